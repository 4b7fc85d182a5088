//! Tower middleware that locks each request: [`LockLayer`] / [`LockService`].
//!
//! A key function (a [`KeyExtractor`]) looks at each request and names the lock(s) it
//! must hold — the user placing an order, the account being debited, the document being
//! edited — or none. The layer takes them, calls the inner service while holding them,
//! and releases them when the response is ready (or, if configured, when its body has
//! been sent). Requests with the same key run one at a time across every replica that
//! shares the lock store; requests with different keys never wait for each other.
//!
//! - **Waiting happens in the response future.** `poll_ready` only asks the inner
//!   service; `call` clones it, and the lock is taken when the response future is
//!   polled, so a request waiting for one key holds up nothing else.
//! - **One owner per request.** Each request gets a fresh [`Owner`](crate::Owner), made
//!   current around the inner service: a handler that locks the request's key again
//!   re-enters instead of deadlocking, and [`Locks`](crate::extract::Locks) takes more
//!   locks as the same owner. Two requests on one HTTP/2 connection are two owners.
//! - **Several keys** are taken as one [`MultiLock`](crate::kinds::MultiLock): all or
//!   none, in sorted order, so `{a, b}` and `{b, a}` cannot deadlock.
//! - **Every outcome is a response.** Busy after the wait, a bad key, the store down, a
//!   lock lost: each is a distinct [`Rejection`], answered by an overridable handler
//!   ([`LockLayerBuilder::on_rejection`]). The inner service's error type is unchanged.
//!
//! | case | default answer |
//! |---|---|
//! | busy after the wait | [`DEFAULT_BUSY_STATUS`] (429) + `Retry-After` (the holder's remaining lease, rounded up to whole seconds, at least 1) |
//! | key function error, invalid key | 400 (500 when the extractor blames the server), plain text |
//! | lock store failed | 503 + `Retry-After` (fail closed), or pass through unlocked ([`fail_open`](LockLayerBuilder::fail_open)) |
//! | mode the backend does not support | 500 |
//! | lock lost while handling | handler cancelled, 503 + `Retry-After` ([`OnLost`]) |
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use http::HeaderName;
//! use tower_lock::layer::{HeaderKey, LockLayer};
//! use tower_lock::MemoryBackend;
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! // One order at a time per user: `lock:order:{<x-user-id>}`.
//! let layer = LockLayer::builder(
//!     MemoryBackend::new(),
//!     HeaderKey::new(HeaderName::from_static("x-user-id")),
//! )
//! .with_key_prefix("lock:order")
//! .with_wait(Duration::from_secs(2))
//! .build()?;
//!
//! let app = Router::new()
//!     .route("/orders", post(|| async { "created" }))
//!     .layer(layer);
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```
//!
//! A closure is a key function too; it returns anything [`IntoKeys`]:
//!
//! ```
//! use axum::body::Body;
//! use http::Request;
//! use tower_lock::layer::{KeyError, LockLayer};
//! use tower_lock::{LockKey, MemoryBackend};
//!
//! fn account(req: &Request<Body>, header: &str) -> Result<Option<LockKey>, KeyError> {
//!     let Some(value) = req.headers().get(header) else { return Ok(None) };
//!     let value = value.to_str().map_err(|_| KeyError::new("bad account header"))?;
//!     Ok(Some(LockKey::namespaced("account", value)?))
//! }
//!
//! // Transfers lock both accounts, all or none; other requests are not locked.
//! let layer = LockLayer::new(MemoryBackend::new(), |req: &Request<Body>| {
//!     Ok::<_, KeyError>(match (account(req, "x-from")?, account(req, "x-to")?) {
//!         (Some(from), Some(to)) => vec![from, to],
//!         _ => Vec::new(),
//!     })
//! });
//! # let _ = layer;
//! ```
//!
//! # Errors
//!
//! [`LockLayerBuilder::build`] rejects bad configuration with
//! [`Error::InvalidConfig`](crate::Error::InvalidConfig) naming the setting. At run
//! time nothing is an error of the service: every lock outcome is a response (see the
//! table above), and the inner service's errors pass through unchanged.
//!
//! # Cancel safety
//!
//! - Response future dropped while waiting (the client went away): the wait is
//!   abandoned and leaves no waiter; an acquisition in flight is undone.
//! - Dropped while the inner service runs: the inner future is dropped and the locks
//!   are released in a spawned task.
//! - Completed: the locks are released before the response is handed on (the release
//!   runs in a spawned task that the future awaits, so dropping the future then does
//!   not interrupt it), or, with [`hold_until_body_end`](LockLayerBuilder::hold_until_body_end),
//!   the [`LockBody`] releases them when the body ends, or in a spawned task when it is
//!   dropped unfinished.
//!
//! In every case the lease is the last safety net: a lock whose release could not run
//! (the process died, the store was unreachable) is free when its lease ends.

mod body;
mod future;
mod keys;
#[allow(clippy::module_inception)]
mod layer;
mod policy;
mod release;
mod service;

pub use body::LockBody;
pub use future::ResponseFuture;
#[cfg(feature = "axum")]
pub use keys::PathParamKey;
pub use keys::{ExtensionKey, HeaderKey, IntoKeys, KeyError, KeyExtractor};
pub use layer::{LockLayer, LockLayerBuilder};
pub use policy::{
    DEFAULT_BUSY_STATUS, DEFAULT_UNAVAILABLE_RETRY_AFTER, DEFAULT_WAIT, DefaultRejection, MAX_WAIT,
    OnLost, OnRejection, Rejection, ReleaseOn,
};
pub use service::LockService;
