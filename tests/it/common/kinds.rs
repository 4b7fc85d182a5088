//! The lock-kind suite: the conformance cases that apply to each kind (fair, read,
//! write, permits), plus each kind's own cases, run against every backend through a
//! [`KindFixture`]. A backend file instantiates them all with
//! [`kind_tests!`](crate::kind_tests).

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tower_lock::backend::{Acquire, LockMode, LockRequest, Release};
use tower_lock::{Error, HoldId, Lease, Lock, LockClient, LockGuard, LockKey};

use super::wait_until;

/// One backend under test.
pub trait KindFixture: Send + Sync + Sized {
    /// A new client (a new identity) on the shared store, with this watchdog lease.
    fn client(&self, watchdog_lease: Duration) -> LockClient;

    /// The same store seen through a backend whose queued waiters (fair, read-write)
    /// are evicted after `timeout` without polling.
    fn with_waiter_timeout(&self, timeout: Duration) -> impl Future<Output = Self> + Send;

    /// The waiter timeout of this fixture's backend.
    fn waiter_timeout(&self) -> Duration;

    /// Removes the holds of `key` in `mode` behind their holders' backs.
    fn sabotage(&self, key: &LockKey, mode: LockMode) -> impl Future<Output = ()> + Send;

    /// Waiters (subscriptions) this process has registered for `key`.
    fn waiters(&self, key: &LockKey) -> impl Future<Output = usize> + Send;

    /// Owners in `key`'s wait queue (fair, read-write).
    fn queued(&self, key: &LockKey) -> impl Future<Output = usize> + Send;

    /// Whether the store still keeps any state for `key` (apart from durable fencing
    /// counters).
    fn residue(&self, key: &LockKey) -> impl Future<Output = bool> + Send;
}

/// A lock kind under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Fair,
    Read,
    Write,
    /// A semaphore of this many permits.
    Permits(u32),
}

const LONG: Duration = Duration::from_secs(30);

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Fair => "fair",
            Kind::Read => "read",
            Kind::Write => "write",
            Kind::Permits(_) => "permits",
        }
    }

    /// The kind's lock on `key`.
    pub fn lock(self, client: &LockClient, key: &LockKey) -> Lock {
        match self {
            Kind::Fair => client.get_fair_lock(key).unwrap(),
            Kind::Read => client.get_read_write_lock(key).unwrap().read_lock(),
            Kind::Write => client.get_read_write_lock(key).unwrap().write_lock(),
            Kind::Permits(n) => client.get_permits(key, n).unwrap(),
        }
    }

    /// How many holders of this kind fill the key.
    fn capacity(self) -> usize {
        match self {
            Kind::Permits(n) => n as usize,
            _ => 1,
        }
    }

    /// A lock that cannot be taken while the key is filled with this kind's holds.
    fn excluded(self, client: &LockClient, key: &LockKey) -> Lock {
        match self {
            Kind::Read => Kind::Write.lock(client, key),
            Kind::Write => Kind::Read.lock(client, key),
            kind => kind.lock(client, key),
        }
    }

    /// Holds (each by a fresh owner) that keep this kind's lock from being taken.
    async fn block(self, client: &LockClient, key: &LockKey) -> Vec<LockGuard> {
        let (blocker, count) = match self {
            Kind::Read => (Kind::Write, 1),
            Kind::Write => (Kind::Read, 1),
            kind => (kind, kind.capacity()),
        };
        let mut guards = Vec::new();
        for _ in 0..count {
            guards.push(blocker.lock(client, key).lock().await.unwrap());
        }
        guards
    }
}

fn key(kind: Kind, name: &str) -> LockKey {
    LockKey::new(format!("kinds:{}:{name}", kind.name())).unwrap()
}

async fn unlock_all(guards: Vec<LockGuard>) {
    for guard in guards {
        guard.unlock().await.unwrap();
    }
}

fn request_of(guard: &LockGuard) -> LockRequest {
    LockRequest::new(
        guard.key().clone(),
        guard.hold_id().clone(),
        guard.mode(),
        guard.lease(),
    )
}

/// Whether the store still has the guard's hold (asked by renewing it).
async fn still_held(client: &LockClient, guard: &LockGuard) -> bool {
    client.backend().renew(&request_of(guard)).await.unwrap()
}

