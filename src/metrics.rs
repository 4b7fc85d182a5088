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
//! | `tower_lock_acquire_wait_seconds` | histogram ([`BUCKETS`]) | `kind`, `backend`, `namespace`, `outcome` (`acquired`, `busy`) | how long acquisitions took, by outcome |
//! | `tower_lock_hold_seconds` | histogram ([`BUCKETS`]) | `kind`, `backend`, `namespace` | how long guards were held |
//! | `tower_lock_holds` | gauge | `kind`, `backend`, `namespace` | guards held now (re-entries counted) |
//! | `tower_lock_waiters` | gauge | `kind`, `backend`, `namespace` | acquisitions waiting now |
//! | `tower_lock_lost_total` | counter | `kind`, `backend`, `namespace` | holds found lost |
//! | `tower_lock_backend_errors_total` | counter | `kind`, `backend`, `namespace`, `op` (`acquire`, `renew`, `release`) | failed acquisitions (the store failed, or refused the request), renewals and releases |
//! | `tower_lock_layer_outcomes_total` | counter | `layer`, `namespace`, `outcome` (see below) | what [`LockLayer`](crate::LockLayer) did with each request it locks |
//! | `tower_lock_idempotency_outcomes_total` | counter | `layer`, `namespace`, `outcome`, `reason` (see below) | what [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) did with each request it covers |
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
//! An [`IdempotencyLayer`](crate::idempotency::IdempotencyLayer) counts in
//! `tower_lock_idempotency_outcomes_total`, under its own name, with `bad_key`,
//! `unavailable`, `misconfigured` and `lost` as above, and:
//!
//! | `outcome` | status | what |
//! |---|---|---|
//! | `stored` | the handler's | the handler ran and its response was stored for replay |
//! | `not_stored` | the handler's | the handler ran; nothing stored, for the `reason` ([`NotStoredReason`]: `declined`, `transient`, `too_large`, `too_slow`, `trailers`, `store_failed`); `reason` is `""` for every other outcome |
//! | `replayed` | the stored one | a retry answered with the stored response; the handler did not run |
//! | `in_flight` | 409 | the first request with the key was still running |
//! | `mismatch` | 422 | the key was used for another request |
//! | `over_quota` | 429, 503 | the caller, or everyone together, has as many stored responses as allowed |
//!
//! Requests the layer passes through unlocked (no key, a method it does not lock) are
//! not counted. The lock metrics above come from the client, which does not know the
//! layer: they carry no `layer` label.
//!
//! # Histograms across replicas
//!
//! The two `_seconds` metrics are histograms on the `metrics` facade, which leaves their
//! shape to the exporter. `metrics-exporter-prometheus` exports a histogram as a
//! *summary* (quantiles computed in each process) unless it is given bucket boundaries,
//! and summaries cannot be added up across replicas: a fleet's p99 is not the average of
//! its replicas' p99s. Give it [`BUCKETS`] for every `tower_lock_` metric, and it exports
//! `_bucket` series that Prometheus sums over replicas:
//!
//! ```no_run
//! use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let prometheus = PrometheusBuilder::new()
//!     .set_buckets_for_metric(Matcher::Prefix("tower_lock_".into()), tower_lock::metrics::BUCKETS)?
//!     .install_recorder()?;
//! # let _ = prometheus;
//! # Ok(())
//! # }
//! ```
//!
//! Other exporters take boundaries in their own way (OpenTelemetry: an explicit-bucket
//! view); give them the same [`BUCKETS`].
//!
//! # Alerting
//!
//! With the buckets above, in PromQL (over every replica, by namespace or layer):
//!
//! ```text
//! # p99 of the lock wait above 0.5 s, across replicas (add outcome="acquired" to
//! # leave out the waits that ran out)
//! histogram_quantile(0.99,
//!   sum by (le, namespace) (rate(tower_lock_acquire_wait_seconds_bucket[5m]))) > 0.5
//!
//! # Fail-closed: requests answered 503 because the lock store could not answer
//! sum by (layer) (rate(tower_lock_layer_outcomes_total{outcome="unavailable"}[5m])) > 0
//!
//! # Fail-open: requests served without their lock
//! sum by (layer) (rate(tower_lock_layer_outcomes_total{outcome="fail_open"}[5m])) > 0
//!
//! # A wiring mistake: requests answered 500 (a missing extension, an unsupported mode)
//! sum by (layer) (rate(tower_lock_layer_outcomes_total{outcome="misconfigured"}[5m])) > 0
//!
//! # Share of a layer's requests answered busy, above 5 %
//!   sum by (layer) (rate(tower_lock_layer_outcomes_total{outcome="busy"}[5m]))
//! / sum by (layer) (rate(tower_lock_layer_outcomes_total[5m])) > 0.05
//! ```
//!
//! Labels stay low-cardinality: `namespace` is
//! [`LockKey::namespace`](crate::LockKey::namespace) — `lock:order` for
//! `lock:order:{42}` — never the key itself, as long as user input goes in the hash tag
//! ([`LockKey::namespaced`](crate::LockKey::namespaced), the layer's extractors) or
//! after the last `:`; `layer` is a name the application chose.

