//! Which lock(s) a request takes: [`KeyExtractor`], [`IntoKeys`], [`KeyError`] and the
//! ready-made extractors.

use std::any::type_name;
use std::borrow::Cow;
use std::fmt;
use std::future::{Future, Ready, ready};
use std::marker::PhantomData;

use http::request::Parts;
use http::{HeaderName, Response, StatusCode};

use super::policy::RejectionBody;
use crate::error::Error;
use crate::key::LockKey;

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

impl From<Error> for KeyError {
    /// [`Error::InvalidKey`] (the request's value makes no valid key) is a 400 saying
    /// why; any other error is the server's: a 500 whose text is logged, not sent.
    fn from(error: Error) -> Self {
        match error {
            Error::InvalidKey { reason } => KeyError::new(format!("invalid lock key: {reason}")),
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

/// A request's lock keys: none (the request is not locked), one, or several. One key,
/// the common case, needs no allocation.
///
/// ```
/// use tower_lock::LockKey;
/// use tower_lock::layer::Keys;
///
/// let one = Keys::from(LockKey::new("order:{42}")?);
/// assert_eq!(one.len(), 1);
/// let two: Keys = vec![LockKey::new("a")?, LockKey::new("b")?].into();
/// assert_eq!(two.as_slice().len(), 2);
/// assert!(Keys::none().is_empty());
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[derive(Clone, Default)]
pub struct Keys {
    repr: KeysRepr,
}

#[derive(Clone, Default)]
enum KeysRepr {
    #[default]
    None,
    One(LockKey),
    Many(Vec<LockKey>),
}

impl Keys {
    /// No keys: the request passes through unlocked.
    pub fn none() -> Self {
        Keys::default()
    }

    /// The keys, in the order given.
    pub fn as_slice(&self) -> &[LockKey] {
        match &self.repr {
            KeysRepr::None => &[],
            KeysRepr::One(key) => std::slice::from_ref(key),
            KeysRepr::Many(keys) => keys,
        }
    }

    /// How many keys.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// No keys: the request is not locked.
    pub fn is_empty(&self) -> bool {
        self.as_slice().is_empty()
    }

    /// The keys, as a vector.
    pub fn into_vec(self) -> Vec<LockKey> {
        match self.repr {
            KeysRepr::None => Vec::new(),
            KeysRepr::One(key) => vec![key],
            KeysRepr::Many(keys) => keys,
        }
    }

    /// The single key, if there is exactly one; else the keys back.
    pub(crate) fn into_one(self) -> Result<LockKey, Keys> {
        match self.repr {
            KeysRepr::One(key) => Ok(key),
            KeysRepr::Many(mut keys) if keys.len() == 1 => keys.pop().ok_or_else(Keys::none),
            repr => Err(Keys { repr }),
        }
    }

    /// Each key through `f`, which may fail.
    pub(crate) fn try_map<E>(
        self,
        mut f: impl FnMut(LockKey) -> Result<LockKey, E>,
    ) -> Result<Keys, E> {
        Ok(Keys {
            repr: match self.repr {
                KeysRepr::None => KeysRepr::None,
                KeysRepr::One(key) => KeysRepr::One(f(key)?),
                KeysRepr::Many(keys) => {
                    KeysRepr::Many(keys.into_iter().map(f).collect::<Result<_, E>>()?)
                }
            },
        })
    }
}

/// Equal when they list the same keys in the same order.
impl PartialEq for Keys {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Keys {}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.as_slice()).finish()
    }
}

impl From<LockKey> for Keys {
    fn from(key: LockKey) -> Self {
        Keys {
            repr: KeysRepr::One(key),
        }
    }
}

impl From<Vec<LockKey>> for Keys {
    fn from(keys: Vec<LockKey>) -> Self {
        Keys {
            repr: if keys.is_empty() {
                KeysRepr::None
            } else {
                KeysRepr::Many(keys)
            },
        }
    }
}

impl FromIterator<LockKey> for Keys {
    fn from_iter<I: IntoIterator<Item = LockKey>>(iter: I) -> Self {
        Keys::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl IntoIterator for Keys {
    type Item = LockKey;
    type IntoIter = std::vec::IntoIter<LockKey>;

    fn into_iter(self) -> Self::IntoIter {
        self.into_vec().into_iter()
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
    fn into_keys(self) -> Result<Keys, KeyError>;
}

impl IntoKeys for Keys {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(self)
    }
}

impl IntoKeys for LockKey {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(Keys::from(self))
    }
}

impl IntoKeys for Vec<LockKey> {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(Keys::from(self))
    }
}

impl<const N: usize> IntoKeys for [LockKey; N] {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(self.into_iter().collect())
    }
}

