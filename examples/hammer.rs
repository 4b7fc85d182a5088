//! Cross-process exclusion check: run several of these against one Redis (or one set of
//! RedLock nodes, or one PostgreSQL, MySQL or MariaDB database) and the counter must come
//! out exact.
//!
//! ```sh
//! cargo run --release --example hammer -- --url redis://127.0.0.1:6379 \
//!     --name hammer --iters 1000 --counter-key hammer:counter [--lease-ms 5000] \
//!     [--kind lock|fair|write|redlock|permits] [--permits N] [--tasks T] \
//!     [--counter-url URL] [--wait-ms W] [--watchdog-ms L] [--hold-us H]
//! cargo run --release --features cluster --example hammer -- --cluster \
//!     --url redis://127.0.0.1:7000,redis://127.0.0.1:7001 --counter-url postgres://... \
//!     --name '{h}' --iters 1000 --counter-key h:counter
//! cargo run --release --example hammer -- --url postgres://root@127.0.0.1:5432/app \
//!     --name hammer --iters 1000 --counter-key hammer:counter
//! cargo run --release --example hammer -- --url mysql://root@127.0.0.1:3306/test \
//!     --name hammer --iters 1000 --counter-key hammer:counter
//! cargo run --release --features zookeeper --example hammer -- \
//!     --url zk://127.0.0.1:2181 --zk-root /locks --counter-url file:/tmp/counter \
//!     --name hammer --iters 1000 --counter-key hammer --events
//! ```
//!
//! Each iteration locks NAME (waiting as long as needed, or at most `--wait-ms`; watchdog
//! unless `--lease-ms`), reads the counter, sleeps `--hold-us` (default 200 µs), writes
//! it back plus one, and unlocks. The read and the write are two separate commands, so
//! only the lock makes the count exact: without mutual exclusion, concurrent processes
//! lose increments.
//!
//! - `--url` picks the backend by its scheme: `redis://` (or `rediss://`) for
//!   [`RedisBackend`], `redis+sentinel://host:26379,host2:26379/mymaster[/db]` for
//!   [`RedisBackend`] on the primary those Sentinels name (with the `sentinel` feature;
//!   see [`RedisBackend::from_url`]), `postgres://` (or `postgresql://`) for [`PostgresBackend`] on a
//!   pool of `--tasks` connections (and one more that listens for releases), with its
//!   tables created if missing; `mysql://` (or `mariadb://`) for [`MySqlBackend`] the
//!   same way; `zk://host:port[,host:port][/chroot]` for `ZooKeeperBackend` (with the
//!   `zookeeper` feature), under `--zk-root` (the lock NAME is Curator's path
//!   `<root>/NAME`), with `--session-ms`.
//! - `--cluster` (with the `cluster` feature): the `--url` list is the seed nodes of one
//!   Redis Cluster, and the locks are taken there ([`RedisBackend::cluster`]); the
//!   counter then needs a `--counter-url` of its own.
//! - `--counter-url` is where the counter lives (default: the first `--url`), on either
//!   kind of server. On Redis the counter is the string K, read with `GET` and written
//!   with `SET`. On PostgreSQL it is the row K of the table `hammer_counter` (created if
//!   missing), read with a `SELECT` and written with an upsert; the same statement as
//!   the write appends `(key, value, pid, at)` to `hammer_counter_writes`, so a check
//!   can tell which process wrote which value and when (by the database's clock): with
//!   exclusion, the values written are 1 to N, each once. On MySQL or MariaDB the
//!   same tables, with `at_us` (microseconds since the epoch, by the database's clock,
//!   as the lock table's leases) where PostgreSQL has `at`, and the upsert and the log
//!   written in one transaction. `file:PATH` keeps it in a file (the decimal value),
//!   as the Curator client of the interop tests does, so Java and Rust processes share
//!   one counter (not with `--kind permits`).
//! - `--events` prints `acquired <µs>` when a lock is taken and `released <µs> <µs>`
//!   (before and after the unlock), in microseconds since the epoch, one line each, so
//!   a check can tell that no two holds overlapped; and `lost <µs>` when the lock's lost
//!   signal fires while it is held.
//! - A lock lost while held (its lost signal fired: a lease that ran out, a ZooKeeper
//!   session that expired while the process was frozen) ends the run before the counter
//!   is written, as a careful holder stops: the read-modify-write is given up, and the
//!   count stays exact (not with `--kind permits`, whose holder leaves its count as it
//!   entered).
//! - `--outage-ok`: an unlock the store could not answer (an outage; the release goes on
//!   in the background, as `LockGuard::unlock` says) is reported on stderr and the run
//!   goes on, for runs across a failover. Any other lock error still ends it.
//! - `--kind` picks the lock: `lock` (the reentrant lock, the default), `fair`, `write`
//!   (the write lock of a read-write lock), `redlock` (a reentrant lock held by a
//!   majority of the Redis nodes given as a comma-separated `--url` list), or `permits`
//!   (one of `--permits N` permits). Permits admit N holders, so instead of the read-
//!   modify-write each iteration records how many holders are inside at once: it
//!   increments `K:inside`, raises `K:max` to that value, sleeps (`--hold-us`, default
//!   500 µs), decrements `K:inside`, and increments K.
//! - `--tasks T` runs T concurrent workers of `--iters` iterations each (default 1).
//! - `--watchdog-ms L` sets the watchdog lease (default: the backend's, else 30 s): a
//!   process killed while it holds the lock keeps it for at most L.
//!
//! Exits 0 when done, 1 with a message on stderr on any lock or counter error (a lost
//! lock, a wait that ran out, no RedLock quorum, a server gone), 2 on bad arguments.

