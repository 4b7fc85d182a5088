//! The [`ReplayStore`] conformance cases, one `async fn` each, for a backend whose
//! [`LockBackend::replays`](crate::backend::LockBackend::replays) keeps records. The
//! [`replay_conformance_tests!`](super::replay_conformance_tests) macro makes a test of
//! each, as [`conformance_tests!`](super::conformance_tests) does for the lock cases;
//! [`run_all_replays`](super::run_all_replays) runs them in turn against one fixture.
//!
//! ```
//! # use std::time::Duration;
//! # use tower_lock::backend::StoreAdmin;
//! # use tower_lock::testing::Fixture;
//! # use tower_lock::{LockClient, LockKey, LockMode, MemoryBackend};
//! # struct MyStore(MemoryBackend);
//! # impl Fixture for MyStore {
//! #     fn client(&self, lease: Duration) -> LockClient {
//! #         LockClient::builder(self.0.clone()).watchdog_lease(lease).build().unwrap()
//! #     }
//! #     async fn sabotage(&self, key: &LockKey) {
//! #         assert!(self.0.force_release(key, LockMode::Exclusive).await.unwrap());
//! #     }
//! #     async fn waiters(&self, key: &LockKey) -> usize { self.0.waiters(key) }
//! #     async fn residue(&self, key: &LockKey) -> bool { self.0.contains_key(key) }
//! # }
//! // tests/replay_conformance.rs: the same fixture as for the lock cases.
//! tower_lock::testing::replay_conformance_tests!(paused: async { MyStore(MemoryBackend::new()) });
//! # fn main() {}
//! ```
//!
//! The cases drive the store itself — [`LockBackend`](crate::backend::LockBackend)'s
//! `acquire` and `release` with hold identities of their own, and the
//! [`ReplayStore`] — as the `IdempotencyLayer` does below its guards, and check the
//! contract: a record is written only by a hold that still holds its lock, never over a
//! record with a greater fencing token, and goes with its TTL; the release that comes
//! with it is exactly [`LockBackend::release`](crate::backend::LockBackend::release)'s,
//! wake-up included; records round-trip byte for byte, whatever the key, and never
//! stand in a lock's way. Each case uses keys of its own (`conformance:replay:<case>...`)
//! and fencing tokens the store issued, so cases may share one store.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::{Fixture, wait_until};
use crate::backend::{Acquire, FencingToken, LockMode, LockRequest, Release, ReplayStore, Stored};
use crate::{Error, HoldId, Lease, LockClient, LockKey, StoreErrorKind};

/// Every hold's lease, unless a case says otherwise: far longer than any case, so only
/// a release frees a lock.
const LONG: Duration = Duration::from_secs(30);

/// Every record's TTL, unless a case says otherwise.
const KEEP: Duration = Duration::from_secs(60);

fn key(name: &str) -> LockKey {
    LockKey::new(format!("conformance:replay:{name}")).unwrap()
}

/// A fenced exclusive request of the hold `replay-<who>:1` on `k`, as the layer's guard
/// makes it.
fn hold(k: &LockKey, who: &str) -> LockRequest {
    LockRequest::new(
        k.clone(),
        HoldId::from_raw(format!("replay-{who}:1")).unwrap(),
        LockMode::Exclusive,
        LONG,
    )
    .fenced()
}

/// The store's records.
fn replays(client: &LockClient) -> &dyn ReplayStore {
    client
        .backend()
        .replays()
        .expect("the backend keeps records for replay (`LockBackend::replays` is `None`)")
}

/// Takes `req` in the store, which must be free for it (or held by it); its token.
async fn acquire(client: &LockClient, req: &LockRequest) -> FencingToken {
    match client.backend().acquire(req).await.unwrap() {
        Acquire::Acquired(grant) => grant.token().expect("a fenced acquisition has a token"),
        other => panic!("{} could not take {}: {other:?}", req.hold_id, req.key),
    }
}

async fn load(client: &LockClient, k: &LockKey) -> Option<Bytes> {
    replays(client).load(k).await.unwrap()
}

async fn store(
    client: &LockClient,
    req: &LockRequest,
    token: FencingToken,
    record: &str,
) -> Stored {
    replays(client)
        .store_and_release(req, token, Bytes::from(record.to_owned()), KEEP)
        .await
        .unwrap()
}

