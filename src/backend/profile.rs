//! [`StoreProfile`]: what the lock core needs to know about a store besides its
//! operations — which modes it queues waiters in, how much of a lease
//! it cannot promise, and which store it is.

use std::borrow::Cow;
use std::time::Duration;

use super::LockMode;

/// What a store is, as the lock core sees it: fixed when the backend is built, returned
/// by [`LockBackend::profile`](super::LockBackend::profile).
///
/// One value instead of a method per fact: a wrapper that forwards the profile forwards
/// all of it, and nothing in it can be dropped by forgetting a method.
///
/// # Example
///
/// ```
/// use std::time::Duration;
/// use tower_lock::backend::{ClockDrift, StoreProfile};
/// use tower_lock::LockMode;
///
/// let profile = StoreProfile::new("my-store")
///     .with_store_id("my-store://db.internal:7000")
///     .with_queued_modes([LockMode::Fair])
///     .with_clock_drift(ClockDrift::new(10_000, Duration::from_millis(2)));
/// assert!(profile.queues_waiters(LockMode::Fair));
/// assert!(!profile.queues_waiters(LockMode::Exclusive));
/// // 1 % of a 10 s lease plus 2 ms.
/// assert_eq!(profile.clock_drift(Duration::from_secs(10)), Duration::from_millis(102));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreProfile {
    name: &'static str,
    store_id: Cow<'static, str>,
    queued: ModeBits,
    clock_drift: ClockDrift,
}

impl StoreProfile {
    /// A store named `name` (for messages, traces and metrics: `"memory"`, `"redis"`),
    /// whose identity is its name, that queues no waiters and has no clock drift.
    pub const fn new(name: &'static str) -> Self {
        StoreProfile {
            name,
            store_id: Cow::Borrowed(name),
            queued: ModeBits::NONE,
            clock_drift: ClockDrift::NONE,
        }
    }

    /// The same profile with the store's identity: the same in every process using the
    /// store (a server's address, not a connection's). Two [`Lock`](crate::Lock)s with
    /// the same key and mode on stores with the same identity are the same lock;
    /// MultiLock orders and de-duplicates its locks by key, mode and this, so that two
    /// processes taking the same locks take them in the same order. Without it the
    /// identity is the name, right for a store of which a process can reach only one.
    #[must_use]
    pub fn with_store_id(mut self, id: impl Into<Cow<'static, str>>) -> Self {
        self.store_id = id.into();
        self
    }

    /// The same profile with the modes in which
    /// [`acquire`](super::LockBackend::acquire) records a busy owner in the store as a
    /// waiter (a fair or read-write queue): callers then call
    /// [`cancel_wait`](super::LockBackend::cancel_wait) when they give up — also after
    /// a single busy attempt, as `try_lock` does. Such a store should evict waiters that
    /// stop polling (a caller that vanished without `cancel_wait`) and keep the
    /// [`Acquire::Busy`](super::Acquire::Busy) ttl of a queued owner below that
    /// eviction time. A [`LockMode::Permits`] entry stands for every `max`.
    #[must_use]
    pub fn with_queued_modes(mut self, modes: impl IntoIterator<Item = LockMode>) -> Self {
        self.queued = modes
            .into_iter()
            .fold(ModeBits::NONE, |bits, mode| bits.with(mode));
        self
    }

    /// The same profile with the store's clock-drift allowance; see
    /// [`clock_drift`](StoreProfile::clock_drift).
    #[must_use]
    pub fn with_clock_drift(mut self, drift: ClockDrift) -> Self {
        self.clock_drift = drift;
        self
    }

    /// A short name for messages, traces and metrics (`"memory"`, `"redis"`).
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The store's identity; see [`with_store_id`](StoreProfile::with_store_id).
    pub fn store_id(&self) -> &str {
        &self.store_id
    }

    /// Whether the store queues busy owners in `mode`; see
    /// [`with_queued_modes`](StoreProfile::with_queued_modes).
    pub fn queues_waiters(&self, mode: LockMode) -> bool {
        self.queued.contains(mode)
    }

