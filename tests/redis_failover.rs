//! Redis as production runs it: a primary with replicas behind Sentinel. Real processes
//! (`redis-server --replicaof`, `redis-server --sentinel`) on free loopback ports.
#![cfg(feature = "redis")]

mod common;

use std::time::Duration;

use common::sentinel::{SentinelSet, info_replication};

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
