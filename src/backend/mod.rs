//! The [`LockBackend`] contract every lock store meets, and its request/outcome types.
//!
//! A backend stores lock state and nothing else: who holds which key, in which
//! [`LockMode`], with how many holds, until when. Everything on the client side — waiting
//! with a deadline, the watchdog, guards, owners, the middleware — is written once
//! against this trait, so it holds for every backend alike.
//!
//! The trait speaks in store-neutral terms: a lease is a [`Duration`], a busy lock
//! reports how long its holder's lease still runs, and "waiting for a release" is a
//! [`Subscription`] whose mechanism is the backend's own (Redis pub/sub, an in-process
//! notify, PostgreSQL `LISTEN`/`NOTIFY`, ...). No scripts, channels or `PTTL` appear here.
//!
//! The methods return boxed futures so that the trait is object-safe: a
//! [`LockClient`](crate::LockClient) holds an `Arc<dyn LockBackend>`, and composite
//! backends (RedLock over several stores) hold several. One allocation per call is
//! nothing next to a network round trip.
//!
//! # Implementing a backend
//!
//! Every state change must be atomic in the store (one script, one transaction, one
//! critical section). A hold's lease only ever moves later: every renewal, re-entry and
//! partial release writes the later of the current and the requested end, computed in
//! the store. The conformance suite runs the same cases against every backend; a new
//! backend should pass it unchanged: it ships behind the `testing` feature, see
//! `tower_lock::testing`.
//!
//! The contract is [`LockBackend`]: the operations and a [`StoreProfile`], all
//! required, plus three optional extensions: an in-process fast path ([`LocalStore`]),
//! administration ([`StoreAdmin`]: inspection, forced release, readiness, client names)
//! and records of responses for replay ([`ReplayStore`]).
//!
//! A store that fails reports a [`StoreError`](crate::StoreError) with the driver's
//! error as its source, and picks its [kind](crate::StoreErrorKind): what the lock core
//! and the layer do follows the kind alone — an
//! [unavailable](crate::StoreErrorKind::Unavailable) store is retried while a lock call
//! waits and lets a fail-open layer through; a
//! [misconfigured](crate::StoreErrorKind::Misconfigured) or
//! [unexpected](crate::StoreErrorKind::Unexpected) one fails closed. A connection that
//! broke under a call is [`StoreError::connection_lost`](crate::StoreError::connection_lost):
//! a first attempt is then tried once more at once.
//!
//! # Wrapping a backend
//!
//! A backend that adds something around another one — counting, tracing, injecting
//! faults — is an [`Intercepted`] backend: an [`Intercept`] changes the calls it means
//! to, and every other call, the profile and the fast path included, reaches the inner
//! backend unchanged.
//!
//! # Example
//!
//! Driving a backend directly (the [`Lock`](crate::Lock) API does this for you):
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::backend::{Acquire, LockBackend, LockMode, LockRequest, Release};
//! use tower_lock::{HoldId, LockKey, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! let backend = MemoryBackend::new();
//! let req = LockRequest::new(
//!     LockKey::new("k")?,
//!     HoldId::from_raw("me:1")?,
//!     LockMode::Exclusive,
//!     Duration::from_secs(10),
//! );
//! let Acquire::Acquired(grant) = backend.acquire(&req).await? else { unreachable!() };
//! assert_eq!(grant.holds(), 1);
//! assert_eq!(grant.token(), None); // unfenced: nothing is left behind once released
//!
//! let other = LockRequest::new(req.key.clone(), HoldId::from_raw("you:1")?, LockMode::Exclusive, req.lease);
//! assert!(matches!(backend.acquire(&other).await?, Acquire::Busy { ttl: Some(_) }));
//! assert_eq!(backend.release(&other).await?, Release::NotHeld);
//! assert_eq!(backend.release(&req).await?, Release::Released);
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::error::Result;
use crate::hold_id::HoldId;
use crate::key::LockKey;