/// No state is left for `k` once what is already under way has finished: spawned
/// releases of dropped guards, or leaked holds whose leases end a moment later on one
/// node of a composite store than on the others (each node started its lease at its
/// own instant). Waits with a deadline far below any lease still running.
async fn settles_to_no_residue(f: &impl KindFixture, k: &LockKey) {
    wait_until(
        Duration::from_secs(2),
        "no state left for the key",
        || async { !f.residue(k).await },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// The conformance cases, per kind.

/// Tasks hammer the kind's lock; never more holders at once than it admits (measured),
/// and with one admitted holder a read-yield-write counter is exact.
pub async fn exclusion(f: &impl KindFixture, kind: Kind) {
    const TASKS: u64 = 8;
    const ITERS: u64 = 100;
    let k = key(kind, "exclusion");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let clients = [f.client(LONG), f.client(LONG)];
    let mut tasks = Vec::new();
    for t in 0..TASKS {
        let lock = kind.lock(&clients[(t % 2) as usize], &k);
        let (counter, inside, most) = (counter.clone(), inside.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..ITERS {
                let guard = lock.lock().await.unwrap();
                let now_inside = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now_inside, Ordering::SeqCst);
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
    let most = most.load(Ordering::SeqCst);
    assert!(
        most <= kind.capacity(),
        "{most} holders at once, at most {} allowed",
        kind.capacity()
    );
    if kind.capacity() == 1 {
        assert_eq!(
            counter.load(Ordering::SeqCst),
            TASKS * ITERS,
            "lost updates"
        );
    }
    assert!(!f.residue(&k).await, "a free lock left state behind");
}

/// Lock twice as one owner, unlock once: still held; unlock again: free.
pub async fn reentrancy(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "reentrant");
    let client = f.client(LONG);
    let owner = client.new_owner();
    let lock = kind.lock(&client, &k);
    owner
        .clone()
        .scope(async {
            let outer = lock.lock().await.unwrap();
            let inner = lock.try_lock().await.expect("the same owner re-enters");
            assert_eq!((outer.hold_count(), inner.hold_count()), (1, 2));
            assert_eq!(inner.fencing_token(), outer.fencing_token());
            assert_eq!(inner.owner(), &owner);
            inner.unlock().await.unwrap();
            assert!(still_held(&client, &outer).await, "one hold is left");
            let req = request_of(&outer);
            outer.unlock().await.unwrap();
            assert!(!client.backend().renew(&req).await.unwrap(), "still held");
        })
        .await;
    assert!(!f.residue(&k).await);
}

/// A re-entry with a short lease, released again, must not cut the outer hold's lease:
/// past the short lease, the outer hold is still in the store (its unlock finds it).
pub async fn reentry_never_shortens_the_lease(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "reentry-lease");
    let client = f.client(LONG);
    let lock = kind.lock(&client, &k).with_owner(client.new_owner());
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
        tokio::time::sleep(Duration::from_millis(120)).await;
        inner.unlock().await.unwrap();
        tokio::time::sleep(Duration::from_millis(120)).await;
        assert!(
            outer.unlock().await.is_ok(),
            "{outer_lease:?}: the short re-entry cut the outer hold's lease"
        );
    }
    settles_to_no_residue(f, &k).await;
}

/// Another owner can neither release nor renew a held lock, and the holder's unlock
/// still succeeds.
pub async fn foreign_owner_cannot_release_or_renew(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "foreign");
    let client = f.client(LONG);
    let guard = kind.lock(&client, &k).lock().await.unwrap();
    let intruder = LockRequest::new(
        k.clone(),
        HoldId::from_raw("intruder:1").unwrap(),
        guard.mode(),
        Duration::from_secs(60),
    );
    let backend = client.backend();
    assert_eq!(backend.release(&intruder).await.unwrap(), Release::NotHeld);
    assert!(!backend.renew(&intruder).await.unwrap());
    assert!(still_held(&client, &guard).await);
    guard.unlock().await.unwrap();
    assert!(!f.residue(&k).await);
}

/// Guards leaked with `mem::forget` under a 200 ms lease: the lease frees the key for
/// a lock they exclude.
pub async fn lease_expiry_frees_leaked_guard(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "leaked");
    let client = f.client(LONG);
    let lease = Duration::from_millis(200);
    // No lease can have started before this, nor ended before it plus the lease.
    let before = Instant::now();
    for _ in 0..kind.capacity() {
        let leaked = kind
            .lock(&client, &k)
            .try_lock_for(Duration::ZERO, lease)
            .await
            .unwrap();
        std::mem::forget(leaked);
    }
    let leaked_at = Instant::now();
    let excluded = kind.excluded(&client, &k);
    assert!(excluded.try_lock().await.unwrap_err().is_busy());
    let guard = excluded
        .try_lock_for(Duration::from_secs(5), Duration::from_secs(5))
        .await
        .expect("the lease frees the leaked holds");
    let freed_at = Instant::now();
    assert!(
        freed_at >= before + lease,
        "freed early: {:?} after the first leak",
        freed_at - before
    );
    assert!(
        freed_at < leaked_at + lease + Duration::from_secs(1),
        "freed late: {:?} after the last leak",
        freed_at - leaked_at
    );
    guard.unlock().await.unwrap();
    settles_to_no_residue(f, &k).await;
}

