//! Hooks for metrics, and key redaction in traces.
//!
//! A [`LockObserver`] set with [`LockClientBuilder::observer`](crate::LockClientBuilder::observer)
//! hears about every acquisition, release and loss of the client's locks, so an
//! application can feed its own metrics (Prometheus, StatsD, OpenTelemetry, ...) without
//! this crate depending on a metrics library. Every method has a no-op default; implement
//! the ones you need. The methods run inline on the lock's path: keep them cheap and
//! non-blocking (increment a counter, record a histogram sample).
//!
//! [`LockClientBuilder::redact_keys`](crate::LockClientBuilder::redact_keys) replaces keys
//! in this crate's spans and events with a short hash, for keys that carry personal data
//! (a user id, an e-mail address). Observers always get the real key.

use std::fmt;
use std::hash::Hasher;
use std::sync::Arc;
use std::time::Duration;

use crate::backend::LockMode;
use crate::error::Error;
use crate::key::LockKey;
use crate::owner::Owner;

/// Which lock an observed event is about.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LockEvent<'a> {
    /// The lock's key.
    pub key: &'a LockKey,
    /// How it is (or was to be) held.
    pub mode: LockMode,
    /// Who holds (or tried to take) it.
    pub owner: &'a Owner,
}

/// Receives lock events for metrics. Every method defaults to doing nothing.
///
/// # Example
///
/// ```
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
/// use tower_lock::{LockClient, LockEvent, LockObserver, MemoryBackend};
///
/// #[derive(Default)]
/// struct Counters {
///     acquired: AtomicU64,
///     busy: AtomicU64,
/// }
///
/// impl LockObserver for Counters {
///     fn acquired(&self, _: LockEvent<'_>, _waited: Duration) {
///         self.acquired.fetch_add(1, Ordering::Relaxed);
///     }
///     fn busy(&self, _: LockEvent<'_>, _waited: Duration) {
///         self.busy.fetch_add(1, Ordering::Relaxed);
///     }
/// }
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), tower_lock::Error> {
/// let counters = std::sync::Arc::new(Counters::default());
/// let client = LockClient::builder(MemoryBackend::new())
///     .observer(counters.clone())
///     .build()?;
/// let held = client.get_lock("k")?.lock().await?;
/// assert!(client.get_lock("k")?.try_lock().await.is_err());
/// assert_eq!(counters.acquired.load(Ordering::Relaxed), 1);
/// assert_eq!(counters.busy.load(Ordering::Relaxed), 1);
/// held.unlock().await
/// # }
/// ```
pub trait LockObserver: Send + Sync + 'static {
    /// The lock was acquired (or re-entered) after waiting `waited`.
    fn acquired(&self, event: LockEvent<'_>, waited: Duration) {
        let _ = (event, waited);
    }

    /// The wait ran out after `waited` (zero for a single attempt): another owner holds
    /// the lock.
    fn busy(&self, event: LockEvent<'_>, waited: Duration) {
        let _ = (event, waited);
    }

    /// The acquisition failed for another reason: the backend failed, the mode is not
    /// supported, the lease was invalid.
    fn acquire_failed(&self, event: LockEvent<'_>, error: &Error) {
        let _ = (event, error);
    }

    /// One hold was released (by `unlock` or by dropping the guard) after being held
    /// for `held`.
    fn released(&self, event: LockEvent<'_>, held: Duration) {
        let _ = (event, held);
    }

    /// The hold was found lost: the watchdog found it gone or could not renew it before
    /// its lease ended, or a release found it no longer held. Reported once per hold.
    fn lost(&self, event: LockEvent<'_>) {
        let _ = event;
    }

    /// A watchdog renewal of this hold failed (the store did not answer in time or
    /// answered an error); the watchdog tries again next period. `error` is `None`
    /// when the renewal timed out.
    fn renewal_failed(&self, event: LockEvent<'_>, error: Option<&Error>) {
        let _ = (event, error);
    }
}

