//! Group commit of exclusive acquisitions and releases on one Redis server.
//!
//! What a lock costs Redis is mostly the fixed cost of entering a script, not the few
//! commands inside it. So while one exclusive-lock call is on its way, the operations
//! that arrive meanwhile wait in a queue, and when the call is answered they all go in
//! one call of `lua/lock_batch.lua` (up to [`MAX_BATCH`]). An operation that finds
//! nothing in flight goes at once, alone, with the single-key script.
//!
//! Operations are sent by a spawned sender task, the drainer, never by a caller's
//! future waiting for its reply: a caller that gives up (a timeout, a client hanging
//! up) or whose future is parked without being dropped (a lost `select!` branch, a
//! future kept in a struct) costs only itself, and the others' operations go on. The
//! one exception costs nothing of the kind: on a single server, an operation that finds
//! the batcher idle is put into the connection's queue by its caller's first poll
//! ([`pipeline::direct`]), and from then on redis-rs sends it whether or not that
//! caller is polled again; the batcher is free again before that poll ends. An
//! operation whose caller is gone is still sent, in order: the lock's compensating
//! release for a cancelled acquisition is queued after it and undoes it. Within a batch
//! the operations run in queue order, each alone against its own key, exactly as the
//! single-key scripts would.
//!
//! Acquisitions carry the deadline of the call that sends them (see
//! [`clock`](crate::backend::clock)): a call that arrives after it takes nothing.
//!
//! On a single server without replica acknowledgement, up to
//! [`pipeline::MAX_IN_FLIGHT`] calls are on the wire at once, on a connection of their
//! own, in queue order (see [`pipeline`] for why the order holds).
//!
//! On a cluster a script's keys must share a hash slot, so what is queued is split by
//! slot, in queue order, and each slot's share goes in its own call, all at once (each
//! to the master of its slot). Operations on one key share its slot, so they still run
//! in queue order; the next batch waits for every call of this one.
//!
//! While a slot migrates, Redis runs a call on the source when every key it names is
//! there. An operation that deletes a lock there (its last release) leaves the ones
//! behind it in the same call looking at a key that is the target's now, and Redis
//! refuses their first look at it ([`moved_away`]). Each operation's first
//! command reads its lock, so a refused one changed nothing, and neither did those of
//! the same key behind it (all refused alike): they go first in the next batch, in
//! their order, which Redis sends to the target. [`MAX_RESENDS`] bounds that.

use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use redis::Value;
use tokio::sync::{Notify, oneshot};

use super::UNLOCK_MESSAGE;
use super::conn::Conn;
use super::errors::{map_error, moved_away};
use super::inner::Inner;
#[cfg(feature = "cluster")]
use super::names::Names;
use super::scripts::{arrived_late, lease_ms, ttl_of};
use super::synced::Replicated;
use crate::backend::{Acquire, FencingToken, Grant, LockRequest, Release};
use crate::error::{Error, Result, StoreError, StoreErrorKind};
use crate::hold_id::HoldId;
use crate::key::LockKey;

/// The most operations one batch call carries.
pub(super) const MAX_BATCH: usize = 128;

/// How many times an operation refused as [moved away](moved_away) is sent
/// again before it is answered as an outage (which its lock core retries while it may).
const MAX_RESENDS: u8 = 3;

/// What an operation asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Op {
    Acquire,
    Release,
}

/// What Redis answered to one queued [`Op`]: the acquisition's or the release's result.
pub(super) enum OpReply {
    Acquire(Acquire),
    Release(Release),
}

/// One operation, with everything its script call needs.
///
/// It keeps the request's key and hold identity (shared, not copied): the names the
/// call carries are written into its command as it is encoded, with no strings of their
/// own on the way (five allocations an exclusive lock and unlock once cost here).
pub(super) struct Job {
    op: Op,
    fenced: bool,
    key: LockKey,
    lease_ms: u64,
    hold_id: HoldId,
}

