//! [`LockGuard`]: a held lock, and [`LostSignal`]: the alarm that it is no longer held.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;

use super::registry::{Hold, Left};
use super::unlocking::{FinishOnDrop, Unlocking};
use super::{LockClient, LockEvent};
use bytes::Bytes;

use super::HeldLock;
use crate::backend::{FencingToken, LockMode, LockRequest, Release, Stored};
use crate::error::{Error, Result};
use crate::hold_id::HoldId;
use crate::key::LockKey;
use crate::owner::Owner;

/// Fires when a held lock is lost.
///
/// A lock is lost when the watchdog finds it no longer held (it was removed or taken over
/// after the holder stalled), when renewals fail until its lease has run out, or — for a
/// lock taken with an explicit lease — when that lease ends. After that, the critical
/// section is no longer protected: stop writing, or guard writes with the
/// [fencing token](LockGuard::fencing_token).
///
/// Cheap to clone; every clone observes the same hold.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_lock::{LockClient, MemoryBackend};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_lock::Error> {
/// let client = LockClient::new(MemoryBackend::new());
/// let guard = client
///     .get_lock("job:9")?
///     .try_lock_for(Duration::ZERO, Duration::from_millis(50))
///     .await?;
/// let lost = guard.lost();
/// tokio::select! {
///     _ = lost.wait() => { /* lease ended: stop, the work is no longer protected */ }
///     _ = tokio::time::sleep(Duration::from_secs(5)) => unreachable!(),
/// }
/// assert!(lost.is_lost());
/// assert!(matches!(guard.unlock().await, Err(tower_lock::Error::Lost)));
/// # Ok(())
/// # }
/// ```
#[derive(Clone)]
pub struct LostSignal {
    repr: Repr,
}

#[derive(Clone)]
enum Repr {
    /// One hold: lost when its lost flag is set (a renewal, release or re-entry found it
    /// gone) or its last confirmed lease ends, whichever is seen first; then for good.
    One(Arc<Hold>),
    /// Fires when any of several holds is lost (a MultiLock, a request's locks).
    Any(Arc<[LostSignal]>),
}

impl LostSignal {
    pub(crate) fn new(hold: Arc<Hold>) -> Self {
        LostSignal {
            repr: Repr::One(hold),
        }
    }

    /// A signal that fires as soon as any of `signals` fires. With no signals, it never
    /// fires.
    pub fn any(signals: impl IntoIterator<Item = LostSignal>) -> Self {
        let mut signals = signals.into_iter();
        let Some(first) = signals.next() else {
            return LostSignal {
                repr: Repr::Any(Arc::from([])),
            };
        };
        // One lock (the common case): its own signal, no allocation.
        let Some(second) = signals.next() else {
            return first;
        };
        let all: Vec<LostSignal> = [first, second].into_iter().chain(signals).collect();
        LostSignal {
            repr: Repr::Any(all.into()),
        }
    }

    /// Whether the lock has been lost. Once it has, it stays lost.
    pub fn is_lost(&self) -> bool {
        match &self.repr {
            Repr::One(hold) => hold.is_lost_at(Instant::now()),
            Repr::Any(signals) => signals.iter().any(LostSignal::is_lost),
        }
    }

    /// Completes when the lock is lost; never, if it is released first. Owns what it
    /// needs, so it can be moved into a spawned task or a `select!`.
    pub fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let this = self.clone();
        async move {
            match this.repr {
                // One lock (the common case): waited for in place, no allocation.
                Repr::One(hold) => wait_one(hold).await,
                Repr::Any(signals) => wait_any(signals).await,
            }
        }
    }
}

async fn wait_one(hold: Arc<Hold>) {
    // The lease may be extended while we sleep: re-read it when it seems due.
    while let Some(at) = hold.expiry.get() {
        tokio::select! {
            _ = hold.lost.wait() => return,
            () = store_lost(&hold) => {
                hold.lost.set();
                return;
            }
            _ = tokio::time::sleep_until(at) => {
                if hold.is_lost_at(Instant::now()) {
                    return;
                }
            }
        }
    }
    tokio::select! {
        _ = hold.lost.wait() => {}
        () = store_lost(&hold) => hold.lost.set(),
    }
}

/// Ready when the store dropped `hold` by itself (see [`StoreLoss`]); never for a
/// store that does not.
///
/// [`StoreLoss`]: crate::backend::StoreLoss
async fn store_lost(hold: &Hold) {
    match hold.store_loss.get() {
        Some(loss) => loss.fired().await,
        None => std::future::pending().await,
    }
}

