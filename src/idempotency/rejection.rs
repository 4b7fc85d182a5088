//! How the idempotency layer answers when it neither runs the handler nor replays a
//! response: [`IdempotencyRejection`], answered as `application/problem+json` (RFC
//! 9457) by default, or by a handler of your own ([`OnIdempotencyRejection`]).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::Full;

use crate::error::{ConfigError, Error};
use crate::layer::KeyError;
use crate::layer::rejection::retry_after_secs;
use crate::layer::{IntoRejectionResponse, RejectionBody};
use crate::lock::LayerOutcome;

/// Where each problem `type` is explained by default: this crate's page on idempotency,
/// whose anchors are the problems' names (`#in-flight`, `#mismatch`, ...). Set another
/// with [`problem_type_base`](super::IdempotencyLayerBuilder::problem_type_base).
pub const DEFAULT_PROBLEM_TYPE_BASE: &str =
    "https://github.com/tower-lock/tower-lock/blob/main/docs/idempotency.md";

/// The longest problem type base accepted.
const MAX_TYPE_BASE_LEN: usize = 2048;

/// Why the idempotency layer answered itself.
#[derive(Debug)]
#[non_exhaustive]
pub enum IdempotencyRejection {
    /// Another request with this key is still being handled. Default: `409 Conflict`
    /// with `Retry-After` (the draft's answer).
    InFlight {
        /// `Retry-After` to send.
        retry_after: Duration,
    },
    /// This key was used before for a request with other content (method, path, query
    /// or body). Default: `422 Unprocessable Content`.
    Mismatch,
    /// The request has no usable key and the layer requires one, or its key is
    /// malformed (empty, too long, repeated, not a structured-field string). Default:
    /// `400 Bad Request`, saying what is wrong.
    BadKey {
        /// What is wrong, for the client.
        detail: String,
    },
    /// The scope extractor found no caller for the request: its own rejection (an axum
    /// extractor's response), a `400` for the client's fault, or a `500` for the
    /// server's wiring (a missing request extension).
    Scope(KeyError),
    /// The request's body is larger than the layer reads to fingerprint it. Default:
    /// `413 Content Too Large`.
    BodyTooLarge {
        /// The limit, in bytes.
        limit: usize,
    },
    /// The request's body could not be read. Default: `400 Bad Request`.
    BadBody,
    /// The lock store could not answer. Default: `503 Service Unavailable` with
    /// `Retry-After`.
    Unavailable {
        /// What failed.
        error: Error,
        /// `Retry-After` to send.
        retry_after: Duration,
    },
    /// The lock for this key was lost while the handler ran; the handler was cancelled
    /// and nothing was stored. Default: `503 Service Unavailable` with `Retry-After`.
    Lost {
        /// `Retry-After` to send.
        retry_after: Duration,
    },
    /// The caller has as many stored responses as it may
    /// ([`max_records_per_scope`](super::IdempotencyLayerBuilder::max_records_per_scope));
    /// the handler did not run. Default: `429 Too Many Requests` with `Retry-After`:
    /// when the caller's oldest stored response expires.
    TooManyRecords {
        /// `Retry-After` to send.
        retry_after: Duration,
    },
    /// The layer has as many stored responses as it may, all callers together
    /// ([`max_records`](super::IdempotencyLayerBuilder::max_records)); the handler did
    /// not run. Default: `503 Service Unavailable` with `Retry-After`: when the oldest
    /// expires.
    RecordsFull {
        /// `Retry-After` to send.
        retry_after: Duration,
    },
    /// The server's wiring or the store is at fault (a missing request extension the
    /// scope needs, a corrupt stored response, no tokio runtime). Default: `500`, with
    /// a generic text; the cause is logged.
    Misconfigured(Error),
}

