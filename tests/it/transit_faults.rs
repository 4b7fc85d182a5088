//! Faults in transit (issue 20): a write delayed past its timeout, a connection cut, a
//! store restarted under an idle connection, a future parked forever. Each test is a
//! sequence an independent review reproduced against real servers, written before its
//! fix and seen failing; each asserts what the client and the store must see.
//!
//! The store is always a real `redis-server` of the test's own (and, where a write
//! must arrive late, a [`FaultProxy`](common::proxy::FaultProxy) between it and the
//! client). Real time, with margins.

use crate::common;

use std::future::Future;
use std::pin::pin;
use std::task::Poll;
use std::time::Duration;

use common::proxy::{Direction, FaultProxy, Flow, Trap};
use common::redis_server::RedisServer;
use common::wait_until;
use tokio::time::Instant;
use tower_lock::backend::{
    Acquire, LockBackend, LockMode, LockRequest, Release, ReplayStore, Stored,
};
use tower_lock::{Error, FencingToken, HoldId, Lease, Lock, LockClient, LockKey, RedisBackend};

/// The response timeout of every backend behind the proxy: short, so the tests are.
const TIMEOUT: Duration = Duration::from_millis(200);

/// A lease far longer than any test: a phantom hold would outlast the test.
const LONG: Duration = Duration::from_secs(60);

/// A Redis backend that reaches `server` through a new fault proxy, with a short
/// response timeout and the lock scripts already loaded (a late `EVALSHA` of a script
/// Redis does not know would do nothing, and prove nothing).
async fn redis_behind_proxy(server: &RedisServer) -> (FaultProxy, RedisBackend, LockClient) {
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
    let backend = RedisBackend::builder(format!("redis://127.0.0.1:{}", proxy.port()))
        .response_timeout(TIMEOUT)
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    for lock in [
        client.get_lock("warm-up").unwrap(),
        client.get_fair_lock("warm-up").unwrap(),
    ] {
        lock.try_lock().await.unwrap().unlock().await.unwrap();
    }
    (proxy, backend, client)
}

/// A server of the test's own, a client reaching it through a fault proxy (see
/// [`redis_behind_proxy`]), and a backend on it directly, for the store's side of the
/// scenarios both stores share.
struct RedisBehindProxy {
    _server: RedisServer,
    proxy: FaultProxy,
    direct: RedisBackend,
    client: LockClient,
}

async fn redis_and_direct() -> RedisBehindProxy {
    let server = RedisServer::start().await;
    let (proxy, _backend, client) = redis_behind_proxy(&server).await;
    let direct = RedisBackend::connect(server.url()).await.unwrap();
    RedisBehindProxy {
        _server: server,
        proxy,
        direct,
        client,
    }
}

