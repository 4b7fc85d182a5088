//! Group commit of acquisitions and releases.
//!
//! What an exclusive lock costs PostgreSQL is mostly what every statement and every
//! transaction costs (parse and plan, a snapshot, a commit record, and a grant's
//! `fdatasync`), not the few rows it touches. So while one statement of a kind
//! (acquisition or release, of the exclusive mode or of the others) is on its way, the
//! operations of that kind that arrive meanwhile wait in a queue, and go together in
//! one statement and one transaction (up to [`MAX_BATCH`] names, each name once):
//! `sql/lock_x_batch.sql` and `sql/unlock_x_batch.sql` for the exclusive mode,
//! `_acquire_batch` and `_release_batch` (the single-name functions called name by
//! name, in name order) for the others. An operation that finds nothing of its kind in
//! flight is sent at once by its caller, alone, with the single-name statement: no
//! added latency when idle.
//!
//! What is queued is sent by a spawned task ([`SENDERS`] per kind at most), never by a
//! caller's future: a caller that gives up or whose future is parked costs only
//! itself, and the others' operations go on. A queued acquisition whose caller is gone
//! is not sent; one already on its way may land or not. Either way the lock core gives
//! the hold up ([`abandon`](crate::backend::LockBackend::abandon)), as for any
//! unanswered attempt. A release is sent whether its caller waits or not.
//!
//! Order between batches is not needed: as for single statements over the pool's
//! connections, each attempt carries its caller's deadline (refused once past it), and
//! an abandonment refuses the late attempts of its owner. Each statement locks its
//! names' rows in name order, so two of them never wait for each other in a cycle.

use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::PostgresBackend;
use super::statements::{AttemptRow, millis, mode_char, permits_max};
use crate::backend::{Acquire, LockMode, LockRequest, Release};
use crate::error::{Error, Result, StoreError, StoreErrorKind};

/// The most names one batch carries.
pub(super) const MAX_BATCH: usize = 64;

/// Sender tasks of one kind at once. One: each batch then carries everything that
/// arrived while the one before was on its way. (At 32 workers, two per kind split the
/// batches and gave 15–20% fewer locks per second.)
pub(super) const SENDERS: usize = 1;

/// The queues: acquisitions and releases, of the exclusive mode and of the others
/// (which go in statements of their own).
#[derive(Default)]
pub(super) struct Batcher {
    lanes: [Lane; 4],
}

#[derive(Default)]
struct Lane {
    state: Mutex<LaneState>,
}

#[derive(Default)]
struct LaneState {
    /// Statements sent by their callers, not yet answered or dropped.
    direct: usize,
    /// Sender tasks running.
    senders: usize,
    queue: Vec<Queued>,
}

impl Lane {
    fn state(&self) -> MutexGuard<'_, LaneState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What an operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Acquire,
    Release,
}

/// Which statements an operation goes in: the exclusive mode's own, or the other
/// modes' (which call the single-name functions row by row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Family {
    Exclusive,
    Other,
}

impl Family {
    fn of(req: &LockRequest) -> Self {
        if req.mode == LockMode::Exclusive {
            Family::Exclusive
        } else {
            Family::Other
        }
    }
}

impl Batcher {
    fn lane(&self, op: Op, family: Family) -> &Lane {
        let i = match (op, family) {
            (Op::Acquire, Family::Exclusive) => 0,
            (Op::Release, Family::Exclusive) => 1,
            (Op::Acquire, Family::Other) => 2,
            (Op::Release, Family::Other) => 3,
        };
        &self.lanes[i]
    }
}

/// One queued operation and where its answer goes.
struct Queued {
    req: LockRequest,
    /// An acquisition's deadline on the database's clock, in microseconds (0: none).
    deadline: i64,
    reply: oneshot::Sender<Result<Answer>>,
}

enum Answer {
    Acquire(Acquire),
    Release(Release),
}

/// How an operation goes: by its caller (counted until the guard drops), or queued.
enum Entry<'a> {
    Direct(Option<DirectGuard<'a>>),
    Queued(oneshot::Receiver<Result<Answer>>),
}

