//! Pipelined group commit on one server: up to [`MAX_IN_FLIGHT`] batches on the wire at
//! once, so Redis runs one batch while the next is on its way and the previous one's
//! callers are being answered.
//!
//! Why the order still holds. Operations on one key must run in queue order (a
//! compensating release is queued behind the acquisition it undoes). The drainer takes
//! batches off the queue in order and hands each to the connection before it takes the
//! next: its deadline is computed first, then its command is polled once, which puts it
//! in the connection's outgoing queue (a FIFO; redis-rs writes it in that order, and
//! Redis runs one connection's commands in the order they arrive). Two things could
//! still send a batch's command after a later one, and neither is allowed here:
//! - a reconnect inside the connection (`ConnectionManager` parks commands while it
//!   reconnects, and wakes them in no promised order): the batches go on a plain
//!   multiplexed connection of their own, which never reconnects. When a call on it
//!   fails (or, behind Sentinel, the lock calls' connection moved to another primary),
//!   nothing more is sent on it from the drainer's next pass; once every batch in
//!   flight on it is answered, it is replaced. A command of the old connection that reaches Redis late is a
//!   release (harmless: hold identities are never reused) or an acquisition past its
//!   deadline, which the scripts refuse;
//! - redis-rs's `NOSCRIPT` fallback (load the script, send it again, after whatever
//!   was sent meanwhile): batches are sent as bare `EVALSHA`. The scripts are loaded
//!   when the connection is made; a batch answered `NOSCRIPT` ran nothing, so its
//!   operations fail as after a lost connection (the lock core tries a first attempt
//!   once more at once) and the scripts are loaded again before the next batch.
//!
//! An operation that finds the batcher idle is issued the same way by its own caller
//! ([`direct`]): the batcher stays busy until its command is in the connection's queue,
//! so nothing can be put ahead of it, and what comes after it goes behind it. The one
//! difference: when its connection is replaced, nobody waits for its reply, as the
//! drainer waits for its batches. It is then an attempt over a connection that was cut
//! (see [`direct`]).
//!
//! Not with replica acknowledgement, whose `WAIT` rides with each call (those batches go
//! one at a time, as before).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::Poll;

use futures_util::stream::{FuturesUnordered, StreamExt};
use redis::aio::MultiplexedConnection;
use redis::{RedisResult, Value};

use super::encode::Encoder;
use super::{Drainer, Job, MAX_BATCH, Op, OpReply, Queued, fail, parse, released, start_drainer};
use crate::backend::redis::inner::Inner;
use crate::backend::redis::scripts::parse_acquire;
use crate::error::{Error, Result, StoreError, StoreErrorKind};

/// The most batches on the wire at once.
pub(super) const MAX_IN_FLIGHT: usize = 4;

/// A batch on the wire: answers its operations when its reply comes.
type Sending = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What the drainer found in the queue.
enum Took {
    Batch(Vec<Queued>),
    /// Nothing queued, batches in flight.
    Nothing,
    /// Nothing queued, nothing in flight: the batcher is idle again.
    Idle,
}

/// Sends the queue in batches, several at once, until it is empty and every batch is
/// answered.
pub(super) async fn drain(mut drainer: Drainer) {
    let inner = Arc::clone(&drainer.inner);
    // The connection of the drainer before, if it ended idle.
    let mut line = inner.batcher.state().line.take().unwrap_or_default();
    let mut in_flight: FuturesUnordered<Sending> = FuturesUnordered::new();
    loop {
        // Decided once a pass: a connection that fails (or is left behind by a move)
        // between here and the send still carries this pass's batch, behind the ones in
        // flight on it, and is replaced on the next pass, once they are answered.
        let broken = line.is_broken(&inner);
        if broken && !in_flight.is_empty() {
            // Nothing more on a connection that failed: its batches first.
            while in_flight.next().await.is_some() {}
        }
        let took = if in_flight.len() < MAX_IN_FLIGHT {
            take(&inner, &mut drainer, &mut line, in_flight.is_empty())
        } else {
            Took::Nothing
        };
        match took {
            Took::Idle => return,
            Took::Batch(batch) => {
                if let Some(sending) = issue(&inner, &mut line, batch, broken).await {
                    in_flight.push(sending);
                }
            }
            Took::Nothing => {
                let room = in_flight.len() < MAX_IN_FLIGHT;
                tokio::select! {
                    biased;
                    Some(()) = in_flight.next() => {}
                    () = inner.batcher.queued.notified(), if room => {}
                }
            }
        }
    }
}

