//! The benchmark: prints one JSON line per run, in the format the peer libraries' own
//! benchmarks print, so tower-lock's numbers sit next to theirs.
//!
//! ```sh
//! cargo run --release --example bench -- --url redis://127.0.0.1:6379 \
//!     --workers 32 --seconds 10 --workload w1 [--handoff] [--backend redis|memory] \
//!     [--kind lock|fair|read|write|permits] [--impl tower-lock|baseline|safe-baseline] \
//!     [--lease-ms L]
//! cargo run --release --example bench -- --url postgres://root@127.0.0.1:5432/bench \
//!     --seconds 10 --workload pg
//! cargo run --release --example bench -- --url mysql://root@127.0.0.1:3306/test \
//!     --seconds 4 --workload mysql [--wake-poll-ms 2]
//! cargo run --release --features zookeeper --example bench -- \
//!     --url zk://127.0.0.1:2181 --seconds 4 --workload zk
//! cargo run --release --example bench -- --workload w5 --backend memory --impl baseline
//! cargo run --release --example bench -- --url redis://127.0.0.1:6379 --workload w6 \
//!     --backend redis [--connections 64]
//! ```
//!
//! The backend follows `--url`: a `postgres://` (or `postgresql://`) URL measures
//! [`PostgresBackend`] (on a pool of one connection per worker, each kept by the
//! backend between statements, plus two for the listener and the other statements,
//! without `test_before_acquire`) and the lines carry `"backend":"postgres"`; a
//! `mysql://` URL measures [`MySqlBackend`] (on a pool of one connection per worker and
//! one more, without `test_before_acquire`, plus the backend's listening connection),
//! `"backend":"mysql"`; a `zk://host:port[,host:port][/chroot]` URL (feature
//! `zookeeper`) measures [`ZooKeeperBackend`](tower_lock::ZooKeeperBackend) (one
//! session the workers share, or one each with `--backend-per-worker`),
//! `"backend":"zookeeper"`; `--backend memory` measures the in-process store.
//!
//! On MySQL/MariaDB every run works in a scratch database of its own,
//! `tower_lock_bench_<pid>_<random>`, created on the server of `--url` (whose own
//! database is left alone) and dropped when the run ends, failed or not (an interrupted
//! run leaves it behind: drop it by that name).
//!
//! On ZooKeeper every run works under a scratch node of its own, the same way
//! (`examples/bench/zk.rs` says where, and how round trips are counted).
//!
//! Workloads:
//!
//! - `w1`: each worker locks its own key; lock + unlock in a loop (throughput, latency).
//!   `--impl baseline` runs the hand-rolled reference instead: on Redis `SET key owner
//!   NX PX` and a Lua compare-and-delete on a multiplexed connection; on PostgreSQL
//!   `pg_advisory_lock(hashtext(key))` and `pg_advisory_unlock` (session advisory locks)
//!   on a connection of each worker's own; on MySQL `GET_LOCK(name, 30)` and
//!   `RELEASE_LOCK(name)` (user locks, owned by the session) on a pooled connection of
//!   each worker's own, names prefixed with the scratch database's (user locks are
//!   server-wide). `--impl safe-baseline` (Redis) sends the
//!   baseline's `SET` through `lua/bench_safe_acquire.lua`, which refuses it once the
//!   server's clock has passed a deadline one second after it was sent: a rule
//!   tower-lock keeps and the plain baseline does not (a `SET` delayed past its
//!   sender's timeout takes a lock nobody holds). On PostgreSQL the lines add what the
//!   server spent per cycle: `pg_cpu_us_per_cycle` (the CPU time of the local `postgres`
//!   processes, from `/proc`; `null` when the server is not on this machine),
//!   `pg_write_xacts_per_cycle` (transaction ids assigned: each is a commit that
//!   writes) and `pg_wal_bytes_per_cycle`. On MySQL they add, from `SHOW GLOBAL STATUS`
//!   deltas over the run (server-wide: another client's work counts too),
//!   `mysql_fsyncs_per_cycle` (`Innodb_data_fsyncs`: with
//!   `innodb_flush_log_at_trx_commit = 1`, a commit's log flush, shared by the commits
//!   of a group), `mysql_log_bytes_per_cycle` (`Innodb_os_log_written`), and
//!   `mysql_cpu_us_per_cycle` (the local `mariadbd` or `mysqld` processes, from `/proc`).
//!   On ZooKeeper `--impl baseline` is a bare lock in Curator's layout on the
//!   `zookeeper-client` crate: `Client::lock` with `LockPrefix::new_curator(dir,
//!   "lock-")` (its directory made as a container node if missing), released by
//!   `LockClient::delete` of its own node, awaited, then dropped (the drop sends one
//!   more delete in the background, which finds nothing). The lines add
//!   `zk_packets_per_cycle`: the requests the servers received per cycle (`mntr`'s
//!   `zk_packets_received`). `--fresh-keys` (ZooKeeper): a new key every cycle, so each
//!   cycle also makes its lock's directory. `--backend-per-worker`: each worker on a
//!   backend (a session) of its own, for the baseline too on ZooKeeper.
//! - `w2`: all workers on one key; each iteration acquires, does a non-atomic
//!   `GET counter` + `SET counter+1` on a second connection, and releases. `--handoff`:
//!   after releasing, a worker sits out until another worker has acquired, so every
//!   transition is a real handoff. Reports waits, handoff latency, fairness, and the
//!   safety counters `lost_updates` and `overlaps` (both must be 0). On PostgreSQL the
//!   counter is a row of `bench_counter`, read with a `SELECT` and written with an
//!   `UPDATE` through a pool of its own (the field keeps its name, `redis_counter`), and
//!   `--impl baseline` holds the advisory lock on each worker's own connection instead.
//!   Every PostgreSQL run starts with a `VACUUM` of the database, so that no run pays
//!   for the dead rows of the ones before it. On MySQL the counter is in the process:
//!   read, a `yield_now` (so that another task holding the lock would run between the
//!   read and the write), written (a row would add a commit, and its fsync, to every
//!   hold); `--impl baseline` holds `GET_LOCK` on each worker's own connection; the
//!   lines add `wake_poll_ms`. On ZooKeeper the counter is in the process too, and
//!   `--impl baseline` holds the bare Curator-layout lock, on one session the workers
//!   share (or one each). `--backend-per-worker`: each worker on a backend of its
//!   own (its own pool and listener; on ZooKeeper its own session), as workers in
//!   separate processes are: a release then reaches the next holder through the
//!   listener's poll (`--wake-poll-ms`), not at once as within one backend.
//! - `w3`: `--waiters` (default 200) tasks on one key until `--handoffs` (default 1,000)
//!   handoffs: Redis commands per handoff (from `INFO commandstats` deltas) and client CPU.
//! - `w4`: `--locks` (default 10,000) held locks with the watchdog for 3 renewal periods
//!   (`--watchdog-ms`, default 3,000): Redis commands and client round trips per period.
//! - `w5`: an axum hello-world with 64 keep-alive connections, each request with its own
//!   key, with `--backend none` (no layer), `noop` (a tower layer that does nothing: what
//!   axum costs for any route layer), `memory` or `redis`: requests/s and latency.
//!   `--impl baseline` (with `memory` or `redis`) runs the peer an adopter writes instead
//!   of `LockLayer`: an `axum::middleware::from_fn_with_state` that locks the request's
//!   key, waits for it as long as `LockLayer`'s default `max_wait` (5 s) and then answers
//!   `429 Too Many Requests` with `Retry-After: 1`, as `LockLayer` does by default, and
//!   releases before handing the response on. In memory the lock is a per-key
//!   `tokio::sync::Mutex` in a `std::sync::Mutex<HashMap>`, each entry removed once
//!   nobody holds or waits for it (`"peer":"mutex-map-baseline"`); on Redis it is the
//!   w1 baseline, `SET key owner NX PX` and the Lua compare-and-delete on one multiplexed
//!   connection, polled every 50 ms while busy (`"peer":"redis-setnx-baseline"`).
//!   `--impl safe-baseline` sends that `SET` through `lua/bench_safe_acquire.lua`, with
//!   tower-lock's late-write rule (`"peer":"redis-setnx-deadline-baseline"`).
//! - `w6`: an `IdempotencyLayer` on `POST /orders/{id}` (a handler that reads the body
//!   and answers `201`), `--connections` (default 64) keep-alive connections, one
//!   caller, with `--backend memory` or `redis`, beside the same route without the layer
//!   in the same run (`--backend none` runs only that): two cases, one line each.
//!   `first`: every request a new `Idempotency-Key` (the handler runs and its response
//!   is stored; the layer's record quotas are raised so that none is refused). `replay`:
//!   1,000 keys stored by a warm-up, then requests cycling through them, each answered
//!   from the store (an answer without `Idempotent-Replayed: true` is an error).
//!   `round_trips_per_request`: in memory the calls that reach the store, counted
//!   through `backend::Intercepted`; on Redis the client-issued commands from
//!   `INFO commandstats` deltas, plus the replay reads (`HGET`, a name scripts also
//!   call, so the commandstats count leaves it out) counted through the same intercept.
//!   Records live 10 minutes, under a key prefix of the run's own.
//!
//! - `all`: the whole suite in one run, one JSON line per measurement: redis-benchmark's
//!   ceilings for tower-lock's own acquire and release scripts (`-c 1 -P 1` and
//!   `-c 32 -P 16`, when `redis-benchmark` is on `PATH`), w1 with 1 and 32 workers for
//!   tower-lock, the baseline and the safe baseline, w2 for the plain and the fair
//!   lock, w2h, w3 at 20 and 200 waiters, w4, w5 for each layer at 64 connections and
//!   at 1 (with the peer beside `memory` and `redis`), and w6 for both cases in memory
//!   and on Redis. The `ratios` line then has, for each, `w5x64_memory_req_per_s`
//!   (`LockLayer` ÷ no layer), `w5x64_memory_req_per_s_vs_peer` (`LockLayer` ÷ the
//!   peer), `w5x64_memory_peer_req_per_s` (the peer ÷ no layer), and
//!   `w6_memory_first_req_per_s` (÷ no layer) and `w6_memory_first_round_trips_per_request`.
//!   `--chart F.svg` draws the handoff-latency distributions of w2 and w2h.
//! - `mysql`: the MySQL/MariaDB suite in one run (`--url mysql://...`): w1 with 1 and
//!   32 workers, then w2 with 8 workers on one backend, beside the `GET_LOCK` baseline,
//!   and w2 again with each worker on a backend of its own (`--backend-per-worker`), then
//!   a `ratios` line (tower-lock / baseline).
//! - `zk`: the ZooKeeper suite in one run (`--url zk://...`, feature `zookeeper`), each
//!   measurement for tower-lock and then the bare Curator-layout baseline: w1 with 1 and
//!   32 workers on one session, with 32 on a session each, and with 1 and 32 on fresh
//!   keys; w2 with 8 workers on one session, then on a session each; then a `ratios`
//!   line (tower-lock / baseline, `zk_packets_per_cycle` included, and the machine's
//!   1-minute load average before and after the suite).
//! - `pg`: the PostgreSQL suite in one run (`--url postgres://...`): w1 with 1 and 32
//!   workers (and again with fast grants, `--fast-grants-ms`, default 30 s), w2 and w2h
//!   with 8 (and again with `--hand-over`), each for tower-lock and the advisory-lock
//!   baseline, then a `ratios` line (tower-lock / baseline).
//!
//! Latency percentiles are nearest-rank, read from an HDR histogram (`hdrhistogram`)
//! that keeps three significant digits: exact below 2,048 µs, within 0.1% above.
//! `--help` lists every flag with its default; bad arguments exit 2.
//!
//! Benchmarks are not tests: nothing here asserts a timing.

#[path = "shared/shown.rs"]
mod shown;
#[path = "bench/zk.rs"]
mod zk;
use shown::shown;
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use zk::is_zk;

use bytes::Bytes;
use clap::{CommandFactory, Parser, ValueEnum};
use hdrhistogram::Histogram;
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use serde::Serialize;
use serde::ser::{SerializeMap, Serializer};
use sqlx::mysql::{MySql, MySqlConnection, MySqlPool, MySqlPoolOptions};
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool, PgPoolOptions};
use sqlx::{Connection, Row};
use tower_lock::backend::{
    Acquire, BoxFuture, Intercept, Intercepted, LockBackend, LockRequest, Release, ReplayStore,
    Stored, Subscription,
};
use tower_lock::idempotency::{IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED};
use tower_lock::{
    FencingToken, IdempotencyLayer, Lease, LockClient, LockKey, MemoryBackend, MySqlBackend,
    PostgresBackend, RedisBackend,
};

