//! The conformance suite against the MySQL/MariaDB backend, on a real server and a
//! database of its own per test (dropped afterwards).

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::mysql::MyDatabase;
use tower_lock::testing::Fixture;
use tower_lock::{LockClient, LockKey, MySqlBackend};

struct MySql {
    /// Separate backends (pools and listeners), handed out in turn, as separate replicas
    /// would be.
    backends: Vec<MySqlBackend>,
    next: AtomicUsize,
    /// Last: dropped after the backends.
    _db: MyDatabase,
}

impl MySql {
    async fn start() -> Self {
        let db = MyDatabase::create().await;
        let mut backends = Vec::new();
        for _ in 0..3 {
            let pool = db.pool(4).await;
            backends.push(MySqlBackend::builder(pool).build().await.unwrap());
        }
        MySql {
            backends,
            next: AtomicUsize::new(0),
            _db: db,
        }
    }
}

impl Fixture for MySql {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn sabotage(&self, key: &LockKey) {
        let deleted = sqlx::query("DELETE FROM tower_lock WHERE name = ?")
            .bind(key.as_str())
            .execute(self.backends[0].pool())
            .await
            .unwrap()
            .rows_affected();
        assert_eq!(deleted, 1, "the hold was there to delete");
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.backends.iter().map(|b| b.local_waiters(key)).sum()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        let rows: i64 = sqlx::query_scalar(
            "SELECT CAST((SELECT COUNT(*) FROM tower_lock WHERE name = ? \
                      AND expires_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))) \
                  + (SELECT COUNT(*) FROM tower_lock_queue WHERE name = ?) AS SIGNED)",
        )
        .bind(key.as_str())
        .bind(key.as_str())
        .fetch_one(self.backends[0].pool())
        .await
        .unwrap();
        rows > 0 || self.waiters(key).await > 0
    }
}

tower_lock::testing::conformance_tests!(MySql::start());

/// The `ReplayStore` cases, on records in `<table>_replay`.
mod replay {
    use super::*;

    tower_lock::testing::replay_conformance_tests!(MySql::start());
}

/// Nothing a client sends grows the tables for good: a thousand distinct names locked
/// once (fenced and not, released or left to expire) leave no row behind once they
/// have been free for the token retention, and the sweep takes them in bounded steps.
#[tokio::test]
async fn names_free_for_the_retention_leave_no_rows() {
    let db = MyDatabase::create().await;
    let backend = MySqlBackend::builder(db.pool(4).await)
        .token_retention(Duration::from_secs(1))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let rows = async || -> i64 {
        sqlx::query_scalar(
            "SELECT CAST((SELECT COUNT(*) FROM tower_lock_names) + (SELECT COUNT(*) FROM tower_lock) AS SIGNED)",
        )
        .fetch_one(backend.pool())
        .await
        .unwrap()
    };
    for i in 0..1000 {
        let name = format!("growth:{i}");
        let guard = if i % 2 == 0 {
            client.get_fenced_lock(&name).unwrap()
        } else {
            client.get_lock(&name).unwrap()
        }
        .try_lock_for(Duration::ZERO, Duration::from_secs(1))
        .await
        .unwrap();
        if i == 0 {
            assert!(rows().await > 0, "the name was written");
        }
        if i % 3 == 0 {
            // Left to its lease.
            std::mem::forget(guard);
        } else {
            guard.unlock().await.unwrap();
        }
    }
    common::wait_until(
        Duration::from_secs(20),
        "the sweep emptied the tables",
        || async { rows().await == 0 },
    )
    .await;
}
