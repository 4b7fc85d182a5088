//! The client's registry of holds: which holds it has in the store, which guards stand
//! for each, and the rule that makes every guard touch only its own hold.
//!
//! # One hold, one identity
//!
//! A *hold* is one acquisition in the store and everything that re-enters it. Every hold
//! is taken in the store under an identity of its own, a [`HoldId`] `<client uuid>:<n>`,
//! which no other hold ever uses — not a later hold of the same logical [`Owner`], not a hold of
//! another kind on the same name. The logical owner (a request, an explicit owner) only
//! decides, here in the client, which guards share a hold:
//!
//! - a guard's release, renewal and compensation name the hold's own identity, so they
//!   can only ever affect that hold, however late they arrive (a release spawned from
//!   `Drop`, an attempt stalled on a socket that was replaced meanwhile);
//! - re-entry is counted here: locking a key the owner already holds (in the same mode)
//!   adds a guard to the live hold without asking the store, and only the last guard's
//!   release goes to the store;
//! - a hold that ended — released, lost, expired by the client's own clock — is never
//!   re-entered or brought back: the next acquisition by the same owner is a new hold
//!   with a new identity, and the old guards stay lost;
//! - acquisitions of one slot (key, owner, mode) by concurrent tasks are serialized: the
//!   second waits for the first to finish, then re-enters what it got.
//!
//! Redisson clients see an ordinary field per hold, with a hold count of one.
//!
//! # Renewed while a runtime of it lives
//!
//! A hold's watched guards (taken without an explicit lease) are counted by the runtime
//! each was taken on. The hold is renewed while any of those runtimes is alive, by the
//! first live one's watchdog task (see [`watchdog`](super::watchdog)); a runtime leaves
//! the count with its last watched guard of the hold. Entering and leaving update the
//! count in place: the first runtime is kept inline, so only a hold re-entered from a
//! second runtime allocates.
//!
//! # Lost stays lost
//!
//! A hold is believed until its [`Expiry`] — the end of its last confirmed lease, counted
//! from *before* the request that confirmed it was sent — or until a renewal, a release
//! or a re-entry finds it gone. Whoever first sees either sets the hold's lost flag,
//! which is never cleared: a renewal answered after the expiry passed does not bring the
//! hold back.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::runtime::{Handle, Id};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::Hooks;
use super::cleanup::Cleanups;
use super::health::Health;
use super::watchdog::Tasks;
use crate::backend::{FencingToken, LockBackend, LockMode, LockRequest, StoreLoss};
use crate::hold_id::HoldId;
use crate::key::LockKey;
use crate::log_limit::PerCause;
use crate::owner::Owner;

/// A hold's "lost" alarm: set once, never cleared, awaitable. Like a cancellation
/// token, without an allocation of its own (it lives in the hold's).
#[derive(Default)]
pub(crate) struct LostFlag {
    set: std::sync::atomic::AtomicBool,
    notify: Notify,
}

impl LostFlag {
    /// The hold is lost, for good; wakes every [`wait`](Self::wait).
    pub(crate) fn set(&self) {
        if !self.set.swap(true, Ordering::AcqRel) {
            self.notify.notify_waiters();
        }
    }

    pub(crate) fn is_set(&self) -> bool {
        self.set.load(Ordering::Acquire)
    }

    /// Ready once [`set`](Self::set) was called.
    pub(crate) async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            tokio::pin!(notified);
            // Registered before the check: a `set` after it wakes this one.
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

/// When a hold's last confirmed lease ends. Moves only later once the hold is granted
/// ([`Expiry::set`] only starts it).
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

    /// Sets the end, earlier or later: the first one, when the hold is granted.
    pub(crate) fn set(&self, at: Option<Instant>) {
        self.at.store(self.encode(at), Ordering::Release);
    }

    pub(crate) fn passed(&self, now: Instant) -> bool {
        self.get().is_some_and(|at| now >= at)
    }
}

/// The holds one logical owner can re-enter: a key, in a mode, fenced or not.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Slot {
    pub(crate) key: LockKey,
    pub(crate) owner: Owner,
    pub(crate) mode: LockMode,
    pub(crate) fenced: bool,
}