fn take(inner: &Inner, drainer: &mut Drainer, line: &mut Line, nothing_in_flight: bool) -> Took {
    let mut state = inner.batcher.state();
    if state.queue.is_empty() {
        if nothing_in_flight {
            // Idle under the same lock that queues (see `super::drain`), with the
            // connection left for the next drainer under it too: one started the
            // moment this lock is let go finds it.
            state.busy = false;
            state.line = Some(std::mem::take(line));
            drainer.done = true;
            return Took::Idle;
        }
        return Took::Nothing;
    }
    let n = state.queue.len().min(MAX_BATCH);
    Took::Batch(state.queue.drain(..n).collect())
}

/// The batches' own connection.
#[derive(Default)]
pub(super) struct Line {
    conn: Option<MultiplexedConnection>,
    /// Set by a call that failed on `conn`: nothing more is sent on it.
    broken: Arc<AtomicBool>,
    /// A call found the scripts missing (a restart, `SCRIPT FLUSH`): load them first.
    reload: Arc<AtomicBool>,
    /// The primary's moves when `conn` was made (see `Primary::moves`): behind
    /// Sentinel, once the command connection moved to another primary, `conn` goes to
    /// a server that is not one any more, and is broken.
    moves: u64,
}

impl Line {
    fn is_broken(&self, inner: &Inner) -> bool {
        self.conn.is_some()
            && (self.broken.load(Ordering::Acquire) || self.moves != inner.primary_moves())
    }

    /// The connection, when one can be sent on as it is: made, not broken, its scripts
    /// loaded.
    fn ready(&self, inner: &Inner) -> Option<&MultiplexedConnection> {
        let fine = !self.broken.load(Ordering::Acquire)
            && !self.reload.load(Ordering::Acquire)
            && self.moves == inner.primary_moves();
        self.conn.as_ref().filter(|_| fine)
    }

    /// The connection to send on: the current one, or a new one (with the scripts
    /// loaded) when there is none or `replace` (it was found broken with nothing in
    /// flight on it).
    async fn connection(&mut self, inner: &Inner, replace: bool) -> Result<MultiplexedConnection> {
        if replace {
            self.conn = None;
        }
        let conn = match &self.conn {
            Some(conn) => conn.clone(),
            None => {
                // Every batch that finds no connection tries to make one: a server
                // back from a restart is used at once (a refused connect costs little).
                // Read first: a move while connecting makes this one broken at once.
                let moves = inner.primary_moves();
                let conn = connect(inner).await?;
                self.moves = moves;
                self.broken = Arc::new(AtomicBool::new(false));
                self.reload.store(true, Ordering::Release);
                self.conn = Some(conn.clone());
                conn
            }
        };
        if self.reload.swap(false, Ordering::AcqRel)
            && let Err(error) = load_scripts(&mut conn.clone(), inner).await
        {
            self.reload.store(true, Ordering::Release);
            self.broken.store(true, Ordering::Release);
            return Err(inner.failed(error));
        }
        Ok(conn)
    }
}

/// Loads the scripts the batches use.
async fn load_scripts(conn: &mut MultiplexedConnection, inner: &Inner) -> RedisResult<()> {
    let scripts = inner.publish.scripts();
    for script in [&scripts.acquire, &scripts.release, &scripts.batch] {
        script.prepare_invoke().load_async(conn).await?;
    }
    Ok(())
}

/// A new connection to the primary as it is now.
async fn connect(inner: &Inner) -> Result<MultiplexedConnection> {
    let Some(single) = inner.conn.single() else {
        return Err(Error::store(
            StoreErrorKind::Misconfigured,
            "pipelined batches are for a single server",
        ));
    };
    let config = redis::AsyncConnectionConfig::new()
        .set_response_timeout(Some(inner.attempt_window))
        .set_connection_timeout(Some(single.connection_timeout));
    let connecting = async {
        let client = single.primary.client().await?;
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
    };
    match tokio::time::timeout(single.connection_timeout, connecting).await {
        Ok(result) => inner.checked(result),
        Err(_) => {
            let timed_out = std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connecting for lock batches timed out",
            );
            Err(StoreError::not_applied(timed_out).and_unanswered().into())
        }
    }
}