/// Releases `trap` and waits until the proxy has handed everything it held to the
/// store; then, since the store runs it in a moment, checks `clean` for a while:
/// whatever the late write would leave behind must never show up.
async fn release_late_write<F, Fut>(proxy: &FaultProxy, trap: Trap, what: &str, mut clean: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    trap.release();
    wait_until(
        Duration::from_secs(5),
        "the held write reached the store",
        || async {
            let up = proxy.stats().up;
            up.forwarded + up.discarded >= up.received
        },
    )
    .await;
    let until = tokio::time::Instant::now() + Duration::from_millis(500);
    while tokio::time::Instant::now() < until {
        assert!(clean().await, "{what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

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
    let client = LockClient::new(backend.clone());
    // Held by another client, so the parked future cannot finish in its one poll (a
    // free key could be granted within it, on a loaded machine, and prove nothing).
    let _held = LockClient::new(backend)
        .get_lock("parked")
        .unwrap()
        .try_lock()
        .await
        .unwrap();
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

/// Found by the history checker's nemesis (`nemesis_redis`, seed 2536 of 3,000): Redis
/// restarted between redis-rs's answer to a script Redis did not know (`SCRIPT LOAD`,
/// then `EVALSHA` once more) and that second `EVALSHA`, which found the script cache
/// empty again. The acquisition failed with `NoScript`, an error that is neither an
/// outage nor retried, though the script had never run. Here the cache is flushed at
/// that moment (`SCRIPT FLUSH`, as a restart or a failover to a replica empties it):
/// the acquisition must still be taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_script_cache_lost_between_load_and_run_costs_no_acquisition_redis() {
    let server = RedisServer::start().await;
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
    let backend = RedisBackend::builder(format!("redis://127.0.0.1:{}", proxy.port()))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    let mut direct = server.conn().await;
    let flush = || redis::cmd("SCRIPT").arg("FLUSH").to_owned();
    let () = flush().query_async(&mut direct).await.unwrap();

    // The first EVALSHA finds no script; redis-rs loads it, and its second EVALSHA is
    // held until the cache is empty again.
    let load = proxy.trap(Direction::Up, b"LOAD");
    let lock = client.get_lock("script-cache-lost").unwrap();
    let acquiring = tokio::spawn(async move { lock.try_lock().await });
    load.caught().await;
    let again = proxy.trap(Direction::Up, b"EVALSHA");
    load.release();
    again.caught().await;
    let () = flush().query_async(&mut direct).await.unwrap();
    again.release();

    let guard = tokio::time::timeout(Duration::from_secs(5), acquiring)
        .await
        .expect("the acquisition never returned")
        .unwrap()
        .expect("a script cache emptied between its load and its run failed the acquisition");
    guard.unlock().await.unwrap();
    assert_eq!(
        server.keys("script-cache-lost*").await,
        Vec::<String>::new()
    );
}

/// Sequence 3: an acquisition whose reply timed out — the write held back on its way,
/// like a resent packet — and that reaches Redis after the client replaced its
/// connection. The compensating release had gone over the new connection and found
/// nothing; the late acquisition then held the key for its whole lease, for an owner
/// nobody stood for. Now it is refused: its deadline on the server's clock has passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquisition_that_lands_late_takes_nothing_redis() {
    let server = RedisServer::start().await;
    let (proxy, _backend, client) = redis_behind_proxy(&server).await;
    let trap = proxy.trap(Direction::Up, b"late-exclusive");
    let lock = client.get_lock("late-exclusive").unwrap();
    let err = lock.try_lock_for(Duration::ZERO, LONG).await.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    trap.caught().await;
    // Past the deadline and the compensation's second pass: only the store's refusal
    // stands between the late write and a phantom hold.
    tokio::time::sleep(TIMEOUT * 3).await;
    release_late_write(
        &proxy,
        trap,
        "the late acquisition took the lock",
        || async { server.keys("*late-exclusive*").await.is_empty() },
    )
    .await;
    let other = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    other
        .get_lock("late-exclusive")
        .unwrap()
        .try_lock()
        .await
        .expect("the key is free for everyone else")
        .unlock()
        .await
        .unwrap();
}

/// Sequence 3, queued: a fair attempt on a held lock that lands late used to leave a
/// queue entry nobody stood for, ahead of every later waiter until the waiter timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_fair_attempt_that_lands_late_leaves_no_queue_entry_redis() {
    let server = RedisServer::start().await;
    let (proxy, _backend, client) = redis_behind_proxy(&server).await;
    let direct = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let held = direct
        .get_fair_lock("late-fair")
        .unwrap()
        .try_lock()
        .await
        .unwrap();
    let trap = proxy.trap(Direction::Up, b"late-fair");
    let lock = client.get_fair_lock("late-fair").unwrap();
    let err = lock.try_lock_for(Duration::ZERO, LONG).await.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    trap.caught().await;
    tokio::time::sleep(TIMEOUT * 3).await;
    release_late_write(
        &proxy,
        trap,
        "the late attempt queued a waiter nobody stands for",
        || async { server.keys("redisson_lock_*late-fair*").await.is_empty() },
    )
    .await;
    held.unlock().await.unwrap();
    assert_eq!(server.keys("*late-fair*").await, Vec::<String>::new());
}

/// Sequence 4, the part every store shares: a waiter's attempt gets no answer in time
/// (held back on its way) while another owner holds the lock, and the wait runs out.
/// The lock core used to release that attempt's owner — a release that overtook the
/// attempt — and try again as the same owner, and return `Busy` without giving the
/// owner up. The attempt then landed after the holder's unlock and held the key.
///
/// The holder is played on `store` directly (not through the proxy): it takes the key
/// with a short lease, so the waiter's next attempt comes when that lease would end,
/// and then extends it, so the key stays held through the waiter's whole wait.
async fn a_wait_that_runs_out_after_an_unanswered_attempt(
    proxy: &FaultProxy,
    (waiter, waiting_now): (&LockClient, &(dyn Fn() -> bool + Sync)),
    store: &dyn LockBackend,
    key: &str,
) {
    let holder = LockRequest::new(
        LockKey::new(key).unwrap(),
        HoldId::from_raw("holder:1").unwrap(),
        LockMode::Exclusive,
        Duration::from_millis(500),
    );
    assert!(matches!(
        store.acquire(&holder).await.unwrap(),
        Acquire::Acquired(_)
    ));
    let waiting = {
        let lock = waiter.get_lock(key).unwrap();
        tokio::spawn(async move { lock.try_lock_for(Duration::from_secs(2), LONG).await })
    };
    // Its first attempt was answered (busy, for 500 ms): it waits.
    wait_until(Duration::from_secs(5), "the waiter waits", || async {
        waiting_now()
    })
    .await;
    let mut longer = holder.clone();
    longer.lease = LONG;
    assert!(store.renew(&longer).await.unwrap());
    // Its next attempt, when the first lease would have ended, is held back.
    let trap = proxy.trap(Direction::Up, key.as_bytes());
    trap.caught().await;
    let outcome = waiting.await.unwrap();
    assert!(
        matches!(outcome, Err(Error::Busy { .. }))
            || outcome.as_ref().is_err_and(Error::is_unavailable),
        "the waiter cannot have the lock another owner holds: {:?}",
        outcome.map(|g| g.fencing_token())
    );
    assert_eq!(store.release(&holder).await.unwrap(), Release::Released);
    let lock_key = holder.key.clone();
    release_late_write(
        proxy,
        trap,
        "the unanswered attempt took the lock after the wait ran out",
        || async {
            let state = state_of(store, &lock_key).await;
            state.holders.is_empty()
        },
    )
    .await;
}

