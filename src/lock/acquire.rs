//! The acquire loop shared by every lock kind and every backend.
//!
//! Redisson's `tryLock(wait, lease)`: try once; if busy and time is left, subscribe to
//! releases *first*, then try again, then sleep until a release is signalled or the
//! holder's lease would end, whichever is sooner, bounded by the deadline; repeat. A
//! notification that is lost or late costs at most the holder's remaining lease.
//!
//! The first attempt's errors are returned at once (a caller learns immediately that
//! the store is down). Once waiting, transient errors (`Error::is_retryable`: a lost
//! connection, a timeout) are retried with backoff until the deadline — or, without one,
//! until the store has failed for a whole watchdog lease — so a waiter rides out a
//! restart or failover instead of failing with most of its wait left.

use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use super::guard::LockGuard;
use super::{Lease, Lock, LockClient, LockEvent};
use crate::backend::{Acquire, Grant, LockRequest, Subscription, Wake};
use crate::error::{Error, Result};
use crate::owner::Owner;

/// How long a waiter sleeps between attempts when the holder's lock has no expiry (or
/// the backend cannot tell its TTL) and no release is signalled: a safety net against a
/// lost notification, not a polling interval.
const NO_TTL_RECHECK: Duration = Duration::from_secs(1);

/// The longest a new acquirer lined up behind local waiters waits for its turn before it
/// tries anyway (a safety net for a lease that lapsed without a release message).
const LINE_UP_MAX: Duration = Duration::from_secs(1);

/// The first and the longest pause before retrying after a transient store failure
/// (connection lost, timeout) while waiting.
const MIN_ERROR_BACKOFF: Duration = Duration::from_millis(20);
const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(1);

/// The shortest sleep between attempts, so a TTL of zero (a lease ending right now)
/// cannot spin.
const MIN_RECHECK: Duration = Duration::from_millis(1);

/// Who an acquisition acts for.
#[derive(Clone)]
pub(crate) struct Acting {
    pub(crate) owner: Owner,
    /// A fresh owner nobody else uses, so an attempt cancelled in flight can safely be
    /// compensated with a release.
    pub(crate) fresh: bool,
}

impl Acting {
    /// `explicit`, else the current scope's owner, else a fresh owner of `client`.
    pub(crate) fn resolve(explicit: Option<&Owner>, client: &LockClient) -> Self {
        match explicit.cloned().or_else(Owner::current) {
            Some(owner) => Acting {
                owner,
                fresh: false,
            },
            None => Acting {
                owner: client.new_owner(),
                fresh: true,
            },
        }
    }
}

/// The instant a wait of `wait` from now ends; `None` (forever) when `wait` is `None` or
/// too long to represent.
pub(crate) fn deadline_after(wait: Option<Duration>) -> Option<Instant> {
    wait.and_then(|w| Instant::now().checked_add(w))
}

pub(crate) async fn acquire(
    lock: &Lock,
    wait: Option<Duration>,
    lease: Lease,
) -> Result<LockGuard> {
    let deadline = deadline_after(wait);
    acquire_as(
        lock,
        Acting::resolve(lock.owner.as_ref(), &lock.client),
        deadline,
        lease,
    )
    .await
}

pub(crate) async fn acquire_as(
    lock: &Lock,
    acting: Acting,
    deadline: Option<Instant>,
    lease: Lease,
) -> Result<LockGuard> {
    let client = &lock.client;
    let (lease_len, watched) = match lease {
        Lease::Watchdog => (client.watchdog_lease(), true),
        Lease::Fixed(lease) => (super::validate_lease("lease", lease)?, false),
    };
    let Acting {
        owner,
        fresh: fresh_owner,
    } = acting;
    let req = LockRequest::new(lock.key.clone(), owner, lock.mode, lease_len);
    let started = Instant::now();

    let hooks = client.hooks();
    let span = tracing::debug_span!(
        "tower_lock.acquire",
        key = %hooks.key(&req.key),
        mode = %req.mode,
        owner = %req.owner,
        outcome = tracing::field::Empty,
        wait_us = tracing::field::Empty,
    );
    let result = run(client, &req, deadline, fresh_owner)
        .instrument(span.clone())
        .await;
    let waited = started.elapsed();
    span.record("wait_us", waited.as_micros() as u64);
    let event = LockEvent {
        key: &req.key,
        mode: req.mode,
        owner: &req.owner,
    };
    let (grant, sent_at) = match result {
        Ok(acquired) => {
            span.record("outcome", "acquired");
            if let Some(observer) = hooks.observer() {
                observer.acquired(event, waited);
            }
            acquired
        }
        Err(error) => {
            span.record("outcome", if error.is_busy() { "busy" } else { "error" });
            if let Some(observer) = hooks.observer() {
                if error.is_busy() {
                    observer.busy(event, waited);
                } else {
                    observer.acquire_failed(event, &error);
                }
            }
            return Err(error);
        }
    };

    let expires_at = match grant.valid_for() {
        Some(valid_for) => Instant::now() + valid_for,
        None => sent_at + lease_len,
    };
    let registration = client.watchdog().register(&req, Some(expires_at), watched);
    Ok(LockGuard::new(
        client.clone(),
        req,
        grant.token(),
        grant.holds(),
        registration,
        watched,
    ))
}

