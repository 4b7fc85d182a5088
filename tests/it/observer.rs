//! `LockObserver`: every outcome reaches the hook exactly once.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{DownBackend, wait_until};
use tower_lock::{
    Error, LayerEvent, LayerOutcome, Lease, LockClient, LockEvent, LockKey, LockObserver,
    MemoryBackend,
};

#[derive(Default)]
struct Counts {
    acquired: AtomicUsize,
    busy: AtomicUsize,
    failed: AtomicUsize,
    released: AtomicUsize,
    lost: AtomicUsize,
    renewal_failed: AtomicUsize,
}

impl Counts {
    fn get(&self) -> [usize; 6] {
        [
            &self.acquired,
            &self.busy,
            &self.failed,
            &self.released,
            &self.lost,
            &self.renewal_failed,
        ]
        .map(|c| c.load(Ordering::SeqCst))
    }
}

impl LockObserver for Counts {
    fn acquired(&self, _: LockEvent<'_>, _: Duration) {
        self.acquired.fetch_add(1, Ordering::SeqCst);
    }
    fn busy(&self, _: LockEvent<'_>, waited: Duration) {
        assert!(waited < Duration::from_secs(10));
        self.busy.fetch_add(1, Ordering::SeqCst);
    }
    fn acquire_failed(&self, _: LockEvent<'_>, error: &Error) {
        assert!(error.is_backend(), "{error}");
        self.failed.fetch_add(1, Ordering::SeqCst);
    }
    fn released(&self, _: LockEvent<'_>, _: Duration) {
        self.released.fetch_add(1, Ordering::SeqCst);
    }
    fn lost(&self, event: LockEvent<'_>) {
        assert!(event.key.as_str().starts_with("obs:"));
        self.lost.fetch_add(1, Ordering::SeqCst);
    }
    fn renewal_failed(&self, _: LockEvent<'_>, _: Option<&Error>) {
        self.renewal_failed.fetch_add(1, Ordering::SeqCst);
    }
}

fn client(backend: MemoryBackend, counts: &Arc<Counts>) -> LockClient {
    LockClient::builder(backend)
        .watchdog_lease(Duration::from_millis(90))
        .observer(counts.clone())
        .redact_keys(true)
        .build()
        .unwrap()
}

#[tokio::test]
async fn acquired_busy_released_and_dropped() {
    let counts = Arc::new(Counts::default());
    let client = client(MemoryBackend::new(), &counts);
    assert!(client.redacts_keys());
    let lock = client.get_lock("obs:a").unwrap();
    let held = lock.lock().await.unwrap();
    let busy = lock
        .try_lock_for(Duration::from_millis(20), Lease::Watchdog)
        .await;
    assert!(matches!(busy, Err(Error::Busy { .. })), "{busy:?}");
    held.unlock().await.unwrap();
    assert_eq!(counts.get(), [1, 1, 0, 1, 0, 0]);

    drop(lock.lock().await.unwrap());
    wait_until(
        Duration::from_secs(5),
        "the dropped guard's release",
        || async { counts.released.load(Ordering::SeqCst) == 2 },
    )
    .await;
    assert_eq!(counts.get(), [2, 1, 0, 2, 0, 0]);
}

#[tokio::test]
async fn a_loss_is_reported_once() {
    let counts = Arc::new(Counts::default());
    let backend = MemoryBackend::new();
    let client = client(backend.clone(), &counts);

    // Watched: the watchdog finds it gone and reports; unlock does not report again.
    let lock = client.get_lock("obs:watched").unwrap();
    let held = lock.lock().await.unwrap();
    assert!(lock.force_unlock().await.unwrap());
    wait_until(
        Duration::from_secs(5),
        "the watchdog reports the loss",
        || async { counts.lost.load(Ordering::SeqCst) == 1 },
    )
    .await;
    assert!(matches!(held.unlock().await, Err(Error::Lost)));

    // Fixed lease that ran out: the unlock reports it.
    let lock = client.get_lock("obs:fixed").unwrap();
    let held = lock
        .try_lock_for(Duration::ZERO, Duration::from_millis(20))
        .await
        .unwrap();
    held.lost().wait().await;
    assert!(matches!(held.unlock().await, Err(Error::Lost)));
    assert_eq!(counts.get(), [2, 0, 0, 0, 2, 0]);
}

#[tokio::test]
async fn backend_failures_are_reported() {
    let counts = Arc::new(Counts::default());
    let client = LockClient::builder(DownBackend)
        .observer(counts.clone())
        .build()
        .unwrap();
    let err = client.get_lock("obs:down").unwrap().try_lock().await;
    assert!(matches!(err, Err(ref e) if e.is_backend()), "{err:?}");
    assert_eq!(counts.get(), [0, 0, 1, 0, 0, 0]);
}

