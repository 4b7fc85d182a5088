//! The client side: [`LockClient`], [`Lock`], [`LockGuard`] and the watchdog.
//!
//! A [`LockClient`] wraps one backend with an identity (a UUID that prefixes every owner
//! it makes) and one watchdog. It hands out [`Lock`] handles, one per key; a handle
//! acquires with Redisson's three calls:
//!
//! | call | waits | lease |
//! |---|---|---|
//! | [`Lock::lock`] | until acquired | watchdog: renewed every lease/3 while held |
//! | [`Lock::try_lock`] | not at all (one attempt) | watchdog |
//! | [`Lock::try_lock_for(wait, lease)`](Lock::try_lock_for) | up to `wait` | [`Lease::Watchdog`] or a fixed lease, never renewed |
//!
//! Waiting never polls blindly: a waiter sleeps until the backend signals a release or
//! the holder's lease would end, whichever comes first.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::{Lease, LockClient, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! let client = LockClient::new(MemoryBackend::new());
//! let lock = client.get_lock("account:17")?;
//!
//! // Wait up to 2 s; hold with a 10 s lease and no watchdog.
//! let guard = lock.try_lock_for(Duration::from_secs(2), Duration::from_secs(10)).await?;
//! println!("held by {} as the hold {}", guard.owner(), guard.hold_id());
//! guard.unlock().await?;
//!
//! // Wait up to 2 s; keep it as long as needed (watchdog).
//! let guard = lock.try_lock_for(Duration::from_secs(2), Lease::Watchdog).await?;
//! assert!(guard.is_watched());
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! Acquisition fails with [`Error::Busy`] when the wait runs out (with the holder's
//! remaining lease, for a `Retry-After`), [`Error::Config`] (an
//! [`InvalidSetting`](ConfigError::InvalidSetting)) for a zero or absurd lease, and
//! backend errors as they come. [`LockGuard::unlock`] fails with
//! [`Error::Lost`] when the lock was no longer held.
//!
//! # Holds and re-entry
//!
//! Every acquisition that reaches the store is a new *hold* with an identity of its own
//! (a [`HoldId`], [`LockGuard::hold_id`]), which no other hold ever uses. Locking a key its owner already
//! holds (same mode, same client) re-enters that hold without asking the store; only the
//! hold's last guard releases it. So a guard's release only ever affects the hold that
//! guard stands for, and a lost guard stays lost: see the crate docs' one rule.
//!
//! # Cancel safety
//!
//! Dropping an acquire future at any point leaves nothing behind, with one bounded
//! exception. A waiter's subscription is removed (and a release signal it had consumed is
//! passed to another waiter); a queued waiter leaves the store's queue; an attempt
//! cancelled in flight is followed by a spawned release of its hold (and, for a queued
//! mode, leaving the queue) — safe whoever the owner is, since the hold's identity is the
//! attempt's own. The exception: if that compensation reaches the store *before* the
//! attempt itself (the attempt stalled on a connection that was replaced after a
//! response timeout, and the server read it later), the attempt's hold, or its queue
//! entry, stays until its lease (or the waiter timeout) ends; nobody renews it, and no
//! guard stands for it. Dropping a [`LockGuard`] stops its renewal and, for the hold's
//! last guard, spawns its release.

use std::future::Future;
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::backend::{LockBackend, LockMode, LockState, admin_of, clients_of};
use crate::error::{ConfigError, Error, Result};
use crate::hold_id::HoldId;
use crate::key::{IntoLockKey, LockKey};
use crate::owner::Owner;

pub(crate) mod acquire;
mod cleanup;
mod guard;
mod health;
mod held;
mod observer;
mod registry;
mod unlocking;
mod watchdog;

pub(crate) use acquire::{Acquisition, Acting, begin_acquire};
pub use guard::{LockGuard, LostSignal};
pub(crate) use held::Guards;
pub use held::HeldLock;
pub(crate) use observer::Hooks;
pub use observer::{LayerEvent, LayerKind, LayerOutcome, LockEvent, LockObserver, NotStoredReason};
use registry::Registry;
pub(crate) use unlocking::{FinishOnDrop, Unlocking};

use crate::backend::limits::DEFAULT_WATCHDOG_LEASE;
pub(crate) use crate::backend::limits::{
    validate_lease, validate_renewed_lease, validate_watchdog_lease,
};

/// Checks a lease setting `name` of a layer: a fixed lease in range, a renewed one no
/// shorter than the watchdog allows.
pub(crate) fn validate_lease_setting(name: &'static str, lease: Lease) -> Result<(), ConfigError> {
    match lease {
        Lease::Watchdog => Ok(()),
        Lease::Renewed(lease) => validate_renewed_lease(name, lease).map(drop),
        Lease::Fixed(lease) => validate_lease(name, lease).map(drop),
    }
}

/// How a lock's lease is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lease {
    /// The client's watchdog lease, renewed every third of it while the guard lives.
    Watchdog,
    /// Renewed by the watchdog as [`Watchdog`](Lease::Watchdog) is, with a lease of its
    /// own instead of the client's: every third of it while the guard lives, and free
    /// that long after its holder stops (a process killed while holding it). At least
    /// [`MIN_WATCHDOG_LEASE`](crate::MIN_WATCHDOG_LEASE). A layer's request locks take
    /// [`DEFAULT_REQUEST_LEASE`](crate::layer::DEFAULT_REQUEST_LEASE) so by default.
    Renewed(Duration),
    /// A fixed lease: the lock is freed when it ends, whether or not the guard lives
    /// (Redisson's `leaseTime`). Between [`MIN_LEASE`](crate::MIN_LEASE) and
    /// [`MAX_LEASE`](crate::MAX_LEASE).
    Fixed(Duration),
}

