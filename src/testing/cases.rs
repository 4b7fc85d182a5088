//! The conformance cases, one `async fn` each, run against a [`Fixture`]. The
//! [`conformance_tests!`](super::conformance_tests) macro makes a test of each; a test
//! of your own can also run one by hand:
//!
//! ```no_run
//! # use std::time::Duration;
//! # use tower_lock::testing::Fixture;
//! # use tower_lock::{LockClient, LockKey, MemoryBackend};
//! # struct MyFixture(MemoryBackend);
//! # impl Fixture for MyFixture {
//! #     fn client(&self, lease: Duration) -> LockClient {
//! #         LockClient::builder(self.0.clone()).watchdog_lease(lease).build().unwrap()
//! #     }
//! #     async fn sabotage(&self, _: &LockKey) {}
//! #     async fn waiters(&self, key: &LockKey) -> usize { self.0.waiters(key) }
//! #     async fn residue(&self, key: &LockKey) -> bool { self.0.contains_key(key) }
//! # }
//! #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
//! async fn reentrancy() {
//!     let fixture = MyFixture(MemoryBackend::new());
//!     tower_lock::testing::cases::reentrancy(&fixture).await;
//! }
//! # fn main() {}
//! ```
//!
//! Each case uses keys of its own (`conformance:<case>...`), so cases may share one
//! store, and each asserts what it needs with a message that says what went wrong.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::{Fixture, spawn_acquire, wait_until};
use crate::backend::{Acquire, LockMode, LockRequest, Release};
use crate::kinds::MultiLock;
use crate::{ConfigError, Error, HoldId, Lease, LockClient, LockKey};

const LONG: Duration = Duration::from_secs(30);

fn key(name: &str) -> LockKey {
    LockKey::new(format!("conformance:{name}")).unwrap()
}

/// 16 tasks × 500 iterations (see [`Fixture::contention_iters`]) of a read-yield-write
/// on a shared counter: the total is exact only if the lock excludes.
pub async fn mutual_exclusion(f: &impl Fixture) {
    const TASKS: u64 = 16;
    let iters = f.contention_iters();
    let k = key("mutex");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    // Two clients, as two replicas would be.
    let clients = [f.client(LONG), f.client(LONG)];
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let lock = clients[(t % 2) as usize].get_lock(&k).unwrap();
        let (counter, inside, overlaps) = (counter.clone(), inside.clone(), overlaps.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..iters {
                let guard = lock.lock().await.unwrap();
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::SeqCst);
                }
                let v = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::SeqCst);
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.unlock().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert_eq!(
        counter.load(Ordering::SeqCst),
        TASKS * iters,
        "lost updates"
    );
    assert!(!f.residue(&k).await, "a free lock left state behind");
}

/// Lock twice as one owner, unlock once: still ours; unlock again: free.
pub async fn reentrancy(f: &impl Fixture) {
    let k = key("reentrant");
    let client = f.client(LONG);
    let other = client.get_lock(&k).unwrap();
    let owner = client.new_owner();
    let lock = client.get_lock(&k).unwrap();
    owner
        .clone()
        .scope(async {
            let outer = lock.lock().await.unwrap();
            let inner = lock.try_lock().await.expect("the same owner re-enters");
            assert_eq!(outer.hold_count(), 1);
            assert_eq!(inner.hold_count(), 2);
            assert_eq!(inner.fencing_token(), outer.fencing_token());
            assert_eq!(inner.owner(), &owner);

            inner.unlock().await.unwrap();
            // Outside the scope: a fresh owner, who must find it still held.
            let busy = tokio::spawn({
                let other = other.clone();
                async move { other.try_lock().await.map(|_| ()) }
            });
            assert!(matches!(busy.await.unwrap(), Err(Error::Busy { .. })));

            outer.unlock().await.unwrap();
            let free = tokio::spawn(async move { other.try_lock().await.map(|g| g.hold_count()) });
            assert_eq!(free.await.unwrap().unwrap(), 1);
        })
        .await;
}

/// Another owner can neither release nor renew a held lock, and the holder's unlock
/// still succeeds.
pub async fn foreign_owner_cannot_release_or_renew(f: &impl Fixture) {
    let k = key("foreign");
    let client = f.client(LONG);
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    let intruder = LockRequest::new(
        k.clone(),
        HoldId::from_raw("intruder:1").unwrap(),
        LockMode::Exclusive,
        Duration::from_secs(60),
    );
    let backend = client.backend();
    assert_eq!(backend.release(&intruder).await.unwrap(), Release::NotHeld);
    assert!(!backend.renew(&intruder).await.unwrap());
    let still = client.get_lock(&k).unwrap().try_lock().await;
    assert!(matches!(still, Err(Error::Busy { .. })), "{still:?}");
    guard.unlock().await.unwrap();
    assert!(!f.residue(&k).await);
}

