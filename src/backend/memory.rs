//! The in-process backend: one process, tests, demos.
//!
//! [`MemoryBackend`] keeps lock state in a map behind a mutex that is only ever held for
//! a few map operations, never across an `.await`. It keeps the same semantics as the
//! Redis backend, so code tested against it behaves the same in production:
//!
//! - leases really expire (tokio time, so `tokio::time::pause` works in tests);
//! - reentrant holds are counted;
//! - fencing tokens come from one counter for the whole backend, so they are strictly
//!   increasing per key across holders (and across keys);
//! - a release wakes one waiter (a [`tokio::sync::Notify`] per key), not all of them;
//! - a key that nobody holds or waits on has no entry: the map does not grow with the
//!   number of distinct keys ever locked. Entries whose lease expired with nobody
//!   waiting are swept on later operations.
//!
//! Clones share the same state.
//!
//! # Example
//!
//! ```
//! use tower_lock::{LockClient, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! let backend = MemoryBackend::new();
//! let client = LockClient::new(backend.clone());
//! let guard = client.get_lock("k")?.lock().await?;
//! assert_eq!(backend.len(), 1);
//! guard.unlock().await?;
//! assert_eq!(backend.len(), 0);
//! # Ok(())
//! # }
//! ```
//!
//! # Cancel safety
//!
//! Every operation completes within its first poll; dropping the returned future before
//! that changes nothing. Dropping a [`Subscription`] unregisters the waiter at once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use super::{
    Acquire, BoxFuture, FencingToken, Grant, LockBackend, LockMode, LockRequest, Release,
    Subscription, Wake,
};
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// An in-process lock store. See the [module docs](self).
#[derive(Clone, Default)]
pub struct MemoryBackend {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    table: Mutex<Table>,
    fence: AtomicU64,
    watchdog_lease: Option<Duration>,
}

#[derive(Default)]
struct Table {
    map: HashMap<LockKey, Entry>,
    /// Map size after the last sweep; the next sweep runs when it has doubled.
    swept_len: usize,
}

struct Entry {
    holder: Option<Hold>,
    notify: Arc<Notify>,
    subscribers: usize,
}

struct Hold {
    owner: Owner,
    holds: u32,
    token: FencingToken,
    /// `None`: the lease is too long to represent, i.e. no expiry.
    expires_at: Option<Instant>,
}

impl Hold {
    fn live(&self, now: Instant) -> bool {
        self.expires_at.is_none_or(|at| at > now)
    }
}

impl Entry {
    fn new() -> Self {
        Entry {
            holder: None,
            notify: Arc::new(Notify::new()),
            subscribers: 0,
        }
    }

    /// Drops an expired holder; returns the live one.
    fn live_holder(&mut self, now: Instant) -> Option<&mut Hold> {
        if self.holder.as_ref().is_some_and(|h| !h.live(now)) {
            self.holder = None;
        }
        self.holder.as_mut()
    }

    fn is_unused(&self, now: Instant) -> bool {
        self.subscribers == 0 && self.holder.as_ref().is_none_or(|h| !h.live(now))
    }
}

impl MemoryBackend {
    /// A new, empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// A new store whose clients default to `lease` for the watchdog (instead of
    /// [`DEFAULT_WATCHDOG_LEASE`](crate::DEFAULT_WATCHDOG_LEASE)).
    pub fn with_watchdog_lease(lease: Duration) -> Self {
        MemoryBackend {
            shared: Arc::new(Shared {
                watchdog_lease: Some(lease),
                ..Shared::default()
            }),
        }
    }

    /// How many keys have an entry: held, or waited on. Expired, unwatched entries are
    /// swept first, so this is 0 when nothing is held or awaited.
    pub fn len(&self) -> usize {
        let mut table = self.table();
        table.sweep(Instant::now());
        table.map.len()
    }

    /// Whether no key is held or waited on.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` has an entry: it is held or waited on (expired, unwatched entries
    /// are swept first).
    pub fn contains_key(&self, key: &LockKey) -> bool {
        let now = Instant::now();
        let mut table = self.table();
        table.remove_if_unused(key, now);
        table.map.contains_key(key)
    }