/// One hold in the store, shared by its guards.
pub(crate) struct Hold {
    pub(crate) slot: Slot,
    /// The hold as the store knows it: its key, its own identity (used by no other
    /// hold), its mode, and the lease it was taken with.
    pub(crate) store: LockRequest,
    /// Fired when the hold is found gone or its expiry is seen passed; never un-fired.
    pub(crate) lost: LostFlag,
    pub(crate) expiry: Expiry,
    /// Wakes acquirers of the same slot waiting for this hold's acquisition to finish.
    acquired: Notify,
    /// Whether the observer has been told this hold was lost (it is told once).
    loss_reported: std::sync::atomic::AtomicBool,
    /// `tower_lock.hold`, from the grant until the hold's last reference is gone (its
    /// release done).
    pub(crate) span: std::sync::OnceLock<tracing::Span>,
    /// Cancelled when the hold is dropped: ends the task that waits for the store's
    /// [`StoreLoss`], if any.
    over: CancellationToken,
    /// The store's signal that it dropped this hold by itself, if it has one: read by
    /// [`Hold::is_lost_at`] and the lost signal directly, so a hold is lost with it even
    /// when the task that marks it (on the runtime that took it) no longer runs.
    pub(crate) store_loss: std::sync::OnceLock<StoreLoss>,
    state: Mutex<HoldState>,
}

impl Drop for Hold {
    fn drop(&mut self) {
        self.over.cancel();
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// Being acquired in the store; acquirers of the same slot wait for it.
    Acquiring,
    /// Held (as far as the client knows): guards may join it.
    Held,
    /// Its last guard left, its acquisition failed, or it was lost.
    Ended,
}

struct HoldState {
    phase: Phase,
    token: Option<FencingToken>,
    /// Guards standing for this hold.
    guards: u32,
    /// Of which taken without an explicit lease, counted by the runtime each was taken
    /// on: the hold is renewed while any is alive, by the first live one's watchdog task.
    watched: Runtimes,
    /// The lease its renewals ask for: the shortest of its watched guards' (a layer's
    /// request lease, or the client's watchdog lease).
    watch_lease: Option<Duration>,
    /// When the store granted it (wall clock, for inspection).
    since: Option<std::time::SystemTime>,
}

impl HoldState {
    /// One more watched guard, taken on `runtime` with the lease `lease`.
    fn watch(&mut self, runtime: Id, lease: Duration) {
        self.watched.add(runtime);
        self.watch_lease = Some(self.watch_lease.map_or(lease, |l| l.min(lease)));
    }
}

/// The runtimes a hold's watched guards were taken on, each with how many of them, in
/// the order they first entered. The first runtime is kept inline and only a second one
/// allocates, so the usual hold, entered from one runtime, costs no allocation here.
#[derive(Default)]
struct Runtimes {
    first: Option<(Id, u32)>,
    others: Vec<(Id, u32)>,
}

impl Runtimes {
    /// One more watched guard, taken on `runtime`.
    fn add(&mut self, runtime: Id) {
        let known = self
            .first
            .iter_mut()
            .chain(self.others.iter_mut())
            .find(|(id, _)| *id == runtime);
        if let Some((_, guards)) = known {
            *guards += 1;
        } else if self.first.is_none() {
            self.first = Some((runtime, 1));
        } else {
            self.others.push((runtime, 1));
        }
    }

    /// One watched guard taken on `runtime` is gone; a runtime with none left is
    /// forgotten, and the next one in order takes its place.
    fn remove(&mut self, runtime: Id) {
        if let Some((id, guards)) = self.first.as_mut()
            && *id == runtime
        {
            *guards = guards.saturating_sub(1);
            if *guards == 0 {
                self.first = (!self.others.is_empty()).then(|| self.others.remove(0));
            }
        } else if let Some(at) = self.others.iter().position(|(id, _)| *id == runtime) {
            let guards = &mut self.others[at].1;
            *guards = guards.saturating_sub(1);
            if *guards == 0 {
                self.others.remove(at);
            }
        }
    }

    fn is_empty(&self) -> bool {
        self.first.is_none()
    }

    /// The runtimes, in the order they first entered.
    fn iter(&self) -> impl Iterator<Item = Id> + '_ {
        self.first.iter().chain(&self.others).map(|(id, _)| *id)
    }
}