/// Sends `job` from its caller's own future, when the batcher is idle (nothing queued,
/// no drainer, no other operation sent this way unanswered) and needs no I/O before
/// sending: its connection is made and sound, and an acquisition's deadline can be read
/// off the clock sample. `Err(job)` otherwise: the caller queues it.
///
/// What the drainer would do for it, minus the task: no task is spawned, and the reply
/// comes to the caller without passing through another task (one wake-up instead of
/// two). The batcher stays busy while the command goes into the connection's queue, so
/// no batch can be put ahead of it; an operation queued meanwhile gets a drainer once
/// that is done, so it never waits for this one's reply. From then on the command no
/// longer needs its caller: redis-rs sends it whether or not this future is polled
/// again, and the reply of a caller that left is dropped.
///
/// A connection replaced while such a command is on its way is not waited for, unlike
/// the drainer's batches: like any attempt over a connection that was cut, it is refused
/// by the script once its deadline has passed, and an acquisition given up meanwhile is
/// taken back a second time after that deadline (`abandon`), in case it landed after the
/// first take-back.
pub(super) async fn direct(
    inner: &Arc<Inner>,
    job: Job,
) -> std::result::Result<Result<OpReply>, Job> {
    let Some(Slot {
        mut conn,
        broken,
        reload,
        deadline,
    }) = claim(inner, &job)
    else {
        return Err(job);
    };
    let in_flight = InFlight(inner);
    let claimed = Claimed(inner);
    let cmd = Encoder::new(inner, deadline).evalsha_one(&job);
    let mut sending = std::pin::pin!(cmd.query_async::<Value>(&mut conn));
    // One poll: the command is in the connection's queue now, ahead of any later one.
    let early = std::future::poll_fn(|cx| {
        Poll::Ready(match sending.as_mut().poll(cx) {
            Poll::Ready(reply) => Some(reply),
            Poll::Pending => None,
        })
    })
    .await;
    drop(claimed);
    let reply = match early {
        Some(reply) => reply,
        None => sending.await,
    };
    drop(in_flight);
    Ok(checked(inner, reply, &broken, &reload).and_then(|value| single_reply(job.op, value)))
}

/// What [`direct`] sends on: the line's connection and its flags, and the deadline of
/// an operation sent now.
struct Slot {
    conn: MultiplexedConnection,
    broken: Arc<AtomicBool>,
    reload: Arc<AtomicBool>,
    deadline: u64,
}

/// A [`Slot`] for `op`, with the batcher claimed (busy, one more direct operation): when
/// [`direct`] may send it.
fn claim(inner: &Inner, job: &Job) -> Option<Slot> {
    let mut state = inner.batcher.state();
    if state.busy || state.direct > 0 {
        return None;
    }
    let line = state.line.as_ref()?;
    let slot = Slot {
        conn: line.ready(inner)?.clone(),
        broken: Arc::clone(&line.broken),
        reload: Arc::clone(&line.reload),
        deadline: match job.op {
            Op::Acquire => inner.deadline_now(&job.key)?,
            Op::Release => 0,
        },
    };
    state.busy = true;
    state.direct += 1;
    Some(slot)
}

/// An operation [`direct`] sent, until its reply comes or its caller drops it. A caller
/// parked forever keeps it, and with it every later operation on the queue's path: as
/// before there was a direct path, never frozen.
struct InFlight<'a>(&'a Arc<Inner>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        let mut state = self.0.batcher.state();
        state.direct = state.direct.saturating_sub(1);
    }
}

/// The batcher claimed by [`direct`] while its command goes into the connection's
/// queue. Dropped, it leaves the batcher idle, or starts a drainer for what was queued
/// meanwhile.
struct Claimed<'a>(&'a Arc<Inner>);

impl Drop for Claimed<'_> {
    fn drop(&mut self) {
        let mut state = self.0.batcher.state();
        if state.queue.is_empty() {
            state.busy = false;
            return;
        }
        // Still busy: the drainer takes over the queue, as `run` hands it one.
        drop(state);
        start_drainer(self.0);
    }
}