/// A guard leaked with `mem::forget` under a 200 ms lease: the lease frees the lock.
pub async fn lease_expiry_frees_leaked_guard(f: &impl Fixture) {
    let k = key("leaked");
    let client = f.client(LONG);
    let lock = client.get_lock(&k).unwrap();
    let lease = Duration::from_millis(200);
    // The store starts the lease when it grants, between the request going out and the
    // answer coming back: the bound below counts from the request.
    let asked_at = Instant::now();
    let leaked = lock.try_lock_for(Duration::ZERO, lease).await.unwrap();
    std::mem::forget(leaked);

    assert!(lock.try_lock().await.unwrap_err().is_busy());
    let guard = lock
        .try_lock_for(Duration::from_secs(5), Duration::from_secs(5))
        .await
        .expect("the lease frees the leaked lock");
    let freed_after = asked_at.elapsed();
    assert!(
        freed_after >= lease - Duration::from_millis(20),
        "freed early: {freed_after:?}"
    );
    assert!(
        freed_after < lease + Duration::from_secs(1),
        "freed late: {freed_after:?}"
    );
    guard.unlock().await.unwrap();
    assert!(!f.residue(&k).await);
}

/// The watchdog keeps a 1 s-lease lock for 2.5 s, and the lease is not lost. (With a
/// 300 ms lease, a store that answered no renewal for 300 ms lost it: a loaded
/// machine's disk stalls a commit that long at times, which is not what this case
/// is about.)
pub async fn watchdog_keeps_lock(f: &impl Fixture) {
    let k = key("watchdog");
    let client = f.client(Duration::from_secs(1));
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    assert!(guard.is_watched());
    let other = f.client(LONG).get_lock(&k).unwrap();
    let until = Instant::now() + Duration::from_millis(2500);
    let mut checks = 0;
    while Instant::now() < until {
        assert!(
            other.try_lock().await.unwrap_err().is_busy(),
            "lost after {checks} checks"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!guard.is_lost());
    assert_eq!(client.watched_locks(), 1);
    guard.unlock().await.unwrap();
    assert_eq!(client.watched_locks(), 0, "unlock stops the renewal");
    assert!(!f.residue(&k).await);
}

/// The lock vanishes behind the holder's back: the lost signal fires within about one
/// renewal period, and unlock reports the loss.
pub async fn lost_signal_fires(f: &impl Fixture) {
    let k = key("lost");
    let client = f.client(Duration::from_millis(300));
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    let lost = guard.lost();
    assert!(!lost.is_lost());
    f.sabotage(&k).await;
    let removed_at = Instant::now();
    tokio::time::timeout(Duration::from_secs(2), lost.wait())
        .await
        .expect("lost signal fired");
    // One period is 100 ms; allow scheduling slack.
    assert!(
        removed_at.elapsed() < Duration::from_millis(600),
        "{:?}",
        removed_at.elapsed()
    );
    assert!(guard.is_lost());
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
    assert_eq!(client.watched_locks(), 0);
}

/// `try_lock_for` gives up within its wait plus a small margin, reporting the holder's
/// remaining lease.
pub async fn try_lock_for_gives_up_on_time(f: &impl Fixture) {
    let k = key("timeout");
    let client = f.client(LONG);
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    let lock = client.get_lock(&k).unwrap();
    let wait = Duration::from_millis(300);
    let started = Instant::now();
    let err = lock.try_lock_for(wait, Lease::Watchdog).await.unwrap_err();
    let took = started.elapsed();
    match err {
        Error::Busy {
            holder_ttl: Some(ttl),
        } => assert!(ttl <= LONG && ttl > Duration::from_secs(20), "{ttl:?}"),
        other => panic!("expected busy with a ttl, got {other:?}"),
    }
    assert!(took >= wait, "gave up early: {took:?}");
    assert!(
        took < wait + Duration::from_millis(100),
        "gave up late: {took:?}"
    );

    let started = Instant::now();
    assert!(lock.try_lock().await.unwrap_err().is_busy());
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "try_lock waited"
    );
    guard.unlock().await.unwrap();
}