/// A queued [`Job`] and where its answer goes.
struct Queued {
    job: Job,
    reply: oneshot::Sender<Result<OpReply>>,
    /// Times sent again after a refusal as moved away.
    resent: u8,
}

impl std::ops::Deref for Queued {
    type Target = Job;

    fn deref(&self) -> &Job {
        &self.job
    }
}

mod encode;
mod pipeline;

use encode::Encoder;

/// The queue and whether a call is in flight.
#[derive(Default)]
pub(super) struct Batcher {
    state: Mutex<State>,
    /// Tells a pipelining drainer that an operation was queued.
    queued: Notify,
}

#[derive(Default)]
struct State {
    /// A sender task runs: it sends what is queued, and goes idle when nothing is.
    busy: bool,
    queue: Vec<Queued>,
    /// The pipelined batches' connection while no drainer runs (see [`pipeline`]).
    line: Option<pipeline::Line>,
    /// Operations sent by their callers ([`pipeline::direct`]) and not answered yet (or
    /// whose callers have not dropped them yet): while any is, the next operation is
    /// queued, so that what arrives under load is batched.
    direct: usize,
}

impl Batcher {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Runs `op` for `req` (an exclusive lock): alone when nothing is in flight, else in
/// the next batch. Put on the wire by this future's first poll when the batcher is idle
/// ([`pipeline::direct`]), else sent by a task: either way, dropping or parking this
/// future after its first poll never holds up anyone else's operation, nor its own.
pub(super) async fn run(inner: &Arc<Inner>, op: Op, req: &LockRequest) -> Result<OpReply> {
    let job = Job {
        op,
        fenced: req.fenced,
        key: req.key.clone(),
        lease_ms: lease_ms(req.lease),
        hold_id: req.hold_id.clone(),
    };
    let job = if inner.pipelines() {
        match pipeline::direct(inner, job).await {
            Ok(reply) => return reply,
            Err(job) => job,
        }
    } else {
        job
    };
    let (reply, receiver) = oneshot::channel();
    let start = {
        let mut state = inner.batcher.state();
        state.queue.push(Queued {
            job,
            reply,
            resent: 0,
        });
        !std::mem::replace(&mut state.busy, true)
    };
    if start {
        start_drainer(inner);
    } else {
        inner.batcher.queued.notify_one();
    }
    receiver.await.unwrap_or_else(|_| {
        // The sender stopped with this operation taken (its runtime shut down): it may
        // or may not have reached Redis. An error, which the lock compensates.
        Err(Error::store(
            StoreErrorKind::Unavailable,
            "lock operation's outcome unknown: the task sending it stopped",
        ))
    })
}

/// Starts the task that sends the queue, on the caller's runtime.
fn start_drainer(inner: &Arc<Inner>) {
    let drainer = Drainer {
        inner: Arc::clone(inner),
        done: false,
    };
    match tokio::runtime::Handle::try_current() {
        Ok(runtime) => {
            runtime.spawn(drain(drainer));
        }
        // No runtime to send from: the drainer's drop fails the queue, unsent.
        Err(_) => drop(drainer),
    }
}

/// The drainer's hold on the batcher. Dropped before the queue is empty — its task
/// never ran, or its runtime shut down mid-call — it fails what is still queued (those
/// operations were never sent; the callers may retry) and leaves the batcher idle, so
/// that a backend shared with other runtimes goes on working.
struct Drainer {
    inner: Arc<Inner>,
    /// The queue was found empty and the batcher left idle.
    done: bool,
}

impl Drop for Drainer {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        let mut state = self.inner.batcher.state();
        let queued = std::mem::take(&mut state.queue);
        state.busy = false;
        drop(state);
        for q in queued {
            let _ = q.reply.send(Err(unsent("no task left to send it")));
        }
    }
}

/// A queued operation that was never sent: retryable, like an outage, and nothing to
/// take back.
fn unsent(why: &str) -> Error {
    let why = std::io::Error::other(format!("lock operation not sent: {why}"));
    StoreError::not_applied(why).and_unanswered().into()
}