/// Whether the store shows nobody holding `k`.
async fn free(client: &LockClient, k: &LockKey) -> bool {
    let state = client.get_lock(k.clone()).unwrap().inspect().await.unwrap();
    state.holders.is_empty()
}

/// A hold that has its lock stores its record and releases it: the record loads (from
/// another client too), and the lock is free at once for another hold.
pub async fn stored_only_while_held(f: &impl Fixture) {
    let k = key("held");
    let client = f.client(LONG);
    let a = hold(&k, "a");
    let token = acquire(&client, &a).await;
    assert_eq!(
        store(&client, &a, token, "response of a").await,
        Stored::new(true, Release::Released)
    );
    let other = f.client(LONG);
    assert_eq!(
        load(&other, &k).await.as_deref(),
        Some(&b"response of a"[..])
    );
    assert!(
        free(&other, &k).await,
        "the store and release left a holder"
    );
    let b = hold(&k, "b");
    let next = acquire(&other, &b).await;
    assert!(next > token, "token {next} after {token}");
    assert_eq!(
        other.backend().release(&b).await.unwrap(),
        Release::Released
    );
    assert_eq!(
        load(&client, &k).await.as_deref(),
        Some(&b"response of a"[..]),
        "a lock's acquisition and release leave its record alone"
    );
}

/// A hold that does not have its lock stores nothing and releases nothing: released
/// before, its lease ran out, never held (while another hold has the lock), removed
/// behind its back.
pub async fn nothing_stored_without_the_lock(f: &impl Fixture) {
    let client = f.client(LONG);
    let not_held = Stored::new(false, Release::NotHeld);

    let k = key("released-before");
    let a = hold(&k, "a");
    let token = acquire(&client, &a).await;
    assert_eq!(
        client.backend().release(&a).await.unwrap(),
        Release::Released
    );
    assert_eq!(
        store(&client, &a, token, "late").await,
        not_held,
        "released"
    );
    assert_eq!(load(&client, &k).await, None);

    let k = key("lease-ran-out");
    let mut a = hold(&k, "a");
    a.lease = Duration::from_millis(50);
    let token = acquire(&client, &a).await;
    wait_until(Duration::from_secs(5), "the 50 ms lease ran out", || {
        free(&client, &k)
    })
    .await;
    assert_eq!(store(&client, &a, token, "late").await, not_held, "expired");
    assert_eq!(load(&client, &k).await, None);

    let k = key("never-held");
    let holder = hold(&k, "holder");
    let token = acquire(&client, &holder).await;
    let stranger = hold(&k, "stranger");
    let bigger = FencingToken::new(token.get() + 1);
    assert_eq!(store(&client, &stranger, bigger, "forged").await, not_held);
    assert_eq!(load(&client, &k).await, None);
    assert!(
        client.backend().renew(&holder).await.unwrap(),
        "the holder still has the lock"
    );
    assert_eq!(
        client.backend().release(&holder).await.unwrap(),
        Release::Released
    );

    let k = key("removed");
    let a = hold(&k, "a");
    let token = acquire(&client, &a).await;
    f.sabotage(&k).await;
    assert_eq!(store(&client, &a, token, "lost").await, not_held, "removed");
    assert_eq!(load(&client, &k).await, None);
}

/// A record is never overwritten by one carrying a smaller token, even from a hold that
/// has the lock now; the hold's lock is still released. A record carrying the same token
/// is replaced (the contract refuses only a greater one).
pub async fn a_greater_token_is_never_overwritten(f: &impl Fixture) {
    let k = key("greater-kept");
    let client = f.client(LONG);
    let a = hold(&k, "a");
    let t1 = acquire(&client, &a).await;
    assert_eq!(
        client.backend().release(&a).await.unwrap(),
        Release::Released
    );
    let b = hold(&k, "b");
    let t2 = acquire(&client, &b).await;
    assert_eq!(
        store(&client, &b, t2, "b").await,
        Stored::new(true, Release::Released)
    );
    let c = hold(&k, "c");
    let t3 = acquire(&client, &c).await;
    assert!(t1 < t2 && t2 < t3, "tokens {t1}, {t2}, {t3}");
    assert_eq!(
        store(&client, &c, t1, "stale").await,
        Stored::new(false, Release::Released),
        "a smaller token stores nothing, and the hold is released"
    );
    assert_eq!(load(&client, &k).await.as_deref(), Some(&b"b"[..]));
    assert!(free(&client, &k).await);

    let d = hold(&k, "d");
    acquire(&client, &d).await;
    assert_eq!(
        store(&client, &d, t2, "same token").await,
        Stored::new(true, Release::Released)
    );
    assert_eq!(load(&client, &k).await.as_deref(), Some(&b"same token"[..]));
}

