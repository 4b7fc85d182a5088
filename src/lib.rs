//! Redisson-grade distributed locks for tower and axum.
//!
//! Web services run as many replicas, and some requests must not run at the same time:
//! two flash-sale orders of one user, two edits of one document, two transfers from one
//! account. `tower-lock` serializes them across every replica with leased, reentrant,
//! fenced locks, on Redis (wire-compatible with Redisson), PostgreSQL or in memory.
//!
//! # Quick start
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::{LockClient, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! let client = LockClient::new(MemoryBackend::new());
//! let lock = client.get_lock("lock:order:{42}")?;
//!
//! // Wait up to one second; the watchdog keeps the lock while the guard lives.
//! let guard = lock.try_lock_for(Duration::from_secs(1), tower_lock::Lease::Watchdog).await?;
//! assert!(!guard.is_lost());
//! guard.unlock().await?; // reports Error::Lost if the lock was lost meanwhile
//! # Ok(())
//! # }
//! ```
//!
//! # Concepts
//!
//! - A [`LockBackend`](backend::LockBackend) stores lock state: [`MemoryBackend`] in one
//!   process; Redis across processes.
//! - A [`LockClient`] wraps a backend with an identity and a watchdog, and hands out
//!   [`Lock`]s by [`LockKey`].
//! - Locks are held by an [`Owner`]; the same owner re-enters. [`Owner::scope`] makes an
//!   owner current for a future, which is how the middleware gives each request its own.
//! - A [`LockGuard`] is a held lock: its [fencing token](LockGuard::fencing_token), its
//!   [lost signal](LockGuard::lost), and [`unlock`](LockGuard::unlock).
//! - [`LockLayer`] is the tower middleware: it locks each request on the key(s) its
//!   key function derives, as the request's own owner; the [`extract`] module gives
//!   handlers their lock ([`HeldLock`]) and more
//!   ([`Locks`](extract::Locks)).
//! - A [`LockObserver`] on the client feeds your metrics.
//!
//! # The crate, in three layers
//!
//! Each layer uses only the ones above it.
//!
//! 1. **The lock core**, at the root: [`LockClient`], [`Lock`], [`LockGuard`],
//!    [`HeldLock`], [`Lease`], keys ([`LockKey`], [`Namespace`]) and owners
//!    ([`Owner`], [`HoldId`]); the lock kinds built on it in [`kinds`] (read-write,
//!    MultiLock); the errors by phase: [`ConfigError`] (setting up), [`SetupError`]
//!    (connecting a store), [`Error`] (at run time).
//! 2. **The stores**, in [`backend`]: the [`LockBackend`](backend::LockBackend) contract
//!    and its extensions, then [`MemoryBackend`], [`RedisBackend`],
//!    [`PostgresBackend`], [`MySqlBackend`], [`ZooKeeperBackend`] (shared with
//!    Apache Curator) and [`RedLock`](backend::redlock::RedLock); `tower_lock::testing` holds the
//!    conformance suite a store passes (feature `testing`).
//! 3. **The HTTP layers**: [`layer`] ([`LockLayer`]), [`extract`] (the axum
//!    extractors) and [`idempotency`] ([`IdempotencyLayer`]).
//!
//! # The one rule
//!
//! **A guard's release only ever affects the hold that guard created, and a lost guard
//! stays lost.** Every acquisition that reaches the store takes a *hold* under an
//! identity of its own, a [`HoldId`] `<client uuid>:<n>` ([`LockGuard::hold_id`]), that
//! no other hold ever uses — not a later hold of the same [`Owner`], not a hold of another kind on the
//! same name. The owner only decides, in the [`LockClient`], which guards share a hold
//! (re-entry). So:
//!
//! - a release, a renewal or the compensation of a cancelled attempt names one hold and
//!   can only change that hold, however late it reaches the store;
//! - only a hold's last guard releases it; re-entering adds a guard without the store;
//! - a hold that ended — released, found gone, or past its last confirmed lease by the
//!   client's own clock — is never re-entered or brought back: the owner's next lock is
//!   a new hold, and the old guards report [`Error::Lost`];
//! - a hold is believed from *before* the request that granted or renewed it was sent,
//!   for its lease less the backend's [drift allowance](backend::StoreProfile::clock_drift),
//!   so no guard believes in a hold the store has already let go of (on one machine's
//!   clock rate).
//!
//! # Safety of distributed locks
//!
//! A Redis lock is a *lease*. The store frees it when the lease ends, whatever the holder
//! is doing; that is what makes a crashed holder harmless, and it is also why a holder
//! that stalls (a long GC or VM pause, a SIGSTOP, a blocked thread) can wake up after its
//! lease ended and another owner took the lock. No lock service can prevent that on its
//! own. What this crate gives you to cope:
//!
//! - **Fencing tokens**: every acquisition of a fenced lock
//!   ([`LockClient::get_fenced_lock`], [`Lock::fenced`]) gets a token strictly greater
//!   than every earlier holder's. Have the storage you protect remember the highest token
//!   it has accepted and reject writes with lower ones; then a stale holder's writes fail
//!   instead of corrupting data. [`FencingToken`] says exactly what is promised, across
//!   store restarts and for shared (read, permit) holds.
//! - **The lost signal** fires as soon as the watchdog learns the lock is gone (or could
//!   not renew it before the lease ended): stop work that is no longer protected.
//! - **`unlock` reports loss** ([`Error::Lost`]) instead of silently succeeding.
//!
//! Redis replication is asynchronous: a primary that fails over before replicating a lock
//! can let a second owner in. Replica acknowledgement (`WAIT` after every grant, the
//! default behind Sentinel) closes that window for grants a client saw, though `WAIT`
//! is not consensus. RedLock (a majority of independent nodes) narrows that
//! window but still assumes bounded clock drift and pauses shorter than the lease; it
//! gives no fencing guarantee across nodes. Use fencing tokens where correctness matters.
//!
//! # Cancel safety and faults in transit
//!
//! A lock call can be cancelled at any await point, a write can reach the store late
//! (a retransmission, a connection the client replaced), twice, or never, and a future
//! can be parked forever. The rules the crate keeps, and what each store needs for them:
//!
//! - **A given-up attempt can never take a lock later.** Every acquisition carries a
//!   deadline on the store's clock, one response timeout after it is sent; the store
//!   refuses it once that has passed (Redis: the scripts read `TIME`; PostgreSQL:
//!   `clock_timestamp()`), so a reply that timed out leaves nothing that could still
//!   land. The client maps its clock to the store's from a sample, as a lower bound
//!   network delays cannot break; the store's clock must not step back. An attempt
//!   cancelled or failed before its answer is *given up* with
//!   [`LockBackend::abandon`](backend::LockBackend::abandon): whatever it took is
//!   released at once, and once more after its deadline on Redis (PostgreSQL also records
//!   the owner as gone). Its hold identity is never used again: a wait goes on under a new
//!   one, so no release ever races an attempt of its own identity. Memory answers in the
//!   call itself.
//! - **Leases only move later** (see Durability below), so no reordered renewal, re-entry
//!   or MultiLock pin ends a lease before a guard's belief.
//! - **No operation depends on its caller being polled.** Redis operations are sent by a
//!   task of the backend's, renewals by the watchdog's, releases from `Drop` by a spawned
//!   task; a parked or leaked future costs only itself (a lock it was granted but never
//!   saw stays until its lease, or until the future is dropped and gives it up).
//! - **Renewals outlive the runtime that re-entered a hold**: a watched hold is renewed
//!   while any runtime that took or re-entered it lives.
//! - **A connection that broke under an attempt** (a store restarted while the connection
//!   was idle) costs no caller an error: the attempt is tried once more, at once, as a
//!   new hold. **Any outage with time left to wait** (timeouts, refused connections, a
//!   failover, a server reading its data back, no quorum) is ridden out within the wait,
//!   with backoff, each try a new hold; a wait that ends in it fails as the outage. A
//!   call without a wait (`try_lock`) or without a deadline (`lock`) still fails fast.
//! - **A release that gets no answer** (a connection cut, a store failing over) fails
//!   its unlock as an outage and is tried again in the background, with backoff, until
//!   the store answers or the hold's lease ends: the lock is free soon after the store
//!   is back, not when the lease runs out. So is the taking back of an attempt that got
//!   no answer.
//! - **A hold the watchdog gives up is released in the store.** Renewals whose answers
//!   were lost (a one-way partition, a store answering too slowly) may have reached the
//!   store; the guard is told its hold is lost when its lease runs out by the client's
//!   clock, and the hold is released there at once (tried again while the store cannot
//!   be reached), not left for up to a lease more, whether or not the guard lives on.
//!
//! What is left when the store stays unreachable: a hold until its lease ends, a place
//! in a fair or read-write queue until the waiter timeout. Each
//! rule is a test against real servers through a fault-injecting proxy
//! (`tests/it/transit_faults.rs`), and the history checker runs with that proxy as a
//! nemesis.
//!
//! # Durability
//!
//! A lease only ever moves later in the store: every renewal, re-entry and partial
//! release writes the later of the current and the requested end, computed by the store,
//! so no reordering of them can end a lease before a guard's belief. A grant or renewal
//! the client was told about must also survive a crash of the store, or after the
//! restart a second owner is granted a lock the first still believes it holds. What each
//! backend needs from its store for that:
//!
//! - **PostgreSQL**: synchronous commit of grants and renewals. The backend's functions
//!   force it for their own transaction when a session runs `synchronous_commit = off`,
//!   so a pool tuned for speed keeps the promise. Releases commit asynchronously: one
//!   lost in a crash leaves the hold until its lease ends, never a second holder. A
//!   failover keeps only what the standby had: synchronous replication keeps every
//!   grant. See `docs/postgres.md`.
//! - **Redis**: a single server keeps every grant across a crash only with AOF and
//!   `appendfsync always`. With `appendfsync everysec` the last second or so of grants
//!   can be lost, and with RDB snapshots alone or no persistence every grant since the
//!   last snapshot. A failover keeps a grant only if the replica had it: with replica
//!   acknowledgement (`RedisBackendBuilder::synced_replicas`, the default behind
//!   Sentinel) every grant a client saw had reached that many replicas; without it, a
//!   grant is as durable as Redis' asynchronous replication. Fencing tokens still
//!   increase across such a loss.
//! - **ZooKeeper**: the ensemble acknowledges a write once a quorum logged it (synced
//!   to disk with its default `forceSync=yes`), so a grant survives the crash of any
//!   minority of servers. What ends a hold there is its session: when it expires (or
//!   the client gives it up, a third of the session timeout after its connection
//!   dropped), the holder's guards are lost at once. See `docs/zookeeper.md`.
//! - **Memory**: the store is the process; it ends with its holders.
//! - **RedLock**: a grant survives while a majority of nodes keep it; a node that
//!   restarts without its grants should stay out for longer than the longest lease
//!   (see [`RedLock`](backend::redlock::RedLock)).

#![warn(missing_docs, rust_2018_idioms)]
#![deny(unreachable_pub, unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
mod error;
pub mod extract;
mod hold_id;
pub mod idempotency;
mod key;
pub mod kinds;
pub mod layer;
mod lock;
mod log_limit;
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;
mod namespace;
mod owner;
mod scratch;
#[cfg(feature = "testing")]
#[cfg_attr(docsrs, doc(cfg(feature = "testing")))]
pub mod testing;

pub use backend::limits::{DEFAULT_WATCHDOG_LEASE, MAX_LEASE, MIN_LEASE, MIN_WATCHDOG_LEASE};
pub use backend::memory::MemoryBackend;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub use backend::mysql::MySqlBackend;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use backend::postgres::PostgresBackend;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub use backend::redis::RedisBackend;
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub use backend::zookeeper::ZooKeeperBackend;
pub use backend::{FencingToken, HoldInfo, LockMode, LockState, WaiterScope, Waiters};
pub use error::{BoxError, ConfigError, Error, Result, SetupError, StoreError, StoreErrorKind};
pub use hold_id::HoldId;
pub use idempotency::IdempotencyLayer;
pub use key::{IntoLockKey, LockKey, MAX_KEY_LEN, RESERVED_PREFIXES};
pub use layer::LockLayer;
pub use lock::{
    CLIENT_NAME_TTL, DEFAULT_OUTAGE_GRACE, HeldLock, LayerEvent, LayerKind, LayerOutcome, Lease,
    Lock, LockClient, LockClientBuilder, LockEvent, LockGuard, LockObserver, LostSignal,
    MAX_CLIENT_NAME_LEN, NotStoredReason,
};
pub use namespace::{MAX_NAMESPACE_LEN, Namespace};
pub use owner::{MAX_OWNER_LEN, Owner};

/// The README's examples, compiled and run as doc tests.
#[cfg(all(doctest, feature = "redis", feature = "axum"))]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The examples in `docs/`, compiled and run as doc tests, so they cannot go stale.
#[cfg(all(doctest, feature = "redis", feature = "axum"))]
#[doc = include_str!("../docs/lock-kinds.md")]
pub struct LockKindsDoctests;

#[cfg(all(doctest, feature = "redis", feature = "axum"))]
#[doc = include_str!("../docs/redis.md")]
pub struct RedisDoctests;

#[cfg(all(doctest, feature = "redis", feature = "axum"))]
#[doc = include_str!("../docs/redlock.md")]
pub struct RedlockDoctests;

#[cfg(all(doctest, feature = "axum"))]
#[doc = include_str!("../docs/idempotency.md")]
pub struct IdempotencyDoctests;

#[cfg(all(doctest, feature = "redis", feature = "axum", feature = "metrics"))]
#[doc = include_str!("../docs/operations.md")]
pub struct OperationsDoctests;
