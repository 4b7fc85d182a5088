//! What [`LockLayerBuilder`](super::LockLayerBuilder) configures: the layer's validated
//! [`Config`] (private), and the public values of its wait and hold settings,
//! [`DEFAULT_WAIT`], [`MAX_WAIT`], [`ReleaseOn`] and [`OnLost`]. How a failure is
//! answered lives in [`rejection`](super::rejection).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use http::{Method, StatusCode};

use super::keys::KeyError;
use super::rejection::{
    DEFAULT_BUSY_RETRY_AFTER, DEFAULT_BUSY_STATUS, DEFAULT_UNAVAILABLE_RETRY_AFTER,
    DefaultRejection, MAX_RETRY_AFTER, OnRejection, Rejection,
};
use crate::backend::LockMode;
use crate::error::{ConfigError, Error};
use crate::lock::Lease;

/// How long a request waits for a busy lock by default: 5 s. Long enough for the
/// request ahead of it (usually the same user's double click or retry) to finish, short
/// enough that the client gets an answer well before common 30–60 s client and proxy
/// timeouts.
pub const DEFAULT_WAIT: Duration = Duration::from_secs(5);

/// The lease of a request's lock by default: 10 s, renewed every third of it while the
/// request runs ([`Lease::Renewed`]), or the client's watchdog lease if that is
/// shorter. A replica killed while it holds a request's lock (a crash, an OOM kill, a
/// deploy that does not drain) keeps that user out for at most this long, where the
/// client's 30 s watchdog lease would keep them out for half a minute. The price is
/// renewal traffic for requests that hold a lock longer than a third of it: one renewal
/// (batched with the client's others) every 3.3 s instead of every 10 s; requests that
/// finish sooner, most of them, renew nothing either way. Set
/// [`lease`](super::LockLayerBuilder::lease) to [`Lease::Watchdog`] for the client's.
pub const DEFAULT_REQUEST_LEASE: Duration = Duration::from_secs(10);

/// The lease a request's lock is held with by default, in [`LockLayer`](super::LockLayer)
/// and [`IdempotencyLayer`](crate::IdempotencyLayer): renewed by the watchdog, with
/// [`DEFAULT_REQUEST_LEASE`], or the client's watchdog lease if that is shorter.
pub(crate) fn request_lease(client: &crate::LockClient) -> Lease {
    if client.watchdog_lease() <= DEFAULT_REQUEST_LEASE {
        Lease::Watchdog
    } else {
        Lease::Renewed(DEFAULT_REQUEST_LEASE)
    }
}

/// The longest wait accepted: 10 minutes. No HTTP client waits longer; a larger value
/// is a unit mix-up.
pub const MAX_WAIT: Duration = Duration::from_secs(10 * 60);

/// The longest [layer name](super::LockLayerBuilder::name) accepted: 64 bytes. A name
/// is a metric label and a log field that tells a process's layers apart (`orders`,
/// `lock:payment`), not data; a longer one is a mistake.
pub const MAX_LAYER_NAME_LEN: usize = 64;

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

/// The layer's validated configuration.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) wait: Duration,
    pub(crate) lease: Lease,
    pub(crate) busy_status: StatusCode,
    pub(crate) busy_retry_after: Duration,
    pub(crate) fail_open: bool,
    pub(crate) unavailable_retry_after: Duration,
    pub(crate) release_on: ReleaseOn,
    pub(crate) on_lost: OnLost,
    /// `None`: every method is locked.
    pub(crate) methods: Option<Vec<Method>>,
    pub(crate) key_prefix: Option<String>,
    /// `None`: the key prefix names the layer.
    pub(crate) name: Option<String>,
    pub(crate) mode: ModeSelect,
    /// Whether requests' locks carry fencing tokens.
    pub(crate) fenced: bool,
    pub(crate) on_rejection: Arc<dyn OnRejection>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            wait: DEFAULT_WAIT,
            lease: Lease::Watchdog,
            busy_status: DEFAULT_BUSY_STATUS,
            busy_retry_after: DEFAULT_BUSY_RETRY_AFTER,
            fail_open: false,
            unavailable_retry_after: DEFAULT_UNAVAILABLE_RETRY_AFTER,
            release_on: ReleaseOn::Response,
            on_lost: OnLost::Cancel,
            methods: None,
            key_prefix: None,
            name: None,
            mode: ModeSelect::Fixed(LockMode::Exclusive),
            fenced: false,
            on_rejection: Arc::new(DefaultRejection),
        }
    }
}

