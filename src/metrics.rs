//! Lock metrics on the [`metrics`] facade (feature `metrics`).
//!
//! [`MetricsObserver`] is a [`LockObserver`] that records every lock event of a client
//! as the metrics below. Install any `metrics` exporter (Prometheus, StatsD,
//! OpenTelemetry, ...) in the application and set the observer on the client:
//!
//! ```
//! use tower_lock::{LockClient, MemoryBackend};
//! use tower_lock::metrics::MetricsObserver;
//!
//! let client = LockClient::builder(MemoryBackend::new())
//!     .observer(MetricsObserver::new())
//!     .build()?;
//! # let _ = client;
//! # Ok::<(), tower_lock::Error>(())
//! ```
//!
//! Why `metrics` rather than OpenTelemetry: it is a facade of a few macros, with no
//! runtime or exporter of its own, so the crate stays light for the applications that
//! do not record metrics, and an application that exports to OpenTelemetry can still do
//! so through `metrics`' OpenTelemetry bridge. Nothing is recorded until the application
//! installs a recorder.
//!
//! # Metrics
//!
//! | name | type | labels | what |
//! |---|---|---|---|
//! | `tower_lock_acquire_wait_seconds` | histogram | `kind`, `backend`, `namespace`, `outcome` (`acquired`, `busy`) | how long acquisitions took, by outcome |
//! | `tower_lock_hold_seconds` | histogram | `kind`, `backend`, `namespace` | how long guards were held |
//! | `tower_lock_holds` | gauge | `kind`, `backend`, `namespace` | guards held now (re-entries counted) |
//! | `tower_lock_waiters` | gauge | `kind`, `backend`, `namespace` | acquisitions waiting now |
//! | `tower_lock_lost_total` | counter | `kind`, `backend`, `namespace` | holds found lost |
//! | `tower_lock_backend_errors_total` | counter | `kind`, `backend`, `namespace`, `op` (`acquire`, `renew`, `release`) | failed acquisitions (the store failed, or refused the request), renewals and releases |
//! | `tower_lock_layer_outcomes_total` | counter | `layer`, `namespace`, `outcome` (see below) | what [`LockLayer`](crate::LockLayer) did with each request it locks |
//!
//! The outcomes of `tower_lock_layer_outcomes_total` ([`LayerOutcome`]), by the layer's
//! [`name`](crate::layer::LockLayerBuilder::name) (by default its key prefix, or `""`):
//!
//! | `outcome` | status | what |
//! |---|---|---|
//! | `served` | the handler's | the handler answered while the request held its lock |
//! | `busy` | 429 | the lock was still held when the wait ran out |
//! | `unavailable` | 503 | the store could not answer; the layer fails closed |
//! | `fail_open` | the handler's | the store could not answer; served without the lock |
//! | `bad_key` | 4xx | the request makes no valid key: the client's fault |
//! | `misconfigured` | 500 | the server's wiring or the store's setup is wrong (a missing request extension, an unsupported mode, a key of another type) |
//! | `lost` | 503 | the lock was lost while the handler ran; the handler was cancelled |
//!
//! Requests the layer passes through unlocked (no key, a method it does not lock) are
//! not counted. The lock metrics above come from the client, which does not know the
//! layer: they carry no `layer` label.
//!
//! Labels stay low-cardinality: `namespace` is
//! [`LockKey::namespace`](crate::LockKey::namespace) — `lock:order` for
//! `lock:order:{42}` — never the key itself, as long as user input goes in the hash tag
//! ([`LockKey::namespaced`](crate::LockKey::namespaced), the layer's extractors) or
//! after the last `:`; `layer` is a name the application chose.

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

use crate::error::Error;
use crate::lock::{LayerEvent, LayerOutcome, LockEvent, LockObserver};

/// Records a client's lock events as `metrics` (see the [module docs](self)).
#[derive(Clone, Copy, Debug, Default)]
#[non_exhaustive]
pub struct MetricsObserver;