mod admin;
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
pub(crate) mod clock;
mod intercept;
pub(crate) mod limits;
mod loss;
pub mod memory;
mod mode;
#[cfg(feature = "mysql")]
#[cfg_attr(docsrs, doc(cfg(feature = "mysql")))]
pub mod mysql;
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub mod postgres;
mod profile;
#[cfg(feature = "redis")]
#[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
pub mod redis;
pub mod redlock;
mod replay;
mod wake;
#[cfg(feature = "zookeeper")]
#[cfg_attr(docsrs, doc(cfg(feature = "zookeeper")))]
pub mod zookeeper;

pub use admin::{ClientNames, PING_KEY, StoreAdmin};
pub(crate) use admin::{admin_of, clients_of};
pub use intercept::{Intercept, Intercepted};
pub use limits::{DEFAULT_WAITER_TIMEOUT, MIN_WAITER_TIMEOUT};
pub use loss::StoreLoss;
pub use mode::LockMode;
pub(crate) use mode::{QUEUED_MODES, queued};
pub use profile::{ClockDrift, StoreProfile};
pub use replay::{ReplayStore, Stored};
pub(crate) use wake::{Signal, Ticket};
pub use wake::{Subscription, Wake};

/// A boxed, `Send` future: what every [`LockBackend`] method returns.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The wall clock in microseconds since the Unix epoch: the floor of every fencing token a
/// built-in backend issues (0 if the clock is before the epoch).
pub(crate) fn clock_floor_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// A fencing token: a number the store issues with every acquisition of a *fenced* lock,
/// strictly greater than every token it issued for that key before.
///
/// Pass it to the storage your critical section writes to and have the storage refuse a
/// write whose token is lower than the last one it accepted; that turns "a paused holder
/// outlived its lease" from silent corruption into a refused write. Only fenced locks
/// carry tokens ([`LockClient::get_fenced_lock`](crate::LockClient::get_fenced_lock),
/// [`Lock::fenced`](crate::Lock::fenced), the layer's `fenced(true)`): a plain lock leaves
/// nothing behind in the store once released, a fenced one keeps a counter per name.
///
/// # The promise, exactly
///
/// - **Order.** Tokens of one key increase strictly in the order the store issued them,
///   on every backend. Every acquisition takes the next token, a re-entry in the store
///   too (as Redisson's `RFencedLock`); guards that re-enter a hold through one
///   [`LockClient`](crate::LockClient) share the hold's token.
/// - **Exclusive holds** (exclusive, fair, write) never overlap, so a holder's token is
///   greater than every earlier holder's: "refuse anything lower than the highest
///   accepted" is exactly right for them.
/// - **Shared holds** (read, permits) overlap: two readers hold different tokens at
///   once, and the older reader is still a legitimate holder. A read hold's token is
///   greater than the token of every write hold that ended before it began and lower
///   than every later writer's, so fence a store written under shared holds against the
///   highest token *of a writer*, not the highest seen.
/// - **Across store restarts.** A token is at least the store's clock in microseconds
///   since the Unix epoch when it is issued, so tokens keep increasing even when the
///   counter is lost (a Redis restart without persistence, a restore from an older
///   snapshot, a failover to a replica that missed the last increment, a `FLUSHALL`, a
///   restarted process for the memory backend) — as long as the store's clock does not
///   step back by more than the time the restart took.
///
/// # What the built-in backends keep
///
/// - Memory: one counter for the whole backend (so tokens never repeat across keys).
/// - Redis: Redisson `RFencedLock`'s counter `redisson_lock_token:{NAME}`, `INCR`ed (then
///   raised to the clock floor) in the script that grants the lock, never expiring: a
///   Java `RFencedLock` and tower-lock locking the same name share one fence. One small
///   string key per fenced name ever locked (about 70 bytes plus the name); plain locks
///   keep none. A Redisson client increments it by one without the clock floor.
/// - RedLock: per node; see [`RedLock`](redlock::RedLock) — not a fencing token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token value.
    pub const fn new(value: u64) -> Self {
        FencingToken(value)
    }

    /// The raw value.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.0, f)
    }
}