impl From<Duration> for Lease {
    fn from(lease: Duration) -> Self {
        Lease::Fixed(lease)
    }
}

/// How long an outage lasts, by default, before a lock call that begins in it gives up
/// at its first failed attempt: 1 s ([`LockClientBuilder::outage_grace`]). A store's
/// restart, a reconnect or a failover that has just begun is ridden out by the calls
/// that meet it; once it has lasted a second, a request is answered (503, or served by
/// a fail-open layer) at once rather than at the end of its wait.
pub const DEFAULT_OUTAGE_GRACE: Duration = Duration::from_secs(1);

/// How long a client's name stays registered in the store after its last registration:
/// 1 hour. A client that takes locks registers again every half of it; a stopped
/// process's name is gone at most an hour later.
pub const CLIENT_NAME_TTL: Duration = Duration::from_secs(60 * 60);

/// The longest client name accepted, in bytes: 128.
pub const MAX_CLIENT_NAME_LEN: usize = 128;

/// A backend plus an identity and a watchdog: where [`Lock`]s come from.
///
/// Cheap to clone: clones share the backend, the identity and the watchdog. Make one per
/// backend and share it; two clients on one store are two distinct sets of owners, as two
/// Redisson clients are.
#[derive(Clone)]
pub struct LockClient {
    inner: Arc<ClientInner>,
}

struct ClientInner {
    backend: Arc<dyn LockBackend>,
    id: String,
    next_owner: AtomicU64,
    registry: Registry,
    watchdog_lease: Duration,
    hooks: Hooks,
    /// The name an operator knows this client by ([`LockClientBuilder::name`]).
    name: Option<Arc<str>>,
    /// When the name is next due for registration, in seconds after `born`.
    name_due: AtomicU64,
    born: std::time::Instant,
    /// How long an outage lasts before lock calls that begin in it stop riding it out
    /// ([`LockClientBuilder::outage_grace`]).
    outage_grace: Duration,
}

impl LockClient {
    /// A client on `backend` with the default settings: the watchdog lease
    /// [`DEFAULT_WATCHDOG_LEASE`], no name, no observer. [`builder`](Self::builder)
    /// sets them.
    pub fn new(backend: impl LockBackend) -> Self {
        let backend: Arc<dyn LockBackend> = Arc::new(backend);
        Self::with_parts(
            backend,
            DEFAULT_WATCHDOG_LEASE,
            Hooks::default(),
            None,
            DEFAULT_OUTAGE_GRACE,
        )
    }

    /// Configures a client: see [`LockClientBuilder`].
    pub fn builder(backend: impl LockBackend) -> LockClientBuilder {
        LockClientBuilder {
            backend: Arc::new(backend),
            watchdog_lease: None,
            observer: None,
            redact_keys: None,
            name: None,
            outage_grace: DEFAULT_OUTAGE_GRACE,
        }
    }

    fn with_parts(
        backend: Arc<dyn LockBackend>,
        watchdog_lease: Duration,
        hooks: Hooks,
        name: Option<Arc<str>>,
        outage_grace: Duration,
    ) -> Self {
        let hooks = hooks.on_backend(backend.profile().name());
        let client = LockClient {
            inner: Arc::new(ClientInner {
                registry: Registry::new(Arc::clone(&backend), watchdog_lease, hooks.clone()),
                backend,
                id: uuid::Uuid::new_v4().to_string(),
                next_owner: AtomicU64::new(1),
                watchdog_lease,
                hooks,
                name,
                name_due: AtomicU64::new(0),
                born: std::time::Instant::now(),
                outage_grace,
            }),
        };
        if let Some(name) = client.name() {
            tracing::info!(
                client.id = %client.id(),
                client.name = name,
                backend = client.backend().profile().name(),
                "lock client ready"
            );
        }
        client
    }