impl IdempotencyRejection {
    /// The status the default handler answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            IdempotencyRejection::InFlight { .. } => StatusCode::CONFLICT,
            IdempotencyRejection::Mismatch => StatusCode::UNPROCESSABLE_ENTITY,
            IdempotencyRejection::BadKey { .. } | IdempotencyRejection::BadBody => {
                StatusCode::BAD_REQUEST
            }
            IdempotencyRejection::Scope(e) => e.status(),
            IdempotencyRejection::BodyTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            IdempotencyRejection::Unavailable { .. }
            | IdempotencyRejection::Lost { .. }
            | IdempotencyRejection::RecordsFull { .. } => StatusCode::SERVICE_UNAVAILABLE,
            IdempotencyRejection::TooManyRecords { .. } => StatusCode::TOO_MANY_REQUESTS,
            IdempotencyRejection::Misconfigured(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// When a retry makes sense, for `Retry-After`: for a request in flight, the store
    /// down, a lock lost, a quota full.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            IdempotencyRejection::InFlight { retry_after }
            | IdempotencyRejection::Unavailable { retry_after, .. }
            | IdempotencyRejection::Lost { retry_after }
            | IdempotencyRejection::TooManyRecords { retry_after }
            | IdempotencyRejection::RecordsFull { retry_after } => Some(*retry_after),
            _ => None,
        }
    }

    /// The problem's `type`: a link to where this crate's docs explain it.
    pub fn problem_type(&self) -> &'static str {
        match self {
            IdempotencyRejection::InFlight { .. } => "#in-flight",
            IdempotencyRejection::Mismatch => "#mismatch",
            IdempotencyRejection::BadKey { .. } => "#bad-key",
            IdempotencyRejection::Scope(e) if e.is_server_error() => "#server-error",
            IdempotencyRejection::Scope(_) => "#scope",
            IdempotencyRejection::BodyTooLarge { .. } => "#body-too-large",
            IdempotencyRejection::BadBody => "#bad-body",
            IdempotencyRejection::Unavailable { .. } => "#unavailable",
            IdempotencyRejection::Lost { .. } => "#lost",
            IdempotencyRejection::TooManyRecords { .. } => "#too-many-records",
            IdempotencyRejection::RecordsFull { .. } => "#records-full",
            IdempotencyRejection::Misconfigured(_) => "#server-error",
        }
    }

    /// The problem's `title`: short, the same for every occurrence.
    pub fn title(&self) -> &'static str {
        match self {
            IdempotencyRejection::InFlight { .. } => {
                "A request with this idempotency key is in progress"
            }
            IdempotencyRejection::Mismatch => "This idempotency key was used for another request",
            IdempotencyRejection::BadKey { .. } => "Bad idempotency key",
            IdempotencyRejection::Scope(e) if e.is_server_error() => "Internal server error",
            IdempotencyRejection::Scope(_) => "Request has no caller for its idempotency key",
            IdempotencyRejection::BodyTooLarge { .. } => "Request body too large",
            IdempotencyRejection::BadBody => "Request body could not be read",
            IdempotencyRejection::Unavailable { .. } => "Service unavailable",
            IdempotencyRejection::Lost { .. } => "Request interrupted",
            IdempotencyRejection::TooManyRecords { .. } => "Too many idempotency keys",
            IdempotencyRejection::RecordsFull { .. } => "Service unavailable",
            IdempotencyRejection::Misconfigured(_) => "Internal server error",
        }
    }

    /// The problem's `detail`, for the client: never a server-side cause.
    pub fn detail(&self) -> String {
        match self {
            IdempotencyRejection::InFlight { .. } => {
                "the first request with this key has not finished; retry after `Retry-After`".into()
            }
            IdempotencyRejection::Mismatch => {
                "a request with another method, path, query or body used this key; use a new key for a new request".into()
            }
            IdempotencyRejection::BadKey { detail } => detail.clone(),
            IdempotencyRejection::Scope(e) if e.is_server_error() => {
                "the server could not handle this idempotency key".into()
            }
            IdempotencyRejection::Scope(e) => e.message().to_owned(),
            IdempotencyRejection::BodyTooLarge { limit } => {
                format!("requests with an idempotency key may carry at most {limit} bytes")
            }
            IdempotencyRejection::BadBody => "the request body ended with an error".into(),
            IdempotencyRejection::Unavailable { .. } => {
                "the store that keeps idempotency keys cannot answer; retry later".into()
            }
            IdempotencyRejection::Lost { .. } => {
                "the request lost its idempotency lock before it completed and nothing was stored; retry with the same key".into()
            }
            IdempotencyRejection::TooManyRecords { .. } => {
                "this caller has as many responses kept for replay as it may; a new key is taken once an older one expires (`Retry-After`)".into()
            }
            IdempotencyRejection::RecordsFull { .. } => {
                "the server keeps as many responses for replay as it may; retry later".into()
            }
            IdempotencyRejection::Misconfigured(_) => {
                "the server could not handle this idempotency key".into()
            }
        }
    }

    pub(crate) fn outcome(&self) -> LayerOutcome {
        match self {
            IdempotencyRejection::InFlight { .. } => LayerOutcome::InFlight,
            IdempotencyRejection::Mismatch => LayerOutcome::Mismatch,
            IdempotencyRejection::Scope(e) if e.is_server_error() => LayerOutcome::Misconfigured,
            IdempotencyRejection::BadKey { .. }
            | IdempotencyRejection::Scope(_)
            | IdempotencyRejection::BodyTooLarge { .. }
            | IdempotencyRejection::BadBody => LayerOutcome::BadKey,
            IdempotencyRejection::Unavailable { .. } => LayerOutcome::Unavailable,
            IdempotencyRejection::Lost { .. } => LayerOutcome::Lost,
            IdempotencyRejection::TooManyRecords { .. }
            | IdempotencyRejection::RecordsFull { .. } => LayerOutcome::OverQuota,
            IdempotencyRejection::Misconfigured(_) => LayerOutcome::Misconfigured,
        }
    }

    /// The default response: an `application/problem+json` body with `type`, `title`,
    /// `status` and `detail`, and `Retry-After` where [`retry_after`](Self::retry_after)
    /// gives one. A scope extractor's own rejection (an axum extractor's response) is
    /// answered as it is.
    pub fn into_problem(self) -> Response<RejectionBody> {
        self.problem(DEFAULT_PROBLEM_TYPE_BASE)
    }

    /// [`into_problem`](Self::into_problem) with `type` links under `base`.
    fn problem(mut self, base: &str) -> Response<RejectionBody> {
        if let IdempotencyRejection::Scope(e) = &mut self
            && let Some(response) = e.take_response()
        {
            return response;
        }
        let status = self.status();
        let body = format!(
            "{{\"type\":{},\"title\":{},\"status\":{},\"detail\":{}}}",
            json_string(&format!("{base}{}", self.problem_type())),
            json_string(self.title()),
            status.as_u16(),
            json_string(&self.detail()),
        );
        let mut response = Response::new(Full::new(Bytes::from(body)));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(secs) = self.retry_after().map(retry_after_secs) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response.into_rejection_response()
    }
}

