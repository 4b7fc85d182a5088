//! The seeded history checker (`common/history.rs`) against the Redis backend: a real
//! `redis-server` started by the test, real time, a few hundred random histories run
//! several at a time, each checked by the oracle after every step.
//!
//! # Knobs (environment)
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `HISTORY_SEED` | – | run exactly this seed (decimal or `0x` hex) |
//! | `HISTORY_COUNT` | 300 | run seeds `0..HISTORY_COUNT` |
//! | `HISTORY_LEN` | 30 | ops per history |
//!
//! ```text
//! cargo test --test history_redis
//! HISTORY_SEED=17 cargo test --test history_redis -- --nocapture
//! ```
//!
//! # Output
//!
//! As `tests/history.rs` (one summary line; on failure a panic with, per kind of finding,
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

#![cfg(feature = "redis")]

mod common;

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use common::history::{
    Campaign, Finding, Fixture, History, Knobs, Outcome, StoreHold, StoreMode, StoreView, Timing,
    campaign, run,
};
use common::redis_server::RedisServer;
use redis::aio::MultiplexedConnection;
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
};

/// Histories run at once (one thread, runtime and database each).
const WORKERS: u8 = 6;

/// Every live hold of each key, read atomically. KEYS: per key, the lock hash and the
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

/// One history's store: a database of the shared server, a backend per client.
struct Redis {
    backends: Vec<RedisBackend>,
    clients: Vec<LockClient>,
    keys: Vec<LockKey>,
    conn: MultiplexedConnection,
    snapshot: redis::Script,
}

impl Redis {
    async fn connect(url: &str, namespace: &str, history: &History) -> Self {
        let client = redis::Client::open(url).unwrap();
        let mut conn = client.get_multiplexed_async_connection().await.unwrap();
        // The database is this worker's: whatever an earlier run left goes.
        let () = redis::cmd("FLUSHDB").query_async(&mut conn).await.unwrap();
        let mut backends = Vec::new();
        let mut clients = Vec::new();
        for _ in 0..history.clients {
            let backend = RedisBackend::builder(url)
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
        Redis {
            backends,
            clients,
            keys,
            conn,
            snapshot: redis::Script::new(SNAPSHOT),
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
    async fn all_keys(&self) -> Vec<String> {
        let mut conn = self.conn.clone();
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .unwrap();
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        keys
    }
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

    async fn view(&self) -> StoreView {
        let backend = self.backend();
        let mut invocation = self.snapshot.prepare_invoke();
        for key in &self.keys {
            let name = backend.lock_name(key);
            invocation.key(&name).key(backend.permits_name(key));
            invocation.arg(format!("{{{name}}}"));
        }
        let mut conn = self.conn.clone();
        let raw: Vec<Vec<String>> = invocation.invoke_async(&mut conn).await.unwrap();
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

    async fn drained(&self) -> Result<(), (Finding, String)> {
        let fences: Vec<String> = self
            .keys
            .iter()
            .map(|k| self.backend().fence_name(k))
            .collect();
        // Whatever a cancelled attempt may have left runs out with its lease.
        let deadline = Instant::now() + TIMING.beyond_every_lease() + Duration::from_secs(1);
        loop {
            let keys = self.all_keys().await;
            let mut conn = self.conn.clone();
            let dbsize: usize = redis::cmd("DBSIZE").query_async(&mut conn).await.unwrap();
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
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
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
            let store = Redis::connect(&url, &namespace, history).await;
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
            rerun: "cargo test --test history_redis",
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
