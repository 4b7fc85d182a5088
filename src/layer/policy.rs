//! What the layer does in each case: how long to wait, how to hold, which requests to
//! lock, and how every failure becomes a response ([`Rejection`], [`OnRejection`]).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Response, StatusCode, header};

use super::keys::KeyError;
use crate::backend::LockMode;
use crate::error::Error;
use crate::lock::Lease;

/// How long a request waits for a busy lock by default: 5 s. Long enough for the
/// request ahead of it (usually the same user's double click or retry) to finish, short
/// enough that the client gets an answer well before common 30–60 s client and proxy
/// timeouts.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// The longest wait accepted: 10 minutes. No HTTP client waits longer; a larger value
/// is a unit mix-up.
pub const MAX_WAIT: Duration = Duration::from_secs(10 * 60);

/// The status for a lock still busy when the wait ran out: `429 Too Many Requests`.
///
/// Why not the others: `409 Conflict` is what applications answer for a conflict with
/// the resource's state (a duplicate order, a version mismatch), and a client must not
/// confuse "try again in a moment" with "this cannot succeed"; `423 Locked` says the
/// right thing but is WebDAV's, and neither it nor 409 defines `Retry-After`. 429 is
/// exactly "another request of yours for this key is in flight; retry after
/// `Retry-After`", and HTTP clients and retry middleware already honour it. Change it
/// with [`with_busy_status`](super::LockLayerBuilder::with_busy_status).
pub const DEFAULT_BUSY_STATUS: StatusCode = StatusCode::TOO_MANY_REQUESTS;

/// `Retry-After` when the lock store is unreachable (fail-closed) or a lock was lost:
/// 1 s. Short, because a store outage is either over quickly or long enough that
/// clients back off on their own.
pub const DEFAULT_UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// When a request's lock is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ReleaseOn {
    /// When the inner service's response (its head) is ready: the default. The body is
    /// sent unlocked; right for handlers that build the whole response before returning.
    Response,
    /// When the response body has been sent to the end (or dropped): for streaming
    /// responses whose body does the protected work.
    BodyEnd,
}

/// What happens when a held lock is lost while the inner service is still working on
/// the request (its lease ran out, renewals failed, or it was force-released).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum OnLost {
    /// Drop the inner future — the work stops at its next `.await` — and answer
    /// [`Rejection::Lost`]: the default, because the work is no longer protected.
    Cancel,
    /// Let the inner service finish; the loss is only logged (the lost signal in
    /// [`HeldLock`](crate::extract::HeldLock) still fires for handlers that check it).
    Continue,
}

/// Which kind of lock the layer takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ModeSelect {
    Fixed(LockMode),
    ReadWriteByMethod,
}

impl ModeSelect {
    pub(crate) fn for_method(self, method: &Method) -> LockMode {
        match self {
            ModeSelect::Fixed(mode) => mode,
            ModeSelect::ReadWriteByMethod => {
                if method == Method::GET || method == Method::HEAD || method == Method::OPTIONS {
                    LockMode::Read
                } else {
                    LockMode::Write
                }
            }
        }
    }
}

/// Why the layer answered instead of the inner service. The
/// [rejection handler](OnRejection) turns it into a response.
#[derive(Debug)]
#[non_exhaustive]
pub enum Rejection {
    /// The lock was still held by another request when the wait ran out. Default:
    /// [`DEFAULT_BUSY_STATUS`] with `Retry-After`.
    Busy {
        /// The configured busy status.
        status: StatusCode,
        /// How long the holder's lease still ran, if the store could tell.
        holder_ttl: Option<Duration>,
    },
    /// The key function rejected the request or produced an invalid key. Default: the
    /// error's status (400 unless the extractor says the server is at fault).
    BadKey(KeyError),
    /// The lock store failed (unreachable, timed out, answered nonsense) and the layer
    /// fails closed. Default: `503 Service Unavailable` with `Retry-After`.
    Unavailable {
        /// What failed.
        error: Error,
        /// `Retry-After` to send.
        retry_after: Duration,
    },
    /// The layer is configured for something the backend cannot do (a lock mode it does
    /// not implement). Default: `500 Internal Server Error`; fail-open does not apply.
    Misconfigured(Error),
    /// The lock was lost while the inner service worked, and the layer cancelled it
    /// ([`OnLost::Cancel`]). Default: `503 Service Unavailable` with `Retry-After`.
    Lost {
        /// `Retry-After` to send.
        retry_after: Duration,
    },
}

