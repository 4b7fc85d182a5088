//! The seeded history checker (`common/history.rs`) against the Redis backend: a real
//! `redis-server` started by the test, real time, a few hundred random histories run
//! several at a time, each checked by the oracle after every step; and the same with a
//! nemesis (`common/nemesis.rs`): faults in transit and store crashes.
//!
//! # Knobs (environment)
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `HISTORY_SEED` | – | run exactly this seed (decimal or `0x` hex) |
//! | `HISTORY_COUNT` | 300 (nemesis: 24) | run seeds `HISTORY_FROM..HISTORY_FROM + HISTORY_COUNT` |
//! | `HISTORY_FROM` | 0 | the first seed (a campaign past the suite's own seeds) |
//! | `HISTORY_LEN` | 30 | ops per history |
//!
//! ```text
//! cargo test --test it history_redis::random_histories
//! HISTORY_SEED=17 cargo test --test it history_redis::random_histories -- --nocapture
//! HISTORY_COUNT=2000 cargo test --release --test it history_redis::nemesis -- --nocapture
//! HISTORY_FROM=1000 HISTORY_COUNT=1000 HISTORY_LEN=60 cargo test --release --test it history_redis::nemesis -- --nocapture
//! ```
//!
//! # Output
//!
//! As `tests/it/history.rs` (one summary line; on failure a panic with, per kind of finding,
//! the seed, the history, the trace of a replay and the finding), plus the full failing
//! history: on real time a replay is not exact, so shrinking is best-effort (a deletion
//! is kept only when the replay fails the same way; all findings share a 40 s budget),
//! and a finding that did not come back on replay is reported unshrunk.
//!
//! # Setup
//!
//! [`WORKERS`] threads each run one history at a time, each on its own current-thread
//! runtime and its own Redis database (`SELECT`ed by the URL), with 2–3 `RedisBackend`s
//! (separate connections, as separate replicas) and keys named after the worker and the
//! run, so concurrent histories share nothing but the server. The store's view for check
//! 3 is read with one Lua script (atomic): the lock hash's fields, the permit holders'
//! sorted set and the read holds' lease keys (see the layout table in
//! `src/backend/redis/mod.rs`). Check 4 waits until the database holds nothing but the
//! fencing counters of fenced locks (`redisson_lock_token:{NAME}`, which by design never
//! expire), i.e. until `DBSIZE` equals their number, and no backend has a local waiter.
//!
//! # The nemesis
//!
//! [`NEMESIS_WORKERS`] threads each have a `redis-server` of their own (a crash must not
//! touch another worker's histories) and, per history, a fault proxy that every backend
//! connects through (commands and pub/sub alike); the test's own connection goes to the
//! server directly. The backends answer within [`NEMESIS_TIMING`]'s response timeout.
//! A crash pauses every write (`CLIENT PAUSE WRITE`), reads the holds the server has
//! (`EVAL_RO` of the snapshot script), kills it (SIGKILL) and restarts it empty on its
//! port: those holds are the ones lost with it. A refusal of writes sets
//! `min-replicas-to-write 1` on the server (which has no replica) for a while: every
//! write and every script that writes is answered `NOREPLICAS`, as by a primary short
//! of replicas, a full memory or a restart reading its data back; the lock calls must
//! take it as the outage it is. The residue check reads, per key, every
//! Redis key that names it but its fencing counter.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::time::Duration;

use common::history::{
    Campaign, Finding, Fixture, History, Knobs, Outcome, StoreHold, StoreMode, StoreView, Timing,
    campaign, run,
};
use common::nemesis::{Crashed, Nemesis, NemesisTiming};
use common::proxy::FaultProxy;
use common::redis_server::RedisServer;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use tokio::time::Instant;
use tower_lock::{LockClient, LockKey, LockMode, RedisBackend};

/// Real milliseconds: a 300 ms watchdog lease (renewed every 100 ms), fixed leases of
/// 60–150 ms, and now and then a sleep of 160–220 ms, past a fixed lease.
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