fn wait_any(signals: Arc<[LostSignal]>) -> Pin<Box<dyn Future<Output = ()> + Send>> {
    let mut waits: Vec<Pin<Box<dyn Future<Output = ()> + Send>>> = signals
        .iter()
        .map(|s| -> Pin<Box<dyn Future<Output = ()> + Send>> { Box::pin(s.wait()) })
        .collect();
    Box::pin(std::future::poll_fn(move |cx| {
        if waits.iter_mut().any(|w| w.as_mut().poll(cx).is_ready()) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }))
}

impl fmt::Debug for LostSignal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LostSignal")
            .field("lost", &self.is_lost())
            .finish()
    }
}

/// A held lock. Release it with [`unlock`](LockGuard::unlock) to learn whether it was
/// still held; dropping it releases in a spawned task.
///
/// Guards of one owner that re-entered one hold share it: its token, its lost signal,
/// its lease. Only the last of them releases the hold in the store, and a guard's release
/// only ever affects the hold it stands for — never a later hold of the same owner, never
/// a hold of another kind on the same name.
///
/// # Cancel safety
///
/// Dropping the guard stops its watchdog renewal at once and, if it was the hold's last
/// guard, spawns the release on the runtime the guard was made on; it never blocks.
/// Should that runtime be gone, the lease ends the hold; should the store be
/// unreachable, the release is tried again until it answers or the lease ends.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    inner: Option<Held>,
}

struct Held {
    client: LockClient,
    hold: Arc<Hold>,
    token: Option<FencingToken>,
    /// The hold's guards when this one was made (1 unless re-entered).
    holds: u32,
    /// This guard's lease: the watchdog lease for watched guards, else the explicit one.
    lease: Duration,
    /// Renewed by the watchdog (no explicit lease).
    watched: bool,
    runtime: Handle,
    acquired_at: Instant,
    /// Whether the observer was told of this guard's acquisition: then, and only then,
    /// it is told when the guard ends.
    observed: bool,
}

impl LockGuard {
    pub(crate) fn new(
        client: LockClient,
        hold: Arc<Hold>,
        holds: u32,
        lease: Duration,
        watched: bool,
        runtime: Handle,
    ) -> Self {
        LockGuard {
            inner: Some(Held {
                client,
                token: hold.token(),
                hold,
                holds,
                lease,
                watched,
                runtime,
                acquired_at: Instant::now(),
                observed: false,
            }),
        }
    }

    /// The observer has been told of this guard's acquisition.
    pub(crate) fn mark_observed(&mut self) {
        if let Some(held) = self.inner.as_mut() {
            held.observed = true;
        }
    }

    /// Extends the lease of this guard's hold to at least `lease` from now
    /// (owner-checked); returns whether the hold was still there. MultiLock uses it to
    /// make every lock last at least the lease once all are held.
    ///
    /// The store never shortens a lease, and the hold's belief only moves later too: it
    /// already was within what the store keeps, and the store now keeps at least
    /// `lease` from before this renewal was sent. So the belief never outgrows the
    /// store's lease, and other guards of the hold (a watched re-entry) keep theirs.
    pub(crate) async fn pin_lease(&mut self, lease: Duration) -> Result<bool> {
        let Some(held) = self.inner.as_mut() else {
            return Ok(false);
        };
        let mut req = held.hold.store.clone();
        req.lease = lease;
        let backend = held.client.backend();
        let sent_at = Instant::now();
        let renewed = backend.renew(&req).await?;
        if renewed {
            let valid = lease.saturating_sub(backend.profile().clock_drift(lease));
            held.hold.expiry.extend_to(sent_at.checked_add(valid));
            held.lease = lease;
        } else {
            held.client.registry().mark_lost(&held.hold);
        }
        Ok(renewed)
    }

    /// The hold this guard stands for.
    pub(crate) fn hold(&self) -> &Arc<Hold> {
        &self.held().hold
    }

    fn held(&self) -> &Held {
        // `inner` is only taken by `unlock` (which consumes the guard) and `drop`.
        self.inner
            .as_ref()
            .unwrap_or_else(|| unreachable!("a live guard always holds its lock"))
    }

    /// The lock's key.
    pub fn key(&self) -> &LockKey {
        &self.held().hold.slot.key
    }

    /// The owner holding the lock: the request, scope or explicit owner it was taken
    /// as. Guards of one owner re-enter each other's holds.
    pub fn owner(&self) -> &Owner {
        &self.held().hold.slot.owner
    }

