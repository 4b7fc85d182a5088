//! The seeded history checker (`common/history.rs`) against the PostgreSQL backend: a
//! real server, a database of its own for the run (dropped afterwards), real time, random
//! histories run several at a time, each checked by the oracle after every step.
//!
//! Knobs and output as `tests/history_redis.rs` (`HISTORY_SEED`, `HISTORY_COUNT`,
//! default 150 here, `HISTORY_LEN`, default 30).
//!
//! # Setup
//!
//! [`WORKERS`] threads each run one history at a time, each on its own current-thread
//! runtime with 2–3 `PostgresBackend`s (separate pools and listeners, as separate
//! replicas) on a table of the worker's own, and keys named after the run, so concurrent
//! histories share nothing but the server. The store's view for check 3 is one `SELECT`
//! of the live holds of the run's keys (one statement: one snapshot). Check 4 waits until
//! no live hold and no queued waiter of the run's keys is left, and no backend has a
//! local waiter.

#![cfg(feature = "postgres")]

mod common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use common::history::{
    Campaign, Finding, Fixture, History, Knobs, Outcome, StoreHold, StoreMode, StoreView, Timing,
    campaign, run,
};
use common::postgres::PgDatabase;
use sqlx::PgPool;
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
};

/// Histories run at once (one thread, runtime and table each).
const WORKERS: u8 = 4;

struct Postgres {
    backends: Vec<PostgresBackend>,
    clients: Vec<LockClient>,
    keys: Vec<LockKey>,
    pool: PgPool,
    table: String,
}

impl Postgres {
    async fn connect(url: &str, table: &str, namespace: &str, history: &History) -> Self {
        let pool = PgPool::connect(url).await.unwrap();
        let mut backends = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..history.clients {
            let backend = PostgresBackend::builder(pool.clone())
                .table(table)
                .waiter_timeout(TIMING.waiter_timeout())
                .build()
                .await
                .unwrap();
            clients.push(
                LockClient::builder(backend.clone())
                    .watchdog_lease(TIMING.watchdog_lease())
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
            table: table.to_owned(),
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

    async fn view(&self) -> StoreView {
        let rows: Vec<(String, String, i8)> = sqlx::query_as(&format!(
            "SELECT name, owner, mode FROM {} WHERE name = ANY($1) AND expires_at > clock_timestamp()",
            self.table
        ))
        .bind(self.names())
        .fetch_all(&self.pool)
        .await
        .unwrap();
        self.keys
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
            .collect()
    }

    async fn drained(&self) -> Result<(), (Finding, String)> {
        let deadline = Instant::now() + TIMING.beyond_every_lease() + Duration::from_secs(1);
        loop {
            let left: Vec<(String, String)> = sqlx::query_as(&format!(
                "SELECT name, owner FROM {t} WHERE name = ANY($1) AND expires_at > clock_timestamp() \
                 UNION ALL \
                 SELECT name, 'queued:' || owner FROM {t}_queue WHERE name = ANY($1) AND evict_at > clock_timestamp()",
                t = self.table
            ))
            .bind(self.names())
            .fetch_all(&self.pool)
            .await
            .unwrap();
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
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
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
            rerun: "cargo test --features postgres --test history_postgres",
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
