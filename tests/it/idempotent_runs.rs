//! `LockClient::idempotent` on every store that keeps results: each rule once, and the
//! queue consumer of `examples/queue_consumer.rs` (two replicas, each message delivered
//! at least twice, handlings cut short at random) checked against the same oracle as
//! the layer's retry storm: per key, at most one kept result, every replay equal to it.

#[path = "../../examples/shared/consumer.rs"]
mod consumer;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Semaphore;
use tower_lock::idempotency::{Done, IdempotentError, Json};
use tower_lock::{Error, LockClient, MemoryBackend};

use super::idempotency::Store;

/// A run that fails, fails to a retry that runs again; one that succeeds is replayed,
/// and a run with another fingerprint is refused.
async fn a_result_is_kept_once_and_replayed_and_a_failure_keeps_nothing(store: &impl Store) {
    let client = store.client().await;
    let runs = AtomicUsize::new(0);
    let work = |fail: bool| {
        let runs = &runs;
        move |_held| async move {
            let n = runs.fetch_add(1, Ordering::SeqCst) + 1;
            if fail {
                Err(format!("attempt {n} failed"))
            } else {
                Ok(format!("result of run {n}"))
            }
        }
    };
    let failed = client
        .idempotent("job:{a}")
        .unwrap()
        .run(b"args", work(true))
        .await;
    assert!(
        matches!(&failed, Err(IdempotentError::Failed(e)) if e == "attempt 1 failed"),
        "{failed:?}"
    );
    let first = client
        .idempotent("job:{a}")
        .unwrap()
        .run(b"args", work(false))
        .await;
    assert_eq!(first.unwrap(), Done::Ran("result of run 2".to_owned()));
    let other = store.client().await;
    let again = other
        .idempotent("job:{a}")
        .unwrap()
        .run(b"args", work(false))
        .await;
    assert_eq!(again.unwrap(), Done::Replayed("result of run 2".to_owned()));
    let mismatch = other
        .idempotent("job:{a}")
        .unwrap()
        .run(b"other args", work(false))
        .await;
    assert!(
        matches!(mismatch, Err(IdempotentError::Mismatch)),
        "{mismatch:?}"
    );
    assert!(!mismatch.unwrap_err().is_retryable());
    assert_eq!(runs.load(Ordering::SeqCst), 2);
}

/// While the first run works: another is `InFlight` at once, or with `max_wait` waits
/// for it and replays its result; the work runs once.
async fn a_run_in_flight_is_refused_or_waited_for(store: &impl Store) {
    let (a, b) = (store.client().await, store.client().await);
    let gate = Arc::new(Semaphore::new(0));
    let started = Arc::new(Semaphore::new(0));
    let first = tokio::spawn({
        let (gate, started) = (Arc::clone(&gate), Arc::clone(&started));
        async move {
            a.idempotent("job:{b}")
                .unwrap()
                .run(b"x", |_held| async move {
                    started.add_permits(1);
                    gate.acquire().await.unwrap().forget();
                    Ok::<_, std::io::Error>(Json(vec![1u32, 2, 3]))
                })
                .await
        }
    });
    started.acquire().await.unwrap().forget();
    let busy = b
        .idempotent("job:{b}")
        .unwrap()
        .run(b"x", |_held| async {
            Ok::<_, std::io::Error>(Json(vec![9u32]))
        })
        .await;
    assert!(matches!(busy, Err(IdempotentError::InFlight)), "{busy:?}");
    assert!(busy.unwrap_err().is_retryable());
    let waiting = tokio::spawn(async move {
        b.idempotent("job:{b}")
            .unwrap()
            .max_wait(Duration::from_secs(20))
            .run(b"x", |_held| async {
                Ok::<_, std::io::Error>(Json(vec![9u32]))
            })
            .await
    });
    gate.add_permits(1);
    assert_eq!(
        first.await.unwrap().unwrap(),
        Done::Ran(Json(vec![1, 2, 3]))
    );
    assert_eq!(
        waiting.await.unwrap().unwrap(),
        Done::Replayed(Json(vec![1, 2, 3]))
    );
}

/// A result over `max_result` is returned, not kept: the next run works again. A
/// result kept as one type and read as another is an error, not a wrong value.
async fn a_result_too_large_is_unkept_and_a_wrong_type_is_an_error(store: &impl Store) {
    let client = store.client().await;
    // Not UTF-8: kept as bytes, it cannot be read back as a `String`.
    let big = |_held| async { Ok::<_, std::io::Error>(vec![0xffu8; 100]) };
    let first = client
        .idempotent("job:{c}")
        .unwrap()
        .max_result(99)
        .run(b"", big)
        .await;
    assert!(
        matches!(first, Ok(Done::Unstored(ref v)) if v.len() == 100),
        "{first:?}"
    );
    let second = client.idempotent("job:{c}").unwrap().run(b"", big).await;
    assert!(matches!(second, Ok(Done::Ran(_))), "{second:?}");
    let as_text = client
        .idempotent("job:{c}")
        .unwrap()
        .run(b"", |_held| async {
            Ok::<_, std::io::Error>(String::new())
        })
        .await;
    assert!(
        matches!(as_text, Err(IdempotentError::Lock(Error::Store(_)))),
        "{as_text:?}"
    );
}

