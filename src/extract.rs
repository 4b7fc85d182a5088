//! What a handler behind [`LockLayer`](crate::layer::LockLayer) can see of its locks:
//! [`HeldLock`] (the locks the layer took for this request) and [`Locks`] (take more as
//! the request's owner).
//!
//! The layer puts one [`Locks`] in the request extensions, which carries the
//! [`HeldLock`] once the locks are taken, so any tower service can read them with
//! `req.extensions().get::<Locks>()` and [`Locks::held`] (one extension, not two: each
//! costs the request an allocation). With the `axum` feature both are also axum
//! extractors, and `Option<HeldLock>` works for routes where locking is optional.
//!
//! # Example
//!
//! ```
//! # #[cfg(feature = "axum")]
//! # mod example {
//! use axum::{Router, routing::post};
//! use http::HeaderName;
//! use tower_lock::extract::{HeldLock, Locks};
//! use tower_lock::layer::{HeaderKey, LockLayer};
//! use tower_lock::{LockClient, MemoryBackend};
//!
//! async fn transfer(held: HeldLock, locks: Locks) -> Result<String, String> {
//!     // Re-entering the request's own lock does not wait for itself.
//!     let again = locks.try_lock(held.key()).await.map_err(|e| e.to_string())?;
//!     assert_eq!(again.hold_count(), 2);
//!     let token = held.fencing_token().ok_or("the layer is fenced")?;
//!     Ok(format!("writing with fencing token {token}"))
//! }
//!
//! # pub fn app() -> Result<Router, tower_lock::Error> {
//! let client = LockClient::new(MemoryBackend::new()); // the application's one client
//! let layer = LockLayer::builder(
//!     client.clone(),
//!     HeaderKey::new(HeaderName::from_static("x-account")).namespace("account")?,
//! )
//! .fenced(true)
//! .build()?;
//! let app: Router = Router::new().route("/transfer", post(transfer).route_layer(layer));
//! # Ok(app)
//! # }
//! # }
//! # fn main() {
//! #     #[cfg(feature = "axum")]
//! #     example::app().unwrap();
//! # }
//! ```
//!
//! # Errors
//!
//! Without the layer (or for a request the layer did not lock) the extractors reject
//! with [`MissingLockLayer`]: `500 Internal Server Error` and a message asking whether
//! `LockLayer` is installed on the route. `Option<HeldLock>` and `Option<Locks>` never
//! reject.
//!
//! # Cancel safety
//!
//! The extractors only clone from the request extensions. Locks taken through
//! [`Locks`] are ordinary [`LockGuard`]s: dropping one releases it in a spawned task.
//! The layer's own locks are released by the layer, however the handler ends.

use std::fmt;
use std::time::Duration;

use crate::backend::LockMode;
use crate::error::{ConfigError, Result};
use crate::key::IntoLockKey;
pub use crate::lock::HeldLock;
use crate::lock::{Lease, Lock, LockClient, LockGuard};
use crate::owner::Owner;

/// Takes further locks as the request's owner: a lock the request already holds is
/// re-entered (its hold count goes up) instead of waited for.
///
/// Inside the handler the request's owner is also [current](Owner::current), so plain
/// [`Lock`]s act as it too; `Locks` carries the owner explicitly, which keeps working in
/// tasks the handler spawns.
#[derive(Clone)]
pub struct Locks {
    client: LockClient,
    owner: Owner,
    held: Option<HeldLock>,
}

impl Locks {
    /// Makes the request's `Locks` for `client`, or takes over an outer layer's (its
    /// owner, and its held locks until this layer holds its own) without a second
    /// extension. Returns the request's owner, and whether it was made here: a fresh
    /// owner, never used for a lock before.
    pub(crate) fn attach(extensions: &mut http::Extensions, client: &LockClient) -> (Owner, bool) {
        if let Some(outer) = extensions.get_mut::<Locks>() {
            outer.client = client.clone();
            return (outer.owner.clone(), false);
        }
        let owner = client.new_owner();
        extensions.insert(Locks {
            client: client.clone(),
            owner: owner.clone(),
            held: None,
        });
        (owner, true)
    }

    /// Records the locks the request now holds, for [`Locks::held`] and the
    /// [`HeldLock`] extractor; `keep` keeps an outer layer's record if there is one.
    pub(crate) fn record_held(extensions: &mut http::Extensions, held: HeldLock, keep: bool) {
        if let Some(locks) = extensions.get_mut::<Locks>()
            && !(keep && locks.held.is_some())
        {
            locks.held = Some(held);
        }
    }

    /// The request's owner.
    pub fn owner(&self) -> &Owner {
        &self.owner
    }

    /// The locks the layer holds for this request (the innermost layer's, with nested
    /// layers); `None` before they are taken, or for a request the layer does not lock.
    /// What the [`HeldLock`] extractor gives.
    ///
    /// ```
    /// use tower_lock::extract::{HeldLock, Locks};
    ///
    /// fn fencing_token_of<B>(req: &http::Request<B>) -> Option<u64> {
    ///     let held = req.extensions().get::<Locks>().and_then(Locks::held)?;
    ///     held.fencing_token().map(|t| t.get())
    /// }
    /// # let _ = fencing_token_of::<()>;
    /// ```
    pub fn held(&self) -> Option<&HeldLock> {
        self.held.as_ref()
    }

