//! [`ExtractorKey`] and [`key_from`]: keys a request with any axum extractor (feature
//! `axum`).

use std::marker::PhantomData;

use axum::extract::FromRequestParts;
use axum::response::IntoResponse;
use http::request::Parts;

use super::{Extracted, IntoKeys, KeyError, KeyExtractor};
use crate::backend::BoxFuture;
use crate::layer::rejection::boxed_response;

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
