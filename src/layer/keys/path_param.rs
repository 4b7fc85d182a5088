//! [`PathParamKey`]: keys a request by an axum path parameter (feature `axum`).

use std::borrow::Cow;

use axum::extract::FromRequestParts;
use http::request::Parts;

use super::{Extracted, KeyError, KeyExtractor, Keys, namespaced};
use crate::backend::BoxFuture;
use crate::error::ConfigError;
use crate::namespace::Namespace;

/// Keys a request by an axum path parameter (`/vouchers/{id}` → `id`):
/// `<namespace>:{<value>}`, percent-decoded as axum decodes it.
///
/// **Put the layer on the handler with `MethodRouter::route_layer`** (or add it with
/// `Router::route_layer`). The parameters exist only once axum has matched a route.
/// Under `Router::layer`, which also wraps the router's fallback, a request for a path
/// no route matches is answered `404 Not Found` (empty body), as axum answers it, and a
/// known path with a method it does not serve gets axum's 405 (after the lock); but
/// every route then needs the parameter. A route without the named parameter is a 500
/// (a wiring bug), and so is a layer wrapped around the whole router from outside,
/// which runs before routing and never sees a parameter. For a typed parameter, use
/// [`key_from`](super::key_from) with `Path<T>`.
///
/// Paths are set by the client: see the warning on [`KeyExtractor`].
///
/// ```
/// use axum::{Router, routing::post};
/// use tower_lock::layer::{LockLayer, PathParamKey};
/// use tower_lock::{LockClient, MemoryBackend};
///
/// let client = LockClient::new(MemoryBackend::new()); // the application's one client
/// let layer = LockLayer::new(client.clone(), PathParamKey::new("id").namespace("account")?);
/// let app: Router =
///     Router::new().route("/accounts/{id}/transfers", post(|| async { "ok" }).route_layer(layer));
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[cfg_attr(docsrs, doc(cfg(feature = "axum")))]
#[derive(Clone, Debug)]
pub struct PathParamKey {
    name: Cow<'static, str>,
    namespace: Namespace,
}

impl PathParamKey {
    /// Keys by the path parameter `name`.
    pub fn new(name: impl Into<Cow<'static, str>>) -> Self {
        PathParamKey {
            name: name.into(),
            namespace: Namespace::empty(),
        }
    }

    /// Puts the value under `namespace` (`<namespace>:{<value>}`).
    ///
    /// # Errors
    ///
    /// As [`HeaderKey::namespace`](super::HeaderKey::namespace).
    pub fn namespace(
        mut self,
        namespace: impl Into<Cow<'static, str>>,
    ) -> Result<Self, ConfigError> {
        self.namespace = Namespace::new(namespace)?;
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
                    None if params.iter().next().is_none() => {
                        if super::axum::no_route_matched(&mut parts).await {
                            Err(KeyError::no_route())
                        } else {
                            Err(this.no_params())
                        }
                    }
                    None => Err(KeyError::server(format!(
                        "this route has no path parameter `{}`",
                        this.name
                    ))),
                },
                Err(RawPathParamsRejection::InvalidUtf8InPathParam(_)) => Err(KeyError::new(
                    format!("path parameter `{}` is not valid UTF-8", this.name),
                )),
                Err(_) if super::axum::no_route_matched(&mut parts).await => {
                    Err(KeyError::no_route())
                }
                Err(_) => Err(this.no_params()),
            };
            (parts, keys)
        })
    }
}