/// One lock operation: which key, for which hold, in which mode, with which lease.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockRequest {
    /// The lock.
    pub key: LockKey,
    /// The hold that acquires, renews or releases: its identity in the store, used by
    /// no other hold. (The logical [`Owner`](crate::Owner) that took it stays in the
    /// client: a backend never sees it.)
    pub hold_id: HoldId,
    /// How the lock is held.
    pub mode: LockMode,
    /// The lease: set on a fresh acquisition; on a renewal, a re-entry and a release
    /// that leaves holds in place, the hold's lease is extended to it but never
    /// shortened (a hold without expiry keeps none). Always at least 1 ms, in whole
    /// milliseconds.
    pub lease: Duration,
    /// Whether an acquisition takes a [`FencingToken`]. Unfenced acquisitions leave
    /// nothing in the store once released.
    pub fenced: bool,
    /// For a [`LockMode::Read`] acquisition: the write hold of this key that the read
    /// belongs with (Redisson's downgrade). The store lets the read in past that write
    /// hold, and only that one. `None`: the read's own hold identity.
    pub writer: Option<HoldId>,
}

impl LockRequest {
    /// An unfenced request for the hold `hold_id` on `key`.
    pub fn new(key: LockKey, hold_id: HoldId, mode: LockMode, lease: Duration) -> Self {
        LockRequest {
            key,
            hold_id,
            mode,
            lease,
            fenced: false,
            writer: None,
        }
    }

    /// The same request, taking a [`FencingToken`] when it acquires.
    #[must_use]
    pub fn fenced(mut self) -> Self {
        self.fenced = true;
        self
    }

    /// The same read request, let in past the write hold `writer` (see
    /// [`LockRequest::writer`]).
    #[must_use]
    pub fn with_writer(mut self, writer: HoldId) -> Self {
        self.writer = Some(writer);
        self
    }

    /// Whose write hold lets this request read past it: [`LockRequest::writer`], else
    /// the request's own hold identity.
    pub fn write_hold_id(&self) -> &HoldId {
        self.writer.as_ref().unwrap_or(&self.hold_id)
    }
}

/// A successful acquisition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Grant {
    holds: u32,
    token: Option<FencingToken>,
    valid_for: Option<Duration>,
}

impl Grant {
    /// The hold now has the lock `holds` times (1 for a fresh acquisition); `token` is
    /// the fencing token of a fenced request (`None` for an unfenced one).
    pub fn new(holds: u32, token: Option<FencingToken>) -> Self {
        Grant {
            holds,
            token,
            valid_for: None,
        }
    }

    /// Says the grant is valid for at most `valid_for` from the moment the acquire call
    /// returned, rather than the full lease from the moment it was sent. Quorum
    /// backends use it to pass on lease − elapsed − clock drift.
    pub fn with_valid_for(mut self, valid_for: Duration) -> Self {
        self.valid_for = Some(valid_for);
        self
    }

    /// How many times the hold now has the lock.
    pub fn holds(&self) -> u32 {
        self.holds
    }

    /// The fencing token of this acquisition, for a fenced request.
    pub fn token(&self) -> Option<FencingToken> {
        self.token
    }

    /// See [`Grant::with_valid_for`].
    pub fn valid_for(&self) -> Option<Duration> {
        self.valid_for
    }
}

