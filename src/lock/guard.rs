//! [`LockGuard`]: a held lock, and [`LostSignal`]: the alarm that it is no longer held.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::LockClient;
use super::watchdog::{Expiry, Registration};
use crate::backend::{FencingToken, LockMode, LockRequest, Release};
use crate::error::{Error, Result};
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
    One {
        /// Fired when the hold is found gone (a renewal said "not held", unlock found it
        /// released by someone else).
        token: CancellationToken,
        /// The end of the hold's last confirmed lease, kept up to date by the watchdog.
        expiry: Arc<Expiry>,
    },
    /// Fires when any of several holds is lost (a MultiLock, a request's locks).
    Any(Arc<[LostSignal]>),
}

impl LostSignal {
    pub(crate) fn new(token: CancellationToken, expiry: Arc<Expiry>) -> Self {
        LostSignal {
            repr: Repr::One { token, expiry },
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

    /// Whether the lock has been lost.
    pub fn is_lost(&self) -> bool {
        match &self.repr {
            Repr::One { token, expiry } => token.is_cancelled() || expiry.passed(Instant::now()),
            Repr::Any(signals) => signals.iter().any(LostSignal::is_lost),
        }
    }

    /// Completes when the lock is lost; never, if it is released first. Owns what it
    /// needs, so it can be moved into a spawned task or a `select!`.
    pub fn wait(&self) -> impl Future<Output = ()> + Send + 'static {
        let this = self.clone();
        async move { this.wait_owned().await }
    }

    fn wait_owned(self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        match self.repr {
            Repr::One { token, expiry } => Box::pin(async move {
                // The lease may be extended while we sleep: re-read it when it seems due.
                while let Some(at) = expiry.get() {
                    tokio::select! {
                        _ = token.cancelled() => return,
                        _ = tokio::time::sleep_until(at) => {
                            if expiry.passed(Instant::now()) {
                                return;
                            }
                        }
                    }
                }
                token.cancelled().await;
            }),
            Repr::Any(signals) => {
                let mut waits: Vec<_> = signals.iter().map(|s| s.clone().wait_owned()).collect();
                Box::pin(std::future::poll_fn(move |cx| {
                    if waits.iter_mut().any(|w| w.as_mut().poll(cx).is_ready()) {
                        Poll::Ready(())
                    } else {
                        Poll::Pending
                    }
                }))
            }
        }
    }

    /// Whether the token was fired (a loss found and reported), as opposed to a lease
    /// that merely ran out.
    pub(crate) fn fired(&self) -> bool {
        match &self.repr {
            Repr::One { token, .. } => token.is_cancelled(),
            Repr::Any(signals) => signals.iter().any(LostSignal::fired),
        }
    }

    pub(crate) fn fire(&self) {
        match &self.repr {
            Repr::One { token, .. } => token.cancel(),
            Repr::Any(signals) => signals.iter().for_each(LostSignal::fire),
        }
    }
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
/// # Cancel safety
///
/// Dropping the guard stops its watchdog renewal at once and spawns the release on the
/// runtime the lock was acquired on; it never blocks. Should that runtime be gone, or the
/// store unreachable, the lease ends the hold.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard {
    inner: Option<Held>,
}

struct Held {
    client: LockClient,
    req: LockRequest,
    token: FencingToken,
    holds: u32,
    lost: LostSignal,
    /// The end of the hold's last confirmed lease (shared with `lost`).
    expiry: Arc<Expiry>,
    /// The registration's generation in the client's registry of holds.
    generation: u64,
    /// Renewed by the watchdog (no explicit lease).
    watched: bool,
    runtime: Handle,
    acquired_at: Instant,
}

impl LockGuard {
    pub(crate) fn new(
        client: LockClient,
        req: LockRequest,
        token: FencingToken,
        holds: u32,
        registration: Registration,
        watched: bool,
    ) -> Self {
        let Registration {
            generation,
            lost,
            expiry,
        } = registration;
        LockGuard {
            inner: Some(Held {
                client,
                req,
                token,
                holds,
                lost: LostSignal::new(lost, Arc::clone(&expiry)),
                expiry,
                generation,
                watched,
                runtime: Handle::current(),
                acquired_at: Instant::now(),
            }),
        }
    }