/// A fenced lock's tokens strictly increase across successive holders (two clients
/// taking turns, plain and fenced acquisitions of the name mixed); a plain lock has none.
pub async fn fencing_tokens_increase(f: &impl Fixture) {
    let k = key("fencing");
    let clients = [f.client(LONG), f.client(LONG)];
    let mut last = None;
    for i in 0..20 {
        if i % 3 == 2 {
            let plain = clients[i % 2].get_lock(&k).unwrap().lock().await.unwrap();
            assert_eq!(plain.fencing_token(), None, "a plain lock has no token");
            plain.unlock().await.unwrap();
            continue;
        }
        let guard = clients[i % 2]
            .get_fenced_lock(&k)
            .unwrap()
            .lock()
            .await
            .unwrap();
        let token = guard.fencing_token().expect("a fenced lock has a token");
        if let Some(last) = last {
            assert!(token > last, "token {token} after {last}");
        }
        last = Some(token);
        guard.unlock().await.unwrap();
    }
}

/// A release wakes a waiter at once: the waiter does not sleep out the holder's 30 s
/// lease.
pub async fn release_wakes_waiter(f: &impl Fixture) {
    let k = key("wake");
    let client = f.client(LONG);
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    let lock = client.get_lock(&k).unwrap();
    let waiter = tokio::spawn(async move {
        let g = lock
            .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
            .await?;
        let acquired_at = Instant::now();
        g.unlock().await?;
        Ok::<_, Error>(acquired_at)
    });
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        f.waiters(&k).await == 1
    })
    .await;
    let released_at = Instant::now();
    guard.unlock().await.unwrap();
    let acquired_at = waiter.await.unwrap().unwrap();
    let handoff = acquired_at.duration_since(released_at);
    assert!(
        handoff < Duration::from_secs(2),
        "waiter slept through the release: {handoff:?}"
    );
}

/// A waiter cancelled while waiting leaves no subscription and no state behind.
pub async fn dropped_waiter_leaves_nothing(f: &impl Fixture) {
    let k = key("dropped-waiter");
    let client = f.client(LONG);
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    let lock = client.get_lock(&k).unwrap();
    let waiter = tokio::spawn(async move { lock.lock().await.map(|_| ()) });
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        f.waiters(&k).await == 1
    })
    .await;
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    wait_until(
        Duration::from_secs(5),
        "the subscription went away",
        || async { f.waiters(&k).await == 0 },
    )
    .await;
    guard.unlock().await.unwrap();
    assert!(!f.residue(&k).await, "state left behind");
}

/// Dropping a guard releases the lock (in a spawned task) and stops its renewal.
pub async fn dropped_guard_releases(f: &impl Fixture) {
    let k = key("dropped-guard");
    let client = f.client(LONG);
    let lock = client.get_lock(&k).unwrap();
    let guard = lock.lock().await.unwrap();
    assert_eq!(client.watched_locks(), 1);
    drop(guard);
    assert_eq!(client.watched_locks(), 0);
    let started = Instant::now();
    let again = lock
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "released only by the lease"
    );
    again.unlock().await.unwrap();
    assert!(!f.residue(&k).await);
}

/// Bad input gets typed errors, never a panic.
pub async fn bad_input_is_rejected(f: &impl Fixture) {
    let client = f.client(LONG);
    assert!(matches!(
        client.get_lock(""),
        Err(ConfigError::InvalidKey { .. })
    ));
    assert!(matches!(
        client.get_lock("a\u{0}b"),
        Err(ConfigError::InvalidKey { .. })
    ));
    assert!(matches!(
        client.get_lock("x".repeat(2000)),
        Err(ConfigError::InvalidKey { .. })
    ));
    let lock = client.get_lock(key("bad-input")).unwrap();
    for lease in [Duration::ZERO, Duration::from_micros(999), Duration::MAX] {
        match lock.try_lock_for(Duration::ZERO, lease).await {
            Err(Error::Config(ConfigError::InvalidSetting { name: "lease", .. })) => {}
            other => panic!("lease {lease:?}: {other:?}"),
        }
    }
    // A wait too long to represent means "forever"; the lock is free, so it returns.
    let guard = lock
        .try_lock_for(Duration::MAX, Lease::Watchdog)
        .await
        .unwrap();
    guard.unlock().await.unwrap();
}

