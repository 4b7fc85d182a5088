//! The MariaDB server harness itself (`common::mariadb_server`): what the crash tests
//! rely on. A committed row survives SIGKILL and restart, the test's settings survive the
//! restart, and dropping the server leaves neither process nor directory.

use std::time::Duration;

use sqlx::{Connection, MySqlConnection};

use crate::common::mariadb_server::MariaDbServer;

async fn connect(server: &MariaDbServer) -> MySqlConnection {
    MySqlConnection::connect(&server.url()).await.unwrap()
}

#[tokio::test]
async fn a_committed_row_survives_kill9_and_restart() {
    let mut server = MariaDbServer::start(&[("innodb_lock_wait_timeout", "7")]).await;
    let mut conn = connect(&server).await;
    sqlx::query("CREATE DATABASE crash")
        .execute(&mut conn)
        .await
        .unwrap();
    sqlx::query("CREATE TABLE crash.t (id INT PRIMARY KEY, v TEXT) ENGINE = InnoDB")
        .execute(&mut conn)
        .await
        .unwrap();
    let mut tx = conn.begin().await.unwrap();
    sqlx::query("INSERT INTO crash.t VALUES (1, 'kept')")
        .execute(&mut *tx)
        .await
        .unwrap();
    tx.commit().await.unwrap();
    let first = server.pid().unwrap();

    server.kill9();
    assert_eq!(server.pid(), None);
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", server.port())).is_err(),
        "the killed server still listens"
    );
    drop(conn);
    let port = server.port();
    server.restart().await;

    assert_eq!(server.port(), port);
    assert_ne!(server.pid(), Some(first));
    let mut conn = connect(&server).await;
    let v: String = sqlx::query_scalar("SELECT v FROM crash.t WHERE id = 1")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(v, "kept");
    let timeout: u64 = sqlx::query_scalar("SELECT @@innodb_lock_wait_timeout")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(timeout, 7, "the test's setting is kept across the restart");
    conn.close().await.unwrap();
}

#[tokio::test]
async fn dropping_the_server_leaves_no_process_and_no_directory() {
    let server = MariaDbServer::start(&[]).await;
    let pid = server.pid().unwrap();
    let port = server.port();
    let dir = server.dir().to_owned();
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    assert!(proc_dir.exists());

    drop(server);

    // Gone, or the pid already reused by a process that is not ours.
    let cmdline = std::fs::read(proc_dir.join("cmdline")).unwrap_or_default();
    assert!(
        !String::from_utf8_lossy(&cmdline).contains("mariadbd"),
        "mariadbd {pid} outlived its drop"
    );
    assert!(!dir.exists(), "{} is still there", dir.display());
    let refused = tokio::time::timeout(
        Duration::from_secs(1),
        tokio::net::TcpStream::connect(("127.0.0.1", port)),
    )
    .await;
    assert!(
        !matches!(refused, Ok(Ok(_))),
        "something still listens on {port}"
    );
}
