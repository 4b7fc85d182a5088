//! One shared pub/sub connection per backend, with a per-channel registry.
//!
//! Every waiter of a [`RedisBackend`](super::RedisBackend) registers in one registry. The
//! first waiter of a channel causes a `SUBSCRIBE`, the last one leaving an
//! `UNSUBSCRIBE`; waiters in between share the subscription. One background task owns the
//! connection and reconciles the server's subscriptions with the registry, so a waiter
//! that leaves and one that arrives at the same moment can never end with the channel
//! unsubscribed while someone waits on it.
//!
//! A message on a channel wakes waiters of that channel in this process: `0` (an unlock)
//! wakes one, `1` (a read unlock) wakes all. The one is the earliest registered waiter
//! without a wake-up, parked or not: one between its attempt and its sleep keeps it for
//! its next wait, and a waiter that subscribed later never takes it, not even by being
//! the only one parked when the message arrives (see [`Signal`]). After a reconnect
//! every channel is subscribed again and every waiter is woken to retry, since messages
//! may have been missed meanwhile.
//!
//! On a cluster with sharded pub/sub the same registry is served by a cluster connection
//! that subscribes each channel on its slot's node ([`sharded`]).
//!
//! Reconnecting waits a random delay between [`MIN_BACKOFF`] and [`MAX_BACKOFF`] (see
//! [`reconnect_delay`]), so replicas that lost their connections together (a Redis
//! restart) do not all reconnect and resubscribe at the same instant.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::primary::Primary;
use crate::backend::{BoxFuture, Signal, Subscription, Ticket, Wake};

/// How long a new waiter waits for its `SUBSCRIBE` to be confirmed, while the connection
/// is up, before it goes on anyway. A subscription not confirmed yet makes its first wait
/// end the moment it is confirmed, so the waiter tries again then: a release published
/// before the server had the subscription is never slept through.
const CONFIRM_WAIT: Duration = Duration::from_secs(1);
/// The shortest wait before reconnecting: the first attempt after a connection is lost
/// waits between this and twice this.
const MIN_BACKOFF: Duration = Duration::from_millis(50);
/// How long a keepalive PING's answer may take, as a share of the keepalive interval,
/// before the connection is given up for a new one.
const KEEPALIVE_TIMEOUT_SHARE: u32 = 2;
/// How long connecting may take before the next node is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// The longest wait before reconnecting: the back-off's ceiling doubles after each
/// failed attempt up to this, and a wait is drawn from the ceiling's upper half.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Where the hub listens.
pub(super) enum Source {
    /// One server, or every known node of a cluster publishing with classic `PUBLISH`:
    /// a release published on any node reaches subscribers on every node, so any one
    /// will do, and the task moves to the next when one fails.
    Nodes(Vec<Primary>),
    /// A cluster publishing with `SPUBLISH`: each channel is subscribed on the node
    /// that serves its slot (see [`sharded`]).
    #[cfg(feature = "cluster")]
    Sharded {
        nodes: Vec<redis::ConnectionInfo>,
        response_timeout: Duration,
        connection_timeout: Duration,
    },
}

#[cfg(feature = "cluster")]
mod sharded;

#[derive(Clone)]
pub(super) struct Hub {
    shared: Arc<Shared>,
}

struct Shared {
    state: Mutex<State>,
    /// Tells the task that channels were added or dropped.
    changed: Notify,
    /// Waiters registered on any channel: lets `has_waiters` answer the common "nobody
    /// waits" case without building a channel name or taking the lock.
    total_waiters: AtomicUsize,
    /// Whether the pub/sub connection is up (a new subscription is then confirmed in a
    /// round trip, worth waiting for).
    connected: std::sync::atomic::AtomicBool,
}

#[derive(Default)]
struct State {
    channels: HashMap<String, Channel>,
    /// Channels whose subscription may need to change.
    dirty: HashSet<String>,
}

struct Channel {
    notify: Arc<Signal>,
    waiters: usize,
    /// Whether the server has confirmed the subscription for this entry.
    confirmed: watch::Sender<bool>,
}