/// Histories run at once (one thread, runtime and database each).
const WORKERS: u8 = 6;

/// Real milliseconds, with a nemesis: a 200 ms response timeout; writes delayed up to
/// 450 ms and held up to 700 ms (past the timeout: the client has given up and
/// reconnected when they land); a 600 ms watchdog lease (renewed every 200 ms, so a
/// renewal may time out and the next still come in time), fixed leases of 100–900 ms,
/// and twins that mix them with the watchdog.
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
        refuse_writes_percent: 15,
    }),
};

/// Histories run at once with a nemesis (one thread, runtime and server each).
const NEMESIS_WORKERS: u8 = 3;

/// Every live hold of each key, read atomically (read-only: `EVAL_RO` runs it while
/// writes are paused). KEYS: per key, the lock hash and the
/// permit holders' zset; ARGV: per key, the read holds' lease-key prefix. Returns per
/// key a list of `S|owner` (exclusive or fair), `W|owner`, `R|owner` (a read hold with a
/// lease key alive), `P|owner` (a permit whose lease has not ended).
const SNAPSHOT: &str = r"
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
for i = 1, #KEYS, 2 do
    local H, E, P = KEYS[i], KEYS[i + 1], ARGV[(i + 1) / 2]
    local holds = {}
    local permits = redis.call('zrange', E, 0, -1, 'withscores')
    for j = 1, #permits, 2 do
        -- As the permit scripts: live through its end's millisecond (score >= now).
        if tonumber(permits[j + 1]) >= now then
            table.insert(holds, 'P|' .. permits[j])
        end
    end
    if #permits == 0 then
        local mode = redis.call('hget', H, 'mode')
        local fields = redis.call('hgetall', H)
        for j = 1, #fields, 2 do
            local f, v = fields[j], fields[j + 1]
            if not mode then
                if string.sub(f, 1, 6) ~= 'holds:' and string.sub(f, 1, 6) ~= 'token:' then
                    table.insert(holds, 'S|' .. f)
                end
            elseif f ~= 'mode' then
                if string.sub(f, -6) == ':write' then
                    table.insert(holds, 'W|' .. string.sub(f, 1, -7))
                else
                    for k = tonumber(v), 1, -1 do
                        if redis.call('exists', P .. ':' .. f .. ':rwlock_timeout:' .. k) == 1 then
                            table.insert(holds, 'R|' .. f)
                            break
                        end
                    end
                end
            end
        end
    end
    table.insert(out, holds)
end
return out
";

/// One history's store: a database of a server, a backend per client.
struct Redis {
    backends: Vec<RedisBackend>,
    clients: Vec<LockClient>,
    keys: Vec<LockKey>,
    /// The test's own connection, straight to the server.
    conn: ConnectionManager,
    snapshot: redis::Script,
    timing: &'static Timing,
    /// With a nemesis: its proxy (which the backends connect through) and the server,
    /// which a crash kills and restarts.
    nemesis: Option<(Nemesis, Arc<tokio::sync::Mutex<RedisServer>>)>,
    /// Refusals of writes begun: the one that ends a refusal is the last one's.
    refusals: Arc<AtomicU64>,
}

/// Sets `min-replicas-to-write` on the test's own connection: with 1 and no replica,
/// the server answers every write (and every script that writes) `NOREPLICAS`. An
/// error is ignored: a server down (a crash) restarts with none.
async fn min_replicas_to_write(conn: &ConnectionManager, n: u8) {
    let _: redis::RedisResult<()> = redis::cmd("CONFIG")
        .arg("SET")
        .arg("min-replicas-to-write")
        .arg(n)
        .query_async(&mut conn.clone())
        .await;
}

