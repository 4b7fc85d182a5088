//! A PostgreSQL database of its own for each test, on the server `.ci/run` makes sure is
//! running (`TOWER_LOCK_PG_URL`, default `postgres://root@127.0.0.1:5432/postgres`: the
//! machine's server with trust auth). Created by [`PgDatabase::create`], dropped (with
//! every connection to it) when the value is dropped, also when the test fails.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};
use tower_lock::PostgresBackend;
use tower_lock::backend::{Acquire, LockBackend, LockRequest};

/// The server's maintenance database URL.
pub fn admin_url() -> String {
    std::env::var("TOWER_LOCK_PG_URL")
        .unwrap_or_else(|_| "postgres://root@127.0.0.1:5432/postgres".to_owned())
}

/// `base` with its database replaced by `db`.
pub fn with_database(base: &str, db: &str) -> String {
    let (head, tail) = match base.split_once('?') {
        Some((head, query)) => (head, format!("?{query}")),
        None => (base, String::new()),
    };
    let head = match head.rfind('/') {
        Some(slash) if slash > "postgres://".len() => &head[..slash],
        _ => head,
    };
    format!("{head}/{db}{tail}")
}

/// `req` taken by `backend`: the name lets it in.
pub async fn take(backend: &PostgresBackend, req: &LockRequest) {
    let taken = backend.acquire(req).await.unwrap();
    assert!(matches!(taken, Acquire::Acquired(_)), "{taken:?}");
}

/// How many sessions of `pool`'s database wait for a lock (a row's, in these tests).
pub async fn waiting_for_a_lock(pool: &PgPool) -> i64 {
    sqlx::query_scalar::<_, i64>(
        "SELECT count(*) FROM pg_stat_activity \
          WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}

/// Waits (up to 5 s) until a waiter's busy attempt has marked `name` wanted in the
/// default table (a release of it then notifies).
pub async fn wait_until_wanted(pool: &PgPool, name: &str) {
    super::wait_until(
        Duration::from_secs(5),
        "the waiter marked the name",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT coalesce(bool_or(wanted_until > clock_timestamp()), false) \
               FROM tower_lock_names WHERE name = $1",
            )
            .bind(name)
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
}

/// A lock cycle (take a lock, release it) on a fresh name under `prefix` at each call,
/// through a backend on `pool` with `response` as its response timeout and `kept`
/// connections kept.
pub async fn lock_cycles(
    pool: &PgPool,
    response: Duration,
    kept: usize,
    prefix: &str,
) -> impl AsyncFnMut() -> tower_lock::Result<()> {
    let backend = PostgresBackend::builder(pool.clone())
        .response_timeout(response)
        .kept_connections(kept)
        .build()
        .await
        .unwrap();
    let client = tower_lock::LockClient::new(backend);
    let prefix = prefix.to_owned();
    let mut name = 0;
    async move || {
        name += 1;
        let lock = client.get_lock(format!("{prefix}:{name}")).unwrap();
        lock.try_lock().await?.unlock().await
    }
}

/// Opens every connection `pool` may have (`max`) and waits until they are idle, but
/// for one a backend may keep.
pub async fn every_connection_idle(pool: &PgPool, max: u32) {
    let all = futures_util::future::join_all(
        (0..max).map(|_| tokio::time::timeout(Duration::from_millis(500), pool.acquire())),
    )
    .await;
    drop(all);
    super::wait_until(Duration::from_secs(5), "every connection idle", || async {
        pool.size() == max && pool.num_idle() >= max as usize - 1
    })
    .await;
}

/// Runs `cycle` until it succeeds three times in a row, within `within`; how many times
/// it failed (each an outage) before.
pub async fn failed_before_three_in_a_row(
    within: Duration,
    mut cycle: impl AsyncFnMut() -> tower_lock::Result<()>,
) -> usize {
    let started = tokio::time::Instant::now();
    let (mut failed, mut in_a_row) = (0, 0);
    while in_a_row < 3 {
        assert!(
            started.elapsed() < within,
            "locks still fail {:?} on, {failed} failed calls",
            started.elapsed()
        );
        match cycle().await {
            Ok(()) => in_a_row += 1,
            Err(error) => {
                assert!(error.is_unavailable(), "{error:?}");
                failed += 1;
                in_a_row = 0;
            }
        }
    }
    failed
}

pub struct PgDatabase {
    pub name: String,
    pub url: String,
}

impl PgDatabase {
    pub async fn create() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let name = format!(
            "tower_lock_test_{}_{}_{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            fastrand::u32(..)
        );
        let admin = PgPoolOptions::new()
            .max_connections(1)
            .connect(&admin_url())
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "PostgreSQL at {}: {e} (is it running? .ci/run starts one)",
                    admin_url()
                )
            });
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&admin)
            .await
            .unwrap();
        admin.close().await;
        let url = with_database(&admin_url(), &name);
        PgDatabase { name, url }
    }

    /// The URL of this database through a proxy on `port` in front of the server.
    pub fn url_through(&self, port: u16) -> String {
        self.url
            .replace("127.0.0.1:5432", &format!("127.0.0.1:{port}"))
    }

    /// A pool on this database.
    pub async fn pool(&self, max: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(5))
            .connect(&self.url)
            .await
            .unwrap()
    }
}

