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

use std::borrow::Borrow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;
use tracing::Instrument;

use super::cleanup;
use super::guard::LockGuard;
use super::registry::{Entered, Hold, Registry, Slot};
use super::{Lease, Lock, LockClient, LockEvent};
use crate::backend::{Acquire, Grant, LockMode, LockRequest, Subscription, Wake};
use crate::error::{Error, Result};
use crate::hold_id::HoldId;
use crate::owner::Owner;

/// How long a waiter sleeps between attempts when the holder's lock has no expiry (or
/// the backend cannot tell its TTL) and no release is signalled: a safety net against a
/// lost notification, not a polling interval.
const NO_TTL_RECHECK: Duration = Duration::from_secs(1);

/// The longest a new acquirer lined up behind local waiters waits for its turn before it
/// tries anyway (a safety net for a lease that lapsed without a release message).
const LINE_UP_MAX: Duration = Duration::from_secs(1);

/// The first and the longest pause before retrying after a transient store failure
/// (connection lost, timeout) while waiting, and between two probes of a key's waiting
/// cleanups.
pub(super) const MIN_ERROR_BACKOFF: Duration = Duration::from_millis(20);
pub(super) const MAX_ERROR_BACKOFF: Duration = Duration::from_secs(1);

/// The shortest sleep between attempts, so a TTL of zero (a lease ending right now)
/// cannot spin.
const MIN_RECHECK: Duration = Duration::from_millis(1);

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
    let owner = lock.owner.clone().or_else(Owner::current);
    acquire_as(lock, owner, deadline_after(wait), lease).await
}

/// What an acquisition starts from: the lease, the runtime, the slot, and whether the
/// owner is fresh (used once, so it can be its hold's store identity as well).
struct Start {
    lease_len: Duration,
    watched: bool,
    runtime: Handle,
    slot: Slot,
    fresh: bool,
}

/// Who an acquisition acts as.
#[derive(Clone)]
pub(crate) enum Acting {
    /// An owner that may hold other locks (or may have held this one before): each hold
    /// it takes gets an identity of its own.
    As(Owner),
    /// A fresh owner, made for this acquisition only.
    New,
    /// An owner made for one request that has taken no lock yet: this acquisition's hold
    /// (its first) is identified by the owner's own string, which saves making one.
    /// Later holds of the owner get identities of their own.
    First(Owner),
}

impl From<Option<Owner>> for Acting {
    fn from(owner: Option<Owner>) -> Self {
        owner.map_or(Acting::New, Acting::As)
    }
}

fn start(lock: &Lock, acting: Acting, lease: Lease) -> Result<Start> {
    let client = &lock.client;
    if client.registry().is_closed() {
        return Err(Error::Shutdown);
    }
    let (lease_len, watched) = match lease {
        Lease::Watchdog => (client.watchdog_lease(), true),
        Lease::Renewed(lease) => (super::validate_renewed_lease("lease", lease)?, true),
        Lease::Fixed(lease) => (super::validate_lease("lease", lease)?, false),
    };
    // Releases and renewals run as tasks on the runtime the lock is taken on.
    let runtime = Handle::try_current().map_err(|_| {
        Error::invalid_config(
            "runtime",
            "is missing: locks must be taken inside a tokio runtime, which runs their releases and renewals (got none)",
        )
    })?;
    client.register_name_if_due(&runtime);
    let (owner, fresh) = match acting {
        Acting::As(owner) => (owner, false),
        Acting::New => (client.new_owner(), true),
        Acting::First(owner) => (owner, true),
    };
    let slot = Slot {
        key: lock.key.clone(),
        owner,
        mode: lock.mode,
        fenced: lock.fenced,
    };
    Ok(Start {
        lease_len,
        watched,
        runtime,
        slot,
        fresh,
    })
}

impl Start {
    /// The lease the watchdog renews this acquisition's hold with, if it is watched.
    fn watch(&self) -> Option<Duration> {
        self.watched.then_some(self.lease_len)
    }

    fn enter(&self, client: &LockClient) -> Entered {
        let slot = &self.slot;
        client
            .registry()
            .enter(slot, self.watch(), &self.runtime, |state| {
                let hold_id = if self.fresh {
                    HoldId::of_fresh_owner(&slot.owner)
                } else {
                    client.new_hold_id()
                };
                let mut req =
                    LockRequest::new(slot.key.clone(), hold_id, slot.mode, self.lease_len);
                req.fenced = slot.fenced;
                if slot.mode == LockMode::Read {
                    // The owner's own write hold lets its reads in (downgrade).
                    req.writer = state.write_hold_id(&slot.key, &slot.owner);
                }
                req
            })
    }