    /// The exclusive, reentrant lock named `key` (Redisson `getLock`).
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] when `key` is not a valid [`LockKey`].
    pub fn get_lock(&self, key: impl IntoLockKey) -> Result<Lock, ConfigError> {
        self.lock_in_mode(key, LockMode::Exclusive)
    }

    /// The fair lock named `key` (Redisson `getFairLock`): like [`get_lock`](Self::get_lock),
    /// but waiters acquire in the order they arrived, and a newcomer never takes the
    /// lock while others wait. A waiter that vanishes without leaving the queue is
    /// skipped after the backend's waiter timeout (Redisson's `threadWaitTime`); live
    /// waiters keep their place by polling well within it, so a fair waiter that gives
    /// up reports [`Error::Busy`] with a `holder_ttl` no longer than that polling
    /// interval.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] when `key` is not a valid [`LockKey`].
    pub fn get_fair_lock(&self, key: impl IntoLockKey) -> Result<Lock, ConfigError> {
        self.lock_in_mode(key, LockMode::Fair)
    }

    /// At most `max` holders of `key` at once, each with its own leased permit (like
    /// Redisson's `RPermitExpirableSemaphore`): a crashed holder's permit returns when
    /// its lease ends. An owner that already holds a permit re-enters it.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] for a bad key, [`ConfigError::InvalidSetting`] for `max == 0`.
    pub fn get_permits(&self, key: impl IntoLockKey, max: u32) -> Result<Lock, ConfigError> {
        let max = NonZeroU32::new(max)
            .ok_or_else(|| ConfigError::invalid_setting("permits", "must be at least 1 (got 0)"))?;
        self.lock_in_mode(key, LockMode::Permits { max })
    }

    /// The lock named `key` in any [`LockMode`]; the typed getters are usually clearer.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] when `key` is not a valid [`LockKey`].
    pub fn lock_in_mode(&self, key: impl IntoLockKey, mode: LockMode) -> Result<Lock, ConfigError> {
        Ok(self.lock_on(key.into_lock_key()?, mode))
    }

    pub(crate) fn lock_on(&self, key: LockKey, mode: LockMode) -> Lock {
        Lock {
            client: self.clone(),
            key,
            mode,
            owner: None,
            fenced: false,
        }
    }

    /// The exclusive, reentrant lock named `key` with fencing tokens (Redisson
    /// `getFencedLock`): every acquisition takes a [`FencingToken`](crate::FencingToken) greater than every
    /// earlier holder's, for the storage the lock protects to refuse stale writers. On
    /// Redis the counter is Redisson `RFencedLock`'s, so a Java service fencing the same
    /// name shares it; it is one small key per name that stays after the lock is
    /// released for the backend's token retention (an hour by default), so that tokens
    /// never go backwards (a plain lock leaves nothing). Same as
    /// `get_lock(key)?.fenced()`.
    ///
    /// ```
    /// use tower_lock::{LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_lock::Error> {
    /// let client = LockClient::new(MemoryBackend::new());
    /// let lock = client.get_fenced_lock("ledger:7")?;
    /// let first = lock.lock().await?;
    /// let t1 = first.fencing_token().expect("a fenced lock has a token");
    /// first.unlock().await?;
    /// let second = lock.lock().await?;
    /// assert!(second.fencing_token().expect("fenced") > t1);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] when `key` is not a valid [`LockKey`].
    pub fn get_fenced_lock(&self, key: impl IntoLockKey) -> Result<Lock, ConfigError> {
        Ok(self.get_lock(key)?.fenced())
    }

    /// A fresh owner, `<client id>:<n>`, distinct from every other owner of this client.
    pub fn new_owner(&self) -> Owner {
        let n = self.inner.next_owner.fetch_add(1, Ordering::Relaxed);
        Owner::new(&self.inner.id, n)
    }

    /// A fresh hold identity, `<client id>:<n>`, distinct from every owner and hold
    /// identity of this client (they share one sequence: a fresh owner is its first
    /// hold's identity). The client makes one for every hold it takes; this one is for
    /// driving [`backend`](Self::backend) directly.
    pub fn new_hold_id(&self) -> HoldId {
        let n = self.inner.next_owner.fetch_add(1, Ordering::Relaxed);
        HoldId::new(&self.inner.id, n)
    }

    /// The client's identity, the UUID part of its owners.
    pub fn id(&self) -> &str {
        &self.inner.id
    }

    /// The client's name, if it was given one ([`LockClientBuilder::name`]).
    pub fn name(&self) -> Option<&str> {
        self.inner.name.as_deref()
    }

    /// Registers the client's name in the store now, for [`CLIENT_NAME_TTL`], so that
    /// inspecting a lock from any process shows which client holds it. A named client
    /// also does this by itself when it takes locks (in the background, at most every
    /// half of the TTL); call this at startup to be visible before the first lock.
    /// Does nothing for an unnamed client.
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn register_name(&self) -> Result<()> {
        let Some(name) = self.inner.name.clone() else {
            return Ok(());
        };
        self.mark_name_registered();
        match clients_of(self.backend().as_ref()) {
            Some(clients) => clients.register(self.id(), &name, CLIENT_NAME_TTL).await,
            None => Ok(()),
        }
    }

    fn mark_name_registered(&self) {
        let due = self.inner.born.elapsed().as_secs() + CLIENT_NAME_TTL.as_secs() / 2;
        self.inner.name_due.store(due, Ordering::Relaxed);
    }

    /// Registers the name in the background on `runtime` when it is due.
    pub(crate) fn register_name_if_due(&self, runtime: &tokio::runtime::Handle) {
        if self.inner.name.is_none()
            || self.inner.born.elapsed().as_secs() < self.inner.name_due.load(Ordering::Relaxed)
        {
            return;
        }
        self.mark_name_registered();
        let client = self.clone();
        runtime.spawn(self.registry().track(async move {
            if let Err(error) = client.register_name().await {
                tracing::debug!(%error, "could not register the lock client's name; retrying with a later lock");
                client.inner.name_due.store(0, Ordering::Relaxed);
            }
        }));
    }

    /// Runs `work` under the exclusive lock named `key`: waits for it as
    /// [`Lock::lock`] does, holds it with the watchdog, and unlocks once `work` is done.
    /// If the lock is lost first, `work` is dropped where it stands and
    /// [`Error::Lost`] returned. Same as `client.get_lock(key)?.with_lock(work)`; see
    /// [`Lock::with_lock`].
    ///
    /// ```
    /// use tower_lock::{LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_lock::Error> {
    /// let client = LockClient::new(MemoryBackend::new());
    /// let balance = client
    ///     .with_lock("account:17", |held| async move {
    ///         assert_eq!(held.key().as_str(), "account:17");
    ///         100 // read, change and write the account here
    ///     })
    ///     .await?;
    /// assert_eq!(balance, 100);
    /// assert!(!client.get_lock("account:17")?.is_locked().await?);
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] for a bad key, and the errors of [`Lock::with_lock`].
    pub async fn with_lock<T, F, Fut>(&self, key: impl IntoLockKey, work: F) -> Result<T>
    where
        F: FnOnce(HeldLock) -> Fut,
        Fut: Future<Output = T>,
    {
        self.get_lock(key)?.with_lock(work).await
    }

    /// Releases every hold of this client in the store, stops its watchdog, and
    /// refuses every later acquisition with [`Error::Shutdown`]: for a process that
    /// stops, so that its locks are free at once rather than when their leases end.
    /// Call it after the server has drained its requests (a layer on a shut-down client
    /// answers 500).
    ///
    /// What each state is left in:
    /// - **held**: released in the store; guards still alive are lost (their
    ///   [`LostSignal`] fires, [`with_lock`](Self::with_lock) drops its work with
    ///   [`Error::Lost`], and their `unlock` reports it);
    /// - **waiting or in flight**: given up with [`Error::Shutdown`], leaving no hold,
    ///   queue place or subscription (a grant that arrives meanwhile is taken back);
    /// - **spawned work** (releases of dropped guards, compensations): waited for;
    /// - **the client's name** ([`LockClientBuilder::name`]): removed from the store.
    ///
    /// When it returns, the store keeps nothing of this client but durable fencing
    /// counters, which belong to the names. Clones share the shutdown; calling it again
    /// does nothing.
    ///
    /// ```
    /// use tower_lock::{Error, LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Error> {
    /// let store = MemoryBackend::new();
    /// let client = LockClient::new(store.clone());
    /// let lock = client.get_lock("job:nightly")?;
    /// let guard = lock.lock().await?;
    ///
    /// client.shutdown().await?;
    /// assert!(guard.is_lost());
    /// assert!(!store.contains_key(lock.key()));
    /// assert_eq!(client.watched_locks(), 0);
    /// assert!(matches!(lock.try_lock().await, Err(Error::Shutdown)));
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The first store error met releasing a hold or removing the name; everything else
    /// is still done, and what could not be released ends with its lease.
    ///
    /// # Cancel safety
    ///
    /// Dropped before it finishes, the client is shut down all the same (it refuses
    /// acquisitions, its watchdog is stopped, its holds are lost to their guards), but
    /// releases not yet answered may or may not have reached the store: those holds end
    /// with their lease.
    pub async fn shutdown(&self) -> Result<()> {
        let holds = self.registry().close();
        let released = futures_util::future::join_all(
            holds
                .iter()
                .map(|hold| guard::release_fully(Arc::clone(self.backend()), hold.store.clone())),
        )
        .await;
        self.registry().settle().await;
        let mut first_error = released.into_iter().find_map(Result::err);
        if self.name().is_some()
            && let Some(clients) = clients_of(self.backend().as_ref())
            && let Err(error) = clients.unregister(self.id()).await
        {
            first_error.get_or_insert(error);
        }
        tracing::info!(
            client.id = %self.id(),
            client.name = self.name(),
            released = holds.len(),
            error = first_error.as_ref().map(tracing::field::display),
            "lock client shut down"
        );
        first_error.map_or(Ok(()), Err)
    }

    /// Whether [`shutdown`](Self::shutdown) was called on this client or a clone.
    pub fn is_shut_down(&self) -> bool {
        self.registry().is_closed()
    }

    /// One round trip to the store ([`StoreAdmin::ping`](crate::backend::StoreAdmin::ping)), for a readiness probe:
    /// `Ok` when the store answered.
    ///
    /// ```
    /// use tower_lock::{LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_lock::Error> {
    /// let client = LockClient::new(MemoryBackend::new());
    /// client.ping().await?;
    /// client.shutdown().await?;
    /// assert!(client.ping().await.is_err(), "a shut-down client is not ready");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The store's error — of kind [unavailable](crate::StoreErrorKind::Unavailable)
    /// when it is down or did not answer in time (with [`NoQuorum`](crate::backend::redlock::NoQuorum) as its source for RedLock) — or
    /// [`Error::Shutdown`] after [`shutdown`](Self::shutdown).
    pub async fn ping(&self) -> Result<()> {
        if self.is_shut_down() {
            return Err(Error::Shutdown);
        }
        let answered = match admin_of(self.backend().as_ref()) {
            Ok(admin) => admin.ping().await,
            Err(error) => Err(error),
        };
        self.registry().inner.health.note(&answered);
        answered
    }

    /// How long the store has failed every call of this client, as an outage: `None`
    /// while its last call was answered. Learned from the calls the client makes anyway
    /// (lock attempts, renewals, releases, [`ping`](Self::ping)), so it costs no call
    /// to the store; a readiness probe that must not wait can read it, and one that may
    /// can [`ping`](Self::ping), which also updates it.
    ///
    /// Once it is longer than the [outage grace](LockClientBuilder::outage_grace), a
    /// lock call that begins gives up at its first failed attempt.
    pub fn outage(&self) -> Option<Duration> {
        let since = self.registry().inner.health.failing_since()?;
        Some(tokio::time::Instant::now().saturating_duration_since(since))
    }

    /// How long an outage lasts before lock calls that begin in it stop riding it out
    /// ([`LockClientBuilder::outage_grace`]).
    pub(crate) fn outage_grace(&self) -> Duration {
        self.inner.outage_grace
    }

    /// The backend.
    pub fn backend(&self) -> &Arc<dyn LockBackend> {
        &self.inner.backend
    }

    /// The lease of watched locks; they are renewed every third of it.
    pub fn watchdog_lease(&self) -> Duration {
        self.inner.watchdog_lease
    }

    /// How many holds the watchdog is currently renewing.
    pub fn watched_locks(&self) -> usize {
        self.inner.registry.watched()
    }

    pub(crate) fn registry(&self) -> &Registry {
        &self.inner.registry
    }

    /// Fills in the client-side fields of `state`'s holders: this client's own holds
    /// from the registry, every other holder's client name from the store.
    async fn annotate(&self, key: &LockKey, state: &mut LockState) {
        let mut others: Vec<&str> = Vec::new();
        for holder in &mut state.holders {
            if let Some((since, guards)) = self.registry().describe(key, &holder.hold_id) {
                holder.since = Some(since);
                holder.guards = Some(guards);
                holder.client = self.name().map(str::to_owned);
            }
        }
        for holder in &state.holders {
            if holder.client.is_none()
                && let Some(id) = holder.client_id()
                && !others.contains(&id)
            {
                others.push(id);
            }
        }
        if others.is_empty() {
            return;
        }
        let Some(clients) = clients_of(self.backend().as_ref()) else {
            return;
        };
        let names = match clients.names(&others).await {
            Ok(names) => names,
            Err(error) => {
                tracing::debug!(%error, "could not read client names for an inspection");
                return;
            }
        };
        let found: Vec<(String, String)> = others
            .iter()
            .zip(names)
            .filter_map(|(id, name)| Some(((*id).to_owned(), name?)))
            .collect();
        for holder in &mut state.holders {
            if holder.client.is_none()
                && let Some((_, name)) = holder
                    .client_id()
                    .and_then(|id| found.iter().find(|(k, _)| k == id))
            {
                holder.client = Some(name.clone());
            }
        }
    }

    pub(crate) fn hooks(&self) -> &Hooks {
        &self.inner.hooks
    }

    /// Whether this client shows keys in its traces as short hashes
    /// ([`LockClientBuilder::redact_keys`]).
    pub fn redacts_keys(&self) -> bool {
        self.inner.hooks.redacts_keys()
    }

    /// `key` as this client's traces show it: the key itself, or `#` and a 16-digit hash
    /// when keys are redacted. For logging about a key in code built on this client (the
    /// middleware does).
    pub fn display_key<'a>(&self, key: &'a LockKey) -> impl std::fmt::Display + 'a {
        self.inner.hooks.key(key)
    }
}