/// MultiLock: with one key held elsewhere the attempt fails and nothing it took stays
/// locked; once free, all are taken under one owner and released together.
pub async fn multi_lock_all_or_nothing(f: &impl Fixture) {
    let client = f.client(LONG);
    let keys = [key("multi-a"), key("multi-b"), key("multi-c")];
    let blocker = client.get_lock(&keys[1]).unwrap().lock().await.unwrap();
    let multi = MultiLock::new(keys.iter().map(|k| client.get_lock(k).unwrap()));
    let started = Instant::now();
    let err = multi
        .try_lock_for(Duration::from_millis(200), Lease::Watchdog)
        .await
        .unwrap_err();
    assert!(err.is_busy(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_millis(400),
        "one shared deadline"
    );
    for k in [&keys[0], &keys[2]] {
        let probe = client.get_lock(k).unwrap().try_lock().await;
        assert!(
            probe.is_ok(),
            "{k} stayed locked after the failed attempt: {probe:?}"
        );
        probe.unwrap().unlock().await.unwrap();
        assert!(!f.residue(k).await);
    }
    blocker.unlock().await.unwrap();

    let all = multi.try_lock().await.unwrap();
    let owners: Vec<_> = all.guards().iter().map(|g| g.owner().clone()).collect();
    assert!(owners.windows(2).all(|w| w[0] == w[1]), "one owner for all");
    assert_eq!(all.guards().len(), 3);
    assert!(!all.is_lost());
    all.unlock().await.unwrap();
    for k in &keys {
        assert!(!f.residue(k).await);
    }
}

/// `MultiGuard::unlock` reports a lock lost behind its back, for one lock (the layer's
/// single-key path) and for several, and still releases the locks it does hold.
pub async fn multi_lock_unlock_reports_loss(f: &impl Fixture) {
    let client = f.client(LONG);
    let one = key("multi-loss-one");
    let guard = MultiLock::new([client.get_lock(&one).unwrap()])
        .lock()
        .await
        .unwrap();
    f.sabotage(&one).await;
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
    assert!(!f.residue(&one).await);

    let (a, b) = (key("multi-loss-a"), key("multi-loss-b"));
    let guard = MultiLock::new([client.get_lock(&a).unwrap(), client.get_lock(&b).unwrap()])
        .lock()
        .await
        .unwrap();
    f.sabotage(&a).await;
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
    for k in [&a, &b] {
        assert!(!f.residue(k).await, "{k} left behind");
    }
    assert_eq!(client.watched_locks(), 0);

    let empty = MultiLock::new(std::iter::empty()).lock().await.unwrap();
    assert!(empty.guards().is_empty());
    empty.unlock().await.unwrap();
}

/// Two MultiLocks over {a, b} and {b, a} taking turns many times: no deadlock, exact
/// counts.
pub async fn multi_lock_orders_keys(f: &impl Fixture) {
    const ITERS: usize = 100;
    let clients = [f.client(LONG), f.client(LONG)];
    let (a, b) = (key("order-a"), key("order-b"));
    let counter = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for (i, pair) in [[&a, &b], [&b, &a], [&a, &b], [&b, &a]]
        .into_iter()
        .enumerate()
    {
        let client = &clients[i % 2];
        let multi = MultiLock::new(pair.iter().map(|k| client.get_lock(*k).unwrap()));
        let counter = counter.clone();
        tasks.push(tokio::spawn(async move {
            for _ in 0..ITERS {
                let both = multi.lock().await.unwrap();
                let v = counter.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                counter.store(v + 1, Ordering::SeqCst);
                both.unlock().await.unwrap();
            }
        }));
    }
    let all = async {
        for t in tasks {
            t.await.unwrap();
        }
    };
    tokio::time::timeout(Duration::from_secs(60), all)
        .await
        .expect("MultiLocks over the same keys in opposite orders deadlocked");
    assert_eq!(counter.load(Ordering::SeqCst), 4 * ITERS);
}

/// No barging within a process: a holder that releases and at once asks again lines up
/// behind the waiter that was already waiting, instead of snatching the lock back in the
/// instant before the woken waiter's attempt arrives.
pub async fn no_barging_past_local_waiters(f: &impl Fixture) {
    let k = key("no-barging");
    let client = f.client(LONG);
    let lock = client.get_lock(&k).unwrap();
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let held = lock.lock().await.unwrap();
    let waiter = tokio::spawn({
        let (lock, order) = (lock.clone(), order.clone());
        async move {
            let g = lock
                .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
                .await
                .unwrap();
            order.lock().unwrap().push("waiter");
            g.unlock().await.unwrap();
        }
    });
    wait_until(Duration::from_secs(5), "the waiter waits", || async {
        f.waiters(&k).await == 1
    })
    .await;
    held.unlock().await.unwrap();
    let again = lock
        .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
        .await
        .unwrap();
    order.lock().unwrap().push("releaser");
    again.unlock().await.unwrap();
    waiter.await.unwrap();
    let order = order.lock().unwrap().clone();
    if f.local_order_is_strict() {
        assert_eq!(order, ["waiter", "releaser"], "the releaser barged back in");
    } else {
        assert_eq!(order.len(), 2, "both got the lock: {order:?}");
    }
    assert!(!f.residue(&k).await);
}

/// A waiter that gives up hands its turn to the one lined up behind it, which then
/// finds the holder's lease and takes the lock when it lapses — instead of sleeping out
/// its whole line-up wait.
pub async fn leaving_waiter_passes_its_turn(f: &impl Fixture) {
    let k = key("pass-turn");
    let client = f.client(LONG);
    let lock = client.get_lock(&k).unwrap();
    let lease = Duration::from_millis(600);
    let held = lock.try_lock_for(Duration::ZERO, lease).await.unwrap();
    let held_at = Instant::now();
    let first = tokio::spawn({
        let lock = lock.clone();
        async move {
            lock.try_lock_for(Duration::from_millis(150), Lease::Watchdog)
                .await
                .map(drop)
        }
    });
    wait_until(Duration::from_secs(5), "the first waiter waits", || async {
        f.waiters(&k).await == 1
    })
    .await;
    let second = spawn_acquire(lock.clone(), Duration::from_secs(5));
    assert!(first.await.unwrap().unwrap_err().is_busy());
    let (acquired_at, g) = second.await.unwrap().unwrap();
    let after = acquired_at.duration_since(held_at);
    // The lease lapses at 600 ms; without the handed-on turn the second waiter would sleep
    // its whole line-up wait (1 s) first.
    assert!(
        after >= lease - Duration::from_millis(20),
        "acquired while held: {after:?}"
    );
    assert!(
        after < lease + Duration::from_millis(300),
        "the turn was not passed on: {after:?}"
    );
    g.unlock().await.unwrap();
    assert!(matches!(held.unlock().await, Err(Error::Lost)));
}

/// MultiLock with a fixed lease shorter than its wait: the lock taken first must not run
/// out while a later one is waited for, and once all are held each lasts at least the
/// lease given — and no longer than the lease plus the wait it was taken with (a store
/// never shortens a lease, so that is what a fixed lease can promise).
pub async fn multi_lock_fixed_lease_outlasts_the_wait(f: &impl Fixture) {
    let client = f.client(LONG);
    let other = f.client(LONG);
    let (a, b) = (key("multi-lease-a"), key("multi-lease-b"));
    let blocker = other
        .get_lock(&b)
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_millis(400))
        .await
        .unwrap();
    let multi = MultiLock::new([client.get_lock(&a).unwrap(), client.get_lock(&b).unwrap()]);
    let lease = Duration::from_millis(200);
    let wait = Duration::from_secs(1);
    let started = Instant::now();
    let both = multi.try_lock_for(wait, lease).await.unwrap();
    let held_at = Instant::now();
    assert!(
        !both.is_lost(),
        "a lock ran out while the other was waited for"
    );
    // `a` was taken ~400 ms ago with a 200 ms lease: it must still be ours.
    let intruder = other.get_lock(&a).unwrap().try_lock().await;
    assert!(
        intruder.unwrap_err().is_busy(),
        "the first lock expired during the wait"
    );
    // At least the lease from when both were held; at most the lease plus the wait.
    let again = other
        .get_lock(&a)
        .unwrap()
        .try_lock_for(Duration::from_secs(3), Lease::Watchdog)
        .await
        .unwrap();
    let (after_held, after_start) = (held_at.elapsed(), started.elapsed());
    assert!(
        after_held >= lease - Duration::from_millis(20),
        "freed before the lease: {after_held:?}"
    );
    // The slack is for a loaded machine (a PostgreSQL run under the full suite took
    // 1.65 s); a hold kept by the watchdog instead of its fixed lease would take 30 s.
    assert!(
        after_start < wait + lease + Duration::from_secs(1),
        "held past the lease plus the wait: {after_start:?}"
    );
    again.unlock().await.unwrap();
    assert!(matches!(both.unlock().await, Err(Error::Lost)));
    drop(blocker);
}

