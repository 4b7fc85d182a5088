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

/// Whether `server` is still reading its data back (`INFO persistence`, which Redis
/// answers while loading).
async fn loading(server: &RedisServer) -> bool {
    let info: String = redis::cmd("INFO")
        .arg("persistence")
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
    info.contains("loading:1")
}

/// A Redis restarted with its data answers every command `LOADING` until it has read
/// it all back: seconds for a large dataset. That refusal was taken for a
/// misconfigured store: a lock call failed at once with time left to wait (a layer
/// answered 500, even failing open), and an unlock during it was not tried again, so
/// its hold, read back with the data, outlived the restart for its whole lease. It is
/// now an outage: ridden out within the wait, and the unlock tried again until it
/// lands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_loading_its_data_after_a_restart_is_an_outage() {
    // 1 ms a key, answering between keys: 2,000 keys take 2 s to read back.
    let mut server = RedisServer::start_with(&[
        "--key-load-delay",
        "1000",
        "--loading-process-events-interval-bytes",
        "1024",
    ])
    .await;
    let mut raw = server.conn().await;
    let mut filler = redis::pipe();
    for i in 0..2_000 {
        filler.set(format!("filler:{i}"), i).ignore();
    }
    let () = filler.query_async(&mut raw).await.unwrap();
    let holder = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let other = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let key = LockKey::new("loading").unwrap();
    let held = holder
        .get_lock(&key)
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap();
    let () = redis::cmd("SAVE").query_async(&mut raw).await.unwrap();
    server.restart().await;
    assert!(loading(&server).await, "the server reads its data back");

    let single = other.get_lock(&key).unwrap().try_lock().await.map(drop);
    assert!(
        single.as_ref().is_err_and(Error::is_unavailable),
        "a single try while loading: {single:?}"
    );
    let waiter = {
        let lock = other.get_lock(&key).unwrap();
        tokio::spawn(async move {
            lock.try_lock_for(Duration::from_secs(30), Lease::Watchdog)
                .await
        })
    };
    let unlocked = held.unlock().await;
    assert!(
        unlocked.as_ref().is_err_and(Error::is_unavailable),
        "an unlock while loading: {unlocked:?}"
    );
    assert!(loading(&server).await, "all of this happened while loading");
    // Well before the hold's 60 s lease.
    let guard = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter still waits: the holder's unlock was not tried again")
        .unwrap()
        .expect("the waiter rides out the loading and takes the released lock");
    guard.unlock().await.unwrap();
    assert_eq!(server.keys("loading*").await, Vec::<String>::new());
}

/// With replica acknowledgement each lock script goes in a pipeline with its `WAIT`,
/// where redis-rs names the code only of the errors it knows: `NOREPLICAS`, `OOM` and
/// `BUSY` from a server refusing writes came back as "Pipeline failure" and failed the
/// call as a misconfigured store, not an outage (for exclusive locks, sent one batch at
/// a time, and for fair locks alike). The server here has no replica, so no grant could
/// stand: what is checked is that the refusal itself is what fails the call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_replica_acknowledgement_a_refusal_for_now_is_an_outage_too() {
    for (refusal, code) in [
        (Refusal::NoReplicas, "NOREPLICAS"),
        (Refusal::OutOfMemory, "OOM"),
        (Refusal::Busy, "BUSY"),
    ] {
        let server = RedisServer::start().await;
        let backend = RedisBackend::builder(server.url())
            .synced_replicas(1, Duration::from_millis(100))
            .build()
            .await
            .unwrap();
        let client = LockClient::new(backend);
        refusal.begin(&server).await;
        for lock in [
            client.get_lock("refused-synced").unwrap(),
            client.get_fair_lock("refused-synced-fair").unwrap(),
        ] {
            let single = lock.try_lock().await.map(drop);
            assert!(
                single
                    .as_ref()
                    .is_err_and(|e| e.is_unavailable() && e.to_string().contains(code)),
                "{refusal:?}: a single try: {single:?}"
            );
        }
        refusal.end(&server).await;
    }
}

/// How a test makes a running server refuse lock calls for a while, and ends it.
#[derive(Clone, Copy, Debug)]
enum Refusal {
    /// `min-replicas-to-write 1` without a replica: `NOREPLICAS` for every write.
    NoReplicas,
    /// `maxmemory` below what is used: `OOM` for every write that adds data.
    OutOfMemory,
    /// Another client's script running past `busy-reply-threshold`: `BUSY` for every
    /// command.
    Busy,
}

