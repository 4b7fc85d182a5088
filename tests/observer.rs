//! `LockObserver`: every outcome reaches the hook exactly once.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::{DownBackend, wait_until};
use tower_lock::{Error, Lease, LockClient, LockEvent, LockObserver, MemoryBackend};

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
