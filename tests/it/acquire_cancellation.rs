//! Cancellation inside the acquire loop, made deterministic with a backend wrapper that
//! can stall an acquire call (as a slow network would) before or after it takes effect.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::wait_until;
use tokio::time::Instant;
use tower_lock::backend::{
    Acquire, BoxFuture, ClockDrift, Intercept, Intercepted, LockBackend, LockRequest, Release,
    StoreProfile, Subscription,
};
use tower_lock::{Lease, LockClient, LockKey, MemoryBackend, Result, StoreError, StoreErrorKind};

#[derive(Clone, Default)]
struct Stalls {
    /// Acquire calls never reach the store: every one (`usize::MAX`) or the next n.
    before: usize,
    /// Acquire calls take effect in the store, but the reply never arrives.
    after: bool,
    /// Subscribing never completes (a pub/sub connection that never confirms).
    subscribe: bool,
    /// Renewals never answer (a store that hangs).
    renew: bool,
    /// Releases wait until this is cleared (a slow store).
    release: bool,
    /// The next acquire takes effect in the store, but its reply is lost (an error).
    lose_next_reply: bool,
    /// Every acquire reply takes this long to arrive (a slow network).
    reply_delay: Option<Duration>,
    /// The next acquire fails without ever reaching the store.
    fail_next_unsent: bool,
}

impl Stalls {
    /// Whether the next acquire is stalled or failed: it then goes the async way.
    fn acquire_armed(&self) -> bool {
        self.before > 0
            || self.after
            || self.lose_next_reply
            || self.reply_delay.is_some()
            || self.fail_next_unsent
    }
}

/// A memory store whose calls can be stalled; every call not stalled reaches it through
/// the path production takes (the fast path included).
type Gated = Intercepted<MemoryBackend, Staller>;

/// An injected failure of the store: an outage, as a lost reply or reset connection is.
fn unavailable(what: &str) -> tower_lock::Error {
    StoreError::msg(StoreErrorKind::Unavailable, what).into()
}

fn gated() -> Gated {
    Gated::default()
}

/// A [`gated`] store with a clock-drift allowance, as a quorum backend has.
fn gated_with_drift(drift: Duration) -> Gated {
    let inner = MemoryBackend::new();
    let profile = inner
        .profile()
        .clone()
        .with_clock_drift(ClockDrift::new(0, drift));
    Intercepted::new(
        inner,
        Staller {
            profile: Some(Arc::new(profile)),
            ..Staller::default()
        },
    )
}

#[derive(Clone, Default)]
struct Staller {
    stalls: Arc<Mutex<Stalls>>,
    /// The profile, where it differs from the store's.
    profile: Option<Arc<StoreProfile>>,
}

impl Staller {
    fn stall(&self, f: impl FnOnce(&mut Stalls)) {
        f(&mut self.stalls.lock().unwrap());
    }
}

impl Intercept<MemoryBackend> for Staller {
    fn profile<'a>(&'a self, inner: &'a MemoryBackend) -> &'a StoreProfile {
        self.profile.as_deref().unwrap_or(inner.profile())
    }

    fn acquire<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move {
            let stalls = {
                let mut stalls = self.stalls.lock().unwrap();
                let now = stalls.clone();
                if stalls.before != usize::MAX {
                    stalls.before = stalls.before.saturating_sub(1);
                }
                now
            };
            if stalls.before > 0 {
                std::future::pending::<()>().await;
            }
            if std::mem::take(&mut self.stalls.lock().unwrap().fail_next_unsent) {
                return Err(unavailable("connection reset before sending"));
            }
            let outcome = inner.acquire(req).await;
            if stalls.after {
                std::future::pending::<()>().await;
            }
            if let Some(delay) = stalls.reply_delay {
                tokio::time::sleep(delay).await;
            }
            if std::mem::take(&mut self.stalls.lock().unwrap().lose_next_reply) {
                return Err(unavailable("reply lost in flight"));
            }
            outcome
        })
    }

    fn acquire_now(&self, inner: &MemoryBackend, req: &LockRequest) -> Option<Result<Acquire>> {
        if self.stalls.lock().unwrap().acquire_armed() {
            return None;
        }
        inner.local()?.acquire_now(req)
    }

    fn renew<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if self.stalls.lock().unwrap().renew {
                std::future::pending::<()>().await;
            }
            inner.renew(req).await
        })
    }

    fn renew_many<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        reqs: &'a [LockRequest],
    ) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            if self.stalls.lock().unwrap().renew {
                std::future::pending::<()>().await;
            }
            inner.renew_many(reqs).await
        })
    }

    fn release<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move {
            while self.stalls.lock().unwrap().release {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            inner.release(req).await
        })
    }

    fn release_now(&self, inner: &MemoryBackend, req: &LockRequest) -> Option<Result<Release>> {
        if self.stalls.lock().unwrap().release {
            return None;
        }
        inner.local()?.release_now(req)
    }

    fn subscribe<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            let stall = self.stalls.lock().unwrap().subscribe;
            if stall {
                std::future::pending::<()>().await;
            }
            inner.subscribe(req).await
        })
    }
}

