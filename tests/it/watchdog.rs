//! The watchdog keeps renewing whatever happens around it: the runtime it first ran on
//! shuts down, or a user's observer panics.

use std::time::Duration;
use tower_lock::backend::StoreAdmin as _;

use tokio::time::Instant;
use tower_lock::backend::{LockBackend, LockMode};
use tower_lock::{LockClient, LockEvent, LockKey, LockObserver, MemoryBackend};

/// The watchdog lease: renewed every 300 ms. The test across runtimes runs in real time
/// on a machine that may be loaded: a renewal may be late by most of 600 ms.
const LEASE: Duration = Duration::from_millis(900);

/// Holds the lock for `hold` and checks nobody else can take it meanwhile.
async fn held_throughout(client: &LockClient, other: &LockClient, key: &str, hold: Duration) {
    let guard = client.get_lock(key).unwrap().lock().await.unwrap();
    let until = Instant::now() + hold;
    while Instant::now() < until {
        let intruder = other.get_lock(key).unwrap().try_lock().await;
        assert!(
            intruder.is_err(),
            "the watchdog stopped renewing: {key} was taken"
        );
        assert!(!guard.is_lost());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    guard.unlock().await.unwrap();
}

#[test]
fn renewals_continue_after_the_first_runtime_is_gone() {
    let backend = MemoryBackend::new();
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(LEASE)
        .build()
        .unwrap();
    // First used on a runtime that then shuts down, taking the watchdog task with it.
    let first = tokio::runtime::Runtime::new().unwrap();
    first.block_on(async {
        let g = client.get_lock("first").unwrap().lock().await.unwrap();
        g.unlock().await.unwrap();
        // Keep one watched lock so the task is alive when the runtime goes.
        std::mem::forget(client.get_lock("kept").unwrap().lock().await.unwrap());
    });
    drop(first);

    let second = tokio::runtime::Runtime::new().unwrap();
    second.block_on(async {
        let other = LockClient::new(backend.clone());
        held_throughout(&client, &other, "second", Duration::from_secs(1)).await;
    });
}

struct Panicky;

impl LockObserver for Panicky {
    fn lost(&self, _: LockEvent<'_>) {
        panic!("an observer with a bug");
    }
}

#[tokio::test(start_paused = true)]
async fn a_panicking_observer_does_not_stop_renewals() {
    let backend = MemoryBackend::new();
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(LEASE)
        .observer(Panicky)
        .build()
        .unwrap();
    let other = LockClient::new(backend.clone());
    let doomed = client.get_lock("doomed").unwrap().lock().await.unwrap();
    // Removed behind its back: the watchdog finds it lost and tells the observer, which
    // panics.
    assert!(
        backend
            .force_release(&LockKey::new("doomed").unwrap(), LockMode::Exclusive)
            .await
            .unwrap()
    );
    tokio::time::timeout(Duration::from_secs(2), doomed.lost().wait())
        .await
        .expect("the loss was found");
    held_throughout(&client, &other, "after-panic", Duration::from_secs(1)).await;
}

/// `with_lock` stops the work as soon as the watchdog finds the lock gone (removed
/// behind the holder's back), returns `Error::Lost`, and leaves the key to others.
#[tokio::test(start_paused = true)]
async fn with_lock_drops_the_work_when_the_lock_is_lost() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    let backend = MemoryBackend::new();
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(LEASE)
        .build()
        .unwrap();
    let steps = Arc::new(AtomicU32::new(0));
    let counted = Arc::clone(&steps);
    let saboteur = backend.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let key = LockKey::new("job:lost").unwrap();
        assert!(
            saboteur
                .force_release(&key, LockMode::Exclusive)
                .await
                .unwrap()
        );
    });
    let started = Instant::now();
    let outcome = client
        .with_lock("job:lost", |held| async move {
            assert!(!held.lost().is_lost());
            loop {
                counted.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    assert!(
        matches!(outcome, Err(tower_lock::Error::Lost)),
        "{outcome:?}"
    );
    // Found at the first renewal after the removal: a third of the lease.
    assert!(started.elapsed() <= LEASE / 3 + Duration::from_millis(20));
    let at_loss = steps.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(steps.load(Ordering::Relaxed), at_loss, "the work went on");
    assert_eq!(client.watched_locks(), 0);
}

/// `with_lock` unlocks after the work, returning its value; an error inside the work is
/// the work's own value, and the lock is released all the same.
#[tokio::test(start_paused = true)]
async fn with_lock_unlocks_after_the_work() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let lock = client.get_lock("job:done").unwrap();
    let value: Result<u32, &str> = lock
        .with_lock(|held| async move {
            assert_eq!(held.key().as_str(), "job:done");
            Err("the work failed")
        })
        .await
        .unwrap();
    assert_eq!(value, Err("the work failed"));
    assert!(!backend.contains_key(lock.key()));
    let busy = client.get_lock("job:done").unwrap().lock().await.unwrap();
    let err = lock
        .with_lock_for(
            Duration::from_millis(50),
            Duration::from_secs(1),
            |_| async {},
        )
        .await
        .unwrap_err();
    assert!(err.is_busy(), "{err:?}");
    busy.unlock().await.unwrap();
}

/// Regression (issue 24, item 10): the watchdog's "lock lost" line named the logical
/// owner (`…:68`) while the store shows the hold (`…:69`), so an operator could not
/// match the two. It names the hold as the store shows it.
#[tokio::test(flavor = "current_thread", start_paused = true)]
async fn a_lost_lock_is_logged_with_the_hold_id_the_store_shows() {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    /// Collects the fields of the watchdog's error events.
    struct Errors(Arc<Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Errors {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if *event.metadata().level() == tracing::Level::ERROR {
                let mut text = String::new();
                event.record(
                    &mut |field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
                        text.push_str(&format!("{}={value:?} ", field.name()));
                    },
                );
                self.0.lock().unwrap().push(text);
            }
        }
    }

    let seen = Arc::new(Mutex::new(Vec::new()));
    crate::common::log_capture_sees_every_callsite();
    let _default = tracing::subscriber::set_default(
        tracing_subscriber::registry().with(Errors(Arc::clone(&seen))),
    );
    let backend = MemoryBackend::new();
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(LEASE)
        .build()
        .unwrap();
    let owner = client.new_owner();
    let guard = client
        .get_lock("job:logged")
        .unwrap()
        .with_owner(owner.clone())
        .lock()
        .await
        .unwrap();
    assert_ne!(guard.hold_id().as_str(), owner.as_str());
    let key = LockKey::new("job:logged").unwrap();
    assert!(
        backend
            .force_release(&key, LockMode::Exclusive)
            .await
            .unwrap()
    );
    guard.lost().wait().await;
    let seen = seen.lock().unwrap();
    let line = seen
        .iter()
        .find(|line| line.contains("lock lost"))
        .unwrap_or_else(|| panic!("no loss logged: {seen:#?}"));
    assert!(
        line.contains(&format!("hold_id={}", guard.hold_id())),
        "{line}"
    );
}