/// Counts heap allocations (and reallocations) of the whole process, for
/// `allocs_per_request` in w5.
struct CountingAlloc;

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator; only a counter is
// added.
unsafe impl std::alloc::GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { std::alloc::System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: std::alloc::Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { std::alloc::System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: std::alloc::Layout, size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::Relaxed);
        unsafe { std::alloc::System.realloc(ptr, layout, size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: std::alloc::Layout) {
        unsafe { std::alloc::System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;

/// The Redis server's CPU time so far (`used_cpu_user + used_cpu_sys` of `INFO cpu`), in
/// microseconds.
async fn redis_cpu_us(url: &str) -> Result<f64, String> {
    let mut conn = redis_conn(url).await?;
    let info: String = redis::cmd("INFO")
        .arg("cpu")
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(info
        .lines()
        .filter_map(|l| {
            l.strip_prefix("used_cpu_user:")
                .or_else(|| l.strip_prefix("used_cpu_sys:"))
        })
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum::<f64>()
        * 1e6)
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum BackendKind {
    Redis,
    Postgres,
    Mysql,
    Zookeeper,
    Memory,
    None,
    /// w5 only: a tower layer that does nothing, on the same route: what axum itself
    /// costs per request for any route layer (it boxes the layered service and its
    /// future), the floor under the lock layer's own cost.
    Noop,
}

impl BackendKind {
    /// The name the JSON lines carry.
    fn name(self) -> &'static str {
        match self {
            BackendKind::Redis => "redis",
            BackendKind::Postgres => "postgres",
            BackendKind::Mysql => "mysql",
            BackendKind::Zookeeper => "zookeeper",
            BackendKind::Memory => "memory",
            BackendKind::None => "none",
            BackendKind::Noop => "noop",
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Workload {
    W1,
    W2,
    W3,
    W4,
    W5,
    W6,
    All,
    /// The PostgreSQL suite.
    Pg,
    /// The MySQL/MariaDB suite.
    Mysql,
    /// The ZooKeeper suite.
    Zk,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum LockKind {
    Lock,
    Fair,
    /// A read-write lock's read side.
    Read,
    /// A read-write lock's write side.
    Write,
    /// A permit of [`PERMITS`] on the key (Redisson's `RPermitExpirableSemaphore`).
    Permits,
}

/// How many permits a `--kind permits` key has.
const PERMITS: u32 = 8;

#[derive(Clone, Copy, PartialEq, Eq, Debug, ValueEnum)]
enum Impl {
    TowerLock,
    Baseline,
    /// The baseline with its `SET NX PX` refused past a deadline (Redis, w1).
    SafeBaseline,
}

/// The benchmark: one JSON line per run (see the module docs for the workloads).
#[derive(Clone, Parser)]
#[command(
    name = "bench",
    args_override_self = true,
    allow_negative_numbers = true
)]
struct Args {
    /// The Redis server, the PostgreSQL database (`postgres://...`), the MySQL server
    /// (`mysql://...`; the run works in a scratch database of its own), or the ZooKeeper
    /// ensemble (`zk://host:port[,host:port][/chroot]`; the run works under a scratch
    /// node of its own).
    #[arg(long, value_name = "URL", default_value = "redis://127.0.0.1:6379")]
    url: String,
    /// Concurrent workers (w1, w2).
    #[arg(long, value_name = "W", default_value_t = 8)]
    workers: usize,
    /// How long each run lasts (w1, w2, w5, w6).
    #[arg(long, value_name = "S", default_value_t = 5.0)]
    seconds: f64,
    /// What to measure.
    #[arg(long, value_enum, default_value_t = Workload::W1)]
    workload: Workload,
    /// w2: after releasing, sit out until another worker has acquired.
    #[arg(long)]
    handoff: bool,
    /// Where the locks live (default: what `--url` is); `none` (w5, w6) runs without
    /// the layer, `noop` (w5 only) with a layer that does nothing.
    #[arg(long = "backend", value_name = "BACKEND", value_enum)]
    backend_flag: Option<BackendKind>,
    /// `--backend`, or what `--url` is.
    #[arg(skip = BackendKind::Redis)]
    backend: BackendKind,
    /// Which lock.
    #[arg(long, value_enum, default_value_t = LockKind::Lock)]
    kind: LockKind,
    /// `baseline` runs the hand-rolled reference: SET NX PX (w1) on Redis, advisory
    /// locks (w1, w2) on PostgreSQL, a middleware of its own instead of `LockLayer`
    /// (w5, memory or Redis); `safe-baseline` the Redis one with its SET refused past a
    /// deadline (w1).
    #[arg(long = "impl", value_name = "IMPL", value_enum, default_value_t = Impl::TowerLock)]
    implementation: Impl,
    /// A fixed lease in milliseconds (default: the watchdog).
    #[arg(long = "lease-ms", value_name = "L", value_parser = millis)]
    lease: Option<Duration>,
    /// w3: tasks waiting on the key.
    #[arg(long, value_name = "N", default_value_t = 200)]
    waiters: usize,
    /// w3: handoffs to measure.
    #[arg(long, value_name = "N", default_value_t = 1000)]
    handoffs: u64,
    /// w4: locks held.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    locks: usize,
    /// w4: the watchdog lease in milliseconds.
    #[arg(long = "watchdog-ms", value_name = "L", value_parser = millis, default_value = "3000")]
    watchdog: Duration,
    /// w5, w6: keep-alive connections.
    #[arg(long, value_name = "N", default_value_t = 64)]
    connections: usize,
    /// With `--workload all`: draw the handoff-latency distributions of w2 and w2h here.
    #[arg(long, value_name = "FILE.svg")]
    chart: Option<String>,
    /// PostgreSQL: exclusive grants with leases up to L ms commit without waiting for
    /// the disk (`PostgresBackendBuilder::fast_grants`).
    #[arg(long = "fast-grants-ms", value_name = "L", value_parser = millis)]
    fast_grants: Option<Duration>,
    /// PostgreSQL: a release hands the lock to the oldest waiter
    /// (`PostgresBackendBuilder::hand_over`).
    #[arg(long)]
    hand_over: bool,
    /// MySQL: how often a backend's listener reads the release counters while anyone
    /// waits (`MySqlBackendBuilder::wake_poll`; default the backend's, 2 ms).
    #[arg(long = "wake-poll-ms", value_name = "MS", value_parser = fractional_millis)]
    wake_poll: Option<Duration>,
    /// w2 (and w1 on ZooKeeper): each worker on a backend of its own (its own pool and
    /// listener; its own session on ZooKeeper, the baseline's too), as workers in
    /// separate processes are.
    #[arg(long)]
    backend_per_worker: bool,
    /// w1 on ZooKeeper: a new key every cycle, so each cycle also makes its lock's
    /// directory.
    #[arg(long)]
    fresh_keys: bool,
}

fn millis(value: &str) -> Result<Duration, std::num::ParseIntError> {
    value.parse().map(Duration::from_millis)
}

/// Milliseconds with a fraction (`0.5`), at least 1 µs.
fn fractional_millis(value: &str) -> Result<Duration, String> {
    let ms: f64 = value.parse().map_err(|e| format!("{e}"))?;
    if !(0.001..=3_600_000.0).contains(&ms) {
        return Err("between 0.001 and 3,600,000 ms".to_owned());
    }
    Ok(Duration::from_secs_f64(ms / 1000.0))
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

/// The checks that span several flags (clap makes the others).
fn check(a: &Args) -> Result<(), &'static str> {
    let postgres = is_postgres(&a.url);
    if postgres && a.backend == BackendKind::Redis {
        return Err("a postgres:// --url goes with --backend postgres (the default for it)");
    }
    if !postgres && a.backend == BackendKind::Postgres {
        return Err("--backend postgres needs a postgres:// --url");
    }
    let mysql = is_mysql(&a.url);
    if mysql && a.backend != BackendKind::Mysql {
        return Err("a mysql:// --url goes with --backend mysql (the default for it)");
    }
    if !mysql && a.backend == BackendKind::Mysql {
        return Err("--backend mysql needs a mysql:// --url");
    }
    if a.workload == Workload::Pg && a.backend != BackendKind::Postgres {
        return Err("--workload pg needs a postgres:// --url");
    }
    if a.workload == Workload::Mysql && !mysql {
        return Err("--workload mysql needs a mysql:// --url");
    }
    let zk = is_zk(&a.url);
    if zk && !cfg!(feature = "zookeeper") {
        return Err("a zk:// --url needs the `zookeeper` feature (cargo run --features zookeeper)");
    }
    if zk && a.backend != BackendKind::Zookeeper {
        return Err("a zk:// --url goes with --backend zookeeper (the default for it)");
    }
    if !zk && a.backend == BackendKind::Zookeeper {
        return Err("--backend zookeeper needs a zk:// --url");
    }
    if a.workload == Workload::Zk && !zk {
        return Err("--workload zk needs a zk:// --url");
    }
    if zk && !matches!(a.workload, Workload::W1 | Workload::W2 | Workload::Zk) {
        return Err("on ZooKeeper the workloads are w1, w2 and zk (the suite)");
    }
    if a.fresh_keys && !(zk && a.workload == Workload::W1) {
        return Err("--fresh-keys goes with --workload w1 on a zk:// --url");
    }
    if a.workload == Workload::All && a.backend == BackendKind::Postgres {
        return Err("--workload all is the Redis suite; on PostgreSQL run --workload pg");
    }
    if mysql && !matches!(a.workload, Workload::W1 | Workload::W2 | Workload::Mysql) {
        return Err("on MySQL the workloads are w1, w2 and mysql (the suite)");
    }
    if a.wake_poll.is_some() && !mysql {
        return Err("--wake-poll-ms goes with a mysql:// --url");
    }
    if a.backend_per_worker && a.workload != Workload::W2 && !(zk && a.workload == Workload::W1) {
        return Err("--backend-per-worker goes with --workload w2 (and w1 on ZooKeeper)");
    }
    if a.backend_per_worker && a.implementation != Impl::TowerLock && !zk {
        return Err("--backend-per-worker measures tower-lock (and the baseline on ZooKeeper)");
    }
    if a.implementation == Impl::Baseline
        && (postgres || mysql || zk)
        && !matches!(a.workload, Workload::W1 | Workload::W2)
    {
        return Err("--impl baseline exists for w1 and w2 on PostgreSQL, MySQL and ZooKeeper");
    }
    if a.workers == 0 || a.seconds <= 0.0 || a.waiters == 0 || a.locks == 0 || a.connections == 0 {
        return Err("--workers, --seconds, --waiters, --locks and --connections must be positive");
    }
    if a.chart.is_some() && a.workload != Workload::All {
        return Err("--chart goes with --workload all");
    }
    if matches!(a.kind, LockKind::Read | LockKind::Write | LockKind::Permits)
        && a.workload != Workload::W1
    {
        // w2 counts overlaps: shared kinds overlap by design.
        return Err("--kind read, write and permits go with --workload w1");
    }
    let w5_peer =
        a.workload == Workload::W5 && matches!(a.backend, BackendKind::Memory | BackendKind::Redis);
    if a.implementation == Impl::Baseline
        && !postgres
        && !mysql
        && !zk
        && a.workload != Workload::W1
        && !w5_peer
    {
        return Err(
            "--impl baseline exists for w1 on Redis, w5 with --backend memory or redis \
             (w1 and w2 on PostgreSQL, MySQL and ZooKeeper)",
        );
    }
    if a.workload == Workload::W6
        && !matches!(
            a.backend,
            BackendKind::Memory | BackendKind::Redis | BackendKind::None
        )
    {
        return Err("--workload w6 runs with --backend memory, redis or none");
    }
    let safe_workload = a.workload == Workload::W1
        || (a.workload == Workload::W5 && a.backend == BackendKind::Redis);
    if a.implementation == Impl::SafeBaseline && (postgres || mysql || zk || !safe_workload) {
        return Err("--impl safe-baseline exists for w1 and w5 (--backend redis) on Redis only");
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let mut args = Args::parse();
    args.backend = args.backend_flag.unwrap_or(if is_postgres(&args.url) {
        BackendKind::Postgres
    } else if is_mysql(&args.url) {
        BackendKind::Mysql
    } else if is_zk(&args.url) {
        BackendKind::Zookeeper
    } else {
        BackendKind::Redis
    });
    if let Err(message) = check(&args) {
        // Exits 2, as clap does for the errors it finds itself.
        Args::command()
            .error(clap::error::ErrorKind::ArgumentConflict, message)
            .exit();
    }
    let result = if is_mysql(&args.url) {
        in_scratch_database(&args).await
    } else if is_zk(&args.url) {
        in_scratch_node(&args).await
    } else {
        run(&args).await
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("bench: {message}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the workload `args` name.
async fn run(args: &Args) -> Result<(), String> {
    match args.workload {
        Workload::W1 if args.implementation == Impl::SafeBaseline => {
            w1_baseline(args).await.and_then(|l| say(&l))
        }
        Workload::W1 if args.implementation == Impl::Baseline => {
            if is_postgres(&args.url) {
                w1_pg_baseline(args).await.and_then(|l| say(&l))
            } else if is_mysql(&args.url) {
                w1_my_baseline(args).await.and_then(|l| say(&l))
            } else if is_zk(&args.url) {
                w1_zk_baseline(args).await.and_then(|l| say(&l))
            } else {
                w1_baseline(args).await.and_then(|l| say(&l))
            }
        }
        Workload::W1 => w1(args).await.and_then(|l| say(&l)),
        Workload::W2 => w2(args).await.and_then(|l| say(&l)),
        Workload::W3 => w3(args).await.and_then(|l| say(&l)),
        Workload::W4 => w4(args).await.and_then(|l| say(&l)),
        Workload::W5 => w5(args).await.and_then(|l| say(&l)),
        Workload::W6 => w6(args).await,
        Workload::All => all(args).await,
        Workload::Pg => pg_suite(args).await,
        Workload::Mysql => my_suite(args).await,
        Workload::Zk => zk_suite(args).await,
    }
}

/// Prints one JSON line. The line types declare their fields in the order the lines
/// have always had them: `bench/bench-results.jsonl` and the README quote them.
fn say(line: &impl Serialize) -> Result<(), String> {
    let text = serde_json::to_string(line).map_err(|e| format!("printing a line: {e}"))?;
    println!("{text}");
    Ok(())
}

fn peer(args: &Args) -> &'static str {
    match (args.implementation, args.kind) {
        (Impl::Baseline, _) if is_postgres(&args.url) => "pg-advisory-baseline",
        (Impl::Baseline, _) if is_mysql(&args.url) => "mysql-get-lock-baseline",
        (Impl::Baseline, _) if is_zk(&args.url) => "zk-curator-lock-baseline",
        // w5's peer in memory.
        (Impl::Baseline, _) if args.backend == BackendKind::Memory => "mutex-map-baseline",
        (Impl::Baseline, _) => "redis-setnx-baseline",
        (Impl::SafeBaseline, _) => "redis-setnx-deadline-baseline",
        (Impl::TowerLock, LockKind::Fair) => "tower-lock-fair",
        (Impl::TowerLock, LockKind::Lock) => "tower-lock",
        (Impl::TowerLock, LockKind::Read) => "tower-lock-read",
        (Impl::TowerLock, LockKind::Write) => "tower-lock-write",
        (Impl::TowerLock, LockKind::Permits) => "tower-lock-permits",
    }
}

/// Latencies in microseconds, up to an hour (longer ones count as an hour), at three
/// significant digits.
type Latencies = Histogram<u64>;

fn latencies() -> Result<Latencies, String> {
    Histogram::new_with_bounds(1, 3_600_000_000, 3).map_err(|e| format!("histogram: {e}"))
}

/// The nearest-rank `p`th percentile (0 when nothing was recorded).
fn pct(latencies: &Latencies, p: f64) -> u64 {
    latencies.value_at_percentile(p)
}

/// The largest latency recorded (0 when nothing was).
fn max_of(latencies: &Latencies) -> u64 {
    if latencies.is_empty() {
        0
    } else {
        latencies.max()
    }
}

fn micros(d: Duration) -> u64 {
    d.as_micros() as u64
}

async fn redis_conn(url: &str) -> Result<MultiplexedConnection, String> {
    redis::Client::open(url)
        .map_err(|e| e.to_string())?
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))
}

async fn client(args: &Args) -> Result<LockClient, String> {
    // One connection per worker (per connection in w5).
    let size = if args.workload == Workload::W5 {
        args.connections
    } else {
        args.workers
    };
    client_for(args, size).await
}

/// A client on a backend of its own, with connections for `size` workers.
async fn client_for(args: &Args, size: usize) -> Result<LockClient, String> {
    let backend: Arc<dyn LockBackend> = match args.backend {
        BackendKind::Redis => Arc::new(
            RedisBackend::connect(args.url.as_str())
                .await
                .map_err(|e| format!("connecting to {}: {e}", shown(&args.url)))?,
        ),
        BackendKind::Postgres => {
            // A pool of the benchmark's own: every worker may keep its connection, and
            // one more for the other statements (the listener's connection is its own,
            // outside the pool).
            let pool = pg_pool(&args.url, size + 1).await?;
            let mut builder = PostgresBackend::builder(pool)
                .kept_connections(size)
                .hand_over(args.hand_over);
            if let Some(max_lease) = args.fast_grants {
                builder = builder.fast_grants(max_lease);
            }
            Arc::new(
                builder
                    .build()
                    .await
                    .map_err(|e| format!("PostgreSQL locks at {}: {e}", shown(&args.url)))?,
            )
        }
        BackendKind::Mysql => {
            // One more for the sweeps (the listener's connection is its own).
            let pool = my_pool(&args.url, size + 1).await?;
            let mut builder = MySqlBackend::builder(pool);
            if let Some(every) = args.wake_poll {
                builder = builder.wake_poll(every);
            }
            Arc::new(
                builder
                    .build()
                    .await
                    .map_err(|e| format!("MySQL locks at {}: {e}", shown(&args.url)))?,
            )
        }
        #[cfg(feature = "zookeeper")]
        BackendKind::Zookeeper => Arc::new(zk::backend(&args.url).await?),
        #[cfg(not(feature = "zookeeper"))]
        BackendKind::Zookeeper => return Err("ZooKeeper needs the `zookeeper` feature".into()),
        BackendKind::Memory | BackendKind::None | BackendKind::Noop => {
            Arc::new(MemoryBackend::new())
        }
    };
    Ok(LockClient::new(backend))
}

fn lock_for(client: &LockClient, args: &Args, key: String) -> Result<tower_lock::Lock, String> {
    lock_of(client, args.kind, key)
}

fn lock_of(client: &LockClient, kind: LockKind, key: String) -> Result<tower_lock::Lock, String> {
    let lock = match kind {
        LockKind::Lock => client.get_lock(key),
        LockKind::Fair => client.get_fair_lock(key),
        LockKind::Read => client.get_read_write_lock(key).map(|rw| rw.read_lock()),
        LockKind::Write => client.get_read_write_lock(key).map(|rw| rw.write_lock()),
        LockKind::Permits => client.get_permits(key, PERMITS),
    };
    lock.map_err(|e| e.to_string())
}

fn lease(args: &Args) -> Lease {
    args.lease.map_or(Lease::Watchdog, Lease::Fixed)
}

async fn w1(args: &Args) -> Result<W1Line, String> {
    if args.backend == BackendKind::Postgres {
        pg_vacuum(&args.url).await?;
    }
    // One client the workers share, or (--backend-per-worker) one each.
    let mut clients = vec![client(args).await?];
    if args.backend_per_worker {
        for _ in 1..args.workers {
            clients.push(client_for(args, 1).await?);
        }
    }
    let cpu_before = if args.backend == BackendKind::Redis {
        Some(redis_cpu_us(&args.url).await?)
    } else {
        None
    };
    let meter = if args.backend == BackendKind::Postgres {
        Some(PgMeter::start(&args.url).await?)
    } else {
        None
    };
    let my_meter = if args.backend == BackendKind::Mysql {
        Some(MyMeter::start(&args.url).await?)
    } else {
        None
    };
    let zk_meter = if args.backend == BackendKind::Zookeeper {
        Some(zk::Packets::start(&args.url).await)
    } else {
        None
    };
    // Fresh keys carry the run's own tag: no run finds another's keys (or their
    // directories, on ZooKeeper) there already.
    let run_tag = fastrand::u32(..);
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let failures = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let client = clients[w % clients.len()].clone();
        let own = lock_for(&client, args, format!("bench:w1:{w}"))?;
        let (kind, fresh) = (args.kind, args.fresh_keys);
        let lease = lease(args);
        let failures = failures.clone();
        let mut samples = latencies()?;
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let fresh_lock;
                let lock = if fresh {
                    n += 1;
                    match lock_of(&client, kind, format!("bench:w1:{w}:{run_tag:08x}:{n}")) {
                        Ok(lock) => fresh_lock = lock,
                        Err(_) => {
                            failures.fetch_add(1, Ordering::Relaxed);
                            continue;
                        }
                    }
                    &fresh_lock
                } else {
                    &own
                };
                let guard = match lock.try_lock_for(Duration::MAX, lease).await {
                    Ok(g) => g,
                    Err(_) => {
                        failures.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                };
                if guard.unlock().await.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                samples.saturating_record(micros(t0.elapsed()));
            }
            samples
        }));
    }
    let samples = join_samples(tasks).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = match cpu_before {
        Some(before) => Some(redis_cpu_us(&args.url).await? - before),
        None => None,
    };
    let cost = match meter {
        Some(meter) => Some(meter.finish(samples.len()).await?),
        None => None,
    };
    let my_cost = match my_meter {
        Some(meter) => Some(meter.finish(samples.len()).await?),
        None => None,
    };
    let zk_cost = match zk_meter {
        Some(meter) => Some(meter.finish(samples.len()).await),
        None => None,
    };
    let mut line = w1_line(
        args,
        elapsed,
        samples,
        failures.load(Ordering::Relaxed),
        cpu,
    );
    line.pg = cost;
    line.my = my_cost;
    line.zk = zk_cost;
    Ok(line)
}

/// Every worker's latencies, in one histogram.
async fn join_samples(tasks: Vec<tokio::task::JoinHandle<Latencies>>) -> Result<Latencies, String> {
    let mut samples = latencies()?;
    for t in tasks {
        samples
            .add(t.await.map_err(|e| e.to_string())?)
            .map_err(|e| format!("histogram: {e}"))?;
    }
    Ok(samples)
}

/// A w1 line (tower-lock or the baseline).
#[derive(Serialize)]
struct W1Line {
    peer: &'static str,
    lang: &'static str,
    workload: &'static str,
    workers: usize,
    elapsed_s: f64,
    cycles: u64,
    cycles_per_s: f64,
    cycle_p50_us: u64,
    cycle_p99_us: u64,
    release_failures: u64,
    /// `null` without Redis.
    redis_cpu_us_per_cycle: Option<f64>,
    backend: &'static str,
    /// `watchdog` or `<L>ms`.
    lease: String,
    /// PostgreSQL with `--fast-grants-ms`: the longest fast lease, in ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    fast_grants_ms: Option<u128>,
    /// PostgreSQL only: the server's cost per cycle.
    #[serde(flatten)]
    pg: Option<PgCost>,
    /// MySQL only: the server's cost per cycle.
    #[serde(flatten)]
    my: Option<MyCost>,
    /// ZooKeeper only: the requests the servers received per cycle.
    #[serde(flatten)]
    zk: Option<zk::ZkCost>,
    /// With `--backend-per-worker`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    backend_per_worker: bool,
    /// With `--fresh-keys`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    fresh_keys: bool,
}

/// What the PostgreSQL server spent per cycle.
#[derive(Serialize)]
struct PgCost {
    /// `null` when the server is not on this machine.
    pg_cpu_us_per_cycle: Option<f64>,
    pg_write_xacts_per_cycle: f64,
    pg_wal_bytes_per_cycle: f64,
}

fn w1_line(
    args: &Args,
    elapsed: f64,
    samples: Latencies,
    failures: u64,
    redis_cpu_us: Option<f64>,
) -> W1Line {
    let cycles = samples.len();
    let cpu_per_cycle = redis_cpu_us
        .filter(|_| cycles > 0)
        .map(|us| (us / cycles as f64 * 100.0).round() / 100.0);
    W1Line {
        peer: peer(args),
        lang: "rust",
        workload: "w1",
        workers: args.workers,
        elapsed_s: (elapsed * 1000.0).round() / 1000.0,
        cycles,
        cycles_per_s: (cycles as f64 / elapsed).round(),
        cycle_p50_us: pct(&samples, 50.0),
        cycle_p99_us: pct(&samples, 99.0),
        release_failures: failures,
        redis_cpu_us_per_cycle: cpu_per_cycle,
        backend: args.backend.name(),
        lease: args
            .lease
            .map_or("watchdog".to_owned(), |l| format!("{}ms", l.as_millis())),
        fast_grants_ms: args.fast_grants.map(|d| d.as_millis()),
        pg: None,
        my: None,
        zk: None,
        backend_per_worker: args.backend_per_worker,
        fresh_keys: args.fresh_keys,
    }
}

/// The hand-rolled reference: SET NX PX + Lua compare-and-delete on one multiplexed
/// connection (what most Redis lock libraries do, minus their retry loops). With
/// `--impl safe-baseline` the `SET` goes through `lua/bench_safe_acquire.lua`, which
/// refuses it past a deadline on the server's clock, as tower-lock refuses every
/// acquisition that arrives after its sender gave up: what that safety costs a lock
/// with none of tower-lock's other work.
async fn w1_baseline(args: &Args) -> Result<W1Line, String> {
    let mut conn = redis_conn(&args.url).await?;
    let safe = args.implementation == Impl::SafeBaseline;
    // The server's clock at a local instant: each attempt's deadline is one second past
    // the server's time when it is sent (the lower bound of src/backend/clock.rs).
    let (server_us, sampled): (u64, Instant) = {
        let (secs, micros): (u64, u64) = redis::cmd("TIME")
            .query_async(&mut conn)
            .await
            .map_err(|e| format!("reading the server's clock: {e}"))?;
        (secs * 1_000_000 + micros, Instant::now())
    };
    let cpu_before = redis_cpu_us(&args.url).await?;
    let unlock = Arc::new(redis::Script::new(include_str!(
        "../lua/bench_baseline_unlock.lua"
    )));
    let acquire = Arc::new(redis::Script::new(include_str!(
        "../lua/bench_safe_acquire.lua"
    )));
    let ttl_ms = args.lease.map_or(30_000, |l| l.as_millis() as u64);
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let failures = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..args.workers {
        let mut conn = conn.clone();
        let (unlock, acquire) = (unlock.clone(), acquire.clone());
        let failures = failures.clone();
        let mut samples = latencies()?;
        tasks.push(tokio::spawn(async move {
            let key = format!("bench:base:{w}");
            let owner = format!("baseline-{w}");
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let acquired = if safe {
                    let by = server_us + micros(t0.saturating_duration_since(sampled)) + 1_000_000;
                    let taken: redis::RedisResult<i64> = acquire
                        .key(&key)
                        .arg(&owner)
                        .arg(ttl_ms)
                        .arg(by)
                        .invoke_async(&mut conn)
                        .await;
                    matches!(taken, Ok(1))
                } else {
                    let set: redis::RedisResult<Option<String>> = redis::cmd("SET")
                        .arg(&key)
                        .arg(&owner)
                        .arg("NX")
                        .arg("PX")
                        .arg(ttl_ms)
                        .query_async(&mut conn)
                        .await;
                    matches!(set, Ok(Some(_)))
                };
                if !acquired {
                    failures.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                let deleted: redis::RedisResult<i64> =
                    unlock.key(&key).arg(&owner).invoke_async(&mut conn).await;
                if !matches!(deleted, Ok(1)) {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                samples.saturating_record(micros(t0.elapsed()));
            }
            samples
        }));
    }
    let samples = join_samples(tasks).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = redis_cpu_us(&args.url).await? - cpu_before;
    Ok(w1_line(
        args,
        elapsed,
        samples,
        failures.load(Ordering::Relaxed),
        Some(cpu),
    ))
}

/// A session advisory lock on the key's hash: blocks in the server until granted.
const ADVISORY_LOCK: &str = "SELECT pg_advisory_lock(hashtext($1))";
const ADVISORY_UNLOCK: &str = "SELECT pg_advisory_unlock(hashtext($1))";

/// Releases the advisory lock on `key`; `Err` when this session did not hold it.
async fn advisory_unlock(conn: &mut PgConnection, key: &str) -> Result<(), ()> {
    let released: bool = sqlx::query_scalar(ADVISORY_UNLOCK)
        .bind(key)
        .fetch_one(&mut *conn)
        .await
        .map_err(drop)?;
    if released { Ok(()) } else { Err(()) }
}

/// Vacuums the database, so that each run starts from tables without the dead rows of
/// the runs before it, as autovacuum would keep them (each lock cycle leaves a dead row
/// and a dead index entry in the holds table; see `docs/performance.md`). A warning, not
/// an error, when it cannot.
async fn pg_vacuum(url: &str) -> Result<(), String> {
    let mut conn = pg_conn(url).await?;
    if let Err(e) = sqlx::raw_sql("VACUUM").execute(&mut conn).await {
        eprintln!("bench: VACUUM failed, the run starts from the tables as they are: {e}");
    }
    Ok(())
}

async fn pg_conn(url: &str) -> Result<PgConnection, String> {
    PgConnection::connect(url)
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))
}

/// A pool of `size` connections, all of them opened before it is returned (the run
/// should not measure connection set-up).
async fn pg_pool(url: &str, size: usize) -> Result<PgPool, String> {
    let size = u32::try_from(size.max(1)).unwrap_or(u32::MAX);
    let pool = PgPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        // As docs/postgres.md recommends for a pool that carries lock statements: no
        // round trip to test a connection before every statement.
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))?;
    let opened = futures_util::future::join_all((0..size).map(|_| pool.acquire())).await;
    for conn in opened {
        conn.map_err(|e| format!("connecting to {}: {e}", shown(url)))?;
    }
    Ok(pool)
}

