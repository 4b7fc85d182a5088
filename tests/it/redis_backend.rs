//! The Redis backend beyond the conformance suite: Redisson wire compatibility, wake-one
//! notifications, shared subscriptions, the batched watchdog, typed errors. Every test
//! runs against its own real redis-server.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::redis_server::{RedisServer, command_calls};
use common::wait_until;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;
use tower_lock::backend::redis::WrongType;
use tower_lock::backend::{Acquire, LockBackend, LockMode, LockRequest, Release, Wake};
use tower_lock::{ConfigError, SetupError};
use tower_lock::{Error, HoldId, Lease, LockClient, LockKey, RedisBackend, StoreErrorKind};

/// Redisson 3.x `RedissonLock.tryLockInnerAsync`, verbatim in behaviour: nil when
/// acquired, else the holder's PTTL.
const REDISSON_TRY_LOCK: &str = r"
if (redis.call('exists', KEYS[1]) == 0) then
    redis.call('hincrby', KEYS[1], ARGV[2], 1);
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return nil;
end;
if (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then
    redis.call('hincrby', KEYS[1], ARGV[2], 1);
    redis.call('pexpire', KEYS[1], ARGV[1]);
    return nil;
end;
return redis.call('pttl', KEYS[1]);";

/// Redisson 3.x `RedissonLock.unlockInnerAsync`: nil when not held, 0 when holds remain,
/// 1 when released (and `0` published on the channel).
const REDISSON_UNLOCK: &str = r"
if (redis.call('hexists', KEYS[1], ARGV[3]) == 0) then
    return nil;
end;
local counter = redis.call('hincrby', KEYS[1], ARGV[3], -1);
if (counter > 0) then
    redis.call('pexpire', KEYS[1], ARGV[2]);
    return 0;
else
    redis.call('del', KEYS[1]);
    redis.call('publish', KEYS[2], ARGV[1]);
    return 1;
end;
return nil;";

/// A Redisson client, played with raw commands following RLock's protocol.
struct Redisson {
    conn: MultiplexedConnection,
    id: &'static str,
}

impl Redisson {
    fn field(&self, thread: u64) -> String {
        format!("{}:{thread}", self.id)
    }

    async fn try_lock(&mut self, name: &str, thread: u64, lease_ms: u64) -> Option<i64> {
        redis::Script::new(REDISSON_TRY_LOCK)
            .key(name)
            .arg(lease_ms)
            .arg(self.field(thread))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn unlock(&mut self, name: &str, thread: u64) -> Option<i64> {
        let channel = format!("redisson_lock__channel:{{{name}}}");
        redis::Script::new(REDISSON_UNLOCK)
            .key(name)
            .key(channel)
            .arg(0)
            .arg(30_000)
            .arg(self.field(thread))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }
}

async fn hgetall(conn: &mut MultiplexedConnection, key: &str) -> HashMap<String, String> {
    redis::cmd("HGETALL")
        .arg(key)
        .query_async(conn)
        .await
        .unwrap()
}

async fn pttl(conn: &mut MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("PTTL").arg(key).query_async(conn).await.unwrap()
}

async fn numsub(conn: &mut MultiplexedConnection, channel: &str) -> i64 {
    let reply: (String, i64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    reply.1
}

/// Successful script calls (EVALSHA + EVAL) the server has executed so far.
async fn script_calls(conn: &mut MultiplexedConnection) -> u64 {
    command_calls(conn, &["evalsha", "eval"]).await
}

/// Exclusive acquisition attempts the server has run, batched or not: each starts with
/// one `EXISTS` on the lock hash (`lua/lock_acquire.lua`, `lua/lock_batch.lua`).
async fn acquire_attempts(conn: &mut MultiplexedConnection) -> u64 {
    command_calls(conn, &["exists"]).await
}

async fn client(server: &RedisServer) -> (RedisBackend, LockClient) {
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    (backend.clone(), LockClient::new(backend))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redisson_and_tower_lock_exclude_each_other() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let mut redisson = Redisson {
        conn: server.conn().await,
        id: "5f0e7c8a-redisson-client",
    };
    let (backend, client) = client(&server).await;
    let name = "anyLock";
    let lock = client.get_lock(name).unwrap();

    // Redisson holds: the layout is RLock's, and tower-lock is excluded.
    assert_eq!(redisson.try_lock(name, 1, 30_000).await, None);
    assert_eq!(
        hgetall(&mut raw, name).await,
        HashMap::from([(redisson.field(1), "1".to_owned())])
    );
    // Inspection reads Redisson's hold as it reads ours.
    let state = lock.inspect().await.unwrap();
    assert_eq!(state.holders.len(), 1, "{state:?}");
    let h = &state.holders[0];
    assert_eq!(h.hold_id.as_str(), redisson.field(1));
    assert_eq!((h.holds, h.mode), (1, tower_lock::LockMode::Exclusive));
    assert!(h.ttl.is_some_and(|t| t > Duration::from_secs(25)), "{h:?}");
    assert_eq!(h.client_id(), Some(redisson.id));
    assert_eq!(h.client, None, "Redisson registers no name");
    assert_eq!(lock.hold_count_in_store(&h.hold_id).await.unwrap(), 1);
    match lock.try_lock().await {
        Err(Error::Busy {
            holder_ttl: Some(ttl),
        }) => {
            assert!(
                ttl > Duration::from_secs(25) && ttl <= Duration::from_secs(30),
                "{ttl:?}"
            );
        }
        other => panic!("expected busy, got {other:?}"),
    }

    // A tower-lock waiter is woken by Redisson's unlock message, not by the 30 s TTL.
    let waiter = common::spawn_acquire(lock.clone(), Duration::from_secs(20));
    let key = LockKey::new(name).unwrap();
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        backend.local_waiters(&key) == 1
    })
    .await;
    let channel = "redisson_lock__channel:{anyLock}";
    assert_eq!(numsub(&mut raw, channel).await, 1);
    let released_at = Instant::now();
    assert_eq!(redisson.unlock(name, 1).await, Some(1));
    let (acquired_at, guard) = waiter.await.unwrap().unwrap();
    assert!(acquired_at.duration_since(released_at) < Duration::from_secs(2));

    // tower-lock holds: RLock's layout, and Redisson is excluded.
    let fields = hgetall(&mut raw, name).await;
    assert_eq!(
        fields,
        HashMap::from([(guard.hold_id().to_string(), "1".to_owned())])
    );
    assert!(guard.hold_id().as_str().starts_with(client.id()));
    let ttl = pttl(&mut raw, name).await;
    assert!(
        ttl > 25_000 && ttl <= 30_000,
        "lease is the 30 s watchdog lease: {ttl}"
    );
    let busy = redisson.try_lock(name, 2, 30_000).await;
    assert!(busy.is_some_and(|pttl| pttl > 0), "{busy:?}");
    // Redisson cannot unlock it either.
    assert_eq!(redisson.unlock(name, 2).await, None);

    // A Redisson waiter hears tower-lock's unlock: `0` on Redisson's channel.
    let mut pubsub = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.subscribe(channel).await.unwrap();
    guard.unlock().await.unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(5), pubsub.on_message().next())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(msg.get_channel_name(), channel);
    assert_eq!(msg.get_payload_bytes(), b"0");
    // A plain lock leaves nothing behind: no lock, no counter.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");

    // Re-entry is counted by the client: the store sees one hold, with its own field.
    let owner = client.new_owner();
    owner
        .clone()
        .scope(async {
            let a = lock.lock().await.unwrap();
            let b = lock.lock().await.unwrap();
            assert_eq!(b.hold_count(), 2);
            assert_eq!(b.owner(), &owner);
            assert_eq!(
                hgetall(&mut raw, name).await,
                HashMap::from([(a.hold_id().to_string(), "1".to_owned())])
            );
            b.unlock().await.unwrap();
            assert_eq!(
                hgetall(&mut raw, name).await,
                HashMap::from([(a.hold_id().to_string(), "1".to_owned())])
            );
            a.unlock().await.unwrap();
            assert!(hgetall(&mut raw, name).await.is_empty());
        })
        .await;
}

