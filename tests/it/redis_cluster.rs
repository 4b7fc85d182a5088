//! The Redis backend on a local three-master Redis Cluster (feature `cluster`): the whole
//! conformance suite, the lock kinds' cases that run every script of theirs, and every
//! key and channel of a lock in one hash slot.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::kinds::{self, Kind, KindFixture};
use common::redis_server::{RedisCluster, command_calls};
use redis::cluster_async::ClusterConnection;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::backend::{Acquire, LockBackend, LockMode, LockRequest, Release};
use tower_lock::testing::Fixture;
use tower_lock::{HoldId, LockClient, LockKey, RedisBackend};

struct Cluster {
    cluster: Arc<RedisCluster>,
    backends: Vec<RedisBackend>,
    next: AtomicUsize,
    raw: ClusterConnection,
}

impl Cluster {
    async fn start() -> Self {
        Self::on(
            Arc::new(RedisCluster::start(3).await),
            Duration::from_secs(30),
        )
        .await
    }

    async fn on(cluster: Arc<RedisCluster>, waiter_timeout: Duration) -> Self {
        let mut backends = Vec::new();
        for _ in 0..2 {
            backends.push(
                RedisBackend::cluster(cluster.urls())
                    .waiter_timeout(waiter_timeout)
                    .build()
                    .await
                    .unwrap(),
            );
        }
        let raw = redis::cluster::ClusterClient::new(cluster.urls())
            .unwrap()
            .get_async_connection()
            .await
            .unwrap();
        Cluster {
            cluster,
            backends,
            next: AtomicUsize::new(0),
            raw,
        }
    }
}

impl Fixture for Cluster {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn sabotage(&self, key: &LockKey) {
        let deleted: i64 = redis::cmd("DEL")
            .arg(key.as_str())
            .query_async(&mut self.raw.clone())
            .await
            .unwrap();
        assert_eq!(deleted, 1);
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.backends.iter().map(|b| b.local_waiters(key)).sum()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        let exists: i64 = redis::cmd("EXISTS")
            .arg(key.as_str())
            .query_async(&mut self.raw.clone())
            .await
            .unwrap();
        exists == 1 || Fixture::waiters(self, key).await > 0
    }
}

