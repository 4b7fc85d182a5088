//! The watchdog: renews every watched hold of a client, one batch per period.
//!
//! Redisson schedules one timer per lock; at ten thousand held locks that is ten
//! thousand timers and round trips every ten seconds. Here one task renews all the holds
//! a [`LockClient`](crate::LockClient) took without an explicit lease with a single
//! [`LockBackend::renew_many`](crate::backend::LockBackend::renew_many) call every
//! `lease / 3`, which a backend turns into one pipeline or script per connection.
//!
//! There is one such task per tokio runtime that holds watched locks, running on that
//! runtime: a client shared by several runtimes (one per worker thread, one per test)
//! keeps renewing the holds of every runtime that is alive, whichever runtime came
//! first and whichever ended. A task exists only while its runtime has watched guards,
//! and is started again if it died (its runtime shut down, a panic).
//!
//! # Which task renews a hold
//!
//! A hold is renewed as long as any runtime that took or re-entered it, and still has a
//! watched guard of it, is alive. The hold counts its watched guards by the runtime each
//! was taken on, in the order the runtimes first entered; of those, the first whose task
//! is alive renews it, so exactly one task does. A runtime that re-entered a hold and
//! shut down takes nothing with it, whether its guard left first or not; when the
//! runtime that renewed a hold shuts down, the next one's task renews it at its next
//! tick (within a third of the lease), with no new acquisition. That is why a task stays
//! while its runtime has watched guards even when it renews none of them itself.
//!
//! A renewal extends a hold's [expiry](super::registry::Expiry) to the renewal's send
//! time plus its lease, less the backend's [clock
//! drift](crate::backend::StoreProfile::clock_drift). A renewal that says "not held"
//! marks the hold lost at once; renewals that fail mark it lost when its expiry passes,
//! and so does a renewal answered only after that. A hold lost so may still be in the
//! store (its renewals may have landed, their answers lost), so it is released there,
//! in a task, while its guards are told it is lost.
//! A loss is logged with the hold's identity as the store shows it (`hold_id`, the hash
//! field or row owner an operator finds there) and, beside it, the logical owner the
//! guards were taken as.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::runtime::{Handle, Id};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::cleanup;
use super::registry::{Hold, Inner};
use crate::backend::LockRequest;
use crate::error::Result;
use crate::log_limit::warn_limited;

/// The shortest pause before retrying a failed renewal.
const MIN_RETRY: Duration = Duration::from_millis(5);

/// The renewal tasks of one client, one per runtime with watched holds.
#[derive(Default)]
pub(crate) struct Tasks {
    running: HashMap<Id, Task, foldhash::fast::RandomState>,
}

/// A runtime's renewal task, and how often it ticks.
struct Task {
    handle: JoinHandle<()>,
    pace: Arc<Pace>,
}

/// How often a task ticks: a third of the shortest lease it watches. A hold with a
/// shorter lease than that makes it tick sooner.
struct Pace {
    period_ms: AtomicU64,
    sooner: Notify,
}

impl Pace {
    fn period(&self) -> Duration {
        Duration::from_millis(self.period_ms.load(Ordering::Relaxed))
    }

    fn set(&self, period: Duration) {
        let ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX).max(1);
        self.period_ms.store(ms, Ordering::Relaxed);
    }
}

impl Tasks {
    /// Makes sure a renewal task runs on `runtime`, ticking often enough for a hold
    /// watched with `lease`.
    pub(crate) fn ensure(&mut self, inner: &Arc<Inner>, runtime: &Handle, lease: Duration) {
        let id = runtime.id();
        let period = lease / 3;
        if let Some(task) = self.running.get(&id)
            && !task.handle.is_finished()
        {
            if period < task.pace.period() {
                task.pace.set(period);
                task.pace.sooner.notify_one();
            }
            return;
        }
        // Tasks of runtimes that shut down (or of a panic) are finished: forget them.
        self.running.retain(|_, task| !task.handle.is_finished());
        let pace = Arc::new(Pace {
            period_ms: AtomicU64::new(0),
            sooner: Notify::new(),
        });
        pace.set(period.min(inner.lease / 3));
        let handle = runtime.spawn(run(Arc::clone(inner), id, Arc::clone(&pace)));
        self.running.insert(id, Task { handle, pace });
    }

    /// Whether the task of `runtime` is running: a runtime that shut down (or whose
    /// task panicked) renews nothing, and the holds it renewed pass to another.
    pub(crate) fn is_alive(&self, runtime: Id) -> bool {
        self.running
            .get(&runtime)
            .is_some_and(|task| !task.handle.is_finished())
    }

    /// Stops every task: the client shut down.
    pub(crate) fn stop_all(&mut self) {
        for (_, task) in self.running.drain() {
            task.handle.abort();
        }
    }

    /// The task of `runtime` ends: nothing of its runtime is watched any more.
    pub(crate) fn retire(&mut self, runtime: Id) {
        self.running.remove(&runtime);
    }
}