/// A fenced lock and a Java `RFencedLock` share one fence: Redisson's counter
/// `redisson_lock_token:{NAME}`, `INCR`ed on every acquisition by either side, so tokens
/// keep increasing whoever takes the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_java_fenced_lock_and_tower_lock_share_one_fence() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let (_backend, client) = client(&server).await;
    let name = "fencedLock";
    let counter = "redisson_lock_token:{fencedLock}";
    let lock = client.get_fenced_lock(name).unwrap();

    // RFencedLock's acquire script, as the Java client runs it.
    let java_script = redis::Script::new(
        "if (redis.call('exists', KEYS[1]) == 0) or (redis.call('hexists', KEYS[1], ARGV[2]) == 1) then \
            local token = redis.call('incr', KEYS[2]); \
            redis.call('hincrby', KEYS[1], ARGV[2], 1); \
            redis.call('pexpire', KEYS[1], ARGV[1]); \
            return {-1, token}; \
        end; \
        return {redis.call('pttl', KEYS[1]), -1};",
    );
    let java_lock = |thread: u64, conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        let script = java_script.clone();
        async move {
            let reply: Vec<i64> = script
                .key(name)
                .key(counter)
                .arg(30_000)
                .arg(format!("java-client:{thread}"))
                .invoke_async(&mut conn)
                .await
                .unwrap();
            reply
        }
    };
    let java_unlock = |conn: &mut redis::aio::MultiplexedConnection| {
        let mut conn = conn.clone();
        async move {
            let _: i64 = redis::cmd("DEL")
                .arg(name)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    };

    let mut last = 0i64;
    for round in 0..6 {
        if round % 2 == 0 {
            let reply = java_lock(1, &mut raw).await;
            assert_eq!(reply[0], -1, "the Java side acquired");
            assert!(reply[1] > last, "java token {} after {last}", reply[1]);
            last = reply[1];
            // tower-lock is excluded meanwhile.
            assert!(lock.try_lock().await.unwrap_err().is_busy());
            java_unlock(&mut raw).await;
        } else {
            let guard = lock.lock().await.unwrap();
            let token = guard.fencing_token().expect("fenced").get() as i64;
            assert!(token > last, "our token {token} after {last}");
            let stored: i64 = redis::cmd("GET")
                .arg(counter)
                .query_async(&mut raw)
                .await
                .unwrap();
            assert_eq!(stored, token, "the shared counter holds our token");
            // The Java side is excluded meanwhile.
            let reply = java_lock(2, &mut raw).await;
            assert!(reply[0] > 0, "busy for Java: {reply:?}");
            last = token;
            guard.unlock().await.unwrap();
        }
    }
    // The counter stays (Redisson's too); the lock does not.
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(keys, vec![counter.to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_release_wakes_one_waiter_per_process() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    // No keepalive during the test: a PING the loaded machine answers late replaces
    // the pub/sub connection, and a new connection rightly wakes every waiter (a
    // release may have been missed) — the herd this test must not count.
    let backend = RedisBackend::builder(server.url())
        .pubsub_keepalive(Duration::from_secs(3600))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("herd").unwrap();
    let holder = client.get_lock(&key).unwrap().lock().await.unwrap();
    let spawn_waiter = || {
        let lock = client.get_lock(&key).unwrap();
        tokio::spawn(async move {
            lock.try_lock_for(Duration::from_secs(20), Lease::Watchdog)
                .await
        })
    };
    // The first waiter: its first attempt, and its retry after subscribing; then it
    // sleeps. (Attempts, not script calls: attempts that meet in flight share one
    // call.)
    let mut waiters = vec![spawn_waiter()];
    wait_until(Duration::from_secs(5), "the first waiter parked", || {
        let mut raw = raw.clone();
        let subscribed = backend.local_waiters(&key) == 1;
        async move { subscribed && acquire_attempts(&mut raw).await == 1 + 2 }
    })
    .await;
    // Four more line up behind it (no attempt while a local waiter waits), try once
    // when their turn does not come within the line-up bound, and sleep.
    waiters.extend((0..4).map(|_| spawn_waiter()));
    wait_until(Duration::from_secs(5), "5 waiters subscribed", || async {
        backend.local_waiters(&key) == 5
    })
    .await;
    // One shared subscription for the five.
    assert_eq!(numsub(&mut raw, &backend.channel_name(&key)).await, 1);
    wait_until(Duration::from_secs(5), "every waiter parked", || {
        let mut raw = raw.clone();
        async move { acquire_attempts(&mut raw).await == 1 + 2 + 4 }
    })
    .await;

    let before = acquire_attempts(&mut raw).await;
    holder.unlock().await.unwrap();
    wait_until(Duration::from_secs(5), "one waiter acquired", || async {
        backend.local_waiters(&key) == 4
    })
    .await;
    // Give any wrongly woken waiter ample time to show up in the stats.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let attempts = acquire_attempts(&mut raw).await - before;
    // One attempt, by the one woken waiter: not five.
    assert_eq!(attempts, 1, "a release woke more than one waiter");
    assert_eq!(backend.local_waiters(&key), 4);

    // Pass the lock down the line: each release lets exactly one more in.
    let mut done = 0;
    while done < 5 {
        let finished: Vec<_> = waiters.extract_if(.., |w| w.is_finished()).collect();
        for w in finished {
            w.await.unwrap().unwrap().unlock().await.unwrap();
            done += 1;
        }
        tokio::task::yield_now().await;
    }
    let channel = backend.channel_name(&key);
    wait_until(
        Duration::from_secs(5),
        "the subscription is dropped with the last waiter",
        || {
            let (mut raw, channel) = (raw.clone(), channel.clone());
            async move { numsub(&mut raw, &channel).await == 0 }
        },
    )
    .await;
}

/// A release is the earliest local waiter's, parked or not. A Redis cluster run of
/// `no_barging_past_local_waiters` saw the other way round: the waiter was registered
/// and still busy with its attempt when the holder released; the releaser asked again,
/// lined up behind it and parked before the release's message reached this process;
/// the message then woke the only parked waiter, the releaser, which took the lock
/// back. (On the current-thread runtime a spawned task runs exactly when this one
/// yields, so the later waiter is parked when the message arrives.)
#[tokio::test]
async fn a_release_wakes_the_earliest_waiter_not_the_one_parked_behind_it() {
    let server = RedisServer::start().await;
    let raw = server.conn().await;
    // No keepalive: a reconnect would rightly wake everyone.
    let backend = RedisBackend::builder(server.url())
        .pubsub_keepalive(Duration::from_secs(3600))
        .build()
        .await
        .unwrap();
    let key = LockKey::new("fifo").unwrap();
    let holder = exclusive(&key, 0);
    assert!(matches!(
        backend.acquire(&holder).await.unwrap(),
        Acquire::Acquired(_)
    ));
    // The channel subscribed on the server first, so that the waiters below find their
    // subscription confirmed (an unconfirmed one wakes when it is).
    let first = backend.subscribe(&exclusive(&key, 1)).await.unwrap();
    let channel = backend.channel_name(&key);
    wait_until(Duration::from_secs(5), "the channel is subscribed", || {
        let (mut raw, channel) = (raw.clone(), channel.clone());
        async move { numsub(&mut raw, &channel).await == 1 }
    })
    .await;
    // Registered, between its attempt and its sleep.
    let mut earlier = backend.subscribe(&exclusive(&key, 2)).await.unwrap();
    // Lined up behind it, and parked.
    let mut later = backend.subscribe(&exclusive(&key, 3)).await.unwrap();
    drop(first);
    later.skip_signalled();
    let parked = tokio::spawn(async move {
        let wake = later.wait(Instant::now() + Duration::from_secs(10)).await;
        (wake, later)
    });
    tokio::task::yield_now().await;
    assert_eq!(backend.release(&holder).await.unwrap(), Release::Released);
    // The message has arrived once the earlier waiter has its wake-up.
    let wake = earlier.wait(Instant::now() + Duration::from_secs(5)).await;
    assert_eq!(wake, Wake::Notified);
    // A wrongly woken waiter would be done at once; this one sleeps on.
    let woke = tokio::time::timeout(Duration::from_millis(200), parked).await;
    assert!(
        woke.is_err(),
        "the waiter lined up behind took the release: {:?}",
        woke.map(|r| r.unwrap().0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_renews_all_locks_in_one_call_per_period() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let lease = Duration::from_millis(600);
    let client = LockClient::builder(backend)
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let mut guards = Vec::new();
    for i in 0..200 {
        guards.push(
            client
                .get_lock(format!("batch:{i}"))
                .unwrap()
                .lock()
                .await
                .unwrap(),
        );
    }
    let before = script_calls(&mut raw).await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(1100)).await; // about five periods of 200 ms
    let calls = script_calls(&mut raw).await - before;
    let periods = started.elapsed().as_millis() as u64 / 200;
    assert!(calls >= 3, "the watchdog renewed: {calls} calls");
    assert!(
        calls <= periods + 1,
        "{calls} renewal calls in {periods} periods for 200 locks"
    );
    for (i, g) in guards.iter().enumerate() {
        assert!(!g.is_lost(), "lock {i} lost");
        let ttl = pttl(&mut raw, &format!("batch:{i}")).await;
        assert!(ttl > 0 && ttl <= 600, "lock {i}: {ttl}");
    }
    for g in guards {
        g.unlock().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watchdog_renews_locks_of_every_kind_in_one_call_per_period() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let lease = Duration::from_millis(600);
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let mut guards = Vec::new();
    for i in 0..200 {
        let name = format!("mixed:{i}");
        let lock = match i % 5 {
            0 => client.get_lock(&name),
            1 => client.get_fair_lock(&name),
            2 => client.get_read_write_lock(&name).map(|rw| rw.read_lock()),
            3 => client.get_read_write_lock(&name).map(|rw| rw.write_lock()),
            _ => client.get_permits(&name, 2),
        };
        guards.push(lock.unwrap().lock().await.unwrap());
    }
    let before = script_calls(&mut raw).await;
    let started = Instant::now();
    tokio::time::sleep(Duration::from_millis(1100)).await; // about five periods of 200 ms
    let calls = script_calls(&mut raw).await - before;
    let periods = started.elapsed().as_millis() as u64 / 200;
    assert!(calls >= 3, "the watchdog renewed: {calls} calls");
    assert!(
        calls <= periods + 1,
        "{calls} renewal calls in {periods} periods for 200 locks of five kinds"
    );
    for (i, g) in guards.iter().enumerate() {
        assert!(!g.is_lost(), "lock {i} ({}) lost", g.mode());
        // Each kind's lease lives where its layout keeps it; all were renewed.
        let name = format!("mixed:{i}");
        let ttl = match i % 5 {
            2 => {
                pttl(
                    &mut raw,
                    &format!("{{{name}}}:{}:rwlock_timeout:1", g.hold_id()),
                )
                .await
            }
            _ => pttl(&mut raw, &name).await,
        };
        // A permit set's keys outlive its last permit by 1 ms (`fit_permits`), so the
        // entry goes first: a renewal read in the same millisecond shows 601.
        let most = if matches!(g.mode(), LockMode::Permits { .. }) {
            601
        } else {
            600
        };
        assert!(ttl > 0 && ttl <= most, "lock {i} ({}): {ttl}", g.mode());
    }
    for g in guards {
        g.unlock().await.unwrap();
    }
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*mixed*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(
        keys.iter().all(|k| k.starts_with("redisson_lock_token:")),
        "left behind: {keys:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_release_costs_at_most_the_holders_ttl() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let (backend, client) = client(&server).await;
    let key = LockKey::new("silent").unwrap();
    let lease = Duration::from_millis(1500);
    let holder = client
        .get_lock(&key)
        .unwrap()
        .try_lock_for(Duration::ZERO, lease)
        .await
        .unwrap();
    let lock = client.get_lock(&key).unwrap();
    let waiter = common::spawn_acquire(lock, Duration::from_secs(20));
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        backend.local_waiters(&key) == 1
    })
    .await;
    // The lock vanishes without a message (as if the release message were lost).
    let deleted_at = Instant::now();
    let _: i64 = redis::cmd("DEL")
        .arg("silent")
        .query_async(&mut raw)
        .await
        .unwrap();
    let (acquired_at, guard) = waiter.await.unwrap().unwrap();
    let waited = acquired_at.duration_since(deleted_at);
    assert!(
        waited < lease + Duration::from_millis(500),
        "waited {waited:?} for a {lease:?} TTL"
    );
    guard.unlock().await.unwrap();
    assert!(matches!(holder.unlock().await, Err(Error::Lost)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_type_and_script_errors_are_typed() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let (_backend, client) = client(&server).await;
    let _: () = redis::cmd("SET")
        .arg("stringly")
        .arg("x")
        .query_async(&mut raw)
        .await
        .unwrap();
    let lock = client.get_lock("stringly").unwrap();
    match lock.try_lock().await {
        Err(error) if error.store_source::<WrongType>().is_some() => {
            assert_eq!(error.store_kind(), Some(StoreErrorKind::Misconfigured));
            assert!(!error.is_retryable());
        }
        other => panic!("expected WrongType, got {other:?}"),
    }
    // The string is untouched.
    let value: String = redis::cmd("GET")
        .arg("stringly")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(value, "x");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connection_refused_is_a_typed_error() {
    let server = RedisServer::start().await;
    let url = server.url();
    drop(server);
    let started = Instant::now();
    match RedisBackend::connect(url.as_str()).await {
        Err(SetupError::Store(e)) => {
            assert_eq!(e.kind(), StoreErrorKind::Unavailable, "{e}");
            let e = e
                .downcast_ref::<redis::RedisError>()
                .expect("redis-rs's error");
            assert!(e.is_connection_refusal() || e.is_io_error(), "{e}");
        }
        Err(other) => panic!("expected a store error, got {other}"),
        Ok(_) => panic!("connected to a stopped server"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    let not_a_url = RedisBackend::connect("not a url").await;
    assert!(
        matches!(&not_a_url, Err(e) if e.store_kind() == Some(StoreErrorKind::Misconfigured)),
        "{not_a_url:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_in_url_and_prefix() {
    let server = RedisServer::start_with(&["--requirepass", "s3cret"]).await;
    let url = format!("redis://:s3cret@127.0.0.1:{}", server.port());
    let backend = RedisBackend::builder(url.as_str())
        .key_prefix("app")
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let guard = client.get_lock("k").unwrap().lock().await.unwrap();
    let mut raw = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let exists: i64 = redis::cmd("EXISTS")
        .arg("app:k")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        exists, 1,
        "the prefix is joined to the lock's name with `:`"
    );
    guard.unlock().await.unwrap();

    let wrong = format!("redis://:nope@127.0.0.1:{}", server.port());
    match RedisBackend::connect(wrong.as_str()).await {
        Err(SetupError::Store(e)) => {
            assert_eq!(e.kind(), StoreErrorKind::Misconfigured, "{e}: fails closed");
            let e = e
                .downcast_ref::<redis::RedisError>()
                .expect("redis-rs's error");
            assert_eq!(e.kind(), redis::ErrorKind::AuthenticationFailed, "{e}");
        }
        other => panic!("a wrong password: {other:?}"),
    }
    let long = "p".repeat(tower_lock::MAX_NAMESPACE_LEN + 1);
    // "app:" was the spelling up to 0.1: refused, naming the setting, not doubled.
    for bad in ["a{b", "x}", "tab\t", long.as_str(), "app:", ":app", "a::b"] {
        match RedisBackend::builder(url.as_str())
            .key_prefix(bad)
            .build()
            .await
        {
            Err(SetupError::Config(ConfigError::InvalidSetting {
                name: "key_prefix", ..
            })) => {}
            other => panic!("prefix {bad:?}: {other:?}"),
        }
    }
}

/// `rediss://` with a private CA: the backend takes a redis-rs client built with the CA,
/// and both its command and pub/sub connections speak TLS.
#[cfg(feature = "tls")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_with_a_private_ca() {
    let server = RedisServer::start_tls().await;
    assert!(server.url().starts_with("rediss://"));
    let backend = RedisBackend::from_client(server.client())
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("tls").unwrap();
    let guard = client.get_lock(&key).unwrap().lock().await.unwrap();
    let lock = client.get_lock(&key).unwrap();
    let waiter = common::spawn_acquire(lock, Duration::from_secs(20));
    wait_until(Duration::from_secs(5), "the waiter subscribed", || async {
        backend.local_waiters(&key) == 1
    })
    .await;
    let released_at = Instant::now();
    guard.unlock().await.unwrap();
    let (acquired_at, g) = waiter.await.unwrap().unwrap();
    assert!(
        acquired_at.duration_since(released_at) < Duration::from_secs(2),
        "pub/sub over TLS"
    );
    g.unlock().await.unwrap();

    // Without the CA, the server's certificate is refused.
    let untrusted = RedisBackend::connect(server.url().as_str()).await;
    assert!(
        matches!(&untrusted, Err(SetupError::Store(e)) if e.downcast_ref::<redis::RedisError>().is_some()),
        "{untrusted:?}"
    );
}

/// The fencing counter vanished (evicted, flushed, a restart without persistence) or went
/// back (an older snapshot): tokens still increase, floored by the server's clock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_fence_counter_never_sends_tokens_back() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let (backend, client) = client(&server).await;
    let key = LockKey::new("fence-gone").unwrap();
    let lock = client.get_fenced_lock(&key).unwrap();
    let mut last = 0;
    for sabotage in ["DEL", "SET 1", "FLUSHALL"] {
        let guard = lock.lock().await.unwrap();
        let token = guard.fencing_token().expect("fenced").get();
        assert!(token > last, "{token} after {last}");
        last = token;
        guard.unlock().await.unwrap();
        let mut cmd = match sabotage {
            "DEL" => redis::cmd("DEL"),
            "SET 1" => redis::cmd("SET"),
            _ => redis::cmd("FLUSHALL"),
        };
        if sabotage != "FLUSHALL" {
            cmd.arg(backend.fence_name(&key));
        }
        if sabotage == "SET 1" {
            cmd.arg(1);
        }
        let _: redis::Value = cmd.query_async(&mut raw).await.unwrap();
    }
    let guard = lock.lock().await.unwrap();
    assert!(guard.fencing_token().expect("fenced").get() > last);
    guard.unlock().await.unwrap();
}

// ---------------------------------------------------------------------------------------
// Group commit of exclusive acquisitions and releases
// ---------------------------------------------------------------------------------------

/// `n` lock names `<prefix>:0`, `<prefix>:1`, ...
fn names(prefix: &str, n: usize) -> Vec<LockKey> {
    (0..n)
        .map(|i| LockKey::new(format!("{prefix}:{i}")).unwrap())
        .collect()
}

fn exclusive(key: &LockKey, n: usize) -> LockRequest {
    LockRequest::new(
        key.clone(),
        HoldId::from_raw(format!("batch-owner:{n}")).unwrap(),
        LockMode::Exclusive,
        Duration::from_secs(30),
    )
}

/// 64 acquisitions of 64 keys started together: the first goes alone, the others meet
/// it in flight and share calls. Every one is answered as if alone, and so are the 64
/// releases; the store holds exactly what was granted, then nothing.
#[tokio::test]
async fn acquisitions_in_flight_together_share_script_calls() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let keys = names("batched", 64);
    let reqs: Vec<LockRequest> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| exclusive(k, i))
        .collect();
    let scripts_before = script_calls(&mut raw).await;
    let acquired = futures_util::future::join_all(reqs.iter().map(|r| backend.acquire(r))).await;
    for (i, a) in acquired.iter().enumerate() {
        assert!(
            matches!(a, Ok(Acquire::Acquired(g)) if g.holds() == 1),
            "acquisition {i}: {a:?}"
        );
    }
    let acquire_calls = script_calls(&mut raw).await - scripts_before;
    assert!(
        acquire_calls < 64,
        "64 acquisitions in flight together took {acquire_calls} script calls"
    );
    assert_eq!(acquire_attempts(&mut raw).await, 64);
    for (i, k) in keys.iter().enumerate() {
        let holder: HashMap<String, i64> = redis::cmd("HGETALL")
            .arg(backend.lock_name(k))
            .query_async(&mut raw)
            .await
            .unwrap();
        assert_eq!(
            holder,
            HashMap::from([(format!("batch-owner:{i}"), 1)]),
            "key {i}"
        );
    }
    // A second owner on every key: busy, in a batch too.
    let others: Vec<LockRequest> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| exclusive(k, 100 + i))
        .collect();
    let busy = futures_util::future::join_all(others.iter().map(|r| backend.acquire(r))).await;
    assert!(
        busy.iter()
            .all(|b| matches!(b, Ok(Acquire::Busy { ttl: Some(_) }))),
        "{busy:?}"
    );
    let released = futures_util::future::join_all(reqs.iter().map(|r| backend.release(r))).await;
    assert!(
        released.iter().all(|r| matches!(r, Ok(Release::Released))),
        "{released:?}"
    );
    let keys_left: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(keys_left.is_empty(), "left in the store: {keys_left:?}");
    let not_held = futures_util::future::join_all(reqs.iter().map(|r| backend.release(r))).await;
    assert!(
        not_held.iter().all(|r| matches!(r, Ok(Release::NotHeld))),
        "{not_held:?}"
    );
    // Fenced, together: every grant has a token above the counter's start, one key's
    // tokens increase, and only the counters stay behind.
    let fenced: Vec<LockRequest> = (0..32)
        .map(|i| exclusive(&keys[i % 4], i).fenced())
        .collect();
    let mut tokens: Vec<Vec<u64>> = vec![Vec::new(); 4];
    for round in 0..8 {
        let batch = &fenced[round * 4..round * 4 + 4];
        let granted =
            futures_util::future::join_all(batch.iter().map(|r| backend.acquire(r))).await;
        for (k, g) in granted.iter().enumerate() {
            match g {
                Ok(Acquire::Acquired(g)) => {
                    tokens[k].push(g.token().expect("a fenced grant").get())
                }
                other => panic!("fenced acquisition {round}/{k}: {other:?}"),
            }
        }
        let released =
            futures_util::future::join_all(batch.iter().map(|r| backend.release(r))).await;
        assert!(
            released.iter().all(|r| matches!(r, Ok(Release::Released))),
            "{released:?}"
        );
    }
    for (k, t) in tokens.iter().enumerate() {
        assert!(t.windows(2).all(|w| w[0] < w[1]), "key {k}: tokens {t:?}");
    }
    let keys_left: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(
        keys_left.len(),
        4,
        "only the fencing counters stay: {keys_left:?}"
    );
}

/// A key holding another type of data fails its own operation in a batch, and only it.
#[tokio::test]
async fn a_wrong_type_key_fails_alone_in_a_batch() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let keys = names("mixed", 16);
    let _: () = redis::cmd("SET")
        .arg(backend.lock_name(&keys[7]))
        .arg("not a hash")
        .query_async(&mut raw)
        .await
        .unwrap();
    let reqs: Vec<LockRequest> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| exclusive(k, i))
        .collect();
    let scripts_before = script_calls(&mut raw).await;
    let acquired = futures_util::future::join_all(reqs.iter().map(|r| backend.acquire(r))).await;
    assert!(
        script_calls(&mut raw).await - scripts_before < 16,
        "no batch was formed"
    );
    for (i, a) in acquired.iter().enumerate() {
        if i == 7 {
            assert!(
                matches!(a, Err(e) if e.store_source::<WrongType>().is_some()),
                "the string key: {a:?}"
            );
        } else {
            assert!(
                matches!(a, Ok(Acquire::Acquired(_))),
                "acquisition {i}: {a:?}"
            );
        }
    }
    let released = futures_util::future::join_all(reqs.iter().map(|r| backend.release(r))).await;
    for (i, r) in released.iter().enumerate() {
        if i == 7 {
            assert!(
                matches!(r, Err(e) if e.store_source::<WrongType>().is_some()),
                "the string key: {r:?}"
            );
        } else {
            assert!(matches!(r, Ok(Release::Released)), "release {i}: {r:?}");
        }
    }
}

/// The caller whose call is in flight gives up (its future is dropped): the operations
/// queued behind it are still sent and answered.
#[tokio::test]
async fn a_dropped_caller_does_not_strand_the_queued_operations() {
    let server = RedisServer::start().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let first_key = LockKey::new("stranded:first").unwrap();
    let first = exclusive(&first_key, 0);
    let mut alone = backend.acquire(&first);
    // One poll: it is sent, and the batcher is busy with it.
    assert!(
        tokio::time::timeout(Duration::ZERO, &mut alone)
            .await
            .is_err()
    );
    let queued: Vec<_> = (1..=8)
        .map(|i| {
            let backend = backend.clone();
            tokio::spawn(async move {
                let key = LockKey::new(format!("stranded:{i}")).unwrap();
                backend.acquire(&exclusive(&key, i)).await
            })
        })
        .collect();
    // Let the spawned ones queue up, then drop the caller in flight.
    tokio::task::yield_now().await;
    drop(alone);
    for (i, task) in queued.into_iter().enumerate() {
        let outcome = tokio::time::timeout(Duration::from_secs(5), task)
            .await
            .unwrap_or_else(|_| panic!("queued acquisition {i} was never answered"))
            .unwrap();
        assert!(matches!(outcome, Ok(Acquire::Acquired(_))), "{outcome:?}");
    }
}

/// A backend shared by two runtimes: the one whose task carries a batch shuts down with
/// operations in flight and queued. The other runtime's operations still go through (the
/// batcher does not stay busy forever), and the stranded callers got an error or an
/// answer, never a hang.
#[test]
fn a_runtime_shutting_down_mid_batch_leaves_the_batcher_usable() {
    let b = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = b.block_on(RedisServer::start());
    let backend = b.block_on(RedisBackend::connect(server.url())).unwrap();
    for round in 0..5 {
        let a = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let shared = backend.clone();
        let started = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = started.clone();
        a.spawn(async move {
            let reqs: Vec<LockRequest> = (0..32)
                .map(|i| exclusive(&LockKey::new(format!("rt:{round}:{i}")).unwrap(), i))
                .collect();
            counter.store(1, std::sync::atomic::Ordering::SeqCst);
            let _ = futures_util::future::join_all(reqs.iter().map(|r| shared.acquire(r))).await;
        });
        // Run runtime A just long enough to send and queue, then shut it down.
        a.block_on(async {
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
        });
        assert_eq!(started.load(std::sync::atomic::Ordering::SeqCst), 1);
        drop(a);
        let key = LockKey::new(format!("rt:after:{round}")).unwrap();
        let outcome = b.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(5),
                backend.acquire(&exclusive(&key, 999)),
            )
            .await
        });
        assert!(
            matches!(outcome, Ok(Ok(Acquire::Acquired(_)))),
            "round {round}: {outcome:?}"
        );
    }
    drop(backend);
    b.block_on(async move { drop(server) });
}