    /// The hold's own identity in the store (the hash field a Redis `HGETALL` shows):
    /// `<client uuid>:<n>`, used by this hold only, and shared by the guards that
    /// re-entered it. For diagnostics, for [`Lock::hold_count_in_store`](crate::Lock::hold_count_in_store),
    /// and for driving a [`LockBackend`](crate::backend::LockBackend) directly.
    pub fn hold_id(&self) -> &HoldId {
        &self.held().hold.store.hold_id
    }

    /// How the lock is held.
    pub fn mode(&self) -> LockMode {
        self.held().hold.slot.mode
    }

    /// The fencing token of a fenced lock ([`Lock::fenced`](crate::Lock::fenced)):
    /// strictly greater than the token of every earlier holder of this key (see
    /// [`FencingToken`] for exactly what is promised). Re-entrant guards share the token
    /// of the hold they re-entered. `None` for a lock that is not fenced.
    pub fn fencing_token(&self) -> Option<FencingToken> {
        self.held().token
    }

    /// How many guards the owner had on this hold when this guard was made (1 unless
    /// re-entered).
    pub fn hold_count(&self) -> u32 {
        self.held().holds
    }

    /// This guard's lease: the watchdog lease for watched locks, else the explicit one.
    pub fn lease(&self) -> Duration {
        self.held().lease
    }

    /// Whether the watchdog renews this lock.
    pub fn is_watched(&self) -> bool {
        self.held().watched
    }

    /// The signal that fires if the lock is lost. See [`LostSignal`].
    pub fn lost(&self) -> LostSignal {
        LostSignal::new(Arc::clone(&self.held().hold))
    }

    /// Whether the lock has been lost. Once it has, it stays lost.
    pub fn is_lost(&self) -> bool {
        self.held().hold.is_lost_at(Instant::now())
    }

    /// Releases this guard and reports whether the lock was still held until now. The
    /// hold is released in the store when this is its last guard.
    ///
    /// # Errors
    ///
    /// - [`Error::Lost`] when the lock had been lost (the store no longer had it for
    ///   this hold, or the lost signal had fired), even if the release then failed too;
    ///   nothing of another hold is touched.
    /// - A backend error when the store could not be reached (renewal has already
    ///   stopped). An [outage](Error::is_unavailable) is not the end of it: the release
    ///   is tried again in the background, with backoff, until the store answers or
    ///   the hold's lease ends, so the lock is free soon after the store is back
    ///   rather than when the lease runs out.
    pub async fn unlock(self) -> Result<()> {
        match self.start_unlock() {
            Unlocking::Done(outcome) => outcome,
            Unlocking::Pending(release) => release.await,
        }
    }

    /// [`unlock`](Self::unlock) as far as it goes without waiting: done when this was
    /// not the hold's last guard or the backend released it on the spot (an in-process
    /// store), else the release still to await. Dropped before it finishes, that
    /// release goes on in a task.
    pub(crate) fn start_unlock(mut self) -> Unlocking {
        let Some(held) = self.inner.take() else {
            return Unlocking::Done(Ok(()));
        };
        let left = held.leave();
        let was_lost = held.hold.is_lost_at(Instant::now());
        if left == Left::Others {
            if was_lost {
                held.report_loss();
                return Unlocking::Done(Err(Error::Lost));
            }
            return Unlocking::Done(Ok(()));
        }
        if let Some(outcome) = release_fully_now(held.client.backend().as_ref(), &held.hold.store) {
            return Unlocking::Done(held.finish(outcome, was_lost));
        }
        // Cancel-safe: dropped before the store answers, the release goes on in a task.
        let runtime = held.runtime.clone();
        let registry = held.client.registry().clone();
        Unlocking::Pending(FinishOnDrop::new(
            Some(runtime),
            registry.track(async move {
                let outcome =
                    release_fully(Arc::clone(held.client.backend()), held.hold.store.clone()).await;
                held.finish(outcome, was_lost)
            }),
        ))
    }
}

impl LockGuard {
    /// Leaves the hold in the store until its lease ends, releasing nothing: the guard
    /// is gone for the client (its watchdog renewal, if any, stops), and the store
    /// frees the hold when its lease runs out. For a hold whose lease is what it stands
    /// for: a stored response's place in a quota, taken for the response's lifetime.
    pub(crate) fn keep_until_lease_end(mut self) {
        if let Some(held) = self.inner.take() {
            held.leave();
        }
    }