/// Current waits and guards as the paired hooks count them; never negative.
#[derive(Default)]
struct Gauges {
    waiting: std::sync::atomic::AtomicI64,
    holding: std::sync::atomic::AtomicI64,
    unpaired: AtomicUsize,
}

impl LockObserver for Gauges {
    fn acquired(&self, _: LockEvent<'_>, _: Duration) {
        self.holding.fetch_add(1, Ordering::SeqCst);
    }
    fn guard_ended(&self, _: LockEvent<'_>, _: Duration) {
        if self.holding.fetch_sub(1, Ordering::SeqCst) <= 0 {
            self.unpaired.fetch_add(1, Ordering::SeqCst);
        }
    }
    fn wait_started(&self, _: LockEvent<'_>) {
        self.waiting.fetch_add(1, Ordering::SeqCst);
    }
    fn wait_ended(&self, _: LockEvent<'_>, _: Duration) {
        if self.waiting.fetch_sub(1, Ordering::SeqCst) <= 0 {
            self.unpaired.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Seeded histories of waits cut short, cancelled acquisitions, re-entries (some of
/// which must renew first), unlocks and drops: the start/end hooks stay paired, so
/// gauges built on them return to zero.
#[tokio::test(start_paused = true)]
async fn wait_and_hold_hooks_stay_paired_under_cancellation() {
    for seed in 0..40u64 {
        let gauges = Arc::new(Gauges::default());
        let client = LockClient::builder(MemoryBackend::new())
            .observer(gauges.clone())
            .watchdog_lease(Duration::from_millis(90))
            .build()
            .unwrap();
        let mut tasks = Vec::new();
        for t in 0..6u64 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                let mut rng = fastrand::Rng::with_seed(seed * 100 + t);
                let owner = client.new_owner();
                let mut guards = Vec::new();
                for _ in 0..30 {
                    let lock = client
                        .get_lock(format!("pair:{}", rng.u8(0..2)))
                        .unwrap()
                        .with_owner(owner.clone());
                    match rng.u8(0..5) {
                        // A wait cut short by cancellation at a random point.
                        0 => {
                            let cut = Duration::from_millis(rng.u64(0..30));
                            if let Ok(Ok(g)) = tokio::time::timeout(
                                cut,
                                lock.try_lock_for(Duration::from_millis(50), Lease::Watchdog),
                            )
                            .await
                            {
                                guards.push(g);
                            }
                        }
                        // A bounded wait with a fixed lease (a re-entry may renew).
                        1 | 2 => {
                            let lease = Duration::from_millis(rng.u64(20..200));
                            if let Ok(g) = lock.try_lock_for(Duration::from_millis(20), lease).await
                            {
                                guards.push(g);
                            }
                        }
                        3 if !guards.is_empty() => {
                            let g = guards.swap_remove(rng.usize(0..guards.len()));
                            let _ = g.unlock().await;
                        }
                        _ if !guards.is_empty() => {
                            drop(guards.swap_remove(rng.usize(0..guards.len())));
                        }
                        _ => {}
                    }
                    tokio::time::sleep(Duration::from_millis(rng.u64(0..5))).await;
                }
                drop(guards);
            }));
        }
        for task in tasks {
            task.await.unwrap();
        }
        assert_eq!(gauges.unpaired.load(Ordering::SeqCst), 0, "seed {seed}");
        assert_eq!(gauges.waiting.load(Ordering::SeqCst), 0, "seed {seed}");
        assert_eq!(gauges.holding.load(Ordering::SeqCst), 0, "seed {seed}");
    }
}

/// The layer outcomes an observer heard, in order: the layer's name, the key's namespace
/// and the outcome.
#[derive(Default)]
struct Outcomes(std::sync::Mutex<Vec<(String, String, LayerOutcome)>>);

impl Outcomes {
    fn take(&self) -> Vec<(String, String, LayerOutcome)> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }

    /// Only the outcomes.
    fn take_outcomes(&self) -> Vec<LayerOutcome> {
        self.take().into_iter().map(|(_, _, o)| o).collect()
    }
}

impl LockObserver for Outcomes {
    fn layer_outcome(&self, event: LayerEvent<'_>, outcome: LayerOutcome) {
        let namespace = event.key.map_or("", |k| k.namespace());
        self.0
            .lock()
            .unwrap()
            .push((event.layer.to_owned(), namespace.to_owned(), outcome));
    }
}