/// One hold as a store has it: who, in which mode, how many times, for how long.
///
/// The store's part is filled by [`StoreAdmin::inspect`]; [`Lock::inspect`](crate::Lock::inspect)
/// adds what the inspecting client knows (`client`, and for its own holds `since` and
/// `guards`).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct HoldInfo {
    /// The hold's identity as the store records it: `<client uuid>:<n>` for this
    /// crate's holds (and Redisson's `<uuid>:<thread id>`).
    pub hold_id: HoldId,
    /// How the key is held. For a [`LockMode::Permits`] hold, `max` is the one the
    /// inspection asked with (the store does not keep it), or `u32::MAX` when it asked
    /// in another mode.
    pub mode: LockMode,
    /// How many times the store counts the hold. A
    /// [`LockClient`](crate::LockClient) counts re-entries itself, so its holds show
    /// 1 here and their re-entries in `guards`.
    pub holds: u32,
    /// How long its lease still runs; `None` for no expiry.
    pub ttl: Option<Duration>,
    /// The fencing token of this hold, where the store keeps one per hold (memory,
    /// permits); see [`LockState::fencing_token`] for the name's newest.
    pub token: Option<FencingToken>,
    /// The name of the client that holds it ([`LockClientBuilder::name`](crate::LockClientBuilder::name)),
    /// when that client registered one in the store. Filled by `Lock::inspect`.
    pub client: Option<String>,
    /// When the hold was taken (the inspecting client's wall clock), for the
    /// inspecting client's own holds; the store does not record it. Filled by
    /// `Lock::inspect`.
    pub since: Option<std::time::SystemTime>,
    /// How many guards stand for the hold (the client-side re-entries), for the
    /// inspecting client's own holds. Filled by `Lock::inspect`.
    pub guards: Option<u32>,
}

impl HoldInfo {
    /// A hold as the store reports it; the client-side fields start empty.
    pub fn new(hold_id: HoldId, mode: LockMode, holds: u32, ttl: Option<Duration>) -> Self {
        HoldInfo {
            hold_id,
            mode,
            holds,
            ttl,
            token: None,
            client: None,
            since: None,
            guards: None,
        }
    }

    /// The same hold with its fencing token.
    #[must_use]
    pub fn with_token(mut self, token: Option<FencingToken>) -> Self {
        self.token = token;
        self
    }

    /// The client id part of the hold's identity (`<client uuid>` of
    /// `<client uuid>:<n>`), which names the process that holds it; `None` for an
    /// identity of another shape.
    pub fn client_id(&self) -> Option<&str> {
        self.hold_id
            .as_str()
            .rsplit_once(':')
            .map(|(client, _)| client)
    }
}

/// Who waits for a lock, as far as a store can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Waiters {
    /// How many wait.
    pub count: usize,
    /// Whose waiters `count` covers.
    pub scope: WaiterScope,
}

/// Whose waiters [`Waiters::count`] covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum WaiterScope {
    /// Every process's: the store keeps its waiters (a fair or read-write queue, or an
    /// in-process store). A queue may still hold a waiter that vanished, until the
    /// waiter timeout evicts it.
    Store,
    /// Only the waiters of this process (this backend instance): the store does not
    /// record who waits for a plain lock or a permit (waiters in other processes sleep on
    /// a release channel).
    Process,
}

impl fmt::Display for WaiterScope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WaiterScope::Store => "store",
            WaiterScope::Process => "process",
        })
    }
}

/// What a store holds for one lock name right now. Returned by [`StoreAdmin::inspect`].
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockState {
    /// Every live hold of the name, in the store's order.
    pub holders: Vec<HoldInfo>,
    /// The newest fencing token the store has for the name: the fencing counter where
    /// the store keeps one per name (Redis), else the newest token of a current holder.
    /// `None` when the name was never locked fenced (or nothing is left of it).
    pub fencing_token: Option<FencingToken>,
    /// Who waits.
    pub waiters: Waiters,
}

impl LockState {
    /// A state with these holders and waiters, and no fencing token.
    pub fn new(holders: Vec<HoldInfo>, waiters: Waiters) -> Self {
        LockState {
            holders,
            fencing_token: None,
            waiters,
        }
    }

    /// The same state with the name's newest fencing token.
    #[must_use]
    pub fn with_fencing_token(mut self, token: Option<FencingToken>) -> Self {
        self.fencing_token = token;
        self
    }

    /// Whether anyone holds the name.
    pub fn is_locked(&self) -> bool {
        !self.holders.is_empty()
    }

