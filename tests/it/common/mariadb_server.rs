//! A MariaDB server of the test's own, for crash tests: the machine's server (see
//! [`mysql`](super::mysql)) is shared and stays up; this one the test can SIGKILL and
//! start again on the same data, so that InnoDB's crash recovery runs.
//!
//! [`MariaDbServer::start`] makes a data directory in a private temporary directory with
//! `mariadb-install-db` (root may log in from 127.0.0.1 with no password, as on the
//! machine's server), starts `mariadbd` on a free loopback port and waits until it
//! answers a query. Dropping the value kills the process and removes the directory; a
//! parent-death signal kills it too if the test process dies without unwinding. `.ci/run`
//! installs the binaries (package `mariadb-server`).

use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use sqlx::{Connection, MySqlConnection};
use tokio::time::Instant;

use super::redis_server::free_port;

/// How long a start or restart (crash recovery included) may take before the test fails.
const START_TIMEOUT: Duration = Duration::from_secs(60);

/// Settings every server gets before the test's own: the machine server's character set
/// (`/etc/mysql/my.cnf`; `--no-defaults` would leave latin1), no DNS lookups, and a small
/// buffer pool and redo log, which keep a start to well under a second. No binary log
/// (MariaDB's default) unless a test asks for `log_bin`.
const BASE_SETTINGS: &[(&str, &str)] = &[
    ("character_set_server", "utf8mb4"),
    ("collation_server", "utf8mb4_general_ci"),
    ("skip_name_resolve", "ON"),
    ("innodb_buffer_pool_size", "16M"),
    ("innodb_log_file_size", "16M"),
    ("innodb_buffer_pool_dump_at_shutdown", "OFF"),
    ("innodb_buffer_pool_load_at_startup", "OFF"),
];

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// A `mariadbd` process of the test's own; see the [module docs](self).
pub struct MariaDbServer {
    port: u16,
    dir: PathBuf,
    /// `--name=value` for the base settings and the test's, kept across restarts.
    settings: Vec<String>,
    child: Option<Child>,
}

impl MariaDbServer {
    /// Whether `mariadb-install-db` and `mariadbd` are installed.
    pub fn available() -> bool {
        binary("mariadb-install-db").is_some() && binary("mariadbd").is_some()
    }

