//! Which lock(s) a request takes: [`KeyExtractor`], [`IntoKeys`], [`KeyError`] and the
//! ready-made extractors.

use std::any::type_name;
use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use http::{HeaderName, Request, StatusCode};

use crate::error::Error;
use crate::key::LockKey;

/// Why no key could be derived from a request. The layer answers it with
/// [`status`](KeyError::status) (400 unless made with [`KeyError::server`]) and the
/// plain-text [`message`](KeyError::message), through the rejection handler.
///
/// The message is sent to the client: say what is wrong with the request, and leave
/// server internals out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyError {
    status: StatusCode,
    message: Cow<'static, str>,
}

impl KeyError {
    /// The request is at fault (a missing or malformed header, ...): `400 Bad Request`.
    pub fn new(message: impl Into<Cow<'static, str>>) -> Self {
        KeyError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    /// The server is at fault (the layer sits where the key's source does not exist,
    /// such as a path parameter outside `route_layer`): `500 Internal Server Error`.
    pub fn server(message: impl Into<Cow<'static, str>>) -> Self {
        KeyError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
        }
    }

    /// The status the default rejection answers with.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// What is wrong, as plain text for the client.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for KeyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for KeyError {}

impl From<Error> for KeyError {
    /// [`Error::InvalidKey`] (and anything else) becomes a 400 with the error's text.
    fn from(error: Error) -> Self {
        KeyError::new(error.to_string())
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

/// What a key function may return: the key(s) to lock, nothing (the request passes
/// through unlocked), or an error (the request is rejected).
///
/// | returned | meaning |
/// |---|---|
/// | [`LockKey`], `[LockKey; N]`, `Vec<LockKey>` | lock these (several: all or none, in sorted order) |
/// | `String` | validated with [`LockKey::new`]; invalid text is a 400 |
/// | `None`, an empty `Vec` | no lock for this request |
/// | `Err(e)` | rejected: `e` becomes a [`KeyError`] (400 by default) |
pub trait IntoKeys {
    /// The keys; empty for "no lock".
    ///
    /// # Errors
    ///
    /// A [`KeyError`] when the request cannot be keyed.
    fn into_keys(self) -> Result<Vec<LockKey>, KeyError>;
}

impl IntoKeys for LockKey {
    fn into_keys(self) -> Result<Vec<LockKey>, KeyError> {
        Ok(vec![self])
    }
}

impl IntoKeys for Vec<LockKey> {
    fn into_keys(self) -> Result<Vec<LockKey>, KeyError> {
        Ok(self)
    }
}

impl<const N: usize> IntoKeys for [LockKey; N] {
    fn into_keys(self) -> Result<Vec<LockKey>, KeyError> {
        Ok(self.into())
    }
}

impl IntoKeys for String {
    fn into_keys(self) -> Result<Vec<LockKey>, KeyError> {
        Ok(vec![LockKey::new(self)?])
    }
}

impl<T: IntoKeys> IntoKeys for Option<T> {
    fn into_keys(self) -> Result<Vec<LockKey>, KeyError> {
        self.map_or_else(|| Ok(Vec::new()), IntoKeys::into_keys)
    }
}

impl<T: IntoKeys, E: Into<KeyError>> IntoKeys for Result<T, E> {
    fn into_keys(self) -> Result<Vec<LockKey>, KeyError> {
        self.map_err(Into::into)?.into_keys()
    }
}

/// Derives the lock key(s) of a request.
///
/// Implemented for every `Fn(&Request<B>) -> impl IntoKeys` closure, and by the
/// ready-made [`HeaderKey`], [`ExtensionKey`] and (feature `axum`) [`PathParamKey`].
/// It runs synchronously in [`Service::call`](tower::Service::call), before any waiting,
/// so keep it cheap: read a header, an extension, a path segment.
///
/// # Spoofable input
///
/// A key from a header or a path is whatever the client sent. That is fine when the
/// lock only serializes the client's own requests (a client that lies only fails to
/// serialize itself), but not when the key stands for an identity the client must not
/// choose: lock by a user id that authentication put in the request extensions
/// ([`ExtensionKey`]), not by a header the client fills in. User text should reach a
/// key through [`LockKey::namespaced`] (all ready-made extractors do), so it cannot
/// leave its namespace or break Redis Cluster hash tags.
pub trait KeyExtractor<B>: Send + Sync + 'static {
    /// The keys for `req`; empty when the request is not to be locked.
    ///
    /// # Errors
    ///
    /// A [`KeyError`] rejects the request.
    fn extract(&self, req: &Request<B>) -> Result<Vec<LockKey>, KeyError>;
}

impl<B, F, R> KeyExtractor<B> for F
where
    F: Fn(&Request<B>) -> R + Send + Sync + 'static,
    R: IntoKeys,
{
    fn extract(&self, req: &Request<B>) -> Result<Vec<LockKey>, KeyError> {
        self(req).into_keys()
    }
}

fn namespaced(namespace: &str, what: &dyn fmt::Display, value: &str) -> Result<LockKey, KeyError> {
    LockKey::namespaced(namespace, value).map_err(|e| match e {
        Error::InvalidKey { reason } => KeyError::new(format!("{what}: {reason}")),
        other => KeyError::from(other),
    })
}

/// Keys a request by one header's value: `<namespace>:{<value>}`, escaped with
/// [`LockKey::namespaced`].
///
/// A missing header is a 400 unless the extractor is [`optional`](HeaderKey::optional);
/// a header sent twice, or one that is not visible ASCII, is a 400.
///
/// Headers are set by the client: see the warning on [`KeyExtractor`].
///
/// ```
/// use http::HeaderName;
/// use tower_lock::layer::HeaderKey;
///
/// const USER: HeaderName = HeaderName::from_static("x-user-id");
/// let keys = HeaderKey::new(USER).namespace("user");
/// # let _ = keys;
/// ```
#[derive(Clone, Debug)]
pub struct HeaderKey {
    name: HeaderName,
    namespace: Cow<'static, str>,
    optional: bool,
}

impl HeaderKey {
    /// Keys by header `name`, with no namespace of its own (the key is `{<value>}`,
    /// prefixed by the layer's [key prefix](crate::layer::LockLayerBuilder::with_key_prefix)).
    pub fn new(name: HeaderName) -> Self {
        HeaderKey {
            name,
            namespace: Cow::Borrowed(""),
            optional: false,
        }
    }