impl Shared {
    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Hub {
    /// Starts the connection task on `source`; it ends when `shutdown` is cancelled.
    pub(super) fn start(source: Source, keepalive: Duration, shutdown: CancellationToken) -> Self {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            changed: Notify::new(),
            total_waiters: AtomicUsize::new(0),
            connected: std::sync::atomic::AtomicBool::new(false),
        });
        match source {
            Source::Nodes(nodes) => {
                tokio::spawn(run(Arc::clone(&shared), nodes, keepalive, shutdown));
            }
            #[cfg(feature = "cluster")]
            Source::Sharded {
                nodes,
                response_timeout,
                connection_timeout,
            } => {
                let timeouts = (response_timeout, connection_timeout);
                tokio::spawn(sharded::run(Arc::clone(&shared), nodes, timeouts, shutdown));
            }
        }
        Hub { shared }
    }

    /// Registers a waiter on `channel` and waits (briefly) until the channel is
    /// subscribed.
    pub(super) async fn subscribe(&self, channel: String) -> Box<dyn Subscription> {
        let (ticket, mut confirmed, created) = {
            let mut state = self.shared.state();
            let mut created = false;
            let entry = state.channels.entry(channel.clone()).or_insert_with(|| {
                created = true;
                Channel {
                    notify: Arc::new(Signal::new()),
                    waiters: 0,
                    confirmed: watch::Sender::new(false),
                }
            });
            entry.waiters += 1;
            self.shared.total_waiters.fetch_add(1, Ordering::Relaxed);
            let handles = (
                entry.notify.register(),
                entry.confirmed.subscribe(),
                created,
            );
            if created {
                state.dirty.insert(channel.clone());
            }
            handles
        };
        if created {
            self.shared.changed.notify_one();
        }
        // Registered before waiting, so a cancelled subscribe unregisters on drop.
        let mut sub = Box::new(RedisSubscription {
            shared: Arc::clone(&self.shared),
            channel,
            ticket,
            unconfirmed: None,
        });
        let up = self.shared.connected.load(Ordering::Acquire);
        let in_time = up
            && tokio::time::timeout(CONFIRM_WAIT, confirmed.wait_for(|c| *c))
                .await
                .is_ok();
        if !in_time && !*confirmed.borrow() {
            // No channel in the message: it names the key, which may be redacted.
            tracing::debug!("subscription not confirmed yet; the waiter retries once it is");
            sub.unconfirmed = Some(confirmed);
        }
        sub
    }

    /// Whether anyone in this process waits on any channel (one atomic load).
    pub(super) fn anyone_waits(&self) -> bool {
        self.shared.total_waiters.load(Ordering::Relaxed) > 0
    }

    /// Waiters registered on `channel` in this process (a point lookup).
    pub(super) fn waiters(&self, channel: &str) -> usize {
        self.shared
            .state()
            .channels
            .get(channel)
            .map_or(0, |c| c.waiters)
    }

    /// Waiters registered in this process on the channels `matches` accepts.
    pub(super) fn waiters_where(&self, mut matches: impl FnMut(&str) -> bool) -> usize {
        self.shared
            .state()
            .channels
            .iter()
            .filter(|(name, _)| matches(name))
            .map(|(_, c)| c.waiters)
            .sum()
    }
}

struct RedisSubscription {
    shared: Arc<Shared>,
    channel: String,
    /// Its place among the channel's waiters.
    ticket: Ticket,
    /// Set while the server has not confirmed the subscription: releases published
    /// until then are not heard, so its confirmation itself counts as a wake-up.
    unconfirmed: Option<watch::Receiver<bool>>,
}

impl Subscription for RedisSubscription {
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        let Some(mut confirmed) = self.unconfirmed.take() else {
            return self.ticket.wait(deadline);
        };
        Box::pin(async move {
            let wake = {
                let released = self.ticket.wait(deadline);
                tokio::select! {
                    wake = released => wake,
                    ok = async { confirmed.wait_for(|c| *c).await.is_ok() } => {
                        if ok {
                            Wake::Notified
                        } else {
                            // The registry entry went away (a shutdown): nothing will
                            // confirm it; sleep out the deadline.
                            tokio::time::sleep_until(deadline).await;
                            Wake::Deadline
                        }
                    }
                }
            };
            if wake == Wake::Deadline && !*confirmed.borrow() {
                self.unconfirmed = Some(confirmed);
            }
            wake
        })
    }

    fn pass_on(&mut self) {
        self.ticket.pass_on();
    }

    fn skip_signalled(&mut self) {
        self.ticket.skip();
    }
}

