//! Redisson wire compatibility of the fair and read-write locks: a Redisson client,
//! played with raw commands following the protocol of Redisson 3.x's `RFairLock` and
//! `RReadWriteLock` scripts, and tower-lock share one lock on one real redis-server.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::redis_server::RedisServer;
use common::wait_until;
use futures_util::StreamExt;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;
use tower_lock::{LockClient, LockKey, RedisBackend};

/// Redisson's read lock `tryLock`: nil when acquired, else the hash's PTTL. A read hold
/// is a count in the hash plus one lease key per hold.
///
/// KEYS: lock, this thread's lease-key prefix (`{NAME}:<field>:rwlock_timeout`).
/// ARGV: lease ms, field, field + `:write`.
const REDISSON_READ_LOCK: &str = r"
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
    redis.call('hset', KEYS[1], 'mode', 'read')
    redis.call('hset', KEYS[1], ARGV[2], 1)
    redis.call('set', KEYS[2] .. ':1', 1, 'px', ARGV[1])
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end
if mode == 'read' or (mode == 'write' and redis.call('hexists', KEYS[1], ARGV[3]) == 1) then
    local n = redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('set', KEYS[2] .. ':' .. n, 1, 'px', ARGV[1])
    redis.call('pexpire', KEYS[1], math.max(redis.call('pttl', KEYS[1]), tonumber(ARGV[1])))
    return nil
end
return redis.call('pttl', KEYS[1])";

/// Redisson's read unlock: nil when not held, 0 when other holds keep the lock (its
/// lease recomputed over every hold's lease keys), 1 when released (`0` published).
///
/// KEYS: lock, channel, this thread's lease-key prefix, `{NAME}`. ARGV: `0`, field.
const REDISSON_READ_UNLOCK: &str = r"
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
    redis.call('publish', KEYS[2], ARGV[1])
    return 1
end
if redis.call('hexists', KEYS[1], ARGV[2]) == 0 then
    return nil
end
local n = redis.call('hincrby', KEYS[1], ARGV[2], -1)
if n == 0 then
    redis.call('hdel', KEYS[1], ARGV[2])
end
redis.call('del', KEYS[3] .. ':' .. (n + 1))
if redis.call('hlen', KEYS[1]) > 1 then
    local longest = -3
    for _, field in ipairs(redis.call('hkeys', KEYS[1])) do
        local count = tonumber(redis.call('hget', KEYS[1], field))
        if type(count) == 'number' then
            for i = count, 1, -1 do
                local ttl = redis.call('pttl', KEYS[4] .. ':' .. field .. ':rwlock_timeout:' .. i)
                longest = math.max(ttl, longest)
            end
        end
    end
    if longest > 0 then
        redis.call('pexpire', KEYS[1], longest)
        return 0
    end
    if mode == 'write' then
        return 0
    end
end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], ARGV[1])
return 1";

/// Redisson's write lock `tryLock`. KEYS: lock. ARGV: lease ms, field + `:write`.
const REDISSON_WRITE_LOCK: &str = r"
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
    redis.call('hset', KEYS[1], 'mode', 'write')
    redis.call('hset', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end
if mode == 'write' and redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], redis.call('pttl', KEYS[1]) + tonumber(ARGV[1]))
    return nil
end
return redis.call('pttl', KEYS[1])";

/// Redisson's write unlock: `1` published when the lock is free, mode `read` when the
/// writer's own read holds remain. KEYS: lock, channel. ARGV: `1`, lease ms, field +
/// `:write`.
const REDISSON_WRITE_UNLOCK: &str = r"
local mode = redis.call('hget', KEYS[1], 'mode')
if mode == false then
    redis.call('publish', KEYS[2], ARGV[1])
    return 1
end
if mode == 'write' then
    if redis.call('hexists', KEYS[1], ARGV[3]) == 0 then
        return nil
    end
    local n = redis.call('hincrby', KEYS[1], ARGV[3], -1)
    if n > 0 then
        redis.call('pexpire', KEYS[1], ARGV[2])
        return 0
    end
    redis.call('hdel', KEYS[1], ARGV[3])
    if redis.call('hlen', KEYS[1]) == 1 then
        redis.call('del', KEYS[1])
        redis.call('publish', KEYS[2], ARGV[1])
    else
        redis.call('hset', KEYS[1], 'mode', 'read')
    end
    return 1
