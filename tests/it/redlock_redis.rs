//! RedLock over five real redis-server processes: the conformance suite, a quorum error
//! when three nodes are gone, and a node restarted empty under a held lock. (The
//! multi-process scenarios — three `hammer --kind redlock` processes with two nodes
//! killed — are in `tests/redis_processes.rs`.)

use crate::common;
use tower_lock::backend::redlock::NoQuorum;

use std::time::Duration;

use common::redis_server::RedisServer;
use tokio::time::Instant;
use tower_lock::backend::LockMode;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::kinds::RedLock;
use tower_lock::testing::Fixture;
use tower_lock::{Error, Lease, LockClient, LockKey, RedisBackend};

struct Red {
    servers: Vec<RedisServer>,
    /// Each node's backend, for inspection.
    backends: Vec<RedisBackend>,
    redlock: RedLock,
}

impl Red {
    async fn start() -> Self {
        let mut servers = Vec::new();
        for _ in 0..5 {
            servers.push(RedisServer::start().await);
        }
        let (backends, redlock) = redlock_on(&servers).await;
        Red {
            servers,
            backends,
            redlock,
        }
    }

    /// Whether any running node keeps `key`.
    async fn exists_anywhere(&self, key: &LockKey) -> bool {
        for server in self.servers.iter().filter(|s| s.is_running()) {
            let exists: i64 = redis::cmd("EXISTS")
                .arg(key.as_str())
                .query_async(&mut server.conn().await)
                .await
                .unwrap();
            if exists == 1 {
                return true;
            }
        }
        false
    }
}

/// A RedLock over one new backend per server (another process would have its own). The
/// nodes connect on first use, so servers that are down do not keep it from starting.
async fn redlock_on(servers: &[RedisServer]) -> (Vec<RedisBackend>, RedLock) {
    let mut backends = Vec::new();
    for server in servers {
        let node = RedisBackend::builder(server.url())
            .lazy_connect(true)
            .build()
            .await
            .unwrap();
        backends.push(node);
    }
    let redlock = RedLock::new(backends.iter().cloned()).unwrap();
    (backends, redlock)
}

/// How many running servers hold `key` with `holder`'s field.
async fn nodes_holding(servers: &[RedisServer], key: &LockKey, holder: &str) -> usize {
    let mut holding = 0;
    for server in servers.iter().filter(|s| s.is_running()) {
        let held: i64 = redis::cmd("HEXISTS")
            .arg(key.as_str())
            .arg(holder)
            .query_async(&mut server.conn().await)
            .await
            .unwrap();
        holding += usize::try_from(held).unwrap();
    }
    holding
}

fn client(redlock: &RedLock, watchdog_lease: Duration) -> LockClient {
    LockClient::builder(redlock.clone())
        .watchdog_lease(watchdog_lease)
        .build()
        .unwrap()
}

impl Fixture for Red {
    fn local_order_is_strict(&self) -> bool {
        // A waiter woken by the first node's release may meet a split vote and back off.
        false
    }

    fn client(&self, watchdog_lease: Duration) -> LockClient {
        client(&self.redlock, watchdog_lease)
    }

    async fn sabotage(&self, key: &LockKey) {
        assert!(
            self.redlock
                .force_release(key, LockMode::Exclusive)
                .await
                .unwrap()
        );
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        // Every waiter subscribes on every reachable node.
        self.backends[0].local_waiters(key)
    }

    fn contention_iters(&self) -> u64 {
        // Every contended cycle is ten node calls plus split-vote back-offs; exact counts
        // across processes are checked with `hammer --kind redlock` as well.
        25
    }