/// The PostgreSQL server's counters at the start of a run, to charge the run's cycles
/// with what the server spent on them.
struct PgMeter {
    conn: PgConnection,
    /// CPU ticks per server process; `None` when the server is not on this machine.
    cpu: Option<HashMap<u32, u64>>,
    next_xid: i64,
    wal_lsn: String,
}

/// The next transaction id (each transaction that writes takes one) and the WAL position.
const PG_COUNTERS: &str =
    "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, pg_current_wal_lsn()::text";

impl PgMeter {
    async fn start(url: &str) -> Result<Self, String> {
        let mut conn = pg_conn(url).await?;
        let row = sqlx::query(PG_COUNTERS)
            .fetch_one(&mut conn)
            .await
            .map_err(|e| format!("reading the server's counters: {e}"))?;
        Ok(PgMeter {
            cpu: if is_local(url) {
                server_cpu_ticks(POSTGRES_PROCESSES)
            } else {
                None
            },
            next_xid: row.try_get(0).map_err(|e| e.to_string())?,
            wal_lsn: row.try_get(1).map_err(|e| e.to_string())?,
            conn,
        })
    }

    /// What the server spent per cycle since [`start`](Self::start).
    async fn finish(mut self, cycles: u64) -> Result<PgCost, String> {
        let cpu_us = match &self.cpu {
            Some(before) => {
                server_cpu_ticks(POSTGRES_PROCESSES).map(|after| cpu_used_us(before, &after))
            }
            None => None,
        };
        let row = sqlx::query(
            "SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint, \
                    pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::float8",
        )
        .bind(&self.wal_lsn)
        .fetch_one(&mut self.conn)
        .await
        .map_err(|e| format!("reading the server's counters: {e}"))?;
        let next_xid: i64 = row.try_get(0).map_err(|e| e.to_string())?;
        let wal_bytes: f64 = row.try_get(1).map_err(|e| e.to_string())?;
        let per = |x: f64| per_cycle(x, cycles);
        Ok(PgCost {
            pg_cpu_us_per_cycle: cpu_us.map(per),
            pg_write_xacts_per_cycle: per((next_xid - self.next_xid) as f64),
            pg_wal_bytes_per_cycle: per(wal_bytes),
        })
    }
}

/// `x / cycles` to two decimals (0 without cycles).
fn per_cycle(x: f64, cycles: u64) -> f64 {
    if cycles == 0 {
        0.0
    } else {
        (x / cycles as f64 * 100.0).round() / 100.0
    }
}

/// Whether the URL's host is this machine (so the server's processes are visible).
fn is_local(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    let authority = rest.split(['/', '?']).next().unwrap_or(rest);
    let host = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let host = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(v6),
        None => host.split(':').next().unwrap_or(host),
    };
    matches!(host, "127.0.0.1" | "localhost" | "::1" | "")
}

/// The PostgreSQL server's processes.
const POSTGRES_PROCESSES: &[&str] = &["postgres"];

/// The MySQL or MariaDB server's process (one, with a thread per connection).
const MYSQL_PROCESSES: &[&str] = &["mariadbd", "mysqld"];

/// The CPU time (user + system, in clock ticks) of every process with one of `names`
/// on this machine, by pid; `None` when there is none to see.
fn server_cpu_ticks(names: &[&str]) -> Option<HashMap<u32, u64>> {
    let mut cpu = HashMap::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        // `pid (comm) state ...`: utime and stime are the 14th and 15th fields.
        let Some((head, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let Some((pid, comm)) = head.split_once(" (") else {
            continue;
        };
        if !names.contains(&comm) {
            continue;
        }
        let fields: Vec<&str> = rest.split_whitespace().collect();
        let field = |n: usize| fields.get(n - 3).and_then(|v| v.parse::<u64>().ok());
        if let (Ok(pid), Some(utime), Some(stime)) = (pid.parse(), field(14), field(15)) {
            cpu.insert(pid, utime + stime);
        }
    }
    (!cpu.is_empty()).then_some(cpu)
}

/// The CPU time the server processes used between two readings, in microseconds: what
/// each process alive at the end used since the start (or since it started). A process
/// that exited in between is not counted, so keep the run's connections open until the
/// second reading.
fn cpu_used_us(before: &HashMap<u32, u64>, after: &HashMap<u32, u64>) -> f64 {
    // SAFETY: sysconf only reads a configuration value.
    let ticks_per_s = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1);
    let ticks: u64 = after
        .iter()
        .map(|(pid, &now)| now.saturating_sub(before.get(pid).copied().unwrap_or(0)))
        .sum();
    ticks as f64 * 1e6 / ticks_per_s as f64
}

/// The PostgreSQL baseline: `pg_advisory_lock` and `pg_advisory_unlock` on a key of the
/// worker's own, on a connection of its own (session advisory locks, what a hand-rolled
/// PostgreSQL lock does).
async fn w1_pg_baseline(args: &Args) -> Result<W1Line, String> {
    pg_vacuum(&args.url).await?;
    let mut conns = Vec::with_capacity(args.workers);
    for _ in 0..args.workers {
        conns.push(pg_conn(&args.url).await?);
    }
    let meter = PgMeter::start(&args.url).await?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let failures = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (w, mut conn) in conns.into_iter().enumerate() {
        let failures = failures.clone();
        let mut samples = latencies()?;
        tasks.push(tokio::spawn(async move {
            let key = format!("bench:base:{w}");
            while Instant::now() < deadline {
                let t0 = Instant::now();
                let locked = sqlx::query(ADVISORY_LOCK)
                    .bind(&key)
                    .execute(&mut conn)
                    .await;
                if locked.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if advisory_unlock(&mut conn, &key).await.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                samples.saturating_record(micros(t0.elapsed()));
            }
            // The connection goes back open: the meter reads its CPU time after the run.
            (samples, conn)
        }));
    }
    let mut samples = latencies()?;
    let mut conns = Vec::with_capacity(args.workers);
    for t in tasks {
        let (worker, conn) = t.await.map_err(|e| e.to_string())?;
        samples.add(worker).map_err(|e| format!("histogram: {e}"))?;
        conns.push(conn);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cost = meter.finish(samples.len()).await?;
    drop(conns);
    let mut line = w1_line(
        args,
        elapsed,
        samples,
        failures.load(Ordering::Relaxed),
        None,
    );
    line.pg = Some(cost);
    Ok(line)
}

/// The MySQL baseline's lock: a user lock, owned by the session that takes it; waits
/// in the server up to 30 s.
const GET_LOCK: &str = "SELECT GET_LOCK(?, 30)";
const RELEASE_LOCK: &str = "SELECT RELEASE_LOCK(?)";

/// `GET_LOCK(name, 30)`: `Err` unless granted (0 after 30 s, NULL on an error).
async fn get_lock(conn: &mut MySqlConnection, name: &str) -> Result<(), ()> {
    let granted: Option<i64> = sqlx::query_scalar(GET_LOCK)
        .bind(name)
        .fetch_one(conn)
        .await
        .map_err(drop)?;
    if granted == Some(1) { Ok(()) } else { Err(()) }
}

/// `RELEASE_LOCK(name)`: `Err` when this session did not hold it.
async fn release_lock(conn: &mut MySqlConnection, name: &str) -> Result<(), ()> {
    let released: Option<i64> = sqlx::query_scalar(RELEASE_LOCK)
        .bind(name)
        .fetch_one(conn)
        .await
        .map_err(drop)?;
    if released == Some(1) { Ok(()) } else { Err(()) }
}

/// A user-lock name for the baseline: user locks are server-wide, so the name starts
/// with the run's scratch database (at most 64 characters in all).
fn user_lock_name(url: &str, what: &str) -> String {
    format!("{}:{what}", url_database(url).1)
}

/// `url` cut around its database: everything before the `/` that starts it, the
/// database (empty when none is named), and the `?...` that follows (or nothing). The
/// host starts after the last `@`, as in [`shown`].
fn url_database(url: &str) -> (&str, &str, &str) {
    let after_scheme = url.find("://").map_or(0, |i| i + "://".len());
    let host = url[after_scheme..]
        .rfind('@')
        .map_or(after_scheme, |i| after_scheme + i + 1);
    let query = url[host..].find('?').map_or(url.len(), |i| host + i);
    let path = url[host..query].find('/').map_or(query, |i| host + i);
    let database = url[path..query].trim_start_matches('/');
    (&url[..path], database, &url[query..])
}

/// `url` with its database replaced by `database`.
fn with_database(url: &str, database: &str) -> String {
    let (head, _, query) = url_database(url);
    format!("{head}/{database}{query}")
}

async fn my_conn(url: &str) -> Result<MySqlConnection, String> {
    MySqlConnection::connect(url)
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))
}