impl IntoKeys for String {
    fn into_keys(self) -> Result<Keys, KeyError> {
        Ok(Keys::from(LockKey::new(self)?))
    }
}

impl<T: IntoKeys> IntoKeys for Option<T> {
    fn into_keys(self) -> Result<Keys, KeyError> {
        self.map_or_else(|| Ok(Keys::none()), IntoKeys::into_keys)
    }
}

impl<T: IntoKeys, E: Into<KeyError>> IntoKeys for Result<T, E> {
    fn into_keys(self) -> Result<Keys, KeyError> {
        self.map_err(Into::into)?.into_keys()
    }
}

/// What [`KeyExtractor::extract`] hands back: the request head it was given, and the
/// keys (empty: do not lock this request) or why there are none.
pub type Extracted = (Parts, Result<Keys, KeyError>);

/// Derives the lock key(s) of a request from its head — method, URI, headers,
/// extensions — before the layer takes them.
///
/// Ready-made: [`HeaderKey`], [`ExtensionKey`], and with the `axum` feature
/// [`PathParamKey`] and [`key_from`] (any axum extractor: `Path<T>`, `TypedHeader`, your
/// authentication extractor). Any closure `Fn(&Parts) -> impl IntoKeys` is one too;
/// [`key_fn`] lets the closure's argument type be inferred.
///
/// The extractor takes the head and hands it back with the keys, so that one that must
/// await (an axum extractor) can; a synchronous one returns a [`Ready`] future and costs
/// no allocation.
///
/// # Spoofable input
///
/// A key from a header or a path is whatever the client sent. That is fine when the
/// lock only serializes the client's own requests (a client that lies only fails to
/// serialize itself), but not when the key stands for an identity the client must not
/// choose: lock by a user id that authentication established ([`ExtensionKey`], or
/// [`key_from`] with your authentication extractor), not by a header the client fills
/// in. User text should reach a key through [`LockKey::namespaced`] (all ready-made
/// extractors do), so it cannot leave its namespace or break Redis Cluster hash tags.
pub trait KeyExtractor: Send + Sync + 'static {
    /// The future [`extract`](KeyExtractor::extract) returns.
    type Future: Future<Output = Extracted> + Send + 'static;

    /// The keys for the request whose head is `parts`, with `parts` handed back.
    fn extract(&self, parts: Parts) -> Self::Future;
}

impl<F, R> KeyExtractor for F
where
    F: Fn(&Parts) -> R + Send + Sync + 'static,
    R: IntoKeys,
{
    type Future = Ready<Extracted>;

    fn extract(&self, parts: Parts) -> Self::Future {
        let keys = self(&parts).into_keys();
        ready((parts, keys))
    }
}

/// A key function from a closure, with the closure's argument type inferred:
/// `key_fn(|parts| ...)` is `|parts: &http::request::Parts| ...`.
///
/// ```
/// use tower_lock::layer::{key_fn, KeyError, LockLayer};
/// use tower_lock::{LockKey, MemoryBackend};
///
/// // Lock `PUT /docs/<id>` per document; other requests are not locked.
/// let layer = LockLayer::new(
///     MemoryBackend::new(),
///     key_fn(|parts| match parts.uri.path().strip_prefix("/docs/") {
///         Some(id) if parts.method == http::Method::PUT => {
///             Ok::<_, KeyError>(Some(LockKey::namespaced("doc", id)?))
///         }
///         _ => Ok(None),
///     }),
/// );
/// # let _ = layer;
/// ```
pub fn key_fn<F, R>(f: F) -> F
where
    F: Fn(&Parts) -> R + Send + Sync + 'static,
    R: IntoKeys,
{
    f
}

