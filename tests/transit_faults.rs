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

use common::redis_server::RedisServer;
use tower_lock::{LockClient, RedisBackend};

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
