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
//!   fails, nothing more is sent on it; once every batch in flight on it is answered,
//!   it is replaced. A command of the old connection that reaches Redis late is a
//!   release (harmless: hold identities are never reused) or an acquisition past its
//!   deadline, which the scripts refuse;
//! - redis-rs's `NOSCRIPT` fallback (load the script, send it again, after whatever
//!   was sent meanwhile): batches are sent as bare `EVALSHA`. The scripts are loaded
//!   when the connection is made; a batch answered `NOSCRIPT` ran nothing, so its
//!   operations fail as after a lost connection (the lock core tries a first attempt
//!   once more at once) and the scripts are loaded again before the next batch.
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

use super::{Drainer, MAX_BATCH, Op, OpReply, Queued, fail, parse};
use crate::backend::Release;
use crate::backend::redis::{Inner, UNLOCK_MESSAGE, parse_acquire};
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
        if line.is_broken() && !in_flight.is_empty() {
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
                if let Some(sending) = issue(&inner, &mut line, batch).await {
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
}

impl Line {
    fn is_broken(&self) -> bool {
        self.conn.is_some() && self.broken.load(Ordering::Acquire)
    }

    /// The connection to send on: the current one, or a new one (with the scripts
    /// loaded) when there is none or it failed.
    async fn connection(&mut self, inner: &Inner) -> Result<MultiplexedConnection> {
        if self.is_broken() {
            self.conn = None;
        }
        let conn = match &self.conn {
            Some(conn) => conn.clone(),
            None => {
                // Every batch that finds no connection tries to make one: a server
                // back from a restart is used at once (a refused connect costs little).
                let conn = connect(inner).await?;
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
        Err(_) => Err(Error::store(
            StoreErrorKind::Unavailable,
            "connecting for lock batches timed out",
        )),
    }
}

/// Puts `batch` on the wire: its deadline first, then its command into the
/// connection's queue, before the drainer takes the next batch. `None` when it was
/// answered at once (an error before sending).
async fn issue(inner: &Arc<Inner>, line: &mut Line, batch: Vec<Queued>) -> Option<Sending> {
    let conn = match line.connection(inner).await {
        Ok(conn) => conn,
        Err(error) => {
            fail(batch, &error);
            return None;
        }
    };
    let deadline = if batch.iter().any(|q| q.op == Op::Acquire) {
        match inner.attempt_deadline().await {
            Ok(deadline) => deadline,
            Err(error) => {
                fail(batch, &error);
                return None;
            }
        }
    } else {
        0
    };
    let cmd = command(inner, &batch, deadline);
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

/// The bare `EVALSHA` of `batch`: the single-key script for one operation,
/// `lua/lock_batch.lua` for more.
fn command(inner: &Inner, batch: &[Queued], deadline: u64) -> redis::Cmd {
    let scripts = inner.publish.scripts();
    let prefix = &inner.prefix;
    let mut cmd = redis::cmd("EVALSHA");
    match batch {
        [q] if q.op == Op::Acquire => {
            cmd.arg(scripts.acquire.get_hash())
                .arg(2)
                .arg(q.lock(prefix))
                .arg(q.second(prefix))
                .arg(q.lease_ms)
                .arg(q.hold_id.as_str())
                .arg(if q.fenced { "1" } else { "0" })
                .arg(deadline);
        }
        [q] => {
            cmd.arg(scripts.release.get_hash())
                .arg(2)
                .arg(q.lock(prefix))
                .arg(q.second(prefix))
                .arg(UNLOCK_MESSAGE)
                .arg(q.lease_ms)
                .arg(q.hold_id.as_str());
        }
        _ => {
            cmd.arg(scripts.batch.get_hash()).arg(2 * batch.len());
            for q in batch {
                cmd.arg(q.lock(prefix)).arg(q.second(prefix));
            }
            cmd.arg(deadline);
            for q in batch {
                let tag = match (q.op, q.fenced) {
                    (Op::Release, _) => "r",
                    (Op::Acquire, true) => "f",
                    (Op::Acquire, false) => "a",
                };
                cmd.arg(tag).arg(q.lease_ms).arg(q.hold_id.as_str());
            }
        }
    }
    cmd
}

/// Answers every operation of `batch` from `reply`.
fn answer(
    inner: &Inner,
    mut batch: Vec<Queued>,
    reply: RedisResult<Value>,
    broken: &AtomicBool,
    reload: &AtomicBool,
) {
    let no_script = redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
    let value = match reply {
        Ok(value) => value,
        Err(error) if error.kind() == no_script => {
            // Nothing ran. The scripts are loaded again before the next batch, and the
            // callers try once more at once, as after a connection lost: a restart or a
            // failover to a replica costs them no error.
            reload.store(true, Ordering::Release);
            let error = StoreError::connection_lost(error)
                .with_message("the lock scripts were gone from the server; loading them again");
            return fail(batch, &Error::Store(error));
        }
        Err(error) => {
            if !is_script_error(&error) {
                broken.store(true, Ordering::Release);
            }
            return fail(batch, &inner.failed(error));
        }
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
                let _ = q.reply.send(parse(q.op, triple));
            }
        }
        other => {
            let message = format!("lock batch of {} answered {other:?}", batch.len());
            fail(batch, &Error::store(StoreErrorKind::Unexpected, message));
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
            Ok(OpReply::Release(match reply {
                -1 => Release::NotHeld,
                0 => Release::Released,
                holds => Release::Decremented {
                    holds: u32::try_from(holds).unwrap_or(u32::MAX),
                },
            }))
        }
    }
}
