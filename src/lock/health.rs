//! What a client knows of its store's availability: whether its last calls failed as an
//! outage, and since when. Learned from the answers of the calls it makes anyway
//! (attempts, renewals, releases, cleanups, pings), so knowing costs no call.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use crate::error::{Error, Result};

/// How far apart two failures may be, with no answer between, and still be one outage:
/// twice the longest backoff of a waiter, which fails again at least that often while
/// the store is down. A client that made no call for longer does not know whether the
/// store came back meanwhile: its next failure starts a new outage.
const SAME_OUTAGE: Duration = Duration::from_secs(2);

/// Whether the store answers, as the client's calls found it.
#[derive(Debug)]
pub(crate) struct Health {
    /// What the times below count from.
    base: Instant,
    /// Milliseconds from `base` to the first of the failures since the last answer,
    /// plus one; 0 while the last call was answered.
    failing_since: AtomicU64,
    /// Milliseconds from `base` to the last failure, plus one.
    failed_last: AtomicU64,
}

impl Health {
    pub(crate) fn new() -> Self {
        Health {
            base: Instant::now(),
            failing_since: AtomicU64::new(0),
            failed_last: AtomicU64::new(0),
        }
    }

    /// Notes what a call to the store got: an answer (whatever it said), or an outage.
    /// Errors that are not the store's (a lost lock, bad input) say nothing of it.
    pub(crate) fn note<T>(&self, result: &Result<T>) {
        match result {
            Ok(_) => self.answered(),
            Err(error) => self.note_error(error),
        }
    }

    pub(crate) fn note_error(&self, error: &Error) {
        if error.is_unavailable() {
            let now = self.stamp(Instant::now());
            let last = self.failed_last.swap(now, Ordering::Relaxed);
            let same = last != 0 && now - last <= millis(SAME_OUTAGE);
            // The first failure since the last answer, or since failures too far
            // apart to tell, is when the outage began.
            if !same {
                self.failing_since.store(now, Ordering::Relaxed);
            } else {
                let _ = self.failing_since.compare_exchange(
                    0,
                    now,
                    Ordering::Relaxed,
                    Ordering::Relaxed,
                );
            }
        } else if error.is_backend() {
            self.answered();
        }
    }

    /// The store answered a call.
    pub(crate) fn answered(&self) {
        // A load first: the common case writes nothing.
        if self.failing_since.load(Ordering::Relaxed) != 0 {
            self.failing_since.store(0, Ordering::Relaxed);
        }
    }

    /// When the store began failing every call, if its last call failed as an outage.
    pub(crate) fn failing_since(&self) -> Option<Instant> {
        self.instant(self.failing_since.load(Ordering::Relaxed))
    }

    /// When the outage going on now began, if the client knows of one: its last call
    /// failed, recently enough that nothing says the store came back since.
    pub(crate) fn outage_now(&self) -> Option<Instant> {
        let since = self.failing_since()?;
        let last = self.instant(self.failed_last.load(Ordering::Relaxed))?;
        (last.elapsed() <= SAME_OUTAGE).then_some(since)
    }

    fn stamp(&self, at: Instant) -> u64 {
        let ms = at.saturating_duration_since(self.base).as_millis();
        u64::try_from(ms).unwrap_or(u64::MAX - 1) + 1
    }

    fn instant(&self, stamp: u64) -> Option<Instant> {
        (stamp != 0).then(|| self.base + Duration::from_millis(stamp - 1))
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::StoreErrorKind;

    #[tokio::test(start_paused = true)]
    async fn an_outage_is_dated_from_its_first_failure_and_ends_with_an_answer() {
        let health = Health::new();
        assert_eq!(health.failing_since(), None);
        tokio::time::advance(Duration::from_secs(3)).await;
        let began = Instant::now();
        let down = Error::store(StoreErrorKind::Unavailable, "refused");
        health.note::<()>(&Err(down.duplicate()));
        tokio::time::advance(Duration::from_secs(2)).await;
        health.note::<()>(&Err(down));
        assert_eq!(health.failing_since(), Some(began), "dated from the first");
        health.note::<()>(&Err(Error::Lost));
        assert_eq!(health.failing_since(), Some(began), "not the store's");
        health.note::<()>(&Err(Error::store(
            StoreErrorKind::Misconfigured,
            "no table",
        )));
        assert_eq!(health.failing_since(), None, "the store answered");
        health.note::<()>(&Err(Error::store(StoreErrorKind::Unavailable, "again")));
        assert!(health.failing_since().is_some());
        health.note(&Ok(()));
        assert_eq!(health.failing_since(), None);
    }

    /// A client whose last call failed long ago does not know the outage goes on: the
    /// store may have come back meanwhile (another client saw it), and its next failure
    /// starts a new outage.
    #[tokio::test(start_paused = true)]
    async fn failures_far_apart_are_outages_of_their_own() {
        let health = Health::new();
        let down = || Err::<(), _>(Error::store(StoreErrorKind::Unavailable, "refused"));
        health.note(&down());
        let first = Instant::now();
        tokio::time::advance(SAME_OUTAGE).await;
        assert_eq!(health.outage_now(), Some(first), "still going");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(health.outage_now(), None, "nothing says it goes on");
        assert_eq!(health.failing_since(), Some(first));
        health.note(&down());
        assert_eq!(health.outage_now(), Some(Instant::now()), "a new one");
    }
}
