//! Tower middleware that locks each request: [`LockLayer`] / [`LockService`].
//!
//! A key function (a [`KeyExtractor`]) looks at each request's head and names the
//! lock(s) it must hold — the user placing an order, the account being debited, the
//! document being edited — or none. The layer takes them, calls the inner service while
//! holding them, and releases them when the response is ready (or, if configured, before
//! the last byte of its body). Requests with the same key run one at a time across every
//! replica that shares the lock store; requests with different keys never wait for each
//! other.
//!
//! The layer needs a tokio runtime (it takes locks, renews and releases them in tasks);
//! polled elsewhere, a request is answered 500, never a panic.
//!
//! - **Put it on the handler with `MethodRouter::route_layer`** when the key is
//!   route-specific (a header only your order route requires, a path parameter):
//!   `.route("/orders", post(order).route_layer(layer))`. Then unknown paths (404) and
//!   wrong methods (405) are axum's own answers, unlocked. `Router::layer` wraps the
//!   fallback too (a request for an unknown path without the header would get the
//!   layer's 400, not axum's 404; path keys — [`PathParamKey`], `key_from` with `Path` —
//!   answer a path no route matches 404 as axum does); `Router::route_layer` leaves the
//!   404 to axum but, in axum 0.8, wraps a route's 405 answer (which would need the
//!   header and be locked).
//! - **Waiting happens in the response future, before the inner service is asked for
//!   capacity.** [`LockService`] is always ready; a request first takes its lock, then
//!   waits for the inner service's readiness, then calls it. So a request waiting for a
//!   busy key holds no `ConcurrencyLimit` permit, `Buffer` slot or rate-limit token of
//!   the services inside the layer, and holds up nothing else.
//! - **One owner per request.** Each request gets a fresh [`Owner`](crate::Owner), made
//!   current around the inner service: a handler that locks the request's key again
//!   re-enters instead of deadlocking, and [`Locks`](crate::extract::Locks) takes more
//!   locks as the same owner. Two requests on one HTTP/2 connection, or on one task, are
//!   two owners.
//! - **Several keys** are taken as one [`MultiLock`](crate::kinds::MultiLock): all or
//!   none, in sorted order, so `{a, b}` and `{b, a}` cannot deadlock.
//! - **Every outcome is a response.** Busy after the wait, a bad key, the store down, a
//!   misconfiguration, a lock lost: each is a distinct [`Rejection`], answered by an
//!   overridable handler ([`LockLayerBuilder::on_rejection`], anything `IntoResponse`).
//!   The inner service's error type is unchanged.
//!
//! | case | default answer |
//! |---|---|
//! | busy after the wait | [`DEFAULT_BUSY_STATUS`] (429) + `Retry-After`: [`DEFAULT_BUSY_RETRY_AFTER`] (1 s), or the holder's fixed lease when sooner |
//! | the request makes no valid key | 400, saying what is wrong (or the axum extractor's own rejection) |
//! | the server's wiring makes no key (a missing extension, no path parameters) | 500, generic text; the detail is logged |
//! | lock store cannot answer | 503 + `Retry-After` (fail closed), or pass through unlocked ([`fail_open`](LockLayerBuilder::fail_open)) |
//! | misconfiguration (unsupported mode, a key of another type, no runtime) | 500, generic text, whatever the fail-open setting; logged |
//! | lock lost while handling | handler cancelled, 503 + `Retry-After` ([`OnLost`]) |
//!
//! # Example
//!
//! ```no_run
//! use std::time::Duration;
//! use axum::{Router, routing::post};
//! use http::HeaderName;
//! use tower_lock::layer::{HeaderKey, LockLayer};
//! use tower_lock::{LockClient, MemoryBackend};
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = LockClient::new(MemoryBackend::new()); // one per store, shared by clones
//! // One order at a time per user: `lock:order:{<x-user-id>}`.
//! let layer = LockLayer::builder(
//!     client.clone(),
//!     HeaderKey::new(HeaderName::from_static("x-user-id")),
//! )
//! .key_prefix("lock:order")
//! .max_wait(Duration::from_secs(2))
//! .build()?;
//!
//! // On the handler: only `POST /orders` needs the header and is locked.
//! let app = Router::new().route("/orders", post(|| async { "created" }).route_layer(layer));
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:3000").await?;
//! axum::serve(listener, app).await?;
//! # Ok(())
//! # }
//! ```
//!
//! A closure over the request head is a key function too ([`key_fn`] infers its
//! argument's type), returning anything [`IntoKeys`]; and any axum extractor is one with
//! [`key_from`] (feature `axum`):
//!
//! ```
//! use axum::extract::Path;
//! use http::request::Parts;
//! use tower_lock::layer::{key_fn, key_from, KeyError, LockLayer};
//! use tower_lock::{LockClient, LockKey, MemoryBackend};
//!
//! fn account(parts: &Parts, header: &str) -> Result<Option<LockKey>, KeyError> {
//!     let Some(value) = parts.headers.get(header) else { return Ok(None) };
//!     let value = value.to_str().map_err(|_| KeyError::new("bad account header"))?;
//!     Ok(Some(LockKey::namespaced("account", value)?))
//! }
//!
//! let client = LockClient::new(MemoryBackend::new()); // one per store, shared by clones
//! // Transfers lock both accounts, all or none; other requests are not locked.
//! let transfers = LockLayer::new(
//!     client.clone(),
//!     key_fn(|parts| {
//!         Ok::<_, KeyError>(match (account(parts, "x-from")?, account(parts, "x-to")?) {
//!             (Some(from), Some(to)) => vec![from, to],
//!             _ => Vec::new(),
//!         })
//!     }),
//! );
//!
//! // `/orders/{id}` with a typed path parameter; a bad one gets axum's own rejection.
//! let orders = LockLayer::new(
//!     client.clone(),
//!     key_from(|Path(id): Path<u64>| LockKey::namespaced("order", &id.to_string())),
//! );
//! # let _ = (transfers, orders);
//! ```
//!
//! # Logs
//!
//! What an operator must see is logged once, not once per request: a lock store that
//! cannot answer is a WARN at the first request, then at most one line every
//! [`OUTAGE_LOG_INTERVAL`] (10 s) with the count of requests since (fail-closed and
//! fail-open alike); a misconfiguration (a missing request extension, an unsupported
//! mode, a key of another type) is an ERROR once per cause, then DEBUG. Each line
//! carries the layer's [`name`](LockLayerBuilder::name) (`layer=`). Busy requests and
//! clients' bad keys are DEBUG. Every request is counted by the client's observer
//! ([`LayerOutcome`](crate::LayerOutcome), `tower_lock_layer_outcomes_total`).
//!
//! # Errors
//!
//! [`LockLayerBuilder::build`] rejects bad configuration with
//! [`ConfigError::InvalidSetting`](crate::ConfigError::InvalidSetting) naming the setting, and so do
//! the ready-made extractors' `namespace` setters. At run time nothing is an error of
//! the service: every lock outcome is a response (see the table above), and the inner
//! service's errors pass through unchanged.
//!
//! # Cancel safety
//!
//! - Response future dropped while keying or waiting (the client went away): the wait
//!   is abandoned and leaves no waiter; an acquisition in flight is undone.
//! - Dropped while waiting for the inner service's readiness, or while it runs: the
//!   inner future is dropped and the locks are released in a spawned task.
//! - Completed: the locks are released before the response is handed on (the release
//!   runs in a spawned task that the future awaits, so dropping the future then does
//!   not interrupt it), or, with [`ReleaseOn::BodyEnd`], the [`LockBody`] releases them
//!   before yielding the body's last bytes, or in a spawned task when it is dropped
//!   unfinished.
//!
//! In every case the lease is the last safety net: a lock whose release could not run
//! (the process died, the store was unreachable) is free when its lease ends.

mod body;
pub(crate) mod config;
mod future;
mod keys;
#[allow(clippy::module_inception)]
mod layer;
pub(crate) mod rejection;
pub(crate) mod report;
mod request_locks;
mod service;

pub use body::LockBody;
pub use config::{
    DEFAULT_REQUEST_LEASE, DEFAULT_WAIT, MAX_LAYER_NAME_LEN, MAX_WAIT, OnLost, ReleaseOn,
};
pub use future::ResponseFuture;
pub use keys::{
    ExtensionKey, Extracted, HeaderKey, IntoKeys, KeyError, KeyExtractor, Keys, key_fn,
};
#[cfg(feature = "axum")]
pub use keys::{ExtractorKey, PathParamKey, key_from};
pub use layer::{LockLayer, LockLayerBuilder};
pub use rejection::{
    DEFAULT_BUSY_RETRY_AFTER, DEFAULT_BUSY_STATUS, DEFAULT_UNAVAILABLE_RETRY_AFTER,
    DefaultRejection, IntoRejectionResponse, MAX_RETRY_AFTER, OnRejection, Rejection,
    RejectionBody, Transient,
};
pub use report::OUTAGE_LOG_INTERVAL;
pub use service::LockService;