/// `LockClient::new(backend)`: a new client, with an identity and a watchdog of its own
/// and none of a builder's settings (observer, name, key redaction).
///
/// It lets APIs that take `impl Into<LockClient>` ([`LockLayer::new`](crate::LockLayer::new))
/// take a backend, for code where that backend serves nothing else (a test, a one-off
/// tool). An application makes one client per store and passes clones: every
/// conversion is another client, so two layers given the same backend this way are two
/// sets of owners (a handler's lock under one does not re-enter the other's), each
/// with its own watchdog, and a client built with an observer or a name is not the one
/// they use.
impl<B: LockBackend> From<B> for LockClient {
    fn from(backend: B) -> Self {
        LockClient::new(backend)
    }
}

impl std::fmt::Debug for LockClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LockClient")
            .field("id", &self.inner.id)
            .field("backend", &self.inner.backend.profile().name())
            .field("watchdog_lease", &self.inner.watchdog_lease)
            .finish()
    }
}

/// Configures a [`LockClient`].
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{LockClient, MemoryBackend};
///
/// let client = LockClient::builder(MemoryBackend::new())
///     .watchdog_lease(Duration::from_secs(10))
///     .build()?;
/// assert_eq!(client.watchdog_lease(), Duration::from_secs(10));
///
/// let err = LockClient::builder(MemoryBackend::new())
///     .watchdog_lease(Duration::from_millis(5))
///     .build()
///     .unwrap_err();
/// assert!(err.to_string().contains("watchdog_lease"));
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[must_use]
pub struct LockClientBuilder {
    backend: Arc<dyn LockBackend>,
    watchdog_lease: Option<Duration>,
    observer: Option<Arc<dyn LockObserver>>,
    redact_keys: Option<Option<[u8; 16]>>,
    name: Option<String>,
    outage_grace: Duration,
}

