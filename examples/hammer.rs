//! Cross-process exclusion check: run several of these against one Redis (or one set of
//! RedLock nodes) and the counter must come out exact.
//!
//! ```sh
//! cargo run --release --example hammer -- --url redis://127.0.0.1:6379 \
//!     --name hammer --iters 1000 --counter-key hammer:counter [--lease-ms 5000] \
//!     [--kind lock|fair|write|redlock|permits] [--permits N] [--tasks T] \
//!     [--counter-url URL] [--wait-ms W]
//! ```
//!
//! Each iteration locks NAME (waiting as long as needed, or at most `--wait-ms`; watchdog
//! unless `--lease-ms`), reads the counter with `GET`, sleeps about 200 µs, writes it
//! back plus one with `SET`, and unlocks. Without mutual exclusion, concurrent processes
//! lose increments.
//!
//! - `--kind` picks the lock: `lock` (the reentrant lock, the default), `fair`, `write`
//!   (the write lock of a read-write lock), `redlock` (a reentrant lock held by a
//!   majority of the nodes given as a comma-separated `--url` list), or `permits` (one
//!   of `--permits N` permits). Permits admit N holders, so instead of the read-modify-
//!   write each iteration records how many holders are inside at once: it `INCR`s
//!   `K:inside`, raises `K:max` to that value, sleeps, `DECR`s `K:inside`, and `INCR`s K.
//! - `--counter-url` is where the counter lives (default: the first `--url`).
//! - `--tasks T` runs T concurrent workers of `--iters` iterations each (default 1).
//!
//! Exits 0 when done, 1 with a message on stderr on any lock error (a lost lock, a wait
//! that ran out, no RedLock quorum), 2 on bad arguments.

use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, ValueEnum};
use redis::AsyncCommands;
use tower_lock::kinds::RedLock;
use tower_lock::{Lease, Lock, LockClient, RedisBackend};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Kind {
    /// The reentrant lock.
    Lock,
    /// The fair lock.
    Fair,
    /// The write lock of a read-write lock.
    Write,
    /// A reentrant lock held by a majority of the `--url` nodes.
    #[value(name = "redlock")]
    RedLock,
    /// One of `--permits N` permits.
    Permits,
}

/// Cross-process exclusion check: run several against one Redis and the counter must
/// come out exact.
#[derive(Parser)]
#[command(name = "hammer", args_override_self = true)]
struct Cli {
    /// The Redis server, or a comma-separated list of RedLock nodes (with `--kind redlock`).
    #[arg(long, value_name = "URL[,URL...]")]
    url: String,
    /// Where the counter lives (default: the first `--url`).
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
}

fn millis(value: &str) -> Result<Duration, std::num::ParseIntError> {
    value.parse().map(Duration::from_millis)
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
}

/// The parsed command line, with the checks that span several flags.
fn parse_args() -> Result<Args, String> {
    let cli = Cli::parse();
    let urls: Vec<String> = cli
        .url
        .split(',')
        .filter(|u| !u.is_empty())
        .map(str::to_owned)
        .collect();
    if urls.is_empty() {
        return Err("--url needs at least one URL".to_owned());
    }
    if cli.kind != Kind::RedLock && urls.len() > 1 {
        return Err("several --url values are RedLock nodes: use --kind redlock".to_owned());
    }
    let permits = match (cli.kind, cli.permits) {
        (Kind::Permits, Some(n)) if n > 0 => n,
        (Kind::Permits, _) => return Err("--kind permits needs --permits N (N > 0)".to_owned()),
        (_, Some(_)) => return Err("--permits goes with --kind permits".to_owned()),
        (_, None) => 1,
    };
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
    })
}

async fn connect(url: &str) -> Result<RedisBackend, String> {
    RedisBackend::connect(url)
        .await
        .map_err(|e| format!("connecting to {url}: {e}"))
}

async fn client(args: &Args) -> Result<LockClient, String> {
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
                .map_err(|e| format!("node {url}: {e}"))?;
            nodes.push(node);
        }
        let redlock = RedLock::new(nodes).map_err(|e| format!("redlock: {e}"))?;
        return Ok(LockClient::new(redlock));
    }
    Ok(LockClient::new(connect(&args.urls[0]).await?))
}

fn lock_of(client: &LockClient, args: &Args) -> Result<Lock, tower_lock::Error> {
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

async fn work(
    lock: Lock,
    mut counter: redis::aio::MultiplexedConnection,
    args: &Args,
) -> Result<(), String> {
    let lease = args.lease.map_or(Lease::Watchdog, Lease::Fixed);
    let wait = args.wait.unwrap_or(Duration::MAX);
    let key = args.counter_key.as_str();
    let (inside, most) = (format!("{key}:inside"), format!("{key}:max"));
    let enter = redis::Script::new(ENTER);
    for i in 0..args.iters {
        let guard = lock
            .try_lock_for(wait, lease)
            .await
            .map_err(|e| format!("iteration {i}: lock: {e}"))?;
        if args.kind == Kind::Permits {
            let _: i64 = enter
                .key(&inside)
                .key(&most)
                .invoke_async(&mut counter)
                .await
                .map_err(|e| format!("iteration {i}: enter: {e}"))?;
            tokio::time::sleep(Duration::from_micros(500)).await;
            let () = redis::pipe()
                .decr(&inside, 1)
                .ignore()
                .incr(key, 1)
                .ignore()
                .query_async(&mut counter)
                .await
                .map_err(|e| format!("iteration {i}: leave: {e}"))?;
        } else {
            let value: Option<u64> = counter
                .get(key)
                .await
                .map_err(|e| format!("iteration {i}: GET: {e}"))?;
            tokio::time::sleep(Duration::from_micros(200)).await;
            let () = counter
                .set(key, value.unwrap_or(0) + 1)
                .await
                .map_err(|e| format!("iteration {i}: SET: {e}"))?;
        }
        guard
            .unlock()
            .await
            .map_err(|e| format!("iteration {i}: unlock: {e}"))?;
    }
    Ok(())
}

async fn run(args: Args) -> Result<(), String> {
    let client = client(&args).await?;
    let counter_url = args.counter_url.as_deref().unwrap_or(&args.urls[0]);
    let counter = redis::Client::open(counter_url)
        .map_err(|e| format!("counter connection: {e}"))?
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("counter connection to {counter_url}: {e}"))?;
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