impl MetricsObserver {
    /// An observer recording into the global `metrics` recorder. Describes the metrics
    /// (help text, units) to the recorder installed at that moment.
    pub fn new() -> Self {
        describe_histogram!(
            "tower_lock_acquire_wait_seconds",
            metrics::Unit::Seconds,
            "How long lock acquisitions took, by outcome."
        );
        describe_histogram!(
            "tower_lock_hold_seconds",
            metrics::Unit::Seconds,
            "How long lock guards were held."
        );
        describe_gauge!("tower_lock_holds", "Lock guards held now.");
        describe_gauge!("tower_lock_waiters", "Lock acquisitions waiting now.");
        describe_counter!("tower_lock_lost_total", "Holds found lost.");
        describe_counter!(
            "tower_lock_backend_errors_total",
            "Lock store failures, by operation."
        );
        describe_counter!(
            "tower_lock_layer_outcomes_total",
            "Requests LockLayer locks, by layer and outcome (served, busy, unavailable, ...)."
        );
        MetricsObserver
    }
}

/// The labels every lock metric carries.
fn labels(event: &LockEvent<'_>) -> [(&'static str, String); 3] {
    [
        ("kind", kind(event)),
        ("backend", event.backend.to_owned()),
        ("namespace", event.key.namespace().to_owned()),
    ]
}

fn kind(event: &LockEvent<'_>) -> String {
    match event.mode {
        crate::LockMode::Permits { .. } => "permits".to_owned(),
        mode => mode.to_string(),
    }
}

fn with(
    event: &LockEvent<'_>,
    name: &'static str,
    value: &'static str,
) -> [(&'static str, String); 4] {
    let [a, b, c] = labels(event);
    [a, b, c, (name, value.to_owned())]
}

impl LockObserver for MetricsObserver {
    fn acquired(&self, event: LockEvent<'_>, waited: Duration) {
        histogram!(
            "tower_lock_acquire_wait_seconds",
            &with(&event, "outcome", "acquired")
        )
        .record(waited.as_secs_f64());
        gauge!("tower_lock_holds", &labels(&event)).increment(1.0);
    }

    fn busy(&self, event: LockEvent<'_>, waited: Duration) {
        histogram!(
            "tower_lock_acquire_wait_seconds",
            &with(&event, "outcome", "busy")
        )
        .record(waited.as_secs_f64());
    }

    fn acquire_failed(&self, event: LockEvent<'_>, error: &Error) {
        let _ = error;
        counter!(
            "tower_lock_backend_errors_total",
            &with(&event, "op", "acquire")
        )
        .increment(1);
    }

    fn guard_ended(&self, event: LockEvent<'_>, held: Duration) {
        histogram!("tower_lock_hold_seconds", &labels(&event)).record(held.as_secs_f64());
        gauge!("tower_lock_holds", &labels(&event)).decrement(1.0);
    }

    fn lost(&self, event: LockEvent<'_>) {
        counter!("tower_lock_lost_total", &labels(&event)).increment(1);
    }

    fn renewal_failed(&self, event: LockEvent<'_>, error: Option<&Error>) {
        let _ = error;
        counter!(
            "tower_lock_backend_errors_total",
            &with(&event, "op", "renew")
        )
        .increment(1);
    }

    fn release_failed(&self, event: LockEvent<'_>, error: &Error) {
        let _ = error;
        counter!(
            "tower_lock_backend_errors_total",
            &with(&event, "op", "release")
        )
        .increment(1);
    }

    fn wait_started(&self, event: LockEvent<'_>) {
        gauge!("tower_lock_waiters", &labels(&event)).increment(1.0);
    }

    fn wait_ended(&self, event: LockEvent<'_>, waited: Duration) {
        let _ = waited;
        gauge!("tower_lock_waiters", &labels(&event)).decrement(1.0);
    }

    fn layer_outcome(&self, event: LayerEvent<'_>, outcome: LayerOutcome) {
        let namespace = event
            .key
            .map_or_else(String::new, |k| k.namespace().to_owned());
        counter!(
            "tower_lock_layer_outcomes_total",
            "layer" => event.layer.to_owned(),
            "namespace" => namespace,
            "outcome" => outcome.as_str()
        )
        .increment(1);
    }
}