/// A later holder's record, with its greater token, replaces the earlier one.
pub async fn a_greater_token_replaces_the_record(f: &impl Fixture) {
    let k = key("greater-replaces");
    let client = f.client(LONG);
    let other = f.client(LONG);
    let a = hold(&k, "a");
    let t1 = acquire(&client, &a).await;
    assert!(store(&client, &a, t1, "first").await.stored);
    let b = hold(&k, "b");
    let t2 = acquire(&other, &b).await;
    assert!(t2 > t1);
    assert_eq!(
        store(&other, &b, t2, "second").await,
        Stored::new(true, Release::Released)
    );
    assert_eq!(load(&client, &k).await.as_deref(), Some(&b"second"[..]));
}

/// A record is gone once its TTL has run out (and not before), and an expired record,
/// whatever its token, no longer stands in a store's way.
pub async fn records_expire_with_their_ttl(f: &impl Fixture) {
    const TTL: Duration = Duration::from_millis(250);
    let k = key("ttl");
    let client = f.client(LONG);
    let a = hold(&k, "a");
    let t1 = acquire(&client, &a).await;
    assert_eq!(
        client.backend().release(&a).await.unwrap(),
        Release::Released
    );
    let b = hold(&k, "b");
    let t2 = acquire(&client, &b).await;
    let sent = Instant::now();
    let out = replays(&client)
        .store_and_release(&b, t2, Bytes::from_static(b"short-lived"), TTL)
        .await
        .unwrap();
    assert_eq!(out, Stored::new(true, Release::Released));
    let loaded = load(&client, &k).await;
    if sent.elapsed() < TTL - Duration::from_millis(20) {
        assert_eq!(loaded.as_deref(), Some(&b"short-lived"[..]), "gone early");
    }
    wait_until(Duration::from_secs(5), "the record expired", || async {
        load(&client, &k).await.is_none()
    })
    .await;
    let gone_after = sent.elapsed();
    assert!(
        gone_after >= TTL - Duration::from_millis(20),
        "the record went after {gone_after:?}, before its TTL of {TTL:?}"
    );

    // The expired record carried t2; a hold now storing with the smaller t1 is stored.
    let c = hold(&k, "c");
    acquire(&client, &c).await;
    assert_eq!(
        store(&client, &c, t1, "after expiry").await,
        Stored::new(true, Release::Released),
        "an expired record still refused a smaller token"
    );
    assert_eq!(
        load(&client, &k).await.as_deref(),
        Some(&b"after expiry"[..])
    );
}

/// The release is `LockBackend::release`'s: a hold taken twice is decremented (and
/// still excludes others), the last release frees the lock and wakes a waiter at once —
/// it does not sleep out the holder's 30 s lease.
pub async fn store_and_release_releases_as_release_does(f: &impl Fixture) {
    let k = key("release");
    let client = f.client(LONG);
    let a = hold(&k, "a");
    acquire(&client, &a).await;
    let token = acquire(&client, &a).await;
    assert_eq!(
        store(&client, &a, token, "first").await,
        Stored::new(true, Release::Decremented { holds: 1 })
    );
    let other = f.client(LONG);
    let lock = other.get_lock(&k).unwrap();
    assert!(lock.try_lock().await.unwrap_err().is_busy(), "still held");
    let waiter = tokio::spawn(async move {
        let guard = lock
            .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
            .await?;
        let acquired_at = Instant::now();
        guard.unlock().await?;
        Ok::<_, Error>(acquired_at)
    });
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        f.waiters(&k).await == 1
    })
    .await;
    let released_at = Instant::now();
    assert_eq!(
        store(&client, &a, token, "second").await,
        Stored::new(true, Release::Released)
    );
    let acquired_at = waiter.await.unwrap().unwrap();
    let handoff = acquired_at.duration_since(released_at);
    assert!(
        handoff < Duration::from_secs(2),
        "the waiter slept through the store and release: {handoff:?}"
    );
    assert_eq!(load(&client, &k).await.as_deref(), Some(&b"second"[..]));
}