/// Counts the holds each renewal call of the watchdog renews, by key.
#[derive(Clone, Default)]
struct Renewals(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>);

impl Renewals {
    fn of(&self, key: &str) -> usize {
        self.0.lock().unwrap().get(key).copied().unwrap_or(0)
    }
}

impl tower_lock::backend::Intercept<MemoryBackend> for Renewals {
    fn renew_many<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        reqs: &'a [tower_lock::backend::LockRequest],
    ) -> tower_lock::backend::BoxFuture<'a, Vec<tower_lock::Result<bool>>> {
        for req in reqs {
            *self
                .0
                .lock()
                .unwrap()
                .entry(req.key.to_string())
                .or_default() += 1;
        }
        inner.renew_many(reqs)
    }
}

/// Issue 44, finding 7: a request's lock had the client's 30 s watchdog lease, so a
/// replica killed while holding one kept that user out for half a minute. A lock may
/// now be renewed with a lease of its own (`Lease::Renewed`, the layers' default at
/// 10 s): it is renewed every third of its lease, and a hold with the client's longer
/// lease beside it is still renewed every third of that, not at the shorter pace.
#[tokio::test(start_paused = true)]
async fn each_hold_is_renewed_at_the_pace_of_its_own_lease() {
    let renewals = Renewals::default();
    let backend = tower_lock::backend::Intercepted::new(MemoryBackend::new(), renewals.clone());
    let client = LockClient::new(backend.clone());
    let long = client.get_lock("long").unwrap().lock().await.unwrap();
    let short = client
        .get_lock("short")
        .unwrap()
        .try_lock_for(
            Duration::ZERO,
            tower_lock::Lease::Renewed(Duration::from_secs(9)),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert!(!long.is_lost() && !short.is_lost());
    // 60 s: the 9 s lease every 3 s, the 30 s one once a third of it has passed, at
    // the next tick: every 12 s.
    assert!(
        (4..=6).contains(&renewals.of("long")),
        "{}",
        renewals.of("long")
    );
    assert!(
        (19..=20).contains(&renewals.of("short")),
        "{}",
        renewals.of("short")
    );
    let state = client.get_lock("short").unwrap().inspect().await.unwrap();
    let left = state.holders[0].ttl.unwrap();
    assert!(
        left <= Duration::from_secs(9),
        "the store keeps 9 s at most: {left:?}"
    );
    short.unlock().await.unwrap();
    long.unlock().await.unwrap();
}

/// The same hold given up with its runtime, as a killed replica gives up its holds:
/// another client gets the lock within the hold's own lease (here 10 s), not the
/// client's watchdog lease.
#[test]
fn a_hold_whose_process_is_gone_is_free_within_its_own_lease() {
    let backend = MemoryBackend::new();
    let dying = LockClient::new(backend.clone());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let guard = dying
            .get_lock("request")
            .unwrap()
            .try_lock_for(
                Duration::ZERO,
                tower_lock::Lease::Renewed(Duration::from_secs(10)),
            )
            .await
            .unwrap();
        std::mem::forget(guard);
    });
    drop(runtime); // its watchdog task with it
    let other = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap();
    other.block_on(async {
        let started = Instant::now();
        let guard = LockClient::new(backend)
            .get_lock("request")
            .unwrap()
            .try_lock_for(Duration::from_secs(60), tower_lock::Lease::Watchdog)
            .await
            .unwrap();
        assert!(
            started.elapsed() <= Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
        guard.unlock().await.unwrap();
    });
}