/// Whether `lock` can be taken (and is given back at once).
async fn free(lock: &Lock) -> bool {
    match lock.try_lock().await {
        Ok(guard) => {
            guard.unlock().await.unwrap();
            true
        }
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_leaves_no_phantom_hold_redis() {
    let server = RedisServer::start().await;
    let (proxy, backend, client) = redis_behind_proxy(&server).await;
    let direct = RedisBackend::connect(server.url()).await.unwrap();
    let key = LockKey::new("wait-out").unwrap();
    let waiting = || backend.local_waiters(&key) == 1;
    a_wait_that_runs_out_after_an_unanswered_attempt(
        &proxy,
        (&client, &waiting),
        &direct,
        "wait-out",
    )
    .await;
    assert!(free(&client.get_lock("wait-out").unwrap()).await);
}

/// A PostgreSQL database of the test's own, a backend on it directly, and a backend
/// and client reaching it through a new fault proxy, with a short response timeout and
/// the statements prepared (a late Bind of an unprepared statement would prove
/// nothing).
#[cfg(feature = "postgres")]
struct PgBehindProxy {
    _db: common::postgres::PgDatabase,
    proxy: FaultProxy,
    direct: tower_lock::PostgresBackend,
    backend: tower_lock::PostgresBackend,
    client: LockClient,
}

#[cfg(feature = "postgres")]
async fn postgres_behind_proxy() -> PgBehindProxy {
    use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
    use tower_lock::PostgresBackend;

    let db = common::postgres::PgDatabase::create().await;
    let options: PgConnectOptions = db.url.parse().unwrap();
    let upstream = (options.get_host().to_owned(), options.get_port());
    let upstream = tokio::net::lookup_host(upstream)
        .await
        .unwrap()
        .next()
        .unwrap();
    let proxy = FaultProxy::start(upstream).await;
    let direct = PostgresBackend::builder(db.pool(4).await)
        .build()
        .await
        .unwrap();
    let behind = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options.port(proxy.port()).host("127.0.0.1"))
        .await
        .unwrap();
    let backend = PostgresBackend::builder(behind)
        .response_timeout(TIMEOUT)
        .migrate(false)
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    free(&client.get_lock("warm-up").unwrap()).await;
    PgBehindProxy {
        _db: db,
        proxy,
        direct,
        backend,
        client,
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_that_runs_out_leaves_no_phantom_hold_postgres() {
    let pg = postgres_behind_proxy().await;
    let key = LockKey::new("wait-out").unwrap();
    let waiting = || pg.backend.local_waiters(&key) == 1;
    a_wait_that_runs_out_after_an_unanswered_attempt(
        &pg.proxy,
        (&pg.client, &waiting),
        &pg.direct,
        "wait-out",
    )
    .await;
    assert!(free(&pg.client.get_lock("wait-out").unwrap()).await);
}

/// Sequence 3 on PostgreSQL: the record of an abandoned owner refused its late attempts
/// only for a while (twice the response timeout plus the lease); a statement delayed
/// longer took the lock. Every attempt now carries a deadline on the database's clock,
/// and `_acquire` refuses it once that has passed, however late it comes.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timed_out_acquisition_that_lands_after_its_record_takes_nothing_postgres() {
    let pg = postgres_behind_proxy().await;
    let trap = pg.proxy.trap(Direction::Up, b"late-exclusive");
    let lease = Duration::from_millis(300);
    let lock = pg.client.get_lock("late-exclusive").unwrap();
    let err = lock.try_lock_for(Duration::ZERO, lease).await.unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    trap.caught().await;
    // Past the abandoned owner's record (2 x timeout + lease).
    tokio::time::sleep(TIMEOUT * 2 + lease + Duration::from_millis(300)).await;
    let key = LockKey::new("late-exclusive").unwrap();
    release_late_write(
        &pg.proxy,
        trap,
        "the late acquisition took the lock",
        || async {
            let state = state_of(&pg.direct, &key).await;
            state.holders.is_empty()
        },
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Records for replay (issue 25)
// ---------------------------------------------------------------------------------------

/// Takes `req` on `store`, which must be free for it; its fencing token.
async fn fenced_grant(store: &dyn LockBackend, req: &LockRequest) -> FencingToken {
    match store.acquire(req).await.unwrap() {
        Acquire::Acquired(grant) => grant.token().unwrap(),
        busy => panic!("{} is not free: {busy:?}", req.key),
    }
}

/// A store and release held back on its way (its reply times out) until its hold's
/// lease has run out and another hold has taken the lock: when it lands, the store
/// refuses it. No record is written, the other hold keeps its lock, and its own record
/// is stored afterwards. `behind` reaches the store through `proxy`; `direct` does not.
async fn a_store_and_release_that_lands_after_the_lease(
    proxy: &FaultProxy,
    behind: &dyn LockBackend,
    direct: &dyn LockBackend,
    key: &str,
) {
    let key = LockKey::new(key).unwrap();
    let record = |text: &'static str| bytes::Bytes::from_static(text.as_bytes());
    let lease = Duration::from_millis(300);
    let late = LockRequest::new(
        key.clone(),
        HoldId::from_raw("late:1").unwrap(),
        LockMode::Exclusive,
        lease,
    )
    .fenced();
    let late_token = fenced_grant(behind, &late).await;
    let trap = proxy.trap(Direction::Up, b"record-of-the-late-hold");
    let err = behind
        .replays()
        .unwrap()
        .store_and_release(&late, late_token, record("record-of-the-late-hold"), LONG)
        .await
        .unwrap_err();
    assert!(err.is_unavailable(), "{err:?}");
    trap.caught().await;
    wait_until(
        Duration::from_secs(5),
        "the late hold's lease ran out",
        || async {
            let state = state_of(direct, &key).await;
            state.holders.is_empty()
        },
    )
    .await;
    let next = LockRequest::new(
        key.clone(),
        HoldId::from_raw("next:1").unwrap(),
        LockMode::Exclusive,
        LONG,
    )
    .fenced();
    let next_token = fenced_grant(direct, &next).await;
    assert!(next_token > late_token);
    let records = direct.replays().unwrap();
    release_late_write(
        proxy,
        trap,
        "the late store and release wrote its record or released the next hold",
        || async {
            let state = state_of(direct, &key).await;
            let holders: Vec<&str> = state.holders.iter().map(|h| h.hold_id.as_str()).collect();
            records.load(&key).await.unwrap().is_none() && holders == ["next:1"]
        },
    )
    .await;
    let stored = records
        .store_and_release(&next, next_token, record("record-of-the-next-hold"), LONG)
        .await
        .unwrap();
    assert_eq!(stored, Stored::new(true, Release::Released));
    assert_eq!(
        records.load(&key).await.unwrap().as_deref(),
        Some(&b"record-of-the-next-hold"[..])
    );
}

/// Issue 25 on Redis: a store and release that lands after its hold's lease stores
/// nothing (the replay script checks the hold in the same call that writes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_and_release_that_lands_after_the_lease_stores_nothing_redis() {
    let server = RedisServer::start().await;
    let (proxy, backend, _client) = redis_behind_proxy(&server).await;
    let direct = RedisBackend::connect(server.url()).await.unwrap();
    // The replay script loaded, so the late EVALSHA runs (one the server did not know
    // would do nothing, and prove nothing).
    let warm = LockRequest::new(
        LockKey::new("warm-up-replay").unwrap(),
        HoldId::from_raw("warm:1").unwrap(),
        LockMode::Exclusive,
        LONG,
    )
    .fenced();
    let token = fenced_grant(&backend, &warm).await;
    let warmed = backend
        .store_and_release(&warm, token, bytes::Bytes::from_static(b"warm"), LONG)
        .await
        .unwrap();
    assert!(warmed.stored);
    a_store_and_release_that_lands_after_the_lease(&proxy, &backend, &direct, "late-replay").await;
}

/// Issue 25 on PostgreSQL: a store and release that lands after its hold's lease
/// stores nothing (`_replay_store` checks the hold in the statement that writes).
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_and_release_that_lands_after_the_lease_stores_nothing_postgres() {
    let pg = postgres_behind_proxy().await;
    a_store_and_release_that_lands_after_the_lease(
        &pg.proxy,
        &pg.backend,
        &pg.direct,
        "late-replay",
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// Pipelined group commit (one server)
// ---------------------------------------------------------------------------------------

/// Script calls the server has run so far.
async fn scripts_run(direct: &mut redis::aio::MultiplexedConnection) -> u64 {
    common::redis_server::command_calls(direct, &["evalsha", "eval"]).await
}

/// A backend behind a proxy, whose replies may be held for seconds without timing out.
async fn patient_behind_proxy(server: &RedisServer) -> (FaultProxy, RedisBackend, LockClient) {
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await;
    let backend = RedisBackend::builder(format!("redis://127.0.0.1:{}", proxy.port()))
        .response_timeout(Duration::from_secs(5))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    // The batches' connection made, and its scripts loaded.
    let warm = client.get_lock("warm-up").unwrap();
    warm.try_lock().await.unwrap().unlock().await.unwrap();
    (proxy, backend, client)
}

fn request(key: &str, hold: &str) -> LockRequest {
    LockRequest::new(
        LockKey::new(key).unwrap(),
        HoldId::from_raw(hold).unwrap(),
        LockMode::Exclusive,
        Duration::from_secs(30),
    )
}

/// Several batches go on the wire before the first is answered (the server runs the
/// second while the first one's reply is still on its way), and one key's operations,
/// each sent while the ones before are unanswered, still run in the order they were
/// queued: taken by A, released by A, taken by B.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_pipelined_and_keep_each_keys_order_redis() {
    let server = RedisServer::start().await;
    let (proxy, backend, _client) = patient_behind_proxy(&server).await;
    let mut direct = server.conn().await;
    proxy.set_flow(Direction::Down, Flow::Hold);
    let (a, b) = (request("ordered", "hold-a"), request("ordered", "hold-b"));
    let mut answers = Vec::new();
    let before = scripts_run(&mut direct).await;
    for (n, step) in [(&a, true), (&a, false), (&b, true)]
        .into_iter()
        .enumerate()
    {
        let (backend, req) = (backend.clone(), step.0.clone());
        let acquire = step.1;
        answers.push(tokio::spawn(async move {
            if acquire {
                format!("{:?}", backend.acquire(&req).await)
            } else {
                format!("{:?}", backend.release(&req).await)
            }
        }));
        let ran = before + n as u64 + 1;
        wait_until(
            Duration::from_secs(5),
            "the server runs it with the replies before it unanswered",
            || async { scripts_run(&mut direct.clone()).await >= ran },
        )
        .await;
    }
    proxy.set_flow(Direction::Down, Flow::Pass);
    let mut replies = Vec::new();
    for answer in answers {
        replies.push(answer.await.unwrap());
    }
    assert!(replies[0].starts_with("Ok(Acquired"), "{replies:?}");
    assert_eq!(replies[1], "Ok(Released)", "{replies:?}");
    assert!(replies[2].starts_with("Ok(Acquired"), "{replies:?}");
    let holder: std::collections::HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(backend.lock_name(&LockKey::new("ordered").unwrap()))
        .query_async(&mut direct)
        .await
        .unwrap();
    assert_eq!(
        holder,
        std::collections::HashMap::from([("hold-b".to_owned(), 1)])
    );
}

/// The batches' connection cut with three batches on the wire (their replies held): every
/// caller gets an answer — the lock core tries once more on a new connection — and each
/// key ends with its one holder, then with nothing once they let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_with_batches_in_flight_answers_every_caller_redis() {
    let server = RedisServer::start().await;
    let (proxy, _backend, client) = patient_behind_proxy(&server).await;
    let mut direct = server.conn().await;
    proxy.set_flow(Direction::Down, Flow::Hold);
    let before = scripts_run(&mut direct).await;
    let mut takers = Vec::new();
    for n in 0..3u64 {
        let lock = client
            .get_lock(format!("cut-in-flight:{n}").as_str())
            .unwrap();
        takers.push(tokio::spawn(async move {
            lock.try_lock_for(Duration::from_secs(10), Lease::Watchdog)
                .await
        }));
        wait_until(Duration::from_secs(5), "the server runs it", || async {
            scripts_run(&mut direct.clone()).await > before + n
        })
        .await;
    }
    proxy.cut();
    proxy.set_flow(Direction::Down, Flow::Pass);
    let mut guards = Vec::new();
    for taker in takers {
        let guard = tokio::time::timeout(Duration::from_secs(15), taker)
            .await
            .expect("a caller was never answered")
            .unwrap()
            .expect("the lock after the cut");
        guards.push(guard);
    }
    for (n, guard) in guards.iter().enumerate() {
        let holder: Vec<String> = redis::cmd("HKEYS")
            .arg(format!("cut-in-flight:{n}"))
            .query_async(&mut direct)
            .await
            .unwrap();
        assert_eq!(holder, vec![guard.hold_id().as_str().to_owned()], "key {n}");
    }
    for guard in guards {
        guard.unlock().await.unwrap();
    }
    wait_until(Duration::from_secs(5), "nothing left", || async {
        server.keys("cut-in-flight*").await.is_empty()
    })
    .await;
}

/// One lock at a time, 200 times: each finds the batcher idle and is sent by its
/// caller, and every one of them on the same connection (none is made, and no script
/// loaded, per operation).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn locks_one_at_a_time_share_one_batch_connection_redis() {
    let server = RedisServer::start().await;
    let (proxy, _backend, client) = patient_behind_proxy(&server).await;
    let connections = proxy.stats().accepted;
    let mut direct = server.conn().await;
    let loads = common::redis_server::command_calls(&mut direct, &["script|load"]).await;
    let lock = client.get_lock("one-at-a-time").unwrap();
    for _ in 0..200 {
        lock.try_lock().await.unwrap().unlock().await.unwrap();
    }
    assert_eq!(proxy.stats().accepted, connections, "connections made");
    assert_eq!(
        common::redis_server::command_calls(&mut direct, &["script|load"]).await,
        loads,
        "scripts loaded"
    );
}

/// Many callers at once, on a backend whose batcher keeps going idle: an operation that
/// arrives while another's caller is putting its own on the wire (the batcher busy, no
/// drainer running) is still sent, by a drainer started when that caller is done. None
/// waits for a reply that is not its own, and every lock is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_queued_behind_a_callers_own_send_are_sent_redis() {
    let server = RedisServer::start().await;
    let client = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let mut callers = tokio::task::JoinSet::new();
    for n in 0..64 {
        let lock = client.get_lock(format!("behind-own-send:{n}")).unwrap();
        callers.spawn(async move {
            for _ in 0..50 {
                lock.try_lock().await.unwrap().unlock().await.unwrap();
                // Spread out, so that the batcher goes idle between operations.
                if fastrand::u8(..4) == 0 {
                    tokio::task::yield_now().await;
                }
            }
        });
    }
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(done) = callers.join_next().await {
            done.unwrap();
        }
    })
    .await
    .expect("an operation was never sent");
    assert_eq!(server.keys("*behind-own-send*").await, Vec::<String>::new());
}

