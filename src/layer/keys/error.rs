//! [`KeyError`]: why a request has no key, and how the layer answers that.

use std::borrow::Cow;
use std::fmt;

use http::{Response, StatusCode};

use crate::error::{ConfigError, Error};
use crate::layer::rejection::RejectionBody;

/// Why no key could be derived from a request. The layer answers it through the
/// rejection handler: by default with [`status`](KeyError::status) (400 unless made
/// with [`KeyError::server`]) and, for a 4xx, the plain-text
/// [`message`](KeyError::message).
///
/// The message of a 4xx is sent to the client: say what is wrong with the request. The
/// message of a 5xx (a server-side wiring mistake) is logged, and the client gets a
/// generic text.
pub struct KeyError {
    status: StatusCode,
    message: Cow<'static, str>,
    /// An axum extractor's own rejection, answered as it is.
    response: Option<Box<Response<RejectionBody>>>,
}

impl KeyError {
    /// The request is at fault (a missing or malformed header, ...): `400 Bad Request`.
    pub fn new(message: impl Into<Cow<'static, str>>) -> Self {
        KeyError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            response: None,
        }
    }

    /// The server is at fault (the layer sits where the key's source does not exist,
    /// such as a request extension no middleware sets): `500 Internal Server Error`. The
    /// message is logged, not sent.
    pub fn server(message: impl Into<Cow<'static, str>>) -> Self {
        KeyError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            response: None,
        }
    }

    /// An extractor's rejection, answered with `response` as it is.
    #[cfg(feature = "axum")]
    pub(crate) fn with_response(response: Response<RejectionBody>) -> Self {
        KeyError {
            status: response.status(),
            message: Cow::Borrowed("the request was rejected by the key's extractor"),
            response: Some(Box::new(response)),
        }
    }

    /// The router found no route for the request (a layer added with `Router::layer`
    /// wraps the fallback too): `404 Not Found` with an empty body, as axum answers.
    #[cfg(feature = "axum")]
    pub(crate) fn no_route() -> Self {
        let mut response = Response::new(http_body_util::Empty::new());
        *response.status_mut() = StatusCode::NOT_FOUND;
        KeyError {
            status: StatusCode::NOT_FOUND,
            message: Cow::Borrowed("no route matches this path"),
            response: Some(Box::new(crate::layer::rejection::boxed_response(response))),
        }
    }

    /// The status the default rejection answers with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What is wrong, as plain text.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the server, not the request, is at fault.
    pub fn is_server_error(&self) -> bool {
        self.status.is_server_error()
    }

    pub(crate) fn take_response(&mut self) -> Option<Response<RejectionBody>> {
        self.response.take().map(|r| *r)
    }
}

impl fmt::Debug for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyError")
            .field("status", &self.status)
            .field("message", &self.message)
            .field("response", &self.response.is_some())
            .finish()
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KeyError {}

impl From<ConfigError> for KeyError {
    /// [`ConfigError::InvalidKey`] (the request's value makes no valid key) is a 400
    /// saying why; any other error is the server's: a 500 whose text is logged, not sent.
    fn from(error: ConfigError) -> Self {
        match error {
            ConfigError::InvalidKey { reason } => {
                KeyError::new(format!("invalid lock key: {reason}"))
            }
            other => KeyError::server(other.to_string()),
        }
    }
}

impl From<Error> for KeyError {
    /// A [`ConfigError`] as above; any other error is the server's: a 500 whose text is
    /// logged, not sent.
    fn from(error: Error) -> Self {
        match error {
            Error::Config(error) => KeyError::from(error),
            other => KeyError::server(other.to_string()),
        }
    }
}

impl From<&'static str> for KeyError {
    fn from(message: &'static str) -> Self {
        KeyError::new(message)
    }
}

impl From<String> for KeyError {
    fn from(message: String) -> Self {
        KeyError::new(message)
    }
}
