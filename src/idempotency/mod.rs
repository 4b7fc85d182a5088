//! Replay of retried requests: [`IdempotencyLayer`] runs a request carrying an
//! `Idempotency-Key` once, stores its response, and answers every retry of it with that
//! response, across every replica that shares the lock store.
//!
//! Networks time out and clients retry: without this, a payment or an order runs twice.
//! The client sends a key of its choosing (a UUID) with a `POST` or `PATCH`
//! (draft-ietf-httpapi-idempotency-key-header, Stripe's behaviour); the layer takes a
//! lock on that key, scoped to the caller, the method and the route, and:
//!
//! | case | answer |
//! |---|---|
//! | first request with the key | the handler runs under the key's lock; its response is stored (a final status — below 500 by default, never a "not now" one ([`NEVER_STORED`]) — and a body, sized or streamed, that ends within [`max_stored_body`](IdempotencyLayerBuilder::max_stored_body) and [`max_stored_body_wait`](IdempotencyLayerBuilder::max_stored_body_wait)), then the lock is released; past the caller's [quota](IdempotencyLayerBuilder::max_records_per_scope) of stored responses, `429` |
//! | retry after the first finished, same request | the stored response, byte for byte, with `Idempotent-Replayed: true`; the handler does not run |
//! | retry while the first is in flight | `409 Conflict` + `Retry-After`; or, with [`max_wait`](IdempotencyLayerBuilder::max_wait), wait for the first and replay its response |
//! | the key used before for another request (method, path, query, body) | `422 Unprocessable Content` |
//! | no key | passed through unprotected; `400` with [`required`](IdempotencyLayerBuilder::required) |
//! | a key it cannot use (empty, too long, not visible ASCII, sent twice) | `400`, naming what is wrong, whatever `required` says |
//! | the first answered 5xx (see [`store_if`](IdempotencyLayerBuilder::store_if)) or "not now", its body did not fit, its handler was cancelled, or its lock was lost | nothing stored: the retry runs the handler again |
//! | the lock store cannot answer | `503` + `Retry-After` |
//!
//! Every error is `application/problem+json` (RFC 9457), or what your
//! [`on_rejection`](IdempotencyLayerBuilder::on_rejection) handler answers.
//!
//! # What it promises
//!
//! **At most once per key while its stored response lives** ([`ttl`](IdempotencyLayerBuilder::ttl),
//! 24 h by default): the handler runs at most once for every response stored, because a
//! response is stored only in the same atomic step that checks the request still holds
//! its lock (its fencing token's hold) and then releases it. A request that lost its
//! lock mid-handler (a pause past its lease, a store failover) cannot store over a newer
//! outcome, and its retry runs the handler again.
//!
//! It does **not** make a handler exactly-once by itself: a handler whose lock was lost
//! may still have written before it noticed, and a retry then runs it again. For
//! exactly-once, make the handler's own writes conditional on its lock's fencing token
//! ([`HeldLock::fencing_token`](crate::extract::HeldLock::fencing_token): the layer
//! inserts its lock's for the handler, unless an outer
//! [`LockLayer`](crate::LockLayer) already put its own) or idempotent in the database.
//! See `docs/idempotency.md`.
//!
//! # Example
//!
//! ```no_run
//! use axum::{Router, routing::post};
//! use tower_lock::idempotency::IdempotencyLayer;
//! use tower_lock::layer::ExtensionKey;
//! use tower_lock::{LockClient, MemoryBackend};
//!
//! #[derive(Clone)]
//! struct User(u64); // set by your authentication middleware
//!
//! # #[tokio::main]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let client = LockClient::new(MemoryBackend::new());
//! // Keys are per user: one user can never replay another's response.
//! let idempotent = IdempotencyLayer::new(client, ExtensionKey::new(|u: &User| u.0.to_string()));
//! let app: Router = Router::new().route(
//!     "/orders",
//!     post(|| async { (http::StatusCode::CREATED, "order 1") }).route_layer(idempotent),
//! );
//! # let _ = app;
//! # Ok(())
//! # }
//! ```
//!
//! # Scope
//!
//! The scope extractor (any [`KeyExtractor`](crate::layer::KeyExtractor): an
//! [`ExtensionKey`](crate::layer::ExtensionKey) of your authenticated user, a closure)
//! names the caller. A request it gives no key passes through unprotected; its
//! rejection is answered as it is (`400`, or `500` for a wiring mistake such as a missing
//! extension). The lock key is `<prefix>:{<scope>, <method>, <route>, <key>}`, the route
//! being axum's matched route template when there is one, else the path.
//!
//! # Errors
//!
//! See [`IdempotencyRejection`]: each case has its status, `Retry-After` where a retry
//! makes sense, and a problem `type` that links to the docs.
//!
//! # Cancel safety
//!
//! Dropped while reading the body or taking the lock, the request leaves no lock and no
//! waiter. Dropped while the handler runs, the handler is dropped with it, the lock is
//! released in a spawned task and nothing is stored: a retry runs again. Dropped while
//! storing, the store-and-release step completes in a task.

mod body;
mod key;
mod layer;
mod once;
mod record;
mod rejection;
mod service;

pub use body::IdempotencyBody;
pub use layer::{
    DEFAULT_IN_FLIGHT_RETRY_AFTER, DEFAULT_KEY_PREFIX, DEFAULT_MAX_BODY, DEFAULT_MAX_KEY_LEN,
    DEFAULT_MAX_RECORDS, DEFAULT_MAX_RECORDS_PER_SCOPE, DEFAULT_MAX_STORED_BODY,
    DEFAULT_MAX_STORED_BODY_WAIT, DEFAULT_STORED_HEADERS, DEFAULT_TTL, IDEMPOTENCY_KEY,
    IDEMPOTENT_REPLAYED, IdempotencyLayer, IdempotencyLayerBuilder, MAX_TTL, NEVER_STORED, Replay,
    below_500, stripe,
};
#[cfg(feature = "serde")]
pub use once::Json;
pub use once::{DEFAULT_MAX_RESULT, DEFAULT_RESULT_TTL, Done, Idempotent, IdempotentError, Stored};
pub use record::Fingerprint;
pub use rejection::{
    DEFAULT_PROBLEM_TYPE_BASE, IdempotencyRejection, OnIdempotencyRejection, ProblemJson,
};
pub use service::IdempotencyService;