/// A pool of `size` connections, all of them opened before it is returned, without
/// `test_before_acquire` (as `docs/mysql.md` recommends).
async fn my_pool(url: &str, size: usize) -> Result<MySqlPool, String> {
    let size = u32::try_from(size.max(1)).unwrap_or(u32::MAX);
    let pool = MySqlPoolOptions::new()
        .max_connections(size)
        .acquire_timeout(Duration::from_secs(30))
        .test_before_acquire(false)
        .connect(url)
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))?;
    let opened = futures_util::future::join_all((0..size).map(|_| pool.acquire())).await;
    for conn in opened {
        conn.map_err(|e| format!("connecting to {}: {e}", shown(url)))?;
    }
    Ok(pool)
}

/// `size` connections of a pool of their own, each for one worker to keep.
async fn my_connections(url: &str, size: usize) -> Result<Vec<PoolConnection<MySql>>, String> {
    let pool = my_pool(url, size).await?;
    let mut conns = Vec::with_capacity(size);
    for _ in 0..size {
        conns.push(
            pool.acquire()
                .await
                .map_err(|e| format!("connecting to {}: {e}", shown(url)))?,
        );
    }
    Ok(conns)
}

/// Runs the workload in a scratch database of its own on the server of `--url`, and
/// drops the database afterwards, whatever the run's outcome.
async fn in_scratch_database(args: &Args) -> Result<(), String> {
    let name = format!(
        "tower_lock_bench_{}_{:08x}",
        std::process::id(),
        fastrand::u32(..)
    );
    let mut admin = my_conn(&args.url).await?;
    sqlx::raw_sql(&format!("CREATE DATABASE `{name}`"))
        .execute(&mut admin)
        .await
        .map_err(|e| format!("creating the scratch database {name}: {e}"))?;
    drop(admin);
    let mut scratch = args.clone();
    scratch.url = with_database(&args.url, &name);
    let result = run(&scratch).await;
    // A connection of its own: the run's may have failed with the server.
    let dropped = match my_conn(&args.url).await {
        Ok(mut admin) => sqlx::raw_sql(&format!("DROP DATABASE `{name}`"))
            .execute(&mut admin)
            .await
            .map(drop)
            .map_err(|e| e.to_string()),
        Err(e) => Err(e),
    };
    match (result, dropped) {
        (result, Ok(())) => result,
        (Ok(()), Err(e)) => Err(format!("dropping the scratch database {name}: {e}")),
        (Err(run), Err(e)) => Err(format!(
            "{run}; then dropping the scratch database {name}: {e}"
        )),
    }
}

/// Runs the workload under a scratch node of its own on the ensemble of `--url` (given
/// to the run as its chroot), and deletes the node and everything below it afterwards,
/// whatever the run's outcome.
#[cfg(feature = "zookeeper")]
async fn in_scratch_node(args: &Args) -> Result<(), String> {
    let (name, url) = zk::make_scratch(&args.url).await?;
    let mut scratch = args.clone();
    scratch.url = url;
    let result = run(&scratch).await;
    match (result, zk::remove_scratch(&args.url, &name).await) {
        (result, Ok(())) => result,
        (Ok(()), Err(e)) => Err(e),
        (Err(run), Err(e)) => Err(format!("{run}; then {e}")),
    }
}

#[cfg(not(feature = "zookeeper"))]
async fn in_scratch_node(_args: &Args) -> Result<(), String> {
    Err("a zk:// --url needs the `zookeeper` feature".into())
}

/// The ZooKeeper baseline's w1 (`examples/bench/zk.rs`).
async fn w1_zk_baseline(args: &Args) -> Result<W1Line, String> {
    #[cfg(feature = "zookeeper")]
    return zk::w1_baseline(args).await;
    #[cfg(not(feature = "zookeeper"))]
    return Err(format!(
        "{}: needs the `zookeeper` feature",
        shown(&args.url)
    ));
}

/// The MySQL server's counters at the start of a run (server-wide: the work of other
/// clients counts too).
struct MyMeter {
    conn: MySqlConnection,
    /// CPU ticks of the server's process; `None` when it is not on this machine.
    cpu: Option<HashMap<u32, u64>>,
    counters: MyCounters,
}

/// `SHOW GLOBAL STATUS` counters.
struct MyCounters {
    /// `Innodb_data_fsyncs`: every fsync of InnoDB's files, the redo log's included.
    fsyncs: u64,
    /// `Innodb_os_log_written`: redo log bytes.
    log_bytes: u64,
}

/// What the MySQL server spent per cycle.
#[derive(Serialize)]
struct MyCost {
    /// `null` when the server is not on this machine.
    mysql_cpu_us_per_cycle: Option<f64>,
    mysql_fsyncs_per_cycle: f64,
    mysql_log_bytes_per_cycle: f64,
}

impl MyCounters {
    async fn read(conn: &mut MySqlConnection) -> Result<Self, String> {
        let rows = sqlx::raw_sql(
            "SHOW GLOBAL STATUS WHERE Variable_name IN \
             ('Innodb_data_fsyncs', 'Innodb_os_log_written')",
        )
        .fetch_all(conn)
        .await
        .map_err(|e| format!("reading the server's counters: {e}"))?;
        let mut counters = MyCounters {
            fsyncs: 0,
            log_bytes: 0,
        };
        for row in rows {
            let name: String = row.try_get(0).map_err(|e| e.to_string())?;
            let value: String = row.try_get(1).map_err(|e| e.to_string())?;
            let value = value.parse().map_err(|e| format!("{name}: {e}"))?;
            match name.as_str() {
                "Innodb_data_fsyncs" => counters.fsyncs = value,
                "Innodb_os_log_written" => counters.log_bytes = value,
                _ => {}
            }
        }
        Ok(counters)
    }
}

impl MyMeter {
    async fn start(url: &str) -> Result<Self, String> {
        let mut conn = my_conn(url).await?;
        Ok(MyMeter {
            counters: MyCounters::read(&mut conn).await?,
            cpu: if is_local(url) {
                server_cpu_ticks(MYSQL_PROCESSES)
            } else {
                None
            },
            conn,
        })
    }

    /// What the server spent per cycle since [`start`](Self::start).
    async fn finish(mut self, cycles: u64) -> Result<MyCost, String> {
        let cpu_us = match &self.cpu {
            Some(before) => {
                server_cpu_ticks(MYSQL_PROCESSES).map(|after| cpu_used_us(before, &after))
            }
            None => None,
        };
        let now = MyCounters::read(&mut self.conn).await?;
        let per = |x: f64| per_cycle(x, cycles);
        Ok(MyCost {
            mysql_cpu_us_per_cycle: cpu_us.map(per),
            mysql_fsyncs_per_cycle: per(now.fsyncs.saturating_sub(self.counters.fsyncs) as f64),
            mysql_log_bytes_per_cycle: per(
                now.log_bytes.saturating_sub(self.counters.log_bytes) as f64
            ),
        })
    }
}

/// The MySQL baseline: `GET_LOCK` and `RELEASE_LOCK` on a name of the worker's own, on
/// a pooled connection the worker keeps for the run (a user lock belongs to the session
/// that took it, so lock and release must go through one connection).
async fn w1_my_baseline(args: &Args) -> Result<W1Line, String> {
    let conns = my_connections(&args.url, args.workers).await?;
    let meter = MyMeter::start(&args.url).await?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let failures = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (w, mut conn) in conns.into_iter().enumerate() {
        let failures = failures.clone();
        let mut samples = latencies()?;
        let name = user_lock_name(&args.url, &format!("w1:{w}"));
        tasks.push(tokio::spawn(async move {
            while Instant::now() < deadline {
                let t0 = Instant::now();
                if get_lock(&mut conn, &name).await.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                    continue;
                }
                if release_lock(&mut conn, &name).await.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                samples.saturating_record(micros(t0.elapsed()));
            }
            samples
        }));
    }
    let samples = join_samples(tasks).await?;
    let elapsed = started.elapsed().as_secs_f64();
    let cost = meter.finish(samples.len()).await?;
    let mut line = w1_line(
        args,
        elapsed,
        samples,
        failures.load(Ordering::Relaxed),
        None,
    );
    line.my = Some(cost);
    Ok(line)
}

/// One hold of the w2 lock: who, and when it was acquired and released.
struct Hold {
    worker: usize,
    requested: Instant,
    acquired: Instant,
    release_start: Instant,
    release_end: Instant,
}

/// A w2 or w2h line.
#[derive(Serialize)]
struct W2Line {
    peer: &'static str,
    lang: &'static str,
    /// `w2`, or `w2h` with `--handoff`.
    workload: &'static str,
    workers: usize,
    elapsed_s: f64,
    cycles: u64,
    cycles_per_s: f64,
    acq_wait_p50_us: u64,
    acq_wait_p99_us: u64,
    acq_wait_max_us: u64,
    handoffs: u64,
    handoff_p50_us: u64,
    handoff_p99_us: u64,
    handoff_mean_us: f64,
    handoff_from_start_p50_us: u64,
    handoff_from_start_p99_us: u64,
    same_holder_pct: f64,
    per_worker_min: u64,
    per_worker_max: u64,
    redis_counter: u64,
    lost_updates: i64,
    overlaps: u64,
    release_failures: u64,
    backend: &'static str,
    /// PostgreSQL with `--hand-over`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    hand_over: bool,
    /// MySQL, tower-lock: the backend's wake poll, in ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    wake_poll_ms: Option<f64>,
    /// With `--backend-per-worker`.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    backend_per_worker: bool,
    /// ZooKeeper only: the requests the servers received per cycle.
    #[serde(flatten)]
    zk: Option<zk::ZkCost>,
}

async fn w2(args: &Args) -> Result<W2Line, String> {
    w2_with_samples(args).await.map(|(line, _)| line)
}

/// The w2 line and its handoff latencies (for the chart).
async fn w2_with_samples(args: &Args) -> Result<(W2Line, Latencies), String> {
    if is_postgres(&args.url) {
        pg_vacuum(&args.url).await?;
    }
    let counter_conn = Counter::open(&args.url, args.workers).await?;
    let lockers = w2_lockers(args).await?;
    let zk_meter = if args.backend == BackendKind::Zookeeper {
        Some(zk::Packets::start(&args.url).await)
    } else {
        None
    };
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicU64::new(0));
    let failures = Arc::new(AtomicU64::new(0));
    // (acquisition sequence number, worker): for --handoff.
    let (last_tx, last_rx) = tokio::sync::watch::channel((0u64, usize::MAX));
    let last_tx = Arc::new(last_tx);
    let done = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for (w, mut locker) in lockers.into_iter().enumerate() {
        let (inside, overlaps, failures) = (inside.clone(), overlaps.clone(), failures.clone());
        let (last_tx, mut last_rx, done) = (last_tx.clone(), last_rx.clone(), done.clone());
        let mut conn = counter_conn.clone();
        let handoff = args.handoff;
        tasks.push(tokio::spawn(async move {
            let mut holds = Vec::with_capacity(1 << 14);
            while Instant::now() < deadline && !done.load(Ordering::Relaxed) {
                let requested = Instant::now();
                let Ok(guard) = locker.lock().await else {
                    failures.fetch_add(1, Ordering::Relaxed);
                    continue;
                };
                let acquired = Instant::now();
                let mut seq = 0;
                last_tx.send_modify(|(s, who)| {
                    *s += 1;
                    *who = w;
                    seq = *s;
                });
                if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                    overlaps.fetch_add(1, Ordering::Relaxed);
                }
                let value = conn.get().await;
                conn.set(value.unwrap_or(0) + 1).await;
                inside.fetch_sub(1, Ordering::SeqCst);
                let release_start = Instant::now();
                if locker.unlock(guard).await.is_err() {
                    failures.fetch_add(1, Ordering::Relaxed);
                }
                let release_end = Instant::now();
                holds.push(Hold {
                    worker: w,
                    requested,
                    acquired,
                    release_start,
                    release_end,
                });
                if handoff {
                    // Sit out until someone else has acquired after us.
                    let wait = last_rx.wait_for(|(s, who)| *s > seq && *who != w);
                    if tokio::time::timeout_at(deadline.into(), wait)
                        .await
                        .is_err()
                    {
                        break;
                    }
                }
            }
            done.store(true, Ordering::Relaxed);
            holds
        }));
    }
    let mut per_worker = Vec::new();
    let mut holds = Vec::new();
    for t in tasks {
        let h = t.await.map_err(|e| e.to_string())?;
        per_worker.push(h.len() as u64);
        holds.extend(h);
    }
    let elapsed = started.elapsed().as_secs_f64();
    holds.sort_by_key(|h| h.acquired);
    let mut waits = latencies()?;
    for h in &holds {
        waits.saturating_record(micros(h.acquired - h.requested));
    }
    let mut handoffs = latencies()?;
    let mut from_start = latencies()?;
    let mut same = 0u64;
    for pair in holds.windows(2) {
        let (prev, next) = (&pair[0], &pair[1]);
        if prev.worker == next.worker {
            same += 1;
            continue;
        }
        handoffs.saturating_record(micros(
            next.acquired.saturating_duration_since(prev.release_end),
        ));
        from_start.saturating_record(micros(
            next.acquired.saturating_duration_since(prev.release_start),
        ));
    }
    let counter = counter_conn.clone().value().await?;
    let cycles = holds.len() as u64;
    let zk_cost = match zk_meter {
        Some(meter) => Some(meter.finish(cycles).await),
        None => None,
    };
    let transitions = holds.len().saturating_sub(1) as f64;
    let line = W2Line {
        peer: peer(args),
        lang: "rust",
        workload: if args.handoff { "w2h" } else { "w2" },
        workers: args.workers,
        elapsed_s: (elapsed * 1000.0).round() / 1000.0,
        cycles,
        cycles_per_s: (cycles as f64 / elapsed).round(),
        acq_wait_p50_us: pct(&waits, 50.0),
        acq_wait_p99_us: pct(&waits, 99.0),
        acq_wait_max_us: max_of(&waits),
        handoffs: handoffs.len(),
        handoff_p50_us: pct(&handoffs, 50.0),
        handoff_p99_us: pct(&handoffs, 99.0),
        handoff_mean_us: handoffs.mean().round(),
        handoff_from_start_p50_us: pct(&from_start, 50.0),
        handoff_from_start_p99_us: pct(&from_start, 99.0),
        same_holder_pct: if transitions > 0.0 {
            (1000.0 * same as f64 / transitions).round() / 10.0
        } else {
            0.0
        },
        per_worker_min: per_worker.iter().min().copied().unwrap_or(0),
        per_worker_max: per_worker.iter().max().copied().unwrap_or(0),
        redis_counter: counter,
        lost_updates: cycles as i64 - counter as i64,
        overlaps: overlaps.load(Ordering::Relaxed),
        release_failures: failures.load(Ordering::Relaxed),
        backend: args.backend.name(),
        hand_over: args.hand_over,
        wake_poll_ms: (args.backend == BackendKind::Mysql
            && args.implementation == Impl::TowerLock)
            .then(|| {
                let every = args
                    .wake_poll
                    .unwrap_or(tower_lock::backend::mysql::DEFAULT_WAKE_POLL);
                every.as_secs_f64() * 1000.0
            }),
        backend_per_worker: args.backend_per_worker,
        zk: zk_cost,
    };
    Ok((line, handoffs))
}