    /// Puts the value under `namespace` (`<namespace>:{<value>}`); a namespace with
    /// braces or control characters makes every request a 400.
    pub fn namespace(mut self, namespace: impl Into<Cow<'static, str>>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// A request without the header passes through unlocked instead of being rejected.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

impl<B> KeyExtractor<B> for HeaderKey {
    fn extract(&self, req: &Request<B>) -> Result<Vec<LockKey>, KeyError> {
        let mut values = req.headers().get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return if self.optional {
                Ok(Vec::new())
            } else {
                Err(KeyError::new(format!("missing header `{}`", self.name)))
            };
        };
        if values.next().is_some() {
            return Err(KeyError::new(format!(
                "header `{}` given more than once",
                self.name
            )));
        }
        let value = value
            .to_str()
            .map_err(|_| KeyError::new(format!("header `{}` is not visible ASCII", self.name)))?;
        let what = format!("header `{}`", self.name);
        Ok(vec![namespaced(&self.namespace, &what, value)?])
    }
}

/// Keys a request by a value that earlier middleware put in the request extensions —
/// typically the authenticated user's id: `<namespace>:{<f(value)>}`.
///
/// This is the extractor to use for identities: the value comes from your
/// authentication, not from the client. Authentication must run before `LockLayer`
/// (be added to the router *after* it, as layers wrap what was added before them).
///
/// A missing extension is a 500 (the middleware that sets it is not in front of the
/// layer) unless the extractor is [`optional`](ExtensionKey::optional), in which case
/// the request passes through unlocked.
///
/// ```
/// use tower_lock::layer::ExtensionKey;
///
/// #[derive(Clone)]
/// struct UserId(u64);
///
/// let keys = ExtensionKey::new(|user: &UserId| user.0.to_string()).namespace("user");
/// # let _ = keys;
/// ```
pub struct ExtensionKey<T, F> {
    f: F,
    namespace: Cow<'static, str>,
    optional: bool,
    _value: PhantomData<fn(&T)>,
}

impl<T, F, V> ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> V + Send + Sync + 'static,
    V: AsRef<str>,
{
    /// Keys by `f(extension)`, where the extension of type `T` was inserted by earlier
    /// middleware.
    pub fn new(f: F) -> Self {
        ExtensionKey {
            f,
            namespace: Cow::Borrowed(""),
            optional: false,
            _value: PhantomData,
        }
    }

    /// Puts the value under `namespace` (`<namespace>:{<value>}`).
    pub fn namespace(mut self, namespace: impl Into<Cow<'static, str>>) -> Self {
        self.namespace = namespace.into();
        self
    }

    /// A request without the extension passes through unlocked instead of being
    /// rejected.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }
}

impl<T, F: Clone> Clone for ExtensionKey<T, F> {
    fn clone(&self) -> Self {
        ExtensionKey {
            f: self.f.clone(),
            namespace: self.namespace.clone(),
            optional: self.optional,
            _value: PhantomData,
        }
    }
}

impl<T, F> fmt::Debug for ExtensionKey<T, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ExtensionKey")
            .field("type", &type_name::<T>())
            .field("namespace", &self.namespace)
            .field("optional", &self.optional)
            .finish()
    }
}

impl<B, T, F, V> KeyExtractor<B> for ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> V + Send + Sync + 'static,
    V: AsRef<str>,
{
    fn extract(&self, req: &Request<B>) -> Result<Vec<LockKey>, KeyError> {
        let Some(value) = req.extensions().get::<T>() else {
            return if self.optional {
                Ok(Vec::new())
            } else {
                Err(KeyError::server(format!(
                    "request extension `{}` is missing; is the middleware that sets it in front of `LockLayer`?",
                    type_name::<T>()
                )))
            };
        };
        let value = (self.f)(value);
        Ok(vec![namespaced(
            &self.namespace,
            &"request extension",
            value.as_ref(),
        )?])
    }
}

/// Keys a request by an axum path parameter (`/vouchers/{id}` → `id`):
/// `<namespace>:{<value>}`, percent-decoded as axum decodes it.
///
/// **Add the layer with `Router::route_layer`.** The parameters exist only once axum
/// has matched a route. `Router::layer` also wraps the fallback, which has no
/// parameters, so a request for an unknown path would get this extractor's 500 instead
/// of axum's 404; and a layer wrapped around the whole router from outside runs before
/// routing and never sees a parameter (every request is a 500 saying to use
/// `route_layer`). A route without the named parameter is a 500 too (a wiring bug).
///
/// Paths are set by the client: see the warning on [`KeyExtractor`].
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_lock::layer::{LockLayer, PathParamKey};
/// use tower_lock::MemoryBackend;
///
/// let app: Router = Router::new()
///     .route("/accounts/{id}/transfers", post(|| async { "ok" }))
///     .route_layer(LockLayer::new(MemoryBackend::new(), PathParamKey::new("id").namespace("account")));
/// ```
#[cfg(feature = "axum")]
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Clone, Debug)]
pub struct PathParamKey {
    name: Cow<'static, str>,
    namespace: Cow<'static, str>,
}