/// The watchdog keeps 1 s-lease holds for well over their lease (renewed every third
/// of it). With 300 ms leases a renewal that waited over 200 ms for its commit lost
/// the hold: MySQL's, on a machine running the whole suite (every commit there waits
/// for a flush of the log).
pub async fn watchdog_keeps_lock(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "watchdog");
    let client = f.client(Duration::from_secs(1));
    let mut guards = Vec::new();
    for _ in 0..kind.capacity() {
        guards.push(kind.lock(&client, &k).lock().await.unwrap());
    }
    assert!(guards.iter().all(LockGuard::is_watched));
    let excluded = kind.excluded(&f.client(LONG), &k);
    let until = Instant::now() + Duration::from_millis(2500);
    let mut checks = 0;
    while Instant::now() < until {
        assert!(
            excluded.try_lock().await.unwrap_err().is_busy(),
            "lost after {checks} checks"
        );
        checks += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(guards.iter().all(|g| !g.is_lost()));
    assert_eq!(client.watched_locks(), kind.capacity());
    unlock_all(guards).await;
    assert_eq!(client.watched_locks(), 0, "unlock stops the renewal");
    assert!(!f.residue(&k).await);
}

/// The holds vanish behind the holder's back: the lost signal fires within about one
/// renewal period, and unlock reports the loss.
pub async fn lost_signal_fires(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "lost");
    let client = f.client(Duration::from_millis(300));
    let lock = kind.lock(&client, &k);
    let guard = lock.lock().await.unwrap();
    let lost = guard.lost();
    assert!(!lost.is_lost());
    f.sabotage(&k, lock.mode()).await;
    let removed_at = Instant::now();
    tokio::time::timeout(Duration::from_secs(2), lost.wait())
        .await
        .expect("lost signal fired");
    assert!(
        removed_at.elapsed() < Duration::from_millis(600),
        "{:?}",
        removed_at.elapsed()
    );
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
    assert_eq!(client.watched_locks(), 0);
}

/// `try_lock_for` gives up within its wait plus a small margin, and giving up (also at
/// once, with `try_lock`) leaves no place in a wait queue behind: once free, a newcomer
/// gets the lock at the first attempt.
pub async fn try_lock_for_gives_up_on_time(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "timeout");
    let client = f.client(LONG);
    let blockers = kind.block(&client, &k).await;
    let lock = kind.lock(&client, &k);
    let wait = Duration::from_millis(300);
    let started = Instant::now();
    let err = lock.try_lock_for(wait, Lease::Watchdog).await.unwrap_err();
    let took = started.elapsed();
    match err {
        Error::Busy {
            holder_ttl: Some(ttl),
        } => assert!(ttl <= LONG, "{ttl:?}"),
        other => panic!("expected busy with a ttl, got {other:?}"),
    }
    assert!(took >= wait, "gave up early: {took:?}");
    // Late is sleeping towards the holders' 30 s lease instead of giving up at the
    // wait. The last attempt at the deadline is a store call: with the whole suite
    // running (three SQL stores flushing their logs), a PostgreSQL permit call once
    // took 226 ms past a 150 ms margin.
    assert!(
        took < wait + Duration::from_secs(1),
        "gave up late: {took:?}"
    );
    let started = Instant::now();
    assert!(lock.try_lock().await.unwrap_err().is_busy());
    // One store call, not a wait (the same load as above).
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "try_lock waited"
    );
    assert_eq!(
        f.queued(&k).await,
        0,
        "a waiter that gave up is still queued"
    );
    unlock_all(blockers).await;
    let guard = lock
        .try_lock()
        .await
        .expect("nobody left ahead in the queue");
    guard.unlock().await.unwrap();
    assert!(!f.residue(&k).await);
}

/// A fenced lock's tokens strictly increase across successive holders (two clients
/// taking turns).
pub async fn fencing_tokens_increase(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "fencing");
    let clients = [f.client(LONG), f.client(LONG)];
    let mut last = None;
    for i in 0..20 {
        let guard = kind
            .lock(&clients[i % 2], &k)
            .fenced()
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

/// A release wakes a waiter at once: it does not sleep out the holders' 30 s lease
/// (nor its queue's polling interval).
pub async fn release_wakes_waiter(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "wake");
    let client = f.client(LONG);
    let blockers = kind.block(&client, &k).await;
    let lock = kind.lock(&client, &k);
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
    unlock_all(blockers).await;
    let acquired_at = waiter.await.unwrap().unwrap();
    let handoff = acquired_at.duration_since(released_at);
    let bound = Duration::from_secs(2).min(f.waiter_timeout() / 6);
    assert!(
        handoff < bound,
        "waiter slept through the release: {handoff:?}"
    );
}