    fn span(&self, client: &LockClient, req: &LockRequest) -> tracing::Span {
        tracing::debug_span!(
            "tower_lock.acquire",
            key = %client.hooks().key(&req.key),
            mode = %req.mode,
            owner = %self.slot.owner,
            client = client.name(),
            outcome = tracing::field::Empty,
            wait_us = tracing::field::Empty,
        )
    }

    fn event<'a>(&'a self, client: &LockClient) -> LockEvent<'a> {
        client
            .hooks()
            .event(&self.slot.key, self.slot.mode, &self.slot.owner)
    }

    /// Reports a failed acquisition (span and observer) and hands the error back.
    fn failed(
        &self,
        client: &LockClient,
        span: &tracing::Span,
        error: Error,
        waited: Duration,
    ) -> Error {
        span.record("outcome", if error.is_busy() { "busy" } else { "error" });
        if let Some(observer) = client.hooks().observer() {
            if error.is_busy() {
                observer.busy(self.event(client), waited);
            } else {
                observer.acquire_failed(self.event(client), &error);
            }
        }
        error
    }

    /// Makes the granted hold held and returns its first guard; [`Error::Shutdown`]
    /// (the grant taken back) when the client shut down meanwhile.
    fn granted(
        self,
        client: &LockClient,
        pending: Pending<'_>,
        attempt: Attempted,
        waited: Duration,
    ) -> Result<LockGuard> {
        // The hold is believed from when the granting request was sent, for the lease
        // less the backend's drift allowance — and no longer than the backend's own
        // validity, counted from when its answer came.
        let valid = self
            .lease_len
            .saturating_sub(client.backend().profile().clock_drift(self.lease_len));
        let mut expires_at = attempt.sent_at.checked_add(valid);
        if let Some(valid_for) = attempt.grant.valid_for() {
            let limit = attempt.answered_at.checked_add(valid_for);
            expires_at = match (expires_at, limit) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        let Some(hold) = pending.activate(
            attempt.grant.token(),
            expires_at,
            self.watch(),
            &self.runtime,
        ) else {
            return Err(Error::Shutdown);
        };
        let span = tracing::debug_span!(
            "tower_lock.hold",
            key = %client.hooks().key(&hold.store.key),
            mode = %hold.store.mode,
            hold_id = %hold.store.hold_id,
            token = attempt.grant.token().map(|t| t.get()),
            waited_us = waited.as_micros() as u64,
        );
        let _ = hold.span.set(span);
        let observer = client.hooks().observer();
        if let Some(observer) = observer {
            observer.acquired(self.event(client), waited);
        }
        let mut guard = self.guard(client, hold, 1);
        if observer.is_some() {
            guard.mark_observed();
        }
        Ok(guard)
    }

    /// A guard of `hold`, its `holds`-th.
    fn guard(self, client: &LockClient, hold: Arc<Hold>, holds: u32) -> LockGuard {
        LockGuard::new(
            client.clone(),
            hold,
            holds,
            self.lease_len,
            self.watched,
            self.runtime,
        )
    }
}

/// What the fast path found.
enum Fast {
    /// Answered on the spot: the guard, or why there is none.
    Done(Result<LockGuard>),
    /// The store answered busy (with the holder's remaining lease), and nothing was left
    /// in it: the wait starts from this answer instead of asking again.
    Busy(Option<Duration>),
    /// Not for the fast path: the async path asks.
    Defer,
}

/// The acquisition, answered on the spot when it can be: a free lock of an unqueued
/// mode on a backend that answers without I/O (memory). Anything that would do I/O or
/// queue is deferred, with nothing left behind, to [`acquire_waiting`].
fn try_acquire_now(lock: &Lock, acting: Acting, lease: Lease) -> Fast {
    let client = &lock.client;
    let backend = client.backend();
    // A busy attempt in a queued mode would queue this owner: only the waiting path
    // undoes that.
    let Some(local) = backend.local() else {
        return Fast::Defer;
    };
    if backend.profile().queues_waiters(lock.mode) {
        return Fast::Defer;
    }
    let start = match start(lock, acting, lease) {
        Ok(start) => start,
        Err(error) => return Fast::Done(Err(error)),
    };
    let started = Instant::now();
    let hold = match start.enter(client) {
        Entered::Acquire(hold) => hold,
        Entered::Reentered { hold, count } => {
            let guard = start.guard(client, hold, count);
            if needs_renewal(&guard) {
                // Renewing is I/O-shaped: the async path does it. Dropping this guard
                // only leaves the hold (or, if its other guards went meanwhile, releases
                // it, as any last guard does).
                return Fast::Defer;
            }
            return Fast::Done(reentered(client, guard, started));
        }
        // An acquisition in flight is waited for.
        Entered::Wait(_) => return Fast::Defer,
    };
    // Until activated, dropping this (a failure, giving up) frees the slot.
    let pending = Pending {
        registry: client.registry(),
        hold: Some(hold),
    };
    if backend.has_local_waiters(pending.store()) {
        return Fast::Defer;
    }
    let sent_at = Instant::now();
    let Some(outcome) = local.acquire_now(pending.store()) else {
        return Fast::Defer;
    };
    let attempt = (sent_at, Instant::now());
    answered_now(client, start, pending, outcome, attempt, started)
}