    /// Sets the lease of this hold to exactly `lease` from now (owner-checked); returns
    /// whether the hold was still there. MultiLock uses it to give every lock the same
    /// lease once all are held.
    pub(crate) async fn pin_lease(&mut self, lease: Duration) -> Result<bool> {
        let Some(held) = self.inner.as_mut() else {
            return Ok(false);
        };
        let mut req = held.req.clone();
        req.lease = lease;
        let sent_at = Instant::now();
        let renewed = held.client.backend().renew(&req).await?;
        if renewed {
            held.expiry.set(sent_at.checked_add(lease));
            held.req.lease = lease;
        }
        Ok(renewed)
    }

    fn held(&self) -> &Held {
        // `inner` is only taken by `unlock` (which consumes the guard) and `drop`.
        self.inner
            .as_ref()
            .unwrap_or_else(|| unreachable!("a live guard always holds its lock"))
    }

    /// The lock's key.
    pub fn key(&self) -> &LockKey {
        &self.held().req.key
    }

    /// The owner holding the lock.
    pub fn owner(&self) -> &Owner {
        &self.held().req.owner
    }

    /// How the lock is held.
    pub fn mode(&self) -> LockMode {
        self.held().req.mode
    }

    /// The fencing token: strictly greater than the token of every earlier holder of
    /// this key. Reentrant guards share the token of the hold they re-entered.
    pub fn fencing_token(&self) -> FencingToken {
        self.held().token
    }

    /// How many times the owner held the lock when this guard was made (1 unless
    /// re-entered).
    pub fn hold_count(&self) -> u32 {
        self.held().holds
    }

    /// The lease in force: the watchdog lease for watched locks, else the explicit one.
    pub fn lease(&self) -> Duration {
        self.held().req.lease
    }

    /// Whether the watchdog renews this lock.
    pub fn is_watched(&self) -> bool {
        self.held().watched
    }

    /// The signal that fires if the lock is lost. See [`LostSignal`].
    pub fn lost(&self) -> LostSignal {
        self.held().lost.clone()
    }

    /// Whether the lock has been lost.
    pub fn is_lost(&self) -> bool {
        self.held().lost.is_lost()
    }

    /// Releases one hold and reports whether the lock was still held until now.
    ///
    /// # Errors
    ///
    /// - [`Error::Lost`] when the lock had been lost (the store no longer had it for
    ///   this owner, or the lost signal had fired); nothing of another owner's lock is
    ///   touched.
    /// - A backend error when the store could not be reached; the lease then ends the
    ///   hold (renewal has already stopped).
    pub async fn unlock(mut self) -> Result<()> {
        let Some(held) = self.inner.take() else {
            return Ok(());
        };
        let last_local = held.unregister() == Some(0);
        let was_lost = held.lost.is_lost();
        // Cancel-safe: dropped before the store answers, the release goes on in a task.
        let release = release_fully(
            Arc::clone(held.client.backend()),
            held.req.clone(),
            last_local,
        );
        let outcome = FinishOnDrop::new(held.runtime.clone(), release).await;
        held.observe(&outcome, was_lost);
        match outcome? {
            Release::NotHeld => {
                held.lost.fire();
                Err(Error::Lost)
            }
            _ if was_lost => Err(Error::Lost),
            _ => Ok(()),
        }
    }
}

/// The most extra releases spent repairing holds no guard stands for.
const MAX_REPAIRS: u32 = 1024;

/// Releases one hold of `req`. When this client has no other guard of the hold
/// (`last_local`) yet the store still counts holds of the owner, those holds stand for
/// nobody — an acquisition the store applied but whose reply was lost — so they are
/// released too; otherwise the key would stay locked until the lease ran out.
async fn release_fully(
    backend: Arc<dyn crate::backend::LockBackend>,
    req: LockRequest,
    last_local: bool,
) -> Result<Release> {
    let first = backend.release(&req).await?;
    let Release::Decremented { holds } = first else {
        return Ok(first);
    };
    if !last_local {
        return Ok(first);
    }
    tracing::warn!(holds, key = %req.key, owner = %req.owner, "releasing holds no guard stands for (a reply lost in flight)");
    for _ in 0..holds.min(MAX_REPAIRS) {
        match backend.release(&req).await? {
            Release::Decremented { .. } => {}
            _ => return Ok(Release::Released),
        }
    }
    Ok(first)
}

/// Drives a boxed future; dropped before it completes, hands it to a task on `runtime`
/// so it still runs to the end.
struct FinishOnDrop<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    runtime: Handle,
}

