//! Waiting for a release: what a [`Subscription`] to a key's releases gives a waiter
//! ([`Wake`]), and the in-process wake-up behind the built-in backends' ([`Signal`]).

use tokio::time::Instant;

use super::BoxFuture;

/// Why [`Subscription::wait`] returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wake {
    /// A release (or a reconnect, or a stored notification) says trying again may work.
    Notified,
    /// The deadline passed without a notification.
    Deadline,
}

/// The in-process wake-up behind every [`Subscription`] of the built-in backends: a
/// `Notify` for waiters that are parked, and a release counter for those that are not.
///
/// `Notify` keeps at most one wake-up for a waiter that has not parked yet, so two
/// releases arriving while two waiters are between their attempt and their sleep would
/// wake only one — for permits, the other then sleeps with a permit free. Here a waiter
/// also remembers the count it last saw, and does not park when it has moved: no release
/// is lost, and parked waiters are still woken one per release. The other way round, a
/// wake-up the `Notify` kept from a release before a waiter registered is not that
/// waiter's (it has seen that count), so it waits on instead of taking another's turn.
pub(crate) struct Signal {
    notify: tokio::sync::Notify,
    releases: std::sync::atomic::AtomicU64,
}

impl Signal {
    pub(crate) fn new() -> Self {
        Signal {
            notify: tokio::sync::Notify::new(),
            releases: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The release count now: what a new waiter has seen.
    pub(crate) fn seen(&self) -> u64 {
        self.releases.load(std::sync::atomic::Ordering::Acquire)
    }

    /// One release: wakes one parked waiter; unparked ones find the count moved.
    pub(crate) fn notify_one(&self) {
        self.releases
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.notify.notify_one();
    }

    /// A release that may admit several (a write unlock, a reconnect): wakes everyone.
    pub(crate) fn notify_all(&self) {
        self.releases
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.notify.notify_waiters();
    }

    /// Waits until a release after `seen` or `deadline`, and updates `seen`.
    pub(crate) fn wait<'a>(&'a self, seen: &'a mut u64, deadline: Instant) -> BoxFuture<'a, Wake> {
        Box::pin(async move {
            loop {
                let notified = self.notify.notified();
                tokio::pin!(notified);
                // Registered before the count is read: a release between the two still
                // wakes us through the `Notify`.
                notified.as_mut().enable();
                let now = self.seen();
                if now != *seen {
                    *seen = now;
                    return Wake::Notified;
                }
                if tokio::time::timeout_at(deadline, notified).await.is_err() {
                    return Wake::Deadline;
                }
                // Woken: by a release after `seen` (the count moved, and the check above
                // says so), or by a wake-up the `Notify` kept from a release before we
                // registered, when nobody was parked. That one is not ours: the waiters
                // registered then see the count moved; wait on.
            }
        })
    }
    /// Moves `seen` to the release count now: releases so far are somebody else's.
    pub(crate) fn skip(&self, seen: &mut u64) {
        *seen = self.seen();
    }
}

/// A registered interest in releases of one key, from
/// [`LockBackend::subscribe`](super::LockBackend::subscribe).
///
/// Dropping it unregisters; a backend must not keep anything per waiter after that.
pub trait Subscription: Send {
    /// Waits until a release of the key is signalled or `deadline` passes, whichever
    /// comes first. A release signalled after
    /// [`LockBackend::subscribe`](super::LockBackend::subscribe) returned and before
    /// this call must not be lost: it makes this call return at once.
    ///
    /// It does not fail: when the backend cannot deliver notifications (a dropped
    /// pub/sub connection) it returns `Notified` so the caller retries, or sleeps to the
    /// deadline; the caller bounds the deadline by the holder's lease.
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake>;

    /// The caller leaves without the lock (it gives up, is cancelled, or fails): hand a
    /// wake-up to another waiter of the same key in this process — the one it received
    /// and will not use, or else its turn, so that a waiter lined up behind it retries
    /// now. A release is then never absorbed by a waiter that went away. A spurious
    /// wake-up costs the other waiter one attempt; none that is needed may be lost.
    fn pass_on(&mut self);

    /// Releases signalled so far no longer end the next [`wait`](Self::wait): only a
    /// later one, or a wake-up handed on by another waiter, does. Called by a new
    /// acquirer lining up behind the waiters already here (see
    /// [`LockBackend::has_local_waiters`](super::LockBackend::has_local_waiters)): a
    /// release that landed just before it joined the line is theirs, and taking it
    /// would let the acquirer barge past them.
    ///
    /// The default does nothing: the acquirer may then take such a release, which costs
    /// fairness within the process, never safety.
    fn skip_signalled(&mut self) {}

    /// The caller stops waiting at `deadline` if it has not acquired by then (it then
    /// makes one last attempt). Called once, right after
    /// [`LockBackend::subscribe`](super::LockBackend::subscribe), by an acquisition
    /// with a deadline. A store that hands a released lock to a waiter itself
    /// (PostgreSQL) hands none to this one past it: the waiter may be gone before its
    /// leaving reaches the store. The default does nothing.
    fn gives_up_at(&mut self, deadline: Instant) {
        let _ = deadline;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Signal, Wake};

    /// A release while nobody was parked is seen by the waiters that were registered
    /// then (their count moved), and never by one that registered after it: that one
    /// would take the turn of the waiter the release was for. CI saw it as a releaser
    /// barging past the local waiter it should line up behind (PostgreSQL
    /// `no_barging_past_local_waiters`): the `Notify` kept the release's wake-up for a
    /// waiter not parked yet, and the releaser's new wait took it.
    #[tokio::test(start_paused = true)]
    async fn a_release_before_a_waiter_registered_never_wakes_it() {
        let signal = Arc::new(Signal::new());
        let mut earlier = signal.seen();
        // A release while the earlier waiter is between attempts (not parked).
        signal.notify_one();
        let mut later = signal.seen();
        let soon = Instant::now() + Duration::from_millis(50);
        assert_eq!(signal.wait(&mut later, soon).await, Wake::Deadline);
        assert_eq!(signal.wait(&mut earlier, soon).await, Wake::Notified);
        // The next release wakes the later one, parked.
        let waiter = tokio::spawn({
            let signal = Arc::clone(&signal);
            async move {
                let deadline = Instant::now() + Duration::from_secs(5);
                signal.wait(&mut later, deadline).await
            }
        });
        tokio::task::yield_now().await;
        signal.notify_one();
        assert_eq!(waiter.await.unwrap(), Wake::Notified);
    }
}
