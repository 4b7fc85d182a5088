//! [`ExtractorKey`] and [`key_from`]: keys a request with any axum extractor (feature
//! `axum`).

use std::marker::PhantomData;

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use http_body_util::BodyExt;

use super::{Extracted, IntoKeys, KeyError, KeyExtractor};
use crate::backend::BoxFuture;
use crate::layer::rejection::boxed_response;

/// Keys a request with any axum extractor (`Path<T>`, `Query<T>`, `TypedHeader<T>`,
/// your own authentication extractor...) and a function of its value, made by
/// [`key_from`]. The extractor's rejection is answered as axum would answer it, except
/// that a server error (a 5xx: the extractor cannot work where the layer is) is a 500
/// with a generic text, its message logged, and a request the router found no route for
/// is a 404, as axum answers it.
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
/// use tower_lock::{LockClient, LockKey, MemoryBackend};
///
/// let client = LockClient::new(MemoryBackend::new()); // the application's one client
/// let layer = LockLayer::new(
///     client.clone(),
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
            let rejected = match E::from_request_parts(&mut parts, &state).await {
                Ok(value) => return (parts, f(value).into_keys()),
                Err(rejection) => rejection.into_response(),
            };
            let error = if no_route_matched(&mut parts).await {
                KeyError::no_route()
            } else {
                rejection_error::<E>(rejected).await
            };
            (parts, Err(error))
        })
    }
}

/// Whether the router found no route for this request: it ran (it sets `OriginalUri`
/// first) and matched no route (no `MatchedPath`), so there are no path parameters. A
/// layer added with `Router::layer` wraps the router's fallback too, and sees such
/// requests; axum answers them 404, and so does the layer. A layer outside the router
/// sees no `OriginalUri`, and its misconfiguration stays a 500.
pub(super) async fn no_route_matched(parts: &mut Parts) -> bool {
    use axum::extract::rejection::RawPathParamsRejection;
    use axum::extract::{MatchedPath, OriginalUri, RawPathParams};

    if parts.extensions.get::<OriginalUri>().is_none()
        || parts.extensions.get::<MatchedPath>().is_some()
    {
        return false;
    }
    match RawPathParams::from_request_parts(parts, &()).await {
        Ok(params) => params.iter().next().is_none(),
        Err(RawPathParamsRejection::MissingPathParams(_)) => true,
        Err(_) => false,
    }
}

/// An extractor's rejection as the layer answers it: as it is for the client's fault
/// (4xx), and for the server's (5xx: a wiring mistake, such as `Path<T>` on a route
/// without parameters) a 500 with the generic text, its own text logged, not sent —
/// axum's internal messages are not for clients.
async fn rejection_error<E>(response: Response) -> KeyError {
    let status = response.status();
    if !status.is_server_error() {
        return KeyError::with_response(boxed_response(response));
    }
    let text = match response.into_body().collect().await {
        Ok(body) => String::from_utf8_lossy(&body.to_bytes()).into_owned(),
        Err(error) => format!("(unreadable: {error})"),
    };
    KeyError::server(format!(
        "the key's extractor `{}` failed with {status}: {text}",
        std::any::type_name::<E>()
    ))
}