#[path = "shared/shown.rs"]
mod shown;
use shown::shown;
use std::process::ExitCode;
use std::sync::LazyLock;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};
use redis::AsyncCommands;
use sqlx::mysql::{MySqlPool, MySqlPoolOptions};
use sqlx::postgres::{PgPool, PgPoolOptions};
use tower_lock::backend::LockBackend;
use tower_lock::backend::redlock::RedLock;
use tower_lock::{Lease, Lock, LockClient, MySqlBackend, PostgresBackend, RedisBackend};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// The reentrant lock.
    Lock,
    /// The fair lock.
    Fair,
    /// The write lock of a read-write lock.
    Write,
    /// A reentrant lock held by a majority of the `--url` nodes (Redis).
    #[value(name = "redlock")]
    RedLock,
    /// One of `--permits N` permits.
    Permits,
}

/// Cross-process exclusion check: run several against one Redis, PostgreSQL or MySQL and
/// the counter must come out exact.
#[derive(Parser)]
#[command(name = "hammer", args_override_self = true)]
struct Cli {
    /// The Redis server, PostgreSQL or MySQL/MariaDB database, or a comma-separated list
    /// of RedLock nodes (with `--kind redlock`).
    #[arg(long, value_name = "URL[,URL...]")]
    url: String,
    /// Where the counter lives, Redis, PostgreSQL or MySQL (default: the first `--url`).
    #[arg(long, value_name = "URL")]
    counter_url: Option<String>,
    /// The lock's name.
    #[arg(long)]
    name: String,
    /// Iterations per task.
    #[arg(long, value_name = "N")]
    iters: u64,
    /// The counter's key.
    #[arg(long, value_name = "K")]
    counter_key: String,
    /// A fixed lease in milliseconds (default: the watchdog).
    #[arg(long = "lease-ms", value_name = "L", value_parser = millis)]
    lease: Option<Duration>,
    /// Which lock to take.
    #[arg(long, value_enum, default_value_t = Kind::Lock)]
    kind: Kind,
    /// How many permits (`--kind permits` only; N > 0).
    #[arg(long, value_name = "N")]
    permits: Option<u32>,
    /// Give up on a lock after this many milliseconds (exit 1) (default: wait as long as
    /// needed).
    #[arg(long = "wait-ms", value_name = "W", value_parser = millis)]
    wait: Option<Duration>,
    /// Concurrent workers of `--iters` iterations each (0 counts as 1).
    #[arg(long, value_name = "T", default_value_t = 1)]
    tasks: u64,
    /// The watchdog lease in milliseconds (default: the backend's, else 30 s).
    #[arg(long = "watchdog-ms", value_name = "L", value_parser = millis)]
    watchdog: Option<Duration>,
    /// Microseconds between the read and the write, with the lock held (default 200;
    /// 500 for permits).
    #[arg(long = "hold-us", value_name = "H", value_parser = micros)]
    hold: Option<Duration>,
    /// PostgreSQL: a release hands the lock to the oldest waiter
    /// (`PostgresBackendBuilder::hand_over`).
    #[arg(long)]
    hand_over: bool,
    /// The `--url` list is the seed nodes of one Redis Cluster (`cluster` feature).
    #[arg(long)]
    cluster: bool,
    /// ZooKeeper: the path lock names are put under.
    #[arg(long, value_name = "PATH", default_value = "/tower-lock")]
    zk_root: String,
    /// ZooKeeper: the session timeout in milliseconds.
    #[arg(long = "session-ms", value_name = "S", value_parser = millis)]
    session: Option<Duration>,
    /// Print `acquired`, `released` and `lost` lines with their times.
    #[arg(long)]
    events: bool,
    /// Go on after an unlock the store could not answer (released in the background).
    #[arg(long)]
    outage_ok: bool,
}