/// Counts a statement its caller sends, until it is answered or dropped.
struct DirectGuard<'a>(&'a Lane);

impl Drop for DirectGuard<'_> {
    fn drop(&mut self) {
        self.0.state().direct -= 1;
    }
}

/// An acquisition of `req` (not an exclusive waiter's with hand-over), with its
/// `deadline`.
pub(super) async fn acquire(
    backend: &PostgresBackend,
    req: &LockRequest,
    deadline: i64,
) -> Result<Acquire> {
    match enter(backend, Op::Acquire, req, deadline) {
        Entry::Direct(_counted) => backend.attempt(req, deadline, None).await,
        Entry::Queued(answer) => match wait(backend, answer).await? {
            Answer::Acquire(acquire) => Ok(acquire),
            Answer::Release(_) => Err(mixed()),
        },
    }
}

/// A release of `req`.
pub(super) async fn release(backend: &PostgresBackend, req: &LockRequest) -> Result<Release> {
    match enter(backend, Op::Release, req, 0) {
        Entry::Direct(_counted) => backend.release_alone(req).await,
        Entry::Queued(answer) => match wait(backend, answer).await? {
            Answer::Release(release) => Ok(release),
            Answer::Acquire(_) => Err(mixed()),
        },
    }
}

fn mixed() -> Error {
    Error::store(
        StoreErrorKind::Unexpected,
        "a queued lock operation was answered for another kind",
    )
}

/// Sends `req` directly when nothing of its kind is on its way (or without a runtime
/// to send batches on); else queues it, starting a sender when fewer than [`SENDERS`]
/// run. A caller sending directly holds up no one: what arrives meanwhile is queued,
/// and a sender sends it.
fn enter<'a>(backend: &'a PostgresBackend, op: Op, req: &LockRequest, deadline: i64) -> Entry<'a> {
    let Ok(runtime) = tokio::runtime::Handle::try_current() else {
        return Entry::Direct(None);
    };
    let family = Family::of(req);
    let lane = backend.inner.batcher.lane(op, family);
    let mut state = lane.state();
    if state.direct == 0 && state.senders == 0 {
        state.direct += 1;
        return Entry::Direct(Some(DirectGuard(lane)));
    }
    let (reply, answer) = oneshot::channel();
    state.queue.push(Queued {
        req: req.clone(),
        deadline,
        reply,
    });
    if state.senders < SENDERS {
        state.senders += 1;
        drop(state);
        runtime.spawn(send_queued(backend.clone(), op, family));
    }
    Entry::Queued(answer)
}

/// The answer to a queued operation, within the response timeout: past it the caller
/// gives up (an acquisition still queued then is not sent; one on its way may land).
async fn wait(
    backend: &PostgresBackend,
    answer: oneshot::Receiver<Result<Answer>>,
) -> Result<Answer> {
    match tokio::time::timeout(backend.inner.response_timeout, answer).await {
        Ok(Ok(answer)) => answer,
        Ok(Err(_)) => Err(Error::store(
            StoreErrorKind::Unavailable,
            "the lock operation's sender stopped before PostgreSQL answered",
        )),
        Err(_) => Err(StoreError::msg(
            StoreErrorKind::Unavailable,
            format!(
                "PostgreSQL did not answer within {:?}",
                backend.inner.response_timeout
            ),
        )
        .and_unanswered()
        .into()),
    }
}

/// A sender task: sends what is queued of `op`'s kind in `family`, batch after batch,
/// until the queue is empty.
async fn send_queued(backend: PostgresBackend, op: Op, family: Family) {
    /// Counts the sender out if its task ends without emptying the queue (the runtime
    /// shutting down).
    struct Running<'a>(&'a Lane, bool);
    impl Drop for Running<'_> {
        fn drop(&mut self) {
            if self.1 {
                self.0.state().senders -= 1;
            }
        }
    }
    let lane = backend.inner.batcher.lane(op, family);
    let mut running = Running(lane, true);
    loop {
        let batch = {
            let mut state = lane.state();
            drop_given_up(&mut state.queue, op);
            if state.queue.is_empty() {
                // Counted out under the lock that saw the queue empty: whoever queues
                // next finds a sender missing and starts one.
                state.senders -= 1;
                running.1 = false;
                return;
            }
            take_batch(&mut state.queue)
        };
        send(&backend, op, family, batch).await;
    }
}