/// An operation in flight that its caller sent itself (the batcher was idle) still makes
/// the ones after it wait for the next batch: under load, operations share script calls
/// instead of going one call each. Eight acquisitions made while the first one's reply
/// is held go in one call. (On one thread, so that all of them are queued before the
/// drainer that sends them runs.)
#[tokio::test(flavor = "current_thread")]
async fn operations_arriving_while_one_is_in_flight_share_one_call_redis() {
    let server = RedisServer::start().await;
    let (proxy, backend, _client) = patient_behind_proxy(&server).await;
    let mut direct = server.conn().await;
    proxy.set_flow(Direction::Down, Flow::Hold);
    let before = scripts_run(&mut direct).await;
    let first = {
        let (backend, req) = (backend.clone(), request("in-flight:0", "hold-0"));
        tokio::spawn(async move { backend.acquire(&req).await })
    };
    wait_until(Duration::from_secs(5), "the first one ran", || async {
        scripts_run(&mut direct.clone()).await == before + 1
    })
    .await;
    let mut later = Vec::new();
    for n in 1..=8 {
        let (backend, req) = (
            backend.clone(),
            request(&format!("in-flight:{n}"), &format!("hold-{n}")),
        );
        later.push(tokio::spawn(async move { backend.acquire(&req).await }));
    }
    wait_until(Duration::from_secs(5), "the later ones ran", || async {
        server.keys("in-flight:*").await.len() == 9
    })
    .await;
    assert_eq!(
        scripts_run(&mut direct).await,
        before + 2,
        "script calls for the first operation and the eight after it"
    );
    proxy.set_flow(Direction::Down, Flow::Pass);
    for taker in std::iter::once(first).chain(later) {
        assert!(matches!(taker.await.unwrap(), Ok(Acquire::Acquired(_))));
    }
}

