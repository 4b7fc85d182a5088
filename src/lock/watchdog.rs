//! The watchdog: one task per client that renews every lock held without an explicit
//! lease, all in one batch per period.
//!
//! Redisson schedules one timer per lock; at ten thousand held locks that is ten
//! thousand timers and round trips every ten seconds. Here every watched hold of a
//! [`LockClient`](crate::LockClient) sits in one registry, and one task renews the whole
//! registry with a single [`LockBackend::renew_many`] call every `lease / 3`, which a
//! backend turns into one pipeline or script per connection. The task exists only while
//! something is watched.
//!
//! A hold whose renewal says "not held" is lost at once. A hold whose renewals keep
//! failing (store unreachable) is lost once its last confirmed lease has run out. Either
//! way its [`LostSignal`](crate::LostSignal) fires and it leaves the registry.

use std::collections::HashMap;
use std::collections::hash_map::Entry as MapEntry;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{Hooks, LockEvent};
use crate::backend::{LockBackend, LockMode, LockRequest};
use crate::key::LockKey;
use crate::owner::Owner;

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
    entries: HashMap<WatchKey, Entry>,
    running: bool,
    next_generation: u64,
}

#[derive(Clone, PartialEq, Eq, Hash)]
struct WatchKey {
    key: LockKey,
    owner: Owner,
    mode: LockMode,
}

impl WatchKey {
    fn of(req: &LockRequest) -> Self {
        WatchKey {
            key: req.key.clone(),
            owner: req.owner.clone(),
            mode: req.mode,
        }
    }
}

/// What a guard keeps of its watchdog registration.
pub(crate) struct Registration {
    pub(crate) generation: u64,
    pub(crate) lost: CancellationToken,
}

struct Entry {
    /// Guards sharing this hold (reentrant acquisitions by one owner).
    refs: usize,
    /// Tells a renewal result for an earlier registration of the same hold apart.
    generation: u64,
    req: LockRequest,
    /// When the last confirmed lease runs out.
    expires_at: Instant,
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

    /// Starts watching a hold acquired with `req` (whose lease is the watchdog lease)
    /// and valid until `expires_at`. Guards of the same owner on the same key share one
    /// registration and one lost token. Must be called inside a tokio runtime.
    pub(crate) fn register(&self, req: &LockRequest, expires_at: Instant) -> Registration {
        let mut state = self.state();
        let state = &mut *state;
        // One hash per call: lock keys come from requests, so the map keeps std's keyed
        // SipHash (hash-flooding resistance) and this path hashes as little as it can.
        let registration = match state.entries.entry(WatchKey::of(req)) {
            MapEntry::Occupied(mut occupied) => {
                let entry = occupied.get_mut();
                entry.refs += 1;
                entry.expires_at = entry.expires_at.max(expires_at);
                Registration {
                    generation: entry.generation,
                    lost: entry.lost.clone(),
                }
            }
            MapEntry::Vacant(vacant) => {
                let generation = state.next_generation;
                state.next_generation += 1;
                let lost = CancellationToken::new();
                vacant.insert(Entry {
                    refs: 1,
                    generation,
                    req: req.clone(),
                    expires_at,
                    lost: lost.clone(),
                });
                Registration { generation, lost }
            }
        };
        if !state.running {
            state.running = true;
            tokio::spawn(run(Arc::clone(&self.inner)));
        }
        registration
    }

    /// One guard of the hold is gone; the hold stops being renewed with the last. A
    /// registration that was already dropped as lost is ignored, even if the same owner
    /// has registered the key again since.
    pub(crate) fn unregister(&self, req: &LockRequest, generation: u64) {
        let mut state = self.state();
        if let MapEntry::Occupied(mut occupied) = state.entries.entry(WatchKey::of(req)) {
            let entry = occupied.get_mut();
            if entry.generation != generation {
                return;
            }
            entry.refs -= 1;
            if entry.refs == 0 {
                occupied.remove();
            }
        }
    }

    /// How many holds are being renewed.
    pub(crate) fn len(&self) -> usize {
        self.state().entries.len()
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
    loop {
        tokio::time::sleep(period).await;
        let (keys, reqs): (Vec<(WatchKey, u64)>, Vec<LockRequest>) = {
            let mut state = inner.state();
            if state.entries.is_empty() {
                state.running = false;
                return;
            }
            state
                .entries
                .iter()
                .map(|(k, e)| ((k.clone(), e.generation), e.req.clone()))
                .unzip()
        };
        let sent_at = Instant::now();
        // A renewal slower than a period counts as failed; the next tick tries again.
        let results = tokio::time::timeout(period, inner.backend.renew_many(&reqs))
            .await
            .unwrap_or_default();
        let now = Instant::now();
        let mut state = inner.state();
        // Observer calls wait until the registry is unlocked: (index, lost?) per event.
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
                    entry.expires_at = sent_at + inner.lease;
                    false
                }
                Some(Ok(false)) => {
                    tracing::error!(key = %shown, owner = %key.owner, "lock lost: renewal found it no longer held");
                    true
                }
                Some(Err(_)) | None => {
                    failures += 1;
                    events.push((i, false));
                    if now >= entry.expires_at {
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
                if lost {
                    observer.lost(event);
                } else {
                    observer.renewal_failed(event, results.get(i).and_then(|r| r.as_ref().err()));
                }
            }
        }
        if failures > 0 {
            let first_error = results.iter().find_map(|r| r.as_ref().err());
            tracing::warn!(
                failures,
                error = first_error.map(tracing::field::display),
                "lock renewal failed; retrying next period"
            );
        } else {
            tracing::trace!(renewed = reqs.len(), "watchdog renewed locks");
        }
    }
}
