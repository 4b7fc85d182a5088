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
    /// The backend's [`name`](crate::backend::StoreProfile::name): `memory`, `redis`,
    /// `redlock`, ...
    pub backend: &'static str,
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

    /// Releasing this hold in the store failed. After an outage the release is tried
    /// again in the background until the store answers or the lease ends it; this is
    /// told once, for the first failure.
    fn release_failed(&self, event: LockEvent<'_>, error: &Error) {
        let _ = (event, error);
    }

    /// An acquisition found the lock busy and starts waiting for it. Always followed,
    /// once, by [`wait_ended`](Self::wait_ended) — also when the waiting future is
    /// dropped — so a gauge of current waiters stays exact.
    fn wait_started(&self, event: LockEvent<'_>) {
        let _ = event;
    }

    /// A wait begun with [`wait_started`](Self::wait_started) ended after `waited`:
    /// acquired, out of time, failed or cancelled.
    fn wait_ended(&self, event: LockEvent<'_>, waited: Duration) {
        let _ = (event, waited);
    }

    /// A guard reported by [`acquired`](Self::acquired) was unlocked or dropped, `held`
    /// after it was acquired. Called exactly once for each `acquired`, whatever becomes
    /// of the release ([`released`](Self::released) and [`lost`](Self::lost) say that),
    /// so a gauge of current holds stays exact.
    fn guard_ended(&self, event: LockEvent<'_>, held: Duration) {
        let _ = (event, held);
    }

    /// [`LockLayer`](crate::LockLayer) decided a request: served it under its lock, or
    /// rejected it, or served it without the lock (fail-open). Called once for each
    /// request the layer locks (or tries to), not for those it passes through unlocked
    /// (no key, a method it does not lock); not at all for a request whose future is
    /// dropped before it is decided (the client went away), or whose inner service
    /// fails its readiness check once the locks are held (the error is the answer).
    fn layer_outcome(&self, event: LayerEvent<'_>, outcome: LayerOutcome) {
        let _ = (event, outcome);
    }
}

/// Which layer and request an observed [`LayerOutcome`] is about.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub struct LayerEvent<'a> {
    /// Which kind of layer decided.
    pub kind: LayerKind,
    /// The layer's name ([`LockLayerBuilder::name`](crate::layer::LockLayerBuilder::name),
    /// [`IdempotencyLayerBuilder::name`](crate::idempotency::IdempotencyLayerBuilder::name)):
    /// by default its key prefix, or `""` without one. Tells two layers of a process
    /// apart.
    pub layer: &'a str,
    /// The namespace of the request's (first) key. When no key was derived (a bad
    /// key): an [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer)'s own (its
    /// keys all live under its prefix), `""` for a [`LockLayer`](crate::LockLayer)
    /// (its keys' namespaces are its extractor's).
    pub namespace: &'a str,
    /// The request's (first) key, when one was derived.
    pub key: Option<&'a LockKey>,
    /// Why nothing was stored, with [`LayerOutcome::NotStored`]; else `None`.
    pub not_stored: Option<NotStoredReason>,
}

/// The kind of layer a [`LayerEvent`] comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LayerKind {
    /// [`LockLayer`](crate::LockLayer).
    Lock,
    /// [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer).
    Idempotency,
}

impl LayerKind {
    /// `lock` or `idempotency`.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::Lock => "lock",
            LayerKind::Idempotency => "idempotency",
        }
    }
}

/// Why [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) stored nothing for a
/// response the handler made ([`LayerOutcome::NotStored`]): a retry with its key runs
/// the handler again.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum NotStoredReason {
    /// [`store_if`](crate::idempotency::IdempotencyLayerBuilder::store_if) declined its
    /// status (by default, a 5xx).
    Declined,
    /// A "not now" answer: a status in
    /// [`NEVER_STORED`](crate::idempotency::NEVER_STORED), or a rejection a
    /// [`LockLayer`](crate::LockLayer) marked [`Transient`](crate::layer::Transient).
    Transient,
    /// The body is larger than
    /// [`max_stored_body`](crate::idempotency::IdempotencyLayerBuilder::max_stored_body).
    TooLarge,
    /// The body did not end within
    /// [`max_stored_body_wait`](crate::idempotency::IdempotencyLayerBuilder::max_stored_body_wait)
    /// (a stream of events, a slow producer): it was passed on as it came.
    TooSlow,
    /// The body ends with trailers, which are not stored.
    Trailers,
    /// The store could not take the response (unreachable, timed out), or the lock was
    /// no longer held when it was stored.
    StoreFailed,
}