/// What the sessions of database `name` are doing, one line each: state, what they wait
/// for and which sessions block them, how long their transaction and statement have
/// run, and the statement. Printed for a failed test before its database is dropped, so
/// that a stall (a session holding a lock the others wait for) can be traced.
async fn sessions_of(admin: &PgPool, name: &str) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar(
        "SELECT format('pid %s %s wait %s/%s blocked by %s xact %s stmt %s: %s', \
                pid, state, wait_event_type, wait_event, pg_blocking_pids(pid), \
                clock_timestamp() - xact_start, clock_timestamp() - query_start, \
                left(regexp_replace(query, '\\s+', ' ', 'g'), 160)) \
           FROM pg_stat_activity WHERE datname = $1 ORDER BY pid",
    )
    .bind(name)
    .fetch_all(admin)
    .await
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        let name = self.name.clone();
        let failed = std::thread::panicking();
        // Dropped inside a runtime: drop the database from a thread with its own.
        let dropped = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| e.to_string())?;
            rt.block_on(async {
                let admin = PgPoolOptions::new()
                    .max_connections(1)
                    .connect(&admin_url())
                    .await
                    .map_err(|e| e.to_string())?;
                if failed {
                    match sessions_of(&admin, &name).await {
                        Ok(sessions) => {
                            for session in sessions {
                                eprintln!("{name}: {session}");
                            }
                        }
                        Err(e) => eprintln!("{name}: sessions unknown: {e}"),
                    }
                }
                sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&admin)
                    .await
                    .map_err(|e| e.to_string())?;
                admin.close().await;
                Ok::<(), String>(())
            })
        })
        .join();
        match dropped {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("could not drop test database {}: {e}", self.name),
            Err(_) => eprintln!("dropping test database {} panicked", self.name),
        }
    }
}

/// A PostgreSQL server of the test's own, in a temporary directory on a free port, that
/// the test can kill and start again (the machine's server is shared and stays up). Run
/// as the `postgres` user when the tests run as root (the server refuses root). Killed
/// and its directory removed on drop.
pub struct PgServer {
    pub port: u16,
    dir: std::path::PathBuf,
    bin: std::path::PathBuf,
    child: Option<std::process::Child>,
    /// Environment variables the server starts with (a clock shim).
    env: Vec<(String, String)>,
}

impl PgServer {
    /// Whether the PostgreSQL server binaries are installed (`.ci/run` installs them).
    pub fn available() -> bool {
        Self::bin().is_some()
    }