impl Drop for RedisSubscription {
    fn drop(&mut self) {
        self.shared.total_waiters.fetch_sub(1, Ordering::Relaxed);
        let mut state = self.shared.state();
        let last = match state.channels.get_mut(&self.channel) {
            Some(entry) => {
                entry.waiters = entry.waiters.saturating_sub(1);
                entry.waiters == 0
            }
            None => false,
        };
        if last {
            state.channels.remove(&self.channel);
            state.dirty.insert(std::mem::take(&mut self.channel));
            drop(state);
            self.shared.changed.notify_one();
        }
    }
}

/// The connection task: connects (moving to the next node when one fails), serves the
/// connection until it ends, and connects again, until `shutdown`.
async fn run(
    shared: Arc<Shared>,
    nodes: Vec<Primary>,
    keepalive_every: Duration,
    shutdown: CancellationToken,
) {
    // The ceiling of the next wait; see `reconnect_delay`.
    let mut backoff = FIRST_BACKOFF;
    let mut connected_before = false;
    let mut warn_next_failure = true;
    let mut node = 0usize;
    loop {
        let Some(client) = nodes.get(node % nodes.len().max(1)) else {
            return;
        };
        // Read first: a move while connecting makes the task connect again at once.
        let moves = client.moves();
        let pubsub = match connect(client, &shutdown).await {
            Connecting::Up(pubsub) => pubsub,
            Connecting::Shutdown => return,
            Connecting::Failed(error) => {
                let delay = reconnect_delay(backoff);
                // Said once per outage (a RedLock node can be down for long), then quietly.
                if std::mem::take(&mut warn_next_failure) {
                    crate::log_limit::warn_limited!(crate::log_limit::stores(), "pub/sub connection failed; retrying", %error, retry_in_ms = delay.as_millis() as u64);
                } else {
                    tracing::debug!(%error, retry_in_ms = delay.as_millis() as u64, "pub/sub connection failed");
                }
                // A cluster node that is down: the next one serves as well.
                node = node.wrapping_add(1);
                if sleep_or_shutdown(delay, &shutdown).await {
                    return;
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
                continue;
            }
        };
        backoff = FIRST_BACKOFF;
        if connected_before {
            tracing::info!("pub/sub connection re-established; resubscribing");
        }
        shared.connected.store(true, Ordering::Release);
        warn_next_failure = true;
        // After a reconnect, messages may have been missed: every waiter tries again.
        let wake_all = std::mem::replace(&mut connected_before, true);
        let on = On {
            node: client,
            moves,
        };
        match serve(&shared, pubsub, &on, keepalive_every, wake_all, &shutdown).await {
            Served::Shutdown => return,
            Served::Unresponsive => node = node.wrapping_add(1),
            Served::Lost => {}
        }
        disconnected(&shared);
        if sleep_or_shutdown(reconnect_delay(FIRST_BACKOFF), &shutdown).await {
            return;
        }
    }
}

/// How connecting to a node ended.
enum Connecting {
    Up(redis::aio::PubSub),
    /// Why not, for the log.
    Failed(String),
    Shutdown,
}

/// Connects the pub/sub connection to `node` (behind Sentinel: the primary it names
/// now), within [`CONNECT_TIMEOUT`].
async fn connect(node: &Primary, shutdown: &CancellationToken) -> Connecting {
    let connect = async {
        let client = node.client().await?;
        client.get_async_pubsub().await
    };
    let connecting = tokio::select! {
        _ = shutdown.cancelled() => return Connecting::Shutdown,
        connecting = tokio::time::timeout(CONNECT_TIMEOUT, connect) => connecting,
    };
    match connecting {
        Ok(Ok(pubsub)) => Connecting::Up(pubsub),
        Ok(Err(error)) => Connecting::Failed(error.to_string()),
        Err(_) => Connecting::Failed("timed out".to_owned()),
    }
}

/// The node a connection goes to, and the primary's moves when it was made (see
/// `Primary::moves`).
struct On<'a> {
    node: &'a Primary,
    moves: u64,
}

