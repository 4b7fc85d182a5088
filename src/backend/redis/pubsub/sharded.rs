//! The hub's connection task on a cluster with sharded pub/sub (Redis 7).
//!
//! A sharded channel lives on the node that serves its slot, so there is no single
//! connection to listen on: the task keeps a RESP3 cluster connection of its own
//! (redis-rs routes each `SSUBSCRIBE` to the slot's node and sends the messages of every
//! node to one push channel) and reconciles its subscriptions with the registry exactly
//! as the classic task does, one channel per command (two channels of one command must
//! share a slot).
//!
//! What can take a subscription away, and what the task does then:
//! - a node's connection drops: redis-rs reconnects and subscribes that node again, but
//!   a release published meanwhile is lost, so every waiter is woken to try again and
//!   every channel is subscribed again (harmless when redis-rs already did);
//! - the slot moves to another node (a resharding, a failover): the server ends the
//!   subscription with an `sunsubscribe` it was not asked for. The channel's waiters
//!   are woken to try again, and the channel is subscribed again, which the cluster
//!   redirects to the slot's new node.
//!
//! The connection carries subscription commands only: redis-rs takes a subscription
//! push for the answer to the oldest command in flight on that node, so an unasked
//! `sunsubscribe` could only ever stand in for another subscription command's answer,
//! whose channel the server subscribes all the same.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use futures_util::future::join_all;
use redis::cluster_async::ClusterConnection;
use redis::{PushInfo, PushKind, Value};
use tokio::sync::mpsc::{UnboundedReceiver, unbounded_channel};
use tokio_util::sync::CancellationToken;

use super::{
    CONNECT_TIMEOUT, FIRST_BACKOFF, MAX_BACKOFF, Shared, changes, disconnected, dispatch,
    reconnect_delay, sleep_or_shutdown, wake_everyone,
};