/// How many hold the exclusive lock `key` in `store`.
async fn holders_of(store: &dyn LockBackend, key: &LockKey) -> usize {
    state_of(store, key).await.holders.len()
}

/// What `store` holds for the exclusive lock `key`, read through its administration.
async fn state_of<B: LockBackend + ?Sized>(store: &B, key: &LockKey) -> tower_lock::LockState {
    let admin = store
        .admin()
        .expect("every store under test has administration");
    admin.inspect(key, LockMode::Exclusive).await.unwrap()
}

/// Waits (5 s at most) until nobody holds the exclusive lock `key` in `store`: what a
/// retried release or abandonment must bring about soon after the store is back.
async fn nothing_held_soon(store: &dyn LockBackend, key: &LockKey, what: &str) {
    wait_until(Duration::from_secs(5), what, || async {
        holders_of(store, key).await == 0
    })
    .await;
}

/// The Redis test and the PostgreSQL test of a scenario both stores share:
/// `scenario(proxy, client, direct store, key)`, each store behind a fault proxy of
/// its own.
macro_rules! on_both_stores {
    ($scenario:ident($key:literal): $redis:ident, $postgres:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $redis() {
            let r = redis_and_direct().await;
            $scenario(&r.proxy, &r.client, &r.direct, $key).await;
        }

        #[cfg(feature = "postgres")]
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $postgres() {
            let pg = postgres_behind_proxy().await;
            $scenario(&pg.proxy, &pg.client, &pg.direct, $key).await;
        }
    };
}

