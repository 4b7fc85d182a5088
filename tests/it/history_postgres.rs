//! The seeded history checker (`common/history.rs`) against the PostgreSQL backend: a
//! real server, a database of its own for the run (dropped afterwards), real time, random
//! histories run several at a time, each checked by the oracle after every step.
//!
//! Knobs and output as `tests/it/history_redis.rs` (`HISTORY_SEED`, `HISTORY_FROM`,
//! `HISTORY_COUNT`, default 150 here and 16 with the nemesis, `HISTORY_LEN`, default 30).
//!
//! ```text
//! cargo test --all-features --test it history_postgres::random_histories
//! HISTORY_COUNT=2000 cargo test --release --all-features --test it history_postgres::nemesis -- --nocapture
//! ```
//!
//! # Setup
//!
//! [`WORKERS`] threads each run one history at a time, each on its own current-thread
//! runtime with 2–3 `PostgresBackend`s (separate pools and listeners, as separate
//! replicas) on a table of the worker's own, and keys named after the run, so concurrent
//! histories share nothing but the server. The store's view for check 3 is one `SELECT`
//! of the live holds of the run's keys, exclusive ones in the names table included (one
//! statement: one snapshot). Check 4 waits until
//! no live hold and no queued waiter of the run's keys is left, and no backend has a
//! local waiter.
//!
//! # The nemesis
//!
//! [`NEMESIS_WORKERS`] threads each have a private PostgreSQL server (`PgServer`: a crash
//! must not touch another worker's histories, nor the machine's server) and, per
//! history, a fault proxy that every client's pool connects through (statements and the
//! listening connection alike); the test's own pool goes to the server directly. Each
//! client has a pool of its own, and a relaxed client's sessions run with
//! `synchronous_commit = off`. A crash is a SIGKILL of the server's process group and a
//! restart on its port, with crash recovery: PostgreSQL loses none of the holds it had
//! granted, so the oracle gives it no allowance at all.

use crate::common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::history::{
    Campaign, Finding, Fixture, History, Knobs, Outcome, StoreHold, StoreMode, StoreView, Timing,
    campaign, run,
};
use common::nemesis::{Crashed, Nemesis, NemesisTiming};
use common::postgres::{PgDatabase, PgServer};
use common::proxy::FaultProxy;
use sqlx::PgPool;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::time::Instant;
use tower_lock::{LockClient, LockKey, LockMode, PostgresBackend};

/// Real milliseconds, as on Redis.
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

/// Real milliseconds, with a nemesis: as on Redis (`tests/it/history_redis.rs`), with 40%
/// of the clients on relaxed sessions.
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
        relaxed_percent: 40,
        crash_percent: 12,
        refuse_writes_percent: 0,
    }),
};

/// Histories run at once with a nemesis (one thread, runtime and server each).
const NEMESIS_WORKERS: u8 = 3;

struct Postgres {
    backends: Vec<PostgresBackend>,
    clients: Vec<LockClient>,
    keys: Vec<LockKey>,
    /// The test's own pool (straight to the server, with a nemesis).
    pool: PgPool,
    /// The clients' own pools, with a nemesis (closed after the run).
    client_pools: Vec<PgPool>,
    table: String,
    timing: &'static Timing,
    /// With a nemesis: its proxy (which the clients' pools connect through) and the
    /// server, which a crash kills and restarts.
    nemesis: Option<(Nemesis, Arc<Mutex<PgServer>>)>,
}

impl Postgres {
    async fn connect(url: &str, table: &str, namespace: &str, history: &History) -> Self {
        let pool = PgPool::connect(url).await.unwrap();
        let pools = vec![pool.clone(); usize::from(history.clients)];
        Self::with_pools(pool, pools, table, namespace, history, &TIMING).await
    }