/// Regression (issue 24, item 3): an `ExtensionKey` whose extension no middleware set is
/// the server's wiring mistake (a 500), and was counted as `bad_key`, the series of a
/// client's 400s. It is `misconfigured`; a client's bad header stays `bad_key`.
#[tokio::test]
async fn a_missing_extension_counts_as_misconfigured_not_bad_key() {
    use http::{Request, StatusCode};
    use tower::{Layer, ServiceExt, service_fn};
    use tower_lock::layer::{ExtensionKey, HeaderKey, LockLayer};

    #[derive(Clone)]
    struct User(u64);

    let outcomes = Arc::new(Outcomes::default());
    let client = LockClient::builder(MemoryBackend::new())
        .observer(outcomes.clone())
        .build()
        .unwrap();
    let ok = service_fn(|_: Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });

    let by_user = LockLayer::new(
        client.clone(),
        ExtensionKey::new(|u: &User| u.0.to_string()),
    );
    let res = by_user.layer(ok).oneshot(Request::new(())).await.unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(outcomes.take_outcomes(), [LayerOutcome::Misconfigured]);

    let by_header = LockLayer::new(
        client,
        HeaderKey::new(http::HeaderName::from_static("x-user-id")),
    );
    let res = by_header.layer(ok).oneshot(Request::new(())).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert_eq!(outcomes.take_outcomes(), [LayerOutcome::BadKey]);
}

/// Every request the layer locks is reported once, under the layer's name (set, or its
/// key prefix by default): served under its lock, busy, unavailable, served without it
/// (fail-open), lost. Requests it passes through unlocked are not reported.
#[tokio::test]
async fn every_locked_request_is_reported_once_under_the_layers_name() {
    use http::{Method, Request, StatusCode};
    use tower::{Layer, ServiceExt, service_fn};
    use tower_lock::layer::{LockLayer, key_fn};

    let outcomes = Arc::new(Outcomes::default());
    let backend = MemoryBackend::new();
    let client = LockClient::builder(backend.clone())
        .observer(outcomes.clone())
        .build()
        .unwrap();
    let ok = service_fn(|_: Request<()>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });
    // `/a/1` → `a:{1}`
    let by_path = || {
        key_fn(|p: &http::request::Parts| {
            let (ns, id) = p.uri.path()[1..].split_once('/').unwrap();
            LockKey::namespaced(ns, id)
        })
    };
    let get = |path: &str| Request::get(path).body(()).unwrap();

    // Named by its key prefix: served, then busy while another holder has the key.
    let orders = LockLayer::builder(client.clone(), by_path())
        .key_prefix("lock:order")
        .methods([Method::GET])
        .max_wait(Duration::ZERO)
        .build()
        .unwrap();
    let svc = orders.layer(ok);
    assert_eq!(
        svc.clone().oneshot(get("/o/1")).await.unwrap().status(),
        StatusCode::OK
    );
    let held = client
        .get_lock("lock:order:o:{1}")
        .unwrap()
        .lock()
        .await
        .unwrap();
    let res = svc.clone().oneshot(get("/o/1")).await.unwrap();
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    held.unlock().await.unwrap();
    // Not locked (another method): not reported.
    let post = Request::post("/o/1").body(()).unwrap();
    assert_eq!(svc.oneshot(post).await.unwrap().status(), StatusCode::OK);
    let prefixed = |o| ("lock:order".to_owned(), "lock:order:o".to_owned(), o);
    assert_eq!(
        outcomes.take(),
        [prefixed(LayerOutcome::Served), prefixed(LayerOutcome::Busy)]
    );

    // Named: the store down, closed and open.
    for (fail_open, outcome, status) in [
        (
            false,
            LayerOutcome::Unavailable,
            StatusCode::SERVICE_UNAVAILABLE,
        ),
        (true, LayerOutcome::FailOpen, StatusCode::OK),
    ] {
        let down = LockClient::builder(DownBackend)
            .observer(outcomes.clone())
            .build()
            .unwrap();
        let layer = LockLayer::builder(down, by_path())
            .name("payments")
            .fail_open(fail_open)
            .build()
            .unwrap();
        let res = layer.layer(ok).oneshot(get("/pay/7")).await.unwrap();
        assert_eq!(res.status(), status);
        assert_eq!(
            outcomes.take(),
            [("payments".to_owned(), "pay".to_owned(), outcome)]
        );
    }

    // Unnamed and unprefixed: "". A lock lost while the handler runs.
    let slow = service_fn(|_: Request<()>| async {
        tokio::time::sleep(Duration::from_secs(5)).await;
        Ok::<_, std::convert::Infallible>(http::Response::new(String::new()))
    });
    let short = LockLayer::builder(client.clone(), by_path())
        .lease(Duration::from_millis(50))
        .build()
        .unwrap();
    let res = short.layer(slow).oneshot(get("/slow/1")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        outcomes.take(),
        [(String::new(), "slow".to_owned(), LayerOutcome::Lost)]
    );
    assert!(backend.is_empty());
}
