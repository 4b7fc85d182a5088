//! The MySQL/MariaDB database harness itself (`common::mysql`): its URL helpers, and
//! that a test's database is gone when the test ends, whatever it left open on it.

use std::time::Duration;

use sqlx::{Connection, MySqlConnection};

use crate::common::mysql::{MyDatabase, admin_url, with_database, with_local_port};

#[test]
fn with_database_replaces_or_adds_the_database() {
    let cases = [
        (
            "mysql://root@127.0.0.1:3306/mysql",
            "mysql://root@127.0.0.1:3306/t1",
        ),
        (
            "mysql://root@127.0.0.1:3306",
            "mysql://root@127.0.0.1:3306/t1",
        ),
        (
            "mysql://root@127.0.0.1:3306/",
            "mysql://root@127.0.0.1:3306/t1",
        ),
        (
            "mysql://tower_lock:tower_lock@127.0.0.1:3306/mysql?ssl-mode=disabled",
            "mysql://tower_lock:tower_lock@127.0.0.1:3306/t1?ssl-mode=disabled",
        ),
        (
            "mysql://u:p%2Fq%40r@db.example:3307?ssl-mode=disabled",
            "mysql://u:p%2Fq%40r@db.example:3307/t1?ssl-mode=disabled",
        ),
        ("mysql://[::1]:3306/mysql", "mysql://[::1]:3306/t1"),
    ];
    for (base, expected) in cases {
        assert_eq!(with_database(base, "t1"), expected, "{base}");
    }
}

#[test]
fn with_local_port_keeps_login_database_and_options() {
    assert_eq!(
        with_local_port("mysql://u:p@db.example:3306/t1?ssl-mode=disabled", 4000),
        "mysql://u:p@127.0.0.1:4000/t1?ssl-mode=disabled"
    );
    assert_eq!(
        with_local_port("mysql://127.0.0.1:3306", 4000),
        "mysql://127.0.0.1:4000"
    );
}

/// The database exists while the value lives and is gone after, even with a pool
/// still open and a transaction in it holding a row lock and its table's metadata
/// lock (which `DROP DATABASE` would wait for).
#[tokio::test]
async fn the_database_is_dropped_with_a_transaction_open_on_it() {
    let db = MyDatabase::create().await;
    let name = db.name().to_owned();
    let pool = db.pool(2).await;
    sqlx::query("CREATE TABLE t (id INT PRIMARY KEY) ENGINE = InnoDB")
        .execute(&pool)
        .await
        .unwrap();
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("INSERT INTO t VALUES (1)")
        .execute(&mut *tx)
        .await
        .unwrap();
    let mut admin = MySqlConnection::connect(&admin_url()).await.unwrap();
    let exists = async |admin: &mut MySqlConnection| -> bool {
        sqlx::query_scalar::<_, i64>(
            "SELECT COUNT(*) FROM information_schema.schemata WHERE schema_name = ?",
        )
        .bind(&name)
        .fetch_one(admin)
        .await
        .unwrap()
            == 1
    };
    assert!(exists(&mut admin).await);
    let started = std::time::Instant::now();
    drop(db);
    assert!(!exists(&mut admin).await, "{name} is still there");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the drop waited {:?}",
        started.elapsed()
    );
    drop(tx);
    pool.close().await;
    admin.close().await.unwrap();
}