impl LockClientBuilder {
    /// Names the client for operators: a pod or host name. Owners keep their format
    /// (`<client uuid>:<n>`, which Redisson clients expect), and the name travels beside
    /// them: the store records it under the client's UUID for [`CLIENT_NAME_TTL`]
    /// (on Redis, `GET tower_lock_client:<uuid>`), [`Lock::inspect`] shows it for each
    /// holder, and the client's log line at startup pairs the two. At most
    /// [`MAX_CLIENT_NAME_LEN`] bytes, no whitespace or control characters.
    ///
    /// ```
    /// use tower_lock::{LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_lock::Error> {
    /// let client = LockClient::builder(MemoryBackend::new()).name("checkout-7f9c").build()?;
    /// let lock = client.get_lock("order:{42}")?;
    /// let _guard = lock.lock().await?;
    /// client.register_name().await?; // also done in the background by the first lock
    /// let state = lock.inspect().await?;
    /// assert_eq!(state.holders[0].client.as_deref(), Some("checkout-7f9c"));
    /// # Ok(())
    /// # }
    /// ```
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The lease of locks held without an explicit one; renewed every third of it.
    /// Default: the backend's, else [`DEFAULT_WATCHDOG_LEASE`]. At least
    /// [`MIN_WATCHDOG_LEASE`](crate::MIN_WATCHDOG_LEASE).
    pub fn watchdog_lease(mut self, lease: Duration) -> Self {
        self.watchdog_lease = Some(lease);
        self
    }