impl Redis {
    /// The backends connect to `backend_url`, the test to `url` (the same server).
    async fn connect(
        url: &str,
        backend_url: &str,
        namespace: &str,
        history: &History,
        timing: &'static Timing,
    ) -> Self {
        let client = redis::Client::open(url).unwrap();
        let config = ConnectionManagerConfig::new()
            .set_number_of_retries(2)
            .set_connection_timeout(Some(Duration::from_secs(1)))
            .set_response_timeout(Some(Duration::from_secs(2)));
        let mut conn = ConnectionManager::new_with_config(client, config)
            .await
            .unwrap();
        // The database is this worker's: whatever an earlier run left goes.
        let () = redis::cmd("FLUSHDB").query_async(&mut conn).await.unwrap();
        let mut backends = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..history.clients {
            let backend = build_backend(backend_url, timing).await;
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
        Redis {
            backends,
            clients,
            keys,
            conn,
            snapshot: redis::Script::new(SNAPSHOT),
            timing,
            nemesis: None,
            refusals: Arc::new(AtomicU64::new(0)),
        }
    }

    fn backend(&self) -> &RedisBackend {
        &self.backends[0]
    }

    fn local_waiters(&self) -> usize {
        self.backends
            .iter()
            .flat_map(|b| self.keys.iter().map(move |k| b.local_waiters(k)))
            .sum()
    }

    /// Every key of the database (`SCAN` also drops keys whose TTL has passed).
    async fn all_keys(&self) -> redis::RedisResult<Vec<String>> {
        let mut conn = self.conn.clone();
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await?;
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        Ok(keys)
    }

    /// The snapshot script's keys and arguments for the history's keys.
    fn snapshot_args(&self) -> (Vec<String>, Vec<String>) {
        let backend = self.backend();
        let (mut keys, mut args) = (Vec::new(), Vec::new());
        for key in &self.keys {
            let name = backend.lock_name(key);
            keys.push(name.clone());
            keys.push(backend.permits_name(key));
            args.push(format!("{{{name}}}"));
        }
        (keys, args)
    }

    async fn read_view(&self) -> redis::RedisResult<StoreView> {
        let (keys, args) = self.snapshot_args();
        let mut invocation = self.snapshot.prepare_invoke();
        for key in &keys {
            invocation.key(key);
        }
        for arg in &args {
            invocation.arg(arg);
        }
        let mut conn = self.conn.clone();
        let raw: Vec<Vec<String>> = invocation.invoke_async(&mut conn).await?;
        Ok(parse_view(raw))
    }

    /// What the database keeps for each key, fencing counters aside: each Redis key
    /// that names it, with its TTL and (a hash's) fields.
    async fn read_residue(&self) -> redis::RedisResult<Vec<Vec<String>>> {
        let all = self.all_keys().await?;
        let mut conn = self.conn.clone();
        let mut out = Vec::new();
        for key in &self.keys {
            let name = self.backend().lock_name(key);
            let fence = self.backend().fence_name(key);
            let mut left = Vec::new();
            for k in all.iter().filter(|k| k.contains(&name) && **k != fence) {
                let (kind, pttl): (String, i64) = redis::pipe()
                    .cmd("TYPE")
                    .arg(k)
                    .cmd("PTTL")
                    .arg(k)
                    .query_async(&mut conn)
                    .await?;
                let fields: Vec<String> = match kind.as_str() {
                    "hash" => redis::cmd("HKEYS").arg(k).query_async(&mut conn).await?,
                    "zset" => {
                        redis::cmd("ZRANGE")
                            .arg(k)
                            .arg(0)
                            .arg(-1)
                            .query_async(&mut conn)
                            .await?
                    }
                    "list" => {
                        redis::cmd("LRANGE")
                            .arg(k)
                            .arg(0)
                            .arg(-1)
                            .query_async(&mut conn)
                            .await?
                    }
                    _ => Vec::new(),
                };
                left.push(format!(
                    "{k} ({kind}, pttl {pttl}ms) [ {} ]",
                    fields.join(" ")
                ));
            }
            out.push(left);
        }
        Ok(out)
    }
}

/// A backend for `url` with `timing`'s settings. With a nemesis, its short response
/// timeout can run out while the machine is busy before any fault has begun: a build
/// that fails is tried again, a few times.
async fn build_backend(url: &str, timing: &Timing) -> RedisBackend {
    let mut tries = 0;
    loop {
        let mut builder = RedisBackend::builder(url).waiter_timeout(timing.waiter_timeout());
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

fn parse_view(raw: Vec<Vec<String>>) -> StoreView {
    raw.into_iter()
        .map(|holds| {
            holds
                .into_iter()
                .map(|h| {
                    let (tag, owner) = h.split_once('|').unwrap();
                    let mode = match tag {
                        "S" => StoreMode::Sole,
                        "W" => StoreMode::Exact(LockMode::Write),
                        "R" => StoreMode::Exact(LockMode::Read),
                        _ => StoreMode::Exact(LockMode::Permits {
                            max: common::history::PERMITS.try_into().unwrap(),
                        }),
                    };
                    StoreHold {
                        owner: owner.to_owned(),
                        mode,
                    }
                })
                .collect()
        })
        .collect()
}

impl Fixture for Redis {
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
        // Replies and releases need a round trip, not just a turn of the scheduler.
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    async fn view(&self) -> Option<StoreView> {
        match self.read_view().await {
            Ok(view) => Some(view),
            // Right after a crash the connection may still be on its way back.
            Err(_) if self.nemesis.is_some() => None,
            Err(e) => panic!("reading the store's holds: {e}"),
        }
    }

    async fn drained(&self) -> Result<(), (Finding, String)> {
        let fences: Vec<String> = self
            .keys
            .iter()
            .map(|k| self.backend().fence_name(k))
            .collect();
        // Whatever a cancelled attempt may have left runs out with its lease.
        let deadline = Instant::now()
            + self
                .timing
                .residue_bound()
                .unwrap_or(self.timing.beyond_every_lease())
            + Duration::from_secs(1);
        loop {
            let mut conn = self.conn.clone();
            let read = async {
                let keys = self.all_keys().await?;
                let dbsize: usize = redis::cmd("DBSIZE").query_async(&mut conn).await?;
                Ok::<_, redis::RedisError>((keys, dbsize))
            };
            if let Ok((keys, dbsize)) = read.await {
                let counters = keys.iter().filter(|k| fences.contains(k)).count();
                let left: Vec<&String> = keys.iter().filter(|k| !fences.contains(k)).collect();
                let waiters = self.local_waiters();
                if dbsize == counters && waiters == 0 {
                    return Ok(());
                }
                if Instant::now() >= deadline {
                    return Err((
                        Finding::ResidueAfterLeases,
                        format!(
                            "DBSIZE {dbsize} with {counters} fencing counters (which never expire); \
                             left: {left:?}; local waiters: {waiters}"
                        ),
                    ));
                }
            } else if Instant::now() >= deadline {
                panic!("the store could not be read to check that it drained");
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    fn nemesis(&self) -> Option<&Nemesis> {
        self.nemesis.as_ref().map(|(n, _)| n)
    }

    async fn refuse_writes(&self, for_: Duration) {
        let mine = self.refusals.fetch_add(1, Ordering::SeqCst) + 1;
        min_replicas_to_write(&self.conn, 1).await;
        let (conn, refusals) = (self.conn.clone(), Arc::clone(&self.refusals));
        tokio::spawn(async move {
            tokio::time::sleep(for_).await;
            // Unless a later refusal took over.
            if refusals.load(Ordering::SeqCst) == mine {
                min_replicas_to_write(&conn, 0).await;
            }
        });
    }

    async fn accept_writes(&self) {
        self.refusals.fetch_add(1, Ordering::SeqCst);
        min_replicas_to_write(&self.conn, 0).await;
    }

    /// Pauses every write, reads the holds (they are what the crash loses), kills the
    /// server, and restarts it empty after `down`.
    async fn crash(&self, down: Duration) -> Crashed {
        let (_, server) = self.nemesis.as_ref().expect("a crash needs a nemesis");
        let mut server = server.lock().await;
        let mut conn = self.conn.clone();
        let () = redis::cmd("CLIENT")
            .arg("PAUSE")
            .arg(60_000)
            .arg("WRITE")
            .query_async(&mut conn)
            .await
            .expect("pause the server's writes before the crash");
        let (keys, args) = self.snapshot_args();
        let raw: Vec<Vec<String>> = redis::cmd("EVAL_RO")
            .arg(SNAPSHOT)
            .arg(keys.len())
            .arg(&keys)
            .arg(&args)
            .query_async(&mut conn)
            .await
            .expect("read the holds the crash loses");
        server.kill();
        let killed_at = Instant::now();
        let lost = parse_view(raw)
            .into_iter()
            .flatten()
            .map(|h| h.owner)
            .collect();
        tokio::time::sleep(down).await;
        server.restart().await;
        Crashed { killed_at, lost }
    }

    async fn residue(&self) -> Option<Vec<Vec<String>>> {
        self.read_residue().await.ok()
    }
}

/// Runs histories for one worker thread: its own database, a fresh runtime, fresh
/// connections and fresh key names per run.
struct Worker {
    url: String,
    db: u8,
    runs: u64,
}

impl Worker {
    fn run(&mut self, history: &History) -> Outcome {
        self.runs += 1;
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let url = format!("{}/{}", self.url, self.db);
        let namespace = format!("w{}r{}", self.db, self.runs);
        runtime.block_on(async {
            let store = Redis::connect(&url, &url, &namespace, history, &TIMING).await;
            run(&store, history).await
        })
    }
}

#[test]
fn random_histories_keep_the_oracle_on_redis() {
    let server = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(RedisServer::start());
    let url = server.url();
    // Databases 1..=WORKERS for the search, the next ones for shrinking.
    let next_db = AtomicU8::new(1);
    campaign(
        Campaign {
            name: "redis",
            knobs: Knobs::from_env(300, 30),
            timing: TIMING,
            workers: usize::from(WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --test it history_redis::random_histories",
        },
        || {
            let mut worker = Worker {
                url: url.clone(),
                db: next_db.fetch_add(1, Ordering::Relaxed).min(15),
                runs: 0,
            };
            move |history: &History| worker.run(history)
        },
    );
    drop(server);
}

/// Runs histories with a nemesis for one worker thread: a server of its own (a crash
/// must not touch another worker's histories), and per run a fresh runtime, a fresh
/// proxy, fresh connections and fresh key names.
struct NemesisWorker {
    server: Arc<tokio::sync::Mutex<RedisServer>>,
    url: String,
    port: u16,
    id: u8,
    runs: u64,
}

impl NemesisWorker {
    fn new(id: u8) -> Self {
        let server = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(RedisServer::start());
        NemesisWorker {
            url: server.url(),
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
            let proxy = FaultProxy::start(([127, 0, 0, 1], self.port).into()).await;
            let via_proxy = format!("redis://127.0.0.1:{}", proxy.port());
            let mut store =
                Redis::connect(&self.url, &via_proxy, &namespace, history, &NEMESIS_TIMING).await;
            // The server is this worker's for every history: none begins refusing.
            min_replicas_to_write(&store.conn, 0).await;
            let patterns = store
                .keys
                .iter()
                .map(|k| k.as_str().as_bytes().to_vec())
                .collect();
            let nemesis = Nemesis::new(proxy, &NEMESIS_TIMING, patterns);
            store.nemesis = Some((nemesis, Arc::clone(&self.server)));
            run(&store, history).await
        })
    }
}

/// The history checker with a nemesis on Redis: see the module docs. A sample of
/// seeds in the suite; `HISTORY_COUNT` runs more.
#[test]
fn nemesis_redis() {
    let next = AtomicU8::new(0);
    campaign(
        Campaign {
            name: "redis, nemesis",
            knobs: Knobs::from_env(24, 40),
            timing: NEMESIS_TIMING,
            workers: usize::from(NEMESIS_WORKERS),
            exact: false,
            shrink_budget: Duration::from_secs(40),
            rerun: "cargo test --all-features --test it history_redis::nemesis_redis",
        },
        || {
            let mut worker = NemesisWorker::new(next.fetch_add(1, Ordering::Relaxed));
            move |history: &History| worker.run(history)
        },
    );
}