/// How serving one connection ended.
enum Served {
    /// The connection dropped, or (un)subscribing failed on it.
    Lost,
    /// A keepalive PING went unanswered: the next node is tried.
    Unresponsive,
    Shutdown,
}

/// Serves one connection: subscribes every channel of the registry (and keeps the
/// server's subscriptions in line with it), wakes every waiter once that is done if
/// `wake_all`, and dispatches messages, until the connection ends, the lock calls'
/// connection moves to another primary (behind Sentinel: a release is published
/// there now), or `shutdown`.
async fn serve(
    shared: &Shared,
    pubsub: redis::aio::PubSub,
    on: &On<'_>,
    keepalive_every: Duration,
    mut wake_all: bool,
    shutdown: &CancellationToken,
) -> Served {
    let (mut sink, mut stream) = pubsub.split();
    let mut subscribed = HashSet::new();
    {
        let mut state = shared.state();
        let all: Vec<String> = state.channels.keys().cloned().collect();
        state.dirty.extend(all);
    }
    // A connection can die without a word (a partition, a NAT dropping it): a PING
    // now and then finds out, and the task reconnects instead of waiting forever.
    let mut keepalive = tokio::time::interval_at(Instant::now() + keepalive_every, keepalive_every);
    keepalive.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if let Err(error) = reconcile(shared, &mut sink, &mut subscribed).await {
            crate::log_limit::warn_limited!(crate::log_limit::stores(), "pub/sub (un)subscribe failed; reconnecting", %error);
            return Served::Lost;
        }
        if std::mem::take(&mut wake_all) {
            wake_everyone(shared);
        }
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => return Served::Shutdown,
            msg = stream.next() => match msg {
                Some(msg) => dispatch(shared, msg.get_channel_name(), msg.get_payload_bytes()),
                None => {
                    crate::log_limit::warn_limited!(crate::log_limit::stores(), "pub/sub connection lost; reconnecting");
                    return Served::Lost;
                }
            },
            _ = shared.changed.notified() => {}
            () = on.node.moved() => {
                if on.node.moves() != on.moves {
                    crate::log_limit::warn_limited!(crate::log_limit::stores(), "the Redis primary moved; the pub/sub connection follows");
                    return Served::Lost;
                }
            }
            _ = keepalive.tick() => {
                let patience = keepalive_every / KEEPALIVE_TIMEOUT_SHARE;
                let pong = tokio::time::timeout(patience, sink.ping::<redis::Value>()).await;
                if !matches!(pong, Ok(Ok(_))) {
                    crate::log_limit::warn_limited!(crate::log_limit::stores(), "pub/sub connection unresponsive; reconnecting");
                    return Served::Unresponsive;
                }
            }
        }
    }
}

/// The connection is gone: no subscription is confirmed any more, and waiters must not
/// sleep out a holder's lease on a channel nobody listens to.
fn disconnected(shared: &Shared) {
    shared.connected.store(false, Ordering::Release);
    {
        let state = shared.state();
        for channel in state.channels.values() {
            channel.confirmed.send_replace(false);
        }
    }
    wake_everyone(shared);
}

/// Brings the server's subscriptions in line with the registry for every dirty channel.
async fn reconcile(
    shared: &Shared,
    sink: &mut redis::aio::PubSubSink,
    subscribed: &mut HashSet<String>,
) -> redis::RedisResult<()> {
    let (to_subscribe, to_unsubscribe) = changes(&mut shared.state(), subscribed);
    if !to_subscribe.is_empty() {
        if let Err(error) = sink.subscribe(&to_subscribe).await {
            // Whatever was asked stays dirty for the next connection.
            shared.state().dirty.extend(to_subscribe);
            return Err(error);
        }
        let state = shared.state();
        for channel in to_subscribe {
            if let Some(entry) = state.channels.get(&channel) {
                entry.confirmed.send_replace(true);
            }
            subscribed.insert(channel);
        }
    }
    if !to_unsubscribe.is_empty() {
        for channel in &to_unsubscribe {
            subscribed.remove(channel);
        }
        sink.unsubscribe(&to_unsubscribe).await?;
    }
    Ok(())
}

