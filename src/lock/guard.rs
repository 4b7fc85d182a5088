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
        token: CancellationToken,
        /// End of an explicit lease; `None` for watched locks.
        deadline: Option<Instant>,
    },
    /// Fires when any of several holds is lost (a MultiLock, a request's locks).
    Any(Arc<[LostSignal]>),
}

impl LostSignal {
    pub(crate) fn new(token: CancellationToken, deadline: Option<Instant>) -> Self {
        LostSignal {
            repr: Repr::One { token, deadline },
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
            Repr::One { token, deadline } => {
                token.is_cancelled() || deadline.is_some_and(|d| Instant::now() >= d)
            }
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
            Repr::One { token, deadline } => Box::pin(async move {
                match deadline {
                    Some(deadline) => {
                        tokio::select! {
                            _ = token.cancelled() => {}
                            _ = tokio::time::sleep_until(deadline) => {}
                        }
                    }
                    None => token.cancelled().await,
                }
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
    /// The watchdog registration's generation; `None` for an explicit lease.
    watched: Option<u64>,
    runtime: Handle,
    acquired_at: Instant,
}

impl LockGuard {
    pub(crate) fn new(
        client: LockClient,
        req: LockRequest,
        token: FencingToken,
        holds: u32,
        lost: LostSignal,
        watched: Option<u64>,
    ) -> Self {
        LockGuard {
            inner: Some(Held {
                client,
                req,
                token,
                holds,
                lost,
                watched,
                runtime: Handle::current(),
                acquired_at: Instant::now(),
            }),
        }
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
        self.held().watched.is_some()
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
        held.stop_watching();
        let was_lost = held.lost.is_lost();
        let outcome = held.client.backend().release(&held.req).await;
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

impl Held {
    fn stop_watching(&self) {
        if let Some(generation) = self.watched {
            self.client.watchdog().unregister(&self.req, generation);
        }
    }

    /// Tells the observer how a release went. A loss the watchdog already reported
    /// (a watched hold whose signal had fired) is not reported again.
    fn observe(&self, outcome: &Result<Release>, was_lost: bool) {
        let Some(observer) = self.client.hooks().observer() else {
            return;
        };
        let event = crate::lock::LockEvent {
            key: &self.req.key,
            mode: self.req.mode,
            owner: &self.req.owner,
        };
        let reported_by_watchdog = was_lost && self.watched.is_some();
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
        held.stop_watching();
        let was_lost = held.lost.is_lost();
        let runtime = held.runtime.clone();
        runtime.spawn(async move {
            let outcome = held.client.backend().release(&held.req).await;
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
