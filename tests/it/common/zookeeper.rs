//! ZooKeeper servers of the test's own: a standalone server ([`ZkServer`]) or an
//! ensemble ([`ZkEnsemble`], three nodes for a quorum that outlives one), each node on
//! free loopback ports, gone when the test ends.
//!
//! The servers are the machine's ZooKeeper jars (`/usr/share/java`, Debian's
//! `zookeeper` package; `.ci/run` installs it) run directly with `java ...
//! QuorumPeerMain <cfg>`, never the system service. Each server has a directory of its
//! own under Cargo's test scratch directory (`CARGO_TARGET_TMPDIR`) holding its config,
//! its data directory, the JVM's temporary directory and its logs (`zookeeper.log`, and
//! `jvm.out` for what the JVM itself prints); nothing goes to the test's output. A start
//! returns once the server answers the `srvr` four-letter command as serving (standalone,
//! or leader/follower in an ensemble), within [`START_TIMEOUT`]. Dropping the value kills
//! the process and removes the directory; a parent-death signal kills it too if the test
//! process dies without unwinding.
//!
//! The settings suit tests: a 200 ms tick, session timeouts from 400 ms to 60 s
//! accepted, every four-letter command allowed, no admin server, no fsync (a SIGKILLed
//! server loses nothing: its writes are in the page cache), and a small, quick JVM.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use super::redis_server::signal;

/// How long a start, a restart or an election may take before the test fails: the JVM
/// starts slowly on a loaded two-core machine.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);

/// The tick, ZooKeeper's unit of time: sessions, syncs and elections are counted in it.
pub const TICK: Duration = Duration::from_millis(200);

/// Where Debian's ZooKeeper, Curator, netty and slf4j jars are.
pub const JARS: &str = "/usr/share/java";

/// A small, quick JVM: a test server holds a few nodes, and a second of JIT warm-up
/// matters more than peak speed.
pub const JVM_FLAGS: &[&str] = &[
    "-Xms16m",
    "-Xmx256m",
    "-Xss512k",
    "-XX:+UseSerialGC",
    "-XX:TieredStopAtLevel=1",
    // No /tmp/hsperfdata_<user>/<pid> file, which a SIGKILLed JVM leaves behind.
    "-XX:-UsePerfData",
    "-Djava.net.preferIPv4Stack=true",
];