fn millis(value: &str) -> Result<Duration, std::num::ParseIntError> {
    value.parse().map(Duration::from_millis)
}

fn micros(value: &str) -> Result<Duration, std::num::ParseIntError> {
    value.parse().map(Duration::from_micros)
}

struct Args {
    urls: Vec<String>,
    counter_url: Option<String>,
    name: String,
    iters: u64,
    counter_key: String,
    lease: Option<Duration>,
    kind: Kind,
    permits: u32,
    wait: Option<Duration>,
    tasks: u64,
    watchdog: Option<Duration>,
    hold: Duration,
    hand_over: bool,
    cluster: bool,
    zk_root: String,
    session: Option<Duration>,
    events: bool,
    outage_ok: bool,
}

fn is_zookeeper(url: &str) -> bool {
    url.starts_with("zk://")
}

fn is_postgres(url: &str) -> bool {
    url.starts_with("postgres://") || url.starts_with("postgresql://")
}

fn is_mysql(url: &str) -> bool {
    url.starts_with("mysql://") || url.starts_with("mariadb://")
}

/// Whether `url` is a database's, not a Redis server's.
fn is_sql(url: &str) -> bool {
    is_postgres(url) || is_mysql(url)
}

/// Whether `url` names a primary by its Sentinels (its commas separate Sentinels, not
/// RedLock nodes).
fn is_sentinel(url: &str) -> bool {
    url.get(..17)
        .is_some_and(|s| s.eq_ignore_ascii_case("redis+sentinel://"))
}

/// A connection to the Redis server at `url`; behind Sentinel, to the primary they name
/// now (the counter does not follow a failover; the locks do).
async fn redis_conn(url: &str) -> Result<redis::aio::MultiplexedConnection, String> {
    let client = if is_sentinel(url) {
        sentinel_primary(url).await?
    } else {
        redis::Client::open(url).map_err(|e| format!("counter connection: {e}"))?
    };
    client
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("counter connection to {}: {e}", shown(url)))
}

#[cfg(feature = "sentinel")]
async fn sentinel_primary(url: &str) -> Result<redis::Client, String> {
    tower_lock::backend::redis::SentinelUrl::parse(url)
        .and_then(|url| url.sentinel_client())
        .map_err(|e| format!("counter connection: {e}"))?
        .async_get_client()
        .await
        .map_err(|e| format!("counter connection: asking the Sentinels: {e}"))
}

#[cfg(not(feature = "sentinel"))]
async fn sentinel_primary(_url: &str) -> Result<redis::Client, String> {
    Err("redis+sentinel:// URLs need the `sentinel` feature".to_owned())
}

