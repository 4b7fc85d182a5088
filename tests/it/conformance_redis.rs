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