async fn run(
    client: &LockClient,
    req: &LockRequest,
    deadline: Option<Instant>,
    fresh_owner: bool,
) -> Result<(Grant, Instant)> {
    let expired = |now: Instant| deadline.is_some_and(|d| now >= d);
    let backend = client.backend();
    let queued_mode = backend.queues_waiters(req.mode);

    // No barging within a process: when others here already wait for this key, a new
    // acquirer lines up behind them (they are woken first to last) instead of snatching
    // the lock in the instant after each release. Only fresh owners line up: they hold
    // nothing, so they cannot be waiting behind waiters who wait for them.
    let line_up =
        fresh_owner && !queued_mode && !expired(Instant::now()) && backend.has_local_waiters(req);
    let mut ttl = None;
    if !line_up {
        let first = attempt(client, req, fresh_owner).await;
        if first.is_err() && fresh_owner {
            compensate_later(client, req);
        }
        match first? {
            (Acquire::Acquired(grant), sent_at) => return Ok((grant, sent_at)),
            (Acquire::Busy { ttl: holder_ttl }, _) => ttl = holder_ttl,
        }
    }
    // The waiting state lives in its own allocation, made only when there is something
    // to wait for: the uncontended path's future stays small (it is built, boxed and
    // moved on every acquisition).
    Box::pin(wait(client, req, deadline, fresh_owner, line_up, ttl)).await
}

/// The contended path of [`run`]: line up or subscribe, then attempt and sleep until
/// acquired, out of time, or failed.
async fn wait(
    client: &LockClient,
    req: &LockRequest,
    deadline: Option<Instant>,
    fresh_owner: bool,
    line_up: bool,
    ttl: Option<Duration>,
) -> Result<(Grant, Instant)> {
    let expired = |now: Instant| deadline.is_some_and(|d| now >= d);
    let backend = client.backend();
    let queued_mode = backend.queues_waiters(req.mode);
    // From the first busy answer on, a queueing backend keeps this owner in line; every
    // way out below (giving up at once, a failed subscribe, cancellation) leaves it.
    let mut in_line = InLine {
        queued: queued_mode,
        client,
        req,
    };
    if expired(Instant::now()) {
        in_line.give_up().await;
        return Err(Error::Busy { holder_ttl: ttl });
    }

    // Subscribing may wait for the store to confirm; never past the caller's deadline.
    let sub = match deadline {
        Some(at) => match tokio::time::timeout_at(at, backend.subscribe(req)).await {
            Ok(sub) => sub?,
            Err(_) => {
                in_line.give_up().await;
                return Err(Error::Busy { holder_ttl: ttl });
            }
        },
        None => backend.subscribe(req).await?,
    };
    let mut waiting = Waiting {
        sub,
        woken: false,
        settled: false,
        pass_turn_on_leave: !queued_mode,
        in_line,
    };
    if line_up {
        // Wait for our turn; a release, or a waiter ahead giving up, wakes us. Should
        // neither come (a holder's lease lapsed silently), try anyway after a while.
        let now = Instant::now();
        let until = deadline.map_or(now + LINE_UP_MAX, |d| d.min(now + LINE_UP_MAX));
        waiting.woken = waiting.sub.wait(until).await == Wake::Notified;
    }
    // Transient backend failures while waiting: when the current run of them began, and
    // the next backoff.
    let mut failing_since: Option<Instant> = None;
    let mut backoff = MIN_ERROR_BACKOFF;
    loop {
        let outcome = match attempt(client, req, fresh_owner).await {
            Ok(outcome) => {
                failing_since = None;
                backoff = MIN_ERROR_BACKOFF;
                outcome
            }
            Err(error) if error.is_retryable() => {
                let now = Instant::now();
                let since = *failing_since.get_or_insert(now);
                // Without a deadline, give up once the store has failed for a whole lease:
                // by then no lock it held for anyone is still valid either.
                let out_of_patience = deadline.is_none() && now - since >= client.watchdog_lease();
                if expired(now) || out_of_patience {
                    if fresh_owner {
                        compensate_later(client, req);
                    }
                    return Err(error);
                }
                tracing::warn!(%error, retry_in_ms = backoff.as_millis() as u64, "lock store failed while waiting; retrying");
                if fresh_owner {
                    compensate_now(client, req).await;
                }
                let until = deadline.map_or(now + backoff, |d| d.min(now + backoff));
                backoff = (backoff * 2).min(MAX_ERROR_BACKOFF);
                // A reconnect notification cuts the backoff short.
                waiting.woken = waiting.sub.wait(until).await == Wake::Notified;
                continue;
            }
            Err(error) => {
                if fresh_owner {
                    compensate_later(client, req);
                }
                return Err(error);
            }
        };
        // The wake-up, if any, has been used by this attempt.
        waiting.woken = false;
        let ttl = match outcome {
            (Acquire::Acquired(grant), sent_at) => {
                waiting.in_line.queued = false;
                waiting.settled = true;
                return Ok((grant, sent_at));
            }
            (Acquire::Busy { ttl }, _) => ttl,
        };
        let now = Instant::now();
        if expired(now) {
            waiting.in_line.give_up().await;
            return Err(Error::Busy { holder_ttl: ttl });
        }
        tracing::trace!(
            holder_ttl_ms = ttl.map(|t| t.as_millis() as u64),
            "lock busy; waiting for a release"
        );
        let recheck = ttl.unwrap_or(NO_TTL_RECHECK).max(MIN_RECHECK);
        let until = match (now.checked_add(recheck), deadline) {
            (Some(at), Some(deadline)) => at.min(deadline),
            (Some(at), None) => at,
            (None, Some(deadline)) => deadline,
            (None, None) => now + NO_TTL_RECHECK,
        };
        if waiting.sub.wait(until).await == Wake::Notified {
            waiting.woken = true;
            tracing::trace!("woken by a release; retrying");
        }
    }
}

