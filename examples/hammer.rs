//! Cross-process exclusion check: run several of these against one Redis and the counter
//! must come out exact.
//!
//! ```sh
//! cargo run --release --example hammer -- --url redis://127.0.0.1:6379 \
//!     --name hammer --iters 1000 --counter-key hammer:counter [--lease-ms 5000]
//! ```
//!
//! Each iteration locks NAME (waiting as long as needed; watchdog unless `--lease-ms`),
//! reads the counter with `GET`, sleeps about 200 µs, writes it back plus one with `SET`,
//! and unlocks. Without mutual exclusion, concurrent processes lose increments. Exits 0
//! when done, 1 with a message on any lock error (including a lost lock).

use std::process::ExitCode;
use std::time::Duration;

use redis::AsyncCommands;
use tower_lock::{Lease, LockClient, RedisBackend};

struct Args {
    url: String,
    name: String,
    iters: u64,
    counter_key: String,
    lease: Option<Duration>,
}

const USAGE: &str = "usage: hammer --url URL --name NAME --iters N --counter-key K [--lease-ms L]";

fn parse_args() -> Result<Args, String> {
    let mut url = None;
    let mut name = None;
    let mut iters = None;
    let mut counter_key = None;
    let mut lease = None;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--url" => url = Some(value()?),
            "--name" => name = Some(value()?),
            "--iters" => {
                iters = Some(
                    value()?
                        .parse::<u64>()
                        .map_err(|e| format!("--iters: {e}"))?,
                );
            }
            "--counter-key" => counter_key = Some(value()?),
            "--lease-ms" => {
                let ms = value()?
                    .parse::<u64>()
                    .map_err(|e| format!("--lease-ms: {e}"))?;
                lease = Some(Duration::from_millis(ms));
            }
            "-h" | "--help" => return Err(USAGE.to_owned()),
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    Ok(Args {
        url: url.ok_or("--url is required")?,
        name: name.ok_or("--name is required")?,
        iters: iters.ok_or("--iters is required")?,
        counter_key: counter_key.ok_or("--counter-key is required")?,
        lease,
    })
}

async fn run(args: Args) -> Result<(), String> {
    let backend = RedisBackend::connect(args.url.as_str())
        .await
        .map_err(|e| format!("connecting to {}: {e}", args.url))?;
    let mut counter = redis::Client::open(args.url.as_str())
        .map_err(|e| format!("counter connection: {e}"))?
        .get_multiplexed_async_connection()
        .await
        .map_err(|e| format!("counter connection: {e}"))?;
    let client = LockClient::new(backend);
    let lock = client
        .get_lock(args.name.as_str())
        .map_err(|e| format!("lock name: {e}"))?;
    let lease = args.lease.map_or(Lease::Watchdog, Lease::Fixed);
    for i in 0..args.iters {
        let guard = lock
            .try_lock_for(Duration::MAX, lease)
            .await
            .map_err(|e| format!("iteration {i}: lock: {e}"))?;
        let value: Option<u64> = counter
            .get(&args.counter_key)
            .await
            .map_err(|e| format!("iteration {i}: GET: {e}"))?;
        tokio::time::sleep(Duration::from_micros(200)).await;
        let () = counter
            .set(&args.counter_key, value.unwrap_or(0) + 1)
            .await
            .map_err(|e| format!("iteration {i}: SET: {e}"))?;
        guard
            .unlock()
            .await
            .map_err(|e| format!("iteration {i}: unlock: {e}"))?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("{message}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("hammer: {message}");
            ExitCode::FAILURE
        }
    }
}