/// The fast path's answer from the store (asked at `sent_at`, answered at
/// `answered_at`), turned into what the caller gets.
fn answered_now(
    client: &LockClient,
    start: Start,
    pending: Pending<'_>,
    outcome: Result<Acquire>,
    (sent_at, answered_at): (Instant, Instant),
    started: Instant,
) -> Fast {
    let req = pending.store();
    let span = start.span(client, req);
    let waited = started.elapsed();
    span.record("wait_us", waited.as_micros() as u64);
    match outcome {
        Ok(Acquire::Acquired(grant)) => {
            span.record("outcome", "acquired");
            let attempt = Attempted {
                grant,
                sent_at,
                answered_at,
            };
            Fast::Done(start.granted(client, pending, attempt, waited))
        }
        // Busy: waiting is the async path's (nothing was left in the store).
        Ok(Acquire::Busy { ttl }) => Fast::Busy(ttl),
        Err(error) => {
            compensate_later(client, req, &error);
            Fast::Done(Err(start.failed(client, &span, error, waited)))
        }
    }
}

/// An acquisition begun: of one lock by [`begin_acquire`] (`G` is a [`LockGuard`]), or
/// of a request's locks by the layer.
pub(crate) enum Acquisition<G, W> {
    /// Answered without waiting and without I/O: the guard, or why there is none.
    Now(Result<G>),
    /// Still to do: the wait, or the store's answer over I/O, as a future of `Result<G>`.
    Later(W),
}

/// The one way in to an acquisition, shared by [`Lock`] (through [`acquire_as`]) and
/// the layer's response future: acquires `lock` as `acting` says, waiting until
/// `deadline` (`None`: as long as it takes), holding it with `lease`.
///
/// The fast path is tried here, once: a backend that answers without I/O and a lock
/// that is free (or the owner's own, to re-enter) give [`Acquisition::Now`]. Anything
/// else gives the rest of the acquisition as [`Acquisition::Later`] — which starts
/// from the fast path's busy answer, if it got one, instead of asking again; dropped
/// before it finishes, it leaves no lock and no waiter behind.
pub(crate) fn begin_acquire<L>(
    lock: L,
    acting: Acting,
    deadline: Option<Instant>,
    lease: Lease,
) -> Acquisition<LockGuard, impl Future<Output = Result<LockGuard>> + Send>
where
    L: Borrow<Lock> + Send,
{
    // A busy fast path leaves nothing in the store (it answers on the spot), so a
    // `First` owner's string is still unused when the waiting path takes it up.
    let busy = match try_acquire_now(lock.borrow(), acting.clone(), lease) {
        Fast::Done(done) => return Acquisition::Now(done),
        Fast::Busy(holder_ttl) => Some(holder_ttl),
        Fast::Defer => None,
    };
    let known = Known { deadline, busy };
    Acquisition::Later(async move { acquire_waiting(lock.borrow(), acting, known, lease).await })
}

/// What the waiting path starts from: the caller's deadline, and the busy answer (the
/// holder's remaining lease) the fast path got, if any.
struct Known {
    deadline: Option<Instant>,
    busy: Option<Option<Duration>>,
}

/// Acquires `lock` as `owner` (`None`: a fresh owner, used for this acquisition only),
/// waiting until `deadline` (`None`: as long as it takes).
///
/// The owner's live hold of the same slot is re-entered without the store; otherwise a
/// new hold is taken in the store under an identity of its own (see the
/// [registry](super::registry)), after any acquisition of the same slot by another task
/// of the owner has finished.
pub(crate) async fn acquire_as(
    lock: &Lock,
    owner: Option<Owner>,
    deadline: Option<Instant>,
    lease: Lease,
) -> Result<LockGuard> {
    match begin_acquire(lock, owner.into(), deadline, lease) {
        Acquisition::Now(done) => done,
        Acquisition::Later(waiting) => waiting.await,
    }
}