    /// The layer's client.
    pub fn client(&self) -> &LockClient {
        &self.client
    }

    /// The exclusive lock `key`, acting as the request's owner.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] for a bad key.
    pub fn get_lock(&self, key: impl IntoLockKey) -> Result<Lock, ConfigError> {
        Ok(self.client.get_lock(key)?.with_owner(self.owner.clone()))
    }

    /// The lock `key` in `mode`, acting as the request's owner.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] for a bad key.
    pub fn get_lock_in_mode(
        &self,
        key: impl IntoLockKey,
        mode: LockMode,
    ) -> Result<Lock, ConfigError> {
        Ok(self
            .client
            .lock_in_mode(key, mode)?
            .with_owner(self.owner.clone()))
    }

    /// [`Lock::lock`] on `key`: waits as long as it takes.
    ///
    /// # Errors
    ///
    /// As [`Lock::lock`], and a bad key.
    pub async fn lock(&self, key: impl IntoLockKey) -> Result<LockGuard> {
        self.get_lock(key)?.lock().await
    }

    /// [`Lock::try_lock`] on `key`: one attempt.
    ///
    /// # Errors
    ///
    /// As [`Lock::try_lock`], and a bad key.
    pub async fn try_lock(&self, key: impl IntoLockKey) -> Result<LockGuard> {
        self.get_lock(key)?.try_lock().await
    }

    /// [`Lock::try_lock_for`] on `key`.
    ///
    /// # Errors
    ///
    /// As [`Lock::try_lock_for`], and a bad key.
    pub async fn try_lock_for(
        &self,
        key: impl IntoLockKey,
        wait: Duration,
        lease: impl Into<Lease>,
    ) -> Result<LockGuard> {
        self.get_lock(key)?.try_lock_for(wait, lease).await
    }
}

impl fmt::Debug for Locks {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Locks")
            .field("client", &self.client)
            .field("owner", &self.owner)
            .field("held", &self.held)
            .finish()
    }
}

/// The rejection of [`HeldLock`] and [`Locks`] when the request carries none: `500`
/// with a plain-text message naming the extractor.
#[derive(Clone, Copy, Debug)]
pub struct MissingLockLayer {
    what: &'static str,
}

impl fmt::Display for MissingLockLayer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.what == "HeldLock" {
            f.write_str(
                "this request holds no lock (`HeldLock` is missing): is `LockLayer` installed on this route, and does its key function give this request a key? Use `Option<HeldLock>` where locking is optional",
            )
        } else {
            write!(
                f,
                "`{}` is missing: is `LockLayer` installed on this route?",
                self.what
            )
        }
    }
}

impl std::error::Error for MissingLockLayer {}

#[cfg(feature = "axum")]
mod axum_impls {
    use std::convert::Infallible;

    use axum::extract::{FromRequestParts, OptionalFromRequestParts};
    use axum::response::{IntoResponse, Response};
    use http::StatusCode;
    use http::request::Parts;

    use super::{HeldLock, Locks, MissingLockLayer};

    impl IntoResponse for MissingLockLayer {
        fn into_response(self) -> Response {
            (StatusCode::INTERNAL_SERVER_ERROR, self.to_string()).into_response()
        }
    }

    /// What an extractor takes from the request's [`Locks`].
    trait FromLocks: Sized {
        fn from_locks(locks: &Locks) -> Option<Self>;
    }

    impl FromLocks for Locks {
        fn from_locks(locks: &Locks) -> Option<Self> {
            Some(locks.clone())
        }
    }

    impl FromLocks for HeldLock {
        fn from_locks(locks: &Locks) -> Option<Self> {
            locks.held().cloned()
        }
    }

    fn from_parts<T: FromLocks>(parts: &Parts) -> Option<T> {
        parts.extensions.get::<Locks>().and_then(T::from_locks)
    }

    macro_rules! extension_extractor {
        ($ty:ident) => {
            impl<S: Send + Sync> FromRequestParts<S> for $ty {
                type Rejection = MissingLockLayer;

                async fn from_request_parts(
                    parts: &mut Parts,
                    _state: &S,
                ) -> Result<Self, Self::Rejection> {
                    from_parts(parts).ok_or(MissingLockLayer {
                        what: stringify!($ty),
                    })
                }
            }

            impl<S: Send + Sync> OptionalFromRequestParts<S> for $ty {
                type Rejection = Infallible;

                async fn from_request_parts(
                    parts: &mut Parts,
                    _state: &S,
                ) -> Result<Option<Self>, Self::Rejection> {
                    Ok(from_parts(parts))
                }
            }
        };
    }

    extension_extractor!(HeldLock);
    extension_extractor!(Locks);
}