/// The parsed command line, with the checks that span several flags.
fn parse_args() -> Result<Args, String> {
    let cli = Cli::parse();
    // Sentinels, and a ZooKeeper ensemble's servers, are one store.
    let urls: Vec<String> = if is_sentinel(&cli.url) || is_zookeeper(&cli.url) {
        vec![cli.url.clone()]
    } else {
        cli.url
            .split(',')
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect()
    };
    if urls.is_empty() {
        return Err("--url needs at least one URL".to_owned());
    }
    if cli.cluster {
        if cli.kind == Kind::RedLock || urls.iter().any(|u| is_sql(u) || is_sentinel(u)) {
            return Err("--cluster takes the redis:// seed nodes of one cluster".to_owned());
        }
        if cli.counter_url.is_none() {
            return Err("--cluster needs a --counter-url of its own".to_owned());
        }
    } else if cli.kind != Kind::RedLock && urls.len() > 1 {
        return Err("several --url values are RedLock nodes: use --kind redlock".to_owned());
    }
    if cli.kind == Kind::Permits
        && cli
            .counter_url
            .as_deref()
            .is_some_and(|u| u.starts_with("file:"))
    {
        return Err("a file: counter cannot count permit holders: use a server".to_owned());
    }
    if cli.kind == Kind::RedLock && urls.iter().any(|u| is_sql(u)) {
        return Err("--kind redlock takes Redis nodes, not database URLs".to_owned());
    }
    let permits = match (cli.kind, cli.permits) {
        (Kind::Permits, Some(n)) if n > 0 => n,
        (Kind::Permits, _) => return Err("--kind permits needs --permits N (N > 0)".to_owned()),
        (_, Some(_)) => return Err("--permits goes with --kind permits".to_owned()),
        (_, None) => 1,
    };
    let hold = cli.hold.unwrap_or(if cli.kind == Kind::Permits {
        Duration::from_micros(500)
    } else {
        Duration::from_micros(200)
    });
    Ok(Args {
        urls,
        counter_url: cli.counter_url,
        name: cli.name,
        iters: cli.iters,
        counter_key: cli.counter_key,
        lease: cli.lease,
        kind: cli.kind,
        permits,
        wait: cli.wait,
        tasks: cli.tasks.max(1),
        watchdog: cli.watchdog,
        hold,
        hand_over: cli.hand_over,
        cluster: cli.cluster,
        zk_root: cli.zk_root,
        session: cli.session,
        events: cli.events,
        outage_ok: cli.outage_ok,
    })
}

/// A pool of `size` connections to the PostgreSQL database at `url`.
async fn pg_pool(url: &str, size: u64) -> Result<PgPool, String> {
    PgPoolOptions::new()
        .max_connections(u32::try_from(size).unwrap_or(u32::MAX))
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))
}

/// A pool of `size` connections to the MySQL or MariaDB database at `url`.
async fn my_pool(url: &str, size: u64) -> Result<MySqlPool, String> {
    MySqlPoolOptions::new()
        .max_connections(u32::try_from(size).unwrap_or(u32::MAX))
        .acquire_timeout(Duration::from_secs(10))
        .connect(url)
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))
}

/// A client on `backend`, with `--watchdog-ms` when given.
fn client_on(backend: impl LockBackend, args: &Args) -> Result<LockClient, String> {
    let mut builder = LockClient::builder(backend);
    if let Some(lease) = args.watchdog {
        builder = builder.watchdog_lease(lease);
    }
    builder.build().map_err(|e| format!("lock client: {e}"))
}

#[cfg(feature = "cluster")]
async fn cluster_client(args: &Args) -> Result<LockClient, String> {
    let backend = RedisBackend::cluster(args.urls.iter().map(String::as_str))
        .build()
        .await
        .map_err(|e| format!("connecting to the cluster at {}: {e}", args.urls.join(",")))?;
    client_on(backend, args)
}

#[cfg(not(feature = "cluster"))]
async fn cluster_client(_args: &Args) -> Result<LockClient, String> {
    Err("--cluster needs the `cluster` feature".to_owned())
}

#[cfg(feature = "zookeeper")]
async fn zookeeper_client(url: &str, args: &Args) -> Result<LockClient, String> {
    let mut builder = tower_lock::ZooKeeperBackend::builder(url.trim_start_matches("zk://"))
        .root(args.zk_root.as_str());
    if let Some(session) = args.session {
        builder = builder.session_timeout(session);
    }
    let backend = builder
        .build()
        .await
        .map_err(|e| format!("ZooKeeper locks at {}: {e}", shown(url)))?;
    client_on(backend, args)
}

#[cfg(not(feature = "zookeeper"))]
async fn zookeeper_client(_url: &str, _args: &Args) -> Result<LockClient, String> {
    Err("zk:// URLs need the `zookeeper` feature".to_owned())
}

