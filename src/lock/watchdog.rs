//! The client's registry of the holds it has, and the watchdog that renews the watched
//! ones: one task per client, one batch per period.
//!
//! Redisson schedules one timer per lock; at ten thousand held locks that is ten
//! thousand timers and round trips every ten seconds. Here every hold of a
//! [`LockClient`](crate::LockClient) sits in one registry, and one task renews all those
//! taken without an explicit lease with a single [`LockBackend::renew_many`] call every
//! `lease / 3`, which a backend turns into one pipeline or script per connection. The
//! task exists only while something is watched, and is started again if it died (its
//! runtime shut down, a panic).
//!
//! Every hold carries an [`Expiry`]: the end of its last confirmed lease, shared with its
//! guards, so a guard knows it is lost the moment the lease ends — whether or not the
//! watchdog has run since. A renewal that says "not held" ends the hold at once.
//!
//! Knowing how many guards it has per hold also lets the client repair holds the store
//! counts but no guard stands for (an acquisition applied whose reply was lost): see
//! [`Watchdog::unregister`].

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Hooks, LockEvent};
use crate::backend::{LockBackend, LockMode, LockRequest};
use crate::key::LockKey;
use crate::owner::Owner;

/// The shortest pause before retrying a failed renewal.
const MIN_RETRY: Duration = Duration::from_millis(5);

/// When a hold's last confirmed lease ends. Shared by the registry (which extends it on
/// every successful renewal) and the hold's guards (which compare against it).
pub(crate) struct Expiry {
    base: Instant,
    /// Nanoseconds after `base`; `u64::MAX`: never.
    at: AtomicU64,
}

impl Expiry {
    fn new(at: Option<Instant>) -> Self {
        let expiry = Expiry {
            base: Instant::now(),
            at: AtomicU64::new(u64::MAX),
        };
        expiry.set(at);
        expiry
    }

    fn encode(&self, at: Option<Instant>) -> u64 {
        at.map_or(u64::MAX, |at| {
            u64::try_from(at.saturating_duration_since(self.base).as_nanos()).unwrap_or(u64::MAX)
        })
    }

    /// The end of the lease, `None` for never.
    pub(crate) fn get(&self) -> Option<Instant> {
        match self.at.load(Ordering::Acquire) {
            u64::MAX => None,
            nanos => self.base.checked_add(Duration::from_nanos(nanos)),
        }
    }

    /// Moves the end later (never earlier).
    pub(crate) fn extend_to(&self, at: Option<Instant>) {
        self.at.fetch_max(self.encode(at), Ordering::AcqRel);
    }

    /// Sets the end, earlier or later (a lease pinned to an exact length).
    pub(crate) fn set(&self, at: Option<Instant>) {
        self.at.store(self.encode(at), Ordering::Release);
    }

    pub(crate) fn passed(&self, now: Instant) -> bool {
        self.get().is_some_and(|at| now >= at)
    }
}

#[derive(Clone)]
pub(crate) struct Watchdog {
    inner: Arc<Inner>,
}

struct Inner {
    backend: Arc<dyn LockBackend>,
    lease: Duration,
    state: Mutex<State>,
    hooks: Hooks,
}

#[derive(Default)]
struct State {
    entries: HashMap<HoldKey, Entry>,
    /// The renewal task, while one runs.
    task: Option<JoinHandle<()>>,
    next_generation: u64,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct HoldKey {
    key: LockKey,
    owner: Owner,
    mode: LockMode,
}

impl HoldKey {
    fn of(req: &LockRequest) -> Self {
        HoldKey {
            key: req.key.clone(),
            owner: req.owner.clone(),
            mode: req.mode,
        }
    }
}

/// What a guard keeps of its registration.
pub(crate) struct Registration {
    pub(crate) generation: u64,
    pub(crate) lost: CancellationToken,
    pub(crate) expiry: Arc<Expiry>,
}

struct Entry {
    /// Guards of this hold (reentrant acquisitions by one owner).
    refs: usize,
    /// Of which taken without an explicit lease: renewed while any is alive.
    watched: usize,
    /// Tells registrations of the same hold apart over time.
    generation: u64,
    /// The renewal request (with the watchdog lease).
    renewal: LockRequest,
    expiry: Arc<Expiry>,
    lost: CancellationToken,
}

impl Watchdog {
    pub(crate) fn new(backend: Arc<dyn LockBackend>, lease: Duration, hooks: Hooks) -> Self {
        Watchdog {
            inner: Arc::new(Inner {
                backend,
                lease,
                state: Mutex::new(State::default()),
                hooks,
            }),
        }
    }

    /// Records a guard of the hold acquired with `req`, valid until `expires_at`; the
    /// watchdog renews it if `watched`. Guards of one owner on one key share the
    /// registration: its lost token and its expiry. Must be called inside a tokio
    /// runtime.
    pub(crate) fn register(
        &self,
        req: &LockRequest,
        expires_at: Option<Instant>,
        watched: bool,
    ) -> Registration {
        let mut state = self.state();
        let state = &mut *state;
        // One hash per call: lock keys come from requests, so the map keeps std's keyed
        // SipHash (hash-flooding resistance) and this path hashes as little as it can.
        let registration = match state.entries.entry(HoldKey::of(req)) {
            MapEntry::Occupied(mut occupied) => {
                let entry = occupied.get_mut();
                entry.refs += 1;
                entry.watched += usize::from(watched);
                entry.expiry.extend_to(expires_at);
                Registration {
                    generation: entry.generation,
                    lost: entry.lost.clone(),
                    expiry: Arc::clone(&entry.expiry),
                }
            }
            MapEntry::Vacant(vacant) => {
                let generation = state.next_generation;
                state.next_generation += 1;
                let lost = CancellationToken::new();
                let expiry = Arc::new(Expiry::new(expires_at));
                let mut renewal = req.clone();
                renewal.lease = self.inner.lease;
                vacant.insert(Entry {
                    refs: 1,
                    watched: usize::from(watched),
                    generation,
                    renewal,
                    expiry: Arc::clone(&expiry),
                    lost: lost.clone(),
                });
                Registration {
                    generation,
                    lost,
                    expiry,
                }
            }
        };
        if watched && state.task.as_ref().is_none_or(JoinHandle::is_finished) {
            // Not running, or died with its runtime or by a panic: (re)start it here.
            state.task = Some(tokio::spawn(run(Arc::clone(&self.inner))));
        }
        registration
    }