/// [`acquire_as`] past the fast path, which [`begin_acquire`] has just tried.
async fn acquire_waiting(
    lock: &Lock,
    acting: Acting,
    known: Known,
    lease: Lease,
) -> Result<LockGuard> {
    let Known { deadline, busy } = known;
    let client = &lock.client;
    let start = start(lock, acting, lease)?;
    let started = Instant::now();
    let hold = loop {
        match start.enter(client) {
            Entered::Reentered { hold, count } => {
                let guard = start.guard(client, hold, count);
                return reenter(client, guard, started).await;
            }
            Entered::Wait(hold) => {
                if !hold.acquisition_finished(deadline).await {
                    return Err(Error::Busy { holder_ttl: None });
                }
            }
            Entered::Acquire(hold) => break hold,
        }
    };
    // Until activated, dropping this (a failure, a cancellation) frees the slot.
    let mut pending = Pending {
        registry: client.registry(),
        hold: Some(hold),
    };
    let span = start.span(client, pending.store());
    let closing = client.registry().closing().clone();
    let result = tokio::select! {
        // Shutting down: the wait is given up as a cancelled one is, nothing left behind.
        () = closing.cancelled() => Err(Error::Shutdown),
        result = run(
            client,
            &mut pending,
            &start.slot.owner,
            Known { deadline, busy },
        )
        .instrument(span.clone()) => result,
    };
    let waited = started.elapsed();
    span.record("wait_us", waited.as_micros() as u64);
    match result {
        Ok(attempt) => {
            span.record("outcome", "acquired");
            start.granted(client, pending, attempt, waited)
        }
        Err(error) => Err(start.failed(client, &span, error, waited)),
    }
}

/// Whether re-entering `guard`'s hold must first renew it: a fixed lease asked for
/// that would outlast what the hold has left.
fn needs_renewal(guard: &LockGuard) -> bool {
    let wanted = Instant::now().checked_add(guard.lease());
    match (guard.hold().expiry.get(), wanted) {
        (Some(at), Some(wanted)) => !guard.is_watched() && at < wanted,
        _ => false,
    }
}

/// `guard` is one more guard of its owner's live hold: no store call, unless a fixed
/// lease asks for more than the hold has left (then the hold is extended, never
/// shortened).
async fn reenter(client: &LockClient, guard: LockGuard, started: Instant) -> Result<LockGuard> {
    if needs_renewal(&guard) {
        let hold = Arc::clone(guard.hold());
        let lease = guard.lease();
        let backend = client.backend();
        let mut req = hold.store.clone();
        req.lease = lease;
        let sent_at = Instant::now();
        // On an error the guard is dropped: it leaves, and the hold stays as it was.
        if !backend.renew(&req).await? {
            client.registry().mark_lost(&hold);
            drop(guard);
            return Err(Error::Lost);
        }
        let valid = lease.saturating_sub(backend.profile().clock_drift(lease));
        hold.expiry.extend_to(sent_at.checked_add(valid));
    }
    reentered(client, guard, started)
}

/// A re-entry, done: observed and handed out.
fn reentered(client: &LockClient, mut guard: LockGuard, started: Instant) -> Result<LockGuard> {
    if let Some(observer) = client.hooks().observer() {
        let hold = guard.hold();
        let event = client
            .hooks()
            .event(&hold.slot.key, hold.slot.mode, &hold.slot.owner);
        observer.acquired(event, started.elapsed());
        guard.mark_observed();
    }
    Ok(guard)
}

/// Tells the observer a wait started, and — when dropped, however the wait ends — that
/// it ended.
struct WaitReport<'a> {
    client: &'a LockClient,
    req: &'a LockRequest,
    owner: &'a Owner,
    started: Instant,
}

impl<'a> WaitReport<'a> {
    fn start(client: &'a LockClient, req: &'a LockRequest, owner: &'a Owner) -> Option<Self> {
        let observer = client.hooks().observer()?;
        let report = WaitReport {
            client,
            req,
            owner,
            started: Instant::now(),
        };
        observer.wait_started(report.event());
        Some(report)
    }

    fn event(&self) -> LockEvent<'a> {
        self.client
            .hooks()
            .event(&self.req.key, self.req.mode, self.owner)
    }
}

impl Drop for WaitReport<'_> {
    fn drop(&mut self) {
        if let Some(observer) = self.client.hooks().observer() {
            observer.wait_ended(self.event(), self.started.elapsed());
        }
    }
}

