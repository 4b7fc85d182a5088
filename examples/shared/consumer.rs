//! A queue consumer made idempotent with `LockClient::idempotent`: a pool of workers
//! takes messages from a queue that delivers each at least twice (at-least-once, as
//! SQS, RabbitMQ and Kafka consumers see after a timeout or a rebalance), and
//! redelivers one whose handling was cut short or found another run still in flight.
//! Each message charges an order once, and every delivery gets the same receipt.
//!
//! Shared by `examples/queue_consumer.rs` and the tests (`tests/it/idempotent_runs.rs`),
//! which check its report against an oracle on every store.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tower_lock::LockClient;
use tower_lock::idempotency::{Done, IdempotentError};

/// One message: an order to charge.
#[derive(Clone, Debug)]
pub struct Message {
    /// The message's id: the idempotency key.
    pub id: u64,
    /// What the message says: the fingerprint.
    pub body: String,
}

/// How the pool runs.
#[derive(Clone, Debug)]
pub struct Plan {
    /// Messages, numbered from 0.
    pub messages: u64,
    /// Workers taking messages at once.
    pub workers: usize,
    /// Deliveries of each message to begin with (at least 2).
    pub deliveries: usize,
    /// Per mille of handlings cut short (the worker's deadline passes mid-work, as a
    /// consumer's visibility timeout does): the message is redelivered.
    pub cut_per_mille: u32,
    /// How long a run waits for another run of its message before it is redelivered.
    pub max_wait: Duration,
    /// The seed of the order of deliveries, the work's durations and the cuts.
    pub seed: u64,
    /// How long each receipt is kept.
    pub ttl: Duration,
    /// Names this run's keys apart from an earlier run's on the same store.
    pub run: String,
}

/// What each delivery of each message came to.
#[derive(Debug, Default)]
pub struct Report {
    /// Per message: the receipt of each handling that completed, and whether the work
    /// ran for it (`Ran`), ran unkept (`Unstored`) or was replayed.
    pub outcomes: HashMap<u64, Vec<(Kind, String)>>,
    /// Per message: the receipt of each time the work itself completed (the charges
    /// made), whether or not its handling did.
    pub charges: HashMap<u64, Vec<String>>,
    /// Handlings cut short, and runs that found another in flight: each redelivered.
    pub redelivered: u64,
    /// Handlings that failed otherwise (the store): each redelivered too.
    pub failed: u64,
}

/// How a handling completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// The work ran and its receipt was kept.
    Ran,
    /// The work ran; its receipt was not kept.
    Unstored,
    /// An earlier run's receipt.
    Replayed,
}

/// The key of a message's run: one hash tag per message, so that on Redis Cluster its
/// lock and its record share a slot.
pub fn key_of(run: &str, id: u64) -> String {
    format!("charge:{{{run}-{id}}}")
}

/// Runs the pool until every delivery of every message is handled, worker `i` on
/// `clients[i % clients.len()]` (replicas of one service, each with its own client).
pub async fn consume(clients: &[LockClient], plan: &Plan) -> Report {
    let rng = Mutex::new(fastrand::Rng::with_seed(plan.seed));
    let mut deliveries: Vec<Message> = (0..plan.messages)
        .flat_map(|id| {
            let body = format!("charge order {id}: {} cents", 100 + id % 900);
            std::iter::repeat_n(Message { id, body }, plan.deliveries.max(2))
        })
        .collect();
    rng.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .shuffle(&mut deliveries);
    let queue = Arc::new(Mutex::new(VecDeque::from(deliveries)));
    let report = Arc::new(Mutex::new(Report::default()));
    let seeds: Vec<u64> = {
        let mut rng = rng.lock().unwrap_or_else(PoisonError::into_inner);
        (0..plan.workers).map(|_| rng.u64(..)).collect()
    };
    let mut workers = tokio::task::JoinSet::new();
    for (i, seed) in seeds.into_iter().enumerate() {
        let Some(client) = clients.get(i % clients.len().max(1)) else {
            break;
        };
        let (client, queue, report, plan) = (
            client.clone(),
            Arc::clone(&queue),
            Arc::clone(&report),
            plan.clone(),
        );
        workers.spawn(async move {
            let mut rng = fastrand::Rng::with_seed(seed);
            loop {
                let next = queue
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .pop_front();
                let Some(message) = next else { break };
                if !handle(&client, &plan, &message, &mut rng, &report).await {
                    // Redelivered: to the back of the queue, as a broker does.
                    queue
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .push_back(message);
                    tokio::task::yield_now().await;
                }
            }
        });
    }
    while workers.join_next().await.is_some() {}
    Arc::try_unwrap(report)
        .map(|report| report.into_inner().unwrap_or_else(PoisonError::into_inner))
        .unwrap_or_default()
}

