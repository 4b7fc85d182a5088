//! The seeded history checker (`common/history.rs`) against the ZooKeeper backend: a
//! real ZooKeeper server, real time, random histories run several at a time, each
//! checked by the oracle after every step; and the same with a nemesis
//! (`common/nemesis.rs`): faults in transit and server crashes.
//!
//! Knobs and output as `tests/it/history_redis.rs` (`HISTORY_SEED`, `HISTORY_FROM`,
//! `HISTORY_COUNT`, default 120 here and 24 with the nemesis, `HISTORY_LEN`, default 30).
//!
//! ```text
//! cargo test --test it --features zookeeper,testing history_zookeeper::random_histories
//! HISTORY_COUNT=500 cargo test --release --test it --features zookeeper,testing history_zookeeper::nemesis -- --nocapture
//! ```
//!
//! # Setup
//!
//! [`WORKERS`] threads each run one history at a time, each on its own current-thread
//! runtime, with 2–3 `ZooKeeperBackend`s (each a session of its own, as separate
//! replicas) on the test process's shared server, under a root path of the history's
//! own, so concurrent histories share nothing but the server. The store's view for
//! check 3 is every lock node of the run's keys, holding or queued, read by the test's
//! own client: the hold identity in a tower-lock node's data, its mode from its name
//! (`lock-` nodes are exclusive or fair, which ZooKeeper does not tell apart). Check 3
//! so asks that a believed guard's node is still there (nobody deleted it); exclusion
//! is check 1's, on the guards. Check 4 waits until no lock node of the run's keys is
//! left and no backend has a local waiter.
//!
//! Permits and a key's other families do not exclude each other on ZooKeeper: Curator's
//! `InterProcessSemaphoreV2` keeps its nodes below the key (`locks/`, `leases/`), apart
//! from the `InterProcessMutex` and read-write lock nodes at the key, and Curator's own
//! recipes at one path so ignore each other. `LockMode`'s rules say that holds of
//! another family make a key busy on every built-in backend; this one does not, for
//! permits (exclusive/fair and read/write do exclude each other: their nodes share one
//! queue). The fixture says so (`Fixture::permits_apart`) and check 1 judges a key's
//! permits apart from its other holders; whether the backend should close that gap (at
//! the cost of Curator's semaphore layout, or of a write per acquisition) or the rule
//! should name the exception is open.
//!
//! # The nemesis
//!
//! [`NEMESIS_WORKERS`] threads each have a private `ZkServer` (a crash must not touch
//! another worker's histories) and, per history, a fault proxy that every backend's
//! session goes through; the test's own client goes to the server directly. A crash is
//! a SIGKILL of the server and a restart on its port and data. The server runs with
//! `forceSync=no`, but a write is in the page cache (written to the log, not synced)
//! before ZooKeeper answers it, and a SIGKILL of the JVM loses nothing there: no grant
//! the server acknowledged is lost, so the oracle gives the crash no allowance. What a
//! crash may cost is sessions: the backends' connections are down for as long as the
//! JVM takes to start again (half a second idle, seconds on a loaded machine); past a
//! third of [`NEMESIS_SESSION`], a backend gives its session up and its holds are
//! reported lost (their lost signal fires). The oracle allows a lost guard (it is not
//! believed), and never two holders; a guard believed must keep its node (check 3).
//!
//! The residue rule is the checker's (nothing left for a key one residue bound after
//! its last activity), with one allowance ZooKeeper needs: the nodes of a session no
//! backend uses any more (given up and replaced: the backend closes it as soon as the
//! server answers) or whose connection is down end only with that session, at worst
//! when the server expires it, a session timeout after it last heard from its client
//! (or after its own restart). Such nodes count as residue once seen for
//! [`NEMESIS_SESSION`] and [`ORPHAN_MARGIN`] more.

use crate::common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::history::{
    Campaign, Finding, Fixture, History, Knobs, Outcome, PERMITS, StoreHold, StoreMode, StoreView,
    Timing, campaign, run,
};
use common::nemesis::{Crashed, Nemesis, NemesisTiming};
use common::proxy::FaultProxy;
use common::zookeeper::ZkServer;
use tokio::time::Instant;
use tower_lock::{LockClient, LockKey, LockMode, ZooKeeperBackend};
use zookeeper_client as zk;