impl KindFixture for Cluster {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        Fixture::client(self, watchdog_lease)
    }

    async fn with_waiter_timeout(&self, timeout: Duration) -> Self {
        Cluster::on(Arc::clone(&self.cluster), timeout).await
    }

    fn waiter_timeout(&self) -> Duration {
        self.backends[0].waiter_timeout()
    }

    async fn sabotage(&self, key: &LockKey, mode: LockMode) {
        assert!(self.backends[0].force_release(key, mode).await.unwrap());
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        Fixture::waiters(self, key).await
    }

    async fn queued(&self, key: &LockKey) -> usize {
        redis::cmd("LLEN")
            .arg(self.backends[0].queue_name(key))
            .query_async(&mut self.raw.clone())
            .await
            .unwrap()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        // Every key of the lock but its fencing counter, on whichever master has its slot.
        for node in &self.cluster.nodes {
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("*{}*", key.as_str()))
                .query_async(&mut node.conn().await)
                .await
                .unwrap();
            if keys.iter().any(|k| !k.starts_with("redisson_lock_token:")) {
                return true;
            }
        }
        Fixture::waiters(self, key).await > 0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_suite_on_a_three_master_cluster() {
    let fixture = Cluster::start().await;

    // The lock, its fencing counter, its channel and its record for replay hash to one
    // slot, as the server itself computes it, whether or not the name carries a hash
    // tag.
    let mut node = fixture.cluster.nodes[0].conn().await;
    for name in [
        "anyLock",
        "lock:order:{42}",
        "conformance:mutex",
        "a{b}c",
        "é:{ü}",
    ] {
        let key = LockKey::new(name).unwrap();
        let backend = &fixture.backends[0];
        let mut slots = Vec::new();
        for k in [
            backend.lock_name(&key),
            backend.fence_name(&key),
            backend.channel_name(&key),
            backend.replay_name(&key),
        ] {
            let slot: i64 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(&k)
                .query_async(&mut node)
                .await
                .unwrap();
            slots.push(slot);
        }
        assert!(slots.windows(2).all(|w| w[0] == w[1]), "{name}: {slots:?}");
    }

    tower_lock::testing::run_all(&fixture).await;
    // Records for replay: each script call goes to its lock's master, and its release
    // publishes on the lock's shard.
    tower_lock::testing::run_all_replays(&fixture).await;

    // The lock kinds: the cases that between them run every fair, read-write and permit
    // script (the read holds' lease keys are named inside the scripts, so this is also
    // where the server checks they share the lock's slot).
    let f = &fixture;
    for kind in [Kind::Fair, Kind::Read, Kind::Write, Kind::Permits(3)] {
        eprintln!("kind case {kind:?}");
        kinds::reentrancy(f, kind).await;
        kinds::lost_signal_fires(f, kind).await;
        kinds::try_lock_for_gives_up_on_time(f, kind).await;
        kinds::release_wakes_waiter(f, kind).await;
        kinds::dropped_guard_releases(f, kind).await;
    }
    kinds::fair_order(f, Kind::Fair).await;
    kinds::fair_vanished_waiter_is_skipped(f, Kind::Fair).await;
    kinds::writers_exclude_everyone(f, Kind::Write).await;
    kinds::writer_not_starved_by_hand_over_hand_readers(f, Kind::Write).await;
    kinds::permits_bound_concurrency(f, Kind::Permits(3)).await;
    kinds::leaked_permit_returns(f, Kind::Permits(3)).await;

    // The watchdog renews locks of every kind spread over many slots (and so over all
    // three masters).
    let client = Fixture::client(&fixture, Duration::from_millis(300));
    let mut guards = Vec::new();
    for i in 0..60 {
        let kind = [
            None,
            Some(Kind::Fair),
            Some(Kind::Read),
            Some(Kind::Write),
            Some(Kind::Permits(2)),
        ][i % 5];
        let key = LockKey::new(format!("spread:{i}")).unwrap();
        let lock = match kind {
            None => client.get_lock(&key).unwrap(),
            Some(kind) => kind.lock(&client, &key),
        };
        guards.push(lock.lock().await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(900)).await;
    for (i, g) in guards.iter().enumerate() {
        assert!(
            !g.is_lost(),
            "lock {i} was lost: renewals across slots failed"
        );
    }
    for g in guards {
        g.unlock().await.unwrap();
    }
}

/// Group commit on a cluster: 96 acquisitions started together, of keys in three hash
/// slots, share script calls — one call carries only keys of one slot, so each goes to
/// its slot's master — and every one is answered as if alone; so are the releases, and
/// nothing is left behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acquisitions_in_flight_together_share_script_calls_per_slot() {
    let cluster = RedisCluster::start(3).await;
    let backend = RedisBackend::cluster(cluster.urls()).build().await.unwrap();
    let keys: Vec<LockKey> = (0..96)
        .map(|i| LockKey::new(format!("{{slot-{}}}:{i}", i % 3)).unwrap())
        .collect();
    let reqs: Vec<LockRequest> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            LockRequest::new(
                k.clone(),
                HoldId::from_raw(format!("grouped:{i}")).unwrap(),
                LockMode::Exclusive,
                Duration::from_secs(30),
            )
        })
        .collect();
    let script_calls = || async {
        let mut calls = 0;
        for node in &cluster.nodes {
            calls += command_calls(&mut node.conn().await, &["evalsha", "eval"]).await;
        }
        calls
    };
    let before = script_calls().await;
    let acquired = futures_util::future::join_all(reqs.iter().map(|r| backend.acquire(r))).await;
    let calls = script_calls().await - before;
    for (i, a) in acquired.iter().enumerate() {
        assert!(
            matches!(a, Ok(Acquire::Acquired(g)) if g.holds() == 1),
            "acquisition {i}: {a:?}"
        );
    }
    assert!(
        calls < 96,
        "96 acquisitions together took {calls} script calls"
    );
    let mut raw = redis::cluster::ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    for (i, k) in keys.iter().enumerate() {
        let holder: HashMap<String, i64> = redis::cmd("HGETALL")
            .arg(backend.lock_name(k))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(
            holder,
            HashMap::from([(format!("grouped:{i}"), 1)]),
            "key {i}"
        );
    }
    let released = futures_util::future::join_all(reqs.iter().map(|r| backend.release(r))).await;
    assert!(
        released.iter().all(|r| matches!(r, Ok(Release::Released))),
        "{released:?}"
    );
    for node in &cluster.nodes {
        let left = node.keys("*slot-*").await;
        assert!(left.is_empty(), "left on {}: {left:?}", node.port());
    }
    eprintln!("96 acquisitions in three slots took {calls} script calls");
}