/// A re-entry with a short lease, released again, must not cut the outer hold's lease:
/// the layer holds with the watchdog and a handler re-enters with `try_lock_for(.., 1s)`.
pub async fn reentry_never_shortens_the_lease(f: &impl Fixture) {
    let k = key("reentry-lease");
    let client = f.client(LONG);
    let other = f.client(LONG);
    let owner = client.new_owner();
    let lock = client.get_lock(&k).unwrap().with_owner(owner);
    for outer_lease in [Lease::Watchdog, Lease::Fixed(Duration::from_secs(20))] {
        let outer = lock
            .try_lock_for(Duration::ZERO, outer_lease)
            .await
            .unwrap();
        let inner = lock
            .try_lock_for(Duration::ZERO, Duration::from_millis(50))
            .await
            .unwrap();
        assert_eq!(inner.hold_count(), 2);
        tokio::time::sleep(Duration::from_millis(150)).await;
        // Past the inner lease, while it is still held: the outer lease holds the key.
        match other.get_lock(&k).unwrap().try_lock().await {
            Err(Error::Busy {
                holder_ttl: Some(ttl),
            }) => {
                assert!(
                    ttl > Duration::from_secs(15),
                    "{outer_lease:?}: lease cut to {ttl:?}"
                )
            }
            other => panic!("{outer_lease:?}: the re-entry cut the outer lease: {other:?}"),
        }
        // The hold never lapsed (the outer lease covered it): the inner guard was
        // protected throughout, and says so.
        assert!(!inner.is_lost());
        inner.unlock().await.unwrap();
        match other.get_lock(&k).unwrap().try_lock().await {
            Err(Error::Busy {
                holder_ttl: Some(ttl),
            }) => {
                assert!(
                    ttl > Duration::from_secs(15),
                    "{outer_lease:?}: release cut it to {ttl:?}"
                )
            }
            other => panic!("{outer_lease:?}: the partial release cut the outer lease: {other:?}"),
        }
        assert!(!outer.is_lost());
        outer.unlock().await.unwrap();
    }
    assert!(!f.residue(&k).await);
}