/// What the server's subscriptions lack and have too many of, for every dirty channel
/// (taken off the dirty set); a dirty channel already subscribed is confirmed.
fn changes(state: &mut State, subscribed: &HashSet<String>) -> (Vec<String>, Vec<String>) {
    let dirty = std::mem::take(&mut state.dirty);
    let mut to_subscribe = Vec::new();
    let mut to_unsubscribe = Vec::new();
    for channel in dirty {
        match (state.channels.get(&channel), subscribed.contains(&channel)) {
            (Some(_), false) => to_subscribe.push(channel),
            (Some(entry), true) => {
                entry.confirmed.send_replace(true);
            }
            (None, true) => to_unsubscribe.push(channel),
            (None, false) => {}
        }
    }
    (to_subscribe, to_unsubscribe)
}

fn dispatch(shared: &Shared, channel: &str, payload: &[u8]) {
    let state = shared.state();
    let Some(entry) = state.channels.get(channel) else {
        return;
    };
    if payload == b"1" {
        entry.notify.notify_all();
    } else {
        // The earliest waiter without a wake-up gets one, parked or not: a waiter that
        // lined up after the release, parked while the message was on its way, does not
        // take it from one still busy with its attempt.
        entry.notify.notify_one();
    }
}

fn wake_everyone(shared: &Shared) {
    let state = shared.state();
    for entry in state.channels.values() {
        entry.notify.notify_all();
    }
}

/// The back-off ceiling of the first reconnect attempt: its wait is drawn from
/// `MIN_BACKOFF..=2 * MIN_BACKOFF`.
const FIRST_BACKOFF: Duration = MIN_BACKOFF.saturating_mul(2);

/// How long to wait before a reconnect attempt whose back-off ceiling is `ceiling`
/// (between [`FIRST_BACKOFF`] and [`MAX_BACKOFF`]): a uniformly random delay in
/// `ceiling / 2..=ceiling`, hence never below [`MIN_BACKOFF`] nor above [`MAX_BACKOFF`].
///
/// "Equal jitter" rather than "full jitter" (`0..=ceiling`): after a Redis restart every
/// replica's pub/sub connection drops at once, and the point is to spread their
/// reconnects (and resubscriptions) over a window instead of having them land together.
/// Half the ceiling is enough spread for that, and the floor keeps what the minimum
/// back-off is for: a replica never retries a server that is still down in a tight loop
/// (full jitter's draws near zero would), and a waiter's wake-up after a reconnect is
/// not delayed much more than before.
fn reconnect_delay(ceiling: Duration) -> Duration {
    let ceiling = ceiling.clamp(FIRST_BACKOFF, MAX_BACKOFF);
    let floor = ceiling / 2;
    let spread = u64::try_from((ceiling - floor).as_nanos()).unwrap_or(u64::MAX);
    floor + Duration::from_nanos(fastrand::u64(0..=spread))
}

/// Sleeps for `duration`; returns `true` if shutdown came first.
async fn sleep_or_shutdown(duration: Duration, shutdown: &CancellationToken) -> bool {
    tokio::select! {
        _ = shutdown.cancelled() => true,
        _ = tokio::time::sleep(duration) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconnect_delay_stays_within_the_bounds_and_varies() {
        let mut ceiling = FIRST_BACKOFF;
        let mut ceilings = vec![Duration::ZERO, Duration::from_secs(3600)];
        loop {
            ceilings.push(ceiling);
            if ceiling == MAX_BACKOFF {
                break;
            }
            ceiling = (ceiling * 2).min(MAX_BACKOFF);
        }
        for ceiling in ceilings {
            let draws: Vec<Duration> = (0..500).map(|_| reconnect_delay(ceiling)).collect();
            let bounded = ceiling.clamp(FIRST_BACKOFF, MAX_BACKOFF);
            for delay in &draws {
                assert!(
                    (MIN_BACKOFF..=MAX_BACKOFF).contains(delay),
                    "{delay:?} for {ceiling:?}"
                );
                assert!(
                    (bounded / 2..=bounded).contains(delay),
                    "{delay:?} for {ceiling:?}"
                );
            }
            let distinct: HashSet<_> = draws.iter().collect();
            assert!(
                distinct.len() > 250,
                "{} distinct of 500 for {ceiling:?}",
                distinct.len()
            );
        }
    }
}
