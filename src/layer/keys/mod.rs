//! Which lock(s) a request takes: the [`KeyExtractor`] trait, what a key function
//! returns ([`IntoKeys`], [`Keys`]), why a request has no key ([`KeyError`]), and the
//! ready-made extractors, one per file: [`HeaderKey`], [`ExtensionKey`], and with the
//! `axum` feature [`key_from`] ([`ExtractorKey`]) and [`PathParamKey`].

use std::fmt;
use std::future::{Future, Ready, ready};

use http::request::Parts;

use crate::error::ConfigError;
use crate::key::LockKey;
use crate::namespace::Namespace;

#[cfg(feature = "axum")]
mod axum;
mod error;
mod extension;
mod header;
#[cfg(feature = "axum")]
mod path_param;
mod set;

#[cfg(feature = "axum")]
pub use axum::{ExtractorKey, key_from};
pub use error::KeyError;
pub use extension::ExtensionKey;
pub use header::HeaderKey;
#[cfg(feature = "axum")]
pub use path_param::PathParamKey;
pub use set::{IntoKeys, Keys};

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
/// use tower_lock::{LockClient, LockKey, MemoryBackend};
///
/// let client = LockClient::new(MemoryBackend::new()); // the application's one client
/// // Lock `PUT /docs/<id>` per document; other requests are not locked.
/// let layer = LockLayer::new(
///     client.clone(),
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

fn namespaced(
    namespace: &Namespace,
    what: &dyn fmt::Display,
    value: &str,
) -> Result<LockKey, KeyError> {
    LockKey::in_namespace(namespace, value).map_err(|e| match e {
        ConfigError::InvalidKey { reason } => KeyError::new(format!("{what}: {reason}")),
        other => KeyError::from(other),
    })
}

/// A request head with `headers`, for the extractors' tests.
#[cfg(test)]
fn head(headers: &[(&'static str, &'static str)]) -> Parts {
    let mut b = http::Request::builder();
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(()).unwrap().into_parts().0
}

#[cfg(test)]
mod tests {
    use http::HeaderName;

    use super::*;

    #[derive(Clone)]
    struct UserId(u64);

    const USER: HeaderName = HeaderName::from_static("x-user-id");

    #[test]
    fn a_bad_namespace_is_refused_when_the_extractor_is_made() {
        for bad in ["a{b", "a}", "x\n"] {
            let err = HeaderKey::new(USER).namespace(bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    ConfigError::InvalidSetting {
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
}