impl Refusal {
    async fn begin(self, server: &RedisServer) {
        match self {
            Refusal::NoReplicas => config_set(server, "min-replicas-to-write", "1").await,
            Refusal::OutOfMemory => config_set(server, "maxmemory", "1").await,
            Refusal::Busy => {
                config_set(server, "busy-reply-threshold", "100").await;
                let mut runner = server.conn().await;
                tokio::spawn(async move {
                    let _: redis::RedisResult<()> = redis::cmd("EVAL")
                        .arg("while true do end")
                        .arg(0)
                        .query_async(&mut runner)
                        .await;
                });
                wait_until(
                    Duration::from_secs(5),
                    "the server answers BUSY",
                    || async { ping(server).await.is_err_and(|e| e.code() == Some("BUSY")) },
                )
                .await;
            }
        }
    }

    async fn end(self, server: &RedisServer) {
        match self {
            Refusal::NoReplicas => config_set(server, "min-replicas-to-write", "0").await,
            Refusal::OutOfMemory => config_set(server, "maxmemory", "0").await,
            Refusal::Busy => {
                let () = redis::cmd("SCRIPT")
                    .arg("KILL")
                    .query_async(&mut server.conn().await)
                    .await
                    .unwrap();
                // The script stops at its next check, not at once.
                wait_until(Duration::from_secs(5), "the script killed", || async {
                    ping(server).await.is_ok()
                })
                .await;
            }
        }
    }
}

async fn config_set(server: &RedisServer, name: &str, value: &str) {
    let () = redis::cmd("CONFIG")
        .arg("SET")
        .arg(name)
        .arg(value)
        .query_async(&mut server.conn().await)
        .await
        .unwrap();
}

/// The server's answer to a `PING` on a connection of its own.
async fn ping(server: &RedisServer) -> redis::RedisResult<String> {
    redis::cmd("PING")
        .query_async(&mut server.conn().await)
        .await
}

/// A server that refuses writes for a while (no replica for `min-replicas-to-write`,
/// memory full, a script running too long) is an outage, not a misconfigured store:
/// a single try fails as one, a call with time to wait rides it out and takes the
/// lock, and an unlock that met it is tried again until it lands. For the single-key
/// scripts and the batch script alike (eight callers at once make batches).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_refusing_writes_for_a_while_is_an_outage() {
    for refusal in [Refusal::NoReplicas, Refusal::OutOfMemory, Refusal::Busy] {
        let server = RedisServer::start().await;
        let holder = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
        let other = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
        let held = holder
            .get_lock("refused")
            .unwrap()
            .try_lock_for(Duration::ZERO, Duration::from_secs(60))
            .await
            .unwrap();
        refusal.begin(&server).await;

        let single = other
            .get_lock("refused-alone")
            .unwrap()
            .try_lock()
            .await
            .map(drop);
        assert!(
            single.as_ref().is_err_and(Error::is_unavailable),
            "{refusal:?}: a single try: {single:?}"
        );
        let waiters: Vec<_> = (0..8)
            .map(|i| {
                let name = if i == 0 {
                    "refused".to_owned()
                } else {
                    format!("refused-{i}")
                };
                let lock = other.get_lock(&name).unwrap();
                tokio::spawn(async move {
                    lock.try_lock_for(Duration::from_secs(30), Lease::Watchdog)
                        .await
                })
            })
            .collect();
        let unlocked = held.unlock().await;
        // A full memory refuses only what adds data: a release deletes.
        let released = matches!(refusal, Refusal::OutOfMemory);
        let as_expected = match &unlocked {
            Ok(()) => released,
            Err(error) => !released && error.is_unavailable(),
        };
        assert!(as_expected, "{refusal:?}: an unlock: {unlocked:?}");
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            waiters.iter().all(|w| !w.is_finished()),
            "{refusal:?}: a waiter gave up with its wait left"
        );
        refusal.end(&server).await;
        for waiter in waiters {
            let guard = tokio::time::timeout(Duration::from_secs(15), waiter)
                .await
                .unwrap_or_else(|_| panic!("{refusal:?}: a waiter still waits"))
                .unwrap()
                .unwrap_or_else(|e| panic!("{refusal:?}: a waiter failed: {e:?}"));
            guard.unlock().await.unwrap();
        }
        assert_eq!(
            server.keys("*").await,
            Vec::<String>::new(),
            "{refusal:?}: nothing left"
        );
    }
}