/// A release that gets no answer (its request lost on the way: a connection cut, a
/// failover) fails the unlock as an outage, and the hold stays in the store. It used to
/// stay until its lease ended (a minute here): a phantom hold every other owner waited
/// out. The release is now tried again in the background until the store answers or
/// the lease ends, so the lock is free soon after the store can be reached again.
async fn a_release_that_met_an_outage(
    proxy: &FaultProxy,
    client: &LockClient,
    store: &dyn LockBackend,
    key: &str,
) {
    let lock_key = LockKey::new(key).unwrap();
    let holders = || holders_of(store, &lock_key);
    let guard = client
        .get_lock(key)
        .unwrap()
        .try_lock_for(Duration::ZERO, LONG)
        .await
        .unwrap();
    proxy.set_flow(Direction::Up, Flow::Discard);
    let unlocked = guard.unlock().await;
    assert!(
        unlocked.as_ref().is_err_and(Error::is_unavailable),
        "the unanswered release: {unlocked:?}"
    );
    assert_eq!(holders().await, 1, "the hold is still in the store");
    proxy.set_flow(Direction::Up, Flow::Pass);
    nothing_held_soon(
        store,
        &lock_key,
        "the hold released once the store could be reached",
    )
    .await;
}

on_both_stores!(
    a_release_that_met_an_outage("release-outage"):
    a_release_that_met_an_outage_is_tried_again_redis,
    a_release_that_met_an_outage_is_tried_again_postgres
);