/// A waiter cancelled while waiting leaves no subscription, no place in a queue and no
/// state behind.
pub async fn dropped_waiter_leaves_nothing(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "dropped-waiter");
    let client = f.client(LONG);
    let blockers = kind.block(&client, &k).await;
    let lock = kind.lock(&client, &k);
    let waiter = tokio::spawn(async move { lock.lock().await.map(|_| ()) });
    wait_until(Duration::from_secs(10), "the waiter subscribed", || async {
        f.waiters(&k).await == 1
    })
    .await;
    waiter.abort();
    assert!(waiter.await.unwrap_err().is_cancelled());
    wait_until(Duration::from_secs(10), "the waiter went away", || async {
        f.waiters(&k).await == 0 && f.queued(&k).await == 0
    })
    .await;
    unlock_all(blockers).await;
    // Aborted with an attempt in flight, the waiter leaves the queue and gives its
    // identity up in two spawned calls; should the attempt itself land between them,
    // after the blockers' release, it is granted and then taken back by the second.
    // Nothing may stay, well within any lease.
    settles_to_no_residue(f, &k).await;
}

/// Dropping guards releases them (in spawned tasks) and stops their renewal.
pub async fn dropped_guard_releases(f: &impl KindFixture, kind: Kind) {
    let k = key(kind, "dropped-guard");
    let client = f.client(LONG);
    let mut guards = Vec::new();
    for _ in 0..kind.capacity() {
        guards.push(kind.lock(&client, &k).lock().await.unwrap());
    }
    assert_eq!(client.watched_locks(), kind.capacity());
    drop(guards);
    assert_eq!(client.watched_locks(), 0);
    let started = Instant::now();
    let again = kind
        .excluded(&client, &k)
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "released only by the lease"
    );
    again.unlock().await.unwrap();
    // The other dropped guards' releases are spawned too; far sooner than their lease.
    settles_to_no_residue(f, &k).await;
}

// ---------------------------------------------------------------------------------------
// Fair locks.

/// 20 waiters queued in a known order acquire in exactly that order, and a newcomer
/// trying all along never gets in ahead of them.
pub async fn fair_order(f: &impl KindFixture, _kind: Kind) {
    const WAITERS: usize = 20;
    let k = key(Kind::Fair, "order");
    let client = f.client(LONG);
    let holder = client.get_fair_lock(&k).unwrap().lock().await.unwrap();
    let order = Arc::new(Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..WAITERS {
        let lock = client.get_fair_lock(&k).unwrap();
        let order = order.clone();
        tasks.push(tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            order.lock().unwrap().push(i);
            tokio::task::yield_now().await;
            guard.unlock().await.unwrap();
        }));
        wait_until(Duration::from_secs(5), "the waiter queued", || async {
            f.queued(&k).await == i + 1
        })
        .await;
    }
    let done = Arc::new(AtomicBool::new(false));
    let barger = {
        let lock = f.client(LONG).get_fair_lock(&k).unwrap();
        let (done, order) = (done.clone(), order.clone());
        tokio::spawn(async move {
            let mut overtook = 0;
            while !done.load(Ordering::SeqCst) {
                if let Ok(guard) = lock.try_lock().await {
                    if order.lock().unwrap().len() < WAITERS {
                        overtook += 1;
                    }
                    guard.unlock().await.unwrap();
                }
                tokio::task::yield_now().await;
            }
            overtook
        })
    };
    holder.unlock().await.unwrap();
    for t in tasks {
        t.await.unwrap();
    }
    done.store(true, Ordering::SeqCst);
    assert_eq!(barger.await.unwrap(), 0, "a newcomer jumped the queue");
    assert_eq!(*order.lock().unwrap(), (0..WAITERS).collect::<Vec<_>>());
    assert!(!f.residue(&k).await);
}