/// A new hold between [`Registry::enter`] and its activation.
struct Pending<'a> {
    registry: &'a Registry,
    hold: Option<Arc<Hold>>,
}

impl Pending<'_> {
    fn store(&self) -> &LockRequest {
        match &self.hold {
            Some(hold) => &hold.store,
            None => unreachable!("a pending hold is only taken by `activate`"),
        }
    }

    fn activate(
        mut self,
        token: Option<crate::FencingToken>,
        expires_at: Option<Instant>,
        watch: Option<Duration>,
        runtime: &Handle,
    ) -> Option<Arc<Hold>> {
        let hold = self.hold.take()?;
        self.registry
            .activate(&hold, token, expires_at, watch, runtime)
            .then_some(hold)
    }
}

impl Pending<'_> {
    /// The hold goes on under a new store identity: its attempts so far are given up
    /// (the caller takes them back).
    fn reidentify(&mut self, client: &LockClient) {
        if let Some(old) = self.hold.take() {
            let mut store = old.store.clone();
            store.hold_id = client.new_hold_id();
            self.hold = Some(self.registry.reidentify(&old, store));
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if let Some(hold) = self.hold.take() {
            self.registry.abandon(&hold);
        }
    }
}

/// A store acquisition that succeeded.
struct Attempted {
    grant: Grant,
    /// When the granting request was sent.
    sent_at: Instant,
    /// When its answer came.
    answered_at: Instant,
}

/// Acquires the pending hold in the store: its owner is the hold's own identity, so
/// whatever an attempt cancelled or failed in flight may have taken can always be taken
/// back without touching anything else.
///
/// An attempt that got no answer (a timeout, a lost connection) may still land, later,
/// over a connection that was replaced meanwhile. Its identity is then given up for
/// good — the backend's [`abandon`](crate::backend::LockBackend::abandon) takes back
/// whatever it gets, now or when it lands, and the store refuses it once its deadline
/// has passed — and the acquisition goes on under a new identity. A release racing the
/// next attempt of the same identity is never needed.
async fn run(
    client: &LockClient,
    pending: &mut Pending<'_>,
    owner: &Owner,
    known: Known,
) -> Result<Attempted> {
    let Known { deadline, busy } = known;
    let expired = |now: Instant| deadline.is_some_and(|d| now >= d);
    let backend = client.backend();
    let queued_mode = backend.profile().queues_waiters(pending.store().mode);
    // Begun in an outage that has lasted the grace already: no riding it out.
    let grace = client.outage_grace();
    let in_outage = client
        .registry()
        .inner
        .health
        .outage_now()
        .is_some_and(|since| since.elapsed() >= grace);

    // No barging within a process: when others here already wait for this key, a new
    // acquirer lines up behind them (they are woken first to last) instead of snatching
    // the lock in the instant after each release.
    let mut line_up =
        !queued_mode && !expired(Instant::now()) && backend.has_local_waiters(pending.store());
    // A busy answer the fast path just got is the first attempt's: not asked again.
    let mut ttl = busy.flatten();
    let mut answered = busy.is_some();
    let mut failing = Failing::default();
    if !line_up && !answered {
        match first_attempt(client, pending).await {
            Ok(AttemptAnswer::Acquired(acquired)) => return Ok(acquired),
            Ok(AttemptAnswer::Busy(holder_ttl)) => {
                ttl = holder_ttl;
                answered = true;
            }
            // An outage with time left to wait: the wait rides it out, backing off,
            // under a new identity (the failed attempt's is being taken back). A call
            // without a deadline gave no time to spend on outages: it learns at once.
            Err(error)
                if error.is_unavailable()
                    && deadline.is_some_and(|d| Instant::now() < d)
                    && !in_outage =>
            {
                tracing::debug!(%error, "lock store failed with time left to wait; retrying");
                pending.reidentify(client);
                failing.failed(error);
            }
            Err(error) => return Err(error),
        }
    }
    // The waiting state lives in its own allocation, made only when there is something
    // to wait for: the uncontended path's future stays small (it is built, boxed and
    // moved on every acquisition).
    loop {
        let waited = Box::pin(wait(
            client,
            pending.store(),
            owner,
            deadline,
            line_up,
            (ttl, answered),
            &mut failing,
        ))
        .await;
        match waited {
            Waited::Acquired(acquired) => return Ok(acquired),
            Waited::Failed(error) => return Err(error),
            Waited::Unanswered => {
                // Taken back by `wait`; go on as a new hold.
                pending.reidentify(client);
                line_up = false;
                ttl = None;
                answered = false;
            }
        }
    }
}