use std::time::Duration;

use metrics::{counter, describe_counter, describe_gauge, describe_histogram, gauge, histogram};

use crate::error::Error;
use crate::lock::{LayerEvent, LayerKind, LayerOutcome, LockEvent, LockObserver, NotStoredReason};

/// Bucket boundaries in seconds for `tower_lock_acquire_wait_seconds` and
/// `tower_lock_hold_seconds`, for exporters that need them to export histograms that
/// add up across replicas (see [Histograms across replicas](self#histograms-across-replicas)):
/// 0.5 ms to 60 s, in 1–2.5–5 steps, with 30 s and 60 s on top.
///
/// Why these: an uncontended acquisition costs one store round trip (0.1–1 ms on a
/// nearby Redis or PostgreSQL; microseconds in memory), so the first buckets separate a
/// healthy store from a slow one; a wait for another request's lock lasts about that
/// request's handler (milliseconds to seconds); 5 s is the layer's
/// [`DEFAULT_WAIT`](crate::layer::DEFAULT_WAIT), so waits that ran out fall just above
/// it; 30 s is the [`DEFAULT_WATCHDOG_LEASE`](crate::DEFAULT_WATCHDOG_LEASE), past which
/// a hold lived only because the watchdog renewed it. Sixteen boundaries keep each
/// labelled histogram at 18 series.
pub const BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    60.0,
];

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
        describe_counter!(
            "tower_lock_idempotency_outcomes_total",
            "Requests IdempotencyLayer covers, by layer and outcome (stored, replayed, \
             in_flight, not_stored with its reason, ...)."
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
        let layer = event.layer.to_owned();
        let namespace = event.namespace.to_owned();
        match event.kind {
            LayerKind::Idempotency => counter!(
                "tower_lock_idempotency_outcomes_total",
                "layer" => layer,
                "namespace" => namespace,
                "outcome" => outcome.as_str(),
                "reason" => event.not_stored.map_or("", NotStoredReason::as_str)
            )
            .increment(1),
            _ => counter!(
                "tower_lock_layer_outcomes_total",
                "layer" => layer,
                "namespace" => namespace,
                "outcome" => outcome.as_str()
            )
            .increment(1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_rise_and_bracket_the_defaults() {
        assert!(BUCKETS.windows(2).all(|w| w[0] < w[1]), "{BUCKETS:?}");
        for default in [crate::layer::DEFAULT_WAIT, crate::DEFAULT_WATCHDOG_LEASE] {
            assert!(
                BUCKETS.contains(&default.as_secs_f64()),
                "{default:?} is not a boundary"
            );
        }
        assert!(BUCKETS[0] <= 0.001 && *BUCKETS.last().unwrap() >= 60.0);
    }
}
