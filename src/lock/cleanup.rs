//! Cleanups the store could not answer: releases, and the taking back of attempts and
//! of holds given up, tried again until the store answers or what they undo has ended
//! with its lease.
//!
//! An outage makes many of them at once — one per release, per unanswered attempt, per
//! hold the watchdog gave up — and each used to retry on its own: thousands of retries
//! during the outage, and all of them landing on the store, with a log line each, the
//! moment it was back. Here the cleanups of one key wait together: one of them probes
//! the store per backoff step, and once it is answered the others go at once. What the
//! log says of them is one line per cause and interval ([`warn_limited`]).

use std::collections::HashMap;
use std::collections::hash_map::Entry;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::runtime::Handle;
use tokio::time::Instant;

use super::acquire::{MAX_ERROR_BACKOFF, MIN_ERROR_BACKOFF};
use super::guard::release_fully;
use super::registry::Inner;
use crate::backend::LockRequest;
use crate::error::Result;
use crate::key::LockKey;
use crate::log_limit::{PerCause, warn_limited};

/// What a cleanup undoes.
#[derive(Clone, Copy, Debug)]
pub(crate) enum What {
    /// An attempt given up: [`LockBackend::abandon`](crate::backend::LockBackend::abandon).
    Abandon,
    /// A hold whose release met an outage, or that the watchdog gave up: released, all
    /// of it.
    Release,
}

impl What {
    fn label(self) -> &'static str {
        match self {
            What::Abandon => "abandon",
            What::Release => "release",
        }
    }
}

/// One cleanup: what, of which hold, and until when it is worth trying (by then what
/// it undoes has ended with its lease).
pub(crate) struct Job {
    pub(crate) what: What,
    pub(crate) req: LockRequest,
    pub(crate) until: Instant,
}

impl Job {
    async fn run(&self, inner: &Inner) -> Result<()> {
        let done = match self.what {
            What::Abandon => inner.backend.abandon(&self.req).await,
            What::Release => release_fully(Arc::clone(&inner.backend), self.req.clone())
                .await
                .map(drop),
        };
        inner.health.note(&done);
        done
    }
}

/// The cleanups of a client that wait for the store, by key.
#[derive(Default)]
pub(crate) struct Cleanups {
    waiting: Mutex<HashMap<LockKey, Vec<Job>, foldhash::fast::RandomState>>,
}

impl Cleanups {
    fn waiting(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<LockKey, Vec<Job>, foldhash::fast::RandomState>> {
        self.waiting.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The next job of `key` to probe the store with; `None` when none is left in
    /// time (the key's entry is then gone, and a new job starts a new loop).
    fn next_probe(&self, key: &LockKey, log: &PerCause) -> Option<Job> {
        let now = Instant::now();
        let mut waiting = self.waiting();
        let jobs = waiting.get_mut(key)?;
        let before = jobs.len();
        jobs.retain(|job| job.until > now);
        let expired = before - jobs.len();
        if expired > 0 {
            warn_limited!(
                log,
                "the lock store is still unreachable; cleanups given up, their holds end with their leases",
                namespace = key.namespace(),
                given_up = expired
            );
        }
        let job = jobs.pop();
        if job.is_none() {
            waiting.remove(key);
        }
        job
    }

    /// Takes `key`'s jobs out, leaving its entry (so new ones join this loop).
    fn take(&self, key: &LockKey) -> Vec<Job> {
        self.waiting()
            .get_mut(key)
            .map(std::mem::take)
            .unwrap_or_default()
    }

    fn put_back(&self, key: &LockKey, jobs: impl IntoIterator<Item = Job>) {
        self.waiting().entry(key.clone()).or_default().extend(jobs);
    }
}

/// Runs `job` at once, in a task on `runtime`; if the store cannot answer, it waits
/// with the other cleanups of its key ([`again`]). If it went through while others of
/// its key wait (the store answers again: a refusal it answered, a release), they go
/// now too rather than at their next probe.
pub(crate) fn now_and_again(inner: &Arc<Inner>, runtime: &Handle, job: Job) {
    let task_inner = Arc::clone(inner);
    runtime.spawn(inner.track(async move {
        match job.run(&task_inner).await {
            Ok(()) => {
                let waiting = task_inner.cleanups.take(&job.req.key);
                if !waiting.is_empty() {
                    run_all(&task_inner, waiting).await;
                }
            }
            Err(error) if error.is_unavailable() => {
                if let Ok(runtime) = Handle::try_current() {
                    again(&task_inner, &runtime, job);
                }
            }
            Err(error) => failed(&task_inner, &job, &error),
        }
    }));
}

/// Runs `jobs` at once, together; those the store cannot answer wait again.
async fn run_all(inner: &Arc<Inner>, jobs: Vec<Job>) {
    let results = futures_util::future::join_all(jobs.iter().map(|job| job.run(inner))).await;
    for (job, result) in jobs.into_iter().zip(results) {
        match result {
            Ok(()) => {}
            Err(error) if error.is_unavailable() => {
                if let Ok(runtime) = Handle::try_current() {
                    again(inner, &runtime, job);
                }
            }
            Err(error) => failed(inner, &job, &error),
        }
    }
}

/// `job` met an outage: it waits with the other cleanups of its key, one of which
/// probes the store per backoff step.
pub(crate) fn again(inner: &Arc<Inner>, runtime: &Handle, job: Job) {
    let key = job.req.key.clone();
    {
        let mut waiting = inner.cleanups.waiting();
        match waiting.entry(key.clone()) {
            Entry::Occupied(mut jobs) => {
                jobs.get_mut().push(job);
                return;
            }
            Entry::Vacant(slot) => {
                slot.insert(vec![job]);
            }
        }
    }
    runtime.spawn(drain(Arc::clone(inner), key));
}

/// The loop of `key`'s waiting cleanups: probes the store with one of them per
/// backoff step; once one is answered, runs the others at once, together.
async fn drain(inner: Arc<Inner>, key: LockKey) {
    let cleanups = &inner.cleanups;
    let mut backoff = MIN_ERROR_BACKOFF;
    loop {
        tokio::time::sleep(backoff).await;
        let Some(probe) = cleanups.next_probe(&key, &inner.log) else {
            return;
        };
        match probe.run(&inner).await {
            Ok(()) => {}
            Err(error) if error.is_unavailable() => {
                cleanups.put_back(&key, [probe]);
                backoff = (backoff * 2).min(MAX_ERROR_BACKOFF);
                continue;
            }
            Err(error) => {
                failed(&inner, &probe, &error);
                continue;
            }
        }
        // The store answers again: the others go now.
        let rest = cleanups.take(&key);
        let done = rest.len() + 1;
        run_all(&inner, rest).await;
        if inner
            .log
            .check("cleanups went through once the lock store answered again")
            .is_some()
        {
            tracing::info!(
                namespace = key.namespace(),
                cleanups = done,
                "cleanups went through once the lock store answered again"
            );
        }
        backoff = MIN_ERROR_BACKOFF;
    }
}

/// `job` failed otherwise than by an outage: what it undoes ends with its lease.
fn failed(inner: &Inner, job: &Job, error: &crate::Error) {
    warn_limited!(
        inner.log,
        "a lock cleanup failed; the hold ends with its lease",
        what = job.what.label(),
        namespace = job.req.key.namespace(),
        %error
    );
}