/// `text` as a JSON string literal.
fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if u32::from(c) < 0x20 => out.push_str(&format!("\\u{:04x}", u32::from(c))),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// Turns an [`IdempotencyRejection`] into a response. Implemented for every
/// `Fn(IdempotencyRejection) -> impl IntoRejectionResponse` closure (with the `axum`
/// feature, anything `IntoResponse`); the default is
/// [`IdempotencyRejection::into_problem`]. The layer adds `Retry-After` to an error
/// response that has none, as [`LockLayer`](crate::LockLayer) does.
pub trait OnIdempotencyRejection: Send + Sync + 'static {
    /// The response for `rejection`.
    fn on_rejection(&self, rejection: IdempotencyRejection) -> Response<RejectionBody>;
}

impl<F, R> OnIdempotencyRejection for F
where
    F: Fn(IdempotencyRejection) -> R + Send + Sync + 'static,
    R: IntoRejectionResponse,
{
    fn on_rejection(&self, rejection: IdempotencyRejection) -> Response<RejectionBody> {
        self(rejection).into_rejection_response()
    }
}

/// The default handler: [`IdempotencyRejection::into_problem`], with `type` links under
/// [`DEFAULT_PROBLEM_TYPE_BASE`] or a base of your own
/// ([`with_type_base`](Self::with_type_base)).
#[derive(Clone, Debug)]
pub struct ProblemJson {
    base: std::sync::Arc<str>,
}

impl Default for ProblemJson {
    fn default() -> Self {
        ProblemJson {
            base: DEFAULT_PROBLEM_TYPE_BASE.into(),
        }
    }
}

impl ProblemJson {
    /// Problems whose `type` is `base` followed by `#` and the problem's name.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`] (`problem_type_base`) when `base` is empty,
    /// longer than 2,048 bytes, or holds whitespace, a control character, `"` or `#`.
    pub fn with_type_base(base: impl Into<String>) -> Result<Self, ConfigError> {
        let base = base.into();
        let bad = |why: &str| {
            Err(ConfigError::invalid_setting(
                "problem_type_base",
                format!("{why} (got {} bytes)", base.len()),
            ))
        };
        if base.is_empty() || base.len() > MAX_TYPE_BASE_LEN {
            return bad("must be 1..=2048 bytes");
        }
        if base
            .chars()
            .any(|c| c.is_whitespace() || c.is_control() || c == '"' || c == '#')
        {
            return bad("must be a URI without whitespace, control characters, `\"` or `#`");
        }
        Ok(ProblemJson { base: base.into() })
    }
}

impl OnIdempotencyRejection for ProblemJson {
    fn on_rejection(&self, rejection: IdempotencyRejection) -> Response<RejectionBody> {
        rejection.problem(&self.base)
    }
}

#[cfg(test)]
mod tests {
    use http_body_util::BodyExt;

    use super::*;

    #[tokio::test]
    async fn problems_are_json_with_type_title_status_and_detail() {
        let res = IdempotencyRejection::BadKey {
            detail: "the `idempotency-key` header is \"empty\"".into(),
        }
        .into_problem();
        assert_eq!(res.status(), StatusCode::BAD_REQUEST);
        assert_eq!(
            res.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let body = res.into_body().collect().await.unwrap().to_bytes();
        let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(json["status"], 400);
        assert_eq!(json["title"], "Bad idempotency key");
        assert_eq!(json["detail"], "the `idempotency-key` header is \"empty\"");
        assert!(
            json["type"]
                .as_str()
                .unwrap()
                .ends_with("docs/idempotency.md#bad-key")
        );

        let res = IdempotencyRejection::InFlight {
            retry_after: Duration::from_millis(1500),
        }
        .into_problem();
        assert_eq!(res.status(), StatusCode::CONFLICT);
        assert_eq!(res.headers()[header::RETRY_AFTER], "2");
    }

    #[tokio::test]
    async fn server_faults_send_no_cause() {
        let res = IdempotencyRejection::Misconfigured(Error::store(
            crate::StoreErrorKind::Misconfigured,
            "ERR secret detail",
        ))
        .into_problem();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
        let body = res.into_body().collect().await.unwrap().to_bytes();
        assert!(!String::from_utf8_lossy(&body).contains("secret"));
    }
}