/// Checks a namespace given to an extractor: what [`LockKey::namespaced`] accepts.
fn checked_namespace(namespace: Cow<'static, str>) -> Result<Cow<'static, str>, Error> {
    if namespace.contains(['{', '}']) || namespace.chars().any(char::is_control) {
        return Err(Error::invalid_config(
            "namespace",
            format!("must not contain braces or control characters (got {namespace:?})"),
        ));
    }
    if namespace.len() > crate::MAX_KEY_LEN / 2 {
        return Err(Error::invalid_config(
            "namespace",
            format!(
                "must be at most {} bytes (got {})",
                crate::MAX_KEY_LEN / 2,
                namespace.len()
            ),
        ));
    }
    Ok(namespace)
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
/// let keys = HeaderKey::new(USER).namespace("user")?;
/// # let _ = keys;
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[derive(Clone, Debug)]
pub struct HeaderKey {
    name: HeaderName,
    namespace: Cow<'static, str>,
    optional: bool,
}

impl HeaderKey {
    /// Keys by header `name`, with no namespace of its own (the key is `{<value>}`,
    /// prefixed by the layer's [key prefix](crate::layer::LockLayerBuilder::key_prefix)).
    pub fn new(name: HeaderName) -> Self {
        HeaderKey {
            name,
            namespace: Cow::Borrowed(""),
            optional: false,
        }
    }

    /// Puts the value under `namespace` (`<namespace>:{<value>}`).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming `namespace` when it has braces or control
    /// characters, or is longer than half of [`MAX_KEY_LEN`](crate::MAX_KEY_LEN).
    pub fn namespace(mut self, namespace: impl Into<Cow<'static, str>>) -> Result<Self, Error> {
        self.namespace = checked_namespace(namespace.into())?;
        Ok(self)
    }

    /// A request without the header passes through unlocked instead of being rejected.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    fn keys(&self, parts: &Parts) -> Result<Keys, KeyError> {
        let mut values = parts.headers.get_all(&self.name).iter();
        let Some(value) = values.next() else {
            return if self.optional {
                Ok(Keys::none())
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
        Ok(Keys::from(namespaced(&self.namespace, &what, value)?))
    }
}

impl KeyExtractor for HeaderKey {
    type Future = Ready<Extracted>;

    fn extract(&self, parts: Parts) -> Self::Future {
        let keys = self.keys(&parts);
        ready((parts, keys))
    }
}

/// Keys a request by a value that earlier middleware put in the request extensions —
/// typically the authenticated user's id: `<namespace>:{<f(value)>}`.
///
/// This is an extractor for identities: the value comes from your authentication, not
/// from the client. Authentication must run before `LockLayer` (be added to the router
/// *after* it, as layers wrap what was added before them). With an authentication
/// *extractor* instead of a middleware, use [`key_from`].
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
/// let keys = ExtensionKey::new(|user: &UserId| user.0.to_string()).namespace("user")?;
/// # let _ = keys;
/// # Ok::<(), tower_lock::Error>(())
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
    ///
    /// # Errors
    ///
    /// As [`HeaderKey::namespace`].
    pub fn namespace(mut self, namespace: impl Into<Cow<'static, str>>) -> Result<Self, Error> {
        self.namespace = checked_namespace(namespace.into())?;
        Ok(self)
    }

    /// A request without the extension passes through unlocked instead of being
    /// rejected.
    pub fn optional(mut self) -> Self {
        self.optional = true;
        self
    }

    fn keys(&self, parts: &Parts) -> Result<Keys, KeyError> {
        let Some(value) = parts.extensions.get::<T>() else {
            return if self.optional {
                Ok(Keys::none())
            } else {
                Err(KeyError::server(format!(
                    "request extension `{}` is missing; is the middleware that sets it in front of `LockLayer`?",
                    type_name::<T>()
                )))
            };
        };
        let value = (self.f)(value);
        Ok(Keys::from(namespaced(
            &self.namespace,
            &"request extension",
            value.as_ref(),
        )?))
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

impl<T, F, V> KeyExtractor for ExtensionKey<T, F>
where
    T: Send + Sync + 'static,
    F: Fn(&T) -> V + Send + Sync + 'static,
    V: AsRef<str>,
{
    type Future = Ready<Extracted>;

    fn extract(&self, parts: Parts) -> Self::Future {
        let keys = self.keys(&parts);
        ready((parts, keys))
    }
}

#[cfg(feature = "axum")]
pub use axum_keys::{ExtractorKey, PathParamKey, key_from};

#[cfg(feature = "axum")]
mod axum_keys {
    use std::borrow::Cow;
    use std::marker::PhantomData;

    use axum::extract::FromRequestParts;
    use axum::response::IntoResponse;
    use http::request::Parts;

    use super::{Extracted, IntoKeys, KeyError, KeyExtractor, Keys, checked_namespace, namespaced};
    use crate::backend::BoxFuture;
    use crate::error::Error;
    use crate::layer::policy::boxed_response;

    /// Keys a request with any axum extractor (`Path<T>`, `Query<T>`, `TypedHeader<T>`,
    /// your own authentication extractor...) and a function of its value, made by
    /// [`key_from`]. The extractor's rejection is answered as axum would answer it.
    ///
    /// Extractors that need the router's state take it with
    /// [`with_state`](ExtractorKey::with_state).
    pub struct ExtractorKey<E, F, S = ()> {
        f: F,
        state: S,
        _extractor: PhantomData<fn() -> E>,
    }

    /// Keys from an axum extractor: `key_from(|Path(id): Path<u64>| ...)` runs
    /// `Path<u64>` on the request (put the layer on the handler with
    /// `MethodRouter::route_layer`, where path parameters exist) and locks what the
    /// closure returns (anything [`IntoKeys`]).
    ///
    /// ```
    /// use axum::{Router, extract::Path, routing::post};
    /// use tower_lock::layer::{key_from, LockLayer};
    /// use tower_lock::{LockKey, MemoryBackend};
    ///
    /// let layer = LockLayer::new(
    ///     MemoryBackend::new(),
    ///     key_from(|Path(id): Path<u64>| LockKey::namespaced("account", &id.to_string())),
    /// );
    /// let app: Router =
    ///     Router::new().route("/accounts/{id}/transfers", post(|| async { "ok" }).route_layer(layer));
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    pub fn key_from<E, F, R>(f: F) -> ExtractorKey<E, F>
    where
        E: FromRequestParts<()> + Send + 'static,
        F: Fn(E) -> R + Clone + Send + Sync + 'static,
        R: IntoKeys,
    {
        ExtractorKey {
            f,
            state: (),
            _extractor: PhantomData,
        }
    }

    impl<E, F> ExtractorKey<E, F> {
        /// Runs the extractor with `state` as the router's state, for extractors that
        /// need it (`E: FromRequestParts<S>`).
        pub fn with_state<S>(self, state: S) -> ExtractorKey<E, F, S> {
            ExtractorKey {
                f: self.f,
                state,
                _extractor: PhantomData,
            }
        }
    }

    impl<E, F: Clone, S: Clone> Clone for ExtractorKey<E, F, S> {
        fn clone(&self) -> Self {
            ExtractorKey {
                f: self.f.clone(),
                state: self.state.clone(),
                _extractor: PhantomData,
            }
        }
    }

    impl<E, F, S> std::fmt::Debug for ExtractorKey<E, F, S> {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("ExtractorKey")
                .field("extractor", &std::any::type_name::<E>())
                .finish_non_exhaustive()
        }
    }

    impl<E, F, R, S> KeyExtractor for ExtractorKey<E, F, S>
    where
        E: FromRequestParts<S> + Send + 'static,
        F: Fn(E) -> R + Clone + Send + Sync + 'static,
        R: IntoKeys,
        S: Clone + Send + Sync + 'static,
    {
        type Future = BoxFuture<'static, Extracted>;

        fn extract(&self, mut parts: Parts) -> Self::Future {
            let f = self.f.clone();
            let state = self.state.clone();
            Box::pin(async move {
                let keys = match E::from_request_parts(&mut parts, &state).await {
                    Ok(value) => f(value).into_keys(),
                    Err(rejection) => Err(KeyError::with_response(boxed_response(
                        rejection.into_response(),
                    ))),
                };
                (parts, keys)
            })
        }
    }

    /// Keys a request by an axum path parameter (`/vouchers/{id}` → `id`):
    /// `<namespace>:{<value>}`, percent-decoded as axum decodes it.
    ///
    /// **Put the layer on the handler with `MethodRouter::route_layer`** (or add it with
    /// `Router::route_layer`). The parameters exist only once axum has matched a route.
    /// `Router::layer` also wraps the fallback, which has no parameters, so a request for
    /// an unknown path would get this extractor's 500 instead of axum's 404; and a layer
    /// wrapped around the whole router from outside runs before routing and never sees a
    /// parameter. A route without the named parameter is a 500 too (a wiring bug). For a
    /// typed parameter, use [`key_from`] with `Path<T>`.
    ///
    /// Paths are set by the client: see the warning on [`KeyExtractor`].
    ///
    /// ```
    /// use axum::{Router, routing::post};
    /// use tower_lock::layer::{LockLayer, PathParamKey};
    /// use tower_lock::MemoryBackend;
    ///
    /// let layer = LockLayer::new(MemoryBackend::new(), PathParamKey::new("id").namespace("account")?);
    /// let app: Router =
    ///     Router::new().route("/accounts/{id}/transfers", post(|| async { "ok" }).route_layer(layer));
    /// # Ok::<(), tower_lock::Error>(())
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
    #[derive(Clone, Debug)]
    pub struct PathParamKey {
        name: Cow<'static, str>,
        namespace: Cow<'static, str>,
    }

    impl PathParamKey {
        /// Keys by the path parameter `name`.
        pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
            PathParamKey {
                name: name.into(),
                namespace: Cow::Borrowed(""),
            }
        }

        /// Puts the value under `namespace` (`<namespace>:{<value>}`).
        ///
        /// # Errors
        ///
        /// As [`HeaderKey::namespace`](super::HeaderKey::namespace).
        pub fn namespace(mut self, namespace: impl Into<Cow<'static, str>>) -> Result<Self, Error> {
            self.namespace = checked_namespace(namespace.into())?;
            Ok(self)
        }

        fn no_params(&self) -> KeyError {
            KeyError::server(format!(
                "no path parameters on this request (an unmatched path, or a layer outside routing); put `LockLayer` on the handler with `MethodRouter::route_layer` to key by path parameter `{}`",
                self.name
            ))
        }
    }

    impl KeyExtractor for PathParamKey {
        type Future = BoxFuture<'static, Extracted>;

        fn extract(&self, mut parts: Parts) -> Self::Future {
            use axum::extract::RawPathParams;
            use axum::extract::rejection::RawPathParamsRejection;

            let this = self.clone();
            Box::pin(async move {
                let keys = match RawPathParams::from_request_parts(&mut parts, &()).await {
                    Ok(params) => match params.iter().find(|(name, _)| *name == this.name) {
                        Some((_, value)) => {
                            let what = format!("path parameter `{}`", this.name);
                            namespaced(&this.namespace, &what, value).map(Keys::from)
                        }
                        None if params.iter().next().is_none() => Err(this.no_params()),
                        None => Err(KeyError::server(format!(
                            "this route has no path parameter `{}`",
                            this.name
                        ))),
                    },
                    Err(RawPathParamsRejection::InvalidUtf8InPathParam(_)) => Err(KeyError::new(
                        format!("path parameter `{}` is not valid UTF-8", this.name),
                    )),
                    Err(_) => Err(this.no_params()),
                };
                (parts, keys)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head(headers: &[(&'static str, &'static str)]) -> Parts {
        let mut b = http::Request::builder();
        for (k, v) in headers {
            b = b.header(*k, *v);
        }
        b.body(()).unwrap().into_parts().0
    }

    fn keys_of(k: &impl Fn(&Parts) -> Result<Keys, KeyError>, parts: &Parts) -> Vec<String> {
        k(parts)
            .unwrap()
            .into_iter()
            .map(|k| k.as_str().to_owned())
            .collect()
    }

    const USER: HeaderName = HeaderName::from_static("x-user-id");

    #[test]
    fn header_key_escapes_and_rejects() {
        let keys = HeaderKey::new(USER).namespace("user").unwrap();
        let got = |p: &Parts| keys.keys(p);
        assert_eq!(keys_of(&got, &head(&[("x-user-id", "42")])), ["user:{42}"]);
        assert_eq!(
            keys_of(&got, &head(&[("x-user-id", "a}:x{b")])),
            ["user:{a%7D:x%7Bb}"]
        );

        let missing = keys.keys(&head(&[])).unwrap_err();
        assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
        assert!(missing.message().contains("missing header `x-user-id`"));
        let twice = keys
            .keys(&head(&[("x-user-id", "1"), ("x-user-id", "2")]))
            .unwrap_err();
        assert!(twice.message().contains("more than once"), "{twice}");
        let empty = keys.keys(&head(&[("x-user-id", "")])).unwrap_err();
        assert!(empty.message().contains("empty"), "{empty}");
        let mut long = head(&[]);
        long.headers.insert(USER, "x".repeat(2000).parse().unwrap());
        let long = keys.keys(&long).unwrap_err();
        assert!(long.message().contains("limit"), "{long}");

        assert!(keys.clone().optional().keys(&head(&[])).unwrap().is_empty());
    }

    #[test]
    fn a_bad_namespace_is_refused_when_the_extractor_is_made() {
        for bad in ["a{b", "a}", "x\n"] {
            let err = HeaderKey::new(USER).namespace(bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::InvalidConfig {
                        name: "namespace",
                        ..
                    }
                ),
                "{err}"
            );
            assert!(
                ExtensionKey::new(|u: &UserId| u.0.to_string())
                    .namespace(bad)
                    .is_err()
            );
        }
    }

    #[derive(Clone)]
    struct UserId(u64);

    #[test]
    fn extension_key() {
        let keys = ExtensionKey::new(|u: &UserId| u.0.to_string())
            .namespace("u")
            .unwrap();
        let mut p = head(&[]);
        let missing = keys.keys(&p).unwrap_err();
        assert_eq!(missing.status(), StatusCode::INTERNAL_SERVER_ERROR);
        assert!(missing.is_server_error());
        assert!(missing.message().contains("UserId"), "{missing}");
        p.extensions.insert(UserId(7));
        assert_eq!(keys.keys(&p).unwrap().as_slice()[0].as_str(), "u:{7}");
        assert!(keys.optional().keys(&head(&[])).unwrap().is_empty());
    }

    #[test]
    fn closures_return_anything_into_keys() {
        fn k(s: &str) -> LockKey {
            LockKey::new(s).unwrap()
        }
        fn run(f: impl Fn(&Parts) -> Result<Keys, KeyError>) -> Result<Keys, KeyError> {
            f(&head(&[]))
        }
        assert_eq!(
            run(|p| key_fn(|_| k("a"))(p).into_keys()).unwrap(),
            Keys::from(vec![k("a")])
        );
        assert!(
            run(|p| key_fn(|_| None::<LockKey>)(p).into_keys())
                .unwrap()
                .is_empty()
        );
        assert_eq!(
            run(|p| key_fn(|_| [k("b"), k("a")])(p).into_keys())
                .unwrap()
                .len(),
            2
        );
        let text = run(|p| key_fn(|_| String::from("a{b"))(p).into_keys()).unwrap_err();
        assert_eq!(text.status(), StatusCode::BAD_REQUEST);
        let fails = run(|p| key_fn(|_| Err::<LockKey, _>("no user"))(p).into_keys()).unwrap_err();
        assert_eq!(fails.message(), "no user");
        // Any other error than an invalid key is the server's, and not shown.
        let internal = KeyError::from(Error::WrongType);
        assert!(internal.is_server_error());
    }

    #[tokio::test]
    async fn extract_hands_the_head_back() {
        let keys = HeaderKey::new(USER).namespace("user").unwrap();
        let (parts, got) = keys.extract(head(&[("x-user-id", "9")])).await;
        assert_eq!(got.unwrap().as_slice()[0].as_str(), "user:{9}");
        assert_eq!(parts.headers[USER], "9");
    }
}