/// Takes out of `queue` the acquisitions whose callers are gone (they gave up, or were
/// cancelled): they are not sent. Each such caller gives its hold up in the store
/// (`abandon`), as for any attempt it got no answer to, and an attempt that never lands
/// takes nothing. So an outage that outlasts the callers leaves no backlog of dead
/// attempts ahead of the fresh ones. Releases are sent all the same: one frees its lock
/// before the lease ends.
fn drop_given_up(queue: &mut Vec<Queued>, op: Op) {
    if op == Op::Acquire {
        queue.retain(|queued| !queued.reply.is_closed());
    }
}

/// Up to [`MAX_BATCH`] operations of `queue`, in queue order, on names all different
/// (a statement may touch a row once); the rest stay queued, in order.
fn take_batch(queue: &mut Vec<Queued>) -> Vec<Queued> {
    if queue.len() == 1 {
        return std::mem::take(queue);
    }
    let mut batch: Vec<Queued> = Vec::with_capacity(queue.len().min(MAX_BATCH));
    let mut rest = Vec::new();
    for queued in queue.drain(..) {
        if batch.len() < MAX_BATCH && !batch.iter().any(|b| b.req.key == queued.req.key) {
            batch.push(queued);
        } else {
            rest.push(queued);
        }
    }
    *queue = rest;
    batch
}

/// Sends `batch` and answers each of its operations: alone with the single-name
/// statement, or together.
async fn send(backend: &PostgresBackend, op: Op, family: Family, mut batch: Vec<Queued>) {
    if batch.len() == 1 {
        let Some(queued) = batch.pop() else { return };
        let answer = match op {
            Op::Acquire => backend
                .attempt(&queued.req, queued.deadline, None)
                .await
                .map(Answer::Acquire),
            Op::Release => backend
                .release_alone(&queued.req)
                .await
                .map(Answer::Release),
        };
        let _ = queued.reply.send(answer);
        return;
    }
    let answers = match (op, family) {
        (Op::Acquire, Family::Exclusive) => acquire_all(backend, &batch).await,
        (Op::Release, Family::Exclusive) => release_all(backend, &batch).await,
        (Op::Acquire, Family::Other) => acquire_others(backend, &batch).await,
        (Op::Release, Family::Other) => release_others(backend, &batch).await,
    };
    match answers {
        Ok(answers) => {
            for (queued, answer) in batch.into_iter().zip(answers) {
                let _ = queued.reply.send(answer);
            }
        }
        Err(error) => {
            for queued in batch {
                let _ = queued.reply.send(Err(error.duplicate()));
            }
        }
    }
}

/// Each answer's row: `WITH ORDINALITY` counts from 1; a row missing is an error of
/// its operation alone.
fn by_place<R>(len: usize, rows: Vec<(i64, R)>) -> Vec<Option<R>> {
    let mut out: Vec<Option<R>> = (0..len).map(|_| None).collect();
    for (i, row) in rows {
        if let Some(slot) = usize::try_from(i - 1).ok().and_then(|i| out.get_mut(i)) {
            *slot = Some(row);
        }
    }
    out
}

fn unanswered() -> Error {
    Error::store(
        StoreErrorKind::Unexpected,
        "PostgreSQL answered a batch of lock operations without one of them",
    )
}

/// A row a batch of acquisitions answers: its place (from 1), then as
/// [`AttemptRow`].
type BatchRow = (i64, bool, i32, Option<i64>, Option<i64>);

/// The rows `query` answers, on a kept connection, within the response timeout.
async fn fetch<'q, R>(
    backend: &PostgresBackend,
    query: sqlx::query::QueryAs<'q, sqlx::Postgres, R, sqlx::postgres::PgArguments>,
) -> Result<Vec<R>>
where
    R: Send + Unpin + for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow>,
{
    backend
        .on_connection(async |conn| query.fetch_all(conn).await)
        .await
}

