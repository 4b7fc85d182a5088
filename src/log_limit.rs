//! Log lines that an outage cannot multiply: at most one line per cause and interval,
//! the next one carrying the count of those in between.
//!
//! In an outage every caller, every retry and every cleanup meets the same failure; a
//! line each buries the one that says what is wrong (an outage at 1,000 requests a
//! second). So each cause is logged at once, then at most once per
//! [`LOG_INTERVAL`], with the count of the events not logged since; the others go to
//! DEBUG.

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

/// How often, at most, one cause is logged: 10 s. Short enough that a log shows an
/// outage going on, second by second of a dashboard's resolution; long enough that an
/// outage at any request rate is a handful of lines a minute.
pub(crate) const LOG_INTERVAL: Duration = Duration::from_secs(10);

/// At most one line per interval: the first event at once, then the first event after
/// the interval, with the count of those in between.
#[derive(Debug)]
pub(crate) struct RateLimit {
    interval: Duration,
    state: Mutex<RateState>,
}

#[derive(Debug, Default)]
struct RateState {
    /// When the last line was logged; `None`: never.
    logged: Option<Instant>,
    /// Events not logged since.
    suppressed: u64,
}

impl RateState {
    fn check(&mut self, now: Instant, interval: Duration) -> Option<u64> {
        let due = self
            .logged
            .is_none_or(|last| now.saturating_duration_since(last) >= interval);
        if !due {
            self.suppressed = self.suppressed.saturating_add(1);
            return None;
        }
        self.logged = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

impl RateLimit {
    pub(crate) fn new(interval: Duration) -> Self {
        RateLimit {
            interval,
            state: Mutex::new(RateState::default()),
        }
    }

    /// An event at `now`: `Some(suppressed)` to log it, with the count of events not
    /// logged since the last line; `None` to count it instead.
    pub(crate) fn check(&self, now: Instant) -> Option<u64> {
        // A panic elsewhere while the lock was held leaves a consistent count.
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        state.check(now, self.interval)
    }
}

/// A [`RateLimit`] per cause, a cause being a fixed text the crate wrote (so the map
/// stays as small as the crate's list of causes).
#[derive(Debug, Default)]
pub(crate) struct PerCause {
    causes: Mutex<HashMap<&'static str, RateState>>,
}

impl PerCause {
    /// An event of `cause` now: `Some(suppressed)` to log it, with the count of events
    /// of that cause not logged since its last line; `None` to count it instead.
    pub(crate) fn check(&self, cause: &'static str) -> Option<u64> {
        let mut causes = self.causes.lock().unwrap_or_else(PoisonError::into_inner);
        causes
            .entry(cause)
            .or_default()
            .check(Instant::now(), LOG_INTERVAL)
    }
}

/// Logs `$msg` at WARN with `$fields` (no trailing comma) when `$limit` (a
/// [`PerCause`]) lets the cause `$msg` through, with `suppressed`, the count since its
/// last line; else at DEBUG.
macro_rules! warn_limited {
    ($limit:expr, $msg:literal, $($fields:tt)+) => {
        match $limit.check($msg) {
            Some(suppressed) => tracing::warn!(suppressed, $($fields)+, $msg),
            None => tracing::debug!($($fields)+, $msg),
        }
    };
    ($limit:expr, $msg:literal) => {
        match $limit.check($msg) {
            Some(suppressed) => tracing::warn!(suppressed, $msg),
            None => tracing::debug!($msg),
        }
    };
}

/// What the stores' connections log of their faults (a connection lost, a primary not
/// found), once per cause and interval in the whole process: every backend meets the
/// same outage at once.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
pub(crate) fn stores() -> &'static PerCause {
    static STORES: std::sync::LazyLock<PerCause> = std::sync::LazyLock::new(PerCause::default);
    &STORES
}
pub(crate) use warn_limited;

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_first_event_then_one_line_per_interval_with_the_count() {
        let limit = RateLimit::new(Duration::from_secs(10));
        assert_eq!(limit.check(Instant::now()), Some(0), "the first at once");
        for _ in 0..5 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert_eq!(limit.check(Instant::now()), None);
        }
        tokio::time::advance(Duration::from_millis(4999)).await;
        assert_eq!(limit.check(Instant::now()), None, "9.999 s: still counted");
        tokio::time::advance(Duration::from_millis(1)).await;
        assert_eq!(
            limit.check(Instant::now()),
            Some(6),
            "10 s after the first line: logged, with the 6 in between"
        );
        assert_eq!(limit.check(Instant::now()), None);
        // A quiet spell: the next event is logged at once, with the one before it.
        tokio::time::advance(Duration::from_secs(60)).await;
        assert_eq!(limit.check(Instant::now()), Some(1));
        assert_eq!(limit.check(Instant::now()), None);
    }

    #[tokio::test(start_paused = true)]
    async fn each_cause_has_its_own_interval() {
        let limits = PerCause::default();
        assert_eq!(limits.check("a"), Some(0));
        assert_eq!(
            limits.check("b"),
            Some(0),
            "another cause is logged at once"
        );
        assert_eq!(limits.check("a"), None);
        assert_eq!(limits.check("a"), None);
        tokio::time::advance(LOG_INTERVAL).await;
        assert_eq!(limits.check("a"), Some(2));
        assert_eq!(limits.check("b"), Some(0));
    }
}
