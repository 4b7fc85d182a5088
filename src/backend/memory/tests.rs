use std::num::NonZeroU32;

use super::*;
use crate::backend::Subscription;

/// A fenced request, so that tests can compare tokens.
fn req_in(mode: LockMode, key: &str, owner: &str, lease_ms: u64) -> LockRequest {
    LockRequest::new(
        LockKey::new(key).unwrap(),
        HoldId::from_raw(owner).unwrap(),
        mode,
        Duration::from_millis(lease_ms),
    )
    .fenced()
}

fn req(key: &str, owner: &str, lease_ms: u64) -> LockRequest {
    req_in(LockMode::Exclusive, key, owner, lease_ms)
}

fn permits(max: u32) -> LockMode {
    LockMode::Permits {
        max: NonZeroU32::new(max).unwrap(),
    }
}

fn grant(a: Acquire) -> Grant {
    match a {
        Acquire::Acquired(g) => g,
        busy => panic!("expected a grant, got {busy:?}"),
    }
}

fn busy_ttl(a: Acquire) -> Option<Duration> {
    match a {
        Acquire::Busy { ttl } => ttl,
        granted => panic!("expected busy, got {granted:?}"),
    }
}

/// Whether `sub` has a stored or immediate wake-up.
async fn woken(sub: &mut Box<dyn Subscription>) -> bool {
    sub.wait(Instant::now() + Duration::from_millis(20)).await == Wake::Notified
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
async fn every_fenced_acquisition_takes_the_next_token_and_plain_ones_none() {
    let b = MemoryBackend::new();
    let a = req("k", "a:1", 10_000);
    let first = grant(b.acquire(&a).await.unwrap());
    // A re-entry in the store takes the next token, as Redisson's `RFencedLock`.
    let second = grant(b.acquire(&a).await.unwrap());
    assert_eq!((first.holds(), second.holds()), (1, 2));
    assert!(second.token() > first.token());
    let mut plain = a.clone();
    plain.fenced = false;
    assert_eq!(grant(b.acquire(&plain).await.unwrap()).token(), None);
    assert_eq!(
        b.release(&a).await.unwrap(),
        Release::Decremented { holds: 2 }
    );
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
async fn every_mode_is_supported_and_families_exclude_each_other() {
    let b = MemoryBackend::new();
    for mode in [
        LockMode::Exclusive,
        LockMode::Fair,
        LockMode::Read,
        LockMode::Write,
        permits(2),
    ] {
        let r = req_in(mode, "k", "a:1", 1000);
        grant(b.acquire(&r).await.unwrap());
        // Another family on the same key is busy, with the holder's lease.
        let other_family = if matches!(mode, LockMode::Exclusive | LockMode::Fair) {
            LockMode::Read
        } else {
            LockMode::Exclusive
        };
        let ttl = busy_ttl(
            b.acquire(&req_in(other_family, "k", "b:1", 1000))
                .await
                .unwrap(),
        );
        assert!(
            ttl.is_some_and(|t| t <= Duration::from_millis(1000)),
            "{mode}: {ttl:?}"
        );
        b.cancel_wait(&req_in(other_family, "k", "b:1", 1000))
            .await
            .unwrap();
        assert_eq!(b.release(&r).await.unwrap(), Release::Released, "{mode}");
        assert!(b.is_empty(), "{mode} left an entry");
    }
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
    let s1 = b.subscribe(&req("k", "w:1", 10)).await.unwrap();
    let s2 = b.subscribe(&req("k", "w:2", 10)).await.unwrap();
    assert_eq!(b.waiters(&a.key), 2);
    // Both park; then one release wakes exactly one of them.
    let soon = Instant::now() + Duration::from_millis(100);
    let park = |mut s: Box<dyn Subscription>| {
        tokio::spawn(async move {
            let wake = s.wait(soon).await;
            (wake, s)
        })
    };
    let (p1, p2) = (park(s1), park(s2));
    tokio::task::yield_now().await;
    b.release(&a).await.unwrap();
    let ((w1, s1), (w2, s2)) = (p1.await.unwrap(), p2.await.unwrap());
    let mut wakes = [w1, w2];
    wakes.sort_by_key(|w| *w == Wake::Deadline);
    assert_eq!(
        wakes,
        [Wake::Notified, Wake::Deadline],
        "one release, one parked waiter woken"
    );
    drop((s1, s2));
    assert_eq!(b.len(), 0);
}

/// Waiters that had not parked yet when releases came do not sleep through them: two
/// permits back wake both, once each.
#[tokio::test]
async fn a_release_before_parking_is_not_lost() {
    let b = MemoryBackend::new();
    let holders = [
        req_in(permits(2), "k", "a:1", 10_000),
        req_in(permits(2), "k", "a:2", 10_000),
    ];
    for holder in &holders {
        grant(b.acquire(holder).await.unwrap());
    }
    let mut s1 = b
        .subscribe(&req_in(permits(2), "k", "w:1", 10))
        .await
        .unwrap();
    let mut s2 = b
        .subscribe(&req_in(permits(2), "k", "w:2", 10))
        .await
        .unwrap();
    for holder in &holders {
        b.release(holder).await.unwrap();
    }
    assert!(woken(&mut s2).await);
    assert!(woken(&mut s1).await);
    // Counted once each: the next wait sleeps.
    assert!(!woken(&mut s1).await);
    assert!(!woken(&mut s2).await);
}

/// A release is the earliest waiter's, parked or not. A Redis cluster run of
/// `no_barging_past_local_waiters` saw the other way: the waiter was registered and
/// still busy with its attempt when the holder released; the releaser asked again,
/// lined up behind it and parked before the release reached this process; the release
/// then woke the only parked waiter, the releaser, which took the lock back.
#[tokio::test(start_paused = true)]
async fn a_release_wakes_the_earlier_waiter_not_the_parked_one_lined_up_behind_it() {
    let b = MemoryBackend::new();
    let holder = req("k", "h:1", 10_000);
    grant(b.acquire(&holder).await.unwrap());
    // Registered, between its attempt and its sleep.
    let mut earlier = b.subscribe(&req("k", "w:1", 10_000)).await.unwrap();
    // Lined up behind it, parked.
    let mut later = b.subscribe(&req("k", "r:1", 10_000)).await.unwrap();
    later.skip_signalled();
    let parked = tokio::spawn(async move {
        let wake = later.wait(Instant::now() + Duration::from_secs(1)).await;
        (wake, later)
    });
    tokio::task::yield_now().await;
    b.release(&holder).await.unwrap();
    let (wake, _later) = parked.await.unwrap();
    assert_eq!(
        wake,
        Wake::Deadline,
        "the waiter lined up behind took the release"
    );
    assert!(woken(&mut earlier).await);
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

#[test]
fn builder_validates_the_waiter_timeout() {
    for bad in [Duration::ZERO, Duration::from_millis(2), Duration::MAX] {
        match MemoryBackend::builder().waiter_timeout(bad).build() {
            Err(crate::ConfigError::InvalidSetting {
                name: "waiter_timeout",
                ..
            }) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
    let b = MemoryBackend::builder()
        .waiter_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    assert_eq!(b.waiter_timeout(), Duration::from_millis(300));
}

// ---- fair ----

#[tokio::test(start_paused = true)]
async fn fair_waiters_queue_and_only_the_head_takes_a_free_lock() {
    let b = MemoryBackend::new();
    let fair = |owner: &str| req_in(LockMode::Fair, "f", owner, 10_000);
    let (holder, w1, w2) = (fair("h:1"), fair("w:1"), fair("w:2"));
    grant(b.acquire(&holder).await.unwrap());
    let ttl = busy_ttl(b.acquire(&w1).await.unwrap()).unwrap();
    busy_ttl(b.acquire(&w2).await.unwrap());
    assert_eq!(b.queue_len(&holder.key), 2);
    // Queued waiters are told to poll well within the waiter timeout.
    assert!(ttl <= DEFAULT_WAITER_TIMEOUT / 3, "{ttl:?}");

    let mut sub1 = b.subscribe(&w1).await.unwrap();
    let mut sub2 = b.subscribe(&w2).await.unwrap();
    assert_eq!(b.release(&holder).await.unwrap(), Release::Released);
    // Only the head is woken, and the lock is free but not for w2.
    assert!(woken(&mut sub1).await);
    assert!(!woken(&mut sub2).await);
    busy_ttl(b.acquire(&w2).await.unwrap());
    // A newcomer does not jump the queue either.
    busy_ttl(b.acquire(&fair("late:1")).await.unwrap());
    b.cancel_wait(&fair("late:1")).await.unwrap();

    grant(b.acquire(&w1).await.unwrap());
    assert_eq!(b.queue_len(&holder.key), 1);
    assert_eq!(b.release(&w1).await.unwrap(), Release::Released);
    assert!(woken(&mut sub2).await);
    grant(b.acquire(&w2).await.unwrap());
    b.release(&w2).await.unwrap();
    drop((sub1, sub2));
    assert!(b.is_empty());
}

#[tokio::test(start_paused = true)]
async fn fair_cancel_wait_hands_the_turn_on() {
    let b = MemoryBackend::new();
    let fair = |owner: &str| req_in(LockMode::Fair, "f", owner, 10_000);
    let (holder, w1, w2) = (fair("h:1"), fair("w:1"), fair("w:2"));
    grant(b.acquire(&holder).await.unwrap());
    busy_ttl(b.acquire(&w1).await.unwrap());
    busy_ttl(b.acquire(&w2).await.unwrap());
    let mut sub2 = b.subscribe(&w2).await.unwrap();
    b.release(&holder).await.unwrap();
    // The head gives up: the next in line is woken and may go.
    b.cancel_wait(&w1).await.unwrap();
    assert!(woken(&mut sub2).await);
    grant(b.acquire(&w2).await.unwrap());
    b.release(&w2).await.unwrap();
    drop(sub2);
    assert!(b.is_empty());
}

#[tokio::test(start_paused = true)]
async fn fair_waiter_that_stops_polling_is_evicted() {
    let b = MemoryBackend::builder()
        .waiter_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let fair = |owner: &str| req_in(LockMode::Fair, "f", owner, 10_000);
    let (holder, gone, next) = (fair("h:1"), fair("gone:1"), fair("next:1"));
    grant(b.acquire(&holder).await.unwrap());
    busy_ttl(b.acquire(&gone).await.unwrap());
    let ttl = busy_ttl(b.acquire(&next).await.unwrap()).unwrap();
    assert_eq!(
        ttl,
        Duration::from_millis(100),
        "a third of the waiter timeout"
    );
    b.release(&holder).await.unwrap();

    // Until `gone` would have had to poll, the queue waits for it...
    tokio::time::advance(Duration::from_millis(200)).await;
    let ttl = busy_ttl(b.acquire(&next).await.unwrap()).unwrap();
    assert_eq!(
        ttl,
        Duration::from_millis(100),
        "told to come back at the eviction"
    );
    // ...then skips it.
    tokio::time::advance(Duration::from_millis(100)).await;
    grant(b.acquire(&next).await.unwrap());
    assert_eq!(b.queue_len(&holder.key), 0);
    b.release(&next).await.unwrap();
    assert!(b.is_empty(), "an evicted waiter leaves nothing");
}

#[tokio::test(start_paused = true)]
async fn fair_polling_keeps_the_place() {
    let b = MemoryBackend::builder()
        .waiter_timeout(Duration::from_millis(300))
        .build()
        .unwrap();
    let fair = |owner: &str| req_in(LockMode::Fair, "f", owner, 10_000);
    let (holder, first, second) = (fair("h:1"), fair("a:1"), fair("b:1"));
    grant(b.acquire(&holder).await.unwrap());
    busy_ttl(b.acquire(&first).await.unwrap());
    busy_ttl(b.acquire(&second).await.unwrap());
    for _ in 0..10 {
        tokio::time::advance(Duration::from_millis(100)).await;
        busy_ttl(b.acquire(&second).await.unwrap());
        busy_ttl(b.acquire(&first).await.unwrap());
    }
    b.release(&holder).await.unwrap();
    busy_ttl(b.acquire(&second).await.unwrap());
    grant(b.acquire(&first).await.unwrap());
}

#[tokio::test]
async fn queued_waiter_passing_on_leaves_the_queue() {
    let b = MemoryBackend::new();
    let fair = |owner: &str| req_in(LockMode::Fair, "f", owner, 10_000);
    let (holder, w1, w2) = (fair("h:1"), fair("w:1"), fair("w:2"));
    grant(b.acquire(&holder).await.unwrap());
    busy_ttl(b.acquire(&w1).await.unwrap());
    busy_ttl(b.acquire(&w2).await.unwrap());
    let mut sub1 = b.subscribe(&w1).await.unwrap();
    let mut sub2 = b.subscribe(&w2).await.unwrap();
    b.release(&holder).await.unwrap();
    assert!(woken(&mut sub1).await);
    // w1 was woken but is cancelled before it could use the turn.
    sub1.pass_on();
    assert!(woken(&mut sub2).await);
    grant(b.acquire(&w2).await.unwrap());
}

// ---- read-write ----

#[tokio::test]
async fn readers_share_and_writers_exclude() {
    let b = MemoryBackend::new();
    let read = |owner: &str| req_in(LockMode::Read, "rw", owner, 10_000);
    let write = |owner: &str| req_in(LockMode::Write, "rw", owner, 10_000);
    let r1 = grant(b.acquire(&read("r:1")).await.unwrap());
    let r2 = grant(b.acquire(&read("r:2")).await.unwrap());
    assert!(r2.token() > r1.token(), "every reader gets its own token");
    busy_ttl(b.acquire(&write("w:1")).await.unwrap());
    b.cancel_wait(&write("w:1")).await.unwrap();
    b.release(&read("r:1")).await.unwrap();
    b.release(&read("r:2")).await.unwrap();
    let w = grant(b.acquire(&write("w:1")).await.unwrap());
    assert!(w.token() > r2.token());
    busy_ttl(b.acquire(&read("r:3")).await.unwrap());
    busy_ttl(b.acquire(&write("w:2")).await.unwrap());
    for r in [read("r:3"), write("w:2")] {
        b.cancel_wait(&r).await.unwrap();
    }
    b.release(&write("w:1")).await.unwrap();
    assert!(b.is_empty());
}

#[tokio::test]
async fn writer_may_read_and_downgrade_but_a_reader_waits_to_write() {
    let b = MemoryBackend::new();
    let read = |owner: &str| req_in(LockMode::Read, "rw", owner, 10_000);
    let write = |owner: &str| req_in(LockMode::Write, "rw", owner, 10_000);
    let w = grant(b.acquire(&write("a:1")).await.unwrap());
    // A writer waits in the queue; the holder still reads (no self-deadlock).
    busy_ttl(b.acquire(&write("w:2")).await.unwrap());
    let r = grant(b.acquire(&read("a:1")).await.unwrap());
    assert!(r.token() > w.token());
    busy_ttl(b.acquire(&read("other:1")).await.unwrap());
    // Downgrade: release write, keep read.
    assert_eq!(b.release(&write("a:1")).await.unwrap(), Release::Released);
    assert!(b.renew(&read("a:1")).await.unwrap());
    assert!(!b.renew(&write("a:1")).await.unwrap());
    // a:1 now only reads: it cannot write while its own read hold lives.
    busy_ttl(b.acquire(&write("a:1")).await.unwrap());
    for r in [write("a:1"), write("w:2"), read("other:1")] {
        b.cancel_wait(&r).await.unwrap();
    }
    b.release(&read("a:1")).await.unwrap();
    assert!(b.is_empty());
}

#[tokio::test]
async fn a_read_naming_the_write_holder_goes_past_its_write_hold_only() {
    let b = MemoryBackend::new();
    let read = |owner: &str| req_in(LockMode::Read, "rw", owner, 10_000);
    let write = |owner: &str| req_in(LockMode::Write, "rw", owner, 10_000);
    grant(b.acquire(&write("a:1")).await.unwrap());
    // Another owner's read that names a:1 as its writer goes in (downgrade under a hold
    // identity of its own); one naming someone else does not.
    busy_ttl(
        b.acquire(&read("x:1").with_writer(HoldId::from_raw("z:1").unwrap()))
            .await
            .unwrap(),
    );
    b.cancel_wait(&read("x:1")).await.unwrap();
    let vouched = read("a:2").with_writer(HoldId::from_raw("a:1").unwrap());
    grant(b.acquire(&vouched).await.unwrap());
    // Downgrade: the write hold goes, the read hold stays.
    assert_eq!(b.release(&write("a:1")).await.unwrap(), Release::Released);
    assert!(b.renew(&read("a:2")).await.unwrap());
    grant(b.acquire(&read("x:1")).await.unwrap());
    b.release(&read("x:1")).await.unwrap();
    b.release(&read("a:2")).await.unwrap();
    assert!(b.is_empty());
}

#[tokio::test]
async fn new_readers_queue_behind_a_waiting_writer() {
    let b = MemoryBackend::new();
    let read = |owner: &str| req_in(LockMode::Read, "rw", owner, 10_000);
    let write = |owner: &str| req_in(LockMode::Write, "rw", owner, 10_000);
    grant(b.acquire(&read("r:1")).await.unwrap());
    busy_ttl(b.acquire(&write("w:1")).await.unwrap());
    let mut wsub = b.subscribe(&write("w:1")).await.unwrap();
    // A new reader may not overtake the waiting writer...
    busy_ttl(b.acquire(&read("r:2")).await.unwrap());
    let mut rsub = b.subscribe(&read("r:2")).await.unwrap();
    // ...but the current reader re-enters.
    assert_eq!(grant(b.acquire(&read("r:1")).await.unwrap()).holds(), 2);
    b.release(&read("r:1")).await.unwrap();
    assert!(!woken(&mut wsub).await, "a read hold is left");
    assert_eq!(b.release(&read("r:1")).await.unwrap(), Release::Released);
    // The last read unlock wakes the writer, not the reader queued behind it.
    assert!(woken(&mut wsub).await);
    assert!(!woken(&mut rsub).await);
    grant(b.acquire(&write("w:1")).await.unwrap());
    busy_ttl(b.acquire(&read("r:2")).await.unwrap());
    // The write unlock admits the readers queued behind it.
    b.release(&write("w:1")).await.unwrap();
    assert!(woken(&mut rsub).await);
    grant(b.acquire(&read("r:2")).await.unwrap());
    b.release(&read("r:2")).await.unwrap();
    drop((wsub, rsub));
    assert!(b.is_empty());
}

#[tokio::test]
async fn write_unlock_wakes_every_admitted_reader() {
    let b = MemoryBackend::new();
    let read = |owner: &str| req_in(LockMode::Read, "rw", owner, 10_000);
    let write = |owner: &str| req_in(LockMode::Write, "rw", owner, 10_000);
    grant(b.acquire(&write("w:1")).await.unwrap());
    let mut subs = Vec::new();
    for i in 0..3 {
        let r = read(&format!("r:{i}"));
        busy_ttl(b.acquire(&r).await.unwrap());
        subs.push(b.subscribe(&r).await.unwrap());
    }
    // A writer queued after the readers goes after them.
    busy_ttl(b.acquire(&write("w:2")).await.unwrap());
    let mut w2sub = b.subscribe(&write("w:2")).await.unwrap();
    b.release(&write("w:1")).await.unwrap();
    for sub in &mut subs {
        assert!(woken(sub).await);
    }
    assert!(!woken(&mut w2sub).await);
    for i in 0..3 {
        grant(b.acquire(&read(&format!("r:{i}"))).await.unwrap());
    }
}

#[tokio::test]
async fn force_release_follows_redisson() {
    let b = MemoryBackend::new();
    let read = |owner: &str| req_in(LockMode::Read, "rw", owner, 10_000);
    let write = |owner: &str| req_in(LockMode::Write, "rw", owner, 10_000);
    let key = LockKey::new("rw").unwrap();
    grant(b.acquire(&write("w:1")).await.unwrap());
    grant(b.acquire(&read("w:1")).await.unwrap());
    assert!(
        !b.force_release(&key, LockMode::Read).await.unwrap(),
        "a writer holds it"
    );
    assert!(b.force_release(&key, LockMode::Write).await.unwrap());
    assert!(b.is_empty(), "the writer's own read went with it");
    grant(b.acquire(&read("r:1")).await.unwrap());
    grant(b.acquire(&read("r:2")).await.unwrap());
    assert!(!b.force_release(&key, LockMode::Write).await.unwrap());
    assert!(b.force_release(&key, LockMode::Read).await.unwrap());
    assert_eq!(b.release(&read("r:1")).await.unwrap(), Release::NotHeld);
    assert!(b.is_empty());
}

// ---- permits ----

#[tokio::test(start_paused = true)]
async fn permits_admit_max_owners_each_with_its_lease() {
    let b = MemoryBackend::new();
    let p = |owner: &str, lease_ms| req_in(permits(2), "p", owner, lease_ms);
    let first = grant(b.acquire(&p("a:1", 100)).await.unwrap());
    grant(b.acquire(&p("b:1", 300)).await.unwrap());
    assert_eq!(
        grant(b.acquire(&p("a:1", 100)).await.unwrap()).holds(),
        2,
        "re-entry"
    );
    // Full: the wait is until the first lease ends.
    assert_eq!(
        busy_ttl(b.acquire(&p("c:1", 100)).await.unwrap()),
        Some(Duration::from_millis(100))
    );
    let mut sub = b.subscribe(&p("c:1", 100)).await.unwrap();
    tokio::time::advance(Duration::from_millis(100)).await;
    // a:1 never released: its lease ended and its permit came back.
    let c = grant(b.acquire(&p("c:1", 100)).await.unwrap());
    assert!(c.token() > first.token());
    busy_ttl(b.acquire(&p("d:1", 100)).await.unwrap());
    assert_eq!(b.release(&p("b:1", 100)).await.unwrap(), Release::Released);
    assert!(woken(&mut sub).await, "a release wakes a waiter");
    grant(b.acquire(&p("d:1", 100)).await.unwrap());
}

/// Found by the history checker: one owner queued in two modes (a write waiter at the
/// head, then a fair waiter behind it). Each busy attempt of the fair waiter woke the
/// head through a per-owner signal the fair waiter shared, so it woke itself and looped
/// without ever yielding. Wake-ups belong to one queue entry: owner *and* mode.
#[tokio::test(start_paused = true)]
async fn a_wake_up_for_one_queue_entry_does_not_wake_the_same_owners_other_entry() {
    let b = MemoryBackend::new();
    let fair = req_in(LockMode::Fair, "k", "a:1", 10_000);
    let write = req_in(LockMode::Write, "k", "a:1", 10_000);
    grant(b.acquire(&fair).await.unwrap());
    // Busy against its own fair hold: the write waiter queues, at the head.
    busy_ttl(b.acquire(&write).await.unwrap());
    let mut write_sub = b.subscribe(&write).await.unwrap();
    assert_eq!(b.release(&fair).await.unwrap(), Release::Released);
    assert!(woken(&mut write_sub).await, "the head is told it may go");

    let mut fair_sub = b.subscribe(&fair).await.unwrap();
    // Behind the write head; the attempt tells the head again, and only the head.
    busy_ttl(b.acquire(&fair).await.unwrap());
    assert!(
        !woken(&mut fair_sub).await,
        "the fair waiter was woken by its own attempt"
    );
    assert!(woken(&mut write_sub).await);
    grant(b.acquire(&write).await.unwrap());
}

/// The on-the-spot answers are the async ones, and a backend behind `Arc<dyn _>` or
/// `Box<_>` (how `LockClient` holds it), or in an `Intercepted` wrapper, keeps them and
/// its profile: the forwarding once dropped them.
#[tokio::test]
async fn on_the_spot_answers_survive_wrapping_and_match_the_async_ones() {
    let backend = MemoryBackend::new();
    let wrapped: Vec<Box<dyn LockBackend>> = vec![
        Box::new(backend.clone()),
        Box::new(Arc::new(backend.clone()) as Arc<dyn LockBackend>),
        Box::new(crate::backend::Intercepted::new(backend.clone(), ())),
    ];
    for (i, b) in wrapped.iter().enumerate() {
        let local = b
            .local()
            .unwrap_or_else(|| panic!("wrapper {i} hides the fast path"));
        assert_eq!(
            b.profile(),
            backend.profile(),
            "wrapper {i} changes the profile"
        );
        assert!(
            b.admin().and_then(|admin| admin.clients()).is_some(),
            "wrapper {i} hides the client names"
        );
        let key = format!("spot-{i}");
        let a = req(&key, "a:1", 1000);
        let other = req(&key, "b:1", 1000);
        assert!(matches!(
            local.acquire_now(&a),
            Some(Ok(Acquire::Acquired(_)))
        ));
        assert!(matches!(
            local.acquire_now(&other),
            Some(Ok(Acquire::Busy { .. }))
        ));
        assert!(matches!(b.acquire(&other).await, Ok(Acquire::Busy { .. })));
        assert!(matches!(local.release_now(&a), Some(Ok(Release::Released))));
        assert!(matches!(local.release_now(&a), Some(Ok(Release::NotHeld))));
        assert!(matches!(b.acquire(&other).await, Ok(Acquire::Acquired(_))));
        assert!(matches!(b.release(&other).await, Ok(Release::Released)));
    }
}

/// The identity is the store's address: shared by clones, different for another store.
#[test]
fn the_profile_names_this_store() {
    let (a, b) = (MemoryBackend::new(), MemoryBackend::new());
    let id = format!("memory:{:p}", Arc::as_ptr(&a.shared));
    assert_eq!(a.profile().store_id(), id);
    assert_eq!(a.clone().profile().store_id(), id);
    assert_ne!(b.profile().store_id(), id);
    assert_eq!(a.profile().name(), "memory");
    for mode in [LockMode::Fair, LockMode::Read, LockMode::Write] {
        assert!(a.profile().queues_waiters(mode), "{mode}");
    }
    assert!(!a.profile().queues_waiters(LockMode::Exclusive));
    assert_eq!(
        a.profile().clock_drift(Duration::from_secs(1)),
        Duration::ZERO
    );
}
