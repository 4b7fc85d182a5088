//! The conformance suite against the PostgreSQL backend, on a real server and a
//! database of its own per test (dropped afterwards).

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::postgres::PgDatabase;
use tower_lock::backend::{LockBackend, LockMode};
use tower_lock::testing::Fixture;
use tower_lock::{LockClient, LockKey, PostgresBackend};

struct Postgres {
    /// Separate backends (pools and listeners), handed out in turn, as separate replicas
    /// would be; the second keeps connections, the third grants fast.
    backends: Vec<PostgresBackend>,
    next: AtomicUsize,
    /// Last: dropped after the backends.
    _db: PgDatabase,
}

impl Postgres {
    async fn start() -> Self {
        let db = PgDatabase::create().await;
        let mut backends = Vec::new();
        for i in 0..3 {
            let pool = db.pool(4).await;
            let mut builder = PostgresBackend::builder(pool);
            // One replica keeps connections between statements, one grants fast
            // (without waiting for the disk) and has released locks handed to its
            // waiters: the same rules.
            if i == 1 {
                builder = builder.kept_connections(2);
            }
            if i == 2 {
                builder = builder.fast_grants(Duration::from_secs(60)).hand_over(true);
            }
            backends.push(builder.build().await.unwrap());
        }
        Postgres {
            backends,
            next: AtomicUsize::new(0),
            _db: db,
        }
    }
}

impl Fixture for Postgres {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.backends.len();
        LockClient::builder(self.backends[i].clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn sabotage(&self, key: &LockKey) {
        // An exclusive hold is the owner of the name's row; the others are rows.
        let pool = self.backends[0].pool();
        let freed = sqlx::query(
            "UPDATE tower_lock_names SET owner = NULL, holds = 0 \
              WHERE name = $1 AND owner IS NOT NULL",
        )
        .bind(key.as_str())
        .execute(pool)
        .await
        .unwrap()
        .rows_affected();
        let deleted = sqlx::query("DELETE FROM tower_lock WHERE name = $1")
            .bind(key.as_str())
            .execute(pool)
            .await
            .unwrap()
            .rows_affected();
        assert_eq!(freed + deleted, 1, "the hold was there to delete");
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.backends.iter().map(|b| b.local_waiters(key)).sum()
    }

    async fn residue(&self, key: &LockKey) -> bool {
        let rows: i64 = sqlx::query_scalar(
            "SELECT (SELECT count(*) FROM tower_lock WHERE name = $1 AND expires_at > clock_timestamp()) \
                  + (SELECT count(*) FROM tower_lock_names \
                      WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp()) \
                  + (SELECT count(*) FROM tower_lock_queue WHERE name = $1)",
        )
        .bind(key.as_str())
        .fetch_one(self.backends[0].pool())
        .await
        .unwrap();
        rows > 0 || self.waiters(key).await > 0
    }
}

tower_lock::testing::conformance_tests!(Postgres::start());

/// The `ReplayStore` cases, on records in `<table>_replay`.
mod replay {
    use super::*;

    tower_lock::testing::replay_conformance_tests!(Postgres::start());
}

#[test]
fn database_urls() {
    use common::postgres::with_database;
    assert_eq!(
        with_database("postgres://root@127.0.0.1:5432/postgres", "t1"),
        "postgres://root@127.0.0.1:5432/t1"
    );
    assert_eq!(
        with_database("postgres://u:p@h/postgres?sslmode=disable", "t1"),
        "postgres://u:p@h/t1?sslmode=disable"
    );
    assert_eq!(
        with_database("postgres://h:5432", "t1"),
        "postgres://h:5432/t1"
    );
}

/// Bad input gets typed errors; a schema that is not there fails closed.
#[tokio::test]
async fn bad_configuration_is_refused_by_name() {
    let db = PgDatabase::create().await;
    let pool = db.pool(2).await;
    for (table, schema) in [("Bad-Name", "public"), ("ok", "x;drop"), ("", "public")] {
        let err = PostgresBackend::builder(pool.clone())
            .table(table)
            .schema(schema)
            .build()
            .await
            .unwrap_err();
        assert!(matches!(err, tower_lock::SetupError::Config(_)), "{err}");
    }
    let err = PostgresBackend::builder(pool.clone())
        .waiter_timeout(Duration::ZERO)
        .build()
        .await
        .unwrap_err();
    assert!(err.to_string().contains("waiter_timeout"), "{err}");
    // Not migrated: the functions are missing — a misconfiguration, not an outage.
    let unmigrated = PostgresBackend::builder(pool.clone())
        .table("never_created")
        .migrate(false)
        .build()
        .await
        .unwrap();
    let req = tower_lock::backend::LockRequest::new(
        LockKey::new("k").unwrap(),
        tower_lock::HoldId::from_raw("me:1").unwrap(),
        LockMode::Exclusive,
        Duration::from_secs(1),
    );
    let err = unmigrated.acquire(&req).await.unwrap_err();
    assert!(!err.is_unavailable() && err.is_backend(), "{err:?}");
    assert!(
        PostgresBackend::connect("mysql://nope").await.is_err(),
        "not a PostgreSQL URL"
    );
}

/// After `LockClient::shutdown`, no row of the holds, queue or names tables mentions
/// the client: its holds (plain, fair with a queued waiter, read) and its registered
/// name are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_leaves_no_row_of_the_client() {
    let db = PgDatabase::create().await;
    let pool = db.pool(4).await;
    let backend = PostgresBackend::builder(pool.clone())
        .build()
        .await
        .unwrap();
    let (client, _guards, waiter) = common::holding_every_kind(backend).await;
    let of_client = |table: &'static str| {
        let pool = pool.clone();
        let id = format!("{}%", client.id());
        async move {
            let column = if table == "tower_lock_clients" {
                "id"
            } else {
                "owner"
            };
            let sql = format!("SELECT count(*) FROM {table} WHERE {column}::text LIKE $1");
            sqlx::query_scalar::<_, i64>(&sql)
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    common::wait_until(Duration::from_secs(5), "the waiter queued", || async {
        of_client("tower_lock_queue").await == 1
    })
    .await;
    // The plain lock in the names table, the fair and the read hold in the holds table.
    assert_eq!(of_client("tower_lock_names").await, 1);
    assert_eq!(of_client("tower_lock").await, 2);
    assert_eq!(of_client("tower_lock_clients").await, 1);

    client.shutdown().await.unwrap();
    assert!(matches!(
        waiter.await.unwrap(),
        Err(tower_lock::Error::Shutdown)
    ));
    for table in [
        "tower_lock",
        "tower_lock_names",
        "tower_lock_queue",
        "tower_lock_clients",
    ] {
        assert_eq!(
            of_client(table).await,
            0,
            "rows of the client left in {table}"
        );
    }
    drop(client);
}

/// `ping` answers while the database runs and fails as unavailable once it is stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_fails_as_unavailable_while_the_server_is_down() {
    let Some(mut server) = common::postgres::PgServer::start() else {
        eprintln!("skipped: no PostgreSQL binaries to start a server of our own");
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_millis(500))
        .connect(&server.url())
        .await
        .unwrap();
    let backend = PostgresBackend::builder(pool)
        .response_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    client.ping().await.expect("the database runs");
    server.kill();
    let err = client.ping().await.expect_err("the database is down");
    assert!(err.is_unavailable(), "{err:?}");
    server.restart();
    common::wait_until(Duration::from_secs(10), "ping answers again", || async {
        client.ping().await.is_ok()
    })
    .await;
}
