//! The lock-kind suite (fair, read-write, permits) against the Redis backend, on a real
//! redis-server per test.

use crate::{common, kind_tests};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::kinds::KindFixture;
use common::redis_server::RedisServer;
use tower_lock::backend::LockMode;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::{LockClient, LockKey, RedisBackend};

/// A waiter timeout far above every handoff bound in the suite, so a test that passes
/// cannot have been rescued by queued waiters' polling.
const WAITER_TIMEOUT: Duration = Duration::from_secs(30);

struct Redis {
    server: Arc<RedisServer>,
    /// Separate backends (connections), handed out in turn, as separate replicas would be.
    backends: Vec<RedisBackend>,
    next: AtomicUsize,
}

impl Redis {
    async fn on(server: Arc<RedisServer>, waiter_timeout: Duration) -> Self {
        let mut backends = Vec::new();
        for _ in 0..2 {
            backends.push(
                RedisBackend::builder(server.url())
                    .waiter_timeout(waiter_timeout)
                    .build()
                    .await
                    .unwrap(),
            );
        }
        Redis {
            server,
            backends,
            next: AtomicUsize::new(0),
        }
    }
}

async fn fixture() -> Redis {
    Redis::on(Arc::new(RedisServer::start().await), WAITER_TIMEOUT).await
}

impl KindFixture for Redis {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn with_waiter_timeout(&self, timeout: Duration) -> Self {
        // The same server seen through backends configured otherwise.
        Redis::on(Arc::clone(&self.server), timeout).await
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

    async fn queued(&self, key: &LockKey) -> usize {
        let mut conn = self.server.conn().await;
        redis::cmd("LLEN")
            .arg(self.backends[0].queue_name(key))
            .query_async(&mut conn)
            .await
            .unwrap()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        // Every key of this lock but its durable fencing counter: the lock, the queue and
        // its timeouts, read leases, permit holders.
        let mut conn = self.server.conn().await;
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("*{}*", key.as_str()))
            .query_async(&mut conn)
            .await
            .unwrap();
        let left: Vec<&String> = keys
            .iter()
            .filter(|k| !k.starts_with("redisson_lock_token:"))
            .collect();
        !left.is_empty() || self.waiters(key).await > 0
    }
}

kind_tests!(fixture);
