//! Server faults: redis-server restarted empty under held locks and waiting waiters, and
//! a frozen server. Each test owns its server.

use crate::common;

use std::time::Duration;

use common::redis_server::{FreezableProxy, RedisServer};
use common::wait_until;
use tokio::time::Instant;
use tower_lock::{Error, Lease, LockClient, LockKey, RedisBackend, StoreErrorKind};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_under_held_locks_and_waiters() {
    let mut server = RedisServer::start().await;
    let holder_backend = RedisBackend::connect(server.url()).await.unwrap();
    let waiter_backend = RedisBackend::connect(server.url()).await.unwrap();
    let lease = Duration::from_millis(900);
    let holder_client = LockClient::builder(holder_backend)
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let waiter_client = LockClient::new(waiter_backend.clone());
    let key = LockKey::new("restart").unwrap();
    let held = holder_client.get_lock(&key).unwrap().lock().await.unwrap();

    let wait = Duration::from_secs(3);
    let started = Instant::now();
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let lock = waiter_client.get_lock(&key).unwrap();
        waiters.push(tokio::spawn(async move {
            let outcome = lock.try_lock_for(wait, Lease::Watchdog).await;
            (Instant::now(), outcome.map(drop))
        }));
    }
    wait_until(Duration::from_secs(5), "three waiters", || async {
        waiter_backend.local_waiters(&key) == 3
    })
    .await;

    server.restart().await;
    let restarted_at = Instant::now();

    // No waiter hangs past its deadline, and none fails with most of its wait left: each
    // rides out the restart and gets the lock, which came back free (each drops it at
    // once for the next).
    for w in waiters {
        let (done_at, outcome) = w.await.unwrap();
        assert!(
            done_at.duration_since(started) < wait + Duration::from_secs(1),
            "a waiter hung: {:?} ({outcome:?})",
            done_at.duration_since(started)
        );
        assert!(
            outcome.is_ok(),
            "a waiter failed on the restart: {outcome:?}"
        );
    }

    // The holder learns its lock is gone (the server came back empty).
    tokio::time::timeout(lease + Duration::from_secs(2), held.lost().wait())
        .await
        .expect("the holder's lost signal fired after the restart");
    assert!(restarted_at.elapsed() < lease + Duration::from_secs(2));
    assert!(held.unlock().await.is_err());

    // Clients reconnect by themselves and new locks work.
    let fresh = waiter_client.get_lock("after-restart").unwrap();
    wait_until(
        Duration::from_secs(5),
        "a new lock after the restart",
        || async {
            match fresh.try_lock().await {
                Ok(g) => g.unlock().await.is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;

    // Wake-ups work again: the pub/sub connection resubscribed.
    let guard = holder_client
        .get_lock("wake-after")
        .unwrap()
        .lock()
        .await
        .unwrap();
    let lock = waiter_client.get_lock("wake-after").unwrap();
    let waiter = common::spawn_acquire(lock, Duration::from_secs(20));
    let after = LockKey::new("wake-after").unwrap();
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        waiter_backend.local_waiters(&after) == 1
    })
    .await;
    let released_at = Instant::now();
    guard.unlock().await.unwrap();
    let (acquired_at, g) = waiter.await.unwrap().unwrap();
    assert!(
        acquired_at.duration_since(released_at) < Duration::from_secs(2),
        "a release after the restart did not wake the waiter"
    );
    g.unlock().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frozen_server_times_out_with_a_retryable_error_then_recovers() {
    let server = RedisServer::start().await;
    let backend = RedisBackend::builder(server.url())
        .response_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    let lock = client.get_lock("frozen").unwrap();
    lock.try_lock().await.unwrap().unlock().await.unwrap();

    server.pause();
    let started = Instant::now();
    let err = lock.try_lock().await.unwrap_err();
    let took = started.elapsed();
    server.resume();
    assert!(
        matches!(&err, Error::Store(e) if e.downcast_ref::<redis::RedisError>().is_some()),
        "{err:?}"
    );
    assert_eq!(
        err.store_kind(),
        Some(StoreErrorKind::Unavailable),
        "{err:?}"
    );
    assert!(err.is_retryable(), "{err:?}");
    assert!(err.is_backend());
    assert!(
        took < Duration::from_secs(3),
        "a frozen server stalled the caller {took:?}"
    );

    wait_until(
        Duration::from_secs(5),
        "the lock works after the server thaws",
        || async {
            match lock.try_lock().await {
                Ok(g) => g.unlock().await.is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;
}

/// The pub/sub connection dies without a word (frozen by a proxy, as a partition or a NAT
/// would): the keepalive notices, a new connection is made, and a waiter hears the next
/// release instead of sleeping out the holder's 30 s lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silently_dead_pubsub_connection_is_replaced() {
    let server = RedisServer::start().await;
    let proxy = FreezableProxy::start(server.port()).await;
    let waiter_backend = RedisBackend::builder(proxy.url())
        .pubsub_keepalive(Duration::from_millis(200))
        .response_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let waiter_client = LockClient::new(waiter_backend.clone());
    let holder_client = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let key = LockKey::new("silent-death").unwrap();
    let held = holder_client.get_lock(&key).unwrap().lock().await.unwrap();
    let lock = waiter_client.get_lock(&key).unwrap();
    let waiter = common::spawn_acquire(lock, Duration::from_secs(20));
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        waiter_backend.local_waiters(&key) == 1
    })
    .await;
    proxy.freeze_existing();
    // The release's message goes into the frozen connection and is never seen; only a
    // new pub/sub connection (made after the keepalive gives up) and its wake-up of every
    // waiter get the waiter going again.
    let released_at = Instant::now();
    held.unlock().await.unwrap();
    let (acquired_at, g) = waiter.await.unwrap().unwrap();
    let took = acquired_at.duration_since(released_at);
    assert!(
        took < Duration::from_secs(5),
        "the waiter slept through a dead connection: {took:?}"
    );
    g.unlock().await.unwrap();
}

/// A `SUBSCRIBE` the server gets late (a slow link on the pub/sub connection): the waiter
/// stops waiting for the confirmation after a second and tries again the moment the
/// confirmation comes, so a release published before the server had the subscription is
/// not slept through until the holder's 30 s lease ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_before_a_late_subscribe_is_confirmed_is_not_slept_through() {
    let server = RedisServer::start().await;
    let proxy = FreezableProxy::start(server.port()).await;
    let waiter_backend = RedisBackend::connect(proxy.url()).await.unwrap();
    // Connection 0 carries the commands; connection 1, made by the pub/sub task, the
    // subscriptions.
    wait_until(
        Duration::from_secs(5),
        "the pub/sub connection is up",
        || async { proxy.connections() == 2 },
    )
    .await;
    proxy.slow_requests_of(1, Duration::from_millis(1500));
    let waiter_client = LockClient::new(waiter_backend.clone());
    let holder_client = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let key = LockKey::new("late-subscribe").unwrap();
    let held = holder_client.get_lock(&key).unwrap().lock().await.unwrap();
    let started = Instant::now();
    let waiter = common::spawn_acquire(
        waiter_client.get_lock(&key).unwrap(),
        Duration::from_secs(10),
    );
    // The waiter gave up waiting for the confirmation (1 s) and sleeps; its SUBSCRIBE
    // reaches the server only at 1.5 s. Released in between, the message has no
    // subscriber.
    tokio::time::sleep_until(started + Duration::from_millis(1200)).await;
    held.unlock().await.unwrap();
    let (acquired_at, g) = waiter
        .await
        .unwrap()
        .expect("the waiter tried again once its subscription was confirmed");
    let took = acquired_at.duration_since(started);
    assert!(took < Duration::from_secs(4), "took {took:?}");
    g.unlock().await.unwrap();
}