/// A renewal with a shorter lease after a longer one keeps the longer lease in the store,
/// in every mode that renews, whether renewed alone, in a batch of every mode, or in a
/// batch of plain locks: a store's lease only ever moves later, so no reordering of
/// renewals can end it before the belief of a guard that asked for more.
pub async fn a_shorter_renewal_never_shortens_the_lease(f: &impl Fixture) {
    let client = f.client(LONG);
    let backend = client.backend();
    let modes = [
        LockMode::Exclusive,
        LockMode::Fair,
        LockMode::Read,
        LockMode::Write,
        LockMode::Permits {
            max: std::num::NonZeroU32::new(2).unwrap(),
        },
    ];
    let long = LONG;
    let short = Duration::from_secs(1);
    let reqs: Vec<LockRequest> = modes
        .iter()
        .map(|&mode| {
            let k = key(&format!(
                "renew-shorter-{}",
                mode.to_string().replace(['(', ')'], "")
            ));
            LockRequest::new(k, client.new_hold_id(), mode, long)
        })
        .collect();
    for req in &reqs {
        assert!(
            matches!(backend.acquire(req).await.unwrap(), Acquire::Acquired(_)),
            "{}",
            req.mode
        );
    }
    let shortened: Vec<LockRequest> = reqs
        .iter()
        .map(|req| {
            let mut req = req.clone();
            req.lease = short;
            req
        })
        .collect();
    let plain: Vec<LockRequest> = shortened
        .iter()
        .filter(|r| matches!(r.mode, LockMode::Exclusive | LockMode::Fair))
        .cloned()
        .collect();
    let mut violations = Vec::new();
    for how in [
        "alone",
        "in a batch of every mode",
        "in a batch of plain locks",
    ] {
        // The longer renewal first, then the shorter one.
        for req in &reqs {
            assert!(backend.renew(req).await.unwrap(), "{}: renewed", req.mode);
        }
        let renewed: Vec<bool> = match how {
            "alone" => {
                let mut out = Vec::new();
                for req in &shortened {
                    out.push(backend.renew(req).await.unwrap());
                }
                out
            }
            "in a batch of every mode" => backend
                .renew_many(&shortened)
                .await
                .into_iter()
                .map(|r| r.unwrap())
                .collect(),
            _ => backend
                .renew_many(&plain)
                .await
                .into_iter()
                .map(|r| r.unwrap())
                .collect(),
        };
        assert!(
            renewed.iter().all(|&r| r),
            "{how}: a hold was not renewed: {renewed:?}"
        );
        for req in &reqs {
            let admin = backend
                .admin()
                .expect("a backend under test has administration");
            let state = admin.inspect(&req.key, req.mode).await.unwrap();
            let ttl = state.holders.first().and_then(|h| h.ttl);
            let kept = ttl.is_some_and(|ttl| ttl > long - Duration::from_secs(10));
            if !kept {
                violations.push(format!(
                    "{} renewed with {short:?} {how}: the store's lease is {ttl:?}, not the {long:?} asked before",
                    req.mode
                ));
            }
        }
    }
    for req in &reqs {
        assert_eq!(backend.release(req).await.unwrap(), Release::Released);
        assert!(
            !f.residue(&req.key).await,
            "{}: state left behind",
            req.mode
        );
    }
    assert!(violations.is_empty(), "{violations:#?}");
}

