//! `MetricsObserver`: what a run of locks records, read back from a debugging recorder.
//! Gauges return to zero, every outcome lands under its label, and labels carry the
//! key's namespace, never the key.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use bytes::Bytes;
use common::wait_until;
use http::Request;
use http_body_util::Full;
use metrics_util::debugging::{DebugValue, DebuggingRecorder};
use tower::{Layer, ServiceExt, service_fn};
use tower_lock::layer::{HeaderKey, LockLayer};
use tower_lock::metrics::MetricsObserver;
use tower_lock::{Error, LockClient, MemoryBackend};

/// name + sorted labels → value, from one snapshot.
type Snapshot = HashMap<(String, Vec<(String, String)>), DebugValue>;

/// `later` on top of `earlier`: a debugging recorder's snapshot drains what it reads
/// (counters and gauges back to zero, histograms emptied), so values add up.
fn merge(earlier: Snapshot, mut later: Snapshot) -> Snapshot {
    for (key, value) in earlier {
        let merged = match (value, later.remove(&key)) {
            (v, None) => v,
            (DebugValue::Counter(a), Some(DebugValue::Counter(b))) => DebugValue::Counter(a + b),
            (DebugValue::Gauge(a), Some(DebugValue::Gauge(b))) => DebugValue::Gauge(a + b),
            (DebugValue::Histogram(mut a), Some(DebugValue::Histogram(b))) => {
                a.extend(b);
                DebugValue::Histogram(a)
            }
            (a, Some(b)) => panic!("{key:?} changed type: {a:?} then {b:?}"),
        };
        later.insert(key, merged);
    }
    later
}

fn snapshot(recorder: &DebuggingRecorder) -> Snapshot {
    recorder
        .snapshotter()
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, value)| {
            let (_, key) = key.into_parts();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            ((key.name().to_owned(), labels), value)
        })
        .collect()
}

fn labels(extra: &[(&str, &str)]) -> Vec<(String, String)> {
    let mut labels: Vec<(String, String)> = [
        ("backend", "memory"),
        ("kind", "exclusive"),
        ("namespace", "lock:order"),
    ]
    .iter()
    .chain(extra)
    .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
    .collect();
    labels.sort();
    labels
}

fn gauge(s: &Snapshot, name: &str) -> f64 {
    match s.get(&(name.to_owned(), labels(&[]))) {
        Some(DebugValue::Gauge(v)) => v.into_inner(),
        other => panic!("{name}: {other:?} in {s:#?}"),
    }
}

fn counter(s: &Snapshot, name: &str, extra: &[(&str, &str)]) -> u64 {
    match s.get(&(name.to_owned(), labels(extra))) {
        Some(DebugValue::Counter(n)) => *n,
        other => panic!("{name} {extra:?}: {other:?} in {s:#?}"),
    }
}

/// Samples of a histogram in a snapshot (a snapshot drains them: add up snapshots).
fn samples(s: &Snapshot, name: &str, extra: &[(&str, &str)]) -> usize {
    match s.get(&(name.to_owned(), labels(extra))) {
        Some(DebugValue::Histogram(v)) => v.len(),
        None => 0,
        other => panic!("{name} {extra:?}: {other:?} in {s:#?}"),
    }
}

#[test]
fn a_run_of_locks_is_recorded_and_the_gauges_return_to_zero() {
    let recorder = DebuggingRecorder::new();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    let during = metrics::with_local_recorder(&recorder, || {
        rt.block_on(async {
            let backend = MemoryBackend::new();
            let client = LockClient::builder(backend.clone())
                .observer(MetricsObserver::new())
                .watchdog_lease(Duration::from_millis(300))
                .build()
                .unwrap();
            let lock = client.get_lock("lock:order:{42}").unwrap();

            // Held, then waited for: the waiters gauge shows the wait while it lasts.
            let first = lock.lock().await.unwrap();
            let waiter = tokio::spawn({
                let lock = lock.clone();
                async move {
                    lock.try_lock_for(Duration::from_secs(5), Duration::from_secs(5))
                        .await
                }
            });
            wait_until(Duration::from_secs(1), "the waiter", || async {
                backend.waiters(lock.key()) == 1
            })
            .await;
            let during = snapshot(&recorder);
            assert_eq!(gauge(&during, "tower_lock_waiters"), 1.0);
            assert_eq!(gauge(&during, "tower_lock_holds"), 1.0);
            first.unlock().await.unwrap();
            let second = waiter.await.unwrap().unwrap();

            // Busy: one attempt while held.
            assert!(lock.try_lock().await.unwrap_err().is_busy());
            second.unlock().await.unwrap();

            // Lost: removed behind a watched holder's back; the watchdog finds out.
            let watched = lock.lock().await.unwrap();
            assert!(lock.force_unlock().await.unwrap());
            tokio::time::timeout(Duration::from_secs(5), watched.lost().wait())
                .await
                .unwrap();
            assert!(matches!(watched.unlock().await, Err(Error::Lost)));

            // The layer: a request for a key another holder keeps is answered busy.
            let layer = LockLayer::builder(
                client.clone(),
                HeaderKey::new(http::HeaderName::from_static("x-order"))
                    .namespace("lock:order")
                    .unwrap(),
            )
            .max_wait(Duration::from_millis(10))
            .build()
            .unwrap();
            let svc = layer.layer(service_fn(|_: Request<Full<Bytes>>| async {
                Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
            }));
            let held = lock.lock().await.unwrap();
            let req = Request::builder()
                .header("x-order", "42")
                .body(Full::new(Bytes::new()))
                .unwrap();
            let res = svc.clone().oneshot(req).await.unwrap();
            assert_eq!(res.status(), tower_lock::layer::DEFAULT_BUSY_STATUS);
            held.unlock().await.unwrap();
            during
        })
    });

    let s = merge(during, snapshot(&recorder));
    // Acquired: first, second (after waiting), watched, held; busy: the try and the
    // layer's request (its wait ran out); held: the four guards.
    let total = |name: &str, extra: &[(&str, &str)]| samples(&s, name, extra);
    assert_eq!(
        total(
            "tower_lock_acquire_wait_seconds",
            &[("outcome", "acquired")]
        ),
        4
    );
    assert_eq!(
        total("tower_lock_acquire_wait_seconds", &[("outcome", "busy")]),
        2
    );
    assert_eq!(total("tower_lock_hold_seconds", &[]), 4);
    assert_eq!(gauge(&s, "tower_lock_holds"), 0.0);
    assert_eq!(gauge(&s, "tower_lock_waiters"), 0.0);
    assert_eq!(counter(&s, "tower_lock_lost_total", &[]), 1);
    let layer_busy = s.get(&(
        "tower_lock_layer_outcomes_total".to_owned(),
        vec![
            ("layer".to_owned(), String::new()),
            ("namespace".to_owned(), "lock:order".to_owned()),
            ("outcome".to_owned(), "busy".to_owned()),
        ],
    ));
    assert!(matches!(layer_busy, Some(DebugValue::Counter(1))), "{s:#?}");
    // No label anywhere holds the key itself.
    for (name, labels) in s.keys() {
        assert!(
            labels.iter().all(|(_, v)| !v.contains("42")),
            "{name} has the key in a label: {labels:?}"
        );
    }
}