    /// The longest lease still running among the holders (`Duration::MAX` for a hold
    /// without expiry); `None` when nobody holds the name. Redisson's
    /// `remainTimeToLive`.
    pub fn remaining_lease(&self) -> Option<Duration> {
        self.holders
            .iter()
            .map(|h| h.ttl.unwrap_or(Duration::MAX))
            .max()
    }
}

impl Waiters {
    /// `count` waiters of `scope`.
    pub fn new(count: usize, scope: WaiterScope) -> Self {
        Waiters { count, scope }
    }
}

/// The outcome of [`LockBackend::acquire`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Acquire {
    /// The hold has the lock.
    Acquired(Grant),
    /// Another hold has it.
    Busy {
        /// How long the holder's lease still runs; `None` when it has no expiry or the
        /// backend cannot tell. Waiters sleep at most this long before trying again.
        ///
        /// A backend may answer less than the holder's lease when it needs the caller
        /// to come back sooner: a queueing backend evicts waiters that stop polling, so
        /// it caps the ttl of a queued hold below its eviction time; a quorum backend
        /// answers a jittered back-off after a split vote. So callers treat it as "try
        /// again after at most this long", and a caller that gives up reports it as the
        /// holder's remaining lease only approximately.
        ttl: Option<Duration>,
    },
}

/// The outcome of [`LockBackend::release`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Release {
    /// The hold's last count was released; the lock is free (for this mode) and waiters
    /// were notified.
    Released,
    /// One count was released; the hold still has the lock this many times, with at
    /// least the lease it had.
    Decremented {
        /// Holds left.
        holds: u32,
    },
    /// The hold did not have the lock (never did, or its lease ran out, or it was
    /// force-released). Nothing was changed.
    NotHeld,
}