    fn bin() -> Option<std::path::PathBuf> {
        std::fs::read_dir("/usr/lib/postgresql")
            .ok()?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|p| p.join("initdb").exists())
            .max()
    }

    /// Initializes and starts a server; `None` when the PostgreSQL server binaries are not
    /// installed (`.ci/run` installs them).
    pub fn start() -> Option<Self> {
        Self::start_with_env(Vec::new())
    }

    /// The same, with environment variables for the server (e.g. a
    /// [`ClockShift`](super::clock::ClockShift)'s), kept across restarts.
    pub fn start_with_env(env: Vec<(String, String)>) -> Option<Self> {
        let mut server = Self::new()?;
        server.env = env;
        let status = server
            .command("initdb")
            .args(["-A", "trust", "-U", "root", "--no-sync", "-E", "UTF8", "-D"])
            .arg(server.data())
            .stdout(std::process::Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "initdb failed");
        server.run();
        Some(server)
    }

    /// A server not yet initialized: its directory (owned by the `postgres` user when
    /// the tests run as root) and a free port.
    fn new() -> Option<Self> {
        let bin = Self::bin()?;
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-pg-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let server = PgServer {
            port,
            dir,
            bin,
            child: None,
            env: Vec::new(),
        };
        if let Some((uid, gid)) = postgres_user() {
            std::os::unix::fs::chown(&server.dir, Some(uid), Some(gid)).unwrap();
        }
        Some(server)
    }

    /// A hot standby of `primary`, made with `pg_basebackup` and streaming from it
    /// (`-R`: `primary_conninfo` and `standby.signal`), started and accepting reads.
    pub fn standby_of(primary: &PgServer) -> Self {
        let mut server = Self::new().expect("the primary's binaries are installed");
        // The primary may still be starting up ("the database system is starting up")
        // when its port first answers: tried again until it takes the backup.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let _ = std::fs::remove_dir_all(server.data());
            let out = server
                .command("pg_basebackup")
                .args(["-h", "127.0.0.1", "-p", &primary.port.to_string()])
                .args(["-U", "root", "-R", "--no-sync", "-X", "stream", "-D"])
                .arg(server.data())
                .output()
                .unwrap();
            if out.status.success() {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "pg_basebackup failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        server.run();
        server
    }

    fn data(&self) -> std::path::PathBuf {
        self.dir.join("data")
    }

    fn command(&self, program: &str) -> std::process::Command {
        use std::os::unix::process::CommandExt;
        let mut cmd = std::process::Command::new(self.bin.join(program));
        // A process group of its own: killing the server kills its backends too, which
        // would otherwise keep the old shared memory and stop the restart.
        cmd.process_group(0);
        if let Some((uid, gid)) = postgres_user() {
            cmd.uid(uid).gid(gid);
        }
        cmd
    }

    fn run(&mut self) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        let mut child = self.spawn();
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            let log = || std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default();
            assert!(
                std::time::Instant::now() < deadline,
                "PostgreSQL did not start: {}",
                log()
            );
            // A backend of the killed server that was being forked as the kill went out
            // can outlive the process group's SIGKILL; it exits once it sees the
            // postmaster gone, and until then keeps the old shared memory, which stops
            // the new server. Start again once it has.
            if child.try_wait().ok().flatten().is_some()
                && log().contains("pre-existing shared memory block")
            {
                std::thread::sleep(Duration::from_millis(100));
                child = self.spawn();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        self.child = Some(child);
    }

    fn spawn(&self) -> std::process::Child {
        self.command("postgres")
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .arg("-D")
            .arg(self.data())
            .args(["-p", &self.port.to_string(), "-k"])
            .arg(&self.dir)
            .args(["-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(self.dir.join("server.log")).unwrap())
            .spawn()
            .unwrap()
    }

    /// `postgres://root@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        format!("postgres://root@127.0.0.1:{}/postgres", self.port)
    }

    /// Kills the server (SIGKILL: a crash, as a lost machine) and waits until it is gone.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let group = i32::try_from(child.id()).unwrap();
            // SAFETY: kill(2) on the server's own process group; no memory is involved.
            unsafe { libc::kill(-group, libc::SIGKILL) };
            let _ = child.wait();
            // Until every process of the group is gone (backends hold shared memory).
            let deadline = std::time::Instant::now() + Duration::from_secs(30);
            // SAFETY: signal 0 only checks that the group still exists.
            while unsafe { libc::kill(-group, 0) } == 0 {
                assert!(
                    std::time::Instant::now() < deadline,
                    "PostgreSQL's backends did not stop"
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        // Its children (backends) end when the postmaster is gone; wait for the port.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
            assert!(
                std::time::Instant::now() < deadline,
                "PostgreSQL did not stop"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = std::fs::remove_file(self.data().join("postmaster.pid"));
    }

    /// Starts it again on the same port, with the same data (crash recovery runs).
    pub fn restart(&mut self) {
        self.kill();
        self.run();
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The `postgres` user's uid and gid when running as root.
fn postgres_user() -> Option<(u32, u32)> {
    // SAFETY-free: read the ids from /etc/passwd rather than calling libc.
    if std::fs::metadata("/proc/self").ok().map(|m| {
        use std::os::unix::fs::MetadataExt;
        m.uid()
    }) != Some(0)
    {
        return None;
    }
    let passwd = std::fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let fields: Vec<&str> = line.split(':').collect();
        (fields.first() == Some(&"postgres"))
            .then(|| Some((fields.get(2)?.parse().ok()?, fields.get(3)?.parse().ok()?)))
            .flatten()
    })
}
