//! Wake-ups on a Redis Cluster (feature `cluster`): sharded pub/sub on Redis 7, as
//! Redisson uses it there (`SPUBLISH`/`SSUBSCRIBE` on `redisson_lock__channel:{NAME}`),
//! both ways with a Redisson-style peer, the classic fallback, and a slot that moves to
//! another master while a waiter listens on it.
//!
//! Every waiter here would get its lock anyway once the holder's 30-second lease ran
//! out; each test asserts it got it long before, so only a wake-up can have done it.

use crate::common;

use std::time::Duration;

use common::redis_server::RedisCluster;
use redis::aio::MultiplexedConnection;
use tokio::time::Instant;
use tower_lock::backend::redis::ShardedPubSub;
use tower_lock::{Error, Lease, LockClient, LockKey, RedisBackend};

/// The holders' lease: what a waiter would sleep out without a wake-up.
const HOLD: Duration = Duration::from_secs(30);
/// A woken waiter has its lock well within this.
const WOKEN_WITHIN: Duration = Duration::from_secs(5);

async fn backend(cluster: &RedisCluster, mode: ShardedPubSub) -> RedisBackend {
    RedisBackend::cluster(cluster.urls())
        .sharded_pubsub(mode)
        .build()
        .await
        .unwrap()
}

/// A plain connection to the master serving `key`'s slot now.
async fn owner_of(cluster: &RedisCluster, key: &str) -> (u16, MultiplexedConnection) {
    let port = cluster.master_of(cluster.slot_of(key).await).await;
    let conn = redis::Client::open(format!("redis://127.0.0.1:{port}"))
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    (port, conn)
}

/// Subscribers of `channel` on the node behind `conn`: (sharded, classic).
async fn subscribers(conn: &mut MultiplexedConnection, channel: &str) -> (u64, u64) {
    let (_, sharded): (String, u64) = redis::cmd("PUBSUB")
        .arg("SHARDNUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    let (_, classic): (String, u64) = redis::cmd("PUBSUB")
        .arg("NUMSUB")
        .arg(channel)
        .query_async(conn)
        .await
        .unwrap();
    (sharded, classic)
}

/// Starts a waiter on `key`: a lock call that may wait 20 s, answering how long it
/// waited.
fn wait_for(client: &LockClient, key: &str) -> tokio::task::JoinHandle<Result<Duration, Error>> {
    let lock = client.get_lock(key).unwrap();
    tokio::spawn(async move {
        let started = Instant::now();
        let guard = lock
            .try_lock_for(Duration::from_secs(20), Lease::Fixed(HOLD))
            .await?;
        let took = started.elapsed();
        guard.unlock().await?;
        Ok(took)
    })
}

async fn until_listening(backend: &RedisBackend, key: &str) {
    let key = LockKey::new(key).unwrap();
    common::wait_until(Duration::from_secs(5), "the waiter listens", || async {
        backend.local_waiters(&key) == 1
    })
    .await;
}

/// `key` held for [`HOLD`] by `client`, and a waiter of its own ([`wait_for`]) listening
/// on the key's channel.
async fn held_with_a_waiter(
    client: &LockClient,
    backend: &RedisBackend,
    key: &str,
) -> (
    tower_lock::LockGuard,
    tokio::task::JoinHandle<Result<Duration, Error>>,
) {
    let holder = client
        .get_lock(key)
        .unwrap()
        .try_lock_for(Duration::ZERO, Lease::Fixed(HOLD))
        .await
        .unwrap();
    let waiter = wait_for(client, key);
    until_listening(backend, key).await;
    (holder, waiter)
}

/// On Redis 7 a cluster backend subscribes with `SSUBSCRIBE` on the node of the key's
/// slot (no classic subscriber anywhere), publishes its releases with `SPUBLISH` (a
/// Redisson-style sharded subscriber hears `0`), and its waiter wakes on them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_on_redis_7_wakes_waiters_through_sharded_pubsub() {
    let cluster = RedisCluster::start(3).await;
    let backend = backend(&cluster, ShardedPubSub::Auto).await;
    let client = LockClient::new(backend.clone());
    let key = "sharded:wake";
    let channel = backend.channel_name(&LockKey::new(key).unwrap());
    let (_, node) = owner_of(&cluster, key).await;

    // A Redisson-style listener on the key's shard.
    let (tx, mut heard) = tokio::sync::mpsc::unbounded_channel();
    let mut listener = redis::cluster::ClusterClient::builder(cluster.urls())
        .use_protocol(redis::ProtocolVersion::RESP3)
        .push_sender(tx)
        .build()
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    listener.ssubscribe(&channel).await.unwrap();

    let (holder, waiter) = held_with_a_waiter(&client, &backend, key).await;
    common::wait_until(Duration::from_secs(5), "a sharded subscriber", || async {
        subscribers(&mut node.clone(), &channel).await == (2, 0)
    })
    .await;

    holder.unlock().await.unwrap();
    let took = waiter.await.unwrap().unwrap();
    assert!(took < WOKEN_WITHIN, "the waiter slept {took:?}");
    let message = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let push = heard.recv().await.expect("the listener's pushes");
            if push.kind == redis::PushKind::SMessage {
                return push.data;
            }
        }
    })
    .await
    .expect("a sharded release message");
    assert_eq!(
        message,
        vec![
            redis::Value::BulkString(channel.clone().into_bytes()),
            redis::Value::BulkString(b"0".to_vec()),
        ]
    );
}