    /// One guard of the hold is gone; renewal stops with the last watched one. Returns
    /// how many guards of the hold this client still has — `Some(0)` means none, so the
    /// store should not count any hold of this owner any more — or `None` when the
    /// registration had already ended as lost.
    pub(crate) fn unregister(
        &self,
        req: &LockRequest,
        generation: u64,
        watched: bool,
    ) -> Option<usize> {
        let mut state = self.state();
        let MapEntry::Occupied(mut occupied) = state.entries.entry(HoldKey::of(req)) else {
            return None;
        };
        let entry = occupied.get_mut();
        if entry.generation != generation {
            return None;
        }
        entry.refs -= 1;
        entry.watched -= usize::from(watched);
        let left = entry.refs;
        if left == 0 {
            occupied.remove();
        }
        Some(left)
    }

    /// How many holds are being renewed.
    pub(crate) fn len(&self) -> usize {
        self.state()
            .entries
            .values()
            .filter(|e| e.watched > 0)
            .count()
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.inner.state()
    }
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

async fn run(inner: Arc<Inner>) {
    let period = inner.lease / 3;
    let retry = (period / 4).max(MIN_RETRY);
    // Ticks are scheduled from when the last renewal was sent, so time spent after it
    // (a slow or panicking observer, a busy runtime) shortens the pause instead of
    // pushing renewals past the lease.
    let mut next = Instant::now() + period;
    loop {
        tokio::time::sleep_until(next).await;
        let (keys, reqs): (Vec<(HoldKey, u64)>, Vec<LockRequest>) = {
            let mut state = inner.state();
            let now = Instant::now();
            let watched: (Vec<_>, Vec<_>) = state
                .entries
                .iter()
                .filter(|(_, e)| e.watched > 0)
                .map(|(k, e)| {
                    // Never renew a hold to less than the lease it already has (an outer
                    // guard of the same owner with a longer explicit lease).
                    let mut renewal = e.renewal.clone();
                    if let Some(at) = e.expiry.get() {
                        let left = at.saturating_duration_since(now);
                        if left > renewal.lease {
                            renewal.lease = Duration::from_millis(
                                u64::try_from(left.as_millis()).unwrap_or(u64::MAX),
                            );
                        }
                    }
                    ((k.clone(), e.generation), renewal)
                })
                .unzip();
            if watched.0.is_empty() {
                state.task = None;
                return;
            }
            watched
        };
        let sent_at = Instant::now();
        // A renewal slower than a period counts as failed.
        let results = tokio::time::timeout(period, inner.backend.renew_many(&reqs))
            .await
            .unwrap_or_default();
        let now = Instant::now();
        let mut state = inner.state();
        let mut events: Vec<(usize, bool)> = Vec::new();
        let mut failures = 0usize;
        for (i, (key, generation)) in keys.iter().enumerate() {
            let Some(entry) = state.entries.get_mut(key) else {
                continue;
            };
            if entry.generation != *generation {
                continue;
            }
            let shown = inner.hooks.key(&key.key);
            let lost = match results.get(i) {
                Some(Ok(true)) => {
                    entry.expiry.extend_to(Some(sent_at + reqs[i].lease));
                    false
                }
                Some(Ok(false)) => {
                    tracing::error!(key = %shown, owner = %key.owner, "lock lost: renewal found it no longer held");
                    true
                }
                Some(Err(_)) | None => {
                    failures += 1;
                    events.push((i, false));
                    if entry.expiry.passed(now) {
                        tracing::error!(key = %shown, owner = %key.owner, "lock lost: renewals failed until the lease ran out");
                        true
                    } else {
                        false
                    }
                }
            };
            if lost {
                entry.lost.cancel();
                state.entries.remove(key);
                events.push((i, true));
            }
        }
        drop(state);
        if let Some(observer) = inner.hooks.observer() {
            for (i, lost) in events {
                let key = &keys[i].0;
                let event = LockEvent {
                    key: &key.key,
                    mode: key.mode,
                    owner: &key.owner,
                };
                // The observer is user code; a panic there must not stop renewals.
                let reported = catch_unwind(AssertUnwindSafe(|| {
                    if lost {
                        observer.lost(event);
                    } else {
                        observer
                            .renewal_failed(event, results.get(i).and_then(|r| r.as_ref().err()));
                    }
                }));
                if reported.is_err() {
                    tracing::error!("a LockObserver panicked; the watchdog carries on");
                }
            }
        }
        if failures > 0 {
            let first_error = results.iter().find_map(|r| r.as_ref().err());
            tracing::warn!(
                failures,
                error = first_error.map(tracing::field::display),
                retry_in_ms = retry.as_millis() as u64,
                "lock renewal failed; retrying"
            );
            next = sent_at + retry;
        } else {
            tracing::trace!(renewed = reqs.len(), "watchdog renewed locks");
            next = sent_at + period;
        }
    }
}