/// The contract of a lock store.
///
/// Every method is checked against the hold's identity ([`HoldId`]) where it changes
/// state: nobody renews or releases a hold of another identity. Every method that changes state is atomic in the store.
/// Implementations must be cheap to call concurrently from many tasks.
///
/// Seven methods are required — the [`StoreProfile`] and the six operations a lock
/// needs (acquire, renew, release, abandon, subscribe, cancel a wait) — because each
/// carries a rule a default could not keep for every store. The five provided ones are
/// right for any store, only slower or less capable:
/// [`renew_many`](LockBackend::renew_many) (renews one by one),
/// [`has_local_waiters`](LockBackend::has_local_waiters) (lets a new acquirer barge),
/// and the three extensions a store may offer — [`local`](LockBackend::local) (an
/// in-process fast path), [`admin`](LockBackend::admin) (inspection, forced release,
/// readiness, client names) and [`replays`](LockBackend::replays) (stored responses).
/// A backend that wraps another one should not implement this trait by hand but with
/// [`Intercepted`], which forwards everything it does not change.
pub trait LockBackend: Send + Sync + 'static {
    /// What the store is: its name and identity, the modes it queues waiters in, its
    /// watchdog lease and its clock-drift allowance. The same value on every call (the
    /// lock core reads it on hot paths: return a reference to a field).
    fn profile(&self) -> &StoreProfile;

    /// Tries once to take `req.key` for the hold `req.hold_id` in `req.mode`.
    ///
    /// - The key is free (or compatible with the mode, for shared modes): the hold now
    ///   has it once, with a lease of `req.lease` → [`Acquire::Acquired`] with
    ///   `holds: 1`.
    /// - The hold already has it in this mode: the hold count goes up by one and the
    ///   lease is extended to `req.lease` if it had less left (never shortened: an outer
    ///   hold keeps its longer lease, a hold without expiry keeps none) → `Acquired`
    ///   with the new count (reentrancy). A [`LockClient`](crate::LockClient) never asks
    ///   this: it re-enters its own holds without the store, and gives every hold an
    ///   identity of its own.
    /// - A read ([`LockMode::Read`]) while the hold
    ///   [`req.write_hold_id()`](LockRequest::write_hold_id) has the write lock: granted
    ///   as a fresh read hold of `req.hold_id`, past that write hold (downgrade).
    /// - Another hold has it: nothing changes → [`Acquire::Busy`] with the holder's
    ///   remaining lease; in a mode the [profile](StoreProfile::queues_waiters) says
    ///   the store queues, `req.hold_id` takes (or keeps) its place in the queue.
    ///
    /// A fenced request ([`LockRequest::fenced`]) takes the key's next [`FencingToken`]
    /// with every acquisition, re-entries included; an unfenced one none. An expired
    /// lease counts as free.
    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>>;

    /// Extends the lease of the hold `req.hold_id` to at least `req.lease` from now if
    /// it still has the key in `req.mode`; returns whether it does. Never changes
    /// the hold count.
    ///
    /// Never shortens the lease: a hold with more left keeps it, and a hold without
    /// expiry keeps none. The store computes the new end itself, as the later of the
    /// current and the requested one, in the same atomic step as the identity check. So
    /// renewals that reach the store out of order (over two connections of a pool, or a
    /// watchdog renewal that crosses a re-entry with a longer fixed lease) never end a
    /// hold before a lease the store already confirmed to one of its guards.
    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>>;

    /// [`renew`](LockBackend::renew) for many holds at once, results in the same order:
    /// each hold's lease is extended to at least its request's lease, never shortened.
    /// The watchdog calls this once per period with every lock it keeps alive;
    /// backends batch it into as few round trips as they can (one pipeline or script per
    /// connection). The default renews one by one, which is correct for every store.
    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(reqs.len());
            for req in reqs {
                out.push(self.renew(req).await);
            }
            out
        })
    }

    /// Releases one count of the hold `req.hold_id` on `req.key` in `req.mode`.
    ///
    /// Not held under this identity → [`Release::NotHeld`], nothing changes. More holds left →
    /// [`Release::Decremented`], lease extended to `req.lease` if it had less left (never
    /// shortened). Last hold →
    /// [`Release::Released`], and waiters are notified: in exclusive modes one waiter per
    /// client process is enough (no thundering herd); where a release may let several
    /// waiters in at once (a write unlock, readers), all are woken.
    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>>;

    /// The caller gave up on `req` for good — an attempt dropped in flight or left
    /// unanswered, or a wait that failed — and its hold identity `req.hold_id` will
    /// never be used again: undo whatever its attempts did, or will do when one still in
    /// flight arrives late. The lock core spawns it and does not wait for it; should it
    /// fail as an [outage](crate::Error::is_unavailable), the core calls it again, with
    /// backoff, until it is answered or `req.lease` has passed.
    ///
    /// Required, because what it takes depends on the store. Releasing the hold
    /// and, in a [queued mode](StoreProfile::queues_waiters), leaving the queue covers
    /// attempts already applied: enough for a store that applies an attempt within the
    /// call (memory). A store whose requests can overtake each other (a pool of
    /// connections, a connection replaced after a timeout) must also make sure a late
    /// attempt of `req.hold_id` takes nothing: refuse attempts past a deadline on the
    /// store's clock, record the identity as gone, or release again once no attempt can
    /// still land (the built-in Redis and PostgreSQL backends do the first and one of
    /// the others).
    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>>;

    /// Registers interest in releases of `req.key` as seen by the hold `req.hold_id` in
    /// `req.mode`, before the caller's next attempt, so no release between that attempt
    /// and [`Subscription::wait`] is missed. Subscriptions to the same key are shared
    /// where the store allows (one channel subscription per key per process) and torn
    /// down with the last one.
    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>>;

    /// Whether waiters for `req.key` in `req.mode`, registered through this backend
    /// instance in this process, are waiting right now. The acquire loop then lines a
    /// new acquirer up behind them instead of letting it barge in on every release (no
    /// starvation among one process's waiters; across processes a plain lock still
    /// barges — use a fair lock for strict order). Must be cheap when nobody waits.
    ///
    /// The default is `false`: a new acquirer barges, as one from another process
    /// would. Fairness among one process's waiters, not safety, depends on it.
    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        let _ = req;
        false
    }

    /// The caller stopped waiting for `req` (deadline passed, or it was cancelled):
    /// remove `req.hold_id`'s place in the store's queue, and wake whoever that lets go
    /// next. Only called in modes the [profile](StoreProfile::queues_waiters) says the
    /// store queues; a store that queues in no mode answers `Ok(())`.
    ///
    /// Required: a queue place nobody leaves blocks every waiter behind it until the
    /// store evicts it.
    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>>;

    /// The in-process fast path, for a store that answers without I/O (a store in this
    /// process): the lock core then takes a free lock and releases a hold without a
    /// boxed future or a task. The default is `None`: every call goes through the async
    /// methods, which is always correct.
    fn local(&self) -> Option<&dyn LocalStore> {
        None
    }

    /// The store's administration (inspection, forced release, a readiness probe,
    /// client names), if it has one; see [`StoreAdmin`]. The default is `None`:
    /// [`Lock::inspect`](crate::Lock::inspect), [`LockClient::ping`](crate::LockClient::ping)
    /// and the like then answer [`ConfigError::Unsupported`](crate::ConfigError::Unsupported).
    fn admin(&self) -> Option<&dyn StoreAdmin> {
        None
    }

    /// The store's records of responses for replay, if it keeps them; see
    /// [`ReplayStore`]. The default is `None`: an `IdempotencyLayer` on this store is
    /// refused when it is built.
    fn replays(&self) -> Option<&dyn ReplayStore> {
        None
    }

    /// For a store that drops holds by itself (a ZooKeeper session that expired takes
    /// its nodes along): the signal that fires when the hold `req` granted is gone so.
    /// The lock core asks once per grant and marks the hold lost the moment it fires,
    /// with its guards' lost signal, instead of at the next renewal. The default is
    /// `None`: holds end only when the store says so to a renewal, or their lease runs
    /// out.
    fn loss_signal(&self, req: &LockRequest) -> Option<StoreLoss> {
        let _ = req;
        None
    }
}