impl Config {
    /// The layer's name for metrics and logs: the one set, or the key prefix, or `""`.
    pub(crate) fn layer_name(&self) -> &str {
        self.name
            .as_deref()
            .or(self.key_prefix.as_deref())
            .unwrap_or_default()
    }

    pub(crate) fn locks_method(&self, method: &Method) -> bool {
        self.methods.as_ref().is_none_or(|m| m.contains(method))
    }

    /// Classifies an acquisition error: only a store that could not answer is
    /// "unavailable" (and may fail open); anything else the server got wrong is
    /// "misconfigured" and fails closed.
    pub(crate) fn rejection_for(&self, error: Error) -> Rejection {
        match error {
            Error::Busy { holder_ttl } => Rejection::Busy {
                status: self.busy_status,
                holder_ttl,
                retry_after: self.busy_retry_after(holder_ttl),
            },
            Error::Config(ConfigError::InvalidKey { .. }) => {
                Rejection::BadKey(KeyError::from(error))
            }
            error if error.is_unavailable() => Rejection::Unavailable {
                error,
                retry_after: self.unavailable_retry_after,
            },
            error => Rejection::Misconfigured(error),
        }
    }

    /// When a busy request should retry: the configured value, or sooner when the layer
    /// holds with a fixed lease (then the holder's remaining lease is a real bound).
    fn busy_retry_after(&self, holder_ttl: Option<Duration>) -> Duration {
        match (self.lease, holder_ttl) {
            (Lease::Fixed(_), Some(ttl)) => ttl.min(self.busy_retry_after),
            _ => self.busy_retry_after,
        }
    }

    /// Checks every setting, in the builder's order; the error names the first bad one.
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.wait > MAX_WAIT {
            return Err(ConfigError::invalid_setting(
                "max_wait",
                format!("must be at most {MAX_WAIT:?} (got {:?})", self.wait),
            ));
        }
        crate::lock::validate_lease_setting("lease", self.lease)?;
        if !(self.busy_status.is_client_error() || self.busy_status.is_server_error()) {
            return Err(ConfigError::invalid_setting(
                "busy_status",
                format!(
                    "must be a 4xx or 5xx status (got {})",
                    self.busy_status.as_u16()
                ),
            ));
        }
        check_retry_after("busy_retry_after", self.busy_retry_after)?;
        check_retry_after("unavailable_retry_after", self.unavailable_retry_after)?;
        if self.methods.as_ref().is_some_and(Vec::is_empty) {
            return Err(ConfigError::invalid_setting(
                "methods",
                "must name at least one method (got none); to lock nothing, do not add the layer",
            ));
        }
        if let Some(prefix) = &self.key_prefix {
            check_key_prefix(prefix)?;
        }
        match &self.name {
            Some(name) => check_layer_name(name),
            None => Ok(()),
        }
    }
}

/// The layer's name: not empty, at most [`MAX_LAYER_NAME_LEN`] bytes, no control
/// characters (it goes into log lines and metric labels).
pub(crate) fn check_layer_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() || name.len() > MAX_LAYER_NAME_LEN || name.chars().any(char::is_control) {
        return Err(ConfigError::invalid_setting(
            "name",
            format!(
                "must be 1 to {MAX_LAYER_NAME_LEN} bytes without control characters (got {} bytes: {:?})",
                name.len(),
                name.chars().take(MAX_LAYER_NAME_LEN).collect::<String>(),
            ),
        ));
    }
    Ok(())
}