/// A watched hold whose renewals reach the store but whose answers come back too late
/// (a store or a network slower than the response timeout): its guard is told it is
/// lost when its lease runs out by the client's clock, while the store, which applied
/// renewals the client never heard of, keeps it for up to a lease more. That hold was a
/// phantom every other owner waited out, for as long as nobody let go of the lost
/// guard (a handler that does not watch its lost signal) or the release met the same
/// outage. The watchdog now takes back in the store a hold it gives up, trying again
/// while the store cannot be reached: the lock is free at once, the guard still alive.
async fn a_hold_the_watchdog_gave_up(
    proxy: &FaultProxy,
    client: &LockClient,
    store: &dyn LockBackend,
    key: &str,
) {
    const LEASE: Duration = Duration::from_secs(6);
    let lock_key = LockKey::new(key).unwrap();
    let watched = LockClient::builder(std::sync::Arc::clone(client.backend()))
        .watchdog_lease(LEASE)
        .build()
        .unwrap();
    let guard = watched.get_lock(key).unwrap().lock().await.unwrap();
    // A renewal that goes through first (a renewal script Redis does not have yet would
    // be refused, and its retry never sent); then one whose answer is lost.
    renewal_lands(store, &lock_key, "a renewal").await;
    proxy.set_flow(Direction::Down, Flow::Delay(TIMEOUT * 2));
    renewal_lands(store, &lock_key, "a renewal answered too late").await;
    tokio::time::timeout(LEASE, guard.lost().wait())
        .await
        .expect("the guard is told its hold is lost when the lease runs out");
    proxy.set_flow(Direction::Down, Flow::Pass);
    wait_until(
        LEASE / 6,
        "the lost hold taken back in the store",
        || async { holders_of(store, &lock_key).await == 0 },
    )
    .await;
    assert!(guard.is_lost());
    drop(guard);
}

/// Waits (10 s at most) until the lease of the one hold of `key` in `store` grows: a
/// renewal reached the store.
async fn renewal_lands(store: &dyn LockBackend, key: &LockKey, what: &str) {
    let ttl = || async {
        let state = state_of(store, key).await;
        state
            .holders
            .first()
            .and_then(|h| h.ttl)
            .unwrap_or_default()
    };
    let until = Instant::now() + Duration::from_secs(10);
    let mut last = ttl().await;
    loop {
        tokio::time::sleep(Duration::from_millis(20)).await;
        let now = ttl().await;
        if now > last + Duration::from_millis(500) {
            return;
        }
        assert!(Instant::now() < until, "timed out waiting for {what}");
        last = now;
    }
}

/// Redis only: on PostgreSQL a renewal a period after the last statement goes out on a
/// connection the pool tests first (the backend keeps a connection idle for a second at
/// most), and the delayed answer to that test outlasts the response timeout, so the
/// renewal is never sent. `safety_regressions.rs` loses the answers past the client
/// instead, on every store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_the_watchdog_gave_up_is_taken_back_in_the_store_redis() {
    let r = redis_and_direct().await;
    a_hold_the_watchdog_gave_up(&r.proxy, &r.client, &r.direct, "watchdog-gave-up").await;
}