/// Each acquisition's answer, from the rows of its batch.
fn acquire_answers(len: usize, rows: Vec<BatchRow>) -> Vec<Result<Answer>> {
    let rows = rows
        .into_iter()
        .map(|(i, acquired, holds, token, ttl_ms)| (i, (acquired, holds, token, ttl_ms)))
        .collect();
    by_place(len, rows)
        .into_iter()
        .map(|row: Option<AttemptRow>| {
            let row = row.ok_or_else(unanswered)?;
            PostgresBackend::acquire_answer(row).map(Answer::Acquire)
        })
        .collect()
}

/// Each release's answer, from the rows (place, holds left) of its batch; a release
/// that freed its lock wakes this process's waiters now.
fn release_answers(
    backend: &PostgresBackend,
    batch: &[Queued],
    rows: Vec<(i64, i32)>,
) -> Vec<Result<Answer>> {
    by_place(batch.len(), rows)
        .into_iter()
        .zip(batch)
        .map(|(left, queued)| {
            let left = left.ok_or_else(unanswered)?;
            Ok(Answer::Release(backend.released(&queued.req.key, left)))
        })
        .collect()
}

/// The names, owners and leases of `batch`'s operations, as the batch statements take
/// them.
fn columns(batch: &[Queued]) -> (Vec<&str>, Vec<&str>, Vec<i64>) {
    let names = batch.iter().map(|q| q.req.key.as_str()).collect();
    let owners = batch.iter().map(|q| q.req.hold_id.as_str()).collect();
    let leases = batch.iter().map(|q| millis(q.req.lease)).collect();
    (names, owners, leases)
}

/// One `lock_x_batch` statement for every exclusive acquisition of `batch`.
async fn acquire_all(backend: &PostgresBackend, batch: &[Queued]) -> Result<Vec<Result<Answer>>> {
    let inner = &backend.inner;
    let (names, owners, leases) = columns(batch);
    let fenced: Vec<bool> = batch.iter().map(|q| q.req.fenced).collect();
    let deadlines: Vec<i64> = batch.iter().map(|q| q.deadline).collect();
    let fast: Vec<bool> = batch
        .iter()
        .map(|q| inner.fast_grants.is_some_and(|max| q.req.lease <= max))
        .collect();
    let query = sqlx::query_as(&inner.statements.lock_x_batch)
        .bind(names)
        .bind(owners)
        .bind(leases)
        .bind(fenced)
        .bind(deadlines)
        .bind(fast);
    Ok(acquire_answers(batch.len(), fetch(backend, query).await?))
}

/// One `unlock_x_batch` statement for every exclusive release of `batch`.
async fn release_all(backend: &PostgresBackend, batch: &[Queued]) -> Result<Vec<Result<Answer>>> {
    let inner = &backend.inner;
    let (names, owners, leases) = columns(batch);
    let query = sqlx::query_as(&inner.statements.unlock_x_batch)
        .bind(names)
        .bind(owners)
        .bind(leases)
        .bind(&inner.origin);
    let rows: Vec<(i64, i32, bool)> = fetch(backend, query).await?;
    let rows = rows.into_iter().map(|(i, left, _)| (i, left)).collect();
    Ok(release_answers(backend, batch, rows))
}

/// One `_acquire_batch` call for every acquisition of `batch` (modes other than the
/// exclusive one).
async fn acquire_others(
    backend: &PostgresBackend,
    batch: &[Queued],
) -> Result<Vec<Result<Answer>>> {
    let inner = &backend.inner;
    let (names, owners, leases) = columns(batch);
    let modes: Vec<i8> = batch.iter().map(|q| mode_char(q.req.mode)).collect();
    let max: Vec<i32> = batch.iter().map(|q| permits_max(q.req.mode)).collect();
    let fenced: Vec<bool> = batch.iter().map(|q| q.req.fenced).collect();
    let writers: Vec<Option<&str>> = batch
        .iter()
        .map(|q| q.req.writer.as_ref().map(|w| w.as_str()))
        .collect();
    let deadlines: Vec<i64> = batch.iter().map(|q| q.deadline).collect();
    let query = sqlx::query_as(&inner.statements.acquire_batch)
        .bind(names)
        .bind(owners)
        .bind(modes)
        .bind(max)
        .bind(leases)
        .bind(fenced)
        .bind(writers)
        .bind(millis(inner.waiter_timeout))
        .bind(deadlines);
    Ok(acquire_answers(batch.len(), fetch(backend, query).await?))
}