async fn client(args: &Args) -> Result<LockClient, String> {
    if args.cluster {
        return cluster_client(args).await;
    }
    let url = &args.urls[0];
    if args.kind == Kind::RedLock {
        let mut nodes = Vec::new();
        for url in &args.urls {
            // A node that is down should cost one refused connection per call, not a
            // chain of reconnection attempts, and must not keep the process from
            // starting: the other nodes carry the quorum, and it rejoins when it is back.
            let node = RedisBackend::builder(url.as_str())
                .reconnect_retries(0)
                .lazy_connect(true)
                .build()
                .await
                .map_err(|e| format!("node {}: {e}", shown(url)))?;
            nodes.push(node);
        }
        let redlock = RedLock::new(nodes).map_err(|e| format!("redlock: {e}"))?;
        return client_on(redlock, args);
    }
    if is_postgres(url) {
        // One connection per task (the backend's listener makes its own).
        let pool = pg_pool(url, args.tasks.max(1)).await?;
        let backend = PostgresBackend::builder(pool)
            .hand_over(args.hand_over)
            .build()
            .await
            .map_err(|e| format!("PostgreSQL locks at {}: {e}", shown(url)))?;
        return client_on(backend, args);
    }
    if is_zookeeper(url) {
        return zookeeper_client(url, args).await;
    }
    if is_mysql(url) {
        if args.hand_over {
            return Err("--hand-over is PostgreSQL's (MySqlBackend has no hand-over)".to_owned());
        }
        // One connection per task (the backend's listener makes its own).
        let pool = my_pool(url, args.tasks.max(1)).await?;
        let backend = MySqlBackend::builder(pool)
            .build()
            .await
            .map_err(|e| format!("MySQL locks at {}: {e}", shown(url)))?;
        return client_on(backend, args);
    }
    let backend = RedisBackend::from_url(url)
        .build()
        .await
        .map_err(|e| format!("connecting to {}: {e}", shown(url)))?;
    client_on(backend, args)
}

fn lock_of(client: &LockClient, args: &Args) -> Result<Lock, tower_lock::ConfigError> {
    let name = args.name.as_str();
    match args.kind {
        Kind::Lock | Kind::RedLock => client.get_lock(name),
        Kind::Fair => client.get_fair_lock(name),
        Kind::Write => Ok(client.get_read_write_lock(name)?.write_lock()),
        Kind::Permits => client.get_permits(name, args.permits),
    }
}

/// Raises `KEYS[2]` to the value of `KEYS[1]` after incrementing it; returns that value.
const ENTER: &str = "local n = redis.call('incr', KEYS[1]) \
    if n > tonumber(redis.call('get', KEYS[2]) or '0') then redis.call('set', KEYS[2], n) end \
    return n";

/// The PostgreSQL counter's tables; one transaction behind an advisory lock, as
/// concurrent `CREATE TABLE IF NOT EXISTS` from several processes can collide.
const PG_SCHEMA: &str = "SELECT pg_advisory_xact_lock(hashtext('hammer_counter'));
CREATE TABLE IF NOT EXISTS hammer_counter (key text PRIMARY KEY, value bigint NOT NULL);
CREATE TABLE IF NOT EXISTS hammer_counter_writes (
    key text NOT NULL,
    value bigint NOT NULL,
    pid integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp()
);";

const PG_READ: &str = "SELECT value FROM hammer_counter WHERE key = $1";

/// Sets K to $2 and logs the write, in one statement.
const PG_WRITE: &str = "WITH w AS (
    INSERT INTO hammer_counter (key, value) VALUES ($1, $2)
    ON CONFLICT (key) DO UPDATE SET value = excluded.value RETURNING key)
INSERT INTO hammer_counter_writes (key, value, pid) SELECT key, $2, $3 FROM w";

/// Increments `$1` (K:inside) and raises `$2` (K:max) to its new value.
const PG_ENTER: &str = "WITH n AS (
    INSERT INTO hammer_counter (key, value) VALUES ($1, 1)
    ON CONFLICT (key) DO UPDATE SET value = hammer_counter.value + 1 RETURNING value)
INSERT INTO hammer_counter (key, value) SELECT $2, value FROM n
ON CONFLICT (key) DO UPDATE SET value = greatest(hammer_counter.value, excluded.value)";

/// Decrements `$1` (K:inside) and increments `$2` (K).
const PG_LEAVE: &str = "WITH d AS (
    UPDATE hammer_counter SET value = value - 1 WHERE key = $1 RETURNING value)