    /// How many subscriptions (waiters) are registered for `key`.
    pub fn waiters(&self, key: &LockKey) -> usize {
        self.table().map.get(key).map_or(0, |e| e.subscribers)
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // Critical sections never panic, but a poisoned map is still consistent: every
        // change to an entry is completed before anything that could panic.
        self.shared
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn check_mode(&self, mode: LockMode) -> Result<()> {
        match mode {
            LockMode::Exclusive => Ok(()),
            mode => Err(Error::Unsupported {
                backend: "memory",
                mode,
            }),
        }
    }

    fn next_token(&self) -> FencingToken {
        FencingToken::new(self.shared.fence.fetch_add(1, Ordering::Relaxed) + 1)
    }

    fn acquire_now(&self, req: &LockRequest) -> Result<Acquire> {
        self.check_mode(req.mode)?;
        let now = Instant::now();
        let expires_at = now.checked_add(req.lease);
        let mut table = self.table();
        table.maybe_sweep(now);
        let entry = table.map.entry(req.key.clone()).or_insert_with(Entry::new);
        let outcome = match entry.live_holder(now) {
            Some(hold) if hold.owner == req.owner => {
                hold.holds = hold.holds.saturating_add(1);
                hold.expires_at = expires_at;
                Acquire::Acquired(Grant::new(hold.holds, hold.token))
            }
            Some(hold) => Acquire::Busy {
                ttl: hold.expires_at.map(|at| at.saturating_duration_since(now)),
            },
            None => {
                let token = self.next_token();
                entry.holder = Some(Hold {
                    owner: req.owner.clone(),
                    holds: 1,
                    token,
                    expires_at,
                });
                Acquire::Acquired(Grant::new(1, token))
            }
        };
        Ok(outcome)
    }

    fn renew_now(table: &mut Table, req: &LockRequest, now: Instant) -> bool {
        let Some(entry) = table.map.get_mut(&req.key) else {
            return false;
        };
        match entry.live_holder(now) {
            Some(hold) if hold.owner == req.owner => {
                hold.expires_at = now.checked_add(req.lease);
                true
            }
            _ => {
                table.remove_if_unused(&req.key, now);
                false
            }
        }
    }

    fn release_now(&self, req: &LockRequest) -> Result<Release> {
        self.check_mode(req.mode)?;
        let now = Instant::now();
        let mut table = self.table();
        let Some(entry) = table.map.get_mut(&req.key) else {
            return Ok(Release::NotHeld);
        };
        let outcome = match entry.live_holder(now) {
            Some(hold) if hold.owner == req.owner => {
                if hold.holds > 1 {
                    hold.holds -= 1;
                    hold.expires_at = now.checked_add(req.lease);
                    Release::Decremented { holds: hold.holds }
                } else {
                    entry.holder = None;
                    if entry.subscribers > 0 {
                        entry.notify.notify_one();
                    }
                    Release::Released
                }
            }
            _ => Release::NotHeld,
        };
        table.remove_if_unused(&req.key, now);
        Ok(outcome)
    }
}

impl Table {
    fn remove_if_unused(&mut self, key: &LockKey, now: Instant) {
        if self.map.get(key).is_some_and(|e| e.is_unused(now)) {
            self.map.remove(key);
        }
    }

    fn sweep(&mut self, now: Instant) {
        self.map.retain(|_, e| !e.is_unused(now));
        self.swept_len = self.map.len();
    }

    /// Sweeps expired, unwatched entries once the map has doubled since the last sweep:
    /// amortized O(1) per operation, and the map stays within twice the live keys.
    fn maybe_sweep(&mut self, now: Instant) {
        if self.map.len() >= 2 * self.swept_len.max(512) {
            self.sweep(now);
        }
    }
}

impl LockBackend for MemoryBackend {
    fn name(&self) -> &'static str {
        "memory"
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move { self.acquire_now(req) })
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            self.check_mode(req.mode)?;
            Ok(Self::renew_now(&mut self.table(), req, Instant::now()))
        })
    }

    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut table = self.table();
            reqs.iter()
                .map(|req| {
                    self.check_mode(req.mode)?;
                    Ok(Self::renew_now(&mut table, req, now))
                })
                .collect()
        })
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move { self.release_now(req) })
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            self.check_mode(req.mode)?;
            let mut table = self.table();
            let entry = table.map.entry(req.key.clone()).or_insert_with(Entry::new);
            entry.subscribers += 1;
            let sub: Box<dyn Subscription> = Box::new(MemorySubscription {
                backend: self.clone(),
                key: req.key.clone(),
                notify: Arc::clone(&entry.notify),
            });
            Ok(sub)
        })
    }

    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            self.check_mode(mode)?;
            let now = Instant::now();
            let mut table = self.table();
            let Some(entry) = table.map.get_mut(key) else {
                return Ok(false);
            };
            let held = entry.live_holder(now).is_some();
            entry.holder = None;
            if held && entry.subscribers > 0 {
                entry.notify.notify_one();
            }
            table.remove_if_unused(key, now);
            Ok(held)
        })
    }

    fn watchdog_lease(&self) -> Option<Duration> {
        self.shared.watchdog_lease
    }
}

struct MemorySubscription {
    backend: MemoryBackend,
    key: LockKey,
    notify: Arc<Notify>,
}