/// Regression (a slot move under the hammer failed a lock call as a misconfigured store,
/// "Script attempted to access a non local key in a cluster node"): one owner's release
/// and another's acquisition of the same lock go in one batch call while its slot is
/// migrating. Redis serves the call on the source, where the hash still is; the release
/// deletes it, and the acquisition's first look at the key is refused, since a key
/// missing from a migrating slot is the target's. The acquisition had changed nothing:
/// it is sent again, goes to the target, and gets the lock, as does the release queued
/// behind it in the same call. Nothing is left on the source.
#[tokio::test]
async fn an_acquisition_batched_behind_its_locks_release_in_a_slot_move_is_sent_again() {
    let cluster = RedisCluster::start(3).await;
    let backend = RedisBackend::cluster(cluster.urls()).build().await.unwrap();
    let key = LockKey::new("{moving}:lock").unwrap();
    let name = backend.lock_name(&key);
    let slot = cluster.slot_of(&name).await;
    let home = cluster.master_of(slot).await;
    let away = cluster.another_master(home).await;
    let request = |owner: &str| {
        LockRequest::new(
            key.clone(),
            HoldId::from_raw(owner).unwrap(),
            LockMode::Exclusive,
            Duration::from_secs(30),
        )
    };
    let (first, second) = (request("first"), request("second"));
    let acquired = backend.acquire(&first).await;
    assert!(matches!(acquired, Ok(Acquire::Acquired(_))), "{acquired:?}");
    let migration = cluster.open_migration(slot, away).await;

    // Polled together before the batcher's task runs: one batch call, in this order.
    let (released, acquired, released_again) = tokio::join!(
        backend.release(&first),
        backend.acquire(&second),
        backend.release(&second),
    );
    assert!(matches!(released, Ok(Release::Released)), "{released:?}");
    assert!(
        matches!(acquired, Ok(Acquire::Acquired(ref g)) if g.holds() == 1),
        "the acquisition behind the release: {acquired:?}"
    );
    assert!(
        matches!(released_again, Ok(Release::Released)),
        "the release behind it: {released_again:?}"
    );
    let on = |port: u16| {
        let node = cluster.nodes.iter().find(|n| n.port() == port).unwrap();
        async move { node.keys("*moving*").await }
    };
    assert_eq!(on(home).await, Vec::<String>::new(), "left on the source");
    assert_eq!(on(away).await, Vec::<String>::new(), "left on the target");

    // The target serves the lock from here on.
    let acquired = backend.acquire(&second).await;
    assert!(matches!(acquired, Ok(Acquire::Acquired(_))), "{acquired:?}");
    assert_eq!(on(away).await, vec![name.clone()], "the hold on the target");
    cluster.close_migration(migration).await;
    let released = backend.release(&second).await;
    assert!(matches!(released, Ok(Release::Released)), "{released:?}");
    assert_eq!(on(away).await, Vec::<String>::new(), "left after the move");
}
