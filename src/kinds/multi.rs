//! MultiLock: several locks, all or none.

use std::cmp::Ordering;
use std::fmt;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{FencingToken, LockMode};
use crate::error::Result;
use crate::lock::acquire::{acquire_as, deadline_after};
use crate::lock::{Guards, Lease, Lock, LockGuard, LostSignal};
use crate::owner::Owner;

/// Several locks taken as one (Redisson `RedissonMultiLock`): all of them or none.
///
/// - The locks may live on different clients and backends.
/// - They are taken in one deterministic order (by key, then mode, then the store's
///   identity), the same in every process, so two MultiLocks over `{a, b}` and
///   `{b, a}` cannot deadlock each other. Duplicates are taken once.
/// - One name in two kinds (an exclusive and a fair lock of `k`) are two holds of one
///   owner that exclude each other: a MultiLock over both never succeeds (with a
///   deadline it reports [`Error::Busy`](crate::Error::Busy)).
/// - One owner acts for all of them: the MultiLock's own ([`MultiLock::with_owner`]), else
///   the current [`Owner::scope`], else a fresh one.
/// - One deadline bounds the whole acquisition and one lease applies to every lock. With
///   a fixed lease, each lock is first taken with the lease plus the wait left, so none
///   runs out while later ones are waited for, then each is extended to last at least
///   the lease once every lock is held. Stores never shorten a lease (see
///   [`LockBackend::renew`](crate::backend::LockBackend::renew)), so a fixed lease means
///   *at least* the lease: a lock taken early keeps what is left of the lease plus the
///   wait (a crashed holder's locks may stay that long), and a lock an outer guard of
///   the same owner held longer keeps its longer lease. (Redisson sets every lock to
///   exactly the lease, which can cut a lease another guard still counts on.)
/// - If any lock cannot be taken before the deadline, those already taken are released
///   before the error is returned.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{Lease, LockClient, MemoryBackend};
/// use tower_lock::kinds::MultiLock;
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_lock::Error> {
/// let client = LockClient::new(MemoryBackend::new());
/// let transfer = MultiLock::new([client.get_lock("account:2")?, client.get_lock("account:1")?]);
/// let both = transfer.try_lock_for(Duration::from_secs(1), Lease::Watchdog).await?;
/// assert_eq!(both.guards()[0].key().as_str(), "account:1"); // sorted
/// both.unlock().await?;
/// # Ok(())
/// # }
/// ```
///
/// # Cancel safety
///
/// Dropping the acquire future drops the guards taken so far, which release in spawned
/// tasks; the lock being waited on is left as [`Lock`] leaves it.
#[derive(Clone)]
pub struct MultiLock {
    locks: Vec<Lock>,
    owner: Option<Owner>,
}

fn mode_rank(mode: LockMode) -> (u8, u32) {
    match mode {
        LockMode::Exclusive => (0, 0),
        LockMode::Fair => (1, 0),
        LockMode::Read => (2, 0),
        LockMode::Write => (3, 0),
        LockMode::Permits { max } => (4, max.get()),
    }
}

/// The order every process takes locks in: by key, then mode, then the store's identity
/// (the same in every process, unlike a client's id), then fenced after plain.
fn order(a: &Lock, b: &Lock) -> Ordering {
    a.key()
        .cmp(b.key())
        .then_with(|| mode_rank(a.mode()).cmp(&mode_rank(b.mode())))
        .then_with(|| {
            let (sa, sb) = (a.client().backend(), b.client().backend());
            if std::sync::Arc::ptr_eq(sa, sb) {
                Ordering::Equal
            } else {
                sa.profile().store_id().cmp(sb.profile().store_id())
            }
        })
        .then_with(|| a.is_fenced().cmp(&b.is_fenced()))
}

impl MultiLock {
    /// All of `locks`, in their canonical order: by key, then mode, then the store's
    /// [identity](crate::backend::StoreProfile::store_id), so every process takes the
    /// same locks in the same order. Locks equal in all three are one lock, taken once.
    /// Each lock's own owner, if it has one, is ignored: the MultiLock acts as one owner.
    pub fn new(locks: impl IntoIterator<Item = Lock>) -> Self {
        let mut locks: Vec<Lock> = locks.into_iter().collect();
        locks.sort_by(order);
        locks.dedup_by(|a, b| order(a, b) == Ordering::Equal);
        MultiLock { locks, owner: None }
    }

    /// Acquires as `owner`.
    #[must_use]
    pub fn with_owner(mut self, owner: Owner) -> Self {
        self.owner = Some(owner);
        self
    }

    /// The locks, in acquisition order.
    pub fn locks(&self) -> &[Lock] {
        &self.locks
    }

    /// Waits as long as it takes for all; holds them with the watchdog.
    ///
    /// # Errors
    ///
    /// Backend errors (after releasing what was taken).
    pub async fn lock(&self) -> Result<MultiGuard> {
        self.acquire(None, Lease::Watchdog).await
    }

    /// One attempt at each lock, no waiting.
    ///
    /// # Errors
    ///
    /// [`Error::Busy`](crate::Error::Busy) when any lock is held elsewhere (after
    /// releasing what was taken).
    pub async fn try_lock(&self) -> Result<MultiGuard> {
        self.acquire(Some(Duration::ZERO), Lease::Watchdog).await
    }

    /// Waits up to `wait` in all, then holds every lock with `lease`.
    ///
    /// # Errors
    ///
    /// [`Error::Busy`](crate::Error::Busy) when the wait runs out, with the remaining
    /// lease of the holder that blocked; nothing stays locked.
    pub async fn try_lock_for(
        &self,
        wait: Duration,
        lease: impl Into<Lease>,
    ) -> Result<MultiGuard> {
        self.acquire(Some(wait), lease.into()).await
    }

    async fn acquire(&self, wait: Option<Duration>, lease: Lease) -> Result<MultiGuard> {
        let Some(first) = self.locks.first() else {
            return Ok(MultiGuard::new(Guards::from_vec(Vec::new())));
        };
        let owner = self
            .owner
            .clone()
            .or_else(Owner::current)
            .unwrap_or_else(|| first.client().new_owner());
        self.acquire_as(owner, wait, lease)
            .await
            .map(MultiGuard::new)
    }

    /// Acquires all as `owner` (the middleware passes the request's owner).
    pub(crate) async fn acquire_as(
        &self,
        owner: Owner,
        wait: Option<Duration>,
        lease: Lease,
    ) -> Result<Guards> {
        let deadline = deadline_after(wait);
        // With a fixed lease, a lock taken early must not run out while the later ones
        // are waited for: each is taken with the lease plus the wait left (Redisson's
        // approach), and all are extended to at least the lease once held.
        let pinned = match lease {
            Lease::Fixed(exact) if self.locks.len() > 1 => Some(exact),
            _ => None,
        };
        loop {
            let per_lock = match (pinned, deadline) {
                (Some(exact), Some(deadline)) => {
                    let left = deadline.saturating_duration_since(Instant::now());
                    Lease::Fixed(exact.saturating_add(left).min(crate::MAX_LEASE))
                }
                _ => lease,
            };
            let mut guards = Vec::with_capacity(self.locks.len());
            for lock in &self.locks {
                match acquire_as(lock, Some(owner.clone()), deadline, per_lock).await {
                    Ok(guard) => guards.push(guard),
                    Err(error) => {
                        rollback(guards).await;
                        return Err(error);
                    }
                }
            }
            let Some(exact) = pinned else {
                return Ok(Guards::from_vec(guards));
            };
            let mut all_held = true;
            for guard in &mut guards {
                // Extends only: a re-entered hold keeps its longer lease, if it has one.
                match guard.pin_lease(exact).await {
                    Ok(true) => {}
                    Ok(false) => all_held = false,
                    Err(error) => {
                        rollback(guards).await;
                        return Err(error);
                    }
                }
            }
            if all_held {
                return Ok(Guards::from_vec(guards));
            }
            // A lock ran out while the others were waited for (only possible without a
            // deadline, whose leases cannot be stretched to cover it): start over.
            rollback(guards).await;
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(crate::Error::Busy { holder_ttl: None });
            }
        }
    }
}