/// How long the store stays unreachable in the abandonment tests: longer than an
/// abandonment waits before its last try of its own (the response timeout and a margin).
const OUTAGE: Duration = Duration::from_secs(2);

/// An attempt the store granted, whose answer was lost with its connection, while the
/// store then could not be reached for a while: the lock core's abandonment of it
/// failed, and the grant stayed in the store until its lease ended (a minute here),
/// though its caller had been told the attempt failed. The abandonment is now tried
/// again until the store answers or that lease ends.
async fn an_abandonment_that_met_an_outage(
    proxy: &FaultProxy,
    client: &LockClient,
    store: &dyn LockBackend,
    key: &str,
) {
    let lock_key = LockKey::new(key).unwrap();
    let holders = || holders_of(store, &lock_key);
    // The attempt is held on its way until answers are thrown away (a connection's
    // check before it, on PostgreSQL, is answered), then goes on to the store.
    let trap = proxy.trap(Direction::Up, key.as_bytes());
    let attempt = {
        let lock = client.get_lock(key).unwrap();
        tokio::spawn(async move { lock.try_lock_for(Duration::ZERO, LONG).await.map(drop) })
    };
    trap.caught().await;
    proxy.set_flow(Direction::Down, Flow::Discard);
    trap.release();
    wait_until(
        Duration::from_secs(5),
        "the attempt took the lock in the store",
        || async { holders().await == 1 },
    )
    .await;
    // Before the attempt times out: its connection is cut and no new one gets through.
    proxy.refuse(true);
    proxy.cut();
    let outcome = attempt.await.unwrap();
    assert!(
        outcome.as_ref().is_err_and(Error::is_unavailable),
        "the attempt whose answer was lost: {outcome:?}"
    );
    tokio::time::sleep(OUTAGE).await;
    assert_eq!(holders().await, 1, "the grant is still in the store");
    proxy.set_flow(Direction::Down, Flow::Pass);
    proxy.refuse(false);
    nothing_held_soon(
        store,
        &lock_key,
        "the grant taken back once the store could be reached",
    )
    .await;
}

on_both_stores!(
    an_abandonment_that_met_an_outage("abandon-outage"):
    an_abandonment_that_met_an_outage_is_tried_again_redis,
    an_abandonment_that_met_an_outage_is_tried_again_postgres
);

/// A lock call that meets an outage while it still has time to wait: it used to try
/// twice (the second at once, as a new hold) and fail, however much of its wait was
/// left, so a failover longer than two response timeouts cost a caller that came during
/// it an error. It now rides the outage out within its wait, backing off as a waiter
/// does; and a wait that runs out during an outage fails as the outage it met, not as
/// a busy lock.
async fn a_lock_call_with_wait_left_rides_out_an_outage(
    proxy: &FaultProxy,
    client: &LockClient,
    store: &dyn LockBackend,
    key: &str,
) {
    let lock_key = LockKey::new(key).unwrap();
    let holders = || holders_of(store, &lock_key);
    proxy.refuse(true);
    proxy.cut();
    let call = {
        let lock = client.get_lock(key).unwrap();
        tokio::spawn(async move { lock.try_lock_for(Duration::from_secs(20), LONG).await })
    };
    // Ten response timeouts: far longer than two attempts take.
    tokio::time::sleep(OUTAGE).await;
    assert!(
        !call.is_finished(),
        "the call gave up with most of its wait left: {:?}",
        call.await.unwrap().map(drop)
    );
    proxy.refuse(false);
    let guard = call
        .await
        .unwrap()
        .expect("the lock, once the store could be reached again");
    assert_eq!(holders().await, 1, "the call's hold is in the store");
    guard.unlock().await.unwrap();
    assert_eq!(holders().await, 0);

    // A wait shorter than the outage: it ends with the wait, as an outage.
    proxy.refuse(true);
    proxy.cut();
    let wait = Duration::from_millis(600);
    let started = Instant::now();
    let outcome = client
        .get_lock(key)
        .unwrap()
        .try_lock_for(wait, LONG)
        .await
        .map(drop);
    let took = started.elapsed();
    assert!(
        outcome.as_ref().is_err_and(Error::is_unavailable),
        "a wait that ran out in an outage: {outcome:?}"
    );
    assert!(
        took >= wait && took < wait + 3 * TIMEOUT,
        "a wait of {wait:?} in an outage took {took:?}"
    );
    proxy.refuse(false);
    nothing_held_soon(
        store,
        &lock_key,
        "nothing held once the store could be reached",
    )
    .await;
}

on_both_stores!(
    a_lock_call_with_wait_left_rides_out_an_outage("ride-out"):
    a_lock_call_with_wait_left_rides_out_an_outage_redis,
    a_lock_call_with_wait_left_rides_out_an_outage_postgres
);