/// Real milliseconds, as on MySQL (`tests/it/history_mysql.rs`).
const TIMING: Timing = Timing {
    watchdog_lease_ms: 300,
    waiter_timeout_ms: 300,
    fixed_leases_ms: &[60, 150],
    waits_ms: &[0, 5, 20, 60],
    lock_timeout_ms: (10, 120),
    cancel_timeout_ms: (0, 30),
    small_pass_ms: (1, 15),
    big_pass_ms: (160, 220),
    big_pass_percent: 8,
    nemesis: None,
};

/// The backends' session timeout without a nemesis: nothing cuts a session off, and a
/// loaded machine must not make one expire.
const SESSION: Duration = Duration::from_secs(10);

/// Histories run at once (one thread and runtime each).
const WORKERS: u8 = 3;

/// Real milliseconds, with a nemesis: as on MySQL (`tests/it/history_mysql.rs`).
const NEMESIS_TIMING: Timing = Timing {
    watchdog_lease_ms: 600,
    waiter_timeout_ms: 400,
    fixed_leases_ms: &[100, 300, 900],
    waits_ms: &[0, 10, 60, 200],
    lock_timeout_ms: (20, 400),
    cancel_timeout_ms: (0, 60),
    small_pass_ms: (2, 80),
    big_pass_ms: (320, 650),
    big_pass_percent: 10,
    nemesis: Some(NemesisTiming {
        response_timeout_ms: 200,
        delay_ms: (20, 450),
        delay_for_ms: (30, 300),
        trap_hold_ms: (250, 700),
        trap_armed_ms: 600,
        refuse_for_ms: (30, 300),
        down_ms: (0, 250),
        short_lived_ms: (5, 400),
        twin_leases_ms: &[Some(100), Some(300), Some(900), None],
        fault_percent: 10,
        short_lived_percent: 10,
        twin_percent: 40,
        relaxed_percent: 0,
        crash_percent: 12,
        refuse_writes_percent: 0,
    }),
};

/// The backends' session timeout with a nemesis. The client declares its connection
/// dead after two fifths of it without an answer (1.6 s: past every delay and trap of
/// the nemesis) and the backend gives the session up a third of it later; a crash
/// (seconds of JVM start) outlasts that.
const NEMESIS_SESSION: Duration = Duration::from_secs(4);

/// How long past a session timeout the nodes of a session no backend uses may stay:
/// the server expires sessions on its tick (200 ms), then deletes their nodes.
const ORPHAN_MARGIN: Duration = Duration::from_millis(1500);

/// Histories run at once with a nemesis (one thread, runtime and server each).
const NEMESIS_WORKERS: u8 = 2;

/// The test's own session: long, so that it outlives a crash's restart.
const DIRECT_SESSION: Duration = Duration::from_secs(30);

/// One lock node of a key, as the test's own client read it.
struct Node {
    path: String,
    /// The session that owns it (ephemeral).
    session: i64,
    /// Its mode, for a node of the lock itself (not a semaphore's gate).
    mode: Option<StoreMode>,
    /// What tower-lock wrote into it: `h` or `w`, and its hold identity.
    state: String,
    hold_id: String,
}

/// The mode a lock node's name gives (Curator's names; see `layout.rs`).
fn mode_of(name: &str) -> StoreMode {
    let head = &name[..name.len() - 10];
    if head.ends_with("__WRIT__") {
        StoreMode::Exact(LockMode::Write)
    } else if head.ends_with("__READ__") {
        StoreMode::Exact(LockMode::Read)
    } else if head.ends_with("lease-") {
        StoreMode::Exact(LockMode::Permits {
            max: PERMITS.try_into().unwrap(),
        })
    } else {
        StoreMode::Sole
    }
}

/// Whether `name` is a lock node: protected mode, a ten-digit sequence.
fn is_lock_node(name: &str) -> bool {
    name.starts_with("_c_")
        && name.len() > 10
        && name[name.len() - 10..].bytes().all(|b| b.is_ascii_digit())
}

/// One history's store: a backend (session) per client, under a root of its own.
struct Zk {
    backends: Vec<ZooKeeperBackend>,
    clients: Vec<LockClient>,
    keys: Vec<LockKey>,
    /// Each key's directory.
    dirs: Vec<String>,
    /// The server, for the test's own client.
    connect: String,
    /// The test's own client, straight to the server (a new one after a crash).
    direct: Mutex<zk::Client>,
    timing: &'static Timing,
    /// The backends' session timeout.
    session: Duration,
    /// With a nemesis: its proxy (which the backends connect through) and the server,
    /// which a crash kills and restarts.
    nemesis: Option<(Nemesis, Arc<tokio::sync::Mutex<ZkServer>>)>,
    /// Nodes seen, by path, and since when (from a restart, for nodes that were there
    /// before it): an orphaned session's nodes get a session timeout from then.
    seen: Mutex<HashMap<String, Instant>>,
}