    /// How much of a `lease` granted or renewed the client must not count on: the
    /// allowance for clocks that run at different rates, which a quorum of independent
    /// stores needs ([`RedLock`](super::redlock::RedLock)). A hold is believed until
    /// `sent + lease − clock_drift(lease)`. Zero for one store: its lease is counted
    /// from before the request was sent, which is already on the safe side.
    pub fn clock_drift(&self, lease: Duration) -> Duration {
        self.clock_drift.allowance(lease)
    }

    /// The same profile, queueing waiters in every mode `other` queues them in as well
    /// (a composite store: RedLock queues where any node does).
    pub(crate) fn queueing_as_well_as(mut self, other: &StoreProfile) -> Self {
        self.queued = ModeBits(self.queued.0 | other.queued.0);
        self
    }
}

/// A store's allowance for clock drift: a share of the lease, in parts per million, plus
/// a fixed part (timer resolution). See [`StoreProfile::clock_drift`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClockDrift {
    per_million: u32,
    fixed: Duration,
}

impl ClockDrift {
    /// No allowance: a single store.
    pub const NONE: ClockDrift = ClockDrift {
        per_million: 0,
        fixed: Duration::ZERO,
    };

    /// `per_million` millionths of the lease (at most all of it) plus `fixed`:
    /// RedLock's 1 % plus 2 ms is `ClockDrift::new(10_000, Duration::from_millis(2))`.
    pub const fn new(per_million: u32, fixed: Duration) -> Self {
        ClockDrift {
            per_million: if per_million > 1_000_000 {
                1_000_000
            } else {
                per_million
            },
            fixed,
        }
    }

    /// The allowance for `lease`.
    pub fn allowance(&self, lease: Duration) -> Duration {
        if self.per_million == 0 {
            return self.fixed;
        }
        let share = lease.as_nanos() * u128::from(self.per_million) / 1_000_000;
        let share = u64::try_from(share).map_or(Duration::MAX, Duration::from_nanos);
        share.saturating_add(self.fixed)
    }
}

/// A set of modes, by kind (every `Permits { max }` is one kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ModeBits(u8);

impl ModeBits {
    const NONE: ModeBits = ModeBits(0);

    fn bit(mode: LockMode) -> u8 {
        match mode {
            LockMode::Exclusive => 1,
            LockMode::Fair => 2,
            LockMode::Read => 4,
            LockMode::Write => 8,
            LockMode::Permits { .. } => 16,
        }
    }

    fn with(self, mode: LockMode) -> Self {
        ModeBits(self.0 | Self::bit(mode))
    }

    fn contains(self, mode: LockMode) -> bool {
        self.0 & Self::bit(mode) != 0
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU32;

    use super::*;

    #[test]
    fn queued_modes_are_kinds() {
        let p = StoreProfile::new("s").with_queued_modes([
            LockMode::Read,
            LockMode::Permits {
                max: NonZeroU32::MIN,
            },
        ]);
        assert!(p.queues_waiters(LockMode::Read));
        assert!(p.queues_waiters(LockMode::Permits {
            max: NonZeroU32::new(7).unwrap()
        }));
        assert!(!p.queues_waiters(LockMode::Write));
        assert_eq!(p.store_id(), "s");
    }

    #[test]
    fn drift_is_a_share_plus_a_fixed_part() {
        let redlock = ClockDrift::new(10_000, Duration::from_millis(2));
        assert_eq!(
            redlock.allowance(Duration::from_secs(10)),
            Duration::from_millis(102)
        );
        assert_eq!(
            redlock.allowance(Duration::from_millis(100)),
            Duration::from_millis(3)
        );
        assert_eq!(ClockDrift::NONE.allowance(Duration::MAX), Duration::ZERO);
        let all = ClockDrift::new(u32::MAX, Duration::from_secs(1));
        assert_eq!(all.allowance(Duration::MAX), Duration::MAX);
    }
}