    /// One backend per pool of `pools` (one per client), on `table`.
    async fn with_pools(
        pool: PgPool,
        pools: Vec<PgPool>,
        table: &str,
        namespace: &str,
        history: &History,
        timing: &'static Timing,
    ) -> Self {
        let mut backends = Vec::new();
        let mut clients = Vec::new();
        for (i, client_pool) in pools.iter().enumerate() {
            // Every other client has released locks handed to its waiters.
            let backend = build_backend(client_pool, table, timing, i % 2 == 1).await;
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
        Postgres {
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

    fn names(&self) -> Vec<String> {
        self.keys.iter().map(|k| k.as_str().to_owned()).collect()
    }

    fn local_waiters(&self) -> usize {
        self.backends
            .iter()
            .flat_map(|b| self.keys.iter().map(move |k| b.local_waiters(k)))
            .sum()
    }
}

/// A backend on `pool` and `table` with `timing`'s settings, handing released locks
/// to its waiters when `hand_over`. With a nemesis, its short
/// response timeout can run out while the machine is busy before any fault has begun: a
/// build that fails is tried again, a few times.
async fn build_backend(
    pool: &PgPool,
    table: &str,
    timing: &Timing,
    hand_over: bool,
) -> PostgresBackend {
    let mut tries = 0;
    loop {
        let mut builder = PostgresBackend::builder(pool.clone())
            .table(table)
            .waiter_timeout(timing.waiter_timeout())
            .hand_over(hand_over);
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

impl Fixture for Postgres {
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
        let read = sqlx::query_as(&format!(
            "SELECT name, owner, mode FROM {t} WHERE name = ANY($1) AND expires_at > clock_timestamp() \
             UNION ALL \
             SELECT name, owner, 'x'::\"char\" FROM {t}_names \
              WHERE name = ANY($1) AND owner IS NOT NULL AND expires_at > clock_timestamp()",
            t = self.table
        ))
        .bind(self.names())
        .fetch_all(&self.pool)
        .await;
        let rows: Vec<(String, String, i8)> = match read {
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
                    .filter(|(name, _, _)| name == key.as_str())
                    .map(|(_, owner, mode)| StoreHold {
                        owner: owner.clone(),
                        mode: match u8::try_from(*mode).unwrap() {
                            b'x' => StoreMode::Exact(LockMode::Exclusive),
                            b'f' => StoreMode::Exact(LockMode::Fair),
                            b'r' => StoreMode::Exact(LockMode::Read),
                            b'w' => StoreMode::Exact(LockMode::Write),
                            _ => StoreMode::Exact(LockMode::Permits {
                                max: common::history::PERMITS.try_into().unwrap(),
                            }),
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
            // A waiter's registration that its leaving could not take back (a fault)
            // lasts 2 s past what blocked it.
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

    /// A SIGKILL of the server's process group, and a restart (with crash recovery)
    /// after `down`. PostgreSQL loses nothing it granted.
    async fn crash(&self, down: Duration) -> Crashed {
        let (_, server) = self.nemesis.as_ref().expect("a crash needs a nemesis");
        let killing = Arc::clone(server);
        tokio::task::spawn_blocking(move || killing.lock().unwrap().kill())
            .await
            .unwrap();
        let killed_at = Instant::now();
        tokio::time::sleep(down).await;
        let restarting = Arc::clone(server);
        tokio::task::spawn_blocking(move || restarting.lock().unwrap().restart())
            .await
            .unwrap();
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

impl Postgres {
    /// Every live hold, queue entry and exclusive waiter's registration that could
    /// still be handed a lock, of the run's keys: (name, owner, `queued owner` or
    /// `waiting owner`, with the time left).
    async fn left(&self) -> Result<Vec<(String, String)>, sqlx::Error> {
        sqlx::query_as(&format!(
            "SELECT name, owner || ' (' || mode::text || ', ' || \
                    (extract(epoch from expires_at - clock_timestamp()) * 1000)::bigint || 'ms left)' \
               FROM {t} WHERE name = ANY($1) AND expires_at > clock_timestamp() \
             UNION ALL \
             SELECT name, owner || ' (x, ' || \
                    (extract(epoch from expires_at - clock_timestamp()) * 1000)::bigint || 'ms left)' \
               FROM {t}_names \
              WHERE name = ANY($1) AND owner IS NOT NULL AND expires_at > clock_timestamp() \
             UNION ALL \
             SELECT name, 'queued ' || owner || ' (' || \
                    (extract(epoch from evict_at - clock_timestamp()) * 1000)::bigint || 'ms left)' \
               FROM {t}_queue WHERE name = ANY($1) AND evict_at > clock_timestamp() \
             UNION ALL \
             SELECT name, 'waiting ' || owner || ' (' || \
                    (extract(epoch from until - clock_timestamp()) * 1000)::bigint || 'ms left)' \
               FROM {t}_waiters WHERE name = ANY($1) AND until > clock_timestamp() \
                AND (gives_up_us = 0 \
                     OR gives_up_us > (extract(epoch from clock_timestamp()) * 1000000)::bigint)",
            t = self.table
        ))
        .bind(self.names())
        .fetch_all(&self.pool)
        .await
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
            let store = Postgres::connect(&self.url, &self.table, &namespace, history).await;
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
/// fresh pools and fresh key names on the worker's table.
struct NemesisWorker {
    server: Arc<Mutex<PgServer>>,
    url: String,
    port: u16,
    id: u8,
    runs: u64,
}

impl NemesisWorker {
    fn new(id: u8) -> Self {
        let server = PgServer::start().expect("PostgreSQL server binaries (checked before)");
        NemesisWorker {
            url: server.url(),
            port: server.port,
            server: Arc::new(Mutex::new(server)),
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
            let direct: PgConnectOptions = self.url.parse().unwrap();
            let pool = connect_when_ready(direct, 2, Duration::from_secs(2)).await;
            let proxy = FaultProxy::start(([127, 0, 0, 1], self.port).into()).await;
            let via_proxy: PgConnectOptions =
                format!("postgres://root@127.0.0.1:{}/postgres", proxy.port())
                    .parse()
                    .unwrap();
            let mut pools = Vec::new();
            for c in 0..usize::from(history.clients) {
                let mut options = via_proxy.clone();
                if history.relaxed.get(c) == Some(&true) {
                    options = options.options([("synchronous_commit", "off")]);
                }
                pools.push(connect_when_ready(options, 4, Duration::from_secs(1)).await);
            }
            let mut store =
                Postgres::with_pools(pool, pools, "nemesis", &namespace, history, &NEMESIS_TIMING)
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
            let pools: Vec<PgPool> = std::iter::once(store.pool.clone())
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

/// A pool on `options` once the server answers. `PgServer` is up when its port accepts
/// connections, but a server just started (or restarted by the last history's crash)
/// answers "the database system is starting up" for a while: that is no finding, and
/// no fault has begun yet.
async fn connect_when_ready(options: PgConnectOptions, max: u32, acquire: Duration) -> PgPool {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let pool = PgPoolOptions::new()
            .max_connections(max)
            .acquire_timeout(acquire)
            .connect_with(options.clone())
            .await;
        match pool {
            Ok(pool) => return pool,
            Err(e) if Instant::now() < deadline => {
                tracing::debug!(%e, "PostgreSQL not ready yet");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("PostgreSQL did not answer within 30 s: {e}"),
        }
    }
}

/// The history checker with a nemesis on PostgreSQL: see the module docs. A sample of
/// seeds in the suite; `HISTORY_COUNT` runs more.
#[test]
fn nemesis_postgres() {
    if !PgServer::available() {
        eprintln!("skipped: no PostgreSQL server binaries (.ci/run installs them)");
        return;
    }
    let next = AtomicU8::new(0);
    campaign(
        Campaign {
            name: "postgres, nemesis",
            knobs: Knobs::from_env(16, 40),
            timing: NEMESIS_TIMING,
            workers: usize::from(NEMESIS_WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --all-features --test it history_postgres::nemesis_postgres",
        },
        || {
            let mut worker = NemesisWorker::new(next.fetch_add(1, Ordering::Relaxed));
            move |history: &History| worker.run(history)
        },
    );
}

#[test]
fn random_histories_keep_the_oracle_on_postgres() {
    let db = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(PgDatabase::create());
    let url = db.url.clone();
    let next = AtomicU8::new(1);
    campaign(
        Campaign {
            name: "postgres",
            knobs: Knobs::from_env(150, 30),
            timing: TIMING,
            workers: usize::from(WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --all-features --test it history_postgres::random_histories",
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