/// A client of the test's own on `connect`, tried for a while (a restarted server may
/// still be reading its data).
async fn direct_client(connect: &str) -> zk::Client {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let attempt = zk::Client::connector()
            .with_session_timeout(DIRECT_SESSION)
            .connect(connect)
            .await;
        match attempt {
            Ok(client) => return client,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(%e, "ZooKeeper not ready yet");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("ZooKeeper did not answer within 30 s: {e}"),
        }
    }
}

/// A backend on `hosts` under `root` with `timing`'s settings. With a nemesis the
/// machine may be busy enough that a connection does not come up at once: a build that
/// fails is tried again, a few times.
async fn build_backend(
    hosts: &str,
    root: &str,
    session: Duration,
    timing: &Timing,
) -> ZooKeeperBackend {
    let mut tries = 0;
    loop {
        let mut builder = ZooKeeperBackend::builder(hosts)
            .root(root)
            .session_timeout(session)
            .waiter_timeout(timing.waiter_timeout());
        if let Some(n) = &timing.nemesis {
            builder = builder.response_timeout(n.response_timeout());
        }
        match builder.build().await {
            Ok(backend) => return backend,
            Err(e) if tries < 5 && timing.nemesis.is_some() => {
                tries += 1;
                eprintln!("building a backend failed ({e}); again");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("building a backend: {e}"),
        }
    }
}

impl Zk {
    /// `history`'s store: a backend per client on `hosts` (the server, or a proxy to
    /// it), keys under `root`; the test's own client on `connect`.
    async fn connect(
        hosts: &str,
        connect: &str,
        root: &str,
        history: &History,
        timing: &'static Timing,
        session: Duration,
    ) -> Self {
        let mut backends = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..history.clients {
            let backend = build_backend(hosts, root, session, timing).await;
            clients.push(
                LockClient::builder(backend.clone())
                    .watchdog_lease(timing.watchdog_lease())
                    .build()
                    .unwrap(),
            );
            backends.push(backend);
        }
        let keys: Vec<LockKey> = (0..history.keys)
            .map(|k| LockKey::new(format!("k{k}")).unwrap())
            .collect();
        let dirs = keys.iter().map(|k| backends[0].path_of(k)).collect();
        Zk {
            backends,
            clients,
            keys,
            dirs,
            connect: connect.to_owned(),
            direct: Mutex::new(direct_client(connect).await),
            timing,
            session,
            nemesis: None,
            seen: Mutex::new(HashMap::new()),
        }
    }

    fn direct(&self) -> zk::Client {
        self.direct.lock().unwrap().clone()
    }

    fn local_waiters(&self) -> usize {
        self.backends
            .iter()
            .flat_map(|b| self.keys.iter().map(move |k| b.local_waiters(k)))
            .sum()
    }

    /// Every lock node of each key (the lock's own, a semaphore's leases and gates).
    async fn nodes(&self) -> Result<Vec<Vec<Node>>, zk::Error> {
        let client = self.direct();
        let mut all = Vec::new();
        for dir in &self.dirs {
            let mut nodes = Vec::new();
            for (sub, gate) in [("", false), ("/leases", false), ("/locks", true)] {
                let parent = format!("{dir}{sub}");
                let names = match client.list_children(&parent).await {
                    Ok(names) => names,
                    Err(zk::Error::NoNode) => continue,
                    Err(e) => return Err(e),
                };
                for name in names.into_iter().filter(|n| is_lock_node(n)) {
                    let path = format!("{parent}/{name}");
                    let (data, stat) = match client.get_data(&path).await {
                        Ok(answer) => answer,
                        // Gone meanwhile.
                        Err(zk::Error::NoNode) => continue,
                        Err(e) => return Err(e),
                    };
                    let text = String::from_utf8_lossy(&data).into_owned();
                    let mut words = text.strip_prefix("tower-lock/1 ").unwrap_or("").split(' ');
                    let state = words.next().unwrap_or("?").to_owned();
                    let hold_id = words.nth(1).unwrap_or("?").to_owned();
                    nodes.push(Node {
                        mode: (!gate).then(|| mode_of(&name)),
                        path,
                        session: stat.ephemeral_owner,
                        state,
                        hold_id,
                    });
                }
            }
            all.push(nodes);
        }
        let now = Instant::now();
        let mut seen = self.seen.lock().unwrap();
        seen.retain(|path, _| all.iter().flatten().any(|n| &n.path == path));
        for node in all.iter().flatten() {
            seen.entry(node.path.clone()).or_insert(now);
        }
        Ok(all)
    }

    /// The sessions the backends use now over a live connection: their nodes are
    /// theirs to delete. Any other session's nodes end with it, on the server's clock.
    fn live_sessions(&self) -> Vec<i64> {
        self.backends
            .iter()
            .filter(|b| {
                matches!(
                    b.client().state_watcher().peek_state(),
                    zk::SessionState::SyncConnected
                )
            })
            .map(ZooKeeperBackend::session_id)
            .collect()
    }

    /// Whether `node` is residue now: a live session's node (then the checker's own
    /// bound applies), or any node seen for longer than a session timeout and a margin.
    fn overdue(&self, node: &Node, live: &[i64], now: Instant) -> bool {
        if live.contains(&node.session) {
            return true;
        }
        let since = self.seen.lock().unwrap().get(&node.path).copied();
        since.is_some_and(|since| {
            now.saturating_duration_since(since) > self.session + ORPHAN_MARGIN
        })
    }
}

impl Fixture for Zk {
    fn clients(&self) -> &[LockClient] {
        &self.clients
    }

    fn keys(&self) -> &[LockKey] {
        &self.keys
    }

    async fn pass(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    async fn settle(&self) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    async fn view(&self) -> Option<StoreView> {
        let nodes = match self.nodes().await {
            Ok(nodes) => nodes,
            // Down (a crash) or not reconnected yet.
            Err(_) if self.nemesis.is_some() => return None,
            Err(e) => panic!("reading the store's nodes: {e}"),
        };
        Some(
            nodes
                .into_iter()
                .map(|nodes| {
                    nodes
                        .into_iter()
                        .filter_map(|n| {
                            Some(StoreHold {
                                owner: n.hold_id,
                                mode: n.mode?,
                            })
                        })
                        .collect()
                })
                .collect(),
        )
    }

    async fn drained(&self) -> Result<(), (Finding, String)> {
        let deadline = Instant::now()
            + self
                .timing
                .residue_bound()
                .unwrap_or(self.timing.beyond_every_lease())
            + self.session
            + ORPHAN_MARGIN
            + Duration::from_secs(3);
        loop {
            match self.nodes().await {
                Ok(nodes) => {
                    let left: Vec<String> = nodes
                        .iter()
                        .flatten()
                        .map(|n| format!("{} {} ({})", n.hold_id, n.state, n.path))
                        .collect();
                    let waiters = self.local_waiters();
                    if left.is_empty() && waiters == 0 {
                        return Ok(());
                    }
                    if Instant::now() >= deadline {
                        return Err((
                            Finding::ResidueAfterLeases,
                            format!("left: {left:?}; local waiters: {waiters}"),
                        ));
                    }
                }
                Err(e) if Instant::now() >= deadline => {
                    panic!("the store could not be read to check that it drained: {e}")
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    fn nemesis(&self) -> Option<&Nemesis> {
        self.nemesis.as_ref().map(|(n, _)| n)
    }

    /// A SIGKILL of the server, and a restart on its data after `down`. It loses none of
    /// the writes it answered (see the module docs).
    async fn crash(&self, down: Duration) -> Crashed {
        let (_, server) = self.nemesis.as_ref().expect("a crash needs a nemesis");
        let mut server = server.lock().await;
        server.stop();
        let killed_at = Instant::now();
        tokio::time::sleep(down).await;
        server.start_again().await;
        drop(server);
        // The sessions the server restored get a whole timeout from its start.
        let now = Instant::now();
        for since in self.seen.lock().unwrap().values_mut() {
            *since = now;
        }
        *self.direct.lock().unwrap() = direct_client(&self.connect).await;
        Crashed {
            killed_at,
            lost: Vec::new(),
        }
    }

    /// Permits and the key's other families do not exclude each other here (see the
    /// module docs).
    fn permits_apart(&self) -> bool {
        true
    }

    async fn residue(&self) -> Option<Vec<Vec<String>>> {
        let nodes = self.nodes().await.ok()?;
        let live = self.live_sessions();
        let now = Instant::now();
        Some(
            nodes
                .iter()
                .map(|nodes| {
                    nodes
                        .iter()
                        .filter(|n| self.overdue(n, &live, now))
                        .map(|n| {
                            format!(
                                "{} {} node of session {:#x}{} ({})",
                                n.hold_id,
                                n.state,
                                n.session,
                                if live.contains(&n.session) {
                                    ""
                                } else {
                                    ", not a live one"
                                },
                                n.path
                            )
                        })
                        .collect()
                })
                .collect(),
        )
    }
}

/// Runs histories without a nemesis for one worker thread, on the shared server.
struct Worker {
    server: common::zookeeper::ZkLease,
    id: u8,
    runs: u64,
}

impl Worker {
    fn run(&mut self, history: &History) -> Outcome {
        self.runs += 1;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let root = format!("/hist-{}-w{}-r{}", std::process::id(), self.id, self.runs);
        let connect = self.server.connect_string();
        runtime.block_on(async {
            let store = Zk::connect(&connect, &connect, &root, history, &TIMING, SESSION).await;
            run(&store, history).await
        })
    }
}

/// Runs histories with a nemesis for one worker thread: a private server (a crash must
/// not touch another worker's histories), and per run a fresh runtime, a fresh proxy,
/// fresh sessions and a fresh root.
struct NemesisWorker {
    server: Arc<tokio::sync::Mutex<ZkServer>>,
    port: u16,
    id: u8,
    runs: u64,
}

impl NemesisWorker {
    fn new(id: u8) -> Self {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let server = runtime.block_on(ZkServer::start());
        NemesisWorker {
            port: server.port(),
            server: Arc::new(tokio::sync::Mutex::new(server)),
            id,
            runs: 0,
        }
    }

    fn run(&mut self, history: &History) -> Outcome {
        self.runs += 1;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let root = format!(
            "/nemesis-{}-n{}-r{}",
            std::process::id(),
            self.id,
            self.runs
        );
        runtime.block_on(async {
            let direct = format!("127.0.0.1:{}", self.port);
            let proxy = FaultProxy::start(([127, 0, 0, 1], self.port).into()).await;
            let hosts = format!("127.0.0.1:{}", proxy.port());
            let mut store = Zk::connect(
                &hosts,
                &direct,
                &root,
                history,
                &NEMESIS_TIMING,
                NEMESIS_SESSION,
            )
            .await;
            // A request names its key by its directory's path.
            let patterns = store.dirs.iter().map(|d| d.as_bytes().to_vec()).collect();
            let nemesis = Nemesis::new(proxy, &NEMESIS_TIMING, patterns);
            store.nemesis = Some((nemesis, Arc::clone(&self.server)));
            run(&store, history).await
        })
    }
}

/// The history checker with a nemesis on ZooKeeper: see the module docs. A sample of
/// seeds in the suite; `HISTORY_COUNT` runs more.
#[test]
fn nemesis_zookeeper() {
    if !ZkServer::available() {
        eprintln!("skipped: no ZooKeeper jars or java (.ci/run installs them)");
        return;
    }
    let next = AtomicU8::new(0);
    campaign(
        Campaign {
            name: "zookeeper, nemesis",
            knobs: Knobs::from_env(24, 30),
            timing: NEMESIS_TIMING,
            workers: usize::from(NEMESIS_WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --test it --features zookeeper,testing history_zookeeper::nemesis_zookeeper",
        },
        || {
            let mut worker = NemesisWorker::new(next.fetch_add(1, Ordering::Relaxed));
            move |history: &History| worker.run(history)
        },
    );
}

#[test]
fn random_histories_keep_the_oracle_on_zookeeper() {
    if !ZkServer::available() {
        eprintln!("skipped: no ZooKeeper jars or java (.ci/run installs them)");
        return;
    }
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let server = runtime.block_on(common::zookeeper::shared());
    let next = AtomicU8::new(1);
    campaign(
        Campaign {
            name: "zookeeper",
            knobs: Knobs::from_env(120, 30),
            timing: TIMING,
            workers: usize::from(WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --test it --features zookeeper,testing history_zookeeper::random_histories",
        },
        || {
            let mut worker = Worker {
                server: server.clone(),
                id: next.fetch_add(1, Ordering::Relaxed),
                runs: 0,
            };
            move |history: &History| worker.run(history)
        },
    );
    drop(server);
}
