//! A queue consumer that charges each order once, though its queue delivers every
//! message at least twice: `LockClient::idempotent` runs the charge once per message
//! and gives every later delivery the same receipt.
//!
//! ```sh
//! cargo run --example queue_consumer                     # in memory
//! REDIS_URL=redis://127.0.0.1:6379 cargo run --example queue_consumer
//! DATABASE_URL=postgres://root@127.0.0.1:5432/test cargo run --example queue_consumer
//! cargo run --example queue_consumer -- --messages 2000 --workers 16 --cut-per-mille 100
//! ```
//!
//! A pool of `--workers` takes deliveries from an in-process queue holding each of
//! `--messages` messages `--deliveries` times (default 2), in a seeded random order. A
//! worker whose handling is cut short (`--cut-per-mille`, as a visibility timeout would)
//! or that finds another run of its message in flight puts the message back. At the
//! end it checks, per message: every delivery answered, at most one receipt kept, every
//! replay equal to it. It prints one JSON line and exits 1 if the check fails. Its keys
//! carry a run id of their own, and the receipts are kept for a minute.

#[path = "shared/consumer.rs"]
mod consumer;
#[path = "shared/shown.rs"]
mod shown;

use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use shown::shown;
use tower_lock::{LockClient, MemoryBackend, PostgresBackend, RedisBackend};

/// Charges each order once from a queue that delivers every message at least twice.
#[derive(Parser, Debug)]
struct Args {
    /// The lock store: Redis (the results and locks there).
    #[arg(long, env = "REDIS_URL", value_name = "URL", hide_env_values = true)]
    redis_url: Option<String>,
    /// The lock store: PostgreSQL, when no Redis URL is given.
    #[arg(long, env = "DATABASE_URL", value_name = "URL", hide_env_values = true)]
    database_url: Option<String>,
    /// Messages to charge.
    #[arg(long, default_value_t = 500)]
    messages: u64,
    /// Workers taking messages at once.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Deliveries of each message (at least 2).
    #[arg(long, default_value_t = 2, value_parser = clap::value_parser!(u64).range(2..=100))]
    deliveries: u64,
    /// Per mille of handlings cut short mid-work (redelivered).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=900))]
    cut_per_mille: u32,
    /// The seed of the delivery order, the work's durations and the cuts.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

async fn client(args: &Args) -> Result<(LockClient, &'static str), String> {
    if let Some(url) = &args.redis_url {
        let backend = RedisBackend::from_url(url)
            .build()
            .await
            .map_err(|e| format!("connecting to {}: {e}", shown(url)))?;
        return Ok((LockClient::new(backend), "redis"));
    }
    if let Some(url) = &args.database_url {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(u32::try_from(args.workers + 4).unwrap_or(u32::MAX))
            .acquire_timeout(Duration::from_secs(10))
            .connect(url)
            .await
            .map_err(|e| format!("connecting to {}: {e}", shown(url)))?;
        let backend = PostgresBackend::builder(pool)
            .build()
            .await
            .map_err(|e| format!("PostgreSQL locks at {}: {e}", shown(url)))?;
        return Ok((LockClient::new(backend), "postgres"));
    }
    Ok((LockClient::new(MemoryBackend::new()), "memory"))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let (client, store) = match client(&args).await {
        Ok(client) => client,
        Err(e) => {
            eprintln!("queue_consumer: {e}");
            return ExitCode::FAILURE;
        }
    };
    let plan = consumer::Plan {
        messages: args.messages,
        workers: args.workers.max(1),
        deliveries: usize::try_from(args.deliveries).unwrap_or(2),
        cut_per_mille: args.cut_per_mille,
        max_wait: Duration::from_secs(5),
        seed: args.seed,
        // Long enough for every redelivery; the store forgets the run a minute later.
        ttl: Duration::from_secs(60),
        run: uuid::Uuid::new_v4().simple().to_string(),
    };
    let started = Instant::now();
    let report = consumer::consume(std::slice::from_ref(&client), &plan).await;
    let elapsed = started.elapsed();
    let verdict = consumer::check(&plan, &report);
    if let Err(e) = client.shutdown().await {
        eprintln!("queue_consumer: shutting the lock client down: {e}");
    }
    let count = |kind: consumer::Kind| {
        report
            .outcomes
            .values()
            .flatten()
            .filter(|(k, _)| *k == kind)
            .count()
    };
    println!(
        "{{\"store\":\"{store}\",\"messages\":{},\"deliveries\":{},\"ran\":{},\"replayed\":{},\"unkept\":{},\"charges\":{},\"redelivered\":{},\"failed\":{},\"elapsed_ms\":{},\"ok\":{}}}",
        plan.messages,
        report.outcomes.values().map(Vec::len).sum::<usize>(),
        count(consumer::Kind::Ran),
        count(consumer::Kind::Replayed),
        count(consumer::Kind::Unstored),
        report.charges.values().map(Vec::len).sum::<usize>(),
        report.redelivered,
        report.failed,
        elapsed.as_millis(),
        verdict.is_ok(),
    );
    match verdict {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("queue_consumer: {e}");
            ExitCode::FAILURE
        }
    }
}
