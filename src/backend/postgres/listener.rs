//! Waiting for releases: the listening connection's task, and the waiters of this
//! process it wakes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::backend::{BoxFuture, Signal, Subscription, Wake};
use crate::key::LockKey;

/// The waiters of one key in this process.
pub(super) struct KeyWaiters {
    /// Waiters of exclusive locks and permits: one is woken per release.
    pub(super) one: Arc<Signal>,
    pub(super) ones: usize,
    /// Waiters of the queued modes: all are woken, the queue decides.
    pub(super) all: Arc<Signal>,
    pub(super) alls: usize,
}

/// The listening connection's task: wakes the waiters a notification names. After a
/// lost connection it wakes them all once listening again (a release meanwhile was not
/// heard): when `PgListener` reconnected by itself (`Ok(None)`), and when it could not
/// and a new listener is made here.
pub(super) async fn listen(
    mut listener: PgListener,
    origin: String,
    pool: PgPool,
    channel: String,
    waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let next = tokio::select! {
            _ = stop.cancelled() => return,
            next = listener.try_recv() => next,
        };
        match next {
            Ok(Some(notification)) => {
                backoff = Duration::from_millis(50);
                wake_named(&waiters, notification.payload(), &origin);
            }
            Ok(None) => {
                // The connection was lost; the next call reconnects and listens again.
                // Notifications meanwhile are lost: everyone tries again.
                tracing::warn!("PostgreSQL listening connection lost; reconnecting");
                wake_everyone(&waiters);
            }
            Err(error) => {
                tracing::warn!(%error, "PostgreSQL listening connection failed; reconnecting");
                wake_everyone(&waiters);
                // A new listener, until one listens; `try_recv` would reconnect without a
                // word, and a release between now and then would go unheard.
                let Some(fresh) = listen_again(&pool, &channel, &stop, &mut backoff).await else {
                    return;
                };
                listener = fresh;
                tracing::info!("PostgreSQL listening connection re-established");
                wake_everyone(&waiters);
            }
        }
    }
}

/// Wakes the waiters of the key a notification names. Its payload is
/// `<0|1><origin>|<name>`: `0` wakes one waiter of an exclusive lock or a permit, `1`
/// all of them; the queued modes' waiters all wake either way (their queue decides). A
/// release by this backend (`origin`) woke its waiters already.
fn wake_named(waiters: &Mutex<HashMap<LockKey, KeyWaiters>>, payload: &str, origin: &str) {
    let (all, rest) = match payload.split_at_checked(1) {
        Some(("1", rest)) => (true, rest),
        Some((_, rest)) => (false, rest),
        None => return,
    };
    let Some((from, name)) = rest.split_once('|') else {
        return;
    };
    if from == origin {
        return;
    }
    let Ok(key) = LockKey::new(name) else {
        return;
    };
    if let Some(w) = waiters_of(waiters).get(&key) {
        if all {
            w.one.notify_all();
        } else {
            w.one.notify_one();
        }
        w.all.notify_all();
    }
}

/// Makes a new listening connection, backing off (jittered, doubling up to 2 s) between
/// tries, until one listens; `None` when the backend stops first.
async fn listen_again(
    pool: &PgPool,
    channel: &str,
    stop: &CancellationToken,
    backoff: &mut Duration,
) -> Option<PgListener> {
    loop {
        let jittered = *backoff / 2 + backoff.mul_f64(fastrand::f64() / 2.0);
        tokio::select! {
            _ = stop.cancelled() => return None,
            _ = tokio::time::sleep(jittered) => {}
        }
        *backoff = (*backoff * 2).min(Duration::from_secs(2));
        match relisten(pool, channel).await {
            Ok(fresh) => return Some(fresh),
            Err(error) => {
                tracing::debug!(%error, retry_in_ms = backoff.as_millis() as u64, "PostgreSQL listening connection failed");
            }
        }
    }
}

async fn relisten(pool: &PgPool, channel: &str) -> Result<PgListener, sqlx::Error> {
    let mut listener = PgListener::connect_with(pool).await?;
    listener.listen(channel).await?;
    Ok(listener)
}

fn wake_everyone(waiters: &Mutex<HashMap<LockKey, KeyWaiters>>) {
    for w in waiters_of(waiters).values() {
        w.one.notify_all();
        w.all.notify_all();
    }
}

pub(super) fn waiters_of(
    waiters: &Mutex<HashMap<LockKey, KeyWaiters>>,
) -> MutexGuard<'_, HashMap<LockKey, KeyWaiters>> {
    waiters.lock().unwrap_or_else(PoisonError::into_inner)
}

pub(super) struct PgSubscription {
    pub(super) waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    pub(super) key: LockKey,
    pub(super) queued: bool,
    pub(super) signal: Arc<Signal>,
    pub(super) seen: u64,
}

impl Subscription for PgSubscription {
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        self.signal.wait(&mut self.seen, deadline)
    }

    fn pass_on(&mut self) {
        if !self.queued {
            self.signal.notify_one();
        }
    }
    fn skip_signalled(&mut self) {
        self.signal.skip(&mut self.seen);
    }
}

impl Drop for PgSubscription {
    fn drop(&mut self) {
        let mut map = waiters_of(&self.waiters);
        if let Some(w) = map.get_mut(&self.key) {
            if self.queued {
                w.alls = w.alls.saturating_sub(1);
            } else {
                w.ones = w.ones.saturating_sub(1);
            }
            if w.ones == 0 && w.alls == 0 {
                map.remove(&self.key);
            }
        }
    }
}
