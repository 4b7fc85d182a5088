//! The Redis backend on a local three-master Redis Cluster (feature `cluster`): the whole
//! conformance suite, and every key and channel of a lock in one hash slot.
#![cfg(feature = "cluster")]

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::conformance::Fixture;
use common::redis_server::RedisCluster;
use redis::cluster_async::ClusterConnection;
use tower_lock::{LockClient, LockKey, RedisBackend};

struct Cluster {
    cluster: RedisCluster,
    backends: Vec<RedisBackend>,
    next: AtomicUsize,
    raw: ClusterConnection,
}

impl Cluster {
    async fn start() -> Self {
        let cluster = RedisCluster::start(3).await;
        let mut backends = Vec::new();
        for _ in 0..2 {
            backends.push(RedisBackend::cluster(cluster.urls()).build().await.unwrap());
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
        exists == 1 || self.waiters(key).await > 0
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn conformance_suite_on_a_three_master_cluster() {
    let fixture = Cluster::start().await;

    // The lock, its fencing counter and its channel hash to one slot, as the server
    // itself computes it, whether or not the name carries a hash tag.
    let mut node = fixture.cluster.nodes[0].conn().await;
    for name in ["anyLock", "lock:order:{42}", "conformance:mutex"] {
        let key = LockKey::new(name).unwrap();
        let backend = &fixture.backends[0];
        let mut slots = Vec::new();
        for k in [
            backend.lock_name(&key),
            backend.fence_name(&key),
            backend.channel_name(&key),
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

    run_conformance_cases!(&fixture);

    // The watchdog renews locks spread over many slots (and so over all three masters).
    let client = fixture.client(Duration::from_millis(300));
    let mut guards = Vec::new();
    for i in 0..60 {
        guards.push(
            client
                .get_lock(format!("spread:{i}"))
                .unwrap()
                .lock()
                .await
                .unwrap(),
        );
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
