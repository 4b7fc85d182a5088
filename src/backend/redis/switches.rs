//! Behind Sentinel, word of a failover as soon as it is done: every Sentinel publishes
//! `+switch-master <master> <old ip> <old port> <new ip> <new port>` when it has moved
//! the primary, as Redisson listens for. The backend subscribes on each Sentinel and,
//! on a switch of its master, moves its command connection to the new primary at once
//! (and with it the batches' and the pub/sub connections, which follow every move).
//! Without it, the backend learned of a failover only when a command failed: after the
//! response timeout, when the old primary was frozen rather than gone.

use std::sync::Weak;
use std::time::Duration;

use futures_util::StreamExt;
use tokio_util::sync::CancellationToken;

use super::inner::Inner;

/// The pause before subscribing again on a Sentinel whose connection failed.
const RESUBSCRIBE_AFTER: Duration = Duration::from_secs(1);

/// Listens for `+switch-master` on every Sentinel of `master` in `nodes` until `stop`
/// (the backend's end) or the backend is gone.
pub(super) fn watch(
    inner: Weak<Inner>,
    master: String,
    nodes: Vec<redis::ConnectionInfo>,
    stop: CancellationToken,
) {
    for node in nodes {
        tokio::spawn(listen(inner.clone(), master.clone(), node, stop.clone()));
    }
}

async fn listen(
    inner: Weak<Inner>,
    master: String,
    node: redis::ConnectionInfo,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            ended = subscribed(&inner, &master, node.clone()) => {
                if let Err(error) = ended {
                    tracing::debug!(%error, "Sentinel switch subscription failed; subscribing again");
                }
            }
        }
        if inner.strong_count() == 0 {
            return;
        }
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(RESUBSCRIBE_AFTER) => {}
        }
    }
}

/// One subscription on one Sentinel, until its connection ends.
async fn subscribed(
    inner: &Weak<Inner>,
    master: &str,
    node: redis::ConnectionInfo,
) -> redis::RedisResult<()> {
    let client = redis::Client::open(node)?;
    let mut pubsub = client.get_async_pubsub().await?;
    pubsub.subscribe("+switch-master").await?;
    let mut messages = pubsub.into_on_message();
    while let Some(message) = messages.next().await {
        let Ok(payload) = message.get_payload::<String>() else {
            continue;
        };
        if payload.split(' ').next() != Some(master) {
            continue;
        }
        let Some(inner) = inner.upgrade() else {
            return Ok(());
        };
        if let Some(single) = inner.conn.single() {
            tracing::debug!(%payload, "the Sentinels switched the primary");
            single.follow_primary().await;
        }
    }
    Ok(())
}