impl Subscription for MemorySubscription {
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        Box::pin(async move {
            match tokio::time::timeout_at(deadline, self.notify.notified()).await {
                Ok(()) => Wake::Notified,
                Err(_) => Wake::Deadline,
            }
        })
    }

    fn pass_on(&mut self) {
        self.notify.notify_one();
    }
}

impl Drop for MemorySubscription {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut table = self.backend.table();
        if let Some(entry) = table.map.get_mut(&self.key) {
            entry.subscribers = entry.subscribers.saturating_sub(1);
        }
        table.remove_if_unused(&self.key, now);
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("keys", &self.table().map.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(key: &str, owner: &str, lease_ms: u64) -> LockRequest {
        LockRequest::new(
            LockKey::new(key).unwrap(),
            Owner::from_raw(owner).unwrap(),
            LockMode::Exclusive,
            Duration::from_millis(lease_ms),
        )
    }

    fn grant(a: Acquire) -> Grant {
        match a {
            Acquire::Acquired(g) => g,
            busy => panic!("expected a grant, got {busy:?}"),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn leases_expire_in_tokio_time() {
        let b = MemoryBackend::new();
        let a = req("k", "a:1", 1000);
        let other = req("k", "b:1", 1000);
        grant(b.acquire(&a).await.unwrap());
        tokio::time::advance(Duration::from_millis(400)).await;
        assert_eq!(
            b.acquire(&other).await.unwrap(),
            Acquire::Busy {
                ttl: Some(Duration::from_millis(600))
            }
        );
        tokio::time::advance(Duration::from_millis(600)).await;
        assert!(
            !b.renew(&a).await.unwrap(),
            "expired holds cannot be renewed"
        );
        assert_eq!(b.len(), 0, "an expired, unwatched entry is swept");
        grant(b.acquire(&other).await.unwrap());
    }

    #[tokio::test]
    async fn reentrant_holds_keep_their_token() {
        let b = MemoryBackend::new();
        let a = req("k", "a:1", 10_000);
        let first = grant(b.acquire(&a).await.unwrap());
        let second = grant(b.acquire(&a).await.unwrap());
        assert_eq!((first.holds(), second.holds()), (1, 2));
        assert_eq!(first.token(), second.token());
        assert_eq!(
            b.release(&a).await.unwrap(),
            Release::Decremented { holds: 1 }
        );
        assert_eq!(b.release(&a).await.unwrap(), Release::Released);
        assert_eq!(b.release(&a).await.unwrap(), Release::NotHeld);
        let third = grant(b.acquire(&a).await.unwrap());
        assert!(third.token() > first.token());
    }

    #[tokio::test]
    async fn unsupported_modes_are_typed_errors() {
        let b = MemoryBackend::new();
        let mut r = req("k", "a:1", 1000);
        r.mode = LockMode::Write;
        assert!(matches!(
            b.acquire(&r).await,
            Err(Error::Unsupported {
                backend: "memory",
                mode: LockMode::Write
            })
        ));
    }

    #[tokio::test]
    async fn huge_lease_means_no_expiry() {
        let b = MemoryBackend::new();
        let mut a = req("k", "a:1", 0);
        a.lease = Duration::MAX;
        grant(b.acquire(&a).await.unwrap());
        assert_eq!(
            b.acquire(&req("k", "b:1", 10)).await.unwrap(),
            Acquire::Busy { ttl: None }
        );
    }

    #[tokio::test]
    async fn release_wakes_one_waiter_and_entries_go_away() {
        let b = MemoryBackend::new();
        let a = req("k", "a:1", 10_000);
        grant(b.acquire(&a).await.unwrap());
        let mut s1 = b.subscribe(&req("k", "w:1", 10)).await.unwrap();
        let mut s2 = b.subscribe(&req("k", "w:2", 10)).await.unwrap();
        assert_eq!(b.waiters(&a.key), 2);
        b.release(&a).await.unwrap();
        let soon = Instant::now() + Duration::from_millis(50);
        // The release left one stored wake-up: exactly one of the two waiters gets it.
        let w1 = s1.wait(soon).await;
        let w2 = s2.wait(soon).await;
        assert_eq!((w1, w2), (Wake::Notified, Wake::Deadline));
        drop((s1, s2));
        assert_eq!(b.len(), 0);
    }

    #[tokio::test]
    async fn sweep_bounds_the_map() {
        let b = MemoryBackend::new();
        for i in 0..5000 {
            // 1 ms leases that nobody releases.
            grant(b.acquire(&req(&format!("k{i}"), "a:1", 1)).await.unwrap());
            if i % 1000 == 0 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
        assert!(
            b.table().map.len() < 5000,
            "acquire sweeps as the map grows"
        );
        assert_eq!(b.len(), 0);
    }
}