/// Sends the queue in batches until it is empty: several at once on a single server
/// ([`pipeline`]), one at a time (split by slot on a cluster) otherwise.
async fn drain(mut drainer: Drainer) {
    let inner = Arc::clone(&drainer.inner);
    if inner.pipelines() {
        return pipeline::drain(drainer).await;
    }
    loop {
        let batch: Vec<Queued> = {
            let mut state = inner.batcher.state();
            if state.queue.is_empty() {
                // Idle under the same lock that queues: an operation queued after this
                // sees the batcher idle and goes alone.
                state.busy = false;
                drainer.done = true;
                return;
            }
            let n = state.queue.len().min(MAX_BATCH);
            state.queue.drain(..n).collect()
        };
        let groups = by_slot(&inner, batch);
        let sent = futures_util::future::join_all(groups.into_iter().map(|g| send(&inner, g)));
        let again: Vec<Queued> = sent.await.into_iter().flatten().collect();
        if !again.is_empty() {
            // Ahead of what was queued meanwhile: a compensating release queued after
            // its acquisition stays after it.
            inner.batcher.state().queue.splice(0..0, again);
        }
    }
}

/// `batch` split into the groups one script call may carry, each in queue order: all of
/// it on a single server, one group per hash slot on a cluster.
fn by_slot(inner: &Inner, batch: Vec<Queued>) -> Vec<Vec<Queued>> {
    match &inner.conn {
        Conn::Single(_) => vec![batch],
        #[cfg(feature = "cluster")]
        Conn::Cluster(_) => {
            let mut groups: Vec<(redis::cluster_routing::Slot, Vec<Queued>)> = Vec::new();
            for q in batch {
                let name = Names::lock(&inner.prefix, &q.key);
                let slot = redis::cluster_routing::Slot::for_key(name.as_bytes());
                match groups.iter_mut().find(|(s, _)| *s == slot) {
                    Some((_, group)) => group.push(q),
                    None => groups.push((slot, vec![q])),
                }
            }
            groups.into_iter().map(|(_, group)| group).collect()
        }
    }
}

/// One call for `batch` — the single-key script for one operation, `lock_batch.lua`
/// for more; every operation gets its answer, but those to send again (refused as
/// moved away), returned in their order.
async fn send(inner: &Inner, mut batch: Vec<Queued>) -> Vec<Queued> {
    // On a cluster a batch is one slot's: its first key's clock is every key's.
    let acquiring = batch.iter().find(|q| q.op == Op::Acquire);
    let deadline = if let Some(first) = acquiring {
        match inner.attempt_deadline(&first.key).await {
            Ok(deadline) => deadline,
            Err(error) => {
                fail(batch, &error);
                return Vec::new();
            }
        }
    } else {
        0
    };
    if batch.len() == 1
        && let Some(q) = batch.pop()
    {
        // The single-key scripts are never refused as moved away: Redis sends a call
        // whose one lock is missing from a migrating slot to the target itself.
        send_one(inner, q, deadline).await;
        return Vec::new();
    }
    send_many(inner, batch, deadline).await
}

/// One operation alone: its single-key script (`lua/lock_release.lua` publishes on the
/// lock's channel).
async fn send_one(inner: &Inner, q: Queued, deadline: u64) {
    let invocation = Encoder::new(inner, deadline).one(&q);
    let reply = match q.op {
        Op::Acquire => inner.write_grant(&invocation).await.map(OpReply::Acquire),
        Op::Release => inner
            .write_waited(&invocation)
            .await
            .map(|reply| OpReply::Release(released(reply))),
    };
    let _ = q.reply.send(reply);
}