/// A store in this process that answers on the spot: the fast path of a
/// [`LockBackend`], from [`LockBackend::local`].
///
/// Each method answers exactly as the backend's async method would, or returns `None`
/// having done nothing, and the caller then takes the async way. The lock core asks it
/// only for modes the store does not queue in.
pub trait LocalStore: Send + Sync {
    /// [`LockBackend::acquire`], on the spot.
    fn acquire_now(&self, req: &LockRequest) -> Option<Result<Acquire>>;

    /// [`LockBackend::release`], on the spot.
    fn release_now(&self, req: &LockRequest) -> Option<Result<Release>>;
}

macro_rules! forward_backend {
    ($($ptr:ty),*) => {$(
        impl<T: LockBackend + ?Sized> LockBackend for $ptr {
            fn profile(&self) -> &StoreProfile {
                (**self).profile()
            }
            fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
                (**self).acquire(req)
            }
            fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
                (**self).renew(req)
            }
            fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
                (**self).renew_many(reqs)
            }
            fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
                (**self).release(req)
            }
            fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
                (**self).abandon(req)
            }
            fn subscribe<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
                (**self).subscribe(req)
            }
            fn has_local_waiters(&self, req: &LockRequest) -> bool {
                (**self).has_local_waiters(req)
            }
            fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
                (**self).cancel_wait(req)
            }
            fn local(&self) -> Option<&dyn LocalStore> {
                (**self).local()
            }
            fn admin(&self) -> Option<&dyn StoreAdmin> {
                (**self).admin()
            }
            fn replays(&self) -> Option<&dyn ReplayStore> {
                (**self).replays()
            }
            fn loss_signal(&self, req: &LockRequest) -> Option<StoreLoss> {
                (**self).loss_signal(req)
            }
        }
    )*};
}

forward_backend!(Arc<T>, Box<T>);
