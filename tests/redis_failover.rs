//! Redis as production runs it: a primary with replicas behind Sentinel. Real processes
//! (`redis-server --replicaof`, `redis-server --sentinel`) on free loopback ports.
#![cfg(feature = "redis")]

mod common;

use std::time::Duration;

use common::proxy::{Direction, Flow};
use common::sentinel::{MASTER, SentinelSet, info_replication};
use tower_lock::{Lease, LockClient, RedisBackend};

/// The harness itself: a failover asked of the Sentinels promotes a replica, and the old
/// primary follows it as a replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sentinel_failover_promotes_a_replica() {
    let set = SentinelSet::start(2, 3).await;
    let old = set.primary_port().await;
    assert_eq!(old, set.nodes[0].port());
    let new = set.failover().await;
    assert_ne!(new, old);
    common::wait_until(
        Duration::from_secs(20),
        "the old primary follows",
        || async {
            info_replication(old).await.is_some_and(|info| {
                info.contains("role:slave") && info.contains(&format!("master_port:{new}"))
            })
        },
    )
    .await;
}

/// A backend behind the Sentinels of `set`: replica acknowledgement as `synced` says
/// (`None`: the Sentinel default, one replica).
async fn behind(set: &SentinelSet, synced: Option<u32>) -> RedisBackend {
    let mut builder = RedisBackend::sentinel(MASTER, set.sentinel_urls())
        .response_timeout(Duration::from_millis(600))
        .connection_timeout(Duration::from_millis(600));
    if let Some(replicas) = synced {
        builder = builder.synced_replicas(replicas, Duration::from_millis(250));
    }
    builder.build().await.unwrap()
}

/// A client whose watchdog renews every second.
fn client(backend: &RedisBackend) -> LockClient {
    LockClient::builder(backend.clone())
        .watchdog_lease(Duration::from_millis(3000))
        .build()
        .unwrap()
}

/// A failover the Sentinels are asked for: the held lock keeps its holder and its
/// renewals (which move to the new primary), nobody else gets it meanwhile, the waiter is
/// woken on the new primary when it is released, and new locks go there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_backend_follows_a_failover_with_its_holds_and_waiters() {
    let set = SentinelSet::start(2, 3).await;
    let holder = client(&behind(&set, None).await);
    let other = client(&behind(&set, None).await);
    let guard = holder
        .get_lock("failover:held")
        .unwrap()
        .lock()
        .await
        .unwrap();
    let waiter = {
        let lock = other.get_lock("failover:held").unwrap();
        tokio::spawn(async move {
            let guard = lock
                .try_lock_for(Duration::from_secs(20), Lease::Watchdog)
                .await;
            (tokio::time::Instant::now(), guard)
        })
    };
    let new = set.failover().await;

    // Two watchdog leases on the new primary: still held, by the same hold.
    let until = tokio::time::Instant::now() + Duration::from_millis(6000);
    while tokio::time::Instant::now() < until {
        assert!(!guard.is_lost(), "the failover lost a held lock");
        assert!(!waiter.is_finished(), "the waiter got a lock still held");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let on_new: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
        .arg("failover:held")
        .query_async(
            &mut redis::Client::open(format!("redis://127.0.0.1:{new}"))
                .unwrap()
                .get_multiplexed_async_connection()
                .await
                .unwrap(),
        )
        .await
        .unwrap();
    assert_eq!(
        on_new.keys().collect::<Vec<_>>(),
        vec![guard.holder().as_str()],
        "the new primary has the hold"
    );
    let released = tokio::time::Instant::now();
    guard.unlock().await.unwrap();
    let (acquired, taken) = waiter.await.unwrap();
    taken
        .expect("the waiter gets the lock")
        .unlock()
        .await
        .unwrap();
    assert!(
        acquired - released < Duration::from_millis(3000 + 1000),
        "the waiter resumed {:?} after the release",
        acquired - released
    );
    // New locks go to the new primary.
    other
        .get_lock("failover:new")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();
}

/// What a grant that never reached a replica becomes when its primary is lost: the
/// replication stream to every replica is dropped (in the proxies it flows through),
/// client A takes a key, the primary is killed (SIGKILL), the Sentinels promote a
/// replica, and client B asks for the same key. Returns A's attempt and whether A
/// believed it held the key while B held it.
async fn a_grant_no_replica_saw(synced: Option<u32>) -> (tower_lock::Result<()>, bool) {
    let mut set = SentinelSet::start_behind_proxies(2, 3).await;
    let a = client(&behind(&set, synced).await);
    let primary = set.primary_port().await;
    for proxy in &set.replication {
        proxy.set_flow(Direction::Down, Flow::Discard);
    }
    let a_took = a
        .get_lock("failover:unreplicated")
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_secs(30))
        .await;
    set.node(primary).kill();
    set.wait_for_new_primary(primary, Duration::from_secs(30))
        .await;
    let b = client(&behind(&set, synced).await);
    let b_took = b
        .get_lock("failover:unreplicated")
        .unwrap()
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .expect("B takes the key on the new primary");
    let two = a_took.as_ref().is_ok_and(|g| !g.is_lost()) && !b_took.is_lost();
    (a_took.map(drop), two)
}

/// With replica acknowledgement (the Sentinel default), a grant no replica acknowledged
/// fails as an outage, so losing the primary never makes two holders.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_replica_acknowledgement_losing_the_primary_never_makes_two_holders() {
    let (a_took, two) = a_grant_no_replica_saw(None).await;
    let err = a_took.expect_err("a grant no replica acknowledged fails");
    assert!(err.is_unavailable(), "{err:?}");
    assert!(!two);
}

/// Without it, the same sequence makes two holders: the window replica acknowledgement
/// closes (replication is asynchronous; fencing tokens are the protection then).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_replica_acknowledgement_losing_the_primary_makes_two_holders() {
    let (a_took, two) = a_grant_no_replica_saw(Some(0)).await;
    assert!(a_took.is_ok());
    assert!(
        two,
        "the window replica acknowledgement closes did not open"
    );
}

/// The split-brain window: the primary is frozen (SIGSTOP) past the Sentinels' down
/// time, a replica is promoted and client B takes a key there; then the old primary
/// comes back, still a primary with no replica until the Sentinels demote it, and client
/// A — still connected to it — asks for the key again and again. With replica
/// acknowledgement no grant there stands: A never holds while B does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_back_from_a_pause_grants_nothing_with_replica_acknowledgement() {
    let mut set = SentinelSet::start(2, 3).await;
    let a = client(&behind(&set, None).await);
    // A's connection is up, to the old primary.
    a.get_lock("split:warm-up")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();
    let old = set.primary_port().await;
    set.node(old).pause();
    set.wait_for_new_primary(old, Duration::from_secs(30)).await;
    let b = client(&behind(&set, None).await);
    let held = b
        .get_lock("split:key")
        .unwrap()
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await
        .expect("B takes the key on the new primary");
    set.node(old).resume();
    let until = tokio::time::Instant::now() + Duration::from_secs(4);
    let mut attempts = 0;
    while tokio::time::Instant::now() < until {
        attempts += 1;
        if let Ok(guard) = a.get_lock("split:key").unwrap().try_lock().await {
            assert!(
                guard.is_lost() || held.is_lost(),
                "A holds the key on the old primary while B holds it on the new one (attempt {attempts})"
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!held.is_lost());
    held.unlock().await.unwrap();
}
