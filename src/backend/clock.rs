//! Deadlines on a store's clock: how a store refuses an attempt that arrives after its
//! sender gave up on it.
//!
//! An acquisition whose reply never came (a timeout, a connection cut and replaced) may
//! still be on its way: a retransmitted packet, a write queued on a socket the client
//! has abandoned. A release sent afterwards over another connection can overtake it;
//! the attempt then lands and takes a hold nobody stands for. So every attempt carries
//! a deadline on the *store's* clock, and the store refuses it once its clock has passed
//! that deadline. The client derives the deadline from its own monotonic clock and a
//! sample of the store's:
//!
//! - a sample is the store's clock `S`, read by a request answered at local instant
//!   `r`. At `r` the store's clock had reached at least `S`, so at any local instant `t`
//!   it reads at least `S + (t − r)` — a lower bound, whatever the network delays were
//!   (clocks are taken to run at the same rate; a sample is used for at most
//!   [`MAX_SAMPLE_AGE`], and compensations keep a margin for the drift, see
//!   [`COMPENSATION_MARGIN`]);
//! - an attempt stamped at local `t` with a window `w` gets the deadline
//!   `S + (t − r) + w`. When the local clock reaches `t + w`, the store's clock has
//!   passed that deadline: from then on the attempt has either been applied or never
//!   will be. A timeout of `w` counted from the stamp therefore leaves nothing in flight,
//!   and a compensating release sent after `t + w` lands after the attempt, on any
//!   connection.
//!
//! Redis scripts read `TIME`, PostgreSQL functions `clock_timestamp()`.
//!
//! A store whose clock steps back (an administrator setting it, a failover to a server
//! whose clock is behind) can accept a late attempt for as long as the step; NTP-slewed
//! clocks never step.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How long a sample of the store's clock is used before it is taken again: the drift
/// between two clocks over this long (100 ppm: 3 ms) stays far below
/// [`COMPENSATION_MARGIN`].
pub(crate) const MAX_SAMPLE_AGE: Duration = Duration::from_secs(30);

#[cfg(feature = "redis")]
/// What a compensation waits beyond an attempt's window before it counts the attempt
/// settled: room for the clocks' drift since the sample, and for the store's clock
/// granularity.
pub(crate) const COMPENSATION_MARGIN: Duration = Duration::from_millis(50);

/// A sample of one store's clock, shared by every attempt sent to it.
#[derive(Debug, Default)]
pub(crate) struct StoreClock {
    sample: Mutex<Option<Sample>>,
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    /// When the reply carrying the store's clock arrived (local).
    received: Instant,
    /// The store's clock in that reply, in microseconds.
    store_us: u64,
}

impl StoreClock {
    /// Records that a reply received at `received` read the store's clock as
    /// `store_us` microseconds.
    pub(crate) fn record(&self, store_us: u64, received: Instant) {
        *self.sample.lock().unwrap_or_else(PoisonError::into_inner) =
            Some(Sample { received, store_us });
    }

    #[cfg(feature = "redis")]
    /// Forgets the sample (the connection now reaches another server, or its clock is
    /// in doubt): the next attempt takes a new one.
    pub(crate) fn forget(&self) {
        *self.sample.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// The deadline, on the store's clock in microseconds, of an attempt stamped now
    /// with `window`: the store refuses it once its clock has passed this. `None`
    /// without a sample younger than [`MAX_SAMPLE_AGE`].
    pub(crate) fn deadline(&self, window: Duration) -> Option<u64> {
        let sample = (*self.sample.lock().unwrap_or_else(PoisonError::into_inner))?;
        let now = Instant::now();
        let age = now.saturating_duration_since(sample.received);
        if age > MAX_SAMPLE_AGE {
            return None;
        }
        let micros = |d: Duration| u64::try_from(d.as_micros()).unwrap_or(u64::MAX);
        Some(
            sample
                .store_us
                .saturating_add(micros(age))
                .saturating_add(micros(window)),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_the_sample_plus_its_age_plus_the_window() {
        let clock = StoreClock::default();
        assert_eq!(clock.deadline(Duration::from_secs(1)), None);
        let received = Instant::now();
        clock.record(5_000_000, received);
        let deadline = clock
            .deadline(Duration::from_secs(1))
            .expect("a fresh sample");
        let age = u64::try_from(received.elapsed().as_micros()).unwrap();
        // At least sample + window, and no more than the time that passed since.
        assert!(deadline >= 6_000_000, "{deadline}");
        assert!(deadline <= 6_000_000 + age + 1, "{deadline}");
    }

    #[cfg(feature = "redis")]
    #[test]
    fn a_forgotten_sample_gives_no_deadline() {
        let clock = StoreClock::default();
        clock.record(5_000_000, Instant::now());
        clock.forget();
        assert_eq!(clock.deadline(Duration::from_secs(1)), None);
    }

    #[test]
    fn an_old_sample_is_not_used() {
        let clock = StoreClock::default();
        let Some(long_ago) = Instant::now().checked_sub(MAX_SAMPLE_AGE + Duration::from_secs(1))
        else {
            return; // a monotonic clock this young cannot express it
        };
        clock.record(1, long_ago);
        assert_eq!(clock.deadline(Duration::from_secs(1)), None);
    }
}