/// Two tasks of one owner lock one key at once: the second waits for the first's
/// acquisition and re-enters it, so there is one hold in the store, two guards, and the
/// lock is free only once both are gone. Meanwhile another owner is kept out.
pub async fn concurrent_acquisitions_by_one_owner_share_one_hold(f: &impl Fixture) {
    let k = key("one-owner-twice");
    let client = f.client(LONG);
    let owner = client.new_owner();
    let lock = client.get_lock(&k).unwrap().with_owner(owner);
    let (a, b) = tokio::join!(
        lock.try_lock_for(Duration::from_secs(5), Lease::Watchdog),
        lock.try_lock_for(Duration::from_secs(5), Lease::Watchdog),
    );
    let (a, b) = (a.unwrap(), b.unwrap());
    let mut counts = [a.hold_count(), b.hold_count()];
    counts.sort();
    assert_eq!(counts, [1, 2], "one acquired, the other re-entered");
    assert_eq!(a.hold_id(), b.hold_id(), "one hold");
    let other = f.client(LONG).get_lock(&k).unwrap();
    assert!(other.try_lock().await.unwrap_err().is_busy());
    a.unlock().await.unwrap();
    assert!(
        other.try_lock().await.unwrap_err().is_busy(),
        "one guard is left"
    );
    b.unlock().await.unwrap();
    other.try_lock().await.unwrap().unlock().await.unwrap();
    assert!(!f.residue(&k).await);
}

