//! The lock-kind suite (fair, read-write, permits) against the ZooKeeper backend, on a
//! real ZooKeeper server the tests start, each test under a root path of its own.

use crate::{common, kind_tests};

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::kinds::KindFixture;
use tower_lock::backend::LockMode;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::{LockClient, LockKey, ZooKeeperBackend};

/// A waiter timeout far above every handoff bound in the suite, so a test that passes
/// cannot have been rescued by skipping waiters.
const WAITER_TIMEOUT: Duration = Duration::from_secs(30);

struct Zk {
    backends: Vec<ZooKeeperBackend>,
    next: AtomicUsize,
    root: String,
    server: common::zookeeper::ZkLease,
}

impl Zk {
    async fn on(
        server: common::zookeeper::ZkLease,
        root: String,
        waiter_timeout: Duration,
    ) -> Self {
        let mut backends = Vec::new();
        for _ in 0..2 {
            backends.push(
                ZooKeeperBackend::builder(server.connect_string())
                    .root(root.clone())
                    .waiter_timeout(waiter_timeout)
                    .session_timeout(Duration::from_secs(6))
                    .build()
                    .await
                    .unwrap(),
            );
        }
        Zk {
            backends,
            next: AtomicUsize::new(0),
            root,
            server,
        }
    }

    async fn names(&self, dir: &str) -> Vec<String> {
        let mut names = self.backends[0]
            .client()
            .list_children(dir)
            .await
            .unwrap_or_default();
        names.retain(|c| c.starts_with("_c_"));
        names
    }
}

async fn fixture() -> Zk {
    let server = common::zookeeper::shared().await;
    Zk::on(
        server,
        format!("/kinds-{}", uuid::Uuid::new_v4()),
        WAITER_TIMEOUT,
    )
    .await
}

impl KindFixture for Zk {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn with_waiter_timeout(&self, timeout: Duration) -> Self {
        Zk::on(self.server.clone(), self.root.clone(), timeout).await
    }

    fn waiter_timeout(&self) -> Duration {
        self.backends[0].waiter_timeout()
    }

    async fn sabotage(&self, key: &LockKey, mode: LockMode) {
        assert!(self.backends[0].force_release(key, mode).await.unwrap());
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.backends.iter().map(|b| b.local_waiters(key)).sum()
    }

    /// Queue places: lock nodes that do not hold (for permits, the semaphore's mutex
    /// nodes, held only while acquiring).
    async fn queued(&self, key: &LockKey) -> usize {
        let dir = self.backends[0].path_of(key);
        let gates = self.names(&format!("{dir}/locks")).await.len();
        let state = self.backends[0]
            .inspect(key, LockMode::Exclusive)
            .await
            .unwrap();
        let nodes = self.names(&dir).await.len();
        gates + nodes - state.holders.len().min(nodes)
    }

    async fn residue(&self, key: &LockKey) -> bool {
        let dir = self.backends[0].path_of(key);
        let mut n = self.names(&dir).await.len();
        n += self.names(&format!("{dir}/locks")).await.len();
        n += self.names(&format!("{dir}/leases")).await.len();
        n > 0 || self.waiters(key).await > 0
    }
}

kind_tests!(fixture);
