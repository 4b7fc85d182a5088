//! The limits on leases and waiter timeouts: rules the client and every store share, so
//! they live with the stores (the store layer imports nothing from the client).

use std::time::Duration;

use crate::error::ConfigError;

type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// The watchdog lease when none is configured: 30 s, as Redisson's
/// `lockWatchdogTimeout`. Held locks are renewed every 10 s; a crashed holder's lock is
/// free again at most 30 s later.
pub const DEFAULT_WATCHDOG_LEASE: Duration = Duration::from_secs(30);

/// The shortest watchdog lease accepted: 30 ms (a renewal every 10 ms). Shorter leases
/// leave less time for a renewal round trip than a loaded machine needs.
pub const MIN_WATCHDOG_LEASE: Duration = Duration::from_millis(30);

/// The shortest explicit lease accepted: 1 ms, the resolution of Redis `PEXPIRE`.
pub const MIN_LEASE: Duration = Duration::from_millis(1);

/// The longest lease accepted: 365 days. Anything longer is a mistake (a unit mix-up or
/// `Duration::MAX`); a lock that must be held indefinitely should use the watchdog.
pub const MAX_LEASE: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// How long a queued waiter (fair, read, write) may go without polling before it loses
/// its place: 5 s. (Redisson's `threadWaitTime` plays this part and defaults to 5
/// minutes; a vanished waiter should not stall a queue that long.) Live waiters poll at least every
/// third of it.
pub const DEFAULT_WAITER_TIMEOUT: Duration = Duration::from_secs(5);

/// The shortest waiter timeout accepted: 3 ms, so that waiters poll at least every
/// millisecond.
pub const MIN_WAITER_TIMEOUT: Duration = Duration::from_millis(3);

/// Checks a lease (the setting `name`): between [`MIN_LEASE`] and [`MAX_LEASE`], rounded
/// down to whole milliseconds.
pub(crate) fn validate_lease(name: &'static str, lease: Duration) -> Result<Duration> {
    if lease < MIN_LEASE {
        return Err(ConfigError::invalid_setting(
            name,
            format!("must be at least 1 ms (got {lease:?})"),
        ));
    }
    if lease > MAX_LEASE {
        return Err(ConfigError::invalid_setting(
            name,
            format!(
                "must be at most 365 days (got {lease:?}); use the watchdog to hold a lock indefinitely"
            ),
        ));
    }
    // The stores count in whole milliseconds (Redis `PEXPIRE`): so does the client, or
    // it would believe in a lease up to a millisecond longer than the store's.
    Ok(Duration::from_millis(
        u64::try_from(lease.as_millis()).unwrap_or(u64::MAX),
    ))
}

/// Checks a watchdog lease: at least [`MIN_WATCHDOG_LEASE`], and a valid lease.
pub(crate) fn validate_watchdog_lease(lease: Duration) -> Result<Duration> {
    validate_renewed_lease("watchdog_lease", lease)
}

/// Checks the lease of a setting `name` renewed by the watchdog: at least
/// [`MIN_WATCHDOG_LEASE`], and a valid lease.
pub(crate) fn validate_renewed_lease(name: &'static str, lease: Duration) -> Result<Duration> {
    if lease < MIN_WATCHDOG_LEASE {
        return Err(ConfigError::invalid_setting(
            name,
            format!("must be at least 30 ms when the watchdog renews it (got {lease:?})"),
        ));
    }
    validate_lease(name, lease)
}

/// Checks a backend's waiter timeout: between [`MIN_WAITER_TIMEOUT`] and [`MAX_LEASE`].
pub(crate) fn validate_waiter_timeout(timeout: Duration) -> Result<()> {
    if timeout < MIN_WAITER_TIMEOUT || timeout > MAX_LEASE {
        return Err(ConfigError::invalid_setting(
            "waiter_timeout",
            format!("must be between 3 ms and 365 days (got {timeout:?})"),
        ));
    }
    Ok(())
}

/// Checks a name the SQL stores put in their statements (a schema, a table): a plain
/// identifier, 1 to 40 of `a-z`, `0-9` and `_`, not starting with a digit, so that it
/// needs no quoting and the objects named after it stay within the databases' limits
/// (63 bytes on PostgreSQL, 64 on MySQL).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn validate_identifier(name: &'static str, value: &str) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 40
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !value.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(ConfigError::invalid_setting(
            name,
            format!(
                "must be a plain identifier: 1 to 40 of a-z, 0-9 and _, not starting with a digit (got {value:?})"
            ),
        ))
    }
}