impl Rejection {
    /// The status the default handler answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            Rejection::Busy { status, .. } => *status,
            Rejection::BadKey(e) => e.status(),
            Rejection::Unavailable { .. } | Rejection::Lost { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Rejection::Misconfigured(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// `Retry-After` in whole seconds, rounded up, at least 1, for the cases where
    /// retrying later can succeed: busy (from the holder's remaining lease, or 1 when
    /// unknown), unavailable and lost. `None` for the others.
    pub fn retry_after_secs(&self) -> Option<u64> {
        let d = match self {
            Rejection::Busy { holder_ttl, .. } => holder_ttl.unwrap_or(Duration::ZERO),
            Rejection::Unavailable { retry_after, .. } | Rejection::Lost { retry_after } => {
                *retry_after
            }
            Rejection::BadKey(_) | Rejection::Misconfigured(_) => return None,
        };
        Some(ceil_secs(d).max(1))
    }

    /// A plain-text description for the client.
    pub fn message(&self) -> String {
        match self {
            Rejection::Busy { .. } => {
                "another request holds the lock for this resource; retry later".to_owned()
            }
            Rejection::BadKey(e) => e.message().to_owned(),
            Rejection::Unavailable { .. } => {
                "the lock service is unavailable; retry later".to_owned()
            }
            Rejection::Misconfigured(e) => format!("lock misconfigured: {e}"),
            Rejection::Lost { .. } => {
                "the lock for this request was lost before it completed; retry later".to_owned()
            }
        }
    }

    /// The default response: [`status`](Rejection::status), a plain-text
    /// [`message`](Rejection::message) and `Retry-After` when
    /// [`retry_after_secs`](Rejection::retry_after_secs) gives one.
    pub fn to_response(&self) -> Response<Bytes> {
        let mut response = Response::new(Bytes::from(self.message()));
        *response.status_mut() = self.status();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/plain; charset=utf-8"),
        );
        if let Some(secs) = self.retry_after_secs() {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// Turns a [`Rejection`] into a response. Implemented for every
/// `Fn(&Rejection) -> Response<Bytes>` closure; the default is
/// [`Rejection::to_response`].
///
/// Keep `Retry-After` (start from [`Rejection::to_response`] and change what you need)
/// so that clients back off correctly.
///
/// ```
/// use bytes::Bytes;
/// use http::{header, HeaderValue, Response};
/// use tower_lock::layer::Rejection;
///
/// // JSON errors, keeping the default status and Retry-After.
/// let json = |r: &Rejection| -> Response<Bytes> {
///     let mut res = r.to_response();
///     let body = format!(r#"{{"error":{:?}}}"#, r.message());
///     *res.body_mut() = Bytes::from(body);
///     res.headers_mut().insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
///     res
/// };
/// # let _ = json;
/// ```
pub trait OnRejection: Send + Sync + 'static {
    /// The response for `rejection`.
    fn on_rejection(&self, rejection: &Rejection) -> Response<Bytes>;
}

impl<F> OnRejection for F
where
    F: Fn(&Rejection) -> Response<Bytes> + Send + Sync + 'static,
{
    fn on_rejection(&self, rejection: &Rejection) -> Response<Bytes> {
        self(rejection)
    }
}

/// The default rejection handler: [`Rejection::to_response`].
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultRejection;

impl OnRejection for DefaultRejection {
    fn on_rejection(&self, rejection: &Rejection) -> Response<Bytes> {
        rejection.to_response()
    }
}

/// The layer's validated configuration.
#[derive(Clone)]
pub(crate) struct Policy {
    pub(crate) wait: Duration,
    pub(crate) lease: Lease,
    pub(crate) busy_status: StatusCode,
    pub(crate) fail_open: bool,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) release_on: ReleaseOn,
    pub(crate) on_lost: OnLost,
    /// `None`: every method is locked.
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) key_prefix: Option<String>,
    pub(crate) mode: ModeSelect,
    /// Whether requests' locks carry fencing tokens.
    pub(crate) fenced: bool,
    pub(crate) on_rejection: Arc<dyn OnRejection>,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            wait: DEFAULT_WAIT,
            lease: Lease::Watchdog,
            busy_status: DEFAULT_BUSY_STATUS,
            fail_open: false,
            unavailable_retry_after: DEFAULT_UNAVAILABLE_RETRY_AFTER,
            release_on: ReleaseOn::Response,
            on_lost: OnLost::Cancel,
            methods: None,
            key_prefix: None,
            mode: ModeSelect::Fixed(LockMode::Exclusive),
            fenced: false,
            on_rejection: Arc::new(DefaultRejection),
        }
    }
}