/// Releases a partial acquisition, last taken first.
async fn rollback(guards: Vec<LockGuard>) {
    for guard in guards.into_iter().rev() {
        if let Err(e) = guard.unlock().await {
            tracing::debug!(error = %e, "rolling back a partial MultiLock");
        }
    }
}

impl fmt::Debug for MultiLock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list()
            .entries(self.locks.iter().map(Lock::key))
            .finish()
    }
}

/// Every lock of a [`MultiLock`], held.
#[must_use = "the locks are released as soon as the guard is dropped"]
#[derive(Debug)]
pub struct MultiGuard {
    guards: Guards,
}

impl MultiGuard {
    pub(crate) fn new(guards: Guards) -> Self {
        MultiGuard { guards }
    }

    /// The held locks, in acquisition order.
    pub fn guards(&self) -> &[LockGuard] {
        self.guards.as_slice()
    }

    /// Each lock's fencing token (`None` for a lock that is not fenced), in acquisition
    /// order.
    pub fn fencing_tokens(&self) -> Vec<Option<FencingToken>> {
        self.guards.fencing_tokens()
    }

    /// Fires as soon as any of the locks is lost.
    pub fn lost(&self) -> LostSignal {
        self.guards.lost()
    }

    /// Whether any of the locks has been lost.
    pub fn is_lost(&self) -> bool {
        self.guards.is_lost()
    }

    /// The guards, to release separately.
    pub fn into_guards(self) -> Vec<LockGuard> {
        self.guards.into_vec()
    }

    /// Releases every lock, all at once, even when some fail.
    ///
    /// # Errors
    ///
    /// [`Error::Lost`](crate::Error::Lost) when any lock had been lost, whatever else
    /// failed (a store that could not release another lock does not hide it); else the
    /// first error met, in lock order.
    pub async fn unlock(self) -> Result<()> {
        self.guards.unlock().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LockClient, MemoryBackend};

    /// Two processes — two clients with different ids — over the same two stores take
    /// the same key in the same order: by the store's identity, not the client's.
    #[test]
    fn the_order_is_the_stores_not_the_clients() {
        let (a, b) = (MemoryBackend::new(), MemoryBackend::new());
        let store_order = |multi: &MultiLock| -> Vec<String> {
            multi
                .locks()
                .iter()
                .map(|l| l.client().backend().profile().store_id().to_owned())
                .collect()
        };
        let mut seen = Vec::new();
        for _ in 0..8 {
            let (on_a, on_b) = (LockClient::new(a.clone()), LockClient::new(b.clone()));
            let multi = MultiLock::new([on_b.get_lock("k").unwrap(), on_a.get_lock("k").unwrap()]);
            assert_eq!(multi.locks().len(), 2);
            seen.push(store_order(&multi));
        }
        assert!(seen.windows(2).all(|w| w[0] == w[1]), "{seen:?}");

        // The same lock through two clients of one store is one lock.
        let (c1, c2) = (LockClient::new(a.clone()), LockClient::new(a.clone()));
        let multi = MultiLock::new([c1.get_lock("k").unwrap(), c2.get_lock("k").unwrap()]);
        assert_eq!(multi.locks().len(), 1);
    }
}