    /// How long an outage lasts before a lock call that begins in it stops riding it
    /// out: [`DEFAULT_OUTAGE_GRACE`] by default.
    ///
    /// A lock call with time to wait rides an outage out, retrying with backoff until
    /// its deadline. Once the store has failed every call of this client for the grace
    /// ([`LockClient::outage`]), a call that begins gives up at its first failed
    /// attempt instead: the outage is no blip, and a request that waits out its whole
    /// wait only to be answered 503 holds its connection and its client for nothing. A
    /// call that began earlier (waiting for a busy lock, or in a younger outage) still
    /// rides it out until its own deadline; the first answer from the store ends the
    /// outage for every call. Zero: a call that begins after any failed call gives up
    /// at its first failure.
    pub fn outage_grace(mut self, grace: Duration) -> Self {
        self.outage_grace = grace;
        self
    }

    /// Reports acquisitions, waits, releases and losses of this client's locks to
    /// `observer`, for metrics. See [`LockObserver`].
    pub fn observer(mut self, observer: impl LockObserver) -> Self {
        self.observer = Some(Arc::new(observer));
        self
    }

    /// Shows keys in this client's spans and events as `#` and a 16-digit hash instead
    /// of the key, for keys that carry personal data. Default: `false` (keys shown).
    /// Observers still get the real key. The hash is keyed with a secret drawn when the
    /// client is built: stable for the client's life (one key's events can be followed),
    /// different in every process, so nobody holding the logs can recover a user id by
    /// hashing candidates — it is pseudonymization, not encryption.
    pub fn redact_keys(mut self, redact: bool) -> Self {
        self.redact_keys = redact.then_some(None);
        self
    }

    /// Redacts keys as [`redact_keys(true)`](Self::redact_keys) does, with a secret of
    /// your own instead of a random one: every process configured with the same secret
    /// shows a key as the same hash, so one key can be followed across replicas' logs.
    /// Keep the secret as secret as the keys: whoever has it can test guesses.
    pub fn redact_keys_with(mut self, secret: [u8; 16]) -> Self {
        self.redact_keys = Some(Some(secret));
        self
    }

    /// Builds the client.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`] naming `watchdog_lease` when it is out of range, or
    /// `name` when the name is empty, too long, or has whitespace or control characters.
    pub fn build(self) -> Result<LockClient, ConfigError> {
        let lease = self.watchdog_lease.unwrap_or(DEFAULT_WATCHDOG_LEASE);
        let lease = validate_watchdog_lease(lease)?;
        let name = self.name.as_deref().map(validate_name).transpose()?;
        Ok(LockClient::with_parts(
            self.backend,
            lease,
            Hooks::new(self.observer, self.redact_keys),
            name,
            self.outage_grace,
        ))
    }
}

fn validate_name(name: &str) -> Result<Arc<str>, ConfigError> {
    if name.is_empty()
        || name.len() > MAX_CLIENT_NAME_LEN
        || name.chars().any(|c| c.is_whitespace() || c.is_control())
    {
        return Err(ConfigError::invalid_setting(
            "name",
            format!(
                "must be 1 to {MAX_CLIENT_NAME_LEN} bytes without whitespace or control characters (got {name:?})"
            ),
        ));
    }
    Ok(Arc::from(name))
}

/// A handle on one lock: a key, a mode and a client. Acquiring returns a [`LockGuard`].
///
/// The handle holds nothing by itself; make as many as you like. It acquires as the
/// owner set with [`Lock::with_owner`], else the current [`Owner::scope`], else a fresh
/// owner per acquisition (so, outside a scope, a second acquisition of a held key waits
/// instead of re-entering).
#[derive(Clone)]
pub struct Lock {
    client: LockClient,
    key: LockKey,
    mode: LockMode,
    owner: Option<Owner>,
    fenced: bool,
}