/// The queue consumer: two replicas, every message delivered twice, every run waiting
/// for one in flight. Each message charged exactly once; every delivery gets the one
/// kept receipt.
async fn a_queue_delivering_each_message_twice_charges_each_once(store: &impl Store) {
    let clients = [store.client().await, store.client().await];
    let plan = consumer::Plan {
        messages: 200,
        workers: 8,
        deliveries: 2,
        cut_per_mille: 0,
        max_wait: Duration::from_secs(10),
        seed: 46,
        ttl: Duration::from_secs(60),
        run: "twice".to_owned(),
    };
    let report = consumer::consume(&clients, &plan).await;
    consumer::check(&plan, &report).unwrap();
    assert_eq!(report.failed, 0);
}

/// The same with handlings cut short at every await point at random (15%), and runs
/// that find another in flight put back at once: at most one receipt kept per message,
/// and every replay equal to it. Seeded: a failure names its seed.
async fn cut_short_and_in_flight_deliveries_keep_one_receipt_per_message(store: &impl Store) {
    let clients = [store.client().await, store.client().await];
    for seed in 1..=3 {
        let plan = consumer::Plan {
            messages: 100,
            workers: 8,
            deliveries: 3,
            cut_per_mille: 150,
            max_wait: Duration::ZERO,
            seed,
            ttl: Duration::from_secs(60),
            run: format!("cut-{seed}"),
        };
        let report = consumer::consume(&clients, &plan).await;
        if let Err(e) = consumer::check(&plan, &report) {
            panic!("seed {seed}: {e}");
        }
        assert!(report.redelivered > 0, "seed {seed}: nothing was cut");
    }
}

/// A store that keeps no results (RedLock): every run is a configuration error, and
/// the work never runs.
#[tokio::test]
async fn a_store_without_records_refuses_every_run() {
    let redlock = tower_lock::backend::redlock::RedLock::new(vec![
        MemoryBackend::new(),
        MemoryBackend::new(),
        MemoryBackend::new(),
    ])
    .unwrap();
    let client = LockClient::new(redlock);
    let ran = AtomicUsize::new(0);
    let got = client
        .idempotent("job:{d}")
        .unwrap()
        .run(b"", |_held| async {
            ran.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        })
        .await;
    assert!(
        matches!(got, Err(IdempotentError::Lock(Error::Config(_)))),
        "{got:?}"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 0);
    assert!(client.idempotent("").is_err());
}

/// A run whose lock is lost while it works is cancelled, keeps nothing, and says so;
/// the next run works again.
#[tokio::test(start_paused = true)]
async fn a_run_that_loses_its_lock_is_cancelled_and_keeps_nothing() {
    let backend = MemoryBackend::new();
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(Duration::from_secs(3))
        .build()
        .unwrap();
    let admin = LockClient::new(backend);
    let finished = AtomicUsize::new(0);
    let run = client.idempotent("job:{e}").unwrap();
    let key = run.key().clone();
    let got = tokio::join!(
        run.run(b"", |_held| async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            finished.fetch_add(1, Ordering::SeqCst);
            Ok::<_, std::io::Error>(())
        }),
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let admin = admin.backend().admin().unwrap();
            let mode = tower_lock::backend::LockMode::Exclusive;
            assert!(admin.force_release(&key, mode).await.unwrap());
        }
    )
    .0;
    assert!(
        matches!(got, Err(IdempotentError::Lock(Error::Lost))),
        "{got:?}"
    );
    assert_eq!(
        finished.load(Ordering::SeqCst),
        0,
        "the work was not cancelled"
    );
    let again = client
        .idempotent("job:{e}")
        .unwrap()
        .run(b"", |_held| async { Ok::<_, std::io::Error>(()) })
        .await;
    assert!(matches!(again, Ok(Done::Ran(()))), "{again:?}");
}

macro_rules! idempotent_run_tests {
    ($module:ident, $store:expr) => {
        mod $module {
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_result_is_kept_once_and_replayed_and_a_failure_keeps_nothing() {
                super::a_result_is_kept_once_and_replayed_and_a_failure_keeps_nothing(
                    &$store.await,
                )
                .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_run_in_flight_is_refused_or_waited_for() {
                super::a_run_in_flight_is_refused_or_waited_for(&$store.await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_result_too_large_is_unkept_and_a_wrong_type_is_an_error() {
                super::a_result_too_large_is_unkept_and_a_wrong_type_is_an_error(&$store.await)
                    .await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_queue_delivering_each_message_twice_charges_each_once() {
                super::a_queue_delivering_each_message_twice_charges_each_once(&$store.await).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn cut_short_and_in_flight_deliveries_keep_one_receipt_per_message() {
                super::cut_short_and_in_flight_deliveries_keep_one_receipt_per_message(
                    &$store.await,
                )
                .await;
            }
        }
    };
}

idempotent_run_tests!(memory, super::super::idempotency::memory());
#[cfg(feature = "redis")]
idempotent_run_tests!(redis, super::super::idempotency::redis());
#[cfg(feature = "postgres")]
idempotent_run_tests!(postgres, super::super::idempotency::postgres());