/// Puts `batch` on the wire: its deadline first, then its command into the
/// connection's queue, before the drainer takes the next batch. `None` when it was
/// answered at once (an error before sending). `replace`: see [`Line::connection`].
async fn issue(
    inner: &Arc<Inner>,
    line: &mut Line,
    batch: Vec<Queued>,
    replace: bool,
) -> Option<Sending> {
    let conn = match line.connection(inner, replace).await {
        Ok(conn) => conn,
        Err(error) => {
            fail(batch, &error);
            return None;
        }
    };
    let deadline = if let Some(first) = batch.iter().find(|q| q.op == Op::Acquire) {
        match inner.attempt_deadline(&first.key).await {
            Ok(deadline) => deadline,
            Err(error) => {
                fail(batch, &error);
                return None;
            }
        }
    } else {
        0
    };
    let cmd = Encoder::new(inner, deadline).evalsha(&batch);
    let (inner, broken, reload) = (
        Arc::clone(inner),
        Arc::clone(&line.broken),
        Arc::clone(&line.reload),
    );
    let mut sending: Sending = Box::pin(async move {
        let reply: RedisResult<Value> = cmd.query_async(&mut conn.clone()).await;
        answer(&inner, batch, reply, &broken, &reload);
    });
    // One poll: the command is in the connection's queue now, ahead of any later batch.
    let answered =
        std::future::poll_fn(|cx| Poll::Ready(sending.as_mut().poll(cx).is_ready())).await;
    (!answered).then_some(sending)
}

/// Answers every operation of `batch` from `reply`.
fn answer(
    inner: &Inner,
    mut batch: Vec<Queued>,
    reply: RedisResult<Value>,
    broken: &AtomicBool,
    reload: &AtomicBool,
) {
    let value = match checked(inner, reply, broken, reload) {
        Ok(value) => value,
        Err(error) => return fail(batch, &error),
    };
    if batch.len() == 1
        && let Some(q) = batch.pop()
    {
        let reply = single_reply(q.op, value);
        let _ = q.reply.send(reply);
        return;
    }
    match value {
        Value::Array(values) if values.len() == 3 * batch.len() => {
            for (q, triple) in batch.into_iter().zip(values.chunks_exact(3)) {
                let _ = q.reply.send(parse(q.job.op, triple));
            }
        }
        other => {
            let message = format!("lock batch of {} answered {other:?}", batch.len());
            fail(batch, &Error::store(StoreErrorKind::Unexpected, message));
        }
    }
}

/// A call's reply, or the error its operations get. A failed call marks its connection
/// `broken` (nothing more is sent on it), unless the script itself failed; a missing
/// script marks the scripts for `reload`.
fn checked(
    inner: &Inner,
    reply: RedisResult<Value>,
    broken: &AtomicBool,
    reload: &AtomicBool,
) -> Result<Value> {
    let no_script = redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
    match reply {
        Ok(value) => Ok(value),
        Err(error) if error.kind() == no_script => {
            // Nothing ran. The scripts are loaded again before the next batch, and the
            // callers try once more at once, as after a connection lost: a restart or a
            // failover to a replica costs them no error.
            reload.store(true, Ordering::Release);
            let error = StoreError::not_applied(error)
                .and_connection_lost()
                .with_message("the lock scripts were gone from the server; loading them again");
            Err(Error::Store(error))
        }
        Err(error) => {
            if !is_script_error(&error) {
                broken.store(true, Ordering::Release);
            }
            Err(inner.failed(error))
        }
    }
}

/// A script's own error (a key of the wrong type): the connection is fine.
fn is_script_error(error: &redis::RedisError) -> bool {
    !(error.is_io_error()
        || error.is_timeout()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.code() == Some("READONLY"))
        && error.code().is_some()
}

/// One operation's reply from its single-key script.
fn single_reply(op: Op, value: Value) -> Result<OpReply> {
    let unexpected = |value: &Value| {
        Error::store(
            StoreErrorKind::Unexpected,
            format!("lock script answered {value:?}"),
        )
    };
    match op {
        Op::Acquire => {
            let reply: Vec<i64> =
                redis::from_redis_value_ref(&value).map_err(|_| unexpected(&value))?;
            parse_acquire("acquire", &reply).map(OpReply::Acquire)
        }
        Op::Release => {
            let reply: i64 = redis::from_redis_value_ref(&value).map_err(|_| unexpected(&value))?;
            Ok(OpReply::Release(released(reply)))
        }
    }
}