impl Lock {
    /// Acquires as `owner` rather than the current or a fresh one.
    #[must_use]
    pub fn with_owner(mut self, owner: Owner) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The same lock with fencing tokens: every guard carries a [`FencingToken`](crate::FencingToken) (see
    /// [`LockClient::get_fenced_lock`]). A fenced and a plain lock of one name are the
    /// same lock to other owners; one owner holding both holds them as two holds, so it
    /// waits for itself, as with two kinds of lock on one name.
    #[must_use]
    pub fn fenced(mut self) -> Self {
        self.fenced = true;
        self
    }

    /// Whether guards of this lock carry fencing tokens.
    pub fn is_fenced(&self) -> bool {
        self.fenced
    }

    /// The key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The mode.
    pub fn mode(&self) -> LockMode {
        self.mode
    }

    /// The client.
    pub fn client(&self) -> &LockClient {
        &self.client
    }

    /// Waits as long as it takes, then holds the lock with the watchdog (Redisson
    /// `lock()`).
    ///
    /// # Errors
    ///
    /// Backend errors; never [`Error::Busy`]. Without a deadline there is no time to
    /// spend on an outage: one that meets the first attempt is returned at once (after
    /// one more try if the connection had to be replaced), and one met while waiting
    /// is returned once the store has failed for a whole watchdog lease.
    pub async fn lock(&self) -> Result<LockGuard> {
        acquire::acquire(self, None, Lease::Watchdog).await
    }

    /// One attempt, no waiting; holds with the watchdog (Redisson `tryLock()`).
    ///
    /// # Errors
    ///
    /// [`Error::Busy`] with the holder's remaining lease when another owner holds it.
    pub async fn try_lock(&self) -> Result<LockGuard> {
        acquire::acquire(self, Some(Duration::ZERO), Lease::Watchdog).await
    }

    /// Waits up to `wait` (zero: one attempt; too large to represent: forever), then
    /// holds with `lease` — a fixed [`Duration`] (no watchdog) or [`Lease::Watchdog`]
    /// (Redisson `tryLock(waitTime, leaseTime)`).
    ///
    /// # Errors
    ///
    /// [`Error::Busy`] when the wait runs out, [`ConfigError::InvalidSetting`] for a lease
    /// outside [`MIN_LEASE`](crate::MIN_LEASE)..=[`MAX_LEASE`](crate::MAX_LEASE). A
    /// store outage (a failover, a restart, no quorum) is ridden out within `wait`,
    /// trying again with backoff; when the wait runs out during one, the error is the
    /// outage's ([`Error::is_unavailable`]), not [`Error::Busy`].
    pub async fn try_lock_for(&self, wait: Duration, lease: impl Into<Lease>) -> Result<LockGuard> {
        acquire::acquire(self, Some(wait), lease.into()).await
    }

    /// Removes the lock whoever holds it (Redisson `forceUnlock`); returns whether it
    /// was held. The holders find out at their next renewal (their lost signal fires) or
    /// unlock.
    ///
    /// Only this kind of lock is removed: a read-write or permit lock of the same name is
    /// left alone (and `false` returned). The exclusive and the fair lock of a name are one
    /// lock in the store (Redisson's layout), so forcing either removes it.
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn force_unlock(&self) -> Result<bool> {
        admin_of(self.client.backend().as_ref())?
            .force_release(&self.key, self.mode)
            .await
    }

    /// What the store holds for this lock's name right now: every hold ([`HoldInfo`](crate::HoldInfo):
    /// its identity, mode, count, remaining lease, token), the name's newest fencing token, and who waits
    /// (see [`Waiters`](crate::backend::Waiters) for whose waiters are counted). Each
    /// holder's `client` is the name its client registered
    /// ([`LockClientBuilder::name`]); for this client's own holds, `since` and `guards`
    /// are filled in too. Changes nothing.
    ///
    /// ```
    /// use tower_lock::{LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_lock::Error> {
    /// let client = LockClient::new(MemoryBackend::new());
    /// let lock = client.get_lock("order:{42}")?;
    /// assert!(!lock.is_locked().await?);
    /// let guard = lock.lock().await?;
    /// let state = lock.inspect().await?;
    /// assert_eq!(state.holders.len(), 1);
    /// assert_eq!(state.holders[0].hold_id, *guard.hold_id());
    /// assert_eq!(state.holders[0].guards, Some(1));
    /// assert!(state.remaining_lease().is_some());
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// Backend errors. A client name that cannot be read is left out, not an error.
    pub async fn inspect(&self) -> Result<LockState> {
        let mut state = self.raw_state().await?;
        self.client.annotate(&self.key, &mut state).await;
        Ok(state)
    }

    /// Whether anyone holds this lock's name (Redisson `isLocked`).
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn is_locked(&self) -> Result<bool> {
        Ok(self.raw_state().await?.is_locked())
    }

    /// The longest lease still running among the holders; `None` when nobody holds it
    /// (Redisson `remainTimeToLive`; `Duration::MAX` for a hold without expiry).
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn remaining_lease(&self) -> Result<Option<Duration>> {
        Ok(self.raw_state().await?.remaining_lease())
    }

    /// How many guards the logical `owner` has on its live hold of this lock (Redisson
    /// `getHoldCount`): its re-entries, counted by this client. Zero when it does not
    /// hold it here. For a hold in the store by its identity (another process's, a
    /// Redisson client's), see [`hold_count_in_store`](Self::hold_count_in_store).
    ///
    /// # Errors
    ///
    /// None today; a `Result` so that a store may be asked in the future.
    pub async fn hold_count(&self, owner: &Owner) -> Result<u32> {
        Ok(self
            .client
            .registry()
            .guards_of(&self.key, owner, self.mode)
            .unwrap_or(0))
    }

    /// How many times the store counts the hold `hold_id` on this lock's name: a
    /// [`LockGuard::hold_id`], a hold another process took, a Redisson
    /// `<uuid>:<thread id>`. A [`LockClient`] counts re-entries itself, so its holds
    /// count 1 here. Zero when the store has no such hold.
    ///
    /// # Errors
    ///
    /// Backend errors.
    pub async fn hold_count_in_store(&self, hold_id: &HoldId) -> Result<u32> {
        let state = self.raw_state().await?;
        Ok(state
            .holders
            .iter()
            .filter(|h| h.hold_id == *hold_id)
            .map(|h| h.holds)
            .sum())
    }

    /// Runs `work` under this lock: waits for it as [`lock`](Self::lock) does, holds it
    /// with the watchdog, and unlocks once `work` is done. `work` gets a [`HeldLock`],
    /// as a handler under the layer does: the key, the fencing token, the owner, the
    /// lost signal.
    ///
    /// If the lock is lost before `work` is done, `work` is dropped where it stands (at
    /// its current `.await`) and [`Error::Lost`] returned: nothing after that point runs
    /// unprotected. Work that must not be cut short should check
    /// [`HeldLock::lost`] or write with the fencing token instead.
    ///
    /// ```
    /// use tower_lock::{LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), tower_lock::Error> {
    /// let client = LockClient::new(MemoryBackend::new());
    /// let lock = client.get_fenced_lock("ledger:7")?;
    /// let token = lock
    ///     .with_lock(|held| async move {
    ///         // Write with the token, so storage can refuse a stale writer.
    ///         held.fencing_token()
    ///     })
    ///     .await?;
    /// assert!(token.is_some());
    /// assert!(!lock.is_locked().await?, "unlocked after the work");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The errors of [`lock`](Self::lock); [`Error::Lost`] when the lock was lost before
    /// `work` was done, or found lost when unlocking after it. A store error while
    /// unlocking a lock that was not lost is logged, not returned: `work` was done
    /// under the lock, and the release is tried again as [`LockGuard::unlock`] says.
    ///
    /// # Cancel safety
    ///
    /// Dropping the returned future drops `work` and the guard: the lock is released in
    /// a spawned task, as for any dropped guard.
    pub async fn with_lock<T, F, Fut>(&self, work: F) -> Result<T>
    where
        F: FnOnce(HeldLock) -> Fut,
        Fut: Future<Output = T>,
    {
        guard::run_locked(self.lock().await?, work).await
    }

    /// [`with_lock`](Self::with_lock), acquired as
    /// [`try_lock_for(wait, lease)`](Self::try_lock_for): waits at most `wait`, holds with
    /// `lease` (a fixed lease ends the hold, and so `work`, when it runs out).
    ///
    /// ```
    /// use std::time::Duration;
    /// use tower_lock::{Error, Lease, LockClient, MemoryBackend};
    ///
    /// # #[tokio::main(flavor = "current_thread", start_paused = true)]
    /// # async fn main() -> Result<(), Error> {
    /// let client = LockClient::new(MemoryBackend::new());
    /// let lock = client.get_lock("report:daily")?;
    /// let outcome = lock
    ///     .with_lock_for(Duration::ZERO, Duration::from_millis(100), |_held| async {
    ///         tokio::time::sleep(Duration::from_secs(1)).await; // outlives the lease
    ///         "done"
    ///     })
    ///     .await;
    /// assert!(matches!(outcome, Err(Error::Lost)), "the work was stopped");
    /// # Ok(())
    /// # }
    /// ```
    ///
    /// # Errors
    ///
    /// The errors of [`try_lock_for`](Self::try_lock_for) ([`Error::Busy`] when the
    /// wait runs out) and of [`with_lock`](Self::with_lock).
    pub async fn with_lock_for<T, F, Fut>(
        &self,
        wait: Duration,
        lease: impl Into<Lease>,
        work: F,
    ) -> Result<T>
    where
        F: FnOnce(HeldLock) -> Fut,
        Fut: Future<Output = T>,
    {
        guard::run_locked(self.try_lock_for(wait, lease).await?, work).await
    }

    async fn raw_state(&self) -> Result<LockState> {
        admin_of(self.client.backend().as_ref())?
            .inspect(&self.key, self.mode)
            .await
    }
}

impl std::fmt::Debug for Lock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lock")
            .field("key", &self.key)
            .field("mode", &self.mode)
            .field("owner", &self.owner)
            .field("fenced", &self.fenced)
            .finish()
    }
}