/// The renewal task of `runtime`: renews its due holds every period (a third of the
/// shortest lease it watches; sooner after a failure), until it has none left to watch.
async fn run(inner: Arc<Inner>, runtime: Id, pace: Arc<Pace>) {
    // Ticks are scheduled from when the last renewal was sent, so time spent after it
    // (a slow or panicking observer, a busy runtime) shortens the pause instead of
    // pushing renewals past the lease.
    let mut last = Instant::now();
    let mut next = last + pace.period();
    loop {
        tokio::select! {
            () = tokio::time::sleep_until(next) => {}
            // A hold with a shorter lease came: tick at its pace from the last tick on.
            () = pace.sooner.notified() => {
                next = next.min(last + pace.period());
                continue;
            }
        }
        let Some(due) = inner.due_or_retire(runtime) else {
            return;
        };
        let period = due.period;
        pace.set(period);
        let retry = (period / 4).max(MIN_RETRY);
        last = Instant::now();
        if due.holds.is_empty() {
            // Nothing due: every hold this runtime watches was renewed less than a third
            // of its lease ago, or is renewed by an earlier live runtime; look again in a
            // period, in case that runtime is gone by then.
            next = last + period;
            continue;
        }
        let (holds, reqs): (Vec<_>, Vec<_>) = due.holds.into_iter().unzip();
        let sent_at = last;
        // A renewal slower than a period counts as failed.
        let results = tokio::time::timeout(period, inner.backend.renew_many(&reqs))
            .await
            .unwrap_or_default();
        match results.iter().find(|r| r.is_ok()) {
            Some(answered) => inner.health.note(answered),
            None => results.iter().for_each(|r| inner.health.note(r)),
        }
        let (events, failures) = apply(&inner, &holds, &reqs, &results, sent_at);
        report(&inner, &holds, &results, events);
        if failures > 0 {
            let first_error = results.iter().find_map(|r| r.as_ref().err());
            warn_limited!(
                inner.log,
                "lock renewal failed; retrying",
                failures,
                error = first_error.map(tracing::field::display),
                retry_in_ms = retry.as_millis() as u64
            );
            next = sent_at + retry;
        } else {
            tracing::trace!(renewed = reqs.len(), "watchdog renewed locks");
            next = sent_at + period;
        }
    }
}

/// Applies the renewals sent at `sent_at` to the holds still watched: extends the
/// renewed, marks lost the ones that are. Returns the observer's events (a hold's
/// index, and whether it was lost rather than failed to renew) and how many renewals
/// failed.
fn apply(
    inner: &Arc<Inner>,
    holds: &[Arc<Hold>],
    reqs: &[LockRequest],
    results: &[Result<bool>],
    sent_at: Instant,
) -> (Vec<(usize, bool)>, usize) {
    let now = Instant::now();
    let mut events: Vec<(usize, bool)> = Vec::new();
    let mut failures = 0usize;
    for (i, hold) in holds.iter().enumerate() {
        if !inner.still_watched(hold) {
            continue;
        }
        let shown = inner.hooks.key(&hold.slot.key);
        let lost = match results.get(i) {
            Some(Ok(true)) => {
                // A renewal answered after the hold was seen lost does not bring it
                // back: its guards may have stopped trusting it already.
                if hold.is_lost_at(now) {
                    tracing::error!(key = %shown, hold_id = %hold.store.hold_id, owner = %hold.slot.owner, "lock lost: renewed only after its lease had run out");
                    true
                } else {
                    let lease = reqs[i].lease;
                    let valid = lease.saturating_sub(inner.backend.profile().clock_drift(lease));
                    hold.expiry.extend_to(sent_at.checked_add(valid));
                    false
                }
            }
            Some(Ok(false)) => {
                tracing::error!(key = %shown, hold_id = %hold.store.hold_id, owner = %hold.slot.owner, "lock lost: renewal found it no longer held");
                true
            }
            Some(Err(_)) | None => {
                failures += 1;
                events.push((i, false));
                let lost = hold.is_lost_at(now);
                if lost {
                    tracing::error!(key = %shown, hold_id = %hold.store.hold_id, owner = %hold.slot.owner, "lock lost: renewals failed until the lease ran out");
                }
                lost
            }
        };
        if lost {
            inner.mark_lost(hold);
            events.push((i, true));
            // Unless the store said it no longer holds it, it may: renewals it applied
            // whose answers were lost, or one that came after the lease ran out here.
            if !matches!(results.get(i), Some(Ok(false))) {
                take_back(inner, &reqs[i]);
            }
        }
    }
    (events, failures)
}

/// Releases in the store, in a task, a hold the watchdog gave up while the store may
/// still keep it: its guards were told it is lost, so it protects nothing any more, and
/// every other owner would wait out what is left of its lease there (up to a whole
/// lease, when renewals reached the store and only their answers were lost). Tried
/// again while the store cannot be reached, for a lease; safe however late a try lands:
/// it names this hold's own identity, which nothing else uses.
fn take_back(inner: &Arc<Inner>, req: &LockRequest) {
    let job = cleanup::Job {
        what: cleanup::What::Release,
        req: req.clone(),
        until: Instant::now() + req.lease,
    };
    cleanup::now_and_again(inner, &Handle::current(), job);
}

/// Tells the observer, if any, of each event [`apply`] returned.
fn report(
    inner: &Inner,
    holds: &[Arc<Hold>],
    results: &[Result<bool>],
    events: Vec<(usize, bool)>,
) {
    let Some(observer) = inner.hooks.observer() else {
        return;
    };
    for (i, lost) in events {
        let hold = &holds[i];
        let event = inner
            .hooks
            .event(&hold.slot.key, hold.slot.mode, &hold.slot.owner);
        // The observer is user code; a panic there must not stop renewals.
        let reported = catch_unwind(AssertUnwindSafe(|| {
            if lost {
                if hold.claim_loss_report() {
                    observer.lost(event);
                }
            } else {
                observer.renewal_failed(event, results.get(i).and_then(|r| r.as_ref().err()));
            }
        }));
        if reported.is_err() {
            tracing::error!("a LockObserver panicked; the watchdog carries on");
        }
    }
}