impl Hold {
    /// A hold of `slot` being acquired in the store as `store`.
    fn acquiring(slot: Slot, store: LockRequest) -> Self {
        Hold {
            slot,
            store,
            lost: LostFlag::default(),
            expiry: Expiry::new(None),
            acquired: Notify::new(),
            loss_reported: std::sync::atomic::AtomicBool::new(false),
            span: std::sync::OnceLock::new(),
            over: CancellationToken::new(),
            store_loss: std::sync::OnceLock::new(),
            state: Mutex::new(HoldState {
                phase: Phase::Acquiring,
                token: None,
                guards: 0,
                watched: Runtimes::default(),
                watch_lease: None,
                since: None,
            }),
        }
    }

    fn state(&self) -> MutexGuard<'_, HoldState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the hold is lost at `now`; seeing it lost makes it so for good.
    pub(crate) fn is_lost_at(&self, now: Instant) -> bool {
        if self.lost.is_set() {
            return true;
        }
        if self.store_loss.get().is_some_and(StoreLoss::is_fired) {
            self.lost.set();
            return true;
        }
        if self.expiry.passed(now) {
            self.lost.set();
            return true;
        }
        false
    }

    /// Whether the caller is the first to report this hold's loss to the observer.
    pub(crate) fn claim_loss_report(&self) -> bool {
        !self.loss_reported.swap(true, Ordering::AcqRel)
    }

    /// The hold's fencing token, once held.
    pub(crate) fn token(&self) -> Option<FencingToken> {
        self.state().token
    }

    /// Waits until the hold is no longer being acquired, or `deadline` passes; returns
    /// whether it finished in time.
    pub(crate) async fn acquisition_finished(&self, deadline: Option<Instant>) -> bool {
        let notified = self.acquired.notified();
        tokio::pin!(notified);
        // Registered before the phase is read: a finish in between still wakes us.
        notified.as_mut().enable();
        if self.state().phase != Phase::Acquiring {
            return true;
        }
        match deadline {
            Some(at) => tokio::time::timeout_at(at, notified).await.is_ok(),
            None => {
                notified.await;
                true
            }
        }
    }
}

/// Where an acquisition of a slot stands.
pub(crate) enum Entered {
    /// The owner holds the slot: the caller is one more guard of `hold` (the
    /// `count`-th).
    Reentered { hold: Arc<Hold>, count: u32 },
    /// Another task of the same owner is acquiring the slot: wait for it, then enter
    /// again.
    Wait(Arc<Hold>),
    /// Nobody holds the slot: acquire `hold` in the store, then
    /// [`activate`](Registry::activate) or [`abandon`](Registry::abandon) it.
    Acquire(Arc<Hold>),
}

/// What a leaving guard learns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Left {
    /// Other guards still stand for the hold: nothing to do in the store.
    Others,
    /// It was the last guard: release the hold in the store.
    Last,
}

#[derive(Clone)]
pub(crate) struct Registry {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    pub(crate) backend: Arc<dyn LockBackend>,
    /// The watchdog lease: watched holds are renewed to it every third of it.
    pub(crate) lease: Duration,
    pub(crate) hooks: Hooks,
    state: Mutex<State>,
    /// Set, under the state lock, when the client shuts down: no hold is activated
    /// after it.
    closed: AtomicBool,
    /// Cancelled when the client shuts down: waiting acquisitions give up.
    closing: CancellationToken,
    /// The store work the client spawns and nobody awaits (releases of dropped guards,
    /// compensations, leaving a queue): shutting down waits for it.
    tracker: TaskTracker,
    /// Cleanups waiting for the store to answer again.
    pub(crate) cleanups: Cleanups,
    /// What the client logs of failures, once per cause and interval.
    pub(crate) log: PerCause,
    /// Whether the store answers, as the client's calls found it.
    pub(crate) health: Health,
}

/// What a watchdog task renews at a tick: the holds due, with their renewals, and how
/// long until the next tick (a third of the shortest lease it watches).
pub(crate) struct Due {
    pub(crate) holds: Vec<(Arc<Hold>, LockRequest)>,
    pub(crate) period: Duration,
}