impl<T: LockObserver + ?Sized> LockObserver for Arc<T> {
    fn acquired(&self, event: LockEvent<'_>, waited: Duration) {
        (**self).acquired(event, waited)
    }
    fn busy(&self, event: LockEvent<'_>, waited: Duration) {
        (**self).busy(event, waited)
    }
    fn acquire_failed(&self, event: LockEvent<'_>, error: &Error) {
        (**self).acquire_failed(event, error)
    }
    fn released(&self, event: LockEvent<'_>, held: Duration) {
        (**self).released(event, held)
    }
    fn lost(&self, event: LockEvent<'_>) {
        (**self).lost(event)
    }
    fn renewal_failed(&self, event: LockEvent<'_>, error: Option<&Error>) {
        (**self).renewal_failed(event, error)
    }
}

/// A client's observer and trace settings, shared with its watchdog.
#[derive(Clone, Default)]
pub(crate) struct Hooks {
    observer: Option<Arc<dyn LockObserver>>,
    /// The secret redacted keys are hashed with; `None`: keys are shown.
    redaction: Option<[u8; 16]>,
}

impl Hooks {
    /// `redact`: `None` shows keys; `Some(None)` redacts with a random secret;
    /// `Some(Some(secret))` with that one.
    pub(crate) fn new(
        observer: Option<Arc<dyn LockObserver>>,
        redact: Option<Option<[u8; 16]>>,
    ) -> Self {
        Hooks {
            observer,
            // A random secret per client by default: without one, anyone with the logs
            // could hash every user id and match.
            redaction: redact
                .map(|secret| secret.unwrap_or_else(|| *uuid::Uuid::new_v4().as_bytes())),
        }
    }

    /// The observer, if one is set.
    pub(crate) fn observer(&self) -> Option<&dyn LockObserver> {
        self.observer.as_deref()
    }

    /// `key` as traces show it: itself, or a short hash when keys are redacted.
    pub(crate) fn key<'a>(&self, key: &'a LockKey) -> ShownKey<'a> {
        ShownKey {
            key,
            redaction: self.redaction,
        }
    }

    pub(crate) fn redacts_keys(&self) -> bool {
        self.redaction.is_some()
    }
}

/// A key for traces: `#` and 16 hex digits of a keyed hash when redacted. The hash is
/// stable for the life of the client, so one key's events can still be followed, but it
/// differs between clients (processes), so it cannot be reversed by hashing guesses.
pub(crate) struct ShownKey<'a> {
    key: &'a LockKey,
    redaction: Option<[u8; 16]>,
}

impl fmt::Display for ShownKey<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.redaction {
            Some(secret) => {
                // SipHash-1-3 keyed with the secret: a specified keyed hash (std's
                // `DefaultHasher` promises neither its algorithm nor stability across
                // Rust versions, so two builds could show one key differently).
                let mut h = siphasher::sip::SipHasher13::new_with_key(&secret);
                h.write(self.key.as_str().as_bytes());
                write!(f, "#{:016x}", h.finish())
            }
            None => f.write_str(self.key.as_str()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacted_keys_are_stable_short_hashes() {
        let key = LockKey::new("lock:order:{alice@example.com}").unwrap();
        let hooks = Hooks::new(None, Some(None));
        let shown = hooks.key(&key).to_string();
        assert_eq!(shown.len(), 17, "{shown}");
        assert!(
            shown.starts_with('#') && !shown.contains("alice"),
            "{shown}"
        );
        assert_eq!(shown, hooks.key(&key).to_string());
        let other = LockKey::new("lock:order:{bob}").unwrap();
        assert_ne!(shown, hooks.key(&other).to_string());
        assert_eq!(
            Hooks::default().key(&key).to_string(),
            "lock:order:{alice@example.com}"
        );
        // Random secrets differ per client; a shared secret gives the same hash in every
        // process, and a pinned value (SipHash-1-3 is specified, unlike DefaultHasher).
        assert_ne!(shown, Hooks::new(None, Some(None)).key(&key).to_string());
        let a = Hooks::new(None, Some(Some([7; 16])));
        let b = Hooks::new(None, Some(Some([7; 16])));
        assert_eq!(a.key(&key).to_string(), b.key(&key).to_string());
        assert_eq!(a.key(&key).to_string(), "#30d8c1b4f8f67528");
    }
}
