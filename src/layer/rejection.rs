//! How the layer answers when it does not call the inner service: [`Rejection`], the
//! handler that turns it into a response ([`OnRejection`]), and the defaults of those
//! answers.

use std::borrow::Cow;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body::Body;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};

use super::keys::KeyError;
use crate::error::{BoxError, Error};
use crate::lock::LayerOutcome;

/// The status for a lock still busy when the wait ran out: `429 Too Many Requests`.
///
/// Why not the others: `409 Conflict` is what applications answer for a conflict with
/// the resource's state (a duplicate order, a version mismatch), and a client must not
/// confuse "try again in a moment" with "this cannot succeed"; `423 Locked` says the
/// right thing but is WebDAV's, and neither it nor 409 defines `Retry-After`. 429 is
/// exactly "another request of yours for this key is in flight; retry after
/// `Retry-After`", and HTTP clients and retry middleware already honour it. Change it
/// with [`busy_status`](super::LockLayerBuilder::busy_status).
pub const DEFAULT_BUSY_STATUS: StatusCode = StatusCode::TOO_MANY_REQUESTS;

/// `Retry-After` when the lock store is unreachable (fail-closed) or a lock was lost:
/// 1 s. Short, because a store outage is either over quickly or long enough that
/// clients back off on their own.
pub const DEFAULT_UNAVAILABLE_RETRY_AFTER: Duration = Duration::from_secs(1);

/// `Retry-After` for a lock still busy after the wait: 1 s. What usually holds a
/// request's lock is the same client's other request (a double click, a retry), which
/// finishes in milliseconds; the holder's remaining lease says nothing about that when
/// the watchdog keeps renewing it (it is ~30 s whatever the holder does). With a fixed
/// lease the holder's remaining lease is used when it is sooner.
pub const DEFAULT_BUSY_RETRY_AFTER: Duration = Duration::from_secs(1);

/// The longest `Retry-After` the layer is configured to send: 1 hour. Longer is a unit
/// mix-up.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(60 * 60);

/// The body of a rejection's response: any body, boxed (what an axum `IntoResponse`
/// produces, or bytes).
pub type RejectionBody = UnsyncBoxBody<Bytes, BoxError>;

/// Boxes `response`'s body into a [`RejectionBody`].
pub(crate) fn boxed_response<B>(response: Response<B>) -> Response<RejectionBody>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    response.map(|body| body.map_err(Into::into).boxed_unsync())
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
        /// How long the holder's lease still ran, if the store could tell. With the
        /// watchdog that is the watchdog lease, renewed while the holder works: not a
        /// bound on when the lock frees up.
        holder_ttl: Option<Duration>,
        /// When retrying makes sense: the configured
        /// [`busy_retry_after`](super::LockLayerBuilder::busy_retry_after), or the
        /// holder's remaining lease when the layer holds with a fixed lease and that is
        /// sooner.
        retry_after: Duration,
    },
    /// The key function rejected the request, or produced an invalid key. Default: the
    /// error's status (400 unless the server is at fault), or the response of the axum
    /// extractor that rejected it.
    BadKey(KeyError),
    /// The lock store could not answer (unreachable, timed out, no quorum) and the layer
    /// fails closed. Default: `503 Service Unavailable` with `Retry-After`.
    Unavailable {
        /// What failed.
        error: Error,
        /// `Retry-After` to send.
        retry_after: Duration,
    },
    /// The layer or the store is misconfigured: a lock mode the backend does not
    /// implement, a key holding another type of data, a reply the crate does not
    /// understand, no tokio runtime. Always fails closed, whatever the fail-open setting.
    /// Default: `500 Internal Server Error` with a generic text (the error is logged, not
    /// sent).
    Misconfigured(Error),
    /// The lock was lost while the inner service worked, and the layer cancelled it
    /// ([`OnLost::Cancel`](super::OnLost::Cancel)). Default: `503 Service Unavailable`
    /// with `Retry-After`.
    Lost {
        /// `Retry-After` to send.
        retry_after: Duration,
    },
}