#[cfg(feature = "axum")]
impl PathParamKey {
    /// Keys by the path parameter `name`.
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        PathParamKey {
            name: name.into(),
            namespace: Cow::Borrowed(""),
        }
    }

    /// Puts the value under `namespace` (`<namespace>:{<value>}`).
    pub fn namespace(mut self, namespace: impl Into<Cow<'static, str>>) -> Self {
        self.namespace = namespace.into();
        self
    }

    fn no_params(&self) -> KeyError {
        KeyError::server(format!(
            "no path parameters on this request (an unmatched path, or a layer outside routing); add `LockLayer` with `Router::route_layer` to key by path parameter `{}`",
            self.name
        ))
    }
}

#[cfg(feature = "axum")]
impl<B> KeyExtractor<B> for PathParamKey {
    fn extract(&self, req: &Request<B>) -> Result<Vec<LockKey>, KeyError> {
        use axum::extract::{FromRequestParts, RawPathParams};
        use std::future::Future;
        use std::task::{Context, Poll, Waker};

        // axum keeps the matched parameters in a private extension; its public
        // `RawPathParams` extractor reads them from request parts, so hand it a copy of
        // the extensions. The extractor completes on its first poll.
        let (mut parts, ()) = Request::new(()).into_parts();
        parts.extensions = req.extensions().clone();
        let fut = RawPathParams::from_request_parts(&mut parts, &());
        let mut fut = std::pin::pin!(fut);
        let params = match fut.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(Ok(params)) => params,
            Poll::Ready(Err(
                axum::extract::rejection::RawPathParamsRejection::InvalidUtf8InPathParam(_),
            )) => {
                return Err(KeyError::new(format!(
                    "path parameter `{}` is not valid UTF-8",
                    self.name
                )));
            }
            Poll::Ready(Err(_)) | Poll::Pending => return Err(self.no_params()),
        };
        let Some((_, value)) = params.iter().find(|(name, _)| *name == self.name) else {
            if params.iter().next().is_none() {
                return Err(self.no_params());
            }
            return Err(KeyError::server(format!(
                "this route has no path parameter `{}`",
                self.name
            )));
        };
        let what = format!("path parameter `{}`", self.name);
        Ok(vec![namespaced(&self.namespace, &what, value)?])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(headers: &[(&'static str, &'static str)]) -> Request<()> {
        let mut b = Request::builder();
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap()
    }