pub(crate) struct State {
    /// Hashed with foldhash, not SipHash: three lookups per lock and unlock, and a slot
    /// names the owner too, a string of the client's own (a random client id and a
    /// counter) unless the application passes owners of its own.
    pub(crate) slots: HashMap<Slot, Arc<Hold>, foldhash::fast::RandomState>,
    pub(crate) tasks: Tasks,
}

impl Inner {
    /// `future`, counted until it ends among the work a shutdown waits for.
    pub(crate) fn track<F: std::future::Future>(
        &self,
        future: F,
    ) -> tokio_util::task::task_tracker::TrackedFuture<F> {
        self.tracker.track_future(future)
    }
}

impl Registry {
    pub(crate) fn new(backend: Arc<dyn LockBackend>, lease: Duration, hooks: Hooks) -> Self {
        Registry {
            inner: Arc::new(Inner {
                backend,
                lease,
                hooks,
                state: Mutex::new(State {
                    slots: HashMap::default(),
                    tasks: Tasks::default(),
                }),
                closed: AtomicBool::new(false),
                closing: CancellationToken::new(),
                tracker: TaskTracker::new(),
                cleanups: Cleanups::default(),
                log: PerCause::default(),
                health: Health::new(),
            }),
        }
    }

    /// Finds where an acquisition of `slot` stands, as one more guard (`watch`: one
    /// renewed by the watchdog on `runtime`, with this lease). When nobody holds the
    /// slot, a new hold is made with the store request `store()` returns; that request's
    /// hold identity must be used by no other hold.
    pub(crate) fn enter(
        &self,
        slot: &Slot,
        watch: Option<Duration>,
        runtime: &Handle,
        store: impl FnOnce(&State) -> LockRequest,
    ) -> Entered {
        let mut state = self.inner.state();
        let now = Instant::now();
        if let Some(hold) = state.slots.get(slot).cloned() {
            let mut hs = hold.state();
            match hs.phase {
                Phase::Acquiring => {
                    drop(hs);
                    return Entered::Wait(hold);
                }
                Phase::Held if !hold.is_lost_at(now) => {
                    hs.guards += 1;
                    let count = hs.guards;
                    if let Some(lease) = watch {
                        hs.watch(runtime.id(), lease);
                        state.tasks.ensure(&self.inner, runtime, lease);
                    }
                    drop(hs);
                    return Entered::Reentered { hold, count };
                }
                _ => {
                    // Lost (or ended without leaving the map): never re-entered. Its
                    // guards stay lost; the next hold is a new one.
                    hold.lost.set();
                    hs.phase = Phase::Ended;
                    drop(hs);
                    state.slots.remove(slot);
                }
            }
        }
        let hold = Arc::new(Hold::acquiring(slot.clone(), store(&state)));
        state.slots.insert(slot.clone(), Arc::clone(&hold));
        Entered::Acquire(hold)
    }

    /// `hold`, still being acquired, goes on under another store identity, `store`
    /// (its hold identity used by no other hold): the returned hold takes its place in the
    /// slot, and acquirers of the slot waiting for the old one wait for the new one.
    /// The old identity's attempts are the caller's to take back.
    pub(crate) fn reidentify(&self, hold: &Arc<Hold>, store: LockRequest) -> Arc<Hold> {
        let fresh = Arc::new(Hold::acquiring(hold.slot.clone(), store));
        let mut state = self.inner.state();
        hold.state().phase = Phase::Ended;
        if state
            .slots
            .get(&hold.slot)
            .is_some_and(|current| Arc::ptr_eq(current, hold))
        {
            state.slots.insert(hold.slot.clone(), Arc::clone(&fresh));
        }
        drop(state);
        hold.acquired.notify_waiters();
        fresh
    }