/// W1 is woken by a release and cancelled while its retry is in flight. The wake-up
/// must pass to W2, which otherwise would sleep out the holder's 30 s lease.
#[tokio::test]
async fn cancelled_woken_waiter_passes_the_wakeup_on() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("pass-on").unwrap();
    let holder = client.get_lock(&key).unwrap().lock().await.unwrap();

    let w1_lock = client.get_lock(&key).unwrap();
    let w1 = tokio::spawn(async move { w1_lock.lock().await.map(|_| ()) });
    wait_until(Duration::from_secs(5), "W1 waits", || async {
        backend.inner().waiters(&key) == 1
    })
    .await;
    let w2_lock = client.get_lock(&key).unwrap();
    let w2 = tokio::spawn(async move {
        let guard = w2_lock
            .try_lock_for(Duration::from_secs(20), Lease::Watchdog)
            .await?;
        let at = Instant::now();
        guard.unlock().await?;
        Ok::<_, tower_lock::Error>(at)
    });
    wait_until(Duration::from_secs(5), "W2 waits", || async {
        backend.inner().waiters(&key) == 2
    })
    .await;

    // W1 (first in line) gets the release, and its retry hangs in flight.
    backend.intercept().stall(|s| s.before = 1);
    let released_at = Instant::now();
    holder.unlock().await.unwrap();
    tokio::task::yield_now().await;
    w1.abort();
    assert!(w1.await.unwrap_err().is_cancelled());

    let acquired_at = w2.await.unwrap().unwrap();
    let handoff = acquired_at.duration_since(released_at);
    assert!(
        handoff < Duration::from_secs(2),
        "W2 slept through the release: {handoff:?}"
    );
    wait_until(Duration::from_secs(5), "no entries left", || async {
        backend.inner().is_empty()
    })
    .await;
}

/// An attempt that took the lock in the store but whose reply never came is cancelled:
/// the lock must be released at once, not held until its 30 s lease ends.
#[tokio::test]
async fn attempt_cancelled_in_flight_is_released() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("in-flight").unwrap();
    let lock = client.get_lock(&key).unwrap();

    backend.intercept().stall(|s| s.after = true);
    let stuck = tokio::time::timeout(Duration::from_millis(50), lock.try_lock()).await;
    assert!(stuck.is_err(), "the reply was stalled");
    backend.intercept().stall(|s| s.after = false);

    let started = Instant::now();
    let guard = lock
        .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
        .await
        .expect("the stalled acquisition was released");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    guard.unlock().await.unwrap();
    assert!(backend.inner().is_empty());
}

/// A scoped owner re-enters its hold without the store: with every store call hanging,
/// the re-entry completes at once, and leaving it leaves the outer hold as it was.
#[tokio::test]
async fn scoped_owner_reenters_without_the_store() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("scoped").unwrap();
    let lock = client.get_lock(&key).unwrap();
    let owner = client.new_owner();
    owner
        .scope(async {
            let outer = lock.lock().await.unwrap();
            backend.intercept().stall(|s| s.before = usize::MAX);
            let inner = tokio::time::timeout(Duration::from_millis(50), lock.try_lock())
                .await
                .expect("a re-entry does not ask the store")
                .unwrap();
            assert_eq!(inner.hold_count(), 2);
            assert_eq!(inner.hold_id(), outer.hold_id(), "one hold");
            inner.unlock().await.unwrap();
            backend.intercept().stall(|s| *s = Stalls::default());
            assert!(!outer.is_lost());
            assert_eq!(backend.inner().holders(&key).len(), 1);
            outer.unlock().await.unwrap();
        })
        .await;
    assert!(backend.inner().is_empty());
}