/// The attempt before any waiting. Its failures are the caller's to know at once (or
/// the wait's to ride out, when the caller has time left: see [`run`]), but for a
/// connection that had to be replaced: one that died while idle (the store restarted)
/// fails the first command sent over it, and the backend then reconnects. So an attempt
/// whose connection broke under it is tried once more, at once, as a new hold: a
/// restart costs not even a single try (`try_lock`) an error.
async fn first_attempt(client: &LockClient, pending: &mut Pending<'_>) -> Result<AttemptAnswer> {
    let mut retried = false;
    loop {
        match attempt(client, pending.store()).await {
            Ok(outcome) => return Ok(outcome),
            Err(error) => {
                compensate_later(client, pending.store(), &error);
                if retried || !error.again_at_once() {
                    return Err(error);
                }
                tracing::debug!(%error, "lock store connection lost or clock resampled; trying once more");
                retried = true;
                pending.reidentify(client);
            }
        }
    }
}

/// A run of transient store failures while waiting: when it began, the next backoff,
/// and the last failure (what a wait that runs out during the outage fails with).
struct Failing {
    since: Option<Instant>,
    backoff: Duration,
    last: Option<Error>,
}

impl Default for Failing {
    fn default() -> Self {
        Failing {
            since: None,
            backoff: MIN_ERROR_BACKOFF,
            last: None,
        }
    }
}

impl Failing {
    /// Notes a failure; the run of failures began with the first.
    fn failed(&mut self, error: Error) {
        self.since.get_or_insert_with(Instant::now);
        self.last = Some(error);
    }

    /// What a wait that ran out fails with: the outage, when the store's last word was
    /// a failure, else the lock being held (`ttl`: the holder's lease left).
    fn out_of_time(&mut self, ttl: Option<Duration>) -> Error {
        self.last.take().unwrap_or(Error::Busy { holder_ttl: ttl })
    }
}

/// How a wait under one hold identity ended.
enum Waited {
    Acquired(Attempted),
    Failed(Error),
    /// An attempt got no answer, so the identity was given up (and its attempts taken
    /// back); the wait goes on under a new one.
    Unanswered,
}

/// The contended path of [`run`]: line up or subscribe, then attempt and sleep until
/// acquired, out of time, failed, or an attempt went unanswered. `ttl` is the last busy
/// answer's, `in_queue` whether an attempt of this identity was answered at all (and so
/// may have queued it).
async fn wait(
    client: &LockClient,
    req: &LockRequest,
    owner: &Owner,
    deadline: Option<Instant>,
    line_up: bool,
    (ttl, in_queue): (Option<Duration>, bool),
    failing: &mut Failing,
) -> Waited {
    let expired = |now: Instant| deadline.is_some_and(|d| now >= d);
    let queued_mode = client.backend().profile().queues_waiters(req.mode);
    // From the first busy answer on, a queueing backend keeps this owner in line; every
    // way out below (giving up at once, a failed subscribe, cancellation) leaves it.
    let mut in_line = InLine {
        queued: queued_mode && in_queue,
        client,
        req,
    };
    if expired(Instant::now()) {
        in_line.give_up().await;
        return Waited::Failed(failing.out_of_time(ttl));
    }
    let _reported = WaitReport::start(client, req, owner);
    let sub = match subscribe_until(client, req, deadline).await {
        Ok(Some(mut sub)) => {
            if let Some(deadline) = deadline {
                sub.gives_up_at(deadline);
            }
            sub
        }
        Ok(None) => {
            in_line.give_up().await;
            return Waited::Failed(failing.out_of_time(ttl));
        }
        Err(error) => return Waited::Failed(error),
    };
    let mut waiting = Waiting {
        sub,
        woken: false,
        settled: false,
        pass_turn_on_leave: !queued_mode,
        in_line,
    };
    if line_up {
        waiting.woken = wait_for_turn(&mut waiting, deadline).await;
    }
    loop {
        let attempted = attempt_while_waiting(client, req, deadline, &mut waiting, failing).await;
        let ttl = match attempted {
            std::ops::ControlFlow::Break(waited) => return waited,
            std::ops::ControlFlow::Continue(ttl) => ttl,
        };
        waiting.in_line.queued = queued_mode;
        let now = Instant::now();
        if expired(now) {
            waiting.in_line.give_up().await;
            return Waited::Failed(Error::Busy { holder_ttl: ttl });
        }
        sleep_until_retry(&mut waiting, ttl, now, deadline).await;
    }
}