/// Regression (issue 24, item 10): a Redis that is down at startup failed the build with
/// "connection refused" and no server named. The error names `host:port`, never the
/// password of the URL, and is an outage.
#[tokio::test]
async fn a_server_down_at_startup_is_named_without_its_password() {
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let url = format!("redis://:s3cret-pw@127.0.0.1:{port}/0");
    let err = RedisBackend::builder(url.as_str())
        .connection_timeout(Duration::from_millis(500))
        .build()
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains(&format!("cannot connect to Redis at 127.0.0.1:{port}")),
        "{message}"
    );
    assert!(!message.contains("s3cret-pw"), "{message}");
    assert!(err.is_unavailable(), "{err:?}");
}

/// The channel Redisson listens on for a release of lock hash `name`: its
/// `prefixName("redisson_lock__channel", name)`, computed here by Redisson's rule rather
/// than by the crate.
fn redisson_channel(name: &str) -> String {
    if name.contains('{') {
        format!("redisson_lock__channel:{name}")
    } else {
        format!("redisson_lock__channel:{{{name}}}")
    }
}

/// The release scripts write the release channel's name themselves (it is not sent):
/// for every shape of name (plain, hash-tagged, tagged mid-name, non-ASCII; with and
/// without a key prefix), a release alone and releases in one batch call publish `0`
/// on exactly the channel Redisson listens on, once each, and on nothing else.
#[tokio::test]
async fn releases_publish_on_redissons_channel_alone_and_in_a_batch() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let mut pubsub = redis::Client::open(server.url())
        .unwrap()
        .get_async_pubsub()
        .await
        .unwrap();
    pubsub.psubscribe("*").await.unwrap();
    let mut messages = pubsub.on_message();
    let shapes = |i: usize| {
        [
            format!("plain{i}"),
            format!("lock:order:{{{i}}}"),
            format!("a{{b{i}}}c"),
            format!("é{i}:{{ü}}"),
        ]
    };
    for prefix in ["", "app"] {
        let mut builder = RedisBackend::builder(server.url());
        if !prefix.is_empty() {
            builder = builder.key_prefix(prefix);
        }
        let backend = builder.build().await.unwrap();
        let name_of = |key: &LockKey| {
            let name = backend.lock_name(key);
            assert!(name.ends_with(key.as_str()), "{name}");
            name
        };
        // Alone: one lock at a time, each release its own call.
        let mut expected = Vec::new();
        for (i, key) in shapes(0).into_iter().enumerate() {
            let key = LockKey::new(key).unwrap();
            let req = exclusive(&key, i);
            assert!(matches!(
                backend.acquire(&req).await,
                Ok(Acquire::Acquired(_))
            ));
            assert!(matches!(backend.release(&req).await, Ok(Release::Released)));
            expected.push(redisson_channel(&name_of(&key)));
        }
        // Together: 64 releases in flight at once share calls of the batch script.
        let keys: Vec<LockKey> = (1..=16)
            .flat_map(shapes)
            .map(|k| LockKey::new(k).unwrap())
            .collect();
        let reqs: Vec<LockRequest> = keys
            .iter()
            .enumerate()
            .map(|(i, k)| exclusive(k, i))
            .collect();
        for req in &reqs {
            assert!(matches!(
                backend.acquire(req).await,
                Ok(Acquire::Acquired(_))
            ));
        }
        let before = script_calls(&mut raw).await;
        let released =
            futures_util::future::join_all(reqs.iter().map(|r| backend.release(r))).await;
        assert!(
            released.iter().all(|r| matches!(r, Ok(Release::Released))),
            "{released:?}"
        );
        let calls = script_calls(&mut raw).await - before;
        assert!(
            calls < 64,
            "64 releases in flight together took {calls} calls"
        );
        expected.extend(keys.iter().map(|k| redisson_channel(&name_of(k))));

        // Everything published before the marker has been delivered before it.
        let marker = format!("marker:{prefix}");
        let _: i64 = redis::cmd("PUBLISH")
            .arg(&marker)
            .arg("end")
            .query_async(&mut raw)
            .await
            .unwrap();
        let mut heard = Vec::new();
        loop {
            let message = tokio::time::timeout(Duration::from_secs(5), messages.next())
                .await
                .expect("the marker arrives")
                .expect("the subscription stays open");
            let channel = message.get_channel_name().to_owned();
            if channel == marker {
                break;
            }
            let payload: String = message.get_payload().unwrap();
            assert_eq!(payload, "0", "on {channel}");
            heard.push(channel);
        }
        heard.sort();
        expected.sort();
        let missing: Vec<_> = expected.iter().filter(|c| !heard.contains(c)).collect();
        let stray: Vec<_> = heard.iter().filter(|c| !expected.contains(c)).collect();
        assert!(
            missing.is_empty() && stray.is_empty(),
            "prefix {prefix:?}: nothing heard on {missing:?}; heard on {stray:?}"
        );
        assert_eq!(heard, expected, "prefix {prefix:?}: one message each");
    }
}