/// A response extension on every answer of a [`LockLayer`](super::LockLayer) that says
/// "not now" rather than "no": the lock was busy, the store unavailable, or the lock
/// lost while the request worked. The request never ran to its end, so its answer must
/// not stand for it: an [`IdempotencyLayer`](crate::IdempotencyLayer) outside the lock
/// layer never stores a response that carries it, whatever its `store_if` says, and a
/// retry with the same key runs the handler once the lock is free. The layer adds it
/// after [`OnRejection`] made the response, so a custom handler keeps it too.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Transient {
    /// [`Rejection::Busy`].
    Busy,
    /// [`Rejection::Unavailable`].
    Unavailable,
    /// [`Rejection::Lost`].
    Lost,
}

impl Rejection {
    /// What makes this rejection [`Transient`], if it is one: busy, unavailable and
    /// lost are; a bad key and a misconfiguration are answers of their own.
    pub fn transient(&self) -> Option<Transient> {
        match self {
            Rejection::Busy { .. } => Some(Transient::Busy),
            Rejection::Unavailable { .. } => Some(Transient::Unavailable),
            Rejection::Lost { .. } => Some(Transient::Lost),
            Rejection::BadKey(_) | Rejection::Misconfigured(_) => None,
        }
    }

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

    /// How the layer counts this rejection. A key the server could not derive (a
    /// [`KeyError`] with a 5xx status: a missing extension, an axum extractor's 500) is
    /// the server's wiring mistake, counted with the other misconfigurations, never with
    /// the clients' bad keys.
    pub(crate) fn outcome(&self) -> LayerOutcome {
        match self {
            Rejection::Busy { .. } => LayerOutcome::Busy,
            Rejection::BadKey(e) if e.is_server_error() => LayerOutcome::Misconfigured,
            Rejection::BadKey(_) => LayerOutcome::BadKey,
            Rejection::Unavailable { .. } => LayerOutcome::Unavailable,
            Rejection::Misconfigured(_) => LayerOutcome::Misconfigured,
            Rejection::Lost { .. } => LayerOutcome::Lost,
        }
    }

    /// When retrying can succeed: busy, unavailable and lost. `None` for the others.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            Rejection::Busy { retry_after, .. }
            | Rejection::Unavailable { retry_after, .. }
            | Rejection::Lost { retry_after } => Some(*retry_after),
            Rejection::BadKey(_) | Rejection::Misconfigured(_) => None,
        }
    }

    /// [`retry_after`](Rejection::retry_after) in whole seconds, rounded up, at least 1:
    /// the `Retry-After` header's value.
    pub fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after().map(retry_after_secs)
    }

    /// A plain-text description for the client. Server-side errors get a generic text:
    /// what went wrong inside is logged, not sent.
    pub fn message(&self) -> Cow<'static, str> {
        match self {
            Rejection::Busy { .. } => {
                Cow::Borrowed("another request holds the lock for this resource; retry later")
            }
            Rejection::BadKey(e) if e.is_server_error() => Cow::Borrowed(SERVER_FAULT),
            Rejection::BadKey(e) => Cow::Owned(e.message().to_owned()),
            Rejection::Unavailable { .. } => {
                Cow::Borrowed("the lock service is unavailable; retry later")
            }
            Rejection::Misconfigured(_) => Cow::Borrowed(SERVER_FAULT),
            Rejection::Lost { .. } => {
                Cow::Borrowed("the lock for this request was lost before it completed; retry later")
            }
        }
    }

    /// The default response: [`status`](Rejection::status), a plain-text
    /// [`message`](Rejection::message) and `Retry-After` when
    /// [`retry_after_secs`](Rejection::retry_after_secs) gives one; for an extractor's
    /// rejection, the extractor's own response.
    pub fn into_response(mut self) -> Response<RejectionBody> {
        if let Rejection::BadKey(e) = &mut self
            && let Some(response) = e.take_response()
        {
            return response;
        }
        let mut response = Response::new(Full::new(Bytes::from(self.message().into_owned())));
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
        boxed_response(response)
    }
}

/// The text a client gets for a server-side fault.
const SERVER_FAULT: &str = "internal server error: the lock for this request is misconfigured";