/// A `Retry-After` setting: more than zero, at most [`MAX_RETRY_AFTER`].
pub(crate) fn check_retry_after(
    name: &'static str,
    retry_after: Duration,
) -> Result<(), ConfigError> {
    if retry_after.is_zero() || retry_after > MAX_RETRY_AFTER {
        return Err(ConfigError::invalid_setting(
            name,
            format!("must be between 1 ns and {MAX_RETRY_AFTER:?} (got {retry_after:?})"),
        ));
    }
    Ok(())
}

/// The key prefix: a [`Namespace`](crate::Namespace), and not empty (the layer adds
/// the `:` itself, so an empty prefix would start every key with one; leave it unset
/// for none).
fn check_key_prefix(prefix: &str) -> Result<(), ConfigError> {
    if prefix.is_empty() {
        return Err(ConfigError::invalid_setting(
            "key_prefix",
            "must not be empty; leave it unset for no prefix (got \"\")",
        ));
    }
    crate::namespace::Namespace::for_setting("key_prefix", prefix.to_owned()).map(drop)
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("wait", &self.wait)
            .field("lease", &self.lease)
            .field("busy_status", &self.busy_status)
            .field("fail_open", &self.fail_open)
            .field("release_on", &self.release_on)
            .field("on_lost", &self.on_lost)
            .field("methods", &self.methods)
            .field("key_prefix", &self.key_prefix)
            .field("name", &self.name)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StoreError, StoreErrorKind};

    #[test]
    fn busy_retry_after_uses_the_holders_lease_only_when_fixed_and_sooner() {
        let ttl = Some(Duration::from_secs(29));
        let watchdog = Config::default();
        assert_eq!(watchdog.busy_retry_after(ttl), DEFAULT_BUSY_RETRY_AFTER);
        let fixed = Config {
            lease: Lease::Fixed(Duration::from_millis(300)),
            busy_retry_after: Duration::from_secs(5),
            ..Config::default()
        };
        assert_eq!(
            fixed.busy_retry_after(Some(Duration::from_millis(200))),
            Duration::from_millis(200)
        );
        assert_eq!(
            fixed.busy_retry_after(ttl),
            Duration::from_secs(5),
            "capped"
        );
        assert_eq!(fixed.busy_retry_after(None), Duration::from_secs(5));
    }

    #[test]
    fn a_type_collision_fails_closed_and_an_outage_is_unavailable() {
        let p = Config {
            fail_open: true,
            ..Config::default()
        };
        for misconfigured in [
            Error::store(StoreErrorKind::Unexpected, "?"),
            Error::store(StoreErrorKind::Misconfigured, "permission denied"),
            Error::Config(ConfigError::Unsupported {
                backend: "x",
                what: "fair locks".to_owned(),
            }),
        ] {
            assert!(matches!(
                p.rejection_for(misconfigured),
                Rejection::Misconfigured(_)
            ));
        }
        assert!(matches!(
            p.rejection_for(Error::store(
                StoreErrorKind::Unavailable,
                "connection refused"
            )),
            Rejection::Unavailable { .. }
        ));
        assert!(matches!(
            p.rejection_for(Error::Store(StoreError::new(
                StoreErrorKind::Unavailable,
                crate::backend::redlock::NoQuorum {
                    acquired: 1,
                    needed: 3,
                    total: 5
                }
            ))),
            Rejection::Unavailable { .. }
        ));
    }

    #[test]
    fn the_layer_is_named_by_its_name_or_its_key_prefix() {
        let mut config = Config::default();
        assert_eq!(config.layer_name(), "");
        config.key_prefix = Some("lock:order".to_owned());
        assert_eq!(config.layer_name(), "lock:order");
        config.name = Some("orders".to_owned());
        assert_eq!(config.layer_name(), "orders");
        assert!(config.validate().is_ok());
        for bad in [
            String::new(),
            "a\nb".to_owned(),
            "n".repeat(MAX_LAYER_NAME_LEN + 1),
        ] {
            config.name = Some(bad.clone());
            let error = config.validate().unwrap_err().to_string();
            assert!(error.contains("`name`"), "{bad:?}: {error}");
        }
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