impl Policy {
    pub(crate) fn locks_method(&self, method: &Method) -> bool {
        self.methods.as_ref().is_none_or(|m| m.contains(method))
    }

    /// Classifies an acquisition error.
    pub(crate) fn rejection_for(&self, error: Error) -> Rejection {
        match error {
            Error::Busy { holder_ttl } => Rejection::Busy {
                status: self.busy_status,
                holder_ttl,
            },
            Error::InvalidKey { .. } => Rejection::BadKey(KeyError::from(error)),
            error if error.is_backend() => Rejection::Unavailable {
                error,
                retry_after: self.unavailable_retry_after,
            },
            error => Rejection::Misconfigured(error),
        }
    }

    pub(crate) fn validate(&self) -> Result<(), Error> {
        if self.wait > MAX_WAIT {
            return Err(Error::invalid_config(
                "wait",
                format!("must be at most {MAX_WAIT:?} (got {:?})", self.wait),
            ));
        }
        if let Lease::Fixed(lease) = self.lease {
            crate::lock::validate_lease("lease", lease)?;
        }
        if !(self.busy_status.is_client_error() || self.busy_status.is_server_error()) {
            return Err(Error::invalid_config(
                "busy_status",
                format!(
                    "must be a 4xx or 5xx status (got {})",
                    self.busy_status.as_u16()
                ),
            ));
        }
        if self.unavailable_retry_after.is_zero() || self.unavailable_retry_after > MAX_WAIT {
            return Err(Error::invalid_config(
                "unavailable_retry_after",
                format!(
                    "must be between 1 ns and {MAX_WAIT:?} (got {:?})",
                    self.unavailable_retry_after
                ),
            ));
        }
        if self.methods.as_ref().is_some_and(Vec::is_empty) {
            return Err(Error::invalid_config(
                "methods",
                "must name at least one method (got none); to lock nothing, do not add the layer",
            ));
        }
        if let Some(prefix) = &self.key_prefix
            && (prefix.is_empty()
                || prefix.contains(['{', '}'])
                || prefix.chars().any(char::is_control)
                || prefix.len() > crate::key::MAX_KEY_LEN / 2)
        {
            return Err(Error::invalid_config(
                "key_prefix",
                format!(
                    "must be 1 to {} bytes without braces or control characters (got {prefix:?})",
                    crate::key::MAX_KEY_LEN / 2
                ),
            ));
        }
        Ok(())
    }
}

impl fmt::Debug for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Policy")
            .field("wait", &self.wait)
            .field("lease", &self.lease)
            .field("busy_status", &self.busy_status)
            .field("fail_open", &self.fail_open)
            .field("release_on", &self.release_on)
            .field("on_lost", &self.on_lost)
            .field("methods", &self.methods)
            .field("key_prefix", &self.key_prefix)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let busy = |ms: Option<u64>| Rejection::Busy {
            status: DEFAULT_BUSY_STATUS,
            holder_ttl: ms.map(Duration::from_millis),
        };
        assert_eq!(busy(Some(1)).retry_after_secs(), Some(1));
        assert_eq!(busy(Some(1000)).retry_after_secs(), Some(1));
        assert_eq!(busy(Some(1001)).retry_after_secs(), Some(2));
        assert_eq!(busy(Some(29_999)).retry_after_secs(), Some(30));
        assert_eq!(busy(Some(0)).retry_after_secs(), Some(1));
        assert_eq!(busy(None).retry_after_secs(), Some(1));
        let res = busy(Some(2500)).to_response();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(res.headers()[header::RETRY_AFTER], "3");
        let bad = Rejection::BadKey(KeyError::new("missing header `x`")).to_response();
        assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
        assert!(bad.headers().get(header::RETRY_AFTER).is_none());
        assert_eq!(bad.body(), "missing header `x`");
    }

    #[test]
    fn read_write_by_method() {
        let m = ModeSelect::ReadWriteByMethod;
        for read in [Method::GET, Method::HEAD, Method::OPTIONS] {
            assert_eq!(m.for_method(&read), LockMode::Read);
        }
        for write in [Method::POST, Method::PUT, Method::PATCH, Method::DELETE] {
            assert_eq!(m.for_method(&write), LockMode::Write);
        }
    }
}