/// A subscription that never completes must not hold a waiter past its deadline.
#[tokio::test(start_paused = true)]
async fn a_stalled_subscribe_does_not_outlast_the_wait() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("slow-subscribe").unwrap();
    let held = client.get_lock(&key).unwrap().lock().await.unwrap();
    backend.intercept().stall(|s| s.subscribe = true);
    let wait = Duration::from_millis(100);
    let started = Instant::now();
    let err = client
        .get_lock(&key)
        .unwrap()
        .try_lock_for(wait, Lease::Watchdog)
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(err.is_busy(), "{err:?}");
    assert_eq!(took, wait, "gave up exactly when the wait ran out");
    held.unlock().await.unwrap();
}

/// Renewals hang: the lost signal still fires when the lease ends, not a renewal period
/// or two later when the watchdog notices.
#[tokio::test(start_paused = true)]
async fn lost_fires_when_the_lease_ends_though_renewals_hang() {
    let backend = gated();
    let lease = Duration::from_millis(300);
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let key = LockKey::new("hang").unwrap();
    backend.intercept().stall(|s| s.renew = true);
    let acquired_at = Instant::now();
    let guard = client.get_lock(&key).unwrap().lock().await.unwrap();
    tokio::time::sleep_until(acquired_at + lease - Duration::from_millis(1)).await;
    assert!(!guard.is_lost(), "lost before the lease ended");
    // Known the moment the lease ends, not at the watchdog's next look.
    guard.lost().wait().await;
    assert_eq!(
        acquired_at.elapsed(),
        lease,
        "lost exactly when the lease ended"
    );
    assert!(guard.is_lost());
    backend.intercept().stall(|s| s.renew = false);
}

/// A renewal counts for the lease less the backend's clock-drift allowance, from when it
/// was sent: with renewals hanging after the first, the loss is known at exactly
/// first renewal + lease − drift.
#[tokio::test(start_paused = true)]
async fn renewals_count_the_lease_less_the_backends_clock_drift() {
    let backend = gated_with_drift(Duration::from_millis(50));
    let lease = Duration::from_millis(300);
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let key = LockKey::new("drift").unwrap();
    let t0 = Instant::now();
    let guard = client.get_lock(&key).unwrap().lock().await.unwrap();
    // The first renewal (at t0 + 100 ms) goes through; the later ones hang.
    tokio::time::sleep_until(t0 + Duration::from_millis(150)).await;
    assert!(!guard.is_lost());
    backend.intercept().stall(|s| s.renew = true);
    guard.lost().wait().await;
    assert_eq!(
        Instant::now() - t0,
        Duration::from_millis(100 + 300 - 50),
        "believed past the first renewal's lease less the drift"
    );
    backend.intercept().stall(|s| s.renew = false);
}

/// `unlock` dropped before the store answers: the release still happens.
#[tokio::test]
async fn an_unlock_dropped_mid_flight_still_releases() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("unlock-dropped").unwrap();
    let guard = client.get_lock(&key).unwrap().lock().await.unwrap();
    backend.intercept().stall(|s| s.release = true);
    assert!(
        tokio::time::timeout(Duration::from_millis(20), guard.unlock())
            .await
            .is_err()
    );
    assert!(
        backend.inner().contains_key(&key),
        "the stalled release has not happened yet"
    );
    backend.intercept().stall(|s| s.release = false);
    wait_until(
        Duration::from_secs(2),
        "the dropped unlock's release completed",
        || async { !backend.inner().contains_key(&key) },
    )
    .await;
}

