//! How the layer tells an operator about failures in its log: a lock store that cannot
//! answer (WARN, at most one line per [`OUTAGE_LOG_INTERVAL`] and layer) and a
//! misconfiguration (ERROR once per cause and layer, then DEBUG).
//!
//! Both are about the server, not the request: one line says what is wrong, and a line
//! per request would only bury it (an outage at 1,000 requests a second). Every request
//! is still counted by the observer (`tower_lock_layer_outcomes_total`) and logged at
//! DEBUG.

use std::collections::HashSet;
use std::fmt;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use crate::log_limit::RateLimit;

/// How often, at most, a layer logs that its lock store cannot answer: 10 s. The first
/// request that finds the store down is logged at once (WARN); those that follow within
/// the interval are only counted (and logged at DEBUG), and the first one after it is
/// logged with that count. Short enough that a log shows an outage going on, second by
/// second of a dashboard's resolution; long enough that an outage at any request rate is
/// a handful of lines a minute.
pub const OUTAGE_LOG_INTERVAL: Duration = crate::log_limit::LOG_INTERVAL;

/// How many distinct misconfiguration causes a layer remembers to log each once at
/// ERROR; further new causes are logged at DEBUG. A cause is a message the crate or the
/// key extractor wrote (a missing extension's type, a store's refusal), so a layer sees
/// a handful; the bound keeps a store that puts variable text in its errors from
/// growing the set without end.
const MAX_CAUSES: usize = 64;

/// What a layer remembers to keep its failure log short.
#[derive(Debug)]
pub(crate) struct Report {
    outages: RateLimit,
    causes: OncePerCause,
}

impl Report {
    pub(crate) fn new() -> Self {
        Report {
            outages: RateLimit::new(OUTAGE_LOG_INTERVAL),
            causes: OncePerCause::default(),
        }
    }

    /// The store could not answer `error`: the request was answered 503 (`fail_open`
    /// false) or served without its lock.
    pub(crate) fn outage(&self, layer: &str, error: &dyn fmt::Display, fail_open: bool) {
        let what = if fail_open {
            "lock store cannot answer; requests are served without their lock (fail-open)"
        } else {
            "lock store cannot answer; requests are answered 503 (fail-closed)"
        };
        match self.outages.check(Instant::now()) {
            Some(0) => tracing::warn!(layer, %error, "{what}"),
            Some(suppressed) => tracing::warn!(
                layer,
                suppressed,
                %error,
                "{what}; {suppressed} more since the last warning"
            ),
            None => tracing::debug!(layer, %error, "{what}"),
        }
    }

    /// The request was answered 500: `cause` (the layer, the store or the server's
    /// wiring) is wrong.
    pub(crate) fn misconfigured(&self, layer: &str, cause: &dyn fmt::Display) {
        let cause = cause.to_string();
        if self.causes.first(&cause) {
            tracing::error!(
                layer,
                %cause,
                "request rejected with 500: the lock is misconfigured \
                 (logged once per cause; further requests at DEBUG)"
            );
        } else {
            tracing::debug!(layer, %cause, "request rejected with 500: the lock is misconfigured");
        }
    }

    /// An idempotency layer stored nothing for a response, for `reason` (a body too
    /// large or too slow to store): WARN once per reason and layer, then DEBUG. The
    /// operator can act on it (raise a limit, or leave the route out of the layer); a
    /// line per request would say nothing more.
    pub(crate) fn not_stored(&self, layer: &str, reason: crate::lock::NotStoredReason) {
        let what = "response not stored for replay; a retry with its key runs the handler again";
        if self.causes.first(&format!("not_stored:{reason}")) {
            tracing::warn!(
                layer,
                %reason,
                "{what} (logged once per reason; further responses at DEBUG)"
            );
        } else {
            tracing::debug!(layer, %reason, "{what}");
        }
    }
}

/// Remembers which causes were logged, to log each once.
#[derive(Debug, Default)]
struct OncePerCause {
    seen: Mutex<HashSet<String>>,
}

impl OncePerCause {
    /// Whether `cause` is new (and there is room to remember it).
    fn first(&self, cause: &str) -> bool {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        if seen.len() >= MAX_CAUSES || seen.contains(cause) {
            return false;
        }
        seen.insert(cause.to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_cause_once_and_a_bounded_memory() {
        let once = OncePerCause::default();
        assert!(once.first("extension `User` is missing"));
        assert!(!once.first("extension `User` is missing"));
        assert!(once.first("unsupported mode"));
        for n in 2..MAX_CAUSES {
            assert!(once.first(&format!("cause {n}")));
        }
        assert!(!once.first("one too many"), "full: DEBUG");
    }
}