    async fn residue(&self, key: &LockKey) -> bool {
        // A leaked hold may outlive the quorum's by a moment on one node (each node
        // started its lease at its own instant): settle first.
        let deadline = Instant::now() + Duration::from_secs(1);
        loop {
            if !self.exists_anywhere(key).await && self.waiters(key).await == 0 {
                return false;
            }
            if Instant::now() >= deadline {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

tower_lock::testing::conformance_tests!(Red::start());

/// Too few nodes to make a quorum is an outage: a call with time to wait rides it out
/// (the nodes may come back) and fails with the quorum error when its wait ends, neither
/// sooner nor hanging past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_killed_is_a_clean_quorum_error_when_the_wait_ends() {
    let mut red = Red::start().await;
    for server in &mut red.servers[..3] {
        server.kill();
    }
    let lock = client(&red.redlock, Duration::from_secs(30))
        .get_lock("no-quorum")
        .unwrap();
    let wait = Duration::from_secs(3);
    let started = Instant::now();
    let err = lock.try_lock_for(wait, Lease::Watchdog).await.unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(
            err.store_source::<NoQuorum>(),
            Some(NoQuorum {
                acquired: 2,
                needed: 3,
                total: 5,
                ..
            })
        ),
        "expected no quorum (2 of 3 needed, 5 nodes), got {err:?}"
    );
    assert!(
        took >= wait && took < wait + Duration::from_secs(1),
        "a wait of {wait:?} without a quorum took {took:?}"
    );
    assert!(
        !red.exists_anywhere(&LockKey::new("no-quorum").unwrap())
            .await,
        "the grants of the two live nodes were not undone"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_restarted_empty_does_not_let_a_second_owner_in() {
    let mut red = Red::start().await;
    let key = LockKey::new("restarted").unwrap();
    let holder = client(&red.redlock, Duration::from_millis(600))
        .get_lock(&key)
        .unwrap()
        .lock()
        .await
        .unwrap();
    // A second process: its own connections to the same five servers.
    let (_, other_redlock) = redlock_on(&red.servers).await;
    let other = client(&other_redlock, Duration::from_secs(30))
        .get_lock(&key)
        .unwrap();

    for restarted in 0..2 {
        red.servers[restarted].restart().await;
        let err = other
            .try_lock_for(Duration::from_millis(700), Lease::Watchdog)
            .await
            .unwrap_err();
        assert!(
            err.is_busy(),
            "with {} node(s) restarted empty, a second owner got in: {err:?}",
            restarted + 1
        );
    }
    // The holder's watchdog (200 ms period) kept renewing on the three nodes that still
    // hold it; the restarted ones said "not held" and were outvoted.
    assert!(!holder.is_lost());
    holder
        .unlock()
        .await
        .expect("three of five nodes still held it");
    let guard = other
        .try_lock_for(Duration::from_secs(2), Lease::Watchdog)
        .await
        .expect("free once the holder let go");
    guard.unlock().await.unwrap();
}

/// A client starts, locks and excludes with two of five nodes down from the start (its
/// nodes connect lazily); the two rejoin when they come back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_down_from_the_start_do_not_keep_a_client_from_locking() {
    let mut servers = Vec::new();
    for _ in 0..5 {
        servers.push(RedisServer::start().await);
    }
    servers[1].kill();
    servers[3].kill();
    let (_, redlock) = redlock_on(&servers).await;
    let (_, other) = redlock_on(&servers).await;
    let key = LockKey::new("down-at-start").unwrap();
    let lock = client(&redlock, Duration::from_secs(30))
        .get_lock(&key)
        .unwrap();
    let other = client(&other, Duration::from_secs(30))
        .get_lock(&key)
        .unwrap();

    let guard = lock
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .expect("three of five nodes are a quorum");
    assert_eq!(
        nodes_holding(&servers, &key, guard.hold_id().as_str()).await,
        3
    );
    let err = other.try_lock().await.unwrap_err();
    assert!(err.is_busy(), "{err:?}");
    guard.unlock().await.unwrap();

    // Back (empty): the next lock is held by all five.
    servers[1].restart().await;
    servers[3].restart().await;
    let guard = lock
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .unwrap();
    common::wait_until(Duration::from_secs(5), "all five nodes hold it", || async {
        nodes_holding(&servers, &key, guard.hold_id().as_str()).await == 5
    })
    .await;
    guard.unlock().await.unwrap();
}

/// Every node is restarted empty, one at a time, while a watched lock is held: the
/// watchdog retakes each restarted node, so the lock is held by a quorum throughout and
/// at the end, and no second owner ever gets in.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_restarts_of_every_node_keep_a_watched_lock() {
    let mut servers = Vec::new();
    for _ in 0..5 {
        servers.push(RedisServer::start().await);
    }
    let (_, redlock) = redlock_on(&servers).await;
    let (_, other) = redlock_on(&servers).await;
    let key = LockKey::new("rolling").unwrap();
    // Renewed every 300 ms.
    let holder = client(&redlock, Duration::from_millis(900))
        .get_lock(&key)
        .unwrap()
        .lock()
        .await
        .unwrap();
    let field = holder.hold_id().to_string();
    let other = client(&other, Duration::from_secs(30))
        .get_lock(&key)
        .unwrap();

    for (i, server) in servers.iter_mut().enumerate() {
        server.restart().await;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            // A second owner never gets in, on a quorum of restarted nodes or otherwise.
            match other.try_lock().await {
                Ok(guard) => panic!("a second owner got in after restarting node {i}: {guard:?}"),
                Err(err) => assert!(
                    err.is_busy() || err.store_source::<NoQuorum>().is_some(),
                    "{err:?}"
                ),
            }
            let mut conn = server.conn().await;
            let retaken: i64 = redis::cmd("HEXISTS")
                .arg(key.as_str())
                .arg(&field)
                .query_async(&mut conn)
                .await
                .unwrap();
            if retaken == 1 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "node {i} was not retaken after its restart"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(!holder.is_lost(), "lost after restarting node {i}");
    }
    assert_eq!(nodes_holding(&servers, &key, &field).await, 5);
    holder
        .unlock()
        .await
        .expect("held by every node at the end");
    let guard = other.try_lock().await.expect("free once released");
    guard.unlock().await.unwrap();
}

/// Three of five nodes go away: the holder is told its lock is lost at the next renewal
/// (it can no longer show a quorum), not an error retried until the lease runs out.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_the_quorum_is_a_loss_at_the_next_renewal() {
    let mut servers = Vec::new();
    for _ in 0..5 {
        servers.push(RedisServer::start().await);
    }
    let (_, redlock) = redlock_on(&servers).await;
    let key = LockKey::new("quorum-gone").unwrap();
    let lease = Duration::from_secs(3);
    let holder = client(&redlock, lease)
        .get_lock(&key)
        .unwrap()
        .lock()
        .await
        .unwrap();
    for server in &mut servers[..3] {
        server.kill();
    }
    let killed_at = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), holder.lost().wait())
        .await
        .expect("the loss is told");
    let after = killed_at.elapsed();
    // One renewal period (1 s) plus the node timeout, with margin; well before the 3 s
    // lease would have run out.
    assert!(after < Duration::from_millis(2_200), "told after {after:?}");
    assert!(matches!(holder.unlock().await, Err(Error::Lost)));
}