/// Each w2 worker's lock on the one key: the baseline's on a connection of the worker's
/// own (on ZooKeeper, on a session the workers share or one each), or tower-lock's, on
/// one backend or (`--backend-per-worker`) one each.
async fn w2_lockers(args: &Args) -> Result<Vec<Locker>, String> {
    let mut lockers = Vec::with_capacity(args.workers);
    if args.implementation == Impl::Baseline && is_mysql(&args.url) {
        let name = user_lock_name(&args.url, "w2");
        for conn in my_connections(&args.url, args.workers).await? {
            lockers.push(Locker::UserLock(conn, name.clone()));
        }
    } else if args.implementation == Impl::Baseline && is_zk(&args.url) {
        // One session they share, or one each.
        #[cfg(feature = "zookeeper")]
        {
            let sessions = zk::sessions(args, args.workers).await?;
            for w in 0..args.workers {
                let session = sessions[w % sessions.len()].clone();
                lockers.push(Locker::Curator(zk::CuratorLock::new(session)));
            }
        }
    } else if args.implementation == Impl::Baseline {
        for _ in 0..args.workers {
            lockers.push(Locker::Advisory(pg_conn(&args.url).await?));
        }
    } else if args.backend_per_worker {
        for _ in 0..args.workers {
            let client = client_for(args, 1).await?;
            let lock = lock_for(&client, args, "bench:w2".into())?;
            lockers.push(Locker::Tower(lock, lease(args)));
        }
    } else {
        let client = client(args).await?;
        let lock = lock_for(&client, args, "bench:w2".into())?;
        lockers.resize_with(args.workers, || Locker::Tower(lock.clone(), lease(args)));
    }
    Ok(lockers)
}

/// The counter w2 increments without atomicity (a read, then a write), where `--url`
/// points (in the process on MySQL and ZooKeeper).
#[derive(Clone)]
enum Counter {
    Redis(MultiplexedConnection),
    /// The row `bench:w2:counter` of `bench_counter`.
    Postgres(PgPool),
    /// A value in the process, with a `yield_now` between its read and its write.
    Memory(Arc<AtomicU64>),
}

const COUNTER_KEY: &str = "bench:w2:counter";

impl Counter {
    /// The counter, reset to nothing; `workers` connections on PostgreSQL.
    async fn open(url: &str, workers: usize) -> Result<Self, String> {
        if is_mysql(url) || is_zk(url) {
            return Ok(Counter::Memory(Arc::default()));
        }
        if !is_postgres(url) {
            let mut conn = redis_conn(url).await?;
            let _: () = conn.del(COUNTER_KEY).await.map_err(|e| e.to_string())?;
            return Ok(Counter::Redis(conn));
        }
        let pool = pg_pool(url, workers).await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS bench_counter (key text PRIMARY KEY, value bigint NOT NULL)",
        )
        .execute(&pool)
        .await
        .map_err(|e| format!("creating bench_counter: {e}"))?;
        sqlx::query(
            "INSERT INTO bench_counter (key, value) VALUES ($1, 0) \
             ON CONFLICT (key) DO UPDATE SET value = 0",
        )
        .bind(COUNTER_KEY)
        .execute(&pool)
        .await
        .map_err(|e| format!("resetting the counter: {e}"))?;
        Ok(Counter::Postgres(pool))
    }

    /// The value, `None` when unset or unreadable (the run counts what reaches the store).
    async fn get(&mut self) -> Option<u64> {
        match self {
            Counter::Redis(conn) => conn.get(COUNTER_KEY).await.unwrap_or(None),
            Counter::Postgres(pool) => {
                sqlx::query_scalar::<_, i64>("SELECT value FROM bench_counter WHERE key = $1")
                    .bind(COUNTER_KEY)
                    .fetch_optional(&*pool)
                    .await
                    .ok()
                    .flatten()
                    .and_then(|v| u64::try_from(v).ok())
            }
            Counter::Memory(value) => {
                let read = value.load(Ordering::SeqCst);
                tokio::task::yield_now().await;
                Some(read)
            }
        }
    }

    /// Writes `value`; a failed write shows as a lost update.
    async fn set(&mut self, value: u64) {
        match self {
            Counter::Redis(conn) => {
                let _: redis::RedisResult<()> = conn.set(COUNTER_KEY, value).await;
            }
            Counter::Postgres(pool) => {
                let _ = sqlx::query("UPDATE bench_counter SET value = $2 WHERE key = $1")
                    .bind(COUNTER_KEY)
                    .bind(i64::try_from(value).unwrap_or(i64::MAX))
                    .execute(&*pool)
                    .await;
            }
            Counter::Memory(counter) => counter.store(value, Ordering::SeqCst),
        }
    }

    /// The value at the end of the run.
    async fn value(&mut self) -> Result<u64, String> {
        match self {
            Counter::Redis(conn) => {
                let value: Option<u64> = conn.get(COUNTER_KEY).await.map_err(|e| e.to_string())?;
                Ok(value.unwrap_or(0))
            }
            Counter::Postgres(pool) => {
                let value: i64 =
                    sqlx::query_scalar("SELECT value FROM bench_counter WHERE key = $1")
                        .bind(COUNTER_KEY)
                        .fetch_one(&*pool)
                        .await
                        .map_err(|e| format!("reading the counter: {e}"))?;
                u64::try_from(value).map_err(|_| "a negative counter".to_owned())
            }
            Counter::Memory(counter) => Ok(counter.load(Ordering::SeqCst)),
        }
    }
}

/// One w2 worker's lock: tower-lock's, or the advisory-lock or user-lock baseline on
/// the worker's own connection, or the Curator-layout baseline on ZooKeeper.
enum Locker {
    Tower(tower_lock::Lock, Lease),
    Advisory(PgConnection),
    /// `GET_LOCK` of the name.
    UserLock(PoolConnection<MySql>, String),
    #[cfg(feature = "zookeeper")]
    Curator(zk::CuratorLock),
}

/// A hold of a [`Locker`].
enum Held {
    Tower(tower_lock::LockGuard),
    Advisory,
    UserLock,
    #[cfg(feature = "zookeeper")]
    Curator(zk::CuratorHeld),
}

impl Locker {
    async fn lock(&mut self) -> Result<Held, ()> {
        match self {
            Locker::Tower(lock, lease) => lock
                .try_lock_for(Duration::from_secs(30), *lease)
                .await
                .map(Held::Tower)
                .map_err(drop),
            Locker::Advisory(conn) => {
                sqlx::query(ADVISORY_LOCK)
                    .bind("bench:w2")
                    .execute(&mut *conn)
                    .await
                    .map_err(drop)?;
                Ok(Held::Advisory)
            }
            Locker::UserLock(conn, name) => {
                get_lock(conn, name).await?;
                Ok(Held::UserLock)
            }
            #[cfg(feature = "zookeeper")]
            Locker::Curator(lock) => lock.lock().await.map(Held::Curator),
        }
    }

    async fn unlock(&mut self, held: Held) -> Result<(), ()> {
        match (self, held) {
            (_, Held::Tower(guard)) => guard.unlock().await.map_err(drop),
            (Locker::Advisory(conn), Held::Advisory) => advisory_unlock(conn, "bench:w2").await,
            (Locker::UserLock(conn, name), Held::UserLock) => release_lock(conn, name).await,
            #[cfg(feature = "zookeeper")]
            (Locker::Curator(lock), Held::Curator(held)) => lock.unlock(held).await,
            #[cfg(feature = "zookeeper")]
            (_, Held::Curator(_)) => Err(()),
            (_, Held::Advisory | Held::UserLock) => Err(()),
        }
    }
}

/// Commands as `INFO commandstats` counts them: `(client-issued, all)`. Commands our
/// scripts call internally are counted by Redis too; "client-issued" leaves them out,
/// by name: every command a script in `lua/` calls, so a client-issued command of the
/// same name (the replay read's `HGET`) is left out too.
async fn command_counts(conn: &mut MultiplexedConnection) -> Result<(u64, u64), String> {
    const INSIDE_SCRIPTS: &[&str] = &[
        "decr",
        "hgetall",
        "type",
        "zrangebyscore",
        "exists",
        "hexists",
        "hincrby",
        "hget",
        "hset",
        "hdel",
        "hlen",
        "pexpire",
        "pttl",
        "del",
        "publish",
        "incr",
        "get",
        "zadd",
        "zrem",
        "zrange",
        "zscore",
        "lpush",
        "rpush",
        "lpop",
        "lrange",
        "lindex",
        "lrem",
        "llen",
        "zcard",
        "zremrangebyscore",
        "time",
        "set",
        "expire",
    ];
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .map_err(|e| e.to_string())?;
    let mut client = 0;
    let mut all = 0;
    for line in info.lines() {
        let Some((name, rest)) = line
            .strip_prefix("cmdstat_")
            .and_then(|l| l.split_once(':'))
        else {
            continue;
        };
        let calls: u64 = rest
            .split(',')
            .find_map(|kv| kv.strip_prefix("calls="))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        all += calls;
        if !INSIDE_SCRIPTS.contains(&name) {
            client += calls;
        }
    }
    Ok((client, all))
}

fn cpu_time() -> Duration {
    // SAFETY: getrusage only writes into the struct we pass.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) };
    let tv = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    tv(usage.ru_utime) + tv(usage.ru_stime)
}

/// A w3 line.
#[derive(Serialize)]
struct W3Line {
    peer: &'static str,
    lang: &'static str,
    workload: &'static str,
    waiters: usize,
    handoffs: u64,
    elapsed_s: f64,
    handoffs_per_s: f64,
    client_commands: u64,
    client_commands_per_handoff: f64,
    all_commands_per_handoff: f64,
    client_cpu_us_per_handoff: f64,
}

async fn w3(args: &Args) -> Result<W3Line, String> {
    if args.backend != BackendKind::Redis {
        return Err("w3 counts Redis commands: use --backend redis".into());
    }
    let backend = RedisBackend::connect(args.url.as_str())
        .await
        .map_err(|e| e.to_string())?;
    let client = LockClient::new(backend.clone());
    let mut stats = redis_conn(&args.url).await?;
    let lock = lock_for(&client, args, "bench:w3".into())?;
    // Warm up: load the scripts, so the counts below are steady state.
    lock.try_lock()
        .await
        .map_err(|e| e.to_string())?
        .unlock()
        .await
        .map_err(|e| e.to_string())?;
    let holder = lock.lock().await.map_err(|e| e.to_string())?;
    let acquisitions = Arc::new(AtomicU64::new(0));
    let target = args.handoffs;
    let mut tasks = Vec::new();
    for _ in 0..args.waiters {
        let lock = lock.clone();
        let acquisitions = acquisitions.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                if acquisitions.load(Ordering::SeqCst) >= target {
                    return;
                }
                let Ok(guard) = lock
                    .try_lock_for(Duration::from_secs(60), Lease::Watchdog)
                    .await
                else {
                    return;
                };
                acquisitions.fetch_add(1, Ordering::SeqCst);
                let _ = guard.unlock().await;
            }
        }));
    }
    // Count from the moment every waiter has subscribed and gone to sleep: all are
    // registered, and the server has stopped seeing new attempts.
    let key = LockKey::new("bench:w3").map_err(|e| e.to_string())?;
    let settle = Instant::now() + Duration::from_secs(30);
    while backend.local_waiters(&key) < args.waiters {
        if Instant::now() > settle {
            return Err("the waiters never all subscribed".into());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut last = command_counts(&mut stats).await?;
    loop {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = command_counts(&mut stats).await?;
        // Our own INFO call is one client command.
        if now.0 == last.0 + 1 || Instant::now() > settle {
            last = now;
            break;
        }
        last = now;
    }
    let (client_before, all_before) = last;
    let cpu_before = cpu_time();
    let started = Instant::now();
    holder.unlock().await.map_err(|e| e.to_string())?;
    for t in tasks {
        t.await.map_err(|e| e.to_string())?;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let cpu = cpu_time() - cpu_before;
    let (client_after, all_after) = command_counts(&mut stats).await?;
    let handoffs = acquisitions.load(Ordering::SeqCst);
    // Our own INFO call is one client command.
    let client_cmds = client_after - client_before - 1;
    let all_cmds = all_after - all_before - 1;
    Ok(W3Line {
        peer: peer(args),
        lang: "rust",
        workload: "w3",
        waiters: args.waiters,
        handoffs,
        elapsed_s: (elapsed * 1000.0).round() / 1000.0,
        handoffs_per_s: (handoffs as f64 / elapsed).round(),
        client_commands: client_cmds,
        client_commands_per_handoff: (100.0 * client_cmds as f64 / handoffs as f64).round() / 100.0,
        all_commands_per_handoff: (100.0 * all_cmds as f64 / handoffs as f64).round() / 100.0,
        client_cpu_us_per_handoff: (micros(cpu) as f64 / handoffs as f64).round(),
    })
}

/// Counts watchdog batches on their way to the real backend; every other call reaches
/// it unchanged.
#[derive(Default)]
struct Counting {
    batches: AtomicU64,
    renewed: AtomicU64,
}

impl<B: LockBackend> Intercept<B> for Counting {
    fn renew_many<'a>(
        &'a self,
        inner: &'a B,
        reqs: &'a [LockRequest],
    ) -> BoxFuture<'a, Vec<tower_lock::Result<bool>>> {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.renewed.fetch_add(reqs.len() as u64, Ordering::Relaxed);
        inner.renew_many(reqs)
    }
}

/// A w4 line.
#[derive(Serialize)]
struct W4Line {
    peer: &'static str,
    lang: &'static str,
    workload: &'static str,
    locks: usize,
    watchdog_lease_ms: u64,
    acquire_s: f64,
    periods: f64,
    renew_batches_per_period: f64,
    locks_renewed_per_period: f64,
    client_commands_per_period: f64,
    all_commands_per_period: f64,
    connections: u32,
    client_cpu_ms_per_period: f64,
    lost: usize,
}

async fn w4(args: &Args) -> Result<W4Line, String> {
    if args.backend != BackendKind::Redis {
        return Err("w4 counts Redis commands: use --backend redis".into());
    }
    let redis = RedisBackend::connect(args.url.as_str())
        .await
        .map_err(|e| e.to_string())?;
    let counting = Arc::new(Intercepted::new(redis, Counting::default()));
    let client = LockClient::builder(counting.clone())
        .watchdog_lease(args.watchdog)
        .build()
        .map_err(|e| e.to_string())?;
    let mut stats = redis_conn(&args.url).await?;
    let mut guards = Vec::with_capacity(args.locks);
    let acquiring = Instant::now();
    let chunks: Vec<Vec<usize>> = (0..args.locks)
        .collect::<Vec<_>>()
        .chunks(64)
        .map(<[usize]>::to_vec)
        .collect();
    for chunk in chunks {
        let mut batch = Vec::new();
        for i in chunk {
            let lock = client
                .get_lock(format!("bench:w4:{i}"))
                .map_err(|e| e.to_string())?;
            batch.push(tokio::spawn(async move { lock.lock().await }));
        }
        for t in batch {
            guards.push(
                t.await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| e.to_string())?,
            );
        }
    }
    let acquire_s = acquiring.elapsed().as_secs_f64();
    let period = args.watchdog / 3;
    let batches_before = counting.intercept().batches.load(Ordering::Relaxed);
    let renewed_before = counting.intercept().renewed.load(Ordering::Relaxed);
    let (client_before, all_before) = command_counts(&mut stats).await?;
    let cpu_before = cpu_time();
    tokio::time::sleep(period * 3).await;
    let cpu = cpu_time() - cpu_before;
    let (client_after, all_after) = command_counts(&mut stats).await?;
    let batches = counting.intercept().batches.load(Ordering::Relaxed) - batches_before;
    let renewed = counting.intercept().renewed.load(Ordering::Relaxed) - renewed_before;
    let lost = guards.iter().filter(|g| g.is_lost()).count();
    for g in guards {
        let _ = g.unlock().await;
    }
    let periods = 3.0;
    Ok(W4Line {
        peer: peer(args),
        lang: "rust",
        workload: "w4",
        locks: args.locks,
        watchdog_lease_ms: args.watchdog.as_millis() as u64,
        acquire_s: (acquire_s * 1000.0).round() / 1000.0,
        periods,
        renew_batches_per_period: batches as f64 / periods,
        locks_renewed_per_period: renewed as f64 / periods,
        client_commands_per_period: ((client_after - client_before - 1) as f64 / periods).round(),
        all_commands_per_period: ((all_after - all_before - 1) as f64 / periods).round(),
        connections: 1,
        client_cpu_ms_per_period: (micros(cpu) as f64 / periods / 1000.0 * 10.0).round() / 10.0,
        lost,
    })
}

/// A w5 line.
#[derive(Serialize)]
struct W5Line {
    peer: &'static str,
    lang: &'static str,
    workload: &'static str,
    /// The layer's backend, or `none` without the layer.
    layer: &'static str,
    connections: usize,
    elapsed_s: f64,
    requests: u64,
    req_per_s: f64,
    p50_us: u64,
    p99_us: u64,
    allocs_per_request: f64,
    errors: u64,
}