    /// Makes a fresh data directory and starts a server on it with `settings` (server
    /// variables, e.g. `("innodb_flush_log_at_trx_commit", "0")`) after the base ones;
    /// returns once it answers a query. The settings apply to the data directory's
    /// creation too (so that `innodb_page_size` takes) and to every restart.
    pub async fn start(settings: &[(&str, &str)]) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-mariadb-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("tmp")).expect("create the server's directory");
        let mut server = MariaDbServer {
            port: 0,
            dir,
            settings: BASE_SETTINGS
                .iter()
                .chain(settings)
                .map(|(name, value)| format!("--{name}={value}"))
                .collect(),
            child: None,
        };
        server.install().await;
        for _attempt in 0..10 {
            // A port can be taken between our probe and the server's bind: then another.
            server.port = free_port();
            match server.spawn_and_wait().await {
                Started::Up => return server,
                Started::PortTaken => continue,
                Started::Failed(why) => panic!("mariadbd did not start: {why}"),
            }
        }
        panic!("mariadbd found no free port in 10 tries");
    }

    /// `mariadb-install-db`: the system tables, with root and no password.
    async fn install(&self) {
        let install_db = binary("mariadb-install-db")
            .expect("mariadb-install-db (package mariadb-server; .ci/run installs it)");
        let mut cmd = tokio::process::Command::new(install_db);
        cmd.arg("--no-defaults")
            .arg("--auth-root-authentication-method=normal")
            .arg("--skip-test-db")
            // The script's own option (the `skip_name_resolve` setting is the server's):
            // no `resolveip` of the host name, which waits on DNS where it is slow.
            .arg("--skip-name-resolve")
            .arg(format!("--datadir={}", self.data().display()))
            .arg(format!("--tmpdir={}", self.tmp().display()))
            .args(user_arg())
            .args(&self.settings)
            .stdin(Stdio::null())
            // A test given up on mid-install takes the bootstrap server with it.
            .kill_on_drop(true);
        let out = cmd.output().await.expect("run mariadb-install-db");
        assert!(
            out.status.success(),
            "mariadb-install-db failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// `mysql://root@127.0.0.1:<port>/mysql`.
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/mysql", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The temporary directory: the data directory, the socket and the error log.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Everything the server has logged, over every start.
    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// Kills the server (SIGKILL: a crash, as a lost machine) and waits until it has
    /// exited. Nothing is flushed: what survives is what InnoDB had written to its redo
    /// log (`innodb_flush_log_at_trx_commit` decides when).
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server if it runs and starts it again on the same port and data; returns
    /// once it answers a query, that is once InnoDB's crash recovery is done.
    pub async fn restart(&mut self) {
        self.kill9();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            match self.spawn_and_wait().await {
                Started::Up => return,
                // Another process took the port meanwhile; it may let go of it.
                Started::PortTaken if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Started::PortTaken => panic!("port {} stays taken", self.port),
                Started::Failed(why) => panic!("mariadbd did not restart: {why}"),
            }
        }
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    /// The server's own temporary directory: bootstrap servers sharing `/tmp` name
    /// their temporary tables alike, and two installs at once then fail ("Unknown table
    /// 'mysql.tmp_user_sys'"; seen with six at once, and in the crash tests beside the
    /// nemesis).
    fn tmp(&self) -> PathBuf {
        self.dir.join("tmp")
    }

    fn log_path(&self) -> PathBuf {
        self.dir.join("error.log")
    }

    /// Spawns `mariadbd` on `self.port` and waits until it answers `SELECT 1`, it exits,
    /// or [`START_TIMEOUT`] has passed (then it is killed).
    async fn spawn_and_wait(&mut self) -> Started {
        let mariadbd = binary("mariadbd").expect("mariadbd (package mariadb-server)");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .expect("the server's log file");
        let logged_before = log.metadata().map_or(0, |m| m.len() as usize);
        let mut cmd = Command::new(mariadbd);
        cmd.arg("--no-defaults")
            .arg(format!("--datadir={}", self.data().display()))
            .arg(format!("--tmpdir={}", self.tmp().display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", self.dir.join("sock").display()))
            .arg(format!(
                "--pid-file={}",
                self.dir.join("mariadbd.pid").display()
            ))
            .args(user_arg())
            .args(&self.settings)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log);
        // SAFETY: prctl(2) only, between fork and exec: if this test process dies without
        // unwinding, the server gets SIGKILL (the thread that spawned it lives as long as
        // the test's runtime).
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(cmd.spawn().expect("spawn mariadbd"));
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                self.child = None;
                let log = self.error_log();
                let this_run = log.get(logged_before..).unwrap_or(&log);
                if this_run.contains("Address already in use") {
                    return Started::PortTaken;
                }
                return Started::Failed(format!("exited ({status}); it logged:\n{this_run}"));
            }
            if answers(&self.url()).await {
                return Started::Up;
            }
            if Instant::now() >= deadline {
                self.kill9();
                let log = self.error_log();
                let this_run = log.get(logged_before..).unwrap_or(&log);
                return Started::Failed(format!(
                    "no answer within {START_TIMEOUT:?}; it logged:\n{this_run}"
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for MariaDbServer {
    fn drop(&mut self) {
        self.kill9();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// How a spawn ended.
enum Started {
    Up,
    /// It could not bind its port.
    PortTaken,
    Failed(String),
}

/// Whether a server at `url` logs root in and answers `SELECT 1` (the port alone opens
/// before the server accepts logins).
async fn answers(url: &str) -> bool {
    let ask = async {
        let mut conn = MySqlConnection::connect(url).await.ok()?;
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut conn)
            .await
            .ok()?;
        let _ = conn.close().await;
        Some(one == 1)
    };
    tokio::time::timeout(Duration::from_secs(1), ask)
        .await
        .ok()
        .flatten()
        .unwrap_or(false)
}

/// `--user=root` when running as root: `mariadbd` refuses to run as root unless told to.
fn user_arg() -> Option<&'static str> {
    // SAFETY: geteuid(2) has no preconditions and touches no memory.
    (unsafe { libc::geteuid() } == 0).then_some("--user=root")
}

/// `name` on `PATH` or in the sbin directories (`mariadbd` is in `/usr/sbin`, which is not
/// on every user's `PATH`).
fn binary(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/usr/local/sbin", "/usr/bin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| candidate.is_file())
}