/// One acquire call. With a fresh owner (one nobody else can be using), a call cancelled
/// in flight may still have taken the lock in the store; a release is then spawned for
/// it, so the key is not held until the lease runs out. A call that fails is left to the
/// caller (see [`compensate_now`]). For any owner, a hold applied but never answered is
/// also repaired when the client's last guard of that hold is released.
async fn attempt(
    client: &LockClient,
    req: &LockRequest,
    fresh_owner: bool,
) -> Result<(Acquire, Instant)> {
    struct InFlight<'a> {
        client: &'a LockClient,
        req: &'a LockRequest,
        armed: bool,
    }
    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            if self.armed
                && let Ok(runtime) = tokio::runtime::Handle::try_current()
            {
                let backend = self.client.backend().clone();
                let req = self.req.clone();
                runtime.spawn(async move {
                    let _ = backend.release(&req).await;
                });
            }
        }
    }

    let sent_at = Instant::now();
    let mut in_flight = InFlight {
        client,
        req,
        armed: fresh_owner,
    };
    let outcome = client.backend().acquire(req).await;
    // Answered (even with an error): the caller decides what to compensate, and when,
    // since it may try again as the same owner.
    in_flight.armed = false;
    Ok((outcome?, sent_at))
}

/// After an attempt of a fresh owner failed without an answer (a timeout, a lost
/// connection), the store may or may not have applied it. Before trying again as the
/// same owner, take back whatever it may have taken — awaited, so the release cannot
/// land after the next attempt's grant and free a lock just won.
async fn compensate_now(client: &LockClient, req: &LockRequest) {
    if let Err(error) = client.backend().release(req).await {
        // A hold it left (if any) is released when this owner's last guard goes, or by
        // its lease.
        tracing::debug!(%error, "could not take back an unanswered attempt");
    }
}

/// The same when giving up: nothing will follow as this owner, so it can run later.
fn compensate_later(client: &LockClient, req: &LockRequest) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let backend = client.backend().clone();
        let req = req.clone();
        runtime.spawn(async move {
            let _ = backend.release(&req).await;
        });
    }
}

/// A waiter's place in the store's wait queue (a fair or read-write queue), when the
/// backend keeps one. Dropped while still queued (cancelled, failed), it leaves the queue
/// in a spawned task; the store evicts it anyway if that fails.
struct InLine<'a> {
    /// The backend keeps this waiter in the store until told otherwise.
    queued: bool,
    client: &'a LockClient,
    req: &'a LockRequest,
}

impl InLine<'_> {
    async fn give_up(&mut self) {
        if std::mem::take(&mut self.queued)
            && let Err(error) = self.client.backend().cancel_wait(self.req).await
        {
            tracing::debug!(%error, "could not leave the wait queue; the store will evict this waiter");
        }
    }
}

impl Drop for InLine<'_> {
    fn drop(&mut self) {
        if self.queued
            && let Ok(runtime) = tokio::runtime::Handle::try_current()
        {
            let backend = self.client.backend().clone();
            let req = self.req.clone();
            runtime.spawn(async move {
                let _ = backend.cancel_wait(&req).await;
            });
        }
    }
}

/// A subscribed waiter between attempts. Dropped without success (cancelled, failed, out
/// of time), it hands its turn on to the next local waiter — a wake-up it had not used,
/// or, where local waiters line up, its place — then unsubscribes, then leaves the
/// store's queue (fields drop in order).
struct Waiting<'a> {
    sub: Box<dyn Subscription>,
    /// Woken by a release whose follow-up attempt has not completed yet.
    woken: bool,
    /// Acquired: nothing to hand on.
    settled: bool,
    /// Leaving without the lock wakes the next local waiter, so one lined up behind
    /// this waiter is not left sleeping (modes without a store-side queue).
    pass_turn_on_leave: bool,
    in_line: InLine<'a>,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.woken || (!self.settled && self.pass_turn_on_leave) {
            self.sub.pass_on();
        }
    }
}
