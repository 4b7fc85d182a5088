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
//! # Clock steps
//!
//! A sample is forgotten, and the next attempt takes a new one, whenever it may no
//! longer describe the clock an attempt meets: when the connection moved to another
//! server (a failover), when a reply timed out, and when the store refused an attempt
//! as late (the refusal carries the store's clock, which becomes the new sample, so the
//! attempt is tried again at once with a deadline on it). On a Redis Cluster each
//! master's clock has a sample of its own.
//!
//! - A store's clock that steps **forward** (an NTP step, a failover to a server whose
//!   clock is ahead) makes the deadlines computed from an older sample look passed: the
//!   first attempt after it is refused, brings the new clock, and its retry goes
//!   through. The step costs one round trip, not the sample's age (up to
//!   [`MAX_SAMPLE_AGE`], which it once cost every attempt). It also ends every lease in
//!   the store early by the step (Redis expires keys by its wall clock), which a guard
//!   learns only at its next renewal: a step larger than the backend's drift allowance
//!   ([`StoreProfile::clock_drift`](super::StoreProfile::clock_drift)) can free a lock
//!   in the store while its holder still trusts it.
//! - A clock that steps **back** (an administrator setting it, a failover to a server
//!   whose clock is behind) makes deadlines late by the step until the next sample: an
//!   attempt given up can still land for as long as the step (a compensation still takes
//!   it back). Leases in the store last longer by the step: a crashed holder's lock is
//!   free that much later. NTP-slewed clocks never step.

use std::collections::HashMap;
use std::hash::Hash;
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

/// Samples of a store's clocks, shared by every attempt sent to it: one per server `N`
/// the store's attempts reach (`()` for a store that is one server; a Redis Cluster's
/// slot, standing for the master serving it).
#[derive(Debug)]
pub(crate) struct StoreClock<N = ()> {
    samples: Mutex<HashMap<N, Sample>>,
}

impl<N> Default for StoreClock<N> {
    fn default() -> Self {
        StoreClock {
            samples: Mutex::new(HashMap::new()),
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Sample {
    /// When the reply carrying the store's clock arrived (local).
    received: Instant,
    /// The store's clock in that reply, in microseconds.
    store_us: u64,
    /// Which connection of the store's it came over (the count of moves to another
    /// server when it was taken): one taken before a move describes another server.
    epoch: u64,
}

impl<N: Hash + Eq> StoreClock<N> {
    fn samples(&self) -> std::sync::MutexGuard<'_, HashMap<N, Sample>> {
        self.samples.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records that a reply received at `received`, over the connection of `epoch`,
    /// read the clock of `node` as `store_us` microseconds.
    pub(crate) fn record(&self, node: N, store_us: u64, received: Instant, epoch: u64) {
        self.samples().insert(
            node,
            Sample {
                received,
                store_us,
                epoch,
            },
        );
    }

    /// Forgets every sample (a reply timed out: the connection is replaced, and may
    /// reach another server): the next attempts take new ones.
    #[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
    pub(crate) fn forget(&self) {
        self.samples().clear();
    }

    /// The deadline, on the clock of `node` in microseconds, of an attempt stamped now
    /// with `window`, sent over the connection of `epoch`: the store refuses it once its
    /// clock has passed this. `None` without a sample of `node` younger than
    /// [`MAX_SAMPLE_AGE`] taken over that connection.
    pub(crate) fn deadline(&self, node: &N, window: Duration, epoch: u64) -> Option<u64> {
        let sample = *self.samples().get(node)?;
        if sample.epoch != epoch {
            return None;
        }
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

/// An attempt the store refused because it arrived after its deadline, with the
/// store's clock at the refusal (microseconds) when the store said it: the source of
/// the attempt's error, where the backend finds the clock to sample.
#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
#[derive(Debug)]
pub(crate) struct ArrivedLate {
    pub(crate) store: &'static str,
    /// Read by Redis, whose scripts say it; PostgreSQL's refusal does not.
    #[cfg_attr(not(feature = "redis"), allow(dead_code))]
    pub(crate) now_us: Option<u64>,
}

#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
impl std::fmt::Display for ArrivedLate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "the lock attempt reached {} after its deadline and was refused",
            self.store
        )
    }
}

#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
impl std::error::Error for ArrivedLate {}

#[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
impl ArrivedLate {
    /// The error of such an attempt: an outage (retryable, as the timeout it usually
    /// is) that changed nothing, and worth one more try at once, with a deadline on a
    /// new sample of the store's clock (the refusal's own, or one taken anew).
    pub(crate) fn error(store: &'static str, now_us: Option<u64>) -> crate::Error {
        crate::StoreError::not_applied(ArrivedLate { store, now_us })
            .and_again_at_once()
            .into()
    }

    /// The refusal behind `error`, if it is one.
    pub(crate) fn of(error: &crate::Error) -> Option<&ArrivedLate> {
        match error {
            crate::Error::Store(store) => store.downcast_ref(),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_deadline_is_the_sample_plus_its_age_plus_the_window() {
        let clock = StoreClock::<()>::default();
        assert_eq!(clock.deadline(&(), Duration::from_secs(1), 0), None);
        let received = Instant::now();
        clock.record((), 5_000_000, received, 0);
        let deadline = clock
            .deadline(&(), Duration::from_secs(1), 0)
            .expect("a fresh sample");
        let age = u64::try_from(received.elapsed().as_micros()).unwrap();
        // At least sample + window, and no more than the time that passed since.
        assert!(deadline >= 6_000_000, "{deadline}");
        assert!(deadline <= 6_000_000 + age + 1, "{deadline}");
    }

    #[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
    #[test]
    fn a_forgotten_sample_gives_no_deadline() {
        let clock = StoreClock::<()>::default();
        clock.record((), 5_000_000, Instant::now(), 0);
        clock.forget();
        assert_eq!(clock.deadline(&(), Duration::from_secs(1), 0), None);
    }

    #[test]
    fn an_old_sample_is_not_used() {
        let clock = StoreClock::<()>::default();
        let Some(long_ago) = Instant::now().checked_sub(MAX_SAMPLE_AGE + Duration::from_secs(1))
        else {
            return; // a monotonic clock this young cannot express it
        };
        clock.record((), 1, long_ago, 0);
        assert_eq!(clock.deadline(&(), Duration::from_secs(1), 0), None);
    }

    /// A failover moved the connection to another server: the sample of the old one
    /// says nothing of its clock.
    #[test]
    fn a_sample_taken_before_a_move_is_not_used_after_it() {
        let clock = StoreClock::<()>::default();
        clock.record((), 5_000_000, Instant::now(), 3);
        assert!(clock.deadline(&(), Duration::from_secs(1), 3).is_some());
        assert_eq!(clock.deadline(&(), Duration::from_secs(1), 4), None);
    }

    /// Each server has its own sample: one master's clock says nothing of another's.
    #[test]
    fn each_server_has_a_sample_of_its_own() {
        let clock = StoreClock::<u16>::default();
        let now = Instant::now();
        clock.record(1, 5_000_000, now, 0);
        clock.record(2, 9_000_000, now, 0);
        let one = clock.deadline(&1, Duration::ZERO, 0).unwrap();
        let two = clock.deadline(&2, Duration::ZERO, 0).unwrap();
        assert!(
            two - one >= 3_900_000 && two - one <= 4_100_000,
            "{one} {two}"
        );
        assert_eq!(clock.deadline(&3, Duration::ZERO, 0), None);
    }
}
