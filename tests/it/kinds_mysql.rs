//! The lock-kind suite (fair, read-write, permits) against the MySQL/MariaDB backend, on a
//! real server and a database of its own per test.

use crate::{common, kind_tests};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::kinds::KindFixture;
use common::mysql::MyDatabase;
use tower_lock::backend::LockMode;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::{LockClient, LockKey, MySqlBackend};

/// A waiter timeout far above every handoff bound in the suite, so a test that passes
/// cannot have been rescued by queued waiters' polling.
const WAITER_TIMEOUT: Duration = Duration::from_secs(30);

struct MySql {
    backends: Vec<MySqlBackend>,
    next: AtomicUsize,
    db: Arc<MyDatabase>,
}

impl MySql {
    async fn on(db: Arc<MyDatabase>, waiter_timeout: Duration) -> Self {
        let mut backends = Vec::new();
        for _ in 0..2 {
            backends.push(
                MySqlBackend::builder(db.pool(4).await)
                    .waiter_timeout(waiter_timeout)
                    .build()
                    .await
                    .unwrap(),
            );
        }
        MySql {
            backends,
            next: AtomicUsize::new(0),
            db,
        }
    }
}

async fn fixture() -> MySql {
    MySql::on(Arc::new(MyDatabase::create().await), WAITER_TIMEOUT).await
}

impl KindFixture for MySql {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn with_waiter_timeout(&self, timeout: Duration) -> Self {
        MySql::on(Arc::clone(&self.db), timeout).await
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
        let n: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM tower_lock_queue WHERE name = ?")
            .bind(key.as_str())
            .fetch_one(self.backends[0].pool())
            .await
            .unwrap();
        usize::try_from(n).unwrap()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        let rows: i64 = sqlx::query_scalar(
            "SELECT CAST((SELECT COUNT(*) FROM tower_lock WHERE name = ? \
                      AND expires_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))) \
                  + (SELECT COUNT(*) FROM tower_lock_queue WHERE name = ? \
                      AND evict_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))) AS SIGNED)",
        )
        .bind(key.as_str())
        .bind(key.as_str())
        .fetch_one(self.backends[0].pool())
        .await
        .unwrap();
        rows > 0 || self.waiters(key).await > 0
    }
}

kind_tests!(fixture);