    /// The store granted `hold`: it now has its first guard, valid until `expires_at`
    /// (renewed on `runtime`, with the lease `watch`, if watched).
    pub(crate) fn activate(
        &self,
        hold: &Arc<Hold>,
        token: Option<FencingToken>,
        expires_at: Option<Instant>,
        watch: Option<Duration>,
        runtime: &Handle,
    ) -> bool {
        let mut state = self.inner.state();
        if self.is_closed() {
            // Shut down while this acquisition was in flight: the store's grant is
            // taken back, and waited for by the shutdown, as any compensation is.
            hold.state().phase = Phase::Ended;
            remove_if_current(&mut state, hold);
            drop(state);
            let backend = Arc::clone(&self.inner.backend);
            let req = hold.store.clone();
            runtime.spawn(self.track(async move {
                let _ = backend.abandon(&req).await;
            }));
            hold.acquired.notify_waiters();
            return false;
        }
        let mut hs = hold.state();
        hold.expiry.set(expires_at);
        hs.phase = Phase::Held;
        hs.token = token;
        hs.guards = 1;
        hs.since = Some(std::time::SystemTime::now());
        if let Some(lease) = watch {
            hs.watch(runtime.id(), lease);
            state.tasks.ensure(&self.inner, runtime, lease);
        }
        drop(hs);
        drop(state);
        hold.acquired.notify_waiters();
        if let Some(loss) = self.inner.backend.loss_signal(&hold.store) {
            let _ = hold.store_loss.set(loss.clone());
            self.lose_with(hold, loss, runtime);
        }
        true
    }

    /// Marks `hold` lost the moment the store's `loss` fires (a session that expired
    /// took it along), unless it ended before. The task holds neither the hold nor the
    /// client: it ends with the hold.
    fn lose_with(&self, hold: &Arc<Hold>, loss: StoreLoss, runtime: &Handle) {
        let weak_hold = Arc::downgrade(hold);
        let weak_inner = Arc::downgrade(&self.inner);
        let over = hold.over.clone();
        runtime.spawn(async move {
            tokio::select! {
                () = loss.fired() => {}
                () = over.cancelled() => return,
            }
            let (Some(hold), Some(inner)) = (weak_hold.upgrade(), weak_inner.upgrade()) else {
                return;
            };
            if hold.state().phase != Phase::Held {
                return;
            }
            let shown = inner.hooks.key(&hold.slot.key);
            tracing::error!(key = %shown, hold_id = %hold.store.hold_id, owner = %hold.slot.owner, "lock lost: the store dropped it (its session ended)");
            inner.mark_lost(&hold);
            if let Some(observer) = inner.hooks.observer()
                && hold.claim_loss_report()
            {
                let event = inner.hooks.event(&hold.slot.key, hold.slot.mode, &hold.slot.owner);
                // The observer is user code; a panic there ends only this task.
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    observer.lost(event);
                }));
            }
        });
    }

    /// The acquisition of `hold` failed or was given up: the slot is free for the next.
    pub(crate) fn abandon(&self, hold: &Arc<Hold>) {
        let mut state = self.inner.state();
        let mut hs = hold.state();
        if hs.phase == Phase::Acquiring {
            hs.phase = Phase::Ended;
            drop(hs);
            remove_if_current(&mut state, hold);
        }
        drop(state);
        hold.acquired.notify_waiters();
    }

    /// One guard of `hold` is gone (`watched`: it was renewed by the watchdog, and
    /// taken on `runtime`).
    pub(crate) fn leave(&self, hold: &Arc<Hold>, watched: bool, runtime: &Handle) -> Left {
        let mut state = self.inner.state();
        let mut hs = hold.state();
        hs.guards = hs.guards.saturating_sub(1);
        if watched {
            hs.watched.remove(runtime.id());
        }
        if hs.guards > 0 {
            return Left::Others;
        }
        hs.phase = Phase::Ended;
        drop(hs);
        remove_if_current(&mut state, hold);
        Left::Last
    }

    /// The store says `hold` is gone (a renewal or re-entry found it not held): it is
    /// lost, and the slot is free for a new hold.
    pub(crate) fn mark_lost(&self, hold: &Arc<Hold>) {
        self.inner.mark_lost(hold);
    }

    /// This client's live hold of `key` whose store identity is `hold_id`: when it was
    /// granted and how many guards stand for it.
    pub(crate) fn describe(
        &self,
        key: &LockKey,
        hold_id: &HoldId,
    ) -> Option<(std::time::SystemTime, u32)> {
        let state = self.inner.state();
        let now = Instant::now();
        state.slots.values().find_map(|hold| {
            if hold.slot.key != *key || hold.store.hold_id != *hold_id || hold.is_lost_at(now) {
                return None;
            }
            let hs = hold.state();
            (hs.phase == Phase::Held).then_some((hs.since?, hs.guards))
        })
    }

    /// How many guards the logical `owner` has on its live hold of `key` in `mode`
    /// (fenced or not); `None` when it has none here.
    pub(crate) fn guards_of(&self, key: &LockKey, owner: &Owner, mode: LockMode) -> Option<u32> {
        let state = self.inner.state();
        let now = Instant::now();
        [false, true].into_iter().find_map(|fenced| {
            let slot = Slot {
                key: key.clone(),
                owner: owner.clone(),
                mode,
                fenced,
            };
            let hold = state.slots.get(&slot)?;
            if hold.is_lost_at(now) {
                return None;
            }
            let hs = hold.state();
            (hs.phase == Phase::Held && hs.guards > 0).then_some(hs.guards)
        })
    }

    /// Whether the client has shut down ([`close`](Self::close)).
    pub(crate) fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::Acquire)
    }

    /// Cancelled when the client shuts down.
    pub(crate) fn closing(&self) -> &CancellationToken {
        &self.inner.closing
    }

    /// `future`, counted until it ends among the work a shutdown waits for.
    pub(crate) fn track<F: std::future::Future>(
        &self,
        future: F,
    ) -> tokio_util::task::task_tracker::TrackedFuture<F> {
        self.inner.track(future)
    }

    /// Shuts the registry down: no hold is activated from now on, waiting acquisitions
    /// are cancelled, the watchdog tasks stop, and every held hold ends, lost to its
    /// guards (their lost signal fires). Returns those holds, for the caller to release
    /// in the store.
    pub(crate) fn close(&self) -> Vec<Arc<Hold>> {
        let mut state = self.inner.state();
        self.inner.closed.store(true, Ordering::Release);
        self.inner.closing.cancel();
        state.tasks.stop_all();
        let mut held = Vec::new();
        state.slots.retain(|_, hold| {
            let mut hs = hold.state();
            if hs.phase != Phase::Held {
                return true;
            }
            hs.phase = Phase::Ended;
            drop(hs);
            hold.lost.set();
            held.push(Arc::clone(hold));
            false
        });
        held
    }

    /// Waits until no acquisition of this client is in flight, then until the work it
    /// spawned (compensations, releases of dropped guards) is done. For a closed
    /// registry: no acquisition starts any more.
    pub(crate) async fn settle(&self) {
        loop {
            let acquiring: Vec<Arc<Hold>> = self
                .inner
                .state()
                .slots
                .values()
                .filter(|hold| hold.state().phase == Phase::Acquiring)
                .cloned()
                .collect();
            if acquiring.is_empty() {
                break;
            }
            for hold in acquiring {
                hold.acquisition_finished(None).await;
            }
        }
        self.inner.tracker.close();
        self.inner.tracker.wait().await;
    }

    /// How many holds the watchdog is renewing.
    pub(crate) fn watched(&self) -> usize {
        self.inner
            .state()
            .slots
            .values()
            .filter(|h| {
                let hs = h.state();
                hs.phase == Phase::Held && !hs.watched.is_empty()
            })
            .count()
    }
}