async fn w5(args: &Args) -> Result<W5Line, String> {
    let (addr, server) = serve(w5_app(args).await?).await?;
    let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
    let allocations_before = ALLOCATIONS.load(Ordering::Relaxed);
    let started = Instant::now();
    let driven = drive(
        addr,
        args.connections,
        deadline,
        |id| {
            http::Request::get(format!("/hello/{id}"))
                .header(http::header::HOST, "bench")
                .body(http_body_util::Empty::<bytes::Bytes>::new())
                .ok()
        },
        |head| head.status.is_success(),
    )
    .await;
    let elapsed = started.elapsed().as_secs_f64();
    let allocations = ALLOCATIONS.load(Ordering::Relaxed) - allocations_before;
    server.abort();
    let Driven { samples, errors } = driven?;
    let requests = samples.len();
    // Client and server share the process: the layer's own allocations are the
    // difference from the `none` run (`all` prints it as `layer_allocs_per_request`).
    let allocs_per_request = if requests > 0 {
        (allocations as f64 / requests as f64 * 10.0).round() / 10.0
    } else {
        0.0
    };
    Ok(W5Line {
        peer: peer(args),
        lang: "rust",
        workload: "w5",
        layer: args.backend.name(),
        connections: args.connections,
        elapsed_s: (elapsed * 1000.0).round() / 1000.0,
        requests,
        req_per_s: (requests as f64 / elapsed).round(),
        p50_us: pct(&samples, 50.0),
        p99_us: pct(&samples, 99.0),
        allocs_per_request,
        errors,
    })
}

/// w5's route, under the layer `--backend` and `--impl` name.
async fn w5_app(args: &Args) -> Result<axum::Router, String> {
    use axum::middleware::from_fn_with_state;
    use axum::routing::get;
    use tower_lock::layer::LockLayer;

    let app = axum::Router::new().route("/hello/{id}", get(|| async { "hello" }));
    Ok(match (args.backend, args.implementation) {
        (BackendKind::None, _) => app,
        (BackendKind::Noop, _) => app.layer(tower::layer::util::Identity::new()),
        (BackendKind::Memory, Impl::Baseline) => {
            app.layer(from_fn_with_state(MutexMap::default(), mutex_map_peer))
        }
        (BackendKind::Redis, Impl::Baseline | Impl::SafeBaseline) => {
            let mut conn = redis_conn(&args.url).await?;
            // The server's clock at a local instant, for the safe peer's deadlines.
            let (secs, micros): (u64, u64) = redis::cmd("TIME")
                .query_async(&mut conn)
                .await
                .map_err(|e| format!("reading the server's clock: {e}"))?;
            let peer = RedisPeer {
                conn,
                unlock: Arc::new(redis::Script::new(include_str!(
                    "../lua/bench_baseline_unlock.lua"
                ))),
                safe: (args.implementation == Impl::SafeBaseline).then(|| SafeAcquire {
                    script: Arc::new(redis::Script::new(include_str!(
                        "../lua/bench_safe_acquire.lua"
                    ))),
                    server_us: secs * 1_000_000 + micros,
                    sampled: Instant::now(),
                }),
            };
            app.layer(from_fn_with_state(peer, redis_setnx_peer))
        }
        _ => {
            let layer = LockLayer::builder(
                client(args).await?,
                tower_lock::layer::key_fn(|parts| {
                    // Every request has its own key: the cost of the layer, not of
                    // contention.
                    LockKey::namespaced("bench:w5", parts.uri.path())
                }),
            )
            .build()
            .map_err(|e| e.to_string())?;
            app.layer(layer)
        }
    })
}

/// Serves `app` on a port of its own on loopback: the address, and the task to abort
/// when the run is over.
async fn serve(
    app: axum::Router,
) -> Result<
    (
        std::net::SocketAddr,
        tokio::task::JoinHandle<std::io::Result<()>>,
    ),
    String,
> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .map_err(|e| e.to_string())?;
    let addr = listener.local_addr().map_err(|e| e.to_string())?;
    Ok((
        addr,
        tokio::spawn(async move { axum::serve(listener, app).await }),
    ))
}

/// What [`drive`] measured.
struct Driven {
    /// The latencies of the requests whose answers were accepted.
    samples: Latencies,
    /// Connections that failed, requests that could not be sent, and answers refused
    /// or cut off.
    errors: u64,
}

/// Sends requests to `addr` on `connections` keep-alive HTTP/1 connections, one at a
/// time on each, until `deadline` or until `request` has none for the next number
/// (numbers count from 0 across the connections). A request is timed from its sending
/// to the end of its answer's body, and counted only if `accept` takes the answer's
/// head.
async fn drive<B, R, A>(
    addr: std::net::SocketAddr,
    connections: usize,
    deadline: Instant,
    request: R,
    accept: A,
) -> Result<Driven, String>
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    R: Fn(u64) -> Option<http::Request<B>> + Clone + Send + 'static,
    A: Fn(&http::response::Parts) -> bool + Clone + Send + 'static,
{
    use http_body_util::BodyExt;

    let next_id = Arc::new(AtomicU64::new(0));
    let errors = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for _ in 0..connections {
        let (next_id, errors) = (next_id.clone(), errors.clone());
        let (request, accept) = (request.clone(), accept.clone());
        let mut samples = latencies()?;
        tasks.push(tokio::spawn(async move {
            let Ok(stream) = tokio::net::TcpStream::connect(addr).await else {
                errors.fetch_add(1, Ordering::Relaxed);
                return samples;
            };
            let _ = stream.set_nodelay(true);
            let io = hyper_util::rt::TokioIo::new(stream);
            let Ok((mut sender, conn)) = hyper::client::conn::http1::handshake(io).await else {
                errors.fetch_add(1, Ordering::Relaxed);
                return samples;
            };
            tokio::spawn(conn);
            while Instant::now() < deadline {
                let Some(req) = request(next_id.fetch_add(1, Ordering::Relaxed)) else {
                    break;
                };
                let t0 = Instant::now();
                let answered = match sender.send_request(req).await {
                    Ok(resp) => {
                        let (head, body) = resp.into_parts();
                        let read = body.collect().await.is_ok();
                        read && accept(&head)
                    }
                    Err(_) => false,
                };
                if answered {
                    samples.saturating_record(micros(t0.elapsed()));
                } else {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
            }
            samples
        }));
    }
    let samples = join_samples(tasks).await?;
    Ok(Driven {
        samples,
        errors: errors.load(Ordering::Relaxed),
    })
}

/// The answer of w5's peers when the key stays busy for the whole wait, as `LockLayer`
/// answers by default (`DEFAULT_BUSY_STATUS`, `DEFAULT_BUSY_RETRY_AFTER`), or `503`
/// when the store cannot answer, as `LockLayer` fails closed.
fn peer_refusal(status: http::StatusCode) -> axum::response::Response {
    use axum::response::IntoResponse;
    (status, [(http::header::RETRY_AFTER, "1")]).into_response()
}

/// w5's in-memory peer: the per-key mutexes an adopter keeps instead of `LockLayer`,
/// one `tokio::sync::Mutex` per key in a map behind a `std::sync::Mutex`.
#[derive(Clone, Default)]
struct MutexMap {
    locks: Arc<std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>>,
}

impl MutexMap {
    fn table(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<tokio::sync::Mutex<()>>>> {
        // Nothing panics while holding it; if something did, the map is still whole.
        self.locks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The mutex of `key`, made if nobody has it.
    fn enter(&self, key: String) -> MapEntry {
        let mutex = self.table().entry(key.clone()).or_default().clone();
        MapEntry {
            map: self.clone(),
            key,
            mutex,
        }
    }
}

/// A request's use of a key's mutex in a [`MutexMap`]. Dropped, it removes the key
/// from the map when nobody else holds or waits for it: every w5 request has a key of
/// its own, and a map that kept them would grow without bound.
struct MapEntry {
    map: MutexMap,
    key: String,
    mutex: Arc<tokio::sync::Mutex<()>>,
}

impl Drop for MapEntry {
    fn drop(&mut self) {
        let mut table = self.map.table();
        // The map's reference and this one: no other request holds or waits for the
        // key, and none can take another reference while the map is locked here.
        if Arc::strong_count(&self.mutex) == 2 {
            table.remove(&self.key);
        }
    }
}

/// w5's in-memory peer as an axum middleware: waits for the request's key as long as
/// `LockLayer` does by default, runs the handler holding it, releases it before the
/// response is handed on.
async fn mutex_map_peer(
    axum::extract::State(map): axum::extract::State<MutexMap>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let entry = map.enter(format!("bench:w5:{}", req.uri().path()));
    let wait = tower_lock::layer::DEFAULT_WAIT;
    let Ok(_held) = tokio::time::timeout(wait, entry.mutex.lock()).await else {
        return peer_refusal(tower_lock::layer::DEFAULT_BUSY_STATUS);
    };
    // Declared after `entry`, `_held` is dropped first: the mutex is released, then
    // the entry leaves the map.
    next.run(req).await
}

/// w5's Redis peer: the w1 baseline's `SET NX PX` and compare-and-delete, on one
/// multiplexed connection.
#[derive(Clone)]
struct RedisPeer {
    conn: MultiplexedConnection,
    unlock: Arc<redis::Script>,
    /// `--impl safe-baseline`: the `SET` through `lua/bench_safe_acquire.lua`, refused
    /// past a deadline on the server's clock, as w1's safe baseline.
    safe: Option<SafeAcquire>,
}

/// The safe peer's acquisition: the script, and the server's clock at a local instant.
#[derive(Clone)]
struct SafeAcquire {
    script: Arc<redis::Script>,
    server_us: u64,
    sampled: Instant,
}

/// How often w5's Redis peer tries a busy key again: what a hand-rolled lock without
/// pub/sub does.
const PEER_POLL: Duration = Duration::from_millis(50);

/// w5's Redis peer as an axum middleware: `SET key owner NX PX` with a random owner and
/// `LockLayer`'s default request lease (10 s, not renewed), tried again every
/// [`PEER_POLL`] for as long as `LockLayer` waits by default, the handler run holding
/// the key, then the compare-and-delete awaited before the response is handed on (as
/// `LockLayer` releases with the response). A request dropped while holding the key
/// leaves it to its lease.
async fn redis_setnx_peer(
    axum::extract::State(peer): axum::extract::State<RedisPeer>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    let key = format!("bench:w5peer:{}", req.uri().path());
    let owner = uuid::Uuid::new_v4().to_string();
    let lease_ms = tower_lock::layer::DEFAULT_REQUEST_LEASE.as_millis() as u64;
    let give_up = Instant::now() + tower_lock::layer::DEFAULT_WAIT;
    let mut conn = peer.conn.clone();
    loop {
        let set: redis::RedisResult<bool> = match &peer.safe {
            // Refused once the server's clock passes a second after it was sent.
            Some(safe) => {
                let sent = Instant::now().saturating_duration_since(safe.sampled);
                let by = safe.server_us + micros(sent) + 1_000_000;
                let taken: redis::RedisResult<i64> = safe
                    .script
                    .key(&key)
                    .arg(&owner)
                    .arg(lease_ms)
                    .arg(by)
                    .invoke_async(&mut conn)
                    .await;
                taken.map(|n| n == 1)
            }
            None => redis::cmd("SET")
                .arg(&key)
                .arg(&owner)
                .arg("NX")
                .arg("PX")
                .arg(lease_ms)
                .query_async::<Option<String>>(&mut conn)
                .await
                .map(|set| set.is_some()),
        };
        match set {
            Ok(true) => break,
            Ok(false) if Instant::now() + PEER_POLL < give_up => {
                tokio::time::sleep(PEER_POLL).await;
            }
            Ok(false) => return peer_refusal(tower_lock::layer::DEFAULT_BUSY_STATUS),
            Err(_) => return peer_refusal(http::StatusCode::SERVICE_UNAVAILABLE),
        }
    }
    let response = next.run(req).await;
    let _: redis::RedisResult<i64> = peer
        .unlock
        .key(&key)
        .arg(&owner)
        .invoke_async(&mut conn)
        .await;
    response
}

/// w6's two cases.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum W6Case {
    /// Every request with a new key: the handler runs and its response is stored.
    First,
    /// Requests cycling through keys stored beforehand: each answered from the store.
    Replay,
}

impl W6Case {
    const ALL: [W6Case; 2] = [W6Case::First, W6Case::Replay];

    /// The name the JSON lines carry.
    fn name(self) -> &'static str {
        match self {
            W6Case::First => "first",
            W6Case::Replay => "replay",
        }
    }
}

/// w6: the keys a replay run cycles through, each stored by one request of its warm-up.
const W6_REPLAY_KEYS: u64 = 1_000;

/// w6: requests with keys of their own sent before a `first` run is measured, so that
/// the run does not pay for loading the store's scripts.
const W6_WARMUP: u64 = 100;

/// w6: the layer's record quotas, per caller and in total. The defaults (1,000 per
/// caller, 100,000 in all) would refuse most of a `first` run from its one caller.
const W6_MAX_RECORDS: u32 = 50_000_000;

/// w6: how long stored responses (and their places in the quotas) live: long past any
/// run, short enough that a run on a shared Redis leaves nothing for a day. What a
/// request costs does not depend on it.
const W6_TTL: Duration = Duration::from_secs(10 * 60);

/// w6: the body of every request.
const W6_BODY: &str = r#"{"sku":"bench","quantity":1}"#;

/// A w6 line.
#[derive(Serialize)]
struct W6Line {
    peer: &'static str,
    lang: &'static str,
    workload: &'static str,
    /// The layer's backend, or `none` without the layer.
    layer: &'static str,
    /// `first` or `replay`.
    case: &'static str,
    connections: usize,
    requests: u64,
    req_per_s: f64,
    p50_us: u64,
    p99_us: u64,
    /// Calls into the store (memory) or commands sent to it (Redis) per request; 0
    /// without the layer.
    round_trips_per_request: Option<f64>,
    /// req/s against the no-layer run of the same case in the same run (1 on that line
    /// itself).
    ratio_to_no_layer: Option<f64>,
    /// Failed requests and answers not as the case expects (`201`, replayed or not).
    errors: u64,
}

/// w6: each case without the layer, then with it unless `--backend none`; one line
/// each.
async fn w6(args: &Args) -> Result<(), String> {
    let mut none_args = args.clone();
    none_args.backend = BackendKind::None;
    for case in W6Case::ALL {
        let none = w6_run(&none_args, case).await?;
        say(&none)?;
        if args.backend != BackendKind::None {
            let mut line = w6_run(args, case).await?;
            line.ratio_to_no_layer = ratio(Some(line.req_per_s), Some(none.req_per_s));
            say(&line)?;
        }
    }
    Ok(())
}

/// Counts the calls that reach a store (w6): every acquisition, renewal, release,
/// abandonment, subscription and cancelled wait, by both routes, and the records'
/// reads and writes. The replay reads are also counted on their own.
struct StoreCalls<B> {
    /// The store wrapped, again: [`Intercept::replays`] must hand out a [`ReplayStore`]
    /// that outlives the call, so the intercept keeps a handle of its own (a clone of
    /// the same store).
    store: B,
    calls: AtomicU64,
    loads: AtomicU64,
}

impl<B> StoreCalls<B> {
    fn new(store: B) -> Self {
        StoreCalls {
            store,
            calls: AtomicU64::new(0),
            loads: AtomicU64::new(0),
        }
    }

    fn count(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

impl<B: LockBackend> Intercept<B> for StoreCalls<B> {
    fn acquire<'a>(
        &'a self,
        inner: &'a B,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, tower_lock::Result<Acquire>> {
        self.count();
        inner.acquire(req)
    }

    fn acquire_now(&self, inner: &B, req: &LockRequest) -> Option<tower_lock::Result<Acquire>> {
        let answer = inner.local()?.acquire_now(req)?;
        self.count();
        Some(answer)
    }

    fn renew<'a>(
        &'a self,
        inner: &'a B,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, tower_lock::Result<bool>> {
        self.count();
        inner.renew(req)
    }

    fn renew_many<'a>(
        &'a self,
        inner: &'a B,
        reqs: &'a [LockRequest],
    ) -> BoxFuture<'a, Vec<tower_lock::Result<bool>>> {
        self.count();
        inner.renew_many(reqs)
    }

    fn release<'a>(
        &'a self,
        inner: &'a B,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, tower_lock::Result<Release>> {
        self.count();
        inner.release(req)
    }

    fn release_now(&self, inner: &B, req: &LockRequest) -> Option<tower_lock::Result<Release>> {
        let answer = inner.local()?.release_now(req)?;
        self.count();
        Some(answer)
    }

    fn abandon<'a>(
        &'a self,
        inner: &'a B,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, tower_lock::Result<()>> {
        self.count();
        inner.abandon(req)
    }

    fn subscribe<'a>(
        &'a self,
        inner: &'a B,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, tower_lock::Result<Box<dyn Subscription>>> {
        self.count();
        inner.subscribe(req)
    }

    fn cancel_wait<'a>(
        &'a self,
        inner: &'a B,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, tower_lock::Result<()>> {
        self.count();
        inner.cancel_wait(req)
    }

    fn replays<'a>(&'a self, inner: &'a B) -> Option<&'a dyn ReplayStore> {
        inner.replays()?;
        Some(self)
    }
}