impl<T: Send + 'static> FinishOnDrop<T> {
    fn new(runtime: Handle, future: impl Future<Output = T> + Send + 'static) -> Self {
        FinishOnDrop {
            future: Some(Box::pin(future)),
            runtime,
        }
    }
}

impl<T: Send + 'static> Future for FinishOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let output = std::task::ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        if let Some(future) = self.future.take() {
            self.runtime.spawn(async move {
                let _ = future.await;
            });
        }
    }
}

impl Held {
    /// This guard is gone from the client's registry of holds: how many guards of the
    /// hold the client still has (`None`: the hold had already ended as lost).
    fn unregister(&self) -> Option<usize> {
        self.client
            .watchdog()
            .unregister(&self.req, self.generation, self.watched)
    }

    fn observe(&self, outcome: &Result<Release>, was_lost: bool) {
        let Some(observer) = self.client.hooks().observer() else {
            return;
        };
        let event = crate::lock::LockEvent {
            key: &self.req.key,
            mode: self.req.mode,
            owner: &self.req.owner,
        };
        // The watchdog reports the losses it finds (and fires the token); an expiry it
        // had not caught yet is reported here.
        let reported_by_watchdog = was_lost && self.watched && self.lost.fired();
        match outcome {
            Ok(Release::NotHeld) if !reported_by_watchdog => observer.lost(event),
            Ok(Release::NotHeld) => {}
            Ok(_) if was_lost && !reported_by_watchdog => observer.lost(event),
            Ok(_) => observer.released(event, self.acquired_at.elapsed()),
            Err(_) => {}
        }
    }
}

impl Drop for LockGuard {
    fn drop(&mut self) {
        let Some(held) = self.inner.take() else {
            return;
        };
        let last_local = held.unregister() == Some(0);
        let was_lost = held.lost.is_lost();
        let runtime = held.runtime.clone();
        runtime.spawn(async move {
            let outcome = release_fully(
                Arc::clone(held.client.backend()),
                held.req.clone(),
                last_local,
            )
            .await;
            held.observe(&outcome, was_lost);
            let key = held.client.hooks().key(&held.req.key);
            match outcome {
                Ok(Release::NotHeld) => {
                    tracing::debug!(%key, "dropped guard's lock was no longer held");
                }
                Ok(_) => {}
                Err(error) => {
                    tracing::warn!(%key, %error, "release of a dropped guard failed; the lease will end the hold");
                }
            }
        });
    }
}

impl fmt::Debug for LockGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Some(held) => f
                .debug_struct("LockGuard")
                .field("key", &held.req.key)
                .field("owner", &held.req.owner)
                .field("mode", &held.req.mode)
                .field("fencing_token", &held.token)
                .field("lost", &held.lost.is_lost())
                .finish(),
            None => f.write_str("LockGuard(released)"),
        }
    }
}
