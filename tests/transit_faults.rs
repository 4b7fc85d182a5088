//! Faults in transit (issue 20): a write delayed past its timeout, a connection cut, a
//! store restarted under an idle connection, a future parked forever. Each test is a
//! sequence an independent review reproduced against real servers, written before its
//! fix and seen failing; each asserts what the client and the store must see.
//!
//! The store is always a real `redis-server` of the test's own (and, where a write
//! must arrive late, a [`FaultProxy`](common::proxy::FaultProxy) between it and the
//! client). Real time, with margins.
#![cfg(feature = "redis")]

mod common;

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use common::proxy::{Direction, FaultProxy, Flow};
use common::redis_server::RedisServer;
use tokio::time::Instant;
use tower_lock::{Lease, LockClient, LockKey, RedisBackend};

/// Polls `fut` exactly once, with the task's real waker, and leaves it pending: a
/// future someone holds on to and never polls again (a lost `select!` branch, a future
/// kept in a struct).
async fn poll_once<F: Future>(fut: std::pin::Pin<&mut F>) -> bool {
    let mut fut = Some(fut);
    std::future::poll_fn(|cx| {
        let ready = fut.take().is_some_and(|f| f.poll(cx).is_ready());
        Poll::Ready(ready)
    })
    .await
}

/// Sequence 5: one `lock()` future polled once and then parked — neither polled nor
/// dropped — froze every exclusive lock and unlock of its backend: it was sending its
/// operation itself, and the batcher waited for it to finish. Now a task sends every
/// operation, and the parked future costs only itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_lock_future_never_freezes_other_locks_redis() {
    let server = RedisServer::start().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let client = LockClient::new(backend);
    let parked_lock = client.get_lock("parked").unwrap();
    let mut parked = pin!(parked_lock.lock());
    assert!(
        !poll_once(parked.as_mut()).await,
        "a lock over the network is not taken in one poll"
    );

    // Unrelated locks and unlocks go on, promptly.
    for i in 0..20 {
        let lock = client.get_lock(format!("other:{i}")).unwrap();
        let guard = tokio::time::timeout(Duration::from_secs(5), lock.try_lock())
            .await
            .expect("an unrelated try_lock never returned: the parked future froze the backend")
            .unwrap();
        tokio::time::timeout(Duration::from_secs(5), guard.unlock())
            .await
            .expect("an unrelated unlock never returned")
            .unwrap();
    }
    assert_eq!(
        server.keys("other:*").await,
        Vec::<String>::new(),
        "released locks stayed in Redis"
    );
}

/// Sequence 7: after a Redis restart, the first locked request on each replica failed:
/// its command connection had died while idle, and the first command over it failed
/// fast, even with time left to wait. Now the lock core tries once more (as a new hold)
/// when the connection broke under the attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_lock_after_a_store_restart_succeeds_redis() {
    let mut server = RedisServer::start().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let client = LockClient::new(backend);
    let key = LockKey::new("after-restart").unwrap();
    // The command connection is up and idle.
    client
        .get_lock(&key)
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();

    server.restart().await;

    // A wait with time left, as a layer with `max_wait(2s)` takes it...
    let guard = client
        .get_lock(&key)
        .unwrap()
        .try_lock_for(Duration::from_secs(2), Lease::Watchdog)
        .await
        .expect("the first lock after the restart failed");
    guard.unlock().await.unwrap();

    // ...and a single try, on a second backend whose connection is just as stale.
    server.restart().await;
    let other = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    server.restart().await;
    let guard = other
        .get_lock(&key)
        .unwrap()
        .try_lock()
        .await
        .expect("the first try_lock after the restart failed");
    guard.unlock().await.unwrap();
    assert_eq!(server.keys("*").await, Vec::<String>::new());
}

/// Found by the history checker's nemesis (`nemesis_redis`): an attempt on a short-lived
/// runtime timed out, so the backend replaced its command connection — from that
/// runtime, which then owned the replacement's connecting and its timers. The runtime
/// shut down while the replacement was still connecting (new connections were refused,
/// so it was backing off), and from then on every command of the backend, on every
/// runtime, panicked ("inner future panicked during poll"): a poisoned connection that
/// nothing ever replaced, and a panic out of `unlock()`.
#[test]
fn a_runtime_that_ends_never_breaks_the_redis_connection_for_others() {
    let a = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let (server, proxy, client) = a.block_on(async {
        let server = RedisServer::start().await;
        let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
        let backend = RedisBackend::builder(format!("redis://127.0.0.1:{}", proxy.port()))
            .response_timeout(Duration::from_millis(200))
            .build()
            .await
            .unwrap();
        (server, proxy, LockClient::new(backend))
    });
    let key = LockKey::new("short-lived-runtime").unwrap();
    // Answers stop coming, and new connections are turned away.
    proxy.set_flow(Direction::Down, Flow::Hold);
    proxy.refuse(true);
    let lock = client.get_lock(&key).unwrap();
    std::thread::spawn(move || {
        let b = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        b.block_on(async {
            let timed_out = lock.try_lock().await;
            assert!(timed_out.is_err(), "{timed_out:?}");
            // The replacement connection is trying to connect, from this runtime.
            tokio::time::sleep(Duration::from_millis(30)).await;
        });
        drop(b);
    })
    .join()
    .unwrap();
    proxy.refuse(false);
    proxy.set_flow(Direction::Down, Flow::Pass);

    // The other runtime's locks and unlocks work again, promptly.
    a.block_on(async {
        let other = LockKey::new("after-the-runtime-ended").unwrap();
        let lock = client.get_lock(&other).unwrap();
        let guard = tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                match lock.try_lock().await {
                    Ok(guard) => return guard,
                    Err(e) if Instant::now() < deadline => {
                        tracing::debug!(%e, "not yet");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                    Err(e) => panic!("no lock within 5 s after the runtime ended: {e}"),
                }
            }
        })
        .await
        .expect("a lock after the short-lived runtime ended panicked");
        tokio::spawn(guard.unlock())
            .await
            .expect("an unlock after the short-lived runtime ended panicked")
            .unwrap();
        assert_eq!(
            server.keys("after-the-runtime-ended*").await,
            Vec::<String>::new()
        );
    });
    drop(proxy);
}