/// Offered exactly when the store keeps records (see [`StoreCalls::store`]).
impl<B: LockBackend> ReplayStore for StoreCalls<B> {
    fn load<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, tower_lock::Result<Option<Bytes>>> {
        self.count();
        self.loads.fetch_add(1, Ordering::Relaxed);
        match self.store.replays() {
            Some(records) => records.load(key),
            None => Box::pin(std::future::ready(Err(no_records()))),
        }
    }

    fn store_and_release<'a>(
        &'a self,
        req: &'a LockRequest,
        token: FencingToken,
        record: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'a, tower_lock::Result<Stored>> {
        self.count();
        match self.store.replays() {
            Some(records) => records.store_and_release(req, token, record, ttl),
            None => Box::pin(std::future::ready(Err(no_records()))),
        }
    }
}

/// What [`StoreCalls`] answers if asked for records the store does not keep (it is
/// not: it offers them only when the store does).
fn no_records() -> tower_lock::Error {
    tower_lock::StoreError::msg(
        tower_lock::StoreErrorKind::Misconfigured,
        "the store keeps no records for replay",
    )
    .into()
}

/// A store counted by [`StoreCalls`].
type Counted<B> = Arc<Intercepted<B, StoreCalls<B>>>;

fn counted<B: LockBackend + Clone>(store: B) -> Counted<B> {
    Arc::new(Intercepted::new(store.clone(), StoreCalls::new(store)))
}

/// Where w6 counts the store's round trips.
enum W6Meter {
    None,
    Memory(Counted<MemoryBackend>),
    /// The layer's store, and a connection of the bench's own for `INFO`.
    Redis(Counted<RedisBackend>, MultiplexedConnection),
}

impl W6Meter {
    /// The round trips so far: calls into the memory store; on Redis the commands
    /// `command_counts` takes as client-issued, plus the replay reads (`HGET`, which
    /// scripts also call, so `command_counts` leaves every one out). Reading costs
    /// Redis one client command (the `INFO`), which the next reading counts.
    async fn read(&mut self) -> Result<u64, String> {
        match self {
            W6Meter::None => Ok(0),
            W6Meter::Memory(store) => Ok(store.intercept().calls.load(Ordering::Relaxed)),
            W6Meter::Redis(store, conn) => {
                let (client, _) = command_counts(conn).await?;
                Ok(client + store.intercept().loads.load(Ordering::Relaxed))
            }
        }
    }

    /// The round trips between two readings, without the first reading's own `INFO`.
    fn between(&self, before: u64, after: u64) -> u64 {
        let own = u64::from(matches!(self, W6Meter::Redis(..)));
        after.saturating_sub(before).saturating_sub(own)
    }
}

/// w6's layer: one caller, the quotas raised to [`W6_MAX_RECORDS`], records living
/// [`W6_TTL`], under a key prefix of the run's own (`bench-w6-<nonce>`), so that nothing
/// an earlier run stored, its records or their places in the quotas, is in this one's
/// way.
fn w6_layer(
    client: LockClient,
    nonce: &str,
) -> Result<IdempotencyLayer<impl tower_lock::layer::KeyExtractor>, String> {
    IdempotencyLayer::builder(
        client,
        // Made per request, as an extractor of the authenticated user does.
        tower_lock::layer::key_fn(|_parts| LockKey::namespaced("user", "bench")),
    )
    .key_prefix(format!("bench-w6-{nonce}"))
    .max_records_per_scope(W6_MAX_RECORDS)
    .max_records(W6_MAX_RECORDS)
    .ttl(W6_TTL)
    .build()
    .map_err(|e| e.to_string())
}

/// w6's route, under the layer `--backend` names, and how to count its store's round
/// trips.
async fn w6_app(args: &Args, nonce: &str) -> Result<(axum::Router, W6Meter), String> {
    use axum::routing::post;

    // An order handler: reads the body, answers `201` with a small one.
    let route = post(|order: Bytes| async move {
        let created = !order.is_empty();
        (
            http::StatusCode::CREATED,
            [(http::header::CONTENT_TYPE, "application/json")],
            if created {
                r#"{"order":"created"}"#
            } else {
                r#"{"order":"empty"}"#
            },
        )
    });
    let (route, meter) = match args.backend {
        BackendKind::None => (route, W6Meter::None),
        BackendKind::Memory => {
            let store = counted(MemoryBackend::new());
            let layer = w6_layer(LockClient::new(store.clone()), nonce)?;
            (route.route_layer(layer), W6Meter::Memory(store))
        }
        BackendKind::Redis => {
            let redis = RedisBackend::connect(args.url.as_str())
                .await
                .map_err(|e| format!("connecting to {}: {e}", shown(&args.url)))?;
            let store = counted(redis);
            let layer = w6_layer(LockClient::new(store.clone()), nonce)?;
            let stats = redis_conn(&args.url).await?;
            (route.route_layer(layer), W6Meter::Redis(store, stats))
        }
        other => return Err(format!("w6 has no layer on {}", other.name())),
    };
    Ok((axum::Router::new().route("/orders/{id}", route), meter))
}

/// w6's requests: number `n` is `POST /orders/<i>` with the `Idempotency-Key`
/// `<tag>-<nonce>-<i>`, `i` being `n` modulo `cycle`; none from `limit` on.
fn w6_requests(
    nonce: &str,
    tag: &'static str,
    cycle: u64,
    limit: u64,
) -> impl Fn(u64) -> Option<http::Request<http_body_util::Full<Bytes>>> + Clone + Send + 'static {
    let nonce = nonce.to_owned();
    move |n| {
        if n >= limit {
            return None;
        }
        let i = n % cycle;
        http::Request::post(format!("/orders/{i}"))
            .header(http::header::HOST, "bench")
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(IDEMPOTENCY_KEY, format!("{tag}-{nonce}-{i}"))
            .body(http_body_util::Full::new(Bytes::from_static(
                W6_BODY.as_bytes(),
            )))
            .ok()
    }
}

/// Whether a w6 answer is what its case expects: `201`, with `Idempotent-Replayed:
/// true` or without it as `replayed` says (`None`: no layer, nothing to check).
fn w6_accepts(head: &http::response::Parts, replayed: Option<bool>) -> bool {
    let was_replayed = head
        .headers
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v == "true");
    head.status == http::StatusCode::CREATED && replayed.is_none_or(|want| was_replayed == want)
}

/// One w6 run: the route under `--backend`'s layer (or none), warmed up, then measured
/// for `--seconds`. The line's `ratio_to_no_layer` is left for the caller, who has the
/// no-layer run (1 on that run's own line).
async fn w6_run(args: &Args, case: W6Case) -> Result<W6Line, String> {
    // The run's own key prefix: nothing an earlier run stored answers it.
    let nonce = format!("{:016x}", fastrand::u64(..));
    let (app, mut meter) = w6_app(args, &nonce).await?;
    let (addr, server) = serve(app).await?;
    let layered = args.backend != BackendKind::None;
    let measured = w6_measure(args, case, &nonce, addr, layered, &mut meter).await;
    server.abort();
    let (driven, elapsed, round_trips) = measured?;
    let requests = driven.samples.len();
    let per_request = |x: u64| {
        if requests == 0 {
            0.0
        } else {
            (x as f64 / requests as f64 * 100.0).round() / 100.0
        }
    };
    Ok(W6Line {
        peer: peer(args),
        lang: "rust",
        workload: "w6",
        layer: args.backend.name(),
        case: case.name(),
        connections: args.connections,
        requests,
        req_per_s: (requests as f64 / elapsed).round(),
        p50_us: pct(&driven.samples, 50.0),
        p99_us: pct(&driven.samples, 99.0),
        round_trips_per_request: Some(per_request(round_trips)),
        ratio_to_no_layer: (!layered).then_some(1.0),
        errors: driven.errors,
    })
}

/// w6's warm-up and measured run against the server at `addr`: what was driven, the
/// seconds it took, and the store's round trips.
async fn w6_measure(
    args: &Args,
    case: W6Case,
    nonce: &str,
    addr: std::net::SocketAddr,
    layered: bool,
    meter: &mut W6Meter,
) -> Result<(Driven, f64, u64), String> {
    // `first`: keys of the warm-up's own; `replay`: the keys the run replays, stored.
    let (tag, keys) = match case {
        W6Case::First => ("w", W6_WARMUP),
        W6Case::Replay => ("r", W6_REPLAY_KEYS),
    };
    let warm_up = drive(
        addr,
        args.connections,
        Instant::now() + Duration::from_secs(60),
        w6_requests(nonce, tag, u64::MAX, keys),
        move |head| w6_accepts(head, layered.then_some(false)),
    )
    .await?;
    if warm_up.errors > 0 || warm_up.samples.len() != keys {
        return Err(format!(
            "w6 {}: {} of the warm-up's {keys} requests failed",
            case.name(),
            keys - warm_up.samples.len().min(keys)
        ));
    }
    let (requests, replayed) = match case {
        W6Case::First => (w6_requests(nonce, "f", u64::MAX, u64::MAX), false),
        W6Case::Replay => (w6_requests(nonce, "r", W6_REPLAY_KEYS, u64::MAX), true),
    };
    let before = meter.read().await?;
    let started = Instant::now();
    let driven = drive(
        addr,
        args.connections,
        started + Duration::from_secs_f64(args.seconds),
        requests,
        move |head| w6_accepts(head, layered.then_some(replayed)),
    )
    .await?;
    let elapsed = started.elapsed().as_secs_f64();
    let after = meter.read().await?;
    Ok((driven, elapsed, meter.between(before, after)))
}

/// Requests per second that `redis-benchmark` reaches for one command line.
fn redis_benchmark(
    host: &str,
    port: &str,
    clients: u32,
    pipeline: u32,
    command: &[&str],
) -> Result<f64, String> {
    let requests = (20_000 * pipeline.max(1) * clients.min(8)).to_string();
    let out = std::process::Command::new("redis-benchmark")
        .args([
            "-h",
            host,
            "-p",
            port,
            "-c",
            &clients.to_string(),
            "-P",
            &pipeline.to_string(),
        ])
        .args(["-n", &requests, "-r", "100000", "-q"])
        .args(command)
        .output()
        .map_err(|e| format!("redis-benchmark: {e}"))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .zip(text.split_whitespace().skip(1))
        .filter(|(_, next)| *next == "requests")
        .filter_map(|(n, _)| n.parse::<f64>().ok())
        .last()
        .ok_or_else(|| {
            let errors = String::from_utf8_lossy(&out.stderr);
            format!("redis-benchmark printed no rate: {text}{errors}")
        })
}

/// A ceiling line: what `redis-benchmark` reaches.
#[derive(Serialize)]
struct CeilingLine {
    peer: &'static str,
    lang: &'static str,
    workload: &'static str,
    clients: u32,
    pipeline: u32,
    acquire_script_per_s: f64,
    release_script_per_s: f64,
    cycles_per_s: f64,
    set_nx_per_s: f64,
}

/// redis-benchmark's ceiling for tower-lock's own two scripts: the cycles per second a
/// client could reach if the server were the only limit.
async fn ceilings(args: &Args) -> Result<Vec<CeilingLine>, String> {
    let rest = args.url.trim_start_matches("redis://");
    let hostport = rest.split('/').next().unwrap_or(rest);
    let (host, port) = hostport.rsplit_once(':').unwrap_or((hostport, "6379"));
    let mut conn = redis_conn(&args.url).await?;
    let load = |code: &str| {
        let code = code.to_owned();
        let mut conn = conn.clone();
        async move {
            redis::Script::new(&code)
                .load_async(&mut conn)
                .await
                .map_err(|e| e.to_string())
        }
    };
    let acquire = load(include_str!("../lua/lock_acquire.lua")).await?;
    let release = load(include_str!("../lua/lock_release.lua")).await?;
    let mut lines = Vec::new();
    for (clients, pipeline) in [(1, 1), (32, 16)] {
        let acq = redis_benchmark(
            host,
            port,
            clients,
            pipeline,
            &[
                "EVALSHA",
                &acquire,
                "2",
                "ceil:__rand_int__",
                "ceilf:__rand_int__",
                "30000",
                "bench-owner",
                // Unfenced, with a deadline far ahead: the script reads the clock, as
                // every attempt with a deadline does, and always takes the lock.
                "0",
                "99999999999999999",
            ],
        )?;
        let rel = redis_benchmark(
            host,
            port,
            clients,
            pipeline,
            &[
                "EVALSHA",
                &release,
                "2",
                "ceil:__rand_int__",
                "ceilc:__rand_int__",
                "0",
                "30000",
                "bench-owner",
            ],
        )?;
        let setnx = redis_benchmark(
            host,
            port,
            clients,
            pipeline,
            &[
                "SET",
                "ceils:__rand_int__",
                "bench-owner",
                "NX",
                "PX",
                "30000",
            ],
        )?;
        lines.push(CeilingLine {
            peer: "redis-benchmark",
            lang: "c",
            workload: "ceiling",
            clients,
            pipeline,
            acquire_script_per_s: acq.round(),
            release_script_per_s: rel.round(),
            cycles_per_s: (1.0 / (1.0 / acq + 1.0 / rel)).round(),
            set_nx_per_s: setnx.round(),
        });
    }
    let _: () = redis::cmd("FLUSHDB")
        .query_async(&mut conn)
        .await
        .map_err(|e| e.to_string())?;
    Ok(lines)
}

/// The `ratios` line: `"workload":"ratios"` (and `"backend":"postgres"`, `"mysql"` or
/// `"zookeeper"` for the PostgreSQL, MySQL and ZooKeeper suites), then each ratio in the order measured (`null` when a side is
/// missing). Its field names are made from the runs (`w1x32_cycles_per_s`,
/// `w5x64_memory_req_per_s`, ...), so it is a map serialized in order rather than a
/// struct.
struct Ratios {
    backend: Option<&'static str>,
    ratios: Vec<(String, Option<f64>)>,
}

impl Serialize for Ratios {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.ratios.len() + 2))?;
        map.serialize_entry("workload", "ratios")?;
        if let Some(backend) = self.backend {
            map.serialize_entry("backend", backend)?;
        }
        for (name, value) in &self.ratios {
            map.serialize_entry(name, value)?;
        }
        map.end()
    }
}

/// `a / b` to three decimals (`None` when a side is missing or `b` is 0).
fn ratio(a: Option<f64>, b: Option<f64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b > 0.0 => Some((a / b * 1000.0).round() / 1000.0),
        _ => None,
    }
}