    const USER: HeaderName = HeaderName::from_static("x-user-id");

    #[test]
    fn header_key_escapes_and_rejects() {
        let keys = HeaderKey::new(USER).namespace("user");
        let got = keys.extract(&req(&[("x-user-id", "42")])).unwrap();
        assert_eq!(got[0].as_str(), "user:{42}");
        let got = keys.extract(&req(&[("x-user-id", "a}:x{b")])).unwrap();
        assert_eq!(got[0].as_str(), "user:{a%7D:x%7Bb}");

        let missing = keys.extract(&req(&[])).unwrap_err();
        assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
        assert!(missing.message().contains("missing header `x-user-id`"));
        let twice = keys
            .extract(&req(&[("x-user-id", "1"), ("x-user-id", "2")]))
            .unwrap_err();
        assert!(twice.message().contains("more than once"), "{twice}");
        let empty = keys.extract(&req(&[("x-user-id", "")])).unwrap_err();
        assert!(empty.message().contains("empty"), "{empty}");
        let long = "x".repeat(2000);
        let mut r = req(&[]);
        r.headers_mut().insert(USER, long.parse().unwrap());
        let long = keys.extract(&r).unwrap_err();
        assert!(long.message().contains("limit"), "{long}");

        assert!(
            keys.clone()
                .optional()
                .extract(&req(&[]))
                .unwrap()
                .is_empty()
        );
    }

    #[derive(Clone)]
    struct UserId(u64);

    #[test]
    fn extension_key() {
        let keys = ExtensionKey::new(|u: &UserId| u.0.to_string()).namespace("u");
        let mut r = req(&[]);
        let missing = keys.extract(&r).unwrap_err();
        assert_eq!(missing.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(missing.message().contains("UserId"), "{missing}");
        r.extensions_mut().insert(UserId(7));
        assert_eq!(keys.extract(&r).unwrap()[0].as_str(), "u:{7}");
        assert!(keys.optional().extract(&req(&[])).unwrap().is_empty());
    }

    #[test]
    fn closures_return_anything_into_keys() {
        fn k(s: &str) -> LockKey {
            LockKey::new(s).unwrap()
        }
        let one = |_: &Request<()>| k("a");
        assert_eq!(one.extract(&req(&[])).unwrap(), vec![k("a")]);
        let none = |_: &Request<()>| None::<LockKey>;
        assert!(none.extract(&req(&[])).unwrap().is_empty());
        let many = |_: &Request<()>| [k("b"), k("a")];
        assert_eq!(many.extract(&req(&[])).unwrap().len(), 2);
        let text = |_: &Request<()>| String::from("a{b");
        assert_eq!(
            text.extract(&req(&[])).unwrap_err().status(),
            StatusCode::BAD_REQUEST
        );
        let fails = |_: &Request<()>| Err::<LockKey, _>("no user");
        assert_eq!(fails.extract(&req(&[])).unwrap_err().message(), "no user");
        let opt_res = |_: &Request<()>| Ok::<_, KeyError>(Some(k("z")));
        assert_eq!(opt_res.extract(&req(&[])).unwrap(), vec![k("z")]);
    }
}