INSERT INTO hammer_counter (key, value) VALUES ($2, 1)
ON CONFLICT (key) DO UPDATE SET value = hammer_counter.value + 1";

/// The MySQL counter's tables, as PostgreSQL's (`key` quoted: a reserved word there).
/// A `CREATE TABLE IF NOT EXISTS` is atomic in InnoDB: processes starting together need
/// no lock around them.
const MY_SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS hammer_counter (
        `key` VARCHAR(255) NOT NULL PRIMARY KEY,
        value BIGINT NOT NULL
    ) ENGINE=InnoDB",
    "CREATE TABLE IF NOT EXISTS hammer_counter_writes (
        `key` VARCHAR(255) NOT NULL,
        value BIGINT NOT NULL,
        pid   INT NOT NULL,
        at_us BIGINT NOT NULL
    ) ENGINE=InnoDB",
];

const MY_READ: &str = "SELECT value FROM hammer_counter WHERE `key` = ?";

/// Sets `?1` to `?2` (the first half of PostgreSQL's `PG_WRITE`).
const MY_SET: &str = "INSERT INTO hammer_counter (`key`, value) VALUES (?, ?) \
    ON DUPLICATE KEY UPDATE value = VALUES(value)";

/// Logs the write (the second half), stamped by the database's clock.
const MY_LOG: &str = "INSERT INTO hammer_counter_writes (`key`, value, pid, at_us) \
    VALUES (?, ?, ?, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)))";

/// Adds `?2` to `?1`, creating it at `?2`.
const MY_ADD: &str = "INSERT INTO hammer_counter (`key`, value) VALUES (?, ?) \
    ON DUPLICATE KEY UPDATE value = value + VALUES(value)";

/// Raises `?1` (K:max) to the value of `?2` (K:inside).
const MY_RAISE: &str = "INSERT INTO hammer_counter (`key`, value) \
    SELECT ?, inside.value FROM hammer_counter inside WHERE inside.`key` = ? \
    ON DUPLICATE KEY UPDATE value = GREATEST(hammer_counter.value, VALUES(value))";

/// Where the counter lives.
#[derive(Clone)]
enum Counter {
    Redis(redis::aio::MultiplexedConnection),
    Postgres(PgPool),
    MySql(MySqlPool),
    /// `file:PATH`: the value in a file (`--counter-key` is not used).
    File(std::path::PathBuf),
}