/// One `_release_batch` call for every release of `batch` (modes other than the
/// exclusive one).
async fn release_others(
    backend: &PostgresBackend,
    batch: &[Queued],
) -> Result<Vec<Result<Answer>>> {
    let inner = &backend.inner;
    let (names, owners, leases) = columns(batch);
    let modes: Vec<i8> = batch.iter().map(|q| mode_char(q.req.mode)).collect();
    let query = sqlx::query_as(&inner.statements.release_batch)
        .bind(names)
        .bind(owners)
        .bind(modes)
        .bind(leases)
        .bind(&inner.origin);
    Ok(release_answers(
        backend,
        batch,
        fetch(backend, query).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::LockMode;
    use crate::hold_id::HoldId;
    use crate::key::LockKey;
    use std::time::Duration;

    fn queued(key: &str, owner: &str) -> Queued {
        queued_for(key, owner).0
    }

    /// A queued operation and its caller's end.
    fn queued_for(key: &str, owner: &str) -> (Queued, oneshot::Receiver<Result<Answer>>) {
        let req = LockRequest::new(
            LockKey::new(key).unwrap(),
            HoldId::from_raw(owner).unwrap(),
            LockMode::Exclusive,
            Duration::from_secs(30),
        );
        let (reply, answer) = oneshot::channel();
        let queued = Queued {
            req,
            deadline: 0,
            reply,
        };
        (queued, answer)
    }

    #[test]
    fn acquisitions_whose_callers_left_are_not_sent_releases_are() {
        let (kept, _caller) = queued_for("a", "o:1");
        let (left, gone) = queued_for("b", "o:2");
        drop(gone);
        let mut acquisitions = vec![left, kept];
        drop_given_up(&mut acquisitions, Op::Acquire);
        assert_eq!(owners(&acquisitions), ["o:1"]);
        let (release, gone) = queued_for("c", "o:3");
        drop(gone);
        let mut releases = vec![release];
        drop_given_up(&mut releases, Op::Release);
        assert_eq!(owners(&releases), ["o:3"]);
    }

    fn owners(queue: &[Queued]) -> Vec<&str> {
        queue.iter().map(|q| q.req.hold_id.as_str()).collect()
    }

    #[test]
    fn a_batch_takes_each_name_once_and_leaves_the_rest_in_order() {
        let mut queue = vec![
            queued("a", "o:1"),
            queued("b", "o:2"),
            queued("a", "o:3"),
            queued("c", "o:4"),
            queued("a", "o:5"),
        ];
        let batch = take_batch(&mut queue);
        assert_eq!(owners(&batch), ["o:1", "o:2", "o:4"]);
        assert_eq!(owners(&queue), ["o:3", "o:5"]);
        let batch = take_batch(&mut queue);
        assert_eq!(owners(&batch), ["o:3"]);
        assert_eq!(owners(&queue), ["o:5"]);
    }

    #[test]
    fn a_batch_carries_at_most_the_most() {
        let mut queue: Vec<Queued> = (0..MAX_BATCH + 3)
            .map(|i| queued(&format!("k{i}"), &format!("o:{i}")))
            .collect();
        let batch = take_batch(&mut queue);
        assert_eq!(batch.len(), MAX_BATCH);
        let rest: Vec<String> = (MAX_BATCH..MAX_BATCH + 3)
            .map(|i| format!("o:{i}"))
            .collect();
        assert_eq!(owners(&queue), rest);
    }

    #[test]
    fn answers_are_placed_by_their_ordinality() {
        let placed = by_place(4, vec![(3, 'c'), (1, 'a'), (9, 'x'), (0, 'y')]);
        assert_eq!(placed, [Some('a'), None, Some('c'), None]);
    }
}