/// The connection task: connects, then reconciles subscriptions and dispatches the
/// pushes of every node, until `shutdown`.
pub(super) async fn run(
    shared: Arc<Shared>,
    nodes: Vec<redis::ConnectionInfo>,
    (response_timeout, connection_timeout): (Duration, Duration),
    shutdown: CancellationToken,
) {
    let (pushes_tx, mut pushes) = unbounded_channel();
    let client = redis::cluster::ClusterClient::builder(nodes)
        .use_protocol(redis::ProtocolVersion::RESP3)
        .push_sender(pushes_tx)
        .response_timeout(response_timeout)
        .connection_timeout(connection_timeout)
        .build();
    let client = match client {
        Ok(client) => client,
        Err(error) => {
            // The command connection was made from the same nodes, so this is not
            // expected; waiters then wake on their deadlines (a poll each lease).
            tracing::error!(%error, "sharded pub/sub client could not be made; waiters poll");
            return;
        }
    };
    let Some(mut conn) = connect(&client, &shutdown).await else {
        return;
    };
    shared.connected.store(true, Ordering::Release);
    let mut subs = Subscriptions::default();
    let mut backoff = FIRST_BACKOFF;
    loop {
        match reconcile(&shared, &mut conn, &mut subs).await {
            Ok(()) => {
                backoff = FIRST_BACKOFF;
                shared.connected.store(true, Ordering::Release);
                if std::mem::take(&mut subs.rewake_all) {
                    wake_everyone(&shared);
                }
            }
            Err(error) => {
                // What failed stays dirty; the waiters of those channels were told.
                let delay = reconnect_delay(backoff);
                crate::log_limit::warn_limited!(crate::log_limit::stores(), "sharded (un)subscribe failed; retrying", %error, retry_in_ms = delay.as_millis() as u64);
                if sleep_or_shutdown(delay, &shutdown).await {
                    return;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return,
            push = pushes.recv() => match push {
                Some(push) => on_push(&shared, &mut subs, push, &mut pushes),
                None => return,
            },
            _ = shared.changed.notified() => {}
        }
    }
}

/// What the task knows of the server's side.
#[derive(Default)]
struct Subscriptions {
    /// Channels the cluster has confirmed.
    subscribed: HashSet<String>,
    /// Channels whose subscription was lost: their waiters are woken again once it is
    /// back, since a release published meanwhile went unheard.
    rewake: HashSet<String>,
    /// A node's connection was lost: every waiter is woken again once every channel
    /// is subscribed again.
    rewake_all: bool,
}

/// Connects, retrying with back-off; `None` on shutdown.
async fn connect(
    client: &redis::cluster::ClusterClient,
    shutdown: &CancellationToken,
) -> Option<ClusterConnection> {
    let mut backoff = FIRST_BACKOFF;
    let mut warn = true;
    loop {
        let connecting = tokio::select! {
            _ = shutdown.cancelled() => return None,
            connecting = tokio::time::timeout(CONNECT_TIMEOUT, client.get_async_connection()) => connecting,
        };
        let error = match connecting {
            Ok(Ok(conn)) => return Some(conn),
            Ok(Err(error)) => error.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        let delay = reconnect_delay(backoff);
        if std::mem::take(&mut warn) {
            crate::log_limit::warn_limited!(crate::log_limit::stores(), "sharded pub/sub connection failed; retrying", %error, retry_in_ms = delay.as_millis() as u64);
        }
        if sleep_or_shutdown(delay, shutdown).await {
            return None;
        }
        backoff = (backoff * 2).min(MAX_BACKOFF);
    }
}

/// Handles one push, then every push already queued behind it.
fn on_push(
    shared: &Shared,
    subs: &mut Subscriptions,
    push: PushInfo,
    pushes: &mut UnboundedReceiver<PushInfo>,
) {
    let mut next = Some(push);
    while let Some(push) = next {
        handle(shared, subs, push);
        next = pushes.try_recv().ok();
    }
}

fn handle(shared: &Shared, subs: &mut Subscriptions, push: PushInfo) {
    match push.kind {
        PushKind::SMessage => {
            if let (Some(channel), Some(Value::BulkString(payload))) =
                (text(push.data.first()), push.data.get(1))
            {
                dispatch(shared, &channel, payload);
            }
        }
        PushKind::Disconnection => {
            crate::log_limit::warn_limited!(
                crate::log_limit::stores(),
                "sharded pub/sub connection to a node lost; resubscribing"
            );
            subs.subscribed.clear();
            subs.rewake_all = true;
            {
                let mut state = shared.state();
                let all: Vec<String> = state.channels.keys().cloned().collect();
                state.dirty.extend(all);
            }
            disconnected(shared);
        }
        PushKind::SUnsubscribe => {
            // Asked for (the channel left the registry, or will be subscribed again),
            // or the slot moved away: then the channel's waiters try again, and the
            // channel is subscribed where the slot is now.
            let Some(channel) = text(push.data.first()) else {
                return;
            };
            let mut state = shared.state();
            if subs.subscribed.remove(&channel) {
                if let Some(entry) = state.channels.get(&channel) {
                    tracing::debug!("sharded subscription ended by the server; resubscribing");
                    entry.confirmed.send_replace(false);
                    entry.notify.notify_all();
                    subs.rewake.insert(channel.clone());
                }
                state.dirty.insert(channel);
            }
        }
        _ => {}
    }
}

fn text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

/// Brings the cluster's sharded subscriptions in line with the registry for every dirty
/// channel, one command per channel, all at once.
async fn reconcile(
    shared: &Shared,
    conn: &mut ClusterConnection,
    subs: &mut Subscriptions,
) -> redis::RedisResult<()> {
    let subscribed = &mut subs.subscribed;
    let (to_subscribe, to_unsubscribe) = {
        let mut state = shared.state();
        subs.rewake
            .retain(|channel| state.channels.contains_key(channel));
        changes(&mut state, subscribed)
    };
    for channel in &to_unsubscribe {
        subscribed.remove(channel);
    }
    let subscribing = join_all(to_subscribe.iter().map(|channel| {
        let mut conn = conn.clone();
        async move { conn.ssubscribe(channel).await }
    }));
    let unsubscribing = join_all(to_unsubscribe.iter().map(|channel| {
        let mut conn = conn.clone();
        async move { conn.sunsubscribe(channel).await }
    }));
    let (subscribed_now, unsubscribed_now) = tokio::join!(subscribing, unsubscribing);
    let mut failure = None;
    {
        let mut state = shared.state();
        for (channel, result) in to_subscribe.into_iter().zip(subscribed_now) {
            match result {
                Ok(()) => {
                    let rewake = subs.rewake.remove(&channel);
                    if let Some(entry) = state.channels.get(&channel) {
                        entry.confirmed.send_replace(true);
                        if rewake {
                            entry.notify.notify_all();
                        }
                    }
                    subscribed.insert(channel);
                }
                Err(error) => {
                    // Its waiters may miss releases until it is subscribed: they try
                    // again now, and once more when it is.
                    if let Some(entry) = state.channels.get(&channel) {
                        entry.notify.notify_all();
                        subs.rewake.insert(channel.clone());
                    }
                    state.dirty.insert(channel);
                    failure = Some(error);
                }
            }
        }
        for (channel, result) in to_unsubscribe.into_iter().zip(unsubscribed_now) {
            if let Err(error) = result {
                // Still subscribed, maybe: unsubscribe again later (a message on it
                // finds nobody and is dropped meanwhile).
                subscribed.insert(channel.clone());
                state.dirty.insert(channel);
                failure = Some(error);
            }
        }
    }
    failure.map_or(Ok(()), Err)
}
