//! Waiting for a release: what a [`Subscription`] to a key's releases gives a waiter
//! ([`Wake`]), and the in-process wake-up behind the built-in backends' ([`Signal`]).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};

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

/// The in-process wake-up behind every [`Subscription`] of the built-in backends: the
/// line of the waiters registered for one key (or one queue entry), in the order they
/// registered ([`Signal::register`]).
///
/// A release ([`notify_one`](Self::notify_one)) hands one wake-up to the earliest
/// registered waiter that holds none, parked in [`Ticket::wait`] or not: a waiter
/// between its attempt and its sleep keeps it for its next `wait`. So a release is
/// never lost (a waiter registered before it either has a wake-up or gets this one),
/// two releases while two waiters are unparked wake both (permits), and a waiter that
/// registered later never takes the wake-up of one that registered earlier — not even
/// by being the only one parked when the release arrives, which a `Notify` would wake.
/// A release when every waiter already holds a wake-up is dropped: each of them tries.
/// A waiter that leaves with a wake-up it did not use hands it to the next one.
pub(crate) struct Signal {
    line: Mutex<Line>,
}

#[derive(Default)]
struct Line {
    /// The next waiter's number: numbers grow in registration order.
    next: u64,
    /// Every registered waiter, by number.
    waiters: BTreeMap<u64, Place>,
    /// The waiters without a wake-up: the next release is the first one's.
    unwoken: BTreeSet<u64>,
}

/// A registered waiter's state.
#[derive(Default)]
struct Place {
    /// A wake-up not used yet, and whether it was handed to this waiter alone (a
    /// release, a turn passed on) rather than to everyone.
    woken: Option<Handed>,
    /// Set while parked in `wait`.
    waker: Option<Waker>,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Handed {
    /// This waiter's alone: leaving without using it hands it on.
    One,
    /// Everyone's: nobody else needs this one.
    All,
}

impl Line {
    /// The earliest waiter without a wake-up but `except`. At most one number is
    /// skipped: O(log n).
    fn first_unwoken(&self, except: Option<u64>) -> Option<u64> {
        self.unwoken.iter().copied().find(|n| Some(*n) != except)
    }

    /// Hands waiter `number` (which has none) a wake-up of its own; returns its waker,
    /// to wake once the lock is let go.
    fn hand(&mut self, number: u64) -> Option<Waker> {
        self.unwoken.remove(&number);
        let place = self.waiters.get_mut(&number)?;
        place.woken = Some(Handed::One);
        place.waker.take()
    }

    /// Hands every waiter without a wake-up one; returns the wakers of those parked.
    fn hand_everyone(&mut self) -> Vec<Waker> {
        let mut wakers = Vec::new();
        for number in std::mem::take(&mut self.unwoken) {
            if let Some(place) = self.waiters.get_mut(&number) {
                place.woken = Some(Handed::All);
                wakers.extend(place.waker.take());
            }
        }
        wakers
    }

    /// Takes waiter `number`'s wake-up away, if it has one.
    fn unwake(&mut self, number: u64) -> Option<Handed> {
        let handed = self.waiters.get_mut(&number)?.woken.take()?;
        self.unwoken.insert(number);
        Some(handed)
    }
}

impl Signal {
    pub(crate) fn new() -> Self {
        Signal {
            line: Mutex::default(),
        }
    }

    fn line(&self) -> MutexGuard<'_, Line> {
        self.line.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a waiter at the end of the line. Every release from now on is counted
    /// for it or for a waiter ahead of it.
    pub(crate) fn register(self: &Arc<Self>) -> Ticket {
        let mut line = self.line();
        let number = line.next;
        line.next += 1;
        line.waiters.insert(number, Place::default());
        line.unwoken.insert(number);
        drop(line);
        Ticket {
            signal: Arc::clone(self),
            number,
        }
    }