end
return nil";

/// Redisson's fair lock `tryLock` (the variant that returns a TTL): evict stale heads
/// (timeouts in the client's clock), take a free lock when nobody waits or this thread is
/// the head, re-enter, or queue with a timeout chained from the last waiter's and return
/// a TTL. Every acquisition shortens every waiter's timeout by the thread wait time.
///
/// KEYS: lock, queue, timeouts. ARGV: lease ms, field, thread wait ms, now ms.
const REDISSON_FAIR_LOCK: &str = r"
local now = tonumber(ARGV[4])
while true do
    local head = redis.call('lindex', KEYS[2], 0)
    if head == false then break end
    local at = tonumber(redis.call('zscore', KEYS[3], head))
    if at <= now then
        redis.call('zrem', KEYS[3], head)
        redis.call('lpop', KEYS[2])
    else
        break
    end
end
if redis.call('exists', KEYS[1]) == 0 and (redis.call('exists', KEYS[2]) == 0
        or redis.call('lindex', KEYS[2], 0) == ARGV[2]) then
    redis.call('lpop', KEYS[2])
    redis.call('zrem', KEYS[3], ARGV[2])
    for _, waiter in ipairs(redis.call('zrange', KEYS[3], 0, -1)) do
        redis.call('zincrby', KEYS[3], -tonumber(ARGV[3]), waiter)
    end
    redis.call('hset', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    return nil
end
local mine = redis.call('zscore', KEYS[3], ARGV[2])
if mine ~= false then
    return tonumber(mine) - tonumber(ARGV[3]) - now
end
local last = redis.call('lindex', KEYS[2], -1)
local ttl
if last ~= false and last ~= ARGV[2] then
    ttl = tonumber(redis.call('zscore', KEYS[3], last)) - now
else
    ttl = redis.call('pttl', KEYS[1])
end
if redis.call('zadd', KEYS[3], ttl + tonumber(ARGV[3]) + now, ARGV[2]) == 1 then
    redis.call('rpush', KEYS[2], ARGV[2])
end
return ttl";

/// Redisson's fair unlock: evict stale heads, release, and publish `0` on the channel of
/// the next waiter, `<channel>:<its field>`. KEYS: lock, queue, timeouts, channel.
/// ARGV: `0`, lease ms, field, now ms.
const REDISSON_FAIR_UNLOCK: &str = r"
local now = tonumber(ARGV[4])
while true do
    local head = redis.call('lindex', KEYS[2], 0)
    if head == false then break end
    local at = tonumber(redis.call('zscore', KEYS[3], head))
    if at <= now then
        redis.call('zrem', KEYS[3], head)
        redis.call('lpop', KEYS[2])
    else
        break
    end
end
if redis.call('exists', KEYS[1]) == 0 then
    local next = redis.call('lindex', KEYS[2], 0)
    if next ~= false then
        redis.call('publish', KEYS[4] .. ':' .. next, ARGV[1])
    end
    return 1
end
if redis.call('hexists', KEYS[1], ARGV[3]) == 0 then
    return nil
end
local n = redis.call('hincrby', KEYS[1], ARGV[3], -1)
if n > 0 then
    redis.call('pexpire', KEYS[1], ARGV[2])
    return 0
end
redis.call('del', KEYS[1])
local next = redis.call('lindex', KEYS[2], 0)
if next ~= false then
    redis.call('publish', KEYS[4] .. ':' .. next, ARGV[1])
end
return 1";

/// Redisson's thread wait time in the fair-lock play: below the tower-lock waiters'
/// timeout, so that the shortening a Redisson acquisition applies to every waiter does
/// not make them stale (with Redisson's default of 5 minutes it would; see the README).
const THREAD_WAIT_MS: u64 = 5_000;

/// A Redisson client, played with raw commands.
struct Redisson {
    conn: MultiplexedConnection,
    id: &'static str,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

impl Redisson {
    fn field(&self, thread: u64) -> String {
        format!("{}:{thread}", self.id)
    }

    async fn read_lock(&mut self, name: &str, thread: u64) -> Option<i64> {
        let field = self.field(thread);
        redis::Script::new(REDISSON_READ_LOCK)
            .key(name)
            .key(format!("{{{name}}}:{field}:rwlock_timeout"))
            .arg(30_000)
            .arg(&field)
            .arg(format!("{field}:write"))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn read_unlock(&mut self, name: &str, thread: u64) -> Option<i64> {
        let field = self.field(thread);
        redis::Script::new(REDISSON_READ_UNLOCK)
            .key(name)
            .key(format!("redisson_rwlock:{{{name}}}"))
            .key(format!("{{{name}}}:{field}:rwlock_timeout"))
            .key(format!("{{{name}}}"))
            .arg(0)
            .arg(&field)
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn write_lock(&mut self, name: &str, thread: u64) -> Option<i64> {
        redis::Script::new(REDISSON_WRITE_LOCK)
            .key(name)
            .arg(30_000)
            .arg(format!("{}:write", self.field(thread)))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn write_unlock(&mut self, name: &str, thread: u64) -> Option<i64> {
        redis::Script::new(REDISSON_WRITE_UNLOCK)
            .key(name)
            .key(format!("redisson_rwlock:{{{name}}}"))
            .arg(1)
            .arg(30_000)
            .arg(format!("{}:write", self.field(thread)))
            .invoke_async(&mut self.conn)
            .await
            .unwrap()
    }

    async fn fair_lock(&mut self, name: &str, thread: u64) -> Option<i64> {
        self.fair_lock_waiting(name, thread, THREAD_WAIT_MS).await
    }

    /// `fair_lock` with a given `threadWaitTime`.
    async fn fair_lock_waiting(&mut self, name: &str, thread: u64, wait_ms: u64) -> Option<i64> {
        self.fair_lock_cmd(name, thread, wait_ms)
            .query_async(&mut self.conn)
            .await
            .unwrap()
    }

    /// The command of `fair_lock_waiting`, a plain `EVAL` so that it can go into a
    /// transaction.
    fn fair_lock_cmd(&self, name: &str, thread: u64, wait_ms: u64) -> redis::Cmd {
        let mut cmd = redis::cmd("EVAL");
        cmd.arg(REDISSON_FAIR_LOCK)
            .arg(3)
            .arg(name)
            .arg(format!("redisson_lock_queue:{{{name}}}"))
            .arg(format!("redisson_lock_timeout:{{{name}}}"))
            .arg(30_000)
            .arg(self.field(thread))
            .arg(wait_ms)
            .arg(now_ms());
        cmd
    }

    async fn fair_unlock(&mut self, name: &str, thread: u64) -> Option<i64> {
        redis::Script::new(REDISSON_FAIR_UNLOCK)
            .key(name)
            .key(format!("redisson_lock_queue:{{{name}}}"))
            .key(format!("redisson_lock_timeout:{{{name}}}"))
            .key(format!("redisson_lock__channel:{{{name}}}"))
            .arg(0)
            .arg(30_000)
            .arg(self.field(thread))
            .arg(now_ms())
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

async fn llen(conn: &mut MultiplexedConnection, key: &str) -> i64 {
    redis::cmd("LLEN").arg(key).query_async(conn).await.unwrap()
}

/// A raw subscriber, as a Redisson waiter listens.
async fn listen(server: &RedisServer, channel: &str) -> redis::aio::PubSub {
    let mut pubsub = server.client().get_async_pubsub().await.unwrap();
    pubsub.subscribe(channel).await.unwrap();
    pubsub
}

async fn next_message(pubsub: &mut redis::aio::PubSub) -> (String, Vec<u8>) {
    let msg = tokio::time::timeout(Duration::from_secs(5), pubsub.on_message().next())
        .await
        .expect("a message within 5 s")
        .expect("the subscription is open");
    (
        msg.get_channel_name().to_owned(),
        msg.get_payload_bytes().to_vec(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redisson_read_write_lock_and_tower_lock_share_one_lock() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let mut redisson = Redisson {
        conn: server.conn().await,
        id: "7c1d0b2e-redisson-client",
    };
    // A short waiter timeout: tower-lock waiters poll every 100 ms, which is how they
    // notice a Redisson unlock (Redisson publishes on its shared channel only).
    let backend = RedisBackend::builder(server.url())
        .waiter_timeout(Duration::from_millis(300))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    let name = "doc";
    let rw = client.get_read_write_lock(name).unwrap();
    let channel = "redisson_rwlock:{doc}";

    // A Redisson reader and a tower-lock reader share the lock, in Redisson's layout.
    assert_eq!(redisson.read_lock(name, 1).await, None);
    let ours = rw.read_lock().try_lock().await.expect("readers share");
    let fields = hgetall(&mut raw, name).await;
    assert_eq!(
        fields,
        HashMap::from([
            ("mode".to_owned(), "read".to_owned()),
            (redisson.field(1), "1".to_owned()),
            (ours.hold_id().to_string(), "1".to_owned()),
        ])
    );
    // Inspection reads both read holds, each with its own lease key's ttl.
    let state = rw.read_lock().inspect().await.unwrap();
    assert_eq!(state.holders.len(), 2, "{state:?}");
    for h in &state.holders {
        assert_eq!((h.mode, h.holds), (tower_lock::LockMode::Read, 1), "{h:?}");
        assert!(h.ttl.is_some_and(|t| t > Duration::from_secs(20)), "{h:?}");
    }
    assert!(
        state
            .holders
            .iter()
            .any(|h| h.hold_id.as_str() == redisson.field(1))
    );
    let our_lease_key = format!("{{doc}}:{}:rwlock_timeout:1", ours.hold_id());
    let lease_left = pttl(&mut raw, &our_lease_key).await;
    assert!(
        lease_left > 25_000 && lease_left <= 30_000,
        "our read hold has Redisson's lease key: {lease_left}"
    );
    // Writers of either side are kept out.
    assert!(rw.write_lock().try_lock().await.unwrap_err().is_busy());
    let busy = redisson.write_lock(name, 2).await;
    assert!(busy.is_some_and(|ttl| ttl > 0), "{busy:?}");

    // Redisson's read unlock counts our reader's lease: the lock stays read-locked.
    assert_eq!(redisson.read_unlock(name, 1).await, Some(0));
    assert_eq!(
        hgetall(&mut raw, name)
            .await
            .get("mode")
            .map(String::as_str),
        Some("read")
    );
    assert!(pttl(&mut raw, name).await > 25_000);
    assert!(rw.write_lock().try_lock().await.unwrap_err().is_busy());
    assert!(redisson.write_lock(name, 2).await.is_some());

    // Our last read unlock frees the lock and tells Redisson waiters with its `0`.
    let mut waiting = listen(&server, channel).await;
    ours.unlock().await.unwrap();
    assert_eq!(
        next_message(&mut waiting).await,
        (channel.to_owned(), b"0".to_vec())
    );
    assert!(hgetall(&mut raw, name).await.is_empty());

    // Our writer excludes Redisson readers and writers; its unlock publishes `1`.
    let writer = rw.write_lock().try_lock().await.unwrap();
    assert_eq!(
        hgetall(&mut raw, name).await,
        HashMap::from([
            ("mode".to_owned(), "write".to_owned()),
            (format!("{}:write", writer.hold_id()), "1".to_owned()),
        ])
    );
    assert!(redisson.read_lock(name, 3).await.is_some_and(|t| t > 0));
    assert!(redisson.write_lock(name, 3).await.is_some_and(|t| t > 0));
    assert_eq!(redisson.write_unlock(name, 3).await, None, "not its lock");
    writer.unlock().await.unwrap();
    assert_eq!(
        next_message(&mut waiting).await,
        (channel.to_owned(), b"1".to_vec())
    );

    // A Redisson writer excludes our readers; they get in soon after its unlock.
    assert_eq!(redisson.write_lock(name, 4).await, None);
    assert!(rw.read_lock().try_lock().await.unwrap_err().is_busy());
    let reader = common::spawn_acquire(rw.read_lock(), Duration::from_secs(10));
    wait_until(Duration::from_secs(5), "our reader queued", || async {
        llen(&mut raw.clone(), "redisson_lock_queue:{doc}").await == 1
    })
    .await;
    let unlocked_at = Instant::now();
    assert_eq!(redisson.write_unlock(name, 4).await, Some(1));
    let (acquired_at, guard) = reader.await.unwrap().unwrap();
    assert!(
        acquired_at.duration_since(unlocked_at) < Duration::from_secs(1),
        "our reader got in {:?} after Redisson's unlock",
        acquired_at.duration_since(unlocked_at)
    );
    // And a Redisson writer is kept out by it, a Redisson reader is not.
    assert!(redisson.write_lock(name, 5).await.is_some());
    assert_eq!(redisson.read_lock(name, 5).await, None);
    assert_eq!(redisson.read_unlock(name, 5).await, Some(0));
    guard.unlock().await.unwrap();
    assert!(hgetall(&mut raw, name).await.is_empty());
    let leases: Vec<String> = redis::cmd("KEYS")
        .arg("*rwlock_timeout*")
        .query_async(&mut raw)
        .await
        .unwrap();
    assert!(leases.is_empty(), "lease keys left: {leases:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redisson_fair_lock_and_tower_lock_share_one_queue() {
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let mut redisson = Redisson {
        conn: server.conn().await,
        id: "3a9f4d61-redisson-client",
    };
    // Waiters here poll only every 10 s: a hand-over within a second is a wake-up.
    let backend = RedisBackend::builder(server.url())
        .waiter_timeout(Duration::from_secs(30))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let name = "payouts";
    let queue = "redisson_lock_queue:{payouts}";

    // Ours holds; a Redisson thread queues; then one of ours queues behind it.
    let holder = client.get_fair_lock(name).unwrap().lock().await.unwrap();
    let ttl = redisson.fair_lock(name, 1).await;
    assert!(ttl.is_some_and(|t| t > 0), "{ttl:?}");
    let ours = common::spawn_acquire(client.get_fair_lock(name).unwrap(), Duration::from_secs(20));
    wait_until(Duration::from_secs(5), "our waiter queued", || async {
        llen(&mut raw.clone(), queue).await == 2
    })
    .await;
    let entries: Vec<String> = redis::cmd("LRANGE")
        .arg(queue)
        .arg(0)
        .arg(-1)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(entries[0], redisson.field(1), "Redisson's thread is first");

    // Our unlock tells the Redisson thread at the head, on its own channel.
    let redisson_channel = format!("redisson_lock__channel:{{payouts}}:{}", redisson.field(1));
    let mut told = listen(&server, &redisson_channel).await;
    holder.unlock().await.unwrap();
    assert_eq!(
        next_message(&mut told).await,
        (redisson_channel.clone(), b"0".to_vec())
    );
    assert!(!ours.is_finished(), "our waiter jumped the Redisson thread");
    assert_eq!(redisson.fair_lock(name, 1).await, None, "the head takes it");

    // Redisson's unlock tells our waiter, now at the head, on its own channel; a
    // Redisson newcomer does not get in ahead of it.
    let unlocked_at = Instant::now();
    assert_eq!(redisson.fair_unlock(name, 1).await, Some(1));
    let newcomer = redisson.fair_lock(name, 2).await;
    assert!(
        newcomer.is_some(),
        "a Redisson newcomer barged: {newcomer:?}"
    );
    let (acquired_at, guard) = ours.await.unwrap().unwrap();
    assert!(
        acquired_at.duration_since(unlocked_at) < Duration::from_secs(1),
        "our waiter got in {:?} after Redisson's unlock",
        acquired_at.duration_since(unlocked_at)
    );
    assert_eq!(
        hgetall(&mut raw, name).await,
        HashMap::from([(guard.hold_id().to_string(), "1".to_owned())])
    );

    // The Redisson newcomer is next, and hears our unlock.
    let second_channel = format!("redisson_lock__channel:{{payouts}}:{}", redisson.field(2));
    let mut second = listen(&server, &second_channel).await;
    guard.unlock().await.unwrap();
    assert_eq!(
        next_message(&mut second).await,
        (second_channel, b"0".to_vec())
    );
    assert_eq!(redisson.fair_lock(name, 2).await, None);
    assert_eq!(redisson.fair_unlock(name, 2).await, Some(1));
    assert_eq!(llen(&mut raw, queue).await, 0);
    assert_eq!(
        backend.local_waiters(&LockKey::new(name).unwrap()),
        0,
        "no subscription left"
    );
}

/// With Redisson's default `threadWaitTime` (5 minutes) — far above tower-lock's waiter
/// timeout — a Redisson client taking the fair lock from the queue makes every tower-lock
/// waiter queued at that moment look stale: the next script evicts it, it rejoins at the
/// tail at its next poll, and a Redisson waiter that came later goes first. What the
/// docs promise for mixed queues still holds: exclusion, and our waiter gets the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_redissons_default_thread_wait_time_a_handoff_sends_our_waiters_to_the_tail() {
    const REDISSON_DEFAULT_WAIT_MS: u64 = 300_000;
    let server = RedisServer::start().await;
    let mut raw = server.conn().await;
    let mut redisson = Redisson {
        conn: server.conn().await,
        id: "7c2e9b10-redisson-client",
    };
    // Our waiters poll every second.
    let backend = RedisBackend::builder(server.url())
        .waiter_timeout(Duration::from_secs(3))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let name = "ledger";
    let queue = "redisson_lock_queue:{ledger}";
    let queued = |raw: &MultiplexedConnection| {
        let mut raw = raw.clone();
        async move {
            let entries: Vec<String> = redis::cmd("LRANGE")
                .arg(queue)
                .arg(0)
                .arg(-1)
                .query_async(&mut raw)
                .await
                .unwrap();
            entries
        }
    };

    let holder = client.get_fair_lock(name).unwrap().lock().await.unwrap();
    assert!(
        redisson
            .fair_lock_waiting(name, 1, REDISSON_DEFAULT_WAIT_MS)
            .await
            .is_some()
    );
    let ours = common::spawn_acquire(client.get_fair_lock(name).unwrap(), Duration::from_secs(20));
    wait_until(Duration::from_secs(5), "our waiter queued", || async {
        queued(&raw).await.len() == 2
    })
    .await;

    holder.unlock().await.unwrap();
    // The Redisson head takes it, subtracting 5 minutes from our waiter's eviction time;
    // a Redisson newcomer's script then evicts our (now stale) waiter and queues itself.
    // Both in one transaction, with the read of the queue: our waiter polls every
    // second, and a poll between the take and the newcomer would re-queue it ahead of
    // the newcomer (then nobody overtakes), one between the newcomer and the read would
    // already have re-queued it behind.
    let (taken, newcomer, queue_after): (Option<i64>, Option<i64>, Vec<String>) = redis::pipe()
        .atomic()
        .add_command(redisson.fair_lock_cmd(name, 1, REDISSON_DEFAULT_WAIT_MS))
        .add_command(redisson.fair_lock_cmd(name, 2, REDISSON_DEFAULT_WAIT_MS))
        .cmd("LRANGE")
        .arg(queue)
        .arg(0)
        .arg(-1)
        .query_async(&mut raw)
        .await
        .unwrap();
    assert_eq!(taken, None, "the Redisson head takes it");
    assert!(newcomer.is_some(), "the Redisson newcomer waits");
    assert_eq!(
        queue_after,
        vec![redisson.field(2)],
        "our waiter was evicted"
    );
    // Our waiter rejoins, at the tail, at its next poll.
    wait_until(
        Duration::from_secs(5),
        "our waiter rejoined the queue",
        || async { queued(&raw).await.len() == 2 },
    )
    .await;
    assert_eq!(queued(&raw).await[0], redisson.field(2), "overtaken");

    assert_eq!(redisson.fair_unlock(name, 1).await, Some(1));
    assert!(
        !ours.is_finished(),
        "exclusion: the Redisson newcomer is next"
    );
    assert_eq!(
        redisson
            .fair_lock_waiting(name, 2, REDISSON_DEFAULT_WAIT_MS)
            .await,
        None
    );
    assert!(!ours.is_finished());
    assert_eq!(redisson.fair_unlock(name, 2).await, Some(1));
    let (_, guard) = ours
        .await
        .unwrap()
        .expect("our waiter gets the lock in the end");
    assert_eq!(
        hgetall(&mut raw, name).await,
        HashMap::from([(guard.hold_id().to_string(), "1".to_owned())])
    );
    guard.unlock().await.unwrap();
    assert_eq!(llen(&mut raw, queue).await, 0);
}