/// Runs `statements` (each with its binds) in one transaction on `pool`, once more
/// after a deadlock (permit holders enter and leave at once, and InnoDB may pick one of
/// two upserts of one new row as a victim, which applied nothing).
async fn my_transaction(
    pool: &MySqlPool,
    statements: &[(&str, &[MyValue<'_>])],
) -> Result<(), sqlx::Error> {
    let mut tries = 0;
    loop {
        let mut tx = pool.begin().await?;
        let mut outcome = Ok(());
        for (sql, binds) in statements {
            let mut query = sqlx::query(sql);
            for bind in *binds {
                query = match *bind {
                    MyValue::Text(text) => query.bind(text),
                    MyValue::Int(n) => query.bind(n),
                };
            }
            if let Err(e) = query.execute(&mut *tx).await {
                outcome = Err(e);
                break;
            }
        }
        let outcome = match outcome {
            Ok(()) => tx.commit().await,
            Err(e) => Err(e),
        };
        // SQLSTATE 40001: a deadlock's victim (a lock wait that timed out is HY000).
        let deadlock = matches!(&outcome, Err(sqlx::Error::Database(db))
            if db.code().as_deref() == Some("40001"));
        tries += 1;
        if !deadlock || tries == 5 {
            return outcome;
        }
    }
}

/// A bind of [`my_transaction`]'s statements.
#[derive(Clone, Copy)]
enum MyValue<'a> {
    Text(&'a str),
    Int(i64),
}

impl Counter {
    async fn connect(url: &str, tasks: u64) -> Result<Self, String> {
        if let Some(path) = url.strip_prefix("file:") {
            return Ok(Counter::File(path.into()));
        }
        if is_zookeeper(url) {
            return Err("the counter cannot live in ZooKeeper: give --counter-url".to_owned());
        }
        if is_postgres(url) {
            let pool = pg_pool(url, tasks).await?;
            sqlx::raw_sql(PG_SCHEMA)
                .execute(&pool)
                .await
                .map_err(|e| format!("creating the counter table at {}: {e}", shown(url)))?;
            return Ok(Counter::Postgres(pool));
        }
        if is_mysql(url) {
            let pool = my_pool(url, tasks).await?;
            for statement in MY_SCHEMA {
                sqlx::query(statement)
                    .execute(&pool)
                    .await
                    .map_err(|e| format!("creating the counter table at {}: {e}", shown(url)))?;
            }
            return Ok(Counter::MySql(pool));
        }
        Ok(Counter::Redis(redis_conn(url).await?))
    }

    /// The counter's value (0 when unset).
    async fn read(&mut self, key: &str) -> Result<u64, String> {
        match self {
            Counter::Redis(conn) => {
                let value: Option<u64> = conn.get(key).await.map_err(|e| format!("GET: {e}"))?;
                Ok(value.unwrap_or(0))
            }
            Counter::Postgres(pool) => {
                let value: Option<i64> = sqlx::query_scalar(PG_READ)
                    .bind(key)
                    .fetch_optional(&*pool)
                    .await
                    .map_err(|e| format!("SELECT: {e}"))?;
                u64::try_from(value.unwrap_or(0)).map_err(|_| "a negative counter".to_owned())
            }
            Counter::MySql(pool) => {
                let value: Option<i64> = sqlx::query_scalar(MY_READ)
                    .bind(key)
                    .fetch_optional(&*pool)
                    .await
                    .map_err(|e| format!("SELECT: {e}"))?;
                u64::try_from(value.unwrap_or(0)).map_err(|_| "a negative counter".to_owned())
            }
            Counter::File(path) => match tokio::fs::read_to_string(&*path).await {
                Ok(text) if text.trim().is_empty() => Ok(0),
                Ok(text) => text
                    .trim()
                    .parse()
                    .map_err(|e| format!("the counter file holds {text:?}: {e}")),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(0),
                Err(e) => Err(format!("reading {}: {e}", path.display())),
            },
        }
    }

    async fn write(&mut self, key: &str, value: u64) -> Result<(), String> {
        match self {
            Counter::Redis(conn) => conn.set(key, value).await.map_err(|e| format!("SET: {e}")),
            Counter::Postgres(pool) => {
                let value = i64::try_from(value).map_err(|_| "the counter overflowed")?;
                sqlx::query(PG_WRITE)
                    .bind(key)
                    .bind(value)
                    .bind(std::process::id().cast_signed())
                    .execute(&*pool)
                    .await
                    .map_err(|e| format!("UPDATE: {e}"))?;
                Ok(())
            }
            Counter::MySql(pool) => {
                let value = i64::try_from(value).map_err(|_| "the counter overflowed")?;
                let pid = i64::from(std::process::id());
                let (key, value) = (MyValue::Text(key), MyValue::Int(value));
                my_transaction(
                    pool,
                    &[
                        (MY_SET, &[key, value]),
                        (MY_LOG, &[key, value, MyValue::Int(pid)]),
                    ],
                )
                .await
                .map_err(|e| format!("UPDATE: {e}"))
            }
            Counter::File(path) => tokio::fs::write(&*path, value.to_string())
                .await
                .map_err(|e| format!("writing {}: {e}", path.display())),
        }
    }

    async fn enter(&mut self, inside: &str, most: &str) -> Result<(), String> {
        match self {
            Counter::Redis(conn) => {
                static SCRIPT: LazyLock<redis::Script> =
                    LazyLock::new(|| redis::Script::new(ENTER));
                let _: i64 = SCRIPT
                    .key(inside)
                    .key(most)
                    .invoke_async(conn)
                    .await
                    .map_err(|e| format!("enter: {e}"))?;
            }
            Counter::Postgres(pool) => {
                sqlx::query(PG_ENTER)
                    .bind(inside)
                    .bind(most)
                    .execute(&*pool)
                    .await
                    .map_err(|e| format!("enter: {e}"))?;
            }
            Counter::MySql(pool) => {
                let (inside, most) = (MyValue::Text(inside), MyValue::Text(most));
                my_transaction(
                    pool,
                    &[
                        (MY_ADD, &[inside, MyValue::Int(1)]),
                        (MY_RAISE, &[most, inside]),
                    ],
                )
                .await
                .map_err(|e| format!("enter: {e}"))?;
            }
            Counter::File(_) => return Err("a file counter has no permit count".to_owned()),
        }
        Ok(())
    }

    async fn leave(&mut self, inside: &str, key: &str) -> Result<(), String> {
        match self {
            Counter::Redis(conn) => redis::pipe()
                .decr(inside, 1)
                .ignore()
                .incr(key, 1)
                .ignore()
                .query_async(conn)
                .await
                .map_err(|e| format!("leave: {e}")),
            Counter::Postgres(pool) => {
                sqlx::query(PG_LEAVE)
                    .bind(inside)
                    .bind(key)
                    .execute(&*pool)
                    .await
                    .map_err(|e| format!("leave: {e}"))?;
                Ok(())
            }
            Counter::MySql(pool) => {
                let (inside, key) = (MyValue::Text(inside), MyValue::Text(key));
                my_transaction(
                    pool,
                    &[
                        (MY_ADD, &[inside, MyValue::Int(-1)]),
                        (MY_ADD, &[key, MyValue::Int(1)]),
                    ],
                )
                .await
                .map_err(|e| format!("leave: {e}"))
            }
            Counter::File(_) => Err("a file counter has no permit count".to_owned()),
        }
    }
}

/// Microseconds since the epoch, for `--events`.
fn epoch_micros() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

async fn work(lock: Lock, mut counter: Counter, args: &Args) -> Result<(), String> {
    let lease = args.lease.map_or(Lease::Watchdog, Lease::Fixed);
    let wait = args.wait.unwrap_or(Duration::MAX);
    let key = args.counter_key.as_str();
    let (inside, most) = (format!("{key}:inside"), format!("{key}:max"));
    for i in 0..args.iters {
        let guard = lock
            .try_lock_for(wait, lease)
            .await
            .map_err(|e| format!("iteration {i}: lock: {e}"))?;
        if args.events {
            println!("acquired {}", epoch_micros());
        }
        if args.kind == Kind::Permits {
            counter
                .enter(&inside, &most)
                .await
                .map_err(|e| format!("iteration {i}: {e}"))?;
            tokio::time::sleep(args.hold).await;
            counter
                .leave(&inside, key)
                .await
                .map_err(|e| format!("iteration {i}: {e}"))?;
        } else {
            let value = counter
                .read(key)
                .await
                .map_err(|e| format!("iteration {i}: {e}"))?;
            // The hold, cut short by the lost signal; and nothing written once it fired.
            let lost = guard.lost();
            let gone = tokio::select! {
                () = tokio::time::sleep(args.hold) => lost.is_lost(),
                () = lost.wait() => true,
            };
            if gone {
                if args.events {
                    println!("lost {}", epoch_micros());
                }
                return Err(format!(
                    "iteration {i}: the lock was lost while held; the counter was not written"
                ));
            }
            counter
                .write(key, value + 1)
                .await
                .map_err(|e| format!("iteration {i}: {e}"))?;
        }
        let letting_go = epoch_micros();
        match guard.unlock().await {
            Ok(()) => {}
            Err(e) if args.outage_ok && e.is_unavailable() => {
                eprintln!("hammer: iteration {i}: unlock: {e}; released in the background");
            }
            Err(e) => return Err(format!("iteration {i}: unlock: {e}")),
        }
        if args.events {
            println!("released {letting_go} {}", epoch_micros());
        }
    }
    Ok(())
}

async fn run(args: Args) -> Result<(), String> {
    let client = client(&args).await?;
    let counter_url = args.counter_url.as_deref().unwrap_or(&args.urls[0]);
    let counter = Counter::connect(counter_url, args.tasks).await?;
    let lock = lock_of(&client, &args).map_err(|e| format!("lock name: {e}"))?;
    let workers = (0..args.tasks).map(|_| work(lock.clone(), counter.clone(), &args));
    for outcome in futures_util::future::join_all(workers).await {
        outcome?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        // Exits 2, as clap does for the errors it finds itself.
        Err(message) => Cli::command()
            .error(clap::error::ErrorKind::ArgumentConflict, message)
            .exit(),
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("hammer: {message}");
            ExitCode::FAILURE
        }
    }
}