/// A layer's locks take the request lease by default: 10 s in the store, not the
/// client's 30 s; and the client's when that is shorter.
#[cfg(feature = "axum")]
#[tokio::test]
async fn a_layers_locks_have_the_request_lease_by_default() {
    use bytes::Bytes;
    use http_body_util::Empty;
    use tower::{Layer, ServiceExt, service_fn};
    use tower_lock::layer::{DEFAULT_REQUEST_LEASE, HeaderKey, LockLayer};
    for (client_lease, expected) in [
        (Duration::from_secs(30), DEFAULT_REQUEST_LEASE),
        (Duration::from_secs(4), Duration::from_secs(4)),
    ] {
        let client = LockClient::builder(MemoryBackend::new())
            .watchdog_lease(client_lease)
            .build()
            .unwrap();
        let layer = LockLayer::new(
            client.clone(),
            HeaderKey::new(http::header::HeaderName::from_static("x-user"))
                .namespace("user")
                .unwrap(),
        );
        let inner = client.clone();
        let seen = std::sync::Arc::new(std::sync::Mutex::new(None));
        let ttl_seen = seen.clone();
        let svc = layer.layer(service_fn(move |_req: http::Request<Empty<Bytes>>| {
            let (client, seen) = (inner.clone(), ttl_seen.clone());
            async move {
                let key = LockKey::namespaced("user", "u").unwrap();
                let state = client.get_lock(&key).unwrap().inspect().await.unwrap();
                *seen.lock().unwrap() = state.holders[0].ttl;
                Ok::<_, std::convert::Infallible>(http::Response::new(Empty::<Bytes>::new()))
            }
        }));
        let req = http::Request::builder()
            .header("x-user", "u")
            .body(Empty::<Bytes>::new())
            .unwrap();
        svc.oneshot(req).await.unwrap();
        let ttl = seen.lock().unwrap().take().unwrap();
        assert!(
            ttl <= expected && ttl > expected - Duration::from_secs(1),
            "{client_lease:?}: {ttl:?}"
        );
    }
}
