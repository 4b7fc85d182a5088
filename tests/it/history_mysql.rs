//! The seeded history checker (`common/history.rs`) against the MySQL/MariaDB backend: a
//! real server, a database of its own for the run (dropped afterwards), real time, random
//! histories run several at a time, each checked by the oracle after every step.
//!
//! Knobs and output as `tests/it/history_redis.rs` (`HISTORY_SEED`, `HISTORY_FROM`,
//! `HISTORY_COUNT`, default 150 here and 24 with the nemesis, `HISTORY_LEN`, default 30).
//!
//! ```text
//! cargo test --all-features --test it history_mysql::random_histories
//! HISTORY_COUNT=1000 cargo test --release --all-features --test it history_mysql::nemesis -- --nocapture
//! ```
//!
//! # Setup
//!
//! [`WORKERS`] threads each run one history at a time, each on its own current-thread
//! runtime with 2–3 `MySqlBackend`s (separate pools and listening connections, as
//! separate replicas) on a table of the worker's own, and keys named after the run, so
//! concurrent histories share nothing but the server. The store's view for check 3 is
//! one `SELECT` of the live holds of the run's keys (every mode, exclusive included, is
//! a row of the holds table; one statement: one snapshot). Check 4 waits until no live
//! hold and no queued waiter of the run's keys is left, and no backend has a local
//! waiter.
//!
//! # The nemesis
//!
//! [`NEMESIS_WORKERS`] threads each have a private MariaDB server (`MariaDbServer`: a
//! crash must not touch another worker's histories, nor the machine's server) and, per
//! history, a fault proxy that every client's pool connects through (calls and the
//! listening connection alike); the test's own pool goes to the server directly. Each
//! client has a pool of its own. No client is relaxed: InnoDB's durability is
//! server-wide (`innodb_flush_log_at_trx_commit`), and the backend refuses a server that
//! may lose a commit. A crash is a SIGKILL of the server and a restart on its port and
//! data, with InnoDB's crash recovery: it loses none of the holds it had granted, so the
//! oracle gives it no allowance at all.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use common::history::{
    Campaign, Finding, Fixture, History, Knobs, Outcome, StoreHold, StoreMode, StoreView, Timing,
    campaign, run,
};
use common::mariadb_server::MariaDbServer;
use common::mysql::{MyDatabase, with_database, with_local_port};
use common::nemesis::{Crashed, Nemesis, NemesisTiming};
use common::proxy::FaultProxy;
use sqlx::MySqlPool;
use sqlx::mysql::{MySqlConnectOptions, MySqlPoolOptions};
use tokio::time::Instant;
use tower_lock::{LockClient, LockKey, LockMode, MySqlBackend};

/// Real milliseconds, as on Redis and PostgreSQL.
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

/// Histories run at once (one thread, runtime and table each).
const WORKERS: u8 = 4;

/// Real milliseconds, with a nemesis: as on PostgreSQL (`tests/it/history_postgres.rs`),
/// with no relaxed clients (see the module docs).
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

/// Histories run at once with a nemesis (one thread, runtime and server each).
const NEMESIS_WORKERS: u8 = 2;

/// The live holds' clause: a lease that ends after the database's clock now.
const LIVE: &str = "TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))";

struct MySql {
    backends: Vec<MySqlBackend>,
    clients: Vec<LockClient>,
    keys: Vec<LockKey>,
    /// The test's own pool (straight to the server, with a nemesis).
    pool: MySqlPool,
    /// The clients' own pools, with a nemesis (closed after the run).
    client_pools: Vec<MySqlPool>,
    table: String,
    timing: &'static Timing,
    /// With a nemesis: its proxy (which the clients' pools connect through) and the
    /// server, which a crash kills and restarts.
    nemesis: Option<(Nemesis, Arc<tokio::sync::Mutex<MariaDbServer>>)>,
}

impl MySql {
    async fn connect(url: &str, table: &str, namespace: &str, history: &History) -> Self {
        let pool = MySqlPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(Duration::from_secs(5))
            .test_before_acquire(false)
            .connect(url)
            .await
            .unwrap();
        let pools = vec![pool.clone(); usize::from(history.clients)];
        Self::with_pools(pool, pools, table, namespace, history, &TIMING).await
    }

    /// One backend per pool of `pools` (one per client), on `table`.
    async fn with_pools(
        pool: MySqlPool,
        pools: Vec<MySqlPool>,
        table: &str,
        namespace: &str,
        history: &History,
        timing: &'static Timing,
    ) -> Self {
        let mut backends = Vec::new();
        let mut clients = Vec::new();
        for client_pool in &pools {
            let backend = build_backend(client_pool, table, timing).await;
            clients.push(
                LockClient::builder(backend.clone())
                    .watchdog_lease(timing.watchdog_lease())
                    .build()
                    .unwrap(),
            );
            backends.push(backend);
        }
        let keys = (0..history.keys)
            .map(|k| LockKey::new(format!("hist:{namespace}:k{k}")).unwrap())
            .collect();
        MySql {
            backends,
            clients,
            keys,
            pool,
            client_pools: if timing.nemesis.is_some() {
                pools
            } else {
                Vec::new()
            },
            table: table.to_owned(),
            timing,
            nemesis: None,
        }
    }