fn ceil_secs(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

/// `Retry-After`'s value for `d`: whole seconds, rounded up, at least 1.
pub(crate) fn retry_after_secs(d: Duration) -> u64 {
    ceil_secs(d).max(1)
}

/// Adds `Retry-After: secs` to an error response (4xx or 5xx) a rejection handler wrote
/// without one: clients back off correctly whatever the handler writes, and a handler
/// that sets its own keeps it.
pub(crate) fn keep_retry_after<B>(response: &mut Response<B>, secs: Option<u64>) {
    let status = response.status();
    if let Some(secs) = secs
        && (status.is_client_error() || status.is_server_error())
    {
        response
            .headers_mut()
            .entry(header::RETRY_AFTER)
            .or_insert_with(|| HeaderValue::from(secs));
    }
}

/// A handler's answer to a [`Rejection`]: any axum `IntoResponse` (feature `axum`), or an
/// `http::Response` whose body yields [`Bytes`].
pub trait IntoRejectionResponse {
    /// The response.
    fn into_rejection_response(self) -> Response<RejectionBody>;
}

#[cfg(feature = "axum")]
impl<T: axum::response::IntoResponse> IntoRejectionResponse for T {
    fn into_rejection_response(self) -> Response<RejectionBody> {
        boxed_response(self.into_response())
    }
}

#[cfg(not(feature = "axum"))]
impl<B> IntoRejectionResponse for Response<B>
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    fn into_rejection_response(self) -> Response<RejectionBody> {
        boxed_response(self)
    }
}

/// Turns a [`Rejection`] into a response. Implemented for every
/// `Fn(Rejection) -> impl IntoRejectionResponse` closure — with the `axum` feature,
/// anything `IntoResponse`; the default is [`Rejection::into_response`].
///
/// The layer adds `Retry-After` ([`Rejection::retry_after_secs`]) to an error response
/// (4xx or 5xx) that has none, so clients back off correctly whatever the handler
/// writes; a handler that sets its own keeps it. Keep server-side details out of the
/// body ([`Rejection::message`] does).
///
/// ```
/// # #[cfg(feature = "axum")] {
/// use axum::Json;
/// use axum::response::IntoResponse;
/// use tower_lock::layer::Rejection;
///
/// // JSON errors with the default status (the layer adds Retry-After).
/// let json = |r: Rejection| {
///     let body = Json(serde_json::json!({ "error": r.message() }));
///     (r.status(), body).into_response()
/// };
/// # let _: &dyn tower_lock::layer::OnRejection = &json;
/// # }
/// ```
pub trait OnRejection: Send + Sync + 'static {
    /// The response for `rejection`.
    fn on_rejection(&self, rejection: Rejection) -> Response<RejectionBody>;
}

impl<F, R> OnRejection for F
where
    F: Fn(Rejection) -> R + Send + Sync + 'static,
    R: IntoRejectionResponse,
{
    fn on_rejection(&self, rejection: Rejection) -> Response<RejectionBody> {
        self(rejection).into_rejection_response()
    }
}

/// The default rejection handler: [`Rejection::into_response`].
#[derive(Clone, Copy, Debug, Default)]
pub struct DefaultRejection;

impl OnRejection for DefaultRejection {
    fn on_rejection(&self, rejection: Rejection) -> Response<RejectionBody> {
        rejection.into_response()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn text(res: Response<RejectionBody>) -> String {
        let bytes = res.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8(bytes.to_vec()).unwrap()
    }

    #[test]
    fn retry_after_rounds_up_to_whole_seconds() {
        let busy = |ms: u64| Rejection::Busy {
            status: DEFAULT_BUSY_STATUS,
            holder_ttl: None,
            retry_after: Duration::from_millis(ms),
        };
        assert_eq!(busy(1).retry_after_secs(), Some(1));
        assert_eq!(busy(1000).retry_after_secs(), Some(1));
        assert_eq!(busy(1001).retry_after_secs(), Some(2));
        assert_eq!(busy(0).retry_after_secs(), Some(1));
        let res = busy(2500).into_response();
        assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(res.headers()[header::RETRY_AFTER], "3");
    }

    #[tokio::test]
    async fn server_side_faults_send_no_internal_text() {
        let bad = Rejection::BadKey(KeyError::new("missing header `x`")).into_response();
        assert_eq!(bad.status(), StatusCode::BAD_REQUEST);
        assert!(bad.headers().get(header::RETRY_AFTER).is_none());
        assert_eq!(text(bad).await, "missing header `x`");

        let wiring = Rejection::BadKey(KeyError::server("extension `app::User` missing"));
        let res = wiring.into_response();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!text(res).await.contains("app::User"));

        let res = Rejection::Misconfigured(Error::store(
            crate::StoreErrorKind::Misconfigured,
            "ERR secret detail",
        ))
        .into_response();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(!text(res).await.contains("secret"));
    }
}
