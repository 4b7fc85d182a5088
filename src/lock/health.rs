//! What a client knows of its store's availability: whether its last calls failed as an
//! outage, and since when. Learned from the answers of the calls it makes anyway
//! (attempts, renewals, releases, cleanups, pings), so knowing costs no call.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::time::Instant;

use crate::error::{Error, Result};

/// Whether the store answers, as the client's calls found it.
#[derive(Debug)]
pub(crate) struct Health {
    /// What [`failing_since`](Self::failing_since) counts from.
    base: Instant,
    /// Milliseconds from `base` to the first of the failures since the last answer,
    /// plus one; 0 while the last call was answered.
    failing_since: AtomicU64,
}

impl Health {
    pub(crate) fn new() -> Self {
        Health {
            base: Instant::now(),
            failing_since: AtomicU64::new(0),
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
            let ms = Instant::now()
                .saturating_duration_since(self.base)
                .as_millis();
            let since = u64::try_from(ms).unwrap_or(u64::MAX - 1) + 1;
            // The first failure since the last answer is when the outage began.
            let _ =
                self.failing_since
                    .compare_exchange(0, since, Ordering::Relaxed, Ordering::Relaxed);
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
        match self.failing_since.load(Ordering::Relaxed) {
            0 => None,
            ms => Some(self.base + std::time::Duration::from_millis(ms - 1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

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
}
