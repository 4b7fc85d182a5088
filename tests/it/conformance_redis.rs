//! The conformance suite against the Redis backend, on a real redis-server per test.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::redis_server::RedisServer;
use tower_lock::testing::Fixture;
use tower_lock::{LockClient, LockKey, RedisBackend};

struct Redis {
    server: RedisServer,
    /// Separate backends (connections), handed out in turn, as separate replicas would be.
    backends: Vec<RedisBackend>,
    next: AtomicUsize,
}

impl Redis {
    async fn start() -> Self {
        let server = RedisServer::start().await;
        let mut backends = Vec::new();
        for _ in 0..3 {
            backends.push(RedisBackend::connect(server.url()).await.unwrap());
        }
        Redis {
            server,
            backends,
            next: AtomicUsize::new(0),
        }
    }
}

impl Fixture for Redis {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn sabotage(&self, key: &LockKey) {
        let mut conn = self.server.conn().await;
        let deleted: i64 = redis::cmd("DEL")
            .arg(key.as_str())
            .query_async(&mut conn)
            .await
            .unwrap();
        assert_eq!(deleted, 1, "the lock hash was there to delete");
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.backends.iter().map(|b| b.local_waiters(key)).sum()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        let mut conn = self.server.conn().await;
        let exists: i64 = redis::cmd("EXISTS")
            .arg(key.as_str())
            .query_async(&mut conn)
            .await
            .unwrap();
        exists == 1 || self.waiters(key).await > 0
    }
}

tower_lock::testing::conformance_tests!(Redis::start());

/// The `ReplayStore` cases, on records in Redis.
mod replay {
    use super::*;

    tower_lock::testing::replay_conformance_tests!(Redis::start());
}

/// After `LockClient::shutdown`, no Redis key and no value mentions the client: its
/// holds (plain, fair with a queued waiter, read), its waiter's queue entries and its
/// registered name are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_no_key_of_the_client() {
    let server = RedisServer::start().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let (client, _guards, waiter) = common::holding_every_kind(backend).await;
    common::wait_until(Duration::from_secs(5), "the waiter queued", || async {
        !server.keys("redisson_lock_queue:*").await.is_empty()
    })
    .await;
    assert!(!server.keys("*").await.is_empty());

    client.shutdown().await.unwrap();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(tower_lock::Error::Shutdown)
    ));
    let left = server.keys("*").await;
    assert!(left.is_empty(), "keys left after shutdown: {left:?}");
}

/// `ping` answers while the server runs and fails as unavailable, promptly, once it is
/// stopped; it answers again after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_fails_as_unavailable_while_the_server_is_down() {
    let mut server = RedisServer::start().await;
    let backend = RedisBackend::builder(server.url())
        .response_timeout(Duration::from_millis(500))
        .connection_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    client.ping().await.expect("the server runs");
    server.kill();
    let started = std::time::Instant::now();
    let err = client.ping().await.expect_err("the server is down");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    server.restart().await;
    common::wait_until(Duration::from_secs(10), "ping answers again", || async {
        client.ping().await.is_ok()
    })
    .await;
}