/// A queued waiter that vanished (stopped polling without leaving the queue) is
/// skipped once the waiter timeout has passed since its last poll — not before, and
/// not much later.
pub async fn fair_vanished_waiter_is_skipped(f: &impl KindFixture, _kind: Kind) {
    let timeout = Duration::from_millis(400);
    let f = f.with_waiter_timeout(timeout).await;
    let k = key(Kind::Fair, "vanished");
    let client = f.client(LONG);
    let holder = client.get_fair_lock(&k).unwrap().lock().await.unwrap();

    // The vanished waiter: one busy attempt puts it in the queue, then silence.
    let vanished = LockRequest::new(
        k.clone(),
        client.new_hold_id(),
        LockMode::Fair,
        Duration::from_secs(30),
    );
    // Its eviction deadline is set during this call: not before `before`, not after
    // `last_poll`, plus the timeout.
    let before = Instant::now();
    let answer = client.backend().acquire(&vanished).await.unwrap();
    let last_poll = Instant::now();
    assert!(matches!(answer, Acquire::Busy { .. }), "{answer:?}");

    let lock = client.get_fair_lock(&k).unwrap();
    let next = tokio::spawn(async move {
        let guard = lock
            .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
            .await?;
        let at = Instant::now();
        guard.unlock().await?;
        Ok::<_, Error>(at)
    });
    wait_until(Duration::from_secs(5), "the next waiter queued", || async {
        f.queued(&k).await == 2
    })
    .await;
    holder.unlock().await.unwrap();
    let acquired_at = next.await.unwrap().unwrap();
    assert!(
        acquired_at >= before + timeout,
        "skipped the vanished waiter early: {:?}",
        acquired_at - before
    );
    assert!(
        acquired_at < last_poll + timeout + Duration::from_secs(1),
        "skipped the vanished waiter late: {:?}",
        acquired_at - last_poll
    );
    assert!(!f.residue(&k).await);
}

// ---------------------------------------------------------------------------------------
// Read-write locks.