impl State {
    /// The store identity of `owner`'s live write hold of `key`, if it has one: a read
    /// of the same owner goes past it (downgrade).
    pub(crate) fn write_hold_id(&self, key: &LockKey, owner: &Owner) -> Option<HoldId> {
        let now = Instant::now();
        [false, true].into_iter().find_map(|fenced| {
            let slot = Slot {
                key: key.clone(),
                owner: owner.clone(),
                mode: LockMode::Write,
                fenced,
            };
            let hold = self.slots.get(&slot)?;
            let live = hold.state().phase == Phase::Held && !hold.is_lost_at(now);
            live.then(|| hold.store.hold_id.clone())
        })
    }
}

impl Inner {
    pub(crate) fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The watched holds the task of `runtime` renews that are due (a third of their
    /// lease has passed since their last renewal), with their renewal requests: the
    /// hold's watch lease, or what the hold has left if that is longer (an outer guard
    /// with a longer explicit lease). A hold is renewed by the first of its runtimes (in the
    /// order they entered it) whose task is alive, so by exactly one task, and by
    /// another as soon as that runtime is gone. A task with nothing to renew stays while
    /// its runtime has watched guards (it may have to take over); with none, it is
    /// retired (under the same lock, so a hold registered meanwhile starts a new one)
    /// and `None` is returned.
    pub(crate) fn due_or_retire(&self, runtime: Id) -> Option<Due> {
        let mut state = self.state();
        let State { slots, tasks } = &mut *state;
        let now = Instant::now();
        let mut watches = false;
        let mut shortest = self.lease;
        let holds: Vec<_> = slots
            .values()
            .filter_map(|hold| {
                let hs = hold.state();
                if hs.phase != Phase::Held {
                    return None;
                }
                watches |= hs.watched.iter().any(|id| id == runtime);
                let renewer = hs
                    .watched
                    .iter()
                    .find(|&id| id == runtime || tasks.is_alive(id));
                if renewer != Some(runtime) {
                    return None;
                }
                let lease = hs.watch_lease.unwrap_or(self.lease);
                shortest = shortest.min(lease);
                // Due once a third of its lease has passed since its last renewal: a
                // hold with a longer lease than the task's shortest is not renewed at
                // every tick.
                let due = hold
                    .expiry
                    .get()
                    .is_none_or(|at| at.saturating_duration_since(now) <= lease - lease / 3);
                due.then(|| (Arc::clone(hold), self.renewal(hold, lease, now)))
            })
            .collect();
        if !watches {
            tasks.retire(runtime);
            return None;
        }
        Some(Due {
            holds,
            period: shortest / 3,
        })
    }

    /// The request that renews `hold`, watched with `lease`, at `now`.
    fn renewal(&self, hold: &Hold, lease: Duration, now: Instant) -> LockRequest {
        let mut renewal = hold.store.clone();
        renewal.lease = lease;
        if let Some(at) = hold.expiry.get() {
            let left = at.saturating_duration_since(now);
            if left > renewal.lease {
                // In whole milliseconds, as the stores count, rounded up: the guards keep
                // believing in `at`, so the store must not end first.
                let ms = left.as_nanos().div_ceil(1_000_000);
                renewal.lease = Duration::from_millis(u64::try_from(ms).unwrap_or(u64::MAX));
            }
        }
        renewal
    }

    /// See [`Registry::mark_lost`].
    pub(crate) fn mark_lost(&self, hold: &Arc<Hold>) {
        hold.lost.set();
        let mut state = self.state();
        let mut hs = hold.state();
        if hs.phase == Phase::Held {
            hs.phase = Phase::Ended;
            drop(hs);
            remove_if_current(&mut state, hold);
        }
    }

    /// Whether `hold` is still held and watched (a renewal answer about it matters).
    pub(crate) fn still_watched(&self, hold: &Hold) -> bool {
        let hs = hold.state();
        hs.phase == Phase::Held && !hs.watched.is_empty()
    }
}

fn remove_if_current(state: &mut State, hold: &Arc<Hold>) {
    if state
        .slots
        .get(&hold.slot)
        .is_some_and(|current| Arc::ptr_eq(current, hold))
    {
        state.slots.remove(&hold.slot);
    }
}

#[cfg(test)]
mod tests {
    use super::Runtimes;

    /// Runtimes keep the order they first entered in; one leaves with its last watched
    /// guard, and the next takes its place.
    #[test]
    fn runtimes_keep_their_order_and_leave_with_their_last_guard() {
        let runtimes: Vec<_> = (0..3)
            .map(|_| {
                tokio::runtime::Builder::new_current_thread()
                    .build()
                    .unwrap()
            })
            .collect();
        let [a, b, c] = [0, 1, 2].map(|i| runtimes[i].handle().id());
        let mut watched = Runtimes::default();
        for id in [a, b, a, c] {
            watched.add(id);
        }
        assert_eq!(watched.iter().collect::<Vec<_>>(), [a, b, c]);
        watched.remove(a);
        assert_eq!(watched.iter().collect::<Vec<_>>(), [a, b, c]);
        watched.remove(a);
        assert_eq!(watched.iter().collect::<Vec<_>>(), [b, c]);
        watched.remove(c);
        assert_eq!(watched.iter().collect::<Vec<_>>(), [b]);
        watched.remove(b);
        assert!(watched.is_empty());
        watched.remove(b);
        assert!(watched.is_empty());
        watched.add(c);
        assert_eq!(watched.iter().collect::<Vec<_>>(), [c]);
    }
}