/// Only a fenced acquisition sends a second key (its counter), so a batch's keys are
/// read with a cursor: fenced and unfenced acquisitions and releases mixed in the same
/// calls each act on their own lock, and counters appear for the fenced names only.
#[tokio::test]
async fn a_batch_mixing_fenced_and_unfenced_operations_reads_each_its_own_keys() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let backend = RedisBackend::connect(server.url()).await.unwrap();
    let keys = names("mixed", 64);
    // Every third name fenced.
    let reqs: Vec<LockRequest> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let req = exclusive(k, i);
            if i % 3 == 0 { req.fenced() } else { req }
        })
        .collect();
    // The first half taken alone, beforehand.
    for req in &reqs[..32] {
        assert!(matches!(
            backend.acquire(req).await,
            Ok(Acquire::Acquired(_))
        ));
    }
    // Then, all in flight together: the second half taken, the first half released.
    let before = script_calls(&mut raw).await;
    let (taken, released) = tokio::join!(
        futures_util::future::join_all(reqs[32..].iter().map(|r| backend.acquire(r))),
        futures_util::future::join_all(reqs[..32].iter().map(|r| backend.release(r))),
    );
    let calls = script_calls(&mut raw).await - before;
    assert!(
        calls < 64,
        "64 operations in flight together took {calls} calls"
    );
    for (i, outcome) in taken.iter().enumerate() {
        let i = i + 32;
        match outcome {
            Ok(Acquire::Acquired(grant)) => assert_eq!(
                grant.token().is_some(),
                i % 3 == 0,
                "name {i}: a token exactly when fenced"
            ),
            other => panic!("name {i}: {other:?}"),
        }
    }
    assert!(
        released.iter().all(|r| matches!(r, Ok(Release::Released))),
        "{released:?}"
    );
    for (i, key) in keys.iter().enumerate() {
        let holder = hgetall(&mut raw, &backend.lock_name(key)).await;
        let expected = if i < 32 {
            HashMap::new()
        } else {
            HashMap::from([(format!("batch-owner:{i}"), "1".to_owned())])
        };
        assert_eq!(holder, expected, "name {i}");
    }
    let mut counters: Vec<String> = redis::cmd("KEYS")
        .arg("redisson_lock_token:*")
        .query_async(&mut raw)
        .await
        .unwrap();
    counters.sort();
    let mut fenced: Vec<String> = (0..64)
        .filter(|i| i % 3 == 0)
        .map(|i| format!("redisson_lock_token:{{mixed:{i}}}"))
        .collect();
    fenced.sort();
    assert_eq!(
        counters, fenced,
        "a counter for each fenced name, and no other"
    );
}
