//! The backend conformance suite and the lock-kind suite against a RedLock over five
//! in-memory nodes: RedLock is a backend like any other.

use crate::{common, kind_tests};

use std::time::Duration;

use common::kinds::KindFixture;
use tower_lock::backend::LockMode;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::kinds::RedLock;
use tower_lock::testing::Fixture;
use tower_lock::{LockClient, LockKey, MemoryBackend};

struct Red {
    nodes: Vec<MemoryBackend>,
    redlock: RedLock,
}

impl Red {
    fn new(waiter_timeout: Duration) -> Self {
        let nodes: Vec<MemoryBackend> = (0..5)
            .map(|_| {
                MemoryBackend::builder()
                    .waiter_timeout(waiter_timeout)
                    .build()
                    .unwrap()
            })
            .collect();
        let redlock = RedLock::new(nodes.iter().cloned()).unwrap();
        Red { nodes, redlock }
    }

    fn client_with(&self, watchdog_lease: Duration) -> LockClient {
        LockClient::builder(self.redlock.clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn force(&self, key: &LockKey, mode: LockMode) {
        assert!(self.redlock.force_release(key, mode).await.unwrap());
    }

    /// Whether a node keeps state for `key` once the nodes have settled: a leaked hold
    /// may outlive the quorum's by a moment on one node (each node started its lease at
    /// its own instant), so state still there after a second counts.
    async fn residue_of(&self, key: &LockKey) -> bool {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        loop {
            if !self.nodes.iter().any(|n| n.contains_key(key)) {
                return false;
            }
            if tokio::time::Instant::now() >= deadline {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Fixture for Red {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        self.client_with(watchdog_lease)
    }

    fn local_order_is_strict(&self) -> bool {
        false
    }

    async fn sabotage(&self, key: &LockKey) {
        self.force(key, LockMode::Exclusive).await;
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        // Every waiter subscribes on every reachable node.
        self.nodes[0].waiters(key)
    }

    async fn residue(&self, key: &LockKey) -> bool {
        self.residue_of(key).await
    }
}

tower_lock::testing::conformance_tests!(paused: async { Red::new(Duration::from_secs(30)) });

async fn kinds_fixture() -> Red {
    Red::new(Duration::from_secs(30))
}

impl KindFixture for Red {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        self.client_with(watchdog_lease)
    }

    async fn with_waiter_timeout(&self, timeout: Duration) -> Self {
        Red::new(timeout)
    }

    fn waiter_timeout(&self) -> Duration {
        self.nodes[0].waiter_timeout()
    }

    async fn sabotage(&self, key: &LockKey, mode: LockMode) {
        self.force(key, mode).await;
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.nodes[0].waiters(key)
    }

    async fn queued(&self, key: &LockKey) -> usize {
        self.nodes[0].queue_len(key)
    }

    async fn residue(&self, key: &LockKey) -> bool {
        self.residue_of(key).await
    }
}

kind_tests!(paused: kinds_fixture);