    /// [`unlock`](Self::unlock), keeping `record` for `ttl` in the store's
    /// [`ReplayStore`](crate::backend::ReplayStore) in the same atomic step, if this
    /// hold still holds its lock there: `Ok(true)` when the record was kept.
    ///
    /// Nothing is kept (`Ok(false)`, and the hold released as `unlock` does) when the
    /// guard has no fencing token, the store keeps no records, or another guard of the
    /// hold is still alive (a re-entry kept past this one): the lock is then not this
    /// guard's to hand on. Errors as [`unlock`](Self::unlock); an error keeps nothing.
    ///
    /// Cancel-safe as `unlock`: dropped before the store answers, the step goes on in a
    /// task, and whether it kept the record is then nobody's to know.
    pub(crate) async fn unlock_storing(mut self, record: Bytes, ttl: Duration) -> Result<bool> {
        let Some(held) = self.inner.take() else {
            return Ok(false);
        };
        let left = held.leave();
        let was_lost = held.hold.is_lost_at(Instant::now());
        if left == Left::Others {
            if was_lost {
                held.report_loss();
                return Err(Error::Lost);
            }
            return Ok(false);
        }
        let runtime = held.runtime.clone();
        let registry = held.client.registry().clone();
        FinishOnDrop::new(
            Some(runtime),
            registry.track(async move {
                let (stored, outcome) = held.store_and_release(record, ttl).await;
                held.finish(outcome, was_lost).map(|()| stored)
            }),
        )
        .await
    }
}

/// The most releases spent on holds the store counts beyond one.
const MAX_REPAIRS: u32 = 1024;

/// [`release_fully`] on the spot, when the backend answers without I/O.
fn release_fully_now(
    backend: &dyn crate::backend::LockBackend,
    req: &LockRequest,
) -> Option<Result<Release>> {
    let local = backend.local()?;
    let first = local.release_now(req)?;
    let Ok(Release::Decremented { holds }) = first else {
        return Some(first);
    };
    tracing::debug!(
        holds,
        "releasing holds of an acquisition whose reply was lost"
    );
    for _ in 0..holds.min(MAX_REPAIRS) {
        match local.release_now(req) {
            Some(Ok(Release::Decremented { .. })) => {}
            Some(Ok(_)) => return Some(Ok(Release::Released)),
            Some(Err(error)) => return Some(Err(error)),
            // Not on the spot after all: the holds left end with their lease.
            None => break,
        }
    }
    Some(first)
}

/// Releases the hold `req` names, all of it. The store counts more than one hold for it
/// only when an earlier attempt of the same acquisition was applied though its reply was
/// lost; the hold's identity is its own, so releasing every count touches nothing else.
pub(super) async fn release_fully(
    backend: Arc<dyn crate::backend::LockBackend>,
    req: LockRequest,
) -> Result<Release> {
    let first = backend.release(&req).await?;
    let Release::Decremented { holds } = first else {
        return Ok(first);
    };
    tracing::debug!(
        holds,
        "releasing holds of an acquisition whose reply was lost"
    );
    for _ in 0..holds.min(MAX_REPAIRS) {
        match backend.release(&req).await? {
            Release::Decremented { .. } => {}
            _ => return Ok(Release::Released),
        }
    }
    Ok(first)
}

impl Held {
    /// Keeps `record` and releases the hold, all of it: whether the record was kept, and
    /// the release's outcome.
    async fn store_and_release(&self, record: Bytes, ttl: Duration) -> (bool, Result<Release>) {
        let backend = Arc::clone(self.client.backend());
        let req = self.hold.store.clone();
        let (Some(token), Some(replays)) = (self.token, backend.replays()) else {
            return (false, release_fully(backend, req).await);
        };
        match replays.store_and_release(&req, token, record, ttl).await {
            Ok(Stored {
                stored,
                release: Release::Decremented { .. },
            }) => {
                // Holds counted for a lost reply of this acquisition: release them too.
                let rest = release_fully(Arc::clone(&backend), req).await;
                (stored, rest.map(|_| Release::Released))
            }
            Ok(Stored { stored, release }) => (stored, Ok(release)),
            Err(error) => (false, Err(error)),
        }
    }

    /// This guard is gone from the client's registry of holds.
    fn leave(&self) -> Left {
        if self.observed
            && let Some(observer) = self.client.hooks().observer()
        {
            observer.guard_ended(self.event(), self.acquired_at.elapsed());
        }
        self.client
            .registry()
            .leave(&self.hold, self.watched, &self.runtime)
    }

