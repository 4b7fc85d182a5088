//! The conformance suite against the ZooKeeper backend, on a real ZooKeeper server the
//! tests start, each test under a root path of its own.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tower_lock::backend::StoreAdmin;
use tower_lock::testing::Fixture;
use tower_lock::{LockClient, LockKey, LockMode, ZooKeeperBackend};

pub(crate) struct Zk {
    /// Separate backends (sessions), handed out in turn, as separate replicas would be.
    pub(crate) backends: Vec<ZooKeeperBackend>,
    next: AtomicUsize,
    _server: common::zookeeper::ZkLease,
}

impl Zk {
    pub(crate) async fn start() -> Self {
        let server = common::zookeeper::shared().await;
        let root = format!("/conformance-{}", uuid::Uuid::new_v4());
        let mut backends = Vec::new();
        for _ in 0..3 {
            backends.push(
                ZooKeeperBackend::builder(server.connect_string())
                    .root(root.clone())
                    .session_timeout(Duration::from_secs(6))
                    .build()
                    .await
                    .unwrap(),
            );
        }
        Zk {
            backends,
            next: AtomicUsize::new(0),
            _server: server,
        }
    }

    /// Lock nodes of `key` (holders and queue) in the store, over every mode.
    pub(crate) async fn nodes(&self, key: &LockKey) -> usize {
        let b = &self.backends[0];
        let client = b.client();
        let dir = b.path_of(key);
        let mut n = 0;
        for d in [dir.clone(), format!("{dir}/leases"), format!("{dir}/locks")] {
            if let Ok(children) = client.list_children(&d).await {
                n += children.iter().filter(|c| c.starts_with("_c_")).count();
            }
        }
        n
    }
}

impl Fixture for Zk {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn sabotage(&self, key: &LockKey) {
        let removed = self.backends[0]
            .force_release(key, LockMode::Exclusive)
            .await
            .unwrap();
        assert!(removed, "the hold was there to delete");
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.backends.iter().map(|b| b.local_waiters(key)).sum()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        self.nodes(key).await > 0 || self.waiters(key).await > 0
    }
}

tower_lock::testing::conformance_tests!(Zk::start());

/// Nothing a client sends grows the store for good: a thousand distinct names locked
/// once (fenced and not, released or leaked with a fixed lease) leave no node behind
/// once their leases ran out: released ones at once, leaked ones by their own
/// backend's sweep, and the emptied directories (container nodes) by the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_leave_no_nodes_behind() {
    let zk = Zk::start().await;
    let client = LockClient::new(zk.backends[0].clone());
    for i in 0..1000 {
        let name = format!("growth/{i}");
        let guard = if i % 2 == 0 {
            client.get_fenced_lock(&name).unwrap()
        } else {
            client.get_lock(&name).unwrap()
        }
        .try_lock_for(Duration::ZERO, Duration::from_secs(3))
        .await
        .unwrap();
        if i % 3 == 0 {
            // Left to its lease.
            std::mem::forget(guard);
        } else {
            guard.unlock().await.unwrap();
        }
        if i == 30 {
            let mut held = 0;
            for j in 0..=30 {
                held += zk
                    .nodes(&LockKey::new(format!("growth/{j}")).unwrap())
                    .await;
            }
            assert_eq!(held, 11, "the leaked holds are there");
        }
    }
    let b = &zk.backends[0];
    let root = b.root().to_owned();
    let zk_client = b.client();
    common::wait_until(Duration::from_secs(20), "the store emptied", || {
        let zk_client = zk_client.clone();
        let root = root.clone();
        async move {
            match zk_client.list_children(&root).await {
                Err(zookeeper_client::Error::NoNode) => true,
                Ok(children) => children.is_empty(),
                Err(_) => false,
            }
        }
    })
    .await;
}