async fn all(args: &Args) -> Result<(), String> {
    match ceilings(args).await {
        Ok(ceilings) => {
            for line in &ceilings {
                say(line)?;
            }
        }
        Err(e) => eprintln!("bench: skipping the redis-benchmark ceilings: {e}"),
    }
    let with = |f: &dyn Fn(&mut Args)| {
        let mut a = args.clone();
        a.chart = None;
        f(&mut a);
        a
    };
    let mut ratios = Vec::new();
    for workers in [1, 32] {
        let ours = w1(&with(&|a| {
            a.workers = workers;
            a.workload = Workload::W1;
        }))
        .await?;
        // The plain baseline, then the one that refuses a late SET.
        let mut others = Vec::new();
        for (implementation, suffix) in [(Impl::Baseline, ""), (Impl::SafeBaseline, "_vs_safe")] {
            let other = w1_baseline(&with(&|a| {
                a.workers = workers;
                a.workload = Workload::W1;
                a.implementation = implementation;
            }))
            .await?;
            ratios.push((
                format!("w1x{workers}_cycles_per_s{suffix}"),
                ratio(Some(ours.cycles_per_s), Some(other.cycles_per_s)),
            ));
            ratios.push((
                format!("w1x{workers}_redis_cpu_per_cycle{suffix}"),
                ratio(ours.redis_cpu_us_per_cycle, other.redis_cpu_us_per_cycle),
            ));
            others.push(other);
        }
        say(&ours)?;
        for other in &others {
            say(other)?;
        }
    }
    let (w2_line, w2_samples) = w2_with_samples(&with(&|a| {
        a.workers = 8;
        a.workload = Workload::W2;
    }))
    .await?;
    say(&w2_line)?;
    match w2_with_samples(&with(&|a| {
        a.workers = 8;
        a.workload = Workload::W2;
        a.kind = LockKind::Fair;
    }))
    .await
    {
        Ok((line, _)) => say(&line)?,
        Err(e) => eprintln!("bench: the fair lock's w2 failed: {e}"),
    }
    let (w2h_line, w2h_samples) = w2_with_samples(&with(&|a| {
        a.workers = 8;
        a.workload = Workload::W2;
        a.handoff = true;
    }))
    .await?;
    say(&w2h_line)?;
    for waiters in [20, 200] {
        say(&w3(&with(&|a| {
            a.waiters = waiters;
            a.workload = Workload::W3;
        }))
        .await?)?;
    }
    say(&w4(&with(&|a| a.workload = Workload::W4)).await?)?;
    for connections in [64, 1] {
        let mut none: Option<W5Line> = None;
        let layers = [
            BackendKind::None,
            BackendKind::Noop,
            BackendKind::Memory,
            BackendKind::Redis,
        ];
        for backend in layers {
            let line = w5(&with(&|a| {
                a.connections = connections;
                a.backend = backend;
                a.workload = Workload::W5;
            }))
            .await?;
            say(&line)?;
            let Some(none) = &none else {
                none = Some(line);
                continue;
            };
            let layer = backend.name();
            ratios.push((
                format!("w5x{connections}_{layer}_req_per_s"),
                ratio(Some(line.req_per_s), Some(none.req_per_s)),
            ));
            ratios.push((
                format!("w5x{connections}_{layer}_added_p50_us"),
                Some(line.p50_us as f64 - none.p50_us as f64),
            ));
            ratios.push((
                format!("w5x{connections}_{layer}_layer_allocs_per_request"),
                Some(
                    ((line.allocs_per_request - none.allocs_per_request).max(0.0) * 10.0).round()
                        / 10.0,
                ),
            ));
            if !matches!(backend, BackendKind::Memory | BackendKind::Redis) {
                continue;
            }
            // The middleware an adopter writes instead, right after the layer.
            let peer = w5(&with(&|a| {
                a.connections = connections;
                a.backend = backend;
                a.workload = Workload::W5;
                a.implementation = Impl::Baseline;
            }))
            .await?;
            say(&peer)?;
            ratios.push((
                format!("w5x{connections}_{layer}_req_per_s_vs_peer"),
                ratio(Some(line.req_per_s), Some(peer.req_per_s)),
            ));
            ratios.push((
                format!("w5x{connections}_{layer}_peer_req_per_s"),
                ratio(Some(peer.req_per_s), Some(none.req_per_s)),
            ));
            if backend != BackendKind::Redis {
                continue;
            }
            // On Redis, the peer with tower-lock's late-write rule too.
            let safe = w5(&with(&|a| {
                a.connections = connections;
                a.backend = backend;
                a.workload = Workload::W5;
                a.implementation = Impl::SafeBaseline;
            }))
            .await?;
            say(&safe)?;
            ratios.push((
                format!("w5x{connections}_{layer}_req_per_s_vs_safe_peer"),
                ratio(Some(line.req_per_s), Some(safe.req_per_s)),
            ));
        }
    }
    for case in W6Case::ALL {
        let w6_with = |backend| {
            with(&|a| {
                a.connections = 64;
                a.backend = backend;
                a.workload = Workload::W6;
            })
        };
        let none = w6_run(&w6_with(BackendKind::None), case).await?;
        say(&none)?;
        for backend in [BackendKind::Memory, BackendKind::Redis] {
            let mut line = w6_run(&w6_with(backend), case).await?;
            line.ratio_to_no_layer = ratio(Some(line.req_per_s), Some(none.req_per_s));
            say(&line)?;
            let name = format!("w6_{}_{}", backend.name(), case.name());
            ratios.push((format!("{name}_req_per_s"), line.ratio_to_no_layer));
            ratios.push((
                format!("{name}_round_trips_per_request"),
                line.round_trips_per_request,
            ));
        }
    }
    say(&Ratios {
        backend: None,
        ratios,
    })?;
    if let Some(path) = &args.chart {
        chart(
            path,
            &[
                ("w2 (free-for-all)", &w2_samples),
                ("w2h (strict handoff)", &w2h_samples),
            ],
        )?;
        eprintln!("bench: wrote {path}");
    }
    Ok(())
}

/// The PostgreSQL suite: tower-lock next to the advisory-lock baseline, each pair run
/// back to back: w1 with 1 and 32 workers (also with fast grants), w2 and w2h with 8;
/// then the ratios (tower-lock / baseline).
async fn pg_suite(args: &Args) -> Result<(), String> {
    let with = |f: &dyn Fn(&mut Args)| {
        let mut a = args.clone();
        f(&mut a);
        a
    };
    let u = |v: u64| Some(v as f64);
    let mut ratios = Vec::new();
    for workers in [1, 32] {
        let ours = w1(&with(&|a| {
            a.workers = workers;
            a.workload = Workload::W1;
        }))
        .await?;
        say(&ours)?;
        let base = w1_pg_baseline(&with(&|a| {
            a.workers = workers;
            a.workload = Workload::W1;
            a.implementation = Impl::Baseline;
        }))
        .await?;
        say(&base)?;
        let name = format!("w1x{workers}");
        ratios.push((
            format!("{name}_cycles_per_s"),
            ratio(Some(ours.cycles_per_s), Some(base.cycles_per_s)),
        ));
        ratios.push((
            format!("{name}_cycle_p50_us"),
            ratio(u(ours.cycle_p50_us), u(base.cycle_p50_us)),
        ));
        ratios.push((
            format!("{name}_cycle_p99_us"),
            ratio(u(ours.cycle_p99_us), u(base.cycle_p99_us)),
        ));
        let cpu = |l: &W1Line| l.pg.as_ref().and_then(|c| c.pg_cpu_us_per_cycle);
        ratios.push((
            format!("{name}_pg_cpu_per_cycle"),
            ratio(cpu(&ours), cpu(&base)),
        ));
        // The opt-in fast mode (grants without waiting for the disk), against the same
        // baseline.
        let fast = w1(&with(&|a| {
            a.workers = workers;
            a.workload = Workload::W1;
            a.fast_grants = Some(a.fast_grants.unwrap_or(Duration::from_secs(30)));
        }))
        .await?;
        say(&fast)?;
        ratios.push((
            format!("{name}_fast_cycles_per_s"),
            ratio(Some(fast.cycles_per_s), Some(base.cycles_per_s)),
        ));
    }
    for handoff in [false, true] {
        let ours = w2(&with(&|a| {
            a.workers = 8;
            a.workload = Workload::W2;
            a.handoff = handoff;
        }))
        .await?;
        say(&ours)?;
        let base = w2(&with(&|a| {
            a.workers = 8;
            a.workload = Workload::W2;
            a.handoff = handoff;
            a.implementation = Impl::Baseline;
        }))
        .await?;
        say(&base)?;
        // Released locks handed to the oldest waiter, against the same baseline.
        let handed = w2(&with(&|a| {
            a.workers = 8;
            a.workload = Workload::W2;
            a.handoff = handoff;
            a.hand_over = true;
        }))
        .await?;
        say(&handed)?;
        let name = ours.workload;
        ratios.push((
            format!("{name}_hand_over_cycles_per_s"),
            ratio(Some(handed.cycles_per_s), Some(base.cycles_per_s)),
        ));
        ratios.push((
            format!("{name}_hand_over_handoff_p50_us"),
            ratio(u(handed.handoff_p50_us), u(base.handoff_p50_us)),
        ));
        ratios.push((
            format!("{name}_cycles_per_s"),
            ratio(Some(ours.cycles_per_s), Some(base.cycles_per_s)),
        ));
        ratios.push((
            format!("{name}_handoff_p50_us"),
            ratio(u(ours.handoff_p50_us), u(base.handoff_p50_us)),
        ));
        ratios.push((
            format!("{name}_handoff_p99_us"),
            ratio(u(ours.handoff_p99_us), u(base.handoff_p99_us)),
        ));
    }
    say(&Ratios {
        backend: Some("postgres"),
        ratios,
    })
}

/// The MySQL/MariaDB suite: tower-lock next to the `GET_LOCK` baseline, each pair run
/// back to back: w1 with 1 and 32 workers, w2 with 8 workers on one backend, then w2
/// with a backend per worker (a release reaches the next holder through the
/// listener's poll), against the same baseline; then the ratios (tower-lock /
/// baseline).
async fn my_suite(args: &Args) -> Result<(), String> {
    let with = |f: &dyn Fn(&mut Args)| {
        let mut a = args.clone();
        f(&mut a);
        a
    };
    let u = |v: u64| Some(v as f64);
    let mut ratios = Vec::new();
    for workers in [1, 32] {
        let ours = w1(&with(&|a| {
            a.workers = workers;
            a.workload = Workload::W1;
        }))
        .await?;
        say(&ours)?;
        let base = w1_my_baseline(&with(&|a| {
            a.workers = workers;
            a.workload = Workload::W1;
            a.implementation = Impl::Baseline;
        }))
        .await?;
        say(&base)?;
        let name = format!("w1x{workers}");
        ratios.push((
            format!("{name}_cycles_per_s"),
            ratio(Some(ours.cycles_per_s), Some(base.cycles_per_s)),
        ));
        ratios.push((
            format!("{name}_cycle_p50_us"),
            ratio(u(ours.cycle_p50_us), u(base.cycle_p50_us)),
        ));
        ratios.push((
            format!("{name}_cycle_p99_us"),
            ratio(u(ours.cycle_p99_us), u(base.cycle_p99_us)),
        ));
        let cpu = |l: &W1Line| l.my.as_ref().and_then(|c| c.mysql_cpu_us_per_cycle);
        ratios.push((
            format!("{name}_mysql_cpu_per_cycle"),
            ratio(cpu(&ours), cpu(&base)),
        ));
    }
    let w2_with = |implementation, backend_per_worker| {
        with(&|a| {
            a.workers = 8;
            a.workload = Workload::W2;
            a.implementation = implementation;
            a.backend_per_worker = backend_per_worker;
        })
    };
    let ours = w2(&w2_with(Impl::TowerLock, false)).await?;
    say(&ours)?;
    let base = w2(&w2_with(Impl::Baseline, false)).await?;
    say(&base)?;
    let apart = w2(&w2_with(Impl::TowerLock, true)).await?;
    say(&apart)?;
    for (name, line) in [("w2", &ours), ("w2_backend_per_worker", &apart)] {
        ratios.push((
            format!("{name}_cycles_per_s"),
            ratio(Some(line.cycles_per_s), Some(base.cycles_per_s)),
        ));
        ratios.push((
            format!("{name}_handoff_p50_us"),
            ratio(u(line.handoff_p50_us), u(base.handoff_p50_us)),
        ));
        ratios.push((
            format!("{name}_handoff_p99_us"),
            ratio(u(line.handoff_p99_us), u(base.handoff_p99_us)),
        ));
    }
    say(&Ratios {
        backend: Some("mysql"),
        ratios,
    })
}

/// The ZooKeeper suite: tower-lock next to the bare Curator-layout lock, each pair run
/// back to back: w1 with 1 and 32 workers on one session, with 32 on a session each,
/// and with 1 and 32 on a new key every cycle; w2 with 8 workers on one session, then
/// on a session each; then the ratios (tower-lock / baseline) and the machine's load.
async fn zk_suite(args: &Args) -> Result<(), String> {
    let load_before = load_average();
    let with = |f: &dyn Fn(&mut Args)| {
        let mut a = args.clone();
        f(&mut a);
        a
    };
    let u = |v: u64| Some(v as f64);
    let packets = |cost: &Option<zk::ZkCost>| cost.as_ref().and_then(|c| c.zk_packets_per_cycle);
    let mut ratios = Vec::new();
    let w1_cases = [
        ("w1x1", 1, false, false),
        ("w1x32", 32, false, false),
        ("w1x32_backend_per_worker", 32, true, false),
        ("w1x1_fresh_keys", 1, false, true),
        ("w1x32_fresh_keys", 32, false, true),
    ];
    for (name, workers, apart, fresh) in w1_cases {
        let w1_with = |implementation| {
            with(&|a| {
                a.workers = workers;
                a.workload = Workload::W1;
                a.implementation = implementation;
                a.backend_per_worker = apart;
                a.fresh_keys = fresh;
            })
        };
        let ours = w1(&w1_with(Impl::TowerLock)).await?;
        say(&ours)?;
        let base = w1_zk_baseline(&w1_with(Impl::Baseline)).await?;
        say(&base)?;
        ratios.push((
            format!("{name}_cycles_per_s"),
            ratio(Some(ours.cycles_per_s), Some(base.cycles_per_s)),
        ));
        ratios.push((
            format!("{name}_cycle_p50_us"),
            ratio(u(ours.cycle_p50_us), u(base.cycle_p50_us)),
        ));
        ratios.push((
            format!("{name}_cycle_p99_us"),
            ratio(u(ours.cycle_p99_us), u(base.cycle_p99_us)),
        ));
        ratios.push((
            format!("{name}_zk_packets_per_cycle"),
            ratio(packets(&ours.zk), packets(&base.zk)),
        ));
    }
    for (name, apart) in [("w2", false), ("w2_backend_per_worker", true)] {
        let w2_with = |implementation| {
            with(&|a| {
                a.workers = 8;
                a.workload = Workload::W2;
                a.implementation = implementation;
                a.backend_per_worker = apart;
            })
        };
        let ours = w2(&w2_with(Impl::TowerLock)).await?;
        say(&ours)?;
        let base = w2(&w2_with(Impl::Baseline)).await?;
        say(&base)?;
        ratios.push((
            format!("{name}_cycles_per_s"),
            ratio(Some(ours.cycles_per_s), Some(base.cycles_per_s)),
        ));
        ratios.push((
            format!("{name}_handoff_p50_us"),
            ratio(u(ours.handoff_p50_us), u(base.handoff_p50_us)),
        ));
        ratios.push((
            format!("{name}_handoff_p99_us"),
            ratio(u(ours.handoff_p99_us), u(base.handoff_p99_us)),
        ));
        ratios.push((
            format!("{name}_zk_packets_per_cycle"),
            ratio(packets(&ours.zk), packets(&base.zk)),
        ));
    }
    ratios.push(("load_avg_1m_before".to_owned(), load_before));
    ratios.push(("load_avg_1m_after".to_owned(), load_average()));
    say(&Ratios {
        backend: Some("zookeeper"),
        ratios,
    })
}

/// The machine's 1-minute load average (`/proc/loadavg`), `None` where there is none.
fn load_average() -> Option<f64> {
    let loadavg = std::fs::read_to_string("/proc/loadavg").ok()?;
    loadavg.split_whitespace().next()?.parse().ok()
}

/// Handoff latency distributions (share of handoffs at or below each latency), log scale.
fn chart(path: &str, series: &[(&str, &Latencies)]) -> Result<(), String> {
    use plotters::prelude::*;
    let root = SVGBackend::new(path, (760, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    // Wide enough for the slowest peer's median (rslock, 10.9 ms).
    let max = series
        .iter()
        .map(|(_, s)| max_of(s))
        .max()
        .unwrap_or(0)
        .max(25_000) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "tower-lock handoff latency, 8 workers, Redis on loopback",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((10f64..max * 1.2).log_scale(), 0f64..1f64)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_label_formatter(&|us: &f64| {
            if *us >= 1000.0 {
                format!("{} ms", (*us / 1000.0).round())
            } else {
                format!("{} µs", us.round())
            }
        })
        .x_desc("handoff latency (µs): next holder's acquire returned − previous release returned")
        .y_desc("share of handoffs ≤ x")
        .draw()
        .map_err(|e| e.to_string())?;
    let colors = [BLUE, RED, GREEN];
    for ((name, samples), color) in series.iter().zip(colors) {
        if samples.is_empty() {
            continue;
        }
        // One point per recorded value, thinned to about 400 (the last one kept).
        let recorded: Vec<(f64, f64)> = samples
            .iter_recorded()
            .map(|v| (v.value_iterated_to().max(10) as f64, v.quantile()))
            .collect();
        let step = (recorded.len() / 400).max(1);
        let points: Vec<(f64, f64)> = recorded
            .iter()
            .enumerate()
            .filter(|(i, _)| i % step == 0 || *i + 1 == recorded.len())
            .map(|(_, &point)| point)
            .collect();
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| e.to_string())?
            .label(format!(
                "{name}: p50 {} µs, p99 {} µs",
                pct(samples, 50.0),
                pct(samples, 99.0)
            ))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
            });
    }
    // The peers' published medians for the same strict-handoff workload.
    for (name, us) in [
        ("python-redis-lock p50 68 µs", 68.0),
        ("rslock p50 10.9 ms", 10_900.0),
    ] {
        if us < max * 1.2 {
            chart
                .draw_series(std::iter::once(Circle::new((us, 0.5), 5, BLACK.filled())))
                .map_err(|e| e.to_string())?
                .label(name)
                .legend(|(x, y)| Circle::new((x + 10, y), 4, BLACK.filled()));
        }
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE.mix(0.9))
        .position(SeriesLabelPosition::LowerRight)
        .draw()
        .map_err(|e| e.to_string())?;
    root.present().map_err(|e| e.to_string())
}