    /// One release: one wake-up, for the earliest waiter without one.
    pub(crate) fn notify_one(&self) {
        let waker = {
            let mut line = self.line();
            line.first_unwoken(None).and_then(|first| line.hand(first))
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// A release that may admit several (a write unlock, a reconnect): a wake-up for
    /// every waiter registered now.
    pub(crate) fn notify_all(&self) {
        let wakers = self.line().hand_everyone();
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// One waiter's place in a [`Signal`]'s line, from [`Signal::register`] until dropped.
/// Dropped with a wake-up handed to it alone and not used, it hands that on.
pub(crate) struct Ticket {
    signal: Arc<Signal>,
    /// Its place in the line.
    number: u64,
}

impl Ticket {
    /// Waits until this waiter has a wake-up (and uses it) or `deadline` passes; a
    /// wake-up handed to it before the call returns at once.
    pub(crate) fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        let waiter = &*self;
        Box::pin(async move {
            if waiter.poll_woken(None) {
                return Wake::Notified;
            }
            let _parked = Parked(waiter);
            let sleep = tokio::time::sleep_until(deadline);
            tokio::pin!(sleep);
            std::future::poll_fn(|cx| {
                if waiter.poll_woken(Some(cx)) {
                    return Poll::Ready(Wake::Notified);
                }
                sleep.as_mut().poll(cx).map(|()| Wake::Deadline)
            })
            .await
        })
    }

    /// Leaving without the lock: hands a wake-up to the earliest other waiter without
    /// one — this waiter's own, if it has one, or else its turn.
    pub(crate) fn pass_on(&mut self) {
        let waker = {
            let mut line = self.signal.line();
            // Nobody to take it: this waiter keeps its own, which its leaving hands to
            // a waiter that registers meanwhile.
            let Some(next) = line.first_unwoken(Some(self.number)) else {
                return;
            };
            let waker = line.hand(next);
            line.unwake(self.number);
            waker
        };
        if let Some(waker) = waker {
            waker.wake();
        }
    }

    /// Drops a wake-up handed to this waiter so far: only a later one ends its next
    /// [`wait`](Self::wait).
    pub(crate) fn skip(&mut self) {
        self.signal.line().unwake(self.number);
    }

    /// Uses this waiter's wake-up if it has one; else, with `cx`, parks it.
    fn poll_woken(&self, cx: Option<&Context<'_>>) -> bool {
        let mut line = self.signal.line();
        if line.unwake(self.number).is_some() {
            if let Some(place) = line.waiters.get_mut(&self.number) {
                place.waker = None;
            }
            return true;
        }
        if let (Some(cx), Some(place)) = (cx, line.waiters.get_mut(&self.number)) {
            match &mut place.waker {
                Some(waker) => waker.clone_from(cx.waker()),
                None => place.waker = Some(cx.waker().clone()),
            }
        }
        false
    }
}

/// Unparks a waiter whose `wait` ended or was dropped.
struct Parked<'a>(&'a Ticket);

impl Drop for Parked<'_> {
    fn drop(&mut self) {
        if let Some(place) = self.0.signal.line().waiters.get_mut(&self.0.number) {
            place.waker = None;
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut line = self.signal.line();
        line.unwoken.remove(&self.number);
        let place = line.waiters.remove(&self.number);
        let waker = match place.and_then(|p| p.woken) {
            Some(Handed::One) => line.first_unwoken(None).and_then(|next| line.hand(next)),
            _ => None,
        };
        drop(line);
        if let Some(waker) = waker {
            waker.wake();
        }
    }
}

/// A registered interest in releases of one key, from [`LockBackend::subscribe`](super::LockBackend::subscribe).
///
/// Dropping it unregisters; a backend must not keep anything per waiter after that.
pub trait Subscription: Send {
    /// Waits until a release of the key is signalled or `deadline` passes, whichever
    /// comes first. A release signalled after [`LockBackend::subscribe`](super::LockBackend::subscribe) returned and
    /// before this call must not be lost: it makes this call return at once. A release
    /// that wakes one waiter of this process should wake the earliest subscribed one
    /// not woken yet, in this call or not: a waiter that lined up behind it
    /// ([`skip_signalled`](Self::skip_signalled)) must not take its turn by being the one
    /// parked when the release arrives.
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
    /// [`LockBackend::has_local_waiters`](super::LockBackend::has_local_waiters)): a release that landed just before it joined
    /// the line is theirs, and taking it would let the acquirer barge past them.
    ///
    /// The default does nothing: the acquirer may then take such a release, which costs
    /// fairness within the process, never safety.
    fn skip_signalled(&mut self) {}

    /// The caller stops waiting at `deadline` if it has not acquired by then (it then
    /// makes one last attempt). Called once, right after
    /// [`LockBackend::subscribe`](super::LockBackend::subscribe), by an acquisition with a deadline. A store that
    /// hands a released lock to a waiter itself (PostgreSQL) hands none to this one
    /// past it: the waiter may be gone before its leaving reaches the store. The
    /// default does nothing.
    fn gives_up_at(&mut self, deadline: Instant) {
        let _ = deadline;
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tokio::time::Instant;

    use super::{Signal, Ticket, Wake};

    fn soon() -> Instant {
        Instant::now() + Duration::from_millis(50)
    }

    /// Parks `waiter` in a task of its own until a wake-up or a second from now.
    async fn park(mut waiter: Ticket) -> tokio::task::JoinHandle<(Wake, Ticket)> {
        let parked = tokio::spawn(async move {
            let wake = waiter.wait(Instant::now() + Duration::from_secs(1)).await;
            (wake, waiter)
        });
        tokio::task::yield_now().await;
        parked
    }

    /// A release while nobody was parked is the waiters' that were registered then, and
    /// never one's that registered after it: that one would take the turn of the waiter
    /// the release was for. CI saw it as a releaser barging past the local waiter it
    /// should line up behind (PostgreSQL `no_barging_past_local_waiters`): the `Notify`
    /// kept the release's wake-up for a waiter not parked yet, and the releaser's new
    /// wait took it.
    #[tokio::test(start_paused = true)]
    async fn a_release_before_a_waiter_registered_never_wakes_it() {
        let signal = Arc::new(Signal::new());
        let mut earlier = signal.register();
        // A release while the earlier waiter is between attempts (not parked).
        signal.notify_one();
        let mut later = signal.register();
        assert_eq!(later.wait(soon()).await, Wake::Deadline);
        assert_eq!(earlier.wait(soon()).await, Wake::Notified);
        // The earlier one leaves with the lock; the next release wakes the later one,
        // parked.
        drop(earlier);
        let parked = park(later).await;
        signal.notify_one();
        assert_eq!(parked.await.unwrap().0, Wake::Notified);
    }

    /// The other order, which CI saw on a Redis cluster (`no_barging_past_local_waiters`:
    /// "the releaser barged back in"): the waiter registered and was still busy with its
    /// attempt when the holder released; the releaser asked again, lined up behind it
    /// and parked; then the release's pub/sub message arrived. A `Notify` woke the only
    /// parked waiter, the releaser, and the waiter found the count moved too: both
    /// tried, and the releaser sometimes won. The release is the earlier waiter's.
    #[tokio::test(start_paused = true)]
    async fn a_release_is_the_earliest_waiters_even_when_only_a_later_one_is_parked() {
        let signal = Arc::new(Signal::new());
        let mut earlier = signal.register();
        let mut later = signal.register();
        later.skip();
        let parked = park(later).await;
        signal.notify_one();
        let (wake, _later) = parked.await.unwrap();
        assert_eq!(
            wake,
            Wake::Deadline,
            "the later waiter took the earlier one's release"
        );
        assert_eq!(earlier.wait(soon()).await, Wake::Notified);
    }

    /// Two releases while two waiters are between their attempt and their sleep wake
    /// both (two permits came back), and neither a third time.
    #[tokio::test(start_paused = true)]
    async fn releases_while_waiters_are_unparked_wake_one_each() {
        let signal = Arc::new(Signal::new());
        let mut first = signal.register();
        let mut second = signal.register();
        signal.notify_one();
        signal.notify_one();
        // Every waiter has one: a third release finds nobody to wake.
        signal.notify_one();
        assert_eq!(second.wait(soon()).await, Wake::Notified);
        assert_eq!(first.wait(soon()).await, Wake::Notified);
        assert_eq!(first.wait(soon()).await, Wake::Deadline);
        assert_eq!(second.wait(soon()).await, Wake::Deadline);
    }

    /// Parked waiters are woken one per release, first registered first, and a waiter
    /// that used its wake-up and waits again is first in line again.
    #[tokio::test(start_paused = true)]
    async fn parked_waiters_wake_one_per_release_in_registration_order() {
        let signal = Arc::new(Signal::new());
        let first = park(signal.register()).await;
        let second = park(signal.register()).await;
        signal.notify_one();
        let (wake, mut first) = first.await.unwrap();
        assert_eq!(wake, Wake::Notified);
        assert!(!second.is_finished());
        signal.notify_one();
        assert_eq!(first.wait(soon()).await, Wake::Notified);
        assert!(!second.is_finished());
        drop(first);
        signal.notify_one();
        assert_eq!(second.await.unwrap().0, Wake::Notified);
    }

    /// A waiter leaving without the lock hands the next one its unused wake-up, or its
    /// turn; one leaving with a wake-up it never used hands that on as it goes.
    #[tokio::test(start_paused = true)]
    async fn a_leaving_waiter_hands_its_wake_up_or_its_turn_on() {
        let signal = Arc::new(Signal::new());
        let mut first = signal.register();
        let second = park(signal.register()).await;
        signal.notify_one();
        first.pass_on();
        let (wake, mut second) = second.await.unwrap();
        assert_eq!(wake, Wake::Notified);
        assert_eq!(
            first.wait(soon()).await,
            Wake::Deadline,
            "handed on, not kept"
        );
        drop(first);
        // Its turn, without a wake-up of its own.
        let third = park(signal.register()).await;
        second.pass_on();
        let (wake, third) = third.await.unwrap();
        assert_eq!(wake, Wake::Notified);
        drop(second);
        // Dropped with one it never used.
        let fourth = park(signal.register()).await;
        signal.notify_one();
        assert!(!fourth.is_finished());
        drop(third);
        assert_eq!(fourth.await.unwrap().0, Wake::Notified);
    }

    /// A release for everyone wakes every waiter registered then, parked or not, and
    /// one that leaves without using it hands nothing on: the others have theirs.
    #[tokio::test(start_paused = true)]
    async fn notify_all_wakes_everyone_and_is_not_handed_on() {
        let signal = Arc::new(Signal::new());
        let mut unparked = signal.register();
        let parked = park(signal.register()).await;
        let leaving = signal.register();
        signal.notify_all();
        let (wake, mut parked) = parked.await.unwrap();
        assert_eq!(wake, Wake::Notified);
        let mut later = signal.register();
        drop(leaving);
        assert_eq!(later.wait(soon()).await, Wake::Deadline);
        assert_eq!(unparked.wait(soon()).await, Wake::Notified);
        assert_eq!(parked.wait(soon()).await, Wake::Deadline);
    }

    /// `skip` drops what was handed to the waiter so far; later wake-ups still count.
    #[tokio::test(start_paused = true)]
    async fn skip_drops_the_wake_ups_so_far() {
        let signal = Arc::new(Signal::new());
        let mut waiter = signal.register();
        signal.notify_all();
        waiter.skip();
        assert_eq!(waiter.wait(soon()).await, Wake::Deadline);
        signal.notify_one();
        assert_eq!(waiter.wait(soon()).await, Wake::Notified);
    }
}