/// A waiter's attempt takes effect but its reply is lost (as an error). Before retrying,
/// the waiter takes back what the attempt may have done, so the store counts one hold,
/// and its one unlock frees the key: no phantom hold locks everyone out until the lease
/// ends.
#[tokio::test]
async fn a_lost_reply_leaves_no_phantom_hold() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("phantom").unwrap();
    let holder = client.get_lock(&key).unwrap().lock().await.unwrap();
    let waiter_lock = client
        .get_lock(&key)
        .unwrap()
        .with_owner(client.new_owner());
    let waiter = tokio::spawn(async move {
        waiter_lock
            .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
            .await
    });
    wait_until(Duration::from_secs(5), "the waiter waits", || async {
        backend.inner().waiters(&key) == 1
    })
    .await;
    backend.intercept().stall(|s| s.lose_next_reply = true);
    holder.unlock().await.unwrap();
    let guard = waiter
        .await
        .unwrap()
        .expect("the waiter retried after the lost reply");
    assert_eq!(guard.hold_count(), 1, "one guard");
    // The unanswered attempt was taken back before the retry (its hold is the
    // acquisition's own, so that is always safe): the store counts one hold.
    let holders = backend.inner().holders(&key);
    assert_eq!((holders.len(), holders[0].holds), (1, 1));
    guard.unlock().await.unwrap();
    assert!(
        !backend.inner().contains_key(&key),
        "a phantom hold kept the key locked"
    );
    let next = client.get_lock(&key).unwrap().try_lock().await;
    assert!(next.is_ok(), "{next:?}");
}

/// Two permits come back while both waiters are between their attempt and their sleep
/// (their replies are slow). Both releases must count: each waiter gets a permit at once,
/// not one of them at its deadline.
#[tokio::test]
async fn two_releases_in_the_window_wake_two_waiters() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("permit-window").unwrap();
    let permits = client.get_permits(&key, 2).unwrap();
    let h1 = permits.try_lock().await.unwrap();
    let h2 = permits.try_lock().await.unwrap();
    backend
        .intercept()
        .stall(|s| s.reply_delay = Some(Duration::from_millis(50)));
    let started = Instant::now();
    let waiters: Vec<_> = (0..2)
        .map(|_| {
            let permits = permits.clone();
            tokio::spawn(async move {
                let g = permits
                    .try_lock_for(Duration::from_secs(3), Lease::Watchdog)
                    .await?;
                Ok::<_, tower_lock::Error>((Instant::now(), g))
            })
        })
        .collect();
    // Both subscribed: on this one-thread runtime each has also sent its next attempt,
    // which found no permit, and is waiting for the (slow) reply.
    wait_until(
        Duration::from_secs(5),
        "both waiters subscribed",
        || async { backend.inner().waiters(&key) == 2 },
    )
    .await;
    h1.unlock().await.unwrap();
    h2.unlock().await.unwrap();
    // Both hold a permit before either gives one back: no release of ours helps them.
    let mut guards = Vec::new();
    for w in waiters {
        let (at, g) = w.await.unwrap().unwrap();
        let took = at.duration_since(started);
        assert!(
            took < Duration::from_secs(1),
            "a release was lost: a waiter got its permit after {took:?}"
        );
        guards.push(g);
    }
    for g in guards {
        g.unlock().await.unwrap();
    }
}

/// A fresh waiter's attempt fails without reaching the store, and the release that
/// compensates for it is slow. The retry must not win the lock only to have that late
/// release free it behind the new holder's back.
#[tokio::test]
async fn a_late_compensation_never_frees_the_retry_s_lock() {
    let backend = gated();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("compensation-race").unwrap();
    let holder = client.get_lock(&key).unwrap().lock().await.unwrap();
    let lock = client.get_lock(&key).unwrap();
    let waiter = tokio::spawn(async move {
        lock.try_lock_for(Duration::from_secs(5), Lease::Watchdog)
            .await
    });
    wait_until(Duration::from_secs(5), "the waiter waits", || async {
        backend.inner().waiters(&key) == 1
    })
    .await;
    backend.intercept().stall(|s| s.fail_next_unsent = true);
    holder.unlock().await.unwrap();
    // From now on releases are slow: the waiter's compensation among them.
    backend.intercept().stall(|s| s.release = true);
    tokio::time::sleep(Duration::from_millis(100)).await;
    backend.intercept().stall(|s| s.release = false);
    let guard = waiter.await.unwrap().expect("the waiter retried and won");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let intruder = client.get_lock(&key).unwrap().try_lock().await;
    assert!(
        intruder.is_err(),
        "the late compensation freed the new holder's lock"
    );
    guard.unlock().await.unwrap();
}