/// An empty record and a 1 MiB record of every byte value come back exactly; an empty
/// record is a record, not "none".
pub async fn records_round_trip_exactly(f: &impl Fixture) {
    let client = f.client(LONG);
    let big: Bytes = (0..1usize << 20)
        .map(|i| (i as u8) ^ ((i >> 8) as u8).rotate_left(3))
        .collect::<Vec<u8>>()
        .into();
    for (name, record) in [("empty", Bytes::new()), ("1mib", big)] {
        let k = key(name);
        let a = hold(&k, "a");
        let token = acquire(&client, &a).await;
        let out = replays(&client)
            .store_and_release(&a, token, record.clone(), KEEP)
            .await
            .unwrap();
        assert_eq!(out, Stored::new(true, Release::Released), "{name}");
        let loaded = load(&client, &k).await;
        let loaded = loaded.unwrap_or_else(|| panic!("the {name} record is not there"));
        assert!(loaded == record, "the {name} record came back changed");
    }
}

/// Keys with hash tags, separators and non-ASCII text keep records of their own, and a
/// record never stands in its lock's way: the lock is free after the store, a fenced
/// acquisition takes it, and its release leaves the record.
pub async fn records_live_beside_their_locks(f: &impl Fixture) {
    let client = f.client(LONG);
    let other = f.client(LONG);
    let keys = [
        key("a{b}c"),
        key("x:y"),
        key("é:ü:日本"),
        LockKey::namespaced("conformance:replay:user", "}{ 42 %").unwrap(),
        key("{tag}"),
    ];
    for k in &keys {
        let a = hold(k, "a");
        let token = acquire(&client, &a).await;
        let out = store(&client, &a, token, k.as_str()).await;
        assert_eq!(out, Stored::new(true, Release::Released), "{k}");
        assert!(free(&other, k).await, "{k}: the record shows as a holder");
        let b = hold(k, "b");
        acquire(&other, &b).await;
        assert_eq!(
            other.backend().release(&b).await.unwrap(),
            Release::Released
        );
    }
    for k in &keys {
        assert_eq!(
            load(&other, k).await.as_deref(),
            Some(k.as_str().as_bytes()),
            "{k}"
        );
    }
}

/// Records are kept under exclusive locks; a store may also keep them under the other
/// modes, or refuse those as misconfigured — and a refusal changes nothing: the hold
/// still has its lock, and no record is written.
pub async fn other_modes_are_kept_or_refused(f: &impl Fixture) {
    let client = f.client(LONG);
    let modes = [
        LockMode::Fair,
        LockMode::Read,
        LockMode::Write,
        LockMode::Permits {
            max: std::num::NonZeroU32::new(2).unwrap(),
        },
    ];
    for mode in modes {
        let k = key(&format!("mode-{mode}"));
        let mut a = hold(&k, "a");
        a.mode = mode;
        let token = acquire(&client, &a).await;
        let out = replays(&client)
            .store_and_release(&a, token, Bytes::from_static(b"kept"), KEEP)
            .await;
        match out {
            Ok(out) => {
                assert_eq!(out, Stored::new(true, Release::Released), "{mode}");
                assert_eq!(load(&client, &k).await.as_deref(), Some(&b"kept"[..]));
            }
            Err(e) if e.store_kind() == Some(StoreErrorKind::Misconfigured) => {
                assert!(
                    client.backend().renew(&a).await.unwrap(),
                    "{mode}: a refused store released the hold"
                );
                assert_eq!(load(&client, &k).await, None, "{mode}");
                assert_eq!(
                    client.backend().release(&a).await.unwrap(),
                    Release::Released
                );
            }
            Err(e) => panic!("{mode}: neither kept nor refused as misconfigured: {e:?}"),
        }
    }
}