/// A Redisson client on a Redis 7 cluster unlocks with `SPUBLISH`: our waiter, held
/// out by a Redisson-style hold, wakes on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redisson_style_sharded_unlock_wakes_our_waiter() {
    let cluster = RedisCluster::start(3).await;
    let backend = backend(&cluster, ShardedPubSub::Auto).await;
    let client = LockClient::new(backend.clone());
    let key = "sharded:redisson";
    let lock_key = LockKey::new(key).unwrap();
    let (name, channel) = (
        backend.lock_name(&lock_key),
        backend.channel_name(&lock_key),
    );
    let (_, mut node) = owner_of(&cluster, key).await;
    // Redisson's hold: the hash `NAME`, field `<uuid>:<thread>` -> 1, with a lease.
    let () = redis::pipe()
        .cmd("HSET")
        .arg(&name)
        .arg("7b2a3c4d-0000-4000-8000-000000000001:1")
        .arg(1)
        .ignore()
        .cmd("PEXPIRE")
        .arg(&name)
        .arg(HOLD.as_millis() as u64)
        .ignore()
        .query_async(&mut node)
        .await
        .unwrap();

    let waiter = wait_for(&client, key);
    until_listening(&backend, key).await;
    common::wait_until(
        Duration::from_secs(5),
        "our sharded subscription",
        || async { subscribers(&mut node.clone(), &channel).await == (1, 0) },
    )
    .await;
    // Redisson's unlock on such a cluster: the hold goes, `0` goes out with SPUBLISH.
    let () =
        redis::Script::new("redis.call('del', KEYS[1]); redis.call('spublish', KEYS[2], ARGV[1])")
            .key(&name)
            .key(&channel)
            .arg("0")
            .invoke_async(&mut node)
            .await
            .unwrap();

    let took = waiter.await.unwrap().unwrap();
    assert!(took < WOKEN_WITHIN, "the waiter slept {took:?}");
}

/// `ShardedPubSub::Off`: classic `SUBSCRIBE` and `PUBLISH` on a cluster, as Redisson
/// with sharded subscriptions off, and waiters still wake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sharded_pubsub_off_a_cluster_wakes_waiters_with_classic_pubsub() {
    let cluster = RedisCluster::start(3).await;
    let backend = backend(&cluster, ShardedPubSub::Off).await;
    let client = LockClient::new(backend.clone());
    let key = "classic:wake";
    let channel = backend.channel_name(&LockKey::new(key).unwrap());
    let (holder, waiter) = held_with_a_waiter(&client, &backend, key).await;
    // Classic subscriptions are cluster-wide: the node listened on, whichever it is.
    common::wait_until(Duration::from_secs(5), "a classic subscriber", || async {
        let mut classic = 0;
        for node in &cluster.nodes {
            let (sharded, c) = subscribers(&mut node.conn().await, &channel).await;
            assert_eq!(sharded, 0, "a sharded subscription with sharding off");
            classic += c;
        }
        classic == 1
    })
    .await;
    holder.unlock().await.unwrap();
    let took = waiter.await.unwrap().unwrap();
    assert!(took < WOKEN_WITHIN, "the waiter slept {took:?}");
}

/// Only a cluster has shards: asking a single server for sharded pub/sub is refused
/// at build, naming the setting.
#[tokio::test]
async fn sharded_pubsub_on_is_refused_for_a_single_server() {
    let error = RedisBackend::builder("redis://127.0.0.1:1")
        .sharded_pubsub(ShardedPubSub::On)
        .lazy_connect(true)
        .build()
        .await
        .unwrap_err();
    assert!(
        matches!(&error, tower_lock::SetupError::Config(tower_lock::ConfigError::InvalidSetting { name, .. }) if *name == "sharded_pubsub"),
        "{error:?}"
    );
}

/// The key's slot moves to another master while a waiter listens on its channel: the
/// server ends that sharded subscription, the backend subscribes again where the slot
/// is now, and the holder's release there still wakes the waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_follows_its_slot_to_another_master() {
    let cluster = RedisCluster::start(3).await;
    let backend = backend(&cluster, ShardedPubSub::Auto).await;
    let client = LockClient::new(backend.clone());
    let key = "sharded:moving";
    let channel = backend.channel_name(&LockKey::new(key).unwrap());
    let slot = cluster.slot_of(key).await;
    let from = cluster.master_of(slot).await;
    let to = cluster
        .nodes
        .iter()
        .map(|n| n.port())
        .find(|&p| p != from)
        .unwrap();
    let (holder, waiter) = held_with_a_waiter(&client, &backend, key).await;
    let (_, old) = owner_of(&cluster, key).await;
    common::wait_until(
        Duration::from_secs(5),
        "subscribed on the old master",
        || async { subscribers(&mut old.clone(), &channel).await == (1, 0) },
    )
    .await;

    cluster.migrate_slot(slot, to, 10, Duration::ZERO).await;
    let (port, new) = owner_of(&cluster, key).await;
    assert_eq!(port, to);
    common::wait_until(
        Duration::from_secs(5),
        "subscribed on the new master",
        || async { subscribers(&mut new.clone(), &channel).await == (1, 0) },
    )
    .await;
    assert!(
        !waiter.is_finished(),
        "the waiter got the lock while it was held"
    );

    holder.unlock().await.unwrap();
    let took = waiter.await.unwrap().unwrap();
    assert!(took < WOKEN_WITHIN, "the waiter slept {took:?}");
}