/// Readers overlap: four readers hold the read lock at the same time.
pub async fn readers_overlap(f: &impl KindFixture, _kind: Kind) {
    const READERS: usize = 4;
    let k = key(Kind::Read, "overlap");
    let client = f.client(LONG);
    let inside = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..READERS {
        let lock = client.get_read_write_lock(&k).unwrap().read_lock();
        let inside = inside.clone();
        tasks.push(tokio::spawn(async move {
            let guard = lock
                .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
                .await
                .unwrap();
            inside.fetch_add(1, Ordering::SeqCst);
            wait_until(Duration::from_secs(5), "all readers inside at once", || {
                let inside = inside.clone();
                async move { inside.load(Ordering::SeqCst) == READERS }
            })
            .await;
            guard.unlock().await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(!f.residue(&k).await);
}

/// Readers and writers hammer one key: a writer is always alone (measured), readers
/// never see a writer, and the writers' counter is exact.
pub async fn writers_exclude_everyone(f: &impl KindFixture, _kind: Kind) {
    const ITERS: u64 = 60;
    let k = key(Kind::Write, "exclude");
    let clients = [f.client(LONG), f.client(LONG)];
    let readers_in = Arc::new(AtomicUsize::new(0));
    let writers_in = Arc::new(AtomicUsize::new(0));
    let violations = Arc::new(AtomicUsize::new(0));
    let counter = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for t in 0..6 {
        let rw = clients[t % 2].get_read_write_lock(&k).unwrap();
        let (readers_in, writers_in, violations, counter) = (
            readers_in.clone(),
            writers_in.clone(),
            violations.clone(),
            counter.clone(),
        );
        let writer = t < 2;
        tasks.push(tokio::spawn(async move {
            for _ in 0..ITERS {
                if writer {
                    let guard = rw.write_lock().lock().await.unwrap();
                    if writers_in.fetch_add(1, Ordering::SeqCst) != 0
                        || readers_in.load(Ordering::SeqCst) != 0
                    {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    let v = counter.load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    counter.store(v + 1, Ordering::SeqCst);
                    writers_in.fetch_sub(1, Ordering::SeqCst);
                    guard.unlock().await.unwrap();
                } else {
                    let guard = rw.read_lock().lock().await.unwrap();
                    readers_in.fetch_add(1, Ordering::SeqCst);
                    if writers_in.load(Ordering::SeqCst) != 0 {
                        violations.fetch_add(1, Ordering::SeqCst);
                    }
                    tokio::task::yield_now().await;
                    readers_in.fetch_sub(1, Ordering::SeqCst);
                    guard.unlock().await.unwrap();
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(
        violations.load(Ordering::SeqCst),
        0,
        "a writer was not alone"
    );
    assert_eq!(counter.load(Ordering::SeqCst), 2 * ITERS, "lost updates");
    assert!(!f.residue(&k).await);
}

/// A writer takes `k` while a stream of readers runs, alone (no reader counted inside),
/// holds it for `hold` with `writer_in` raised for the readers to see, and releases it.
/// Returns how long it waited.
async fn writer_gets_in(
    client: &LockClient,
    k: &LockKey,
    hold: Duration,
    readers_in: &AtomicUsize,
    writer_in: &AtomicBool,
) -> Duration {
    let write = client.get_read_write_lock(k).unwrap().write_lock();
    let started = Instant::now();
    let guard = write
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .expect("the writer starved behind the readers");
    let waited = started.elapsed();
    writer_in.store(true, Ordering::SeqCst);
    assert_eq!(
        readers_in.load(Ordering::SeqCst),
        0,
        "readers inside with the writer"
    );
    tokio::time::sleep(hold).await;
    writer_in.store(false, Ordering::SeqCst);
    guard.unlock().await.unwrap();
    waited
}

/// Under a continuous stream of overlapping readers (the read lock is never free), a
/// writer gets in within the documented bound: once the readers holding when it
/// arrived are done (20 ms each here), not never.
pub async fn waiting_writer_is_not_starved(f: &impl KindFixture, _kind: Kind) {
    const READERS: usize = 4;
    const HOLD: Duration = Duration::from_millis(20);
    let k = key(Kind::Write, "starvation");
    let client = f.client(LONG);
    let stop = Arc::new(AtomicBool::new(false));
    let readers_in = Arc::new(AtomicUsize::new(0));
    let writer_in = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..READERS {
        let lock = client.get_read_write_lock(&k).unwrap().read_lock();
        let (stop, readers_in, writer_in) = (stop.clone(), readers_in.clone(), writer_in.clone());
        tasks.push(tokio::spawn(async move {
            // Staggered, so the read lock is always held by someone.
            tokio::time::sleep(HOLD * i as u32 / READERS as u32).await;
            let mut overlapped_writer = false;
            while !stop.load(Ordering::SeqCst) {
                let guard = lock.lock().await.unwrap();
                readers_in.fetch_add(1, Ordering::SeqCst);
                overlapped_writer |= writer_in.load(Ordering::SeqCst);
                tokio::time::sleep(HOLD).await;
                readers_in.fetch_sub(1, Ordering::SeqCst);
                guard.unlock().await.unwrap();
            }
            overlapped_writer
        }));
    }
    wait_until(Duration::from_secs(5), "the reader stream runs", || async {
        readers_in.load(Ordering::SeqCst) >= 2
    })
    .await;
    let waited = writer_gets_in(&client, &k, HOLD, &readers_in, &writer_in).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        assert!(!t.await.unwrap(), "a reader held the lock with the writer");
    }
    // The bound is one reader hold (20 ms); allow a loaded machine plenty.
    assert!(
        waited < Duration::from_secs(1),
        "the writer waited {waited:?}"
    );
    assert!(!f.residue(&k).await);
}

/// Readers that never let the read lock go free — each takes its next read hold (as a
/// fresh owner) before it releases the current one, so some hold is always there, with
/// no gap a writer could slip through — still cannot keep a waiting writer out: once it
/// waits, their new holds queue behind it, and it gets in as soon as the holds present
/// when it arrived are released.
pub async fn writer_not_starved_by_hand_over_hand_readers(f: &impl KindFixture, _kind: Kind) {
    const READERS: usize = 3;
    const HOLD: Duration = Duration::from_millis(20);
    let k = key(Kind::Write, "hand-over-hand");
    let client = f.client(LONG);
    let stop = Arc::new(AtomicBool::new(false));
    let readers_in = Arc::new(AtomicUsize::new(0));
    let writer_in = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for _ in 0..READERS {
        let rw = client.get_read_write_lock(&k).unwrap();
        let (stop, readers_in, writer_in) = (stop.clone(), readers_in.clone(), writer_in.clone());
        tasks.push(tokio::spawn(async move {
            let mut overlapped_writer = false;
            let mut held = rw.read_lock().lock().await.unwrap();
            readers_in.fetch_add(1, Ordering::SeqCst);
            while !stop.load(Ordering::SeqCst) {
                tokio::time::sleep(HOLD).await;
                let next = rw
                    .read_lock()
                    .try_lock_for(HOLD, Lease::Watchdog)
                    .await
                    .ok();
                if next.is_some() {
                    readers_in.fetch_add(1, Ordering::SeqCst);
                    overlapped_writer |= writer_in.load(Ordering::SeqCst);
                }
                readers_in.fetch_sub(1, Ordering::SeqCst);
                held.unlock().await.unwrap();
                held = match next {
                    Some(next) => next,
                    None => {
                        // A writer goes first; read again after it.
                        let next = rw.read_lock().lock().await.unwrap();
                        readers_in.fetch_add(1, Ordering::SeqCst);
                        overlapped_writer |= writer_in.load(Ordering::SeqCst);
                        next
                    }
                };
            }
            readers_in.fetch_sub(1, Ordering::SeqCst);
            held.unlock().await.unwrap();
            overlapped_writer
        }));
    }
    wait_until(Duration::from_secs(5), "the reader stream runs", || async {
        readers_in.load(Ordering::SeqCst) >= READERS
    })
    .await;
    let waited = writer_gets_in(&client, &k, HOLD, &readers_in, &writer_in).await;
    stop.store(true, Ordering::SeqCst);
    for t in tasks {
        assert!(!t.await.unwrap(), "a reader held the lock with the writer");
    }
    // The bound is two reader holds (40 ms); allow a loaded machine plenty.
    assert!(
        waited < Duration::from_secs(2),
        "the writer waited {waited:?}"
    );
    settles_to_no_residue(f, &k).await;
}

// ---------------------------------------------------------------------------------------
// Permits.

/// With N permits: N holders at once are possible (measured) and the N+1st waits; under
/// load there are never more than N (measured).
pub async fn permits_bound_concurrency(f: &impl KindFixture, kind: Kind) {
    let Kind::Permits(n) = kind else {
        panic!("a permits case needs Kind::Permits")
    };
    let n = n as usize;
    let k = key(kind, "bound");
    let clients = [f.client(LONG), f.client(LONG)];

    let inside = Arc::new(AtomicUsize::new(0));
    let mut holders = Vec::new();
    for i in 0..n {
        let lock = kind.lock(&clients[i % 2], &k);
        let inside = inside.clone();
        holders.push(tokio::spawn(async move {
            let guard = lock.lock().await.unwrap();
            inside.fetch_add(1, Ordering::SeqCst);
            guard
        }));
    }
    wait_until(Duration::from_secs(5), "N holders at once", || async {
        inside.load(Ordering::SeqCst) == n
    })
    .await;
    assert!(
        kind.lock(&clients[0], &k)
            .try_lock()
            .await
            .unwrap_err()
            .is_busy()
    );
    for h in holders {
        h.await.unwrap().unlock().await.unwrap();
    }

    let inside = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for t in 0..3 * n {
        let lock = kind.lock(&clients[t % 2], &k);
        let (inside, most) = (inside.clone(), most.clone());
        tasks.push(tokio::spawn(async move {
            for _ in 0..40 {
                let guard = lock.lock().await.unwrap();
                let now = inside.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::task::yield_now().await;
                inside.fetch_sub(1, Ordering::SeqCst);
                guard.unlock().await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let most = most.load(Ordering::SeqCst);
    assert!(most <= n, "{most} holders of {n} permits");
    assert!(!f.residue(&k).await);
}

/// A holder that never releases (leaked with `mem::forget`) gives its permit back when
/// its lease ends; the other holders keep theirs.
pub async fn leaked_permit_returns(f: &impl KindFixture, kind: Kind) {
    let Kind::Permits(n) = kind else {
        panic!("a permits case needs Kind::Permits")
    };
    let k = key(kind, "leaked-one");
    let client = f.client(LONG);
    let lease = Duration::from_millis(200);
    let mut others = Vec::new();
    for _ in 1..n {
        others.push(kind.lock(&client, &k).lock().await.unwrap());
    }
    let before = Instant::now();
    let leaked = kind
        .lock(&client, &k)
        .try_lock_for(Duration::ZERO, lease)
        .await
        .unwrap();
    std::mem::forget(leaked);
    let leaked_at = Instant::now();
    let lock = kind.lock(&client, &k);
    assert!(lock.try_lock().await.unwrap_err().is_busy());
    let guard = lock
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .expect("the leaked permit came back");
    let back_at = Instant::now();
    assert!(back_at >= before + lease, "early: {:?}", back_at - before);
    assert!(
        back_at < leaked_at + lease + Duration::from_secs(1),
        "late: {:?}",
        back_at - leaked_at
    );
    for other in &others {
        assert!(still_held(&client, other).await);
    }
    guard.unlock().await.unwrap();
    unlock_all(others).await;
    settles_to_no_residue(f, &k).await;
}

/// Inspection reports each kind's holders in their own mode, and its waiters: counted
/// by the store for queued kinds.
pub async fn inspection_shows_the_kind(f: &impl KindFixture, kind: Kind) {
    let client = f.client(LONG);
    let k = key(kind, "inspect");
    let holders = match kind {
        Kind::Read => 2,
        kind => kind.capacity(),
    };
    let mut guards = Vec::new();
    for _ in 0..holders {
        guards.push(kind.lock(&client, &k).lock().await.unwrap());
    }
    let lock = kind.lock(&client, &k);
    let state = lock.inspect().await.unwrap();
    let expected = match kind {
        Kind::Fair => LockMode::Fair,
        Kind::Read => LockMode::Read,
        Kind::Write => LockMode::Write,
        Kind::Permits(_) => lock.mode(),
    };
    assert_eq!(state.holders.len(), holders, "{state:?}");
    for guard in &guards {
        let h = state
            .holders
            .iter()
            .find(|h| h.hold_id == *guard.hold_id())
            .unwrap_or_else(|| panic!("{} missing from {state:?}", guard.hold_id()));
        assert_eq!(h.mode, expected);
        assert_eq!(h.holds, 1);
        assert_eq!(h.guards, Some(1));
        assert!(
            h.ttl.is_some_and(|t| t > Duration::ZERO && t <= LONG),
            "{h:?}"
        );
    }
    assert_eq!(state.waiters.count, 0);

    let waiter = tokio::spawn({
        let lock = kind.excluded(&client, &k);
        async move { lock.try_lock_for(LONG, LONG).await }
    });
    wait_until(Duration::from_secs(10), "the waiter to show", || {
        let lock = lock.clone();
        async move { lock.inspect().await.unwrap().waiters.count == 1 }
    })
    .await;
    let state = lock.inspect().await.unwrap();
    if matches!(kind, Kind::Fair | Kind::Read | Kind::Write) {
        assert_eq!(state.waiters.scope, tower_lock::WaiterScope::Store);
    }
    unlock_all(guards).await;
    waiter.await.unwrap().unwrap().unlock().await.unwrap();
    assert!(!lock.is_locked().await.unwrap());
    wait_until(Duration::from_secs(10), "nothing left", || async {
        !f.residue(&k).await
    })
    .await;
}

/// Instantiates the kind suite, given the name of an `async fn() -> impl KindFixture`
/// in the including module. One module per kind.
#[macro_export]
macro_rules! kind_tests {
    // An in-process store: every case on a paused clock.
    (paused: $fixture:ident) => {
        $crate::kind_tests!(@cases $fixture, __paused);
    };
    ($fixture:ident) => {
        $crate::kind_tests!(@cases $fixture, __each);
    };
    (@cases $fixture:ident, $flavor:ident) => {
        $crate::kind_tests!(@$flavor $fixture, fair, $crate::common::kinds::Kind::Fair;
            exclusion, reentrancy, reentry_never_shortens_the_lease,
            foreign_owner_cannot_release_or_renew,
            lease_expiry_frees_leaked_guard, watchdog_keeps_lock, lost_signal_fires,
            try_lock_for_gives_up_on_time, fencing_tokens_increase, release_wakes_waiter,
            dropped_waiter_leaves_nothing, dropped_guard_releases,
            fair_order, fair_vanished_waiter_is_skipped, inspection_shows_the_kind,
        );
        $crate::kind_tests!(@$flavor $fixture, read, $crate::common::kinds::Kind::Read;
            reentrancy, reentry_never_shortens_the_lease, foreign_owner_cannot_release_or_renew,
            lease_expiry_frees_leaked_guard, watchdog_keeps_lock, lost_signal_fires,
            try_lock_for_gives_up_on_time, fencing_tokens_increase, release_wakes_waiter,
            dropped_waiter_leaves_nothing, dropped_guard_releases,
            readers_overlap, inspection_shows_the_kind,
        );
        $crate::kind_tests!(@$flavor $fixture, write, $crate::common::kinds::Kind::Write;
            exclusion, reentrancy, reentry_never_shortens_the_lease,
            foreign_owner_cannot_release_or_renew,
            lease_expiry_frees_leaked_guard, watchdog_keeps_lock, lost_signal_fires,
            try_lock_for_gives_up_on_time, fencing_tokens_increase, release_wakes_waiter,
            dropped_waiter_leaves_nothing, dropped_guard_releases,
            writers_exclude_everyone, waiting_writer_is_not_starved,
            writer_not_starved_by_hand_over_hand_readers, inspection_shows_the_kind,
        );
        $crate::kind_tests!(@$flavor $fixture, permits, $crate::common::kinds::Kind::Permits(3);
            exclusion, reentrancy, reentry_never_shortens_the_lease,
            foreign_owner_cannot_release_or_renew,
            lease_expiry_frees_leaked_guard, watchdog_keeps_lock, lost_signal_fires,
            try_lock_for_gives_up_on_time, fencing_tokens_increase, release_wakes_waiter,
            dropped_waiter_leaves_nothing, dropped_guard_releases,
            permits_bound_concurrency, leaked_permit_returns, inspection_shows_the_kind,
        );
    };
    (@__paused $fixture:ident, $module:ident, $kind:expr; $($case:ident),* $(,)?) => {
        mod $module {
            $(
                #[tokio::test(start_paused = true)]
                async fn $case() {
                    let fixture = super::$fixture().await;
                    $crate::common::kinds::$case(&fixture, $kind).await;
                }
            )*
        }
    };
    (@__each $fixture:ident, $module:ident, $kind:expr; $($case:ident),* $(,)?) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $case() {
                    let fixture = super::$fixture().await;
                    $crate::common::kinds::$case(&fixture, $kind).await;
                }
            )*
        }
    };
}