/// One attempt of a subscribed waiter: `Continue` with the holder's remaining lease when
/// busy, `Break` with how the wait ends otherwise (acquired, failed, or unanswered and
/// backed off from).
async fn attempt_while_waiting(
    client: &LockClient,
    req: &LockRequest,
    deadline: Option<Instant>,
    waiting: &mut Waiting<'_>,
    failing: &mut Failing,
) -> std::ops::ControlFlow<Waited, Option<Duration>> {
    use std::ops::ControlFlow;
    let outcome = match attempt(client, req).await {
        Ok(outcome) => {
            *failing = Failing::default();
            outcome
        }
        Err(error) if error.is_retryable() => {
            return ControlFlow::Break(
                back_off(client, req, deadline, waiting, failing, error).await,
            );
        }
        Err(error) => {
            if compensate_later(client, req, &error) {
                waiting.in_line.queued = false;
            }
            return ControlFlow::Break(Waited::Failed(error));
        }
    };
    // The wake-up, if any, has been used by this attempt.
    waiting.woken = false;
    match outcome {
        AttemptAnswer::Acquired(acquired) => {
            waiting.in_line.queued = false;
            waiting.settled = true;
            ControlFlow::Break(Waited::Acquired(acquired))
        }
        AttemptAnswer::Busy(ttl) => ControlFlow::Continue(ttl),
    }
}

/// Subscribes to releases of `req`'s key. Subscribing may wait for the store to
/// confirm, never past the caller's deadline: `Ok(None)` when that passed first.
async fn subscribe_until(
    client: &LockClient,
    req: &LockRequest,
    deadline: Option<Instant>,
) -> Result<Option<Box<dyn Subscription>>> {
    let backend = client.backend();
    match deadline {
        Some(at) => match tokio::time::timeout_at(at, backend.subscribe(req)).await {
            Ok(subscribed) => subscribed.map(Some),
            Err(_) => Ok(None),
        },
        None => backend.subscribe(req).await.map(Some),
    }
}

/// A new acquirer lined up behind local waiters waits for its turn; a release, or a
/// waiter ahead giving up, wakes it. Should neither come (a holder's lease lapsed
/// silently), it tries anyway after a while. Whether it was woken.
async fn wait_for_turn(waiting: &mut Waiting<'_>, deadline: Option<Instant>) -> bool {
    let now = Instant::now();
    let until = deadline.map_or(now + LINE_UP_MAX, |d| d.min(now + LINE_UP_MAX));
    // A release heard before now (its pub/sub message may trail the releaser's own
    // unlock reply) woke the waiters already here; this one waits for the next.
    waiting.sub.skip_signalled();
    waiting.sub.wait(until).await == Wake::Notified
}

/// An attempt got no answer (`error`, retryable): it may still land. Whatever it does,
/// its identity takes it back (now, and once the attempt can only be refused); then
/// the waiter backs off before the wait goes on under a new identity — unless it is
/// out of time, or of patience.
async fn back_off(
    client: &LockClient,
    req: &LockRequest,
    deadline: Option<Instant>,
    waiting: &mut Waiting<'_>,
    failing: &mut Failing,
    error: Error,
) -> Waited {
    if compensate_later(client, req, &error) {
        waiting.in_line.queued = false;
    }
    let now = Instant::now();
    let since = *failing.since.get_or_insert(now);
    // Without a deadline, give up once the store has failed for a whole lease: by then
    // no lock it held for anyone is still valid either.
    let out_of_patience = deadline.is_none() && now - since >= client.watchdog_lease();
    if deadline.is_some_and(|d| now >= d) || out_of_patience {
        return Waited::Failed(error);
    }
    let backoff = failing.backoff;
    // Debug, not warn: every caller in an outage retries so, and the outage reaches
    // the caller (and the layer's rate-limited report) if it outlasts the wait.
    tracing::debug!(%error, retry_in_ms = backoff.as_millis() as u64, "lock store failed while waiting; retrying");
    let until = deadline.map_or(now + backoff, |d| d.min(now + backoff));
    failing.backoff = (backoff * 2).min(MAX_ERROR_BACKOFF);
    failing.failed(error);
    // A reconnect notification cuts the backoff short. Whatever woke it, this waiter
    // tries again itself as soon as the wait goes on: it hands no turn on as it leaves
    // this identity, or each failure in an outage would wake another waiter out of its
    // backoff, and the waiters would take turns failing as fast as the store refuses.
    waiting.sub.wait(until).await;
    waiting.woken = false;
    waiting.settled = true;
    Waited::Unanswered
}