/// Inspection tells an operator who holds a lock (and which client that is), for how
/// long, with which fencing token, and who waits — from another client, as from another
/// process — and changes nothing.
pub async fn inspection_shows_holders_tokens_and_waiters(f: &impl Fixture) {
    let k = key("inspect");
    let named = |name: &str| {
        LockClient::builder(f.client(LONG).backend().clone())
            .name(name)
            .build()
            .unwrap()
    };
    let (a, b) = (named("node-a"), named("node-b"));
    let lock_b = b.get_lock(&k).unwrap();
    let free = lock_b.inspect().await.unwrap();
    assert!(free.holders.is_empty() && !free.is_locked(), "{free:?}");
    assert_eq!(free.waiters.count, 0);
    assert_eq!(lock_b.remaining_lease().await.unwrap(), None);
    assert!(!lock_b.is_locked().await.unwrap());

    a.register_name().await.unwrap();
    let owner = a.new_owner();
    let lock_a = a.get_fenced_lock(&k).unwrap().with_owner(owner.clone());
    let guard = lock_a
        .try_lock_for(Duration::ZERO, Duration::from_secs(10))
        .await
        .unwrap();
    let token = guard.fencing_token().unwrap();
    let again = lock_a
        .try_lock_for(Duration::ZERO, Duration::from_secs(10))
        .await
        .unwrap();

    // From the other client: the store's view plus the holder's registered name.
    let seen = lock_b.inspect().await.unwrap();
    assert_eq!(seen.holders.len(), 1, "{seen:?}");
    let h = &seen.holders[0];
    assert_eq!(h.hold_id, *guard.hold_id());
    assert_eq!(h.client_id(), Some(a.id()));
    assert_eq!(h.client.as_deref(), Some("node-a"));
    assert_eq!(h.mode, LockMode::Exclusive);
    assert_eq!(h.holds, 1, "re-entries are the client's, not the store's");
    let ttl = h.ttl.unwrap();
    assert!(
        ttl > Duration::from_secs(5) && ttl <= Duration::from_secs(10),
        "{ttl:?}"
    );
    assert!(
        h.since.is_none() && h.guards.is_none(),
        "only the holder's client knows"
    );
    assert!(seen.fencing_token.is_some_and(|t| t >= token), "{seen:?}");
    assert!(lock_b.is_locked().await.unwrap());
    let left = lock_b.remaining_lease().await.unwrap().unwrap();
    assert!(left > Duration::from_secs(5) && left <= Duration::from_secs(10));
    // Hold counts: the logical owner's guards, the store's count of the hold, nobody's.
    assert_eq!(lock_a.hold_count(&owner).await.unwrap(), 2);
    assert_eq!(lock_b.hold_count(&owner).await.unwrap(), 0, "not b's owner");
    let held = lock_b.hold_count_in_store(guard.hold_id()).await.unwrap();
    assert_eq!(held, 1);
    assert_eq!(lock_b.hold_count(&b.new_owner()).await.unwrap(), 0);
    let nobody = HoldId::from_raw(b.new_owner().as_str()).unwrap();
    assert_eq!(lock_b.hold_count_in_store(&nobody).await.unwrap(), 0);

    // From the holder's own client: when, and how many guards.
    let mine = lock_a.inspect().await.unwrap();
    let h = &mine.holders[0];
    assert_eq!(h.guards, Some(2));
    let since = h.since.unwrap().elapsed().unwrap_or_default();
    assert!(since < Duration::from_secs(60), "{since:?}");

    // A waiter shows up, and leaves with the lock.
    let waiter = tokio::spawn({
        let lock = lock_b.clone();
        async move { lock.try_lock_for(LONG, LONG).await }
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let state = lock_b.inspect().await.unwrap();
        if state.waiters.count == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the waiter never showed: {state:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(again);
    guard.unlock().await.unwrap();
    let next = waiter.await.unwrap().unwrap();
    let state = lock_b.inspect().await.unwrap();
    assert_eq!(state.holders.len(), 1);
    assert_eq!(state.holders[0].hold_id, *next.hold_id());
    assert_eq!(state.holders[0].client.as_deref(), Some("node-b"));
    assert_eq!(state.waiters.count, 0);
    next.unlock().await.unwrap();
    assert!(!lock_b.is_locked().await.unwrap());
    // Inspecting left nothing behind.
    assert!(!f.residue(&k).await);
}

/// Shutting a client down releases every hold it has (watched, fixed-lease, shared,
/// fair), gives up its waiters, stops its watchdog and leaves nothing of it in the
/// store: another client takes every key at once. The client's guards are lost, and it
/// refuses later acquisitions with [`Error::Shutdown`].
pub async fn shutdown_leaves_nothing(f: &impl Fixture) {
    let client = f.client(LONG);
    let other = f.client(LONG);
    let watched = key("shutdown-watched");
    let fixed = key("shutdown-fixed");
    let read = key("shutdown-read");
    let fair = key("shutdown-fair");
    let held = client.get_lock(&watched).unwrap().lock().await.unwrap();
    let fixed_guard = client
        .get_lock(&fixed)
        .unwrap()
        .try_lock_for(Duration::ZERO, LONG)
        .await
        .unwrap();
    let read_guard = client
        .get_read_write_lock(&read)
        .unwrap()
        .read_lock()
        .lock()
        .await
        .unwrap();
    let fair_guard = client.get_fair_lock(&fair).unwrap().lock().await.unwrap();
    // A waiter of the same client, queued behind the client's own hold.
    let queued = client.get_fair_lock(&fair).unwrap();
    let waiter = tokio::spawn(async move { queued.lock().await.map(drop) });
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        f.waiters(&fair).await == 1
    })
    .await;
    assert_eq!(client.watched_locks(), 3);

    client.shutdown().await.expect("shutdown");

    assert!(
        matches!(waiter.await.unwrap(), Err(Error::Shutdown)),
        "a waiter gives up with Error::Shutdown"
    );
    assert_eq!(client.watched_locks(), 0, "the watchdog stopped");
    assert!(client.is_shut_down());
    for guard in [&held, &fixed_guard, &read_guard, &fair_guard] {
        assert!(guard.is_lost(), "{} not marked lost", guard.key());
    }
    for k in [&watched, &fixed, &read, &fair] {
        assert!(!f.residue(k).await, "{k} left in the store after shutdown");
    }
    assert!(matches!(
        client.get_lock(&watched).unwrap().try_lock().await,
        Err(Error::Shutdown)
    ));
    assert!(matches!(client.ping().await, Err(Error::Shutdown)));
    for k in [&watched, &fixed, &fair] {
        let lock = other.get_lock(k).unwrap();
        let taken = lock.try_lock().await.unwrap_or_else(|e| panic!("{k}: {e}"));
        taken.unlock().await.unwrap();
    }
    let write = other.get_read_write_lock(&read).unwrap().write_lock();
    write.try_lock().await.unwrap().unlock().await.unwrap();
    assert!(matches!(held.unlock().await, Err(Error::Lost)));
    drop((fixed_guard, read_guard, fair_guard));
    client
        .shutdown()
        .await
        .expect("a second shutdown does nothing");
}