/// Several operations: one `lock_batch.lua` call, three values per operation. Returns
/// the operations to send again.
async fn send_many(inner: &Inner, batch: Vec<Queued>, deadline: u64) -> Vec<Queued> {
    let invocation = Encoder::new(inner, deadline).many(&batch);
    // With replica acknowledgement the batch waits once; a grant of it that too few
    // replicas acknowledged is an outage (its lock core gives it up, which releases it).
    let reply: Result<(Vec<Value>, Replicated)> = inner.write(&invocation).await;
    let mut again = Vec::new();
    match reply {
        Ok((values, replicated)) if values.len() == 3 * batch.len() => {
            for (mut q, triple) in batch.into_iter().zip(values.chunks_exact(3)) {
                if q.resent < MAX_RESENDS && refused_as_moved(triple) {
                    tracing::debug!(
                        op = ?q.op,
                        "lock operation refused: its slot is migrating; sending it again"
                    );
                    q.resent += 1;
                    again.push(q);
                    continue;
                }
                let reply = parse(q.op, triple).and_then(|reply| match reply {
                    OpReply::Acquire(Acquire::Acquired(_)) => replicated.check().map(|()| reply),
                    other => Ok(other),
                });
                let _ = q.reply.send(reply);
            }
        }
        Ok((values, _)) => {
            let message = format!(
                "lock batch of {} answered {} values",
                batch.len(),
                values.len()
            );
            fail(batch, &Error::store(StoreErrorKind::Unexpected, message));
        }
        Err(error) => fail(batch, &error),
    }
    again
}

/// Whether one operation's three values are its refusal as
/// [moved away](moved_away).
fn refused_as_moved(triple: &[Value]) -> bool {
    match (triple.first().and_then(int), triple.get(1)) {
        (Some(3), Some(Value::BulkString(message))) => {
            moved_away(&String::from_utf8_lossy(message))
        }
        (Some(3), Some(Value::SimpleString(message))) => moved_away(message),
        _ => false,
    }
}

/// Answers every operation of `batch` with `error`.
fn fail(batch: Vec<Queued>, error: &Error) {
    for q in batch {
        let _ = q.reply.send(Err(error.duplicate()));
    }
}

fn int(value: &Value) -> Option<i64> {
    match value {
        Value::Int(n) => Some(*n),
        _ => None,
    }
}

/// One operation's three values → its reply.
fn parse(op: Op, triple: &[Value]) -> Result<OpReply> {
    let unexpected = || {
        Error::store(
            StoreErrorKind::Unexpected,
            format!("lock batch answered {triple:?}"),
        )
    };
    let (Some(status), Some(second)) = (triple.first().and_then(int), triple.get(1)) else {
        return Err(unexpected());
    };
    let holds = |h: i64| u32::try_from(h).unwrap_or(u32::MAX);
    match (op, status, int(second)) {
        (Op::Acquire, 1, Some(h)) => {
            let token = triple.get(2).and_then(int).unwrap_or(0);
            let token = (token > 0).then(|| FencingToken::new(token.unsigned_abs()));
            Ok(OpReply::Acquire(Acquire::Acquired(Grant::new(
                holds(h),
                token,
            ))))
        }
        (Op::Acquire, 0, Some(ttl)) => Ok(OpReply::Acquire(Acquire::Busy { ttl: ttl_of(ttl) })),
        (Op::Acquire, -1, now) => Err(arrived_late(now)),
        (Op::Release, 2, Some(n)) => Ok(OpReply::Release(released(n))),
        (_, 3, _) => {
            let message = match second {
                Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
                Value::SimpleString(s) => s.clone(),
                other => format!("{other:?}"),
            };
            Err(map_error(redis::RedisError::from((
                redis::ErrorKind::Extension,
                "lock script error",
                message,
            ))))
        }
        _ => Err(unexpected()),
    }
}

/// A release's reply (its single-key script's, or its value in a batch's) → its
/// outcome: `-1` not held, `0` released, else the holds left.
fn released(reply: i64) -> Release {
    match reply {
        -1 => Release::NotHeld,
        0 => Release::Released,
        holds => Release::Decremented {
            holds: u32::try_from(holds).unwrap_or(u32::MAX),
        },
    }
}

// `UNLOCK_MESSAGE` is what the batch script publishes too ('0'): keep them one.
const _: () = assert!(UNLOCK_MESSAGE.len() == 1 && UNLOCK_MESSAGE.as_bytes()[0] == b'0');