    /// `?, ?, ...`, one per key, and the keys' names to bind to them.
    fn names(&self) -> (String, Vec<String>) {
        let names: Vec<String> = self.keys.iter().map(|k| k.as_str().to_owned()).collect();
        (vec!["?"; names.len()].join(", "), names)
    }

    fn local_waiters(&self) -> usize {
        self.backends
            .iter()
            .flat_map(|b| self.keys.iter().map(move |k| b.local_waiters(k)))
            .sum()
    }
}

/// A backend on `pool` and `table` with `timing`'s settings. With a nemesis, its short
/// response timeout can run out while the machine is busy before any fault has begun: a
/// build that fails is tried again, a few times.
async fn build_backend(pool: &MySqlPool, table: &str, timing: &Timing) -> MySqlBackend {
    let mut tries = 0;
    loop {
        let mut builder = MySqlBackend::builder(pool.clone())
            .table(table)
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

impl Fixture for MySql {
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
        let (marks, names) = self.names();
        let sql = format!(
            "SELECT name, owner, mode FROM `{t}` WHERE name IN ({marks}) AND expires_us > {LIVE}",
            t = self.table
        );
        let mut query = sqlx::query_as(&sql);
        for name in &names {
            query = query.bind(name);
        }
        let rows: Vec<(Vec<u8>, Vec<u8>, Vec<u8>)> = match query.fetch_all(&self.pool).await {
            Ok(rows) => rows,
            // Right after a crash the server may still be recovering.
            Err(_) if self.nemesis.is_some() => return None,
            Err(e) => panic!("reading the store's holds: {e}"),
        };
        let view = self
            .keys
            .iter()
            .map(|key| {
                rows.iter()
                    .filter(|(name, _, _)| name == key.as_str().as_bytes())
                    .map(|(_, owner, mode)| StoreHold {
                        owner: String::from_utf8(owner.clone()).unwrap(),
                        mode: match mode.as_slice() {
                            b"x" => StoreMode::Exact(LockMode::Exclusive),
                            b"f" => StoreMode::Exact(LockMode::Fair),
                            b"r" => StoreMode::Exact(LockMode::Read),
                            b"w" => StoreMode::Exact(LockMode::Write),
                            b"p" => StoreMode::Exact(LockMode::Permits {
                                max: common::history::PERMITS.try_into().unwrap(),
                            }),
                            other => panic!("a hold of unknown mode {other:?}"),
                        },
                    })
                    .collect()
            })
            .collect();
        Some(view)
    }

    async fn drained(&self) -> Result<(), (Finding, String)> {
        let deadline = Instant::now()
            + self
                .timing
                .residue_bound()
                .unwrap_or(self.timing.beyond_every_lease())
            + Duration::from_secs(3);
        loop {
            match self.left().await {
                Ok(left) => {
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

    /// A SIGKILL of the server, and a restart on its data (with InnoDB's crash
    /// recovery) after `down`. A commit is durable (`innodb_flush_log_at_trx_commit =
    /// 1`, the default): the server loses nothing it granted.
    async fn crash(&self, down: Duration) -> Crashed {
        let (_, server) = self.nemesis.as_ref().expect("a crash needs a nemesis");
        let mut server = server.lock().await;
        server.kill9();
        let killed_at = Instant::now();
        tokio::time::sleep(down).await;
        server.restart().await;
        Crashed {
            killed_at,
            lost: Vec::new(),
        }
    }

    async fn residue(&self) -> Option<Vec<Vec<String>>> {
        let left = self.left().await.ok()?;
        Some(
            self.keys
                .iter()
                .map(|k| {
                    left.iter()
                        .filter(|(name, _)| name == k.as_str())
                        .map(|(_, what)| what.clone())
                        .collect()
                })
                .collect(),
        )
    }
}

impl MySql {
    /// Every live hold and queue entry of the run's keys: (name, `owner (mode, time
    /// left)` or `queued owner (mode, time left)`).
    async fn left(&self) -> Result<Vec<(String, String)>, sqlx::Error> {
        let (marks, names) = self.names();
        let sql = format!(
            "SELECT CAST(name AS CHAR), CONCAT(CAST(owner AS CHAR), ' (', mode, ', ', \
                    CAST((expires_us - {LIVE}) DIV 1000 AS CHAR), 'ms left)') \
               FROM `{t}` WHERE name IN ({marks}) AND expires_us > {LIVE} \
             UNION ALL \
             SELECT CAST(name AS CHAR), CONCAT('queued ', CAST(owner AS CHAR), ' (', mode, ', ', \
                    CAST((evict_us - {LIVE}) DIV 1000 AS CHAR), 'ms left)') \
               FROM `{t}_queue` WHERE name IN ({marks}) AND evict_us > {LIVE}",
            t = self.table
        );
        let mut query = sqlx::query_as(&sql);
        for name in names.iter().chain(&names) {
            query = query.bind(name);
        }
        query.fetch_all(&self.pool).await
    }
}

struct Worker {
    url: String,
    table: String,
    runs: u64,
}

impl Worker {
    fn run(&mut self, history: &History) -> Outcome {
        self.runs += 1;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let namespace = format!("{}r{}", self.table, self.runs);
        runtime.block_on(async {
            let store = MySql::connect(&self.url, &self.table, &namespace, history).await;
            let outcome = run(&store, history).await;
            // The backends (and their listening connections) go first, then the pool.
            let pool = store.pool.clone();
            drop(store);
            pool.close().await;
            outcome
        })
    }
}

/// Runs histories with a nemesis for one worker thread: a private server (a crash must
/// not touch another worker's histories), and per run a fresh runtime, a fresh proxy,
/// fresh pools and fresh key names on the server's database.
struct NemesisWorker {
    server: Arc<tokio::sync::Mutex<MariaDbServer>>,
    /// The database of the histories, on the private server.
    url: String,
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
        let (server, url) = runtime.block_on(async {
            let server = MariaDbServer::start(&[]).await;
            let admin = connect_when_ready(server.url().parse().unwrap(), 1).await;
            sqlx::query("CREATE DATABASE IF NOT EXISTS history")
                .execute(&admin)
                .await
                .unwrap();
            admin.close().await;
            let url = with_database(&server.url(), "history");
            (server, url)
        });
        NemesisWorker {
            url,
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
        let namespace = format!("n{}r{}", self.id, self.runs);
        runtime.block_on(async {
            let pool = connect_when_ready(self.url.parse().unwrap(), 2).await;
            let proxy = FaultProxy::start(([127, 0, 0, 1], self.port).into()).await;
            let via_proxy: MySqlConnectOptions =
                with_local_port(&self.url, proxy.port()).parse().unwrap();
            let mut pools = Vec::new();
            for _ in 0..usize::from(history.clients) {
                pools.push(connect_when_ready(via_proxy.clone(), 4).await);
            }
            let mut store =
                MySql::with_pools(pool, pools, "nemesis", &namespace, history, &NEMESIS_TIMING)
                    .await;
            let patterns = store
                .keys
                .iter()
                .map(|k| k.as_str().as_bytes().to_vec())
                .collect();
            let nemesis = Nemesis::new(proxy, &NEMESIS_TIMING, patterns);
            store.nemesis = Some((nemesis, Arc::clone(&self.server)));
            let outcome = run(&store, history).await;
            // The backends (and their listening connections) go first, then the pools.
            let pools: Vec<MySqlPool> = std::iter::once(store.pool.clone())
                .chain(store.client_pools.iter().cloned())
                .collect();
            drop(store);
            for pool in pools {
                pool.close().await;
            }
            outcome
        })
    }
}

/// A pool of up to `max` connections on `options` once the server answers (a server
/// restarted by the last history's crash answers once its recovery is done, but no
/// fault has begun yet: a refusal here is no finding). Connections are not pinged before
/// they are handed out, and waiting for one gives up after 1 s: a fault must reach the
/// backend as the outage it is, not be hidden or stall the history.
async fn connect_when_ready(options: MySqlConnectOptions, max: u32) -> MySqlPool {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pool = MySqlPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(Duration::from_secs(1))
            .test_before_acquire(false)
            .connect_with(options.clone())
            .await;
        match pool {
            Ok(pool) => return pool,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(%e, "MariaDB not ready yet");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("MariaDB did not answer within 30 s: {e}"),
        }
    }
}

/// The history checker with a nemesis on MySQL/MariaDB: see the module docs. A sample of
/// seeds in the suite; `HISTORY_COUNT` runs more.
#[test]
fn nemesis_mysql() {
    if !MariaDbServer::available() {
        eprintln!("skipped: no MariaDB server binaries (.ci/run installs them)");
        return;
    }
    let next = AtomicU8::new(0);
    campaign(
        Campaign {
            name: "mysql, nemesis",
            knobs: Knobs::from_env(24, 40),
            timing: NEMESIS_TIMING,
            workers: usize::from(NEMESIS_WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --all-features --test it history_mysql::nemesis_mysql",
        },
        || {
            let mut worker = NemesisWorker::new(next.fetch_add(1, Ordering::Relaxed));
            move |history: &History| worker.run(history)
        },
    );
}

#[test]
fn random_histories_keep_the_oracle_on_mysql() {
    let db = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(MyDatabase::create());
    let url = db.url().to_owned();
    let next = AtomicU8::new(1);
    campaign(
        Campaign {
            name: "mysql",
            knobs: Knobs::from_env(150, 30),
            timing: TIMING,
            workers: usize::from(WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --all-features --test it history_mysql::random_histories",
        },
        || {
            let mut worker = Worker {
                url: url.clone(),
                table: format!("hist_w{}", next.fetch_add(1, Ordering::Relaxed)),
                runs: 0,
            };
            move |history: &History| worker.run(history)
        },
    );
    drop(db);
}
