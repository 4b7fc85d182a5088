//! A MySQL/MariaDB database of its own for each test, on the server `.ci/run` makes sure
//! is running (`TOWER_LOCK_MYSQL_URL`, default `mysql://root@127.0.0.1:3306/mysql`: the
//! machine's MariaDB with root and no password). Created by [`MyDatabase::create`],
//! dropped (its sessions killed first) when the value is dropped, also when the test
//! fails.
//!
//! The database has the server's default character set and collation (`utf8mb4` and
//! the case-insensitive `utf8mb4_general_ci` on the machine's server and on a
//! [`MariaDbServer`](super::mariadb_server::MariaDbServer)): what a user's database has
//! unless the backend's own tables say otherwise.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::Connection;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlPoolOptions};

/// The server's URL for creating and dropping databases.
pub fn admin_url() -> String {
    std::env::var("TOWER_LOCK_MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/mysql".to_owned())
}

/// `base` with its database replaced by `db` (added when `base` names none).
pub fn with_database(base: &str, db: &str) -> String {
    let url = UrlParts::of(base);
    format!("{}{}/{db}{}", url.login, url.host, url.query)
}

/// `base` pointed at `127.0.0.1:<port>` (a proxy in front of the server), the rest kept.
pub fn with_local_port(base: &str, port: u16) -> String {
    let url = UrlParts::of(base);
    format!("{}127.0.0.1:{port}{}{}", url.login, url.path, url.query)
}

/// A URL cut in four: `scheme://user:password@`, `host:port`, `/path`, `?query`. Only
/// the host is never empty. (Reserved characters in the password are percent-encoded,
/// as in any URL, so the first `/` after the scheme starts the path.)
struct UrlParts<'a> {
    login: &'a str,
    host: &'a str,
    path: &'a str,
    query: &'a str,
}

impl<'a> UrlParts<'a> {
    fn of(url: &'a str) -> Self {
        let (rest, query) = url.split_at(url.find('?').unwrap_or(url.len()));
        let authority_start = rest.find("://").map_or(0, |i| i + "://".len());
        let path_start = rest[authority_start..]
            .find('/')
            .map_or(rest.len(), |i| authority_start + i);
        let (authority, path) = rest.split_at(path_start);
        let host_start = authority.rfind('@').map_or(authority_start, |i| i + 1);
        let (login, host) = authority.split_at(host_start);
        UrlParts {
            login,
            host,
            path,
            query,
        }
    }
}

/// A database of the test's own; see the [module docs](self).
pub struct MyDatabase {
    name: String,
    url: String,
}

impl MyDatabase {
    /// Creates a database with a name no other test (of this or another process) has.
    pub async fn create() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "tower_lock_test_{}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            fastrand::u32(..)
        );
        let mut admin = MySqlConnection::connect(&admin_url())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "MySQL/MariaDB at {}: {e} (is it running? .ci/run starts one)",
                    admin_url()
                )
            });
        sqlx::query(&format!("CREATE DATABASE `{name}`"))
            .execute(&mut admin)
            .await
            .unwrap();
        let _ = admin.close().await;
        let url = with_database(&admin_url(), &name);
        MyDatabase { name, url }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The URL of this database.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The URL of this database through a proxy on `port` in front of the server.
    pub fn url_through(&self, port: u16) -> String {
        with_local_port(&self.url, port)
    }

    /// A pool of up to `max` connections on this database. Connections are not pinged
    /// before they are handed out (a test sees a dead one fail, as the backend would
    /// with its own settings); waiting for one gives up after 5 s.
    pub async fn pool(&self, max: u32) -> MySqlPool {
        MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(5))
            .test_before_acquire(false)
            .connect(&self.url)
            .await
            .unwrap()
    }
}

impl Drop for MyDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        let failed = std::thread::panicking();
        // Dropped inside a runtime: drop the database from a thread with its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(drop_database(&name, failed))
                .map_err(|e| e.to_string())
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("could not drop test database {}: {e}", self.name),
            Err(_) => eprintln!("dropping test database {} panicked", self.name),
        }
    }
}

/// Drops database `name`, first printing its sessions if the test `failed`.
///
/// `DROP DATABASE` waits for the metadata locks of every transaction that touched its
/// tables, so the sessions on it (a pool the test still holds, a transaction left open)
/// are killed first, as PostgreSQL's `DROP DATABASE ... WITH (FORCE)` does. A session on
/// another database that touched these tables is not found that way: the drop then
/// gives up after `lock_wait_timeout`, not the server's default day.
async fn drop_database(name: &str, failed: bool) -> Result<(), sqlx::Error> {
    let mut admin = MySqlConnection::connect(&admin_url()).await?;
    if failed {
        match sessions_of(&mut admin, name).await {
            Ok(sessions) => {
                for session in sessions {
                    eprintln!("{name}: {session}");
                }
            }
            Err(e) => eprintln!("{name}: sessions unknown: {e}"),
        }
    }
    let kills: Vec<String> = sqlx::query_scalar(
        "SELECT CONCAT('KILL CONNECTION ', id) FROM information_schema.processlist \
          WHERE db = ? AND id <> CONNECTION_ID()",
    )
    .bind(name)
    .fetch_all(&mut admin)
    .await?;
    for kill in kills {
        // The session may have ended meanwhile (unknown thread id): that is the goal.
        let _ = sqlx::query(&kill).execute(&mut admin).await;
    }
    sqlx::query("SET SESSION lock_wait_timeout = 10")
        .execute(&mut admin)
        .await?;
    sqlx::query(&format!("DROP DATABASE IF EXISTS `{name}`"))
        .execute(&mut admin)
        .await?;
    admin.close().await
}

/// What the sessions on database `name` are doing, one line each: command, seconds in
/// it, state, their InnoDB transaction's state and start, and the statement. Printed for
/// a failed test before its database is dropped, so that a stall (a session holding a
/// lock the others wait for) can be traced.
async fn sessions_of(admin: &mut MySqlConnection, name: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT CONCAT_WS(' ', 'id', p.id, p.command, 'time', p.time, \
                'state', IFNULL(p.state, '-'), 'trx', IFNULL(t.trx_state, '-'), \
                'since', IFNULL(t.trx_started, '-'), \
                CONCAT(': ', LEFT(REGEXP_REPLACE(IFNULL(p.info, ''), '\\\\s+', ' '), 160))) \
           FROM information_schema.processlist p \
           LEFT JOIN information_schema.innodb_trx t ON t.trx_mysql_thread_id = p.id \
          WHERE p.db = ? ORDER BY p.id",
    )
    .bind(name)
    .fetch_all(admin)
    .await
}