impl NotStoredReason {
    /// A short lowercase name, for labels and logs: `declined`, `transient`,
    /// `too_large`, `too_slow`, `trailers`, `store_failed`.
    pub fn as_str(self) -> &'static str {
        match self {
            NotStoredReason::Declined => "declined",
            NotStoredReason::Transient => "transient",
            NotStoredReason::TooLarge => "too_large",
            NotStoredReason::TooSlow => "too_slow",
            NotStoredReason::Trailers => "trailers",
            NotStoredReason::StoreFailed => "store_failed",
        }
    }
}

impl fmt::Display for NotStoredReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What [`LockLayer`](crate::LockLayer) did with a request it locks: see
/// [`LockObserver::layer_outcome`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LayerOutcome {
    /// Served: the inner service answered (a response or its error) while the request
    /// held its locks.
    Served,
    /// Rejected: the lock was still held by another request when the wait ran out.
    Busy,
    /// Rejected: the store could not answer (unreachable, timed out, no quorum) and the
    /// layer fails closed: a 503.
    Unavailable,
    /// Served without its lock: the store could not answer and the layer fails open.
    FailOpen,
    /// Rejected: the request makes no valid key (a missing or malformed header, ...):
    /// the client's fault, a 4xx.
    BadKey,
    /// Rejected: the layer, the store or the server's wiring is misconfigured (an
    /// unsupported mode, a key of another type, a request extension no middleware set):
    /// the server's fault, a 5xx.
    Misconfigured,
    /// Cancelled: the lock was lost while the handler ran.
    Lost,
    /// [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer): a retry answered
    /// with the response its first request stored; the handler did not run.
    Replayed,
    /// `IdempotencyLayer`: rejected, `409`: the first request with the key was still
    /// in flight.
    InFlight,
    /// `IdempotencyLayer`: rejected, `422`: the key was used for a request with other
    /// content.
    Mismatch,
    /// `IdempotencyLayer`: served, and the response stored for replay.
    Stored,
    /// `IdempotencyLayer`: served, and nothing stored: a retry runs the handler again.
    /// [`LayerEvent::not_stored`] says why.
    NotStored,
    /// `IdempotencyLayer`: rejected before the handler ran: the caller, or the layer,
    /// has as many stored responses as it may (`429`, `503`).
    OverQuota,
}

impl LayerOutcome {
    /// A short lowercase name, for labels and trace fields: `served`, `busy`,
    /// `unavailable`, `fail_open`, `bad_key`, `misconfigured`, `lost`, and the
    /// idempotency layer's `replayed`, `in_flight`, `mismatch`, `stored`, `not_stored`,
    /// `over_quota`.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerOutcome::Served => "served",
            LayerOutcome::Busy => "busy",
            LayerOutcome::Unavailable => "unavailable",
            LayerOutcome::FailOpen => "fail_open",
            LayerOutcome::BadKey => "bad_key",
            LayerOutcome::Misconfigured => "misconfigured",
            LayerOutcome::Lost => "lost",
            LayerOutcome::Replayed => "replayed",
            LayerOutcome::InFlight => "in_flight",
            LayerOutcome::Mismatch => "mismatch",
            LayerOutcome::Stored => "stored",
            LayerOutcome::NotStored => "not_stored",
            LayerOutcome::OverQuota => "over_quota",
        }
    }
}

impl fmt::Display for LayerOutcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
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
    fn release_failed(&self, event: LockEvent<'_>, error: &Error) {
        (**self).release_failed(event, error)
    }
    fn wait_started(&self, event: LockEvent<'_>) {
        (**self).wait_started(event)
    }
    fn wait_ended(&self, event: LockEvent<'_>, waited: Duration) {
        (**self).wait_ended(event, waited)
    }
    fn guard_ended(&self, event: LockEvent<'_>, held: Duration) {
        (**self).guard_ended(event, held)
    }
    fn layer_outcome(&self, event: LayerEvent<'_>, outcome: LayerOutcome) {
        (**self).layer_outcome(event, outcome)
    }
}

/// A client's observer and trace settings, shared with its watchdog.
#[derive(Clone, Default)]
pub(crate) struct Hooks {
    observer: Option<Arc<dyn LockObserver>>,
    /// The secret redacted keys are hashed with; `None`: keys are shown.
    redaction: Option<[u8; 16]>,
    /// The backend's name, for events.
    backend: &'static str,
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
            backend: "",
        }
    }

    /// The same hooks, for a client on the backend named `backend`.
    pub(crate) fn on_backend(mut self, backend: &'static str) -> Self {
        self.backend = backend;
        self
    }

    /// An event about `owner`'s lock on `key` in `mode`.
    pub(crate) fn event<'a>(
        &self,
        key: &'a LockKey,
        mode: LockMode,
        owner: &'a Owner,
    ) -> LockEvent<'a> {
        LockEvent {
            key,
            mode,
            owner,
            backend: self.backend,
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