/// After a busy answer at `now`: sleeps until a release wakes this waiter or the
/// holder's lease (`ttl`) would end, bounded by the deadline.
async fn sleep_until_retry(
    waiting: &mut Waiting<'_>,
    ttl: Option<Duration>,
    now: Instant,
    deadline: Option<Instant>,
) {
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

/// What one acquisition attempt got from the store: the lock, or the holder's
/// remaining lease.
enum AttemptAnswer {
    Acquired(Attempted),
    Busy(Option<Duration>),
}

/// One acquire call. A call cancelled in flight may still have taken the lock in the
/// store, or queued its owner there: a release (and, for a queueing mode, leaving the
/// queue) is then spawned for it. The owner is the hold's own, so that touches nothing
/// else, whenever it lands. A call that fails is left to the caller, which gives its
/// identity up ([`compensate_later`]).
async fn attempt(client: &LockClient, req: &LockRequest) -> Result<AttemptAnswer> {
    struct InFlight<'a> {
        client: &'a LockClient,
        req: &'a LockRequest,
        armed: bool,
    }
    impl Drop for InFlight<'_> {
        fn drop(&mut self) {
            if self.armed {
                abandon_later(self.client, self.req, false);
            }
        }
    }

    let sent_at = Instant::now();
    let mut in_flight = InFlight {
        client,
        req,
        armed: true,
    };
    let backend = client.backend();
    let now = backend.local().and_then(|local| local.acquire_now(req));
    let outcome = match now {
        Some(outcome) => outcome,
        None => backend.acquire(req).await,
    };
    let answered_at = Instant::now();
    client.registry().inner.health.note(&outcome);
    // Answered (even with an error): the caller decides what to compensate, and when,
    // since it may try again as the same owner.
    in_flight.armed = false;
    Ok(match outcome? {
        Acquire::Acquired(grant) => AttemptAnswer::Acquired(Attempted {
            grant,
            sent_at,
            answered_at,
        }),
        Acquire::Busy { ttl } => AttemptAnswer::Busy(ttl),
    })
}

/// Takes back, in a spawned task, whatever an unanswered attempt of `req` may have done:
/// a hold, and a place in the store's wait queue. Should the store not answer, that is
/// tried again, with the other cleanups of the key, until it does or whatever the
/// attempt took has ended with its lease (a shutdown waits for the first try only).
/// After an attempt the store gave no answer to (`unanswered`: a timeout, a broken
/// connection) it waits with them from the start: one probe per key and backoff step
/// is enough to find out when the store answers again. After a refusal the store
/// answered (a grant too few replicas acknowledged), it is tried at once.
fn abandon_later(client: &LockClient, req: &LockRequest, unanswered: bool) {
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        let job = cleanup::Job {
            what: cleanup::What::Abandon,
            req: req.clone(),
            until: Instant::now() + req.lease,
        };
        let inner = &client.registry().inner;
        if unanswered {
            cleanup::again(inner, &runtime, job);
        } else {
            cleanup::now_and_again(inner, &runtime, job);
        }
    }
}

/// After an attempt failed with `error`, the store may or may not have applied it: its
/// identity is never used again, and whatever it took is taken back in a task — unless
/// the attempt never reached the store ([`Error::is_not_applied`]), which then has nothing
/// of it: in an outage that would be one more command per attempt to retry, all landing
/// on the store the moment it is back. Returns whether a task takes it back (and so
/// also takes the identity out of a wait queue an earlier attempt put it in).
fn compensate_later(client: &LockClient, req: &LockRequest, error: &Error) -> bool {
    if error.is_not_applied() {
        return false;
    }
    abandon_later(client, req, error.is_unanswered());
    true
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
            runtime.spawn(self.client.registry().track(async move {
                let _ = backend.cancel_wait(&req).await;
            }));
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

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::task::{Context, Poll, Waker};

    use crate::{ConfigError, Error, LockClient, MemoryBackend};

    /// Polled outside a tokio runtime (which would run its releases and renewals), an
    /// acquisition says so instead of panicking.
    #[test]
    fn outside_a_runtime_is_an_error_not_a_panic() {
        let client = LockClient::new(MemoryBackend::new());
        let lock = client.get_lock("no-runtime").unwrap();
        let mut acquire = std::pin::pin!(lock.try_lock());
        let mut cx = Context::from_waker(Waker::noop());
        match acquire.as_mut().poll(&mut cx) {
            Poll::Ready(Err(Error::Config(ConfigError::InvalidSetting {
                name: "runtime",
                ..
            }))) => {}
            other => panic!("expected a `runtime` configuration error, got {other:?}"),
        }
    }
}