/// Handles one delivery; `false`: it is to be redelivered.
async fn handle(
    client: &LockClient,
    plan: &Plan,
    message: &Message,
    rng: &mut fastrand::Rng,
    report: &Mutex<Report>,
) -> bool {
    let Ok(run) = client.idempotent(key_of(&plan.run, message.id)) else {
        return false;
    };
    let work_ms = rng.u64(0..4);
    let nonce = rng.u32(..);
    let cut = rng.u32(0..1000) < plan.cut_per_mille;
    let id = message.id;
    let run = run
        .max_wait(plan.max_wait)
        .ttl(plan.ttl)
        .run(&message.body, |held| async move {
            tokio::time::sleep(Duration::from_millis(work_ms)).await;
            let token = held.fencing_token().map_or(0, |t| t.get());
            let receipt = format!("receipt {id}/{nonce} token {token}");
            // The charge: the work's effect, made at its end (a cut before it makes none).
            report
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .charges
                .entry(id)
                .or_default()
                .push(receipt.clone());
            Ok::<_, std::convert::Infallible>(receipt)
        });
    let done = if cut {
        // Cut short part way into the work (or before it began).
        match tokio::time::timeout(Duration::from_millis(rng.u64(0..3)), run).await {
            Ok(done) => done,
            Err(_) => {
                report
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .redelivered += 1;
                return false;
            }
        }
    } else {
        run.await
    };
    let mut report = report.lock().unwrap_or_else(PoisonError::into_inner);
    let (kind, receipt) = match done {
        Ok(Done::Ran(receipt)) => (Kind::Ran, receipt),
        Ok(Done::Unstored(receipt)) => (Kind::Unstored, receipt),
        Ok(Done::Replayed(receipt)) => (Kind::Replayed, receipt),
        Err(IdempotentError::InFlight) => {
            report.redelivered += 1;
            return false;
        }
        Err(_) => {
            report.failed += 1;
            return false;
        }
    };
    report.outcomes.entry(id).or_default().push((kind, receipt));
    true
}

/// What is wrong with `report`, if anything: per message, every delivery answered, at
/// most one receipt kept, and every replay equal to it (a receipt some run of the work
/// made: a handling cut short after its store step kept one it never saw). With no cuts
/// and no unkept runs, each message charged exactly once.
pub fn check(plan: &Plan, report: &Report) -> Result<(), String> {
    for id in 0..plan.messages {
        let outcomes = report.outcomes.get(&id).map_or(&[][..], Vec::as_slice);
        if outcomes.len() != plan.deliveries.max(2) {
            return Err(format!(
                "message {id}: {} answers to {} deliveries",
                outcomes.len(),
                plan.deliveries.max(2)
            ));
        }
        let mut kept: Vec<&String> = outcomes
            .iter()
            .filter(|(kind, _)| *kind != Kind::Unstored)
            .map(|(_, receipt)| receipt)
            .collect();
        kept.sort();
        kept.dedup();
        if kept.len() > 1 {
            return Err(format!(
                "message {id}: {} receipts kept: {kept:?}",
                kept.len()
            ));
        }
        let charges = report.charges.get(&id).map_or(&[][..], Vec::as_slice);
        if let Some(receipt) = kept.first()
            && !charges.contains(receipt)
        {
            return Err(format!(
                "message {id}: {receipt:?} kept, but no run made it"
            ));
        }
        let unkept = outcomes.iter().any(|(kind, _)| *kind == Kind::Unstored);
        if plan.cut_per_mille == 0 && !unkept && charges.len() != 1 {
            return Err(format!("message {id}: charged {} times", charges.len()));
        }
        if charges.is_empty() {
            return Err(format!("message {id}: never charged"));
        }
    }
    Ok(())
}