/// The server's jars: ZooKeeper (its manifest names netty, jute, slf4j-api and the rest)
/// and log4j behind slf4j, so that the log goes to the server's own file.
const SERVER_JARS: &[&str] = &[
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "slf4j-api.jar",
    "slf4j-log4j12.jar",
    "log4j-1.2.jar",
];

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// A fresh directory for one server or ensemble, under Cargo's test scratch directory.
fn fresh_dir(what: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!(
        "tower-lock-{what}-{}-{}",
        std::process::id(),
        NEXT_DIR.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the server's directory");
    dir
}

/// Freezes process `pid` (SIGSTOP): its sockets stay open, nothing is answered, its
/// timers stop. For a client (a session that outlives its timeout) or a server.
pub fn pause_process(pid: u32) {
    signal(pid, "-STOP");
}

/// Thaws a process frozen with [`pause_process`] (SIGCONT).
pub fn resume_process(pid: u32) {
    signal(pid, "-CONT");
}

/// Sends the four-letter command `cmd` (`ruok`, `srvr`, `dump`, `wchs`, ...) to the
/// server on `port`; its answer, or `None` if it does not answer within a second
/// (down, frozen or still starting).
pub async fn four_letter(port: u16, cmd: &str) -> Option<String> {
    let ask = async {
        let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()?;
        conn.write_all(cmd.as_bytes()).await.ok()?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.ok()?;
        Some(answer)
    };
    tokio::time::timeout(Duration::from_secs(1), ask)
        .await
        .ok()
        .flatten()
}

/// The `Mode:` of a `srvr` answer (`standalone`, `leader`, `follower`); `None` when the
/// server is not serving (no quorum, electing, starting).
fn mode_of(srvr: &str) -> Option<String> {
    srvr.lines()
        .find_map(|l| l.strip_prefix("Mode: "))
        .map(|m| m.trim().to_owned())
}

/// A ZooKeeper server process of the test's own; see the [module docs](self). A node of
/// a [`ZkEnsemble`] is one too.
pub struct ZkServer {
    dir: PathBuf,
    port: u16,
    /// `server.N=...` lines and this node's id in an ensemble; empty for standalone.
    quorum: Vec<String>,
    myid: Option<usize>,
    /// `key=value` lines after the base settings (the test's own), kept across restarts.
    settings: Vec<String>,
    child: Option<Child>,
    /// How long `zookeeper.log` and `jvm.out` were when the last spawn began: what a
    /// failed start logged is after it.
    log_mark: (usize, usize),
}

/// How a spawn ended.
enum Started {
    Up,
    /// It could not bind one of its ports.
    PortTaken,
    Failed(String),
}

impl ZkServer {
    /// Whether java and the ZooKeeper jars are installed.
    pub fn available() -> bool {
        Path::new(JARS).join("zookeeper.jar").is_file()
            && Command::new("java")
                .arg("-version")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
    }

    /// A fresh standalone server on a free loopback port; returns once it serves.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A fresh standalone server with extra `zoo.cfg` settings after the base ones
    /// (e.g. `("maxSessionTimeout", "120000")`), kept across restarts.
    pub async fn start_with(settings: &[(&str, &str)]) -> Self {
        let mut server = ZkServer::new(fresh_dir("zk"), Vec::new(), None, settings);
        for _attempt in 0..10 {
            // A port can be taken between our probe and the server's bind: then another.
            server.port = super::redis_server::free_port();
            server.spawn();
            match server.wait_serving(Instant::now() + START_TIMEOUT).await {
                Started::Up => return server,
                Started::PortTaken => continue,
                Started::Failed(why) => panic!("ZooKeeper did not start: {why}"),
            }
        }
        panic!("ZooKeeper found no free port in 10 tries");
    }

    fn new(
        dir: PathBuf,
        quorum: Vec<String>,
        myid: Option<usize>,
        settings: &[(&str, &str)],
    ) -> Self {
        std::fs::create_dir_all(dir.join("data")).expect("the data directory");
        std::fs::create_dir_all(dir.join("tmp")).expect("the JVM's temporary directory");
        ZkServer {
            dir,
            port: 0,
            quorum,
            myid,
            settings: settings.iter().map(|(k, v)| format!("{k}={v}")).collect(),
            child: None,
            log_mark: (0, 0),
        }
    }

    /// `127.0.0.1:<port>`, what a client connects to.
    pub fn connect_string(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server process's id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// The server's directory: `zoo.cfg`, `data/`, `tmp/`, `zookeeper.log`, `jvm.out`.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Everything the server has logged, over every start (log4j's file, then what the
    /// JVM printed).
    pub fn log(&self) -> String {
        self.log_since((0, 0))
    }

    /// What the server logged after `mark` (lengths of `zookeeper.log` and `jvm.out`).
    fn log_since(&self, mark: (usize, usize)) -> String {
        let read = |name: &str, from: usize| {
            let all = std::fs::read_to_string(self.dir.join(name)).unwrap_or_default();
            all.get(from..).unwrap_or(&all).to_owned()
        };
        format!(
            "{}{}",
            read("zookeeper.log", mark.0),
            read("jvm.out", mark.1)
        )
    }

    fn log_lengths(&self) -> (usize, usize) {
        let len =
            |name: &str| std::fs::metadata(self.dir.join(name)).map_or(0, |m| m.len() as usize);
        (len("zookeeper.log"), len("jvm.out"))
    }

    /// The four-letter command `cmd`'s answer (see [`four_letter`]).
    pub async fn four_letter(&self, cmd: &str) -> Option<String> {
        four_letter(self.port, cmd).await
    }

    /// `standalone`, `leader` or `follower` while the server serves, else `None`.
    pub async fn mode(&self) -> Option<String> {
        mode_of(&self.four_letter("srvr").await?)
    }

    /// The number of watches set on the server (`wchs`).
    pub async fn watch_count(&self) -> u64 {
        let wchs = self.four_letter("wchs").await.unwrap_or_default();
        wchs.lines()
            .find_map(|l| l.strip_prefix("Total watches:"))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no watch count in `wchs`: {wchs:?}"))
    }

    /// The paths with a watch set on them (`wchp`), sorted: a client waiting on a lock
    /// watches a node under the lock's path.
    pub async fn watched_paths(&self) -> Vec<String> {
        let wchp = self.four_letter("wchp").await.unwrap_or_default();
        let mut paths: Vec<String> = wchp
            .lines()
            .filter(|l| l.starts_with('/'))
            .map(str::to_owned)
            .collect();
        paths.sort();
        paths
    }

    /// The sessions that have a watch set on `path` (`wchp`, whose answer lists each
    /// watched path followed by its sessions' ids, one a line). Tells one client's watch
    /// from another's: a tower-lock backend's session is
    /// `ZooKeeperBackend::session_id`. Like every four-letter watch report, it sees data
    /// and exists watches only: a children watch (a semaphore waiter's on `leases`) is
    /// in no report.
    pub async fn watchers(&self, path: &str) -> Vec<i64> {
        let wchp = self.four_letter("wchp").await.unwrap_or_default();
        let mut sessions = Vec::new();
        let mut in_path = false;
        for line in wchp.lines() {
            if line.starts_with('/') {
                in_path = line == path;
            } else if in_path && let Some(hex) = line.trim().strip_prefix("0x") {
                let id = u64::from_str_radix(hex, 16)
                    .unwrap_or_else(|_| panic!("a session id in `wchp`: {line:?}"));
                sessions.push(id.cast_signed());
            }
        }
        sessions
    }

    /// The paths of every ephemeral node, sorted (`dump`, on a standalone server or a
    /// leader).
    pub async fn ephemerals(&self) -> Vec<String> {
        let dump = self.four_letter("dump").await.unwrap_or_default();
        let after = dump
            .split_once("Sessions with Ephemerals")
            .map(|(_, rest)| rest)
            .unwrap_or_else(|| panic!("no ephemerals in `dump`: {dump:?}"));
        let section = after
            .split_once("Connections with Ephemerals")
            .map_or(after, |(section, _)| section);
        let mut paths: Vec<String> = section
            .lines()
            .map(str::trim)
            .filter(|l| l.starts_with('/'))
            .map(str::to_owned)
            .collect();
        paths.sort();
        paths
    }

    /// Kills the server (SIGKILL: a crash) and waits until it has exited.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server if it runs and starts it again on the same port and data;
    /// returns once it serves. Sessions are kept in the data, so a session whose client
    /// reconnects within its timeout keeps its ephemeral nodes.
    pub async fn start_again(&mut self) {
        self.stop();
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            self.spawn();
            match self.wait_serving(deadline).await {
                Started::Up => return,
                // Another process took the port meanwhile; it may let go of it.
                Started::PortTaken if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Started::PortTaken => panic!("port {} stays taken", self.port),
                Started::Failed(why) => panic!("ZooKeeper did not start again: {why}"),
            }
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        pause_process(self.pid().expect("the server runs"));
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        resume_process(self.pid().expect("the server runs"));
    }

    /// `zoo.cfg`: the base settings, the quorum's, then the test's. In ticks: followers
    /// have 10 s (`initLimit`) to connect and sync to a new leader, JVM start included;
    /// one that hears nothing from its leader for 3 s (`syncLimit`) leaves it, so a
    /// frozen leader is replaced after that and an election. Sessions may ask for 2 ticks
    /// (ZooKeeper's least) to 60 s.
    fn config(&self) -> String {
        let data = self.dir.join("data");
        let mut cfg = format!(
            "tickTime={tick}\n\
             initLimit=50\n\
             syncLimit=15\n\
             dataDir={data}\n\
             clientPort={port}\n\
             clientPortAddress=127.0.0.1\n\
             4lw.commands.whitelist=*\n\
             admin.enableServer=false\n\
             minSessionTimeout={min}\n\
             maxSessionTimeout=60000\n\
             forceSync=no\n\
             maxClientCnxns=0\n",
            tick = TICK.as_millis(),
            data = data.display(),
            port = self.port,
            min = 2 * TICK.as_millis(),
        );
        for line in self.quorum.iter().chain(&self.settings) {
            let _ = writeln!(cfg, "{line}");
        }
        cfg
    }

    /// Writes the config and log4j's and spawns the JVM; does not wait.
    fn spawn(&mut self) {
        let cfg = self.dir.join("zoo.cfg");
        std::fs::write(&cfg, self.config()).expect("write zoo.cfg");
        if let Some(id) = self.myid {
            std::fs::write(self.dir.join("data/myid"), format!("{id}\n")).expect("write myid");
        }
        let log4j = self.dir.join("log4j.properties");
        std::fs::write(
            &log4j,
            format!(
                "log4j.rootLogger=INFO, FILE\n\
                 log4j.appender.FILE=org.apache.log4j.FileAppender\n\
                 log4j.appender.FILE.File={}\n\
                 log4j.appender.FILE.layout=org.apache.log4j.PatternLayout\n\
                 log4j.appender.FILE.layout.ConversionPattern=%d{{ISO8601}} %-5p [%t:%C{{1}}@%L] - %m%n\n",
                self.dir.join("zookeeper.log").display()
            ),
        )
        .expect("write log4j.properties");
        let out = OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("jvm.out"))
            .expect("the JVM's output file");
        self.log_mark = self.log_lengths();
        let classpath: Vec<String> = SERVER_JARS.iter().map(|j| format!("{JARS}/{j}")).collect();
        let mut cmd = Command::new("java");
        cmd.args(JVM_FLAGS)
            .arg(format!(
                "-Djava.io.tmpdir={}",
                self.dir.join("tmp").display()
            ))
            .arg(format!("-Dlog4j.configuration=file:{}", log4j.display()))
            .arg("-Dzookeeper.jmx.log4j.disable=true")
            // Empty container nodes (the lock directories) are reaped within a second
            // rather than a minute, so a test can see the store shrink back.
            .arg("-Dznode.container.checkIntervalMs=500")
            .args(["-cp", &classpath.join(":")])
            .arg("org.apache.zookeeper.server.quorum.QuorumPeerMain")
            .arg(&cfg)
            // An hs_err file, should the JVM crash, lands here too.
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(out.try_clone().expect("the JVM's output file"))
            .stderr(out);
        // SAFETY: prctl(2) only, between fork and exec: if this test process dies without
        // unwinding, the server gets SIGKILL (the thread that spawned it lives as long as
        // the test's runtime).
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        self.child = Some(cmd.spawn().expect("java on PATH (.ci/run installs it)"));
    }

    /// Waits until the spawned server serves (`srvr` gives a mode), it exits, or
    /// `deadline` passes (then it is killed).
    async fn wait_serving(&mut self, deadline: Instant) -> Started {
        loop {
            let exited = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten());
            if let Some(status) = exited {
                self.child = None;
                let this_run = self.log_since(self.log_mark);
                if this_run.contains("Address already in use") {
                    return Started::PortTaken;
                }
                return Started::Failed(format!("exited ({status}); it logged:\n{this_run}"));
            }
            if self.mode().await.is_some() {
                return Started::Up;
            }
            if Instant::now() >= deadline {
                self.stop();
                let this_run = self.log_since(self.log_mark);
                return Started::Failed(format!(
                    "not serving on port {} within {START_TIMEOUT:?}; it logged:\n{this_run}",
                    self.port
                ));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for ZkServer {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A ZooKeeper ensemble of the test's own: `n` [`ZkServer`] nodes on loopback, each
/// with a client port, a quorum port and an election port of its own
/// (`server.N=127.0.0.1:<quorum>:<election>`, N from 1).
pub struct ZkEnsemble {
    dir: PathBuf,
    nodes: Vec<ZkServer>,
}

impl ZkEnsemble {
    /// `n` fresh nodes; returns once every node serves under one leader.
    pub async fn start(n: usize) -> Self {
        assert!(n >= 1, "an ensemble has nodes");
        let dir = fresh_dir("zk-ensemble");
        for _attempt in 0..5 {
            let mut ensemble = ZkEnsemble {
                dir: dir.clone(),
                nodes: Vec::new(),
            };
            let ports = distinct_free_ports(3 * n);
            let quorum: Vec<String> = (0..n)
                .map(|i| {
                    format!(
                        "server.{}=127.0.0.1:{}:{}",
                        i + 1,
                        ports[3 * i + 1],
                        ports[3 * i + 2]
                    )
                })
                .collect();
            for i in 0..n {
                let node_dir = dir.join(format!("node{}", i + 1));
                let _ = std::fs::remove_dir_all(&node_dir);
                let mut node = ZkServer::new(node_dir, quorum.clone(), Some(i + 1), &[]);
                node.port = ports[3 * i];
                ensemble.nodes.push(node);
            }
            // All at once: none serves until a quorum has formed.
            for node in &mut ensemble.nodes {
                node.spawn();
            }
            let deadline = Instant::now() + START_TIMEOUT;
            let mut port_taken = false;
            for node in &mut ensemble.nodes {
                match node.wait_serving(deadline).await {
                    Started::Up => {}
                    Started::PortTaken => port_taken = true,
                    Started::Failed(why) => panic!("a ZooKeeper node did not start: {why}"),
                }
                if port_taken {
                    break;
                }
            }
            if port_taken {
                // Every node again, on other ports (dropping the nodes kills them).
                continue;
            }
            ensemble.wait_quorum().await;
            return ensemble;
        }
        panic!("a ZooKeeper ensemble found no free ports in 5 tries");
    }

    /// Every node's `127.0.0.1:<port>`, comma-separated, as clients take it.
    pub fn connect_string(&self) -> String {
        let each: Vec<String> = self.nodes.iter().map(ZkServer::connect_string).collect();
        each.join(",")
    }

    /// Node `i` (from 0).
    pub fn node(&self, i: usize) -> &ZkServer {
        &self.nodes[i]
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Waits until a quorum serves under one leader; the leader's index. Panics after
    /// [`START_TIMEOUT`].
    pub async fn leader(&self) -> usize {
        self.wait_quorum().await
    }

    /// Waits until a quorum serves: exactly one running node says it leads and a
    /// majority of all nodes serve (as leader or follower). The leader's index. Panics
    /// after [`START_TIMEOUT`] with every node's mode.
    pub async fn wait_quorum(&self) -> usize {
        let deadline = Instant::now() + START_TIMEOUT;
        loop {
            let modes = self.modes().await;
            let leaders: Vec<usize> = (0..modes.len())
                .filter(|&i| modes[i].as_deref() == Some("leader"))
                .collect();
            let serving = modes
                .iter()
                .filter(|m| matches!(m.as_deref(), Some("leader" | "follower")))
                .count();
            if let [leader] = leaders[..]
                && serving > self.nodes.len() / 2
            {
                return leader;
            }
            if Instant::now() >= deadline {
                panic!("no quorum within {START_TIMEOUT:?}; the nodes' modes: {modes:?}");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Each node's mode (`leader`, `follower`), `None` for a node down or not serving.
    pub async fn modes(&self) -> Vec<Option<String>> {
        let asks = self.nodes.iter().map(|node| async move {
            match node.child {
                Some(_) => node.mode().await,
                None => None,
            }
        });
        futures_util::future::join_all(asks).await
    }

    /// Kills node `i` (SIGKILL) and waits until it has exited.
    pub fn kill(&mut self, i: usize) {
        self.nodes[i].stop();
    }

    /// Starts node `i` again on its ports and data; returns once it serves (it rejoins
    /// the quorum, as a follower if another node leads).
    pub async fn start_again(&mut self, i: usize) {
        self.nodes[i].start_again().await;
    }

    /// Freezes node `i` (SIGSTOP).
    pub fn pause(&self, i: usize) {
        self.nodes[i].pause();
    }

    /// Thaws node `i` (SIGCONT).
    pub fn resume(&self, i: usize) {
        self.nodes[i].resume();
    }
}

impl Drop for ZkEnsemble {
    fn drop(&mut self) {
        // Each node kills its process and removes its directory.
        self.nodes.clear();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `n` loopback ports free when asked and distinct: every probe is held until all are
/// found, so the kernel cannot hand out one twice.
fn distinct_free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("a bound port").port())
        .collect()
}

/// A share of the test process's standalone server: tests that need a server but not
/// one of their own (each works under a root path of its own) take one, and the server
/// stops when the last share is dropped. A test that stops, pauses or restarts its
/// server starts its own [`ZkServer`] instead.
#[derive(Clone)]
pub struct ZkLease(std::sync::Arc<ZkServer>);

impl ZkLease {
    pub fn connect_string(&self) -> String {
        self.0.connect_string()
    }

    pub fn server(&self) -> &ZkServer {
        &self.0
    }
}

/// The shared server, started on first use (and again after the last share went).
pub async fn shared() -> ZkLease {
    static SHARED: tokio::sync::Mutex<std::sync::Weak<ZkServer>> =
        tokio::sync::Mutex::const_new(std::sync::Weak::new());
    let mut slot = SHARED.lock().await;
    if let Some(server) = slot.upgrade() {
        return ZkLease(server);
    }
    let server = std::sync::Arc::new(start_on_spawner().await);
    *slot = std::sync::Arc::downgrade(&server);
    ZkLease(server)
}

/// Starts a server from a thread that lives as long as the test process: the
/// parent-death signal is tied to the thread that spawned the JVM, and a test's thread
/// ends with the test, while the shared server outlives it.
async fn start_on_spawner() -> ZkServer {
    type Reply = tokio::sync::oneshot::Sender<ZkServer>;
    static SPAWNER: std::sync::OnceLock<std::sync::Mutex<std::sync::mpsc::Sender<Reply>>> =
        std::sync::OnceLock::new();
    let spawner = SPAWNER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Reply>();
        std::thread::Builder::new()
            .name("zk-spawner".into())
            .spawn(move || {
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("a runtime for the spawner");
                while let Ok(reply) = rx.recv() {
                    let _ = reply.send(rt.block_on(ZkServer::start()));
                }
            })
            .expect("the spawner thread");
        std::sync::Mutex::new(tx)
    });
    let (reply, answer) = tokio::sync::oneshot::channel();
    spawner
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(reply)
        .expect("the spawner lives");
    answer.await.expect("the spawner started a server")
}