    fn event(&self) -> LockEvent<'_> {
        self.client.hooks().event(
            &self.hold.slot.key,
            self.hold.slot.mode,
            &self.hold.slot.owner,
        )
    }

    /// Tells the observer the hold was lost, unless someone (the watchdog, another
    /// guard) already did.
    fn report_loss(&self) {
        if let Some(observer) = self.client.hooks().observer()
            && self.hold.claim_loss_report()
        {
            observer.lost(self.event());
        }
    }

    /// The release of a dropped guard, observed and logged: nobody is left to tell.
    fn after_drop(&self, outcome: Result<Release>, was_lost: bool) {
        self.observe(&outcome, was_lost);
        self.release_again_later(&outcome, was_lost);
        let key = self.client.hooks().key(&self.hold.slot.key);
        match outcome {
            Ok(Release::NotHeld) => {
                self.hold.lost.set();
                tracing::debug!(%key, "dropped guard's lock was no longer held");
            }
            Ok(_) => {}
            Err(error) => {
                tracing::warn!(%key, %error, "release of a dropped guard failed");
            }
        }
    }

    /// What `unlock` reports for the release's `outcome`, observed.
    fn finish(&self, outcome: Result<Release>, was_lost: bool) -> Result<()> {
        self.client.registry().inner.health.note(&outcome);
        self.observe(&outcome, was_lost);
        self.release_again_later(&outcome, was_lost);
        match outcome {
            Ok(Release::NotHeld) => {
                self.hold.lost.set();
                Err(Error::Lost)
            }
            // Known lost: that is the news, whatever the release met.
            _ if was_lost => Err(Error::Lost),
            Ok(_) => Ok(()),
            Err(error) => Err(error),
        }
    }

    /// After a release that met an outage (`outcome`): the hold is likely still in the
    /// store, and every other owner would wait out its lease. The release is tried
    /// again in a task until the store answers or the lease ends. Safe however late
    /// a try lands: it names this hold's own identity, which nothing else uses.
    fn release_again_later(&self, outcome: &Result<Release>, was_lost: bool) {
        let Err(error) = outcome else {
            return;
        };
        if was_lost || !error.is_unavailable() {
            return;
        }
        let until = self
            .hold
            .expiry
            .get()
            .unwrap_or_else(|| Instant::now() + self.lease);
        let job = super::cleanup::Job {
            what: super::cleanup::What::Release,
            req: self.hold.store.clone(),
            until,
        };
        super::cleanup::again(&self.client.registry().inner, &self.runtime, job);
    }

    fn observe(&self, outcome: &Result<Release>, was_lost: bool) {
        match outcome {
            Ok(Release::NotHeld) => self.report_loss(),
            Ok(_) if was_lost => self.report_loss(),
            Ok(_) => {
                if let Some(observer) = self.client.hooks().observer() {
                    observer.released(self.event(), self.acquired_at.elapsed());
                }
            }
            Err(error) => {
                if let Some(observer) = self.client.hooks().observer() {
                    observer.release_failed(self.event(), error);
                }
            }
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(held) = self.inner.take() else {
            return;
        };
        if held.leave() == Left::Others {
            return;
        }
        let was_lost = held.hold.is_lost_at(Instant::now());
        if let Some(outcome) = release_fully_now(held.client.backend().as_ref(), &held.hold.store) {
            held.after_drop(outcome, was_lost);
            return;
        }
        let runtime = held.runtime.clone();
        let registry = held.client.registry().clone();
        runtime.spawn(registry.track(async move {
            let outcome =
                release_fully(Arc::clone(held.client.backend()), held.hold.store.clone()).await;
            held.after_drop(outcome, was_lost);
        }));
    }
}

/// Runs `work` while `guard` holds its lock, then unlocks: see
/// [`Lock::with_lock`](crate::Lock::with_lock).
pub(super) async fn run_locked<T, F, Fut>(guard: LockGuard, work: F) -> Result<T>
where
    F: FnOnce(HeldLock) -> Fut,
    Fut: Future<Output = T>,
{
    let held = HeldLock::of_guard(&guard);
    let lost = guard.lost().wait();
    let done = tokio::select! {
        // Loss first: a result that lands as the lock is lost was not protected.
        biased;
        () = lost => None,
        value = work(held) => Some(value),
    };
    let Some(value) = done else {
        let _ = guard.unlock().await;
        return Err(Error::Lost);
    };
    match guard.unlock().await {
        Ok(()) => Ok(value),
        Err(Error::Lost) => Err(Error::Lost),
        Err(error) => {
            tracing::warn!(%error, "unlock after work under the lock failed");
            Ok(value)
        }
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Some(held) => f
                .debug_struct("LockGuard")
                .field("key", &held.hold.slot.key)
                .field("owner", &held.hold.slot.owner)
                .field("hold_id", &held.hold.store.hold_id)
                .field("mode", &held.hold.slot.mode)
                .field("fencing_token", &held.token)
                .field("lost", &held.hold.is_lost_at(Instant::now()))
                .finish(),
            None => f.write_str("LockGuard(released)"),
        }
    }
}
