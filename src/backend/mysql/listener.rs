//! Waiting for releases: the listening connection's task, and the waiters of this
//! process it wakes.
//!
//! MySQL has no `LISTEN`/`NOTIFY`. Every release that frees a hold moves the name's
//! release counter on (`<table>_names.released`), and a busy attempt answers the counter
//! it saw. While anyone in this process waits, one connection of the backend reads the
//! counters of every name waited for, in one statement, every
//! [`wake_poll`](super::MySqlBackendBuilder::wake_poll), and wakes the waiters of the
//! names that moved. A release in this process wakes its own waiters at once, without
//! the listener. So the server sees one small read per process per poll while waiters
//! wait, whatever their number, and nothing while nobody waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sqlx::Connection;
use sqlx::mysql::{MySqlConnection, MySqlPool};
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::MySqlBackend;
use super::statements::{json_array, json_string};
use crate::backend::{BoxFuture, Signal, Subscription, Ticket, Wake};
use crate::key::LockKey;

/// How often an idle listening connection (nobody waits) is asked to answer, so that a
/// connection cut without a word is replaced before it is needed.
const PROBE_EVERY: Duration = Duration::from_secs(2);

/// The waiters of one key in this process.
pub(super) struct KeyWaiters {
    /// Waiters of exclusive locks and permits: one is woken per release.
    pub(super) one: Arc<Signal>,
    pub(super) ones: usize,
    /// Waiters of the queued modes: all are woken, the queue decides.
    pub(super) all: Arc<Signal>,
    pub(super) alls: usize,
    /// The earliest release counter a waiter's busy attempt saw since the listener last
    /// woke them: a greater one means a release they have not heard of.
    pub(super) seen: Option<i64>,
}

impl KeyWaiters {
    pub(super) fn new() -> Self {
        KeyWaiters {
            one: Arc::new(Signal::new()),
            ones: 0,
            all: Arc::new(Signal::new()),
            alls: 0,
            seen: None,
        }
    }

    /// Wakes the waiters for `releases` releases: one exclusive or permit waiter per
    /// release, every queued one.
    fn wake(&self, releases: u64) {
        for _ in 0..releases.min(self.ones as u64) {
            self.one.notify_one();
        }
        self.all.notify_all();
    }
}

pub(super) fn waiters_of(
    waiters: &Mutex<HashMap<LockKey, KeyWaiters>>,
) -> MutexGuard<'_, HashMap<LockKey, KeyWaiters>> {
    waiters.lock().unwrap_or_else(PoisonError::into_inner)
}

fn wake_everyone(waiters: &Mutex<HashMap<LockKey, KeyWaiters>>) {
    for w in waiters_of(waiters).values() {
        w.one.notify_all();
        w.all.notify_all();
    }
}

impl MySqlBackend {
    /// A busy attempt of `key` saw the release counter at `released`.
    pub(super) fn saw(&self, key: &LockKey, released: i64) {
        if let Some(w) = waiters_of(&self.inner.waiters).get_mut(key) {
            w.seen = Some(w.seen.map_or(released, |seen| seen.min(released)));
        }
        self.inner.nudge.notify_one();
    }
}

/// What the listening task needs.
pub(super) struct Listening {
    pub(super) pool: MySqlPool,
    pub(super) released_sql: String,
    pub(super) within: Duration,
    pub(super) poll: Duration,
    pub(super) waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    pub(super) nudge: Arc<Notify>,
}

impl Listening {
    /// A new connection, with the pool's options, outside the pool.
    pub(super) async fn connect(&self) -> Result<MySqlConnection, sqlx::Error> {
        let options = self.pool.connect_options();
        within(self.within, MySqlConnection::connect_with(&options)).await
    }
}

async fn within<T>(
    bound: Duration,
    work: impl Future<Output = Result<T, sqlx::Error>>,
) -> Result<T, sqlx::Error> {
    tokio::time::timeout(bound, work).await.unwrap_or_else(|_| {
        Err(sqlx::Error::Io(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            format!("the listening connection did not answer within {bound:?}"),
        )))
    })
}

/// The names waited for and the counters last seen, in one order.
fn watched(waiters: &Mutex<HashMap<LockKey, KeyWaiters>>) -> Vec<(LockKey, i64)> {
    waiters_of(waiters)
        .iter()
        .filter_map(|(key, w)| w.seen.map(|seen| (key.clone(), seen)))
        .collect()
}

/// The listening task: connects, waits in the server while anyone here waits, wakes
/// the waiters whose names moved; after a lost connection connects again and wakes
/// everyone (a release meanwhile was not heard).
pub(super) async fn listen(
    listening: Listening,
    mut conn: Option<MySqlConnection>,
    stop: CancellationToken,
) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(mut connection) = conn.take() else {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(2));
            match listening.connect().await {
                Ok(fresh) => {
                    tracing::info!("MySQL listening connection re-established");
                    conn = Some(fresh);
                    backoff = Duration::from_millis(50);
                    wake_everyone(&listening.waiters);
                }
                Err(error) => {
                    crate::log_limit::warn_limited!(crate::log_limit::stores(), "MySQL listening connection failed; reconnecting", %error);
                }
            }
            continue;
        };
        let failed = tokio::select! {
            () = stop.cancelled() => return,
            failed = serve(&listening, &mut connection) => failed,
        };
        crate::log_limit::warn_limited!(crate::log_limit::stores(), "MySQL listening connection lost; reconnecting", error = %failed);
        wake_everyone(&listening.waiters);
        drop(connection);
    }
}

/// Serves one connection until it fails.
async fn serve(listening: &Listening, conn: &mut MySqlConnection) -> sqlx::Error {
    loop {
        let names = watched(&listening.waiters);
        if names.is_empty() {
            // Nobody waits: a nudge (a waiter's busy attempt), or a probe of the
            // connection now and then.
            let nudged = tokio::time::timeout(PROBE_EVERY, listening.nudge.notified()).await;
            if nudged.is_err()
                && let Err(error) = within(
                    listening.within,
                    sqlx::query("SELECT 1").execute(&mut *conn),
                )
                .await
            {
                return error;
            }
            continue;
        }
        let json = json_array(names.iter().map(|(key, _)| json_string(key.as_str())));
        let answered: Result<Vec<(i64, i64)>, sqlx::Error> = within(
            listening.within,
            sqlx::query_as(&listening.released_sql)
                .bind(&json)
                .fetch_all(&mut *conn),
        )
        .await;
        let rows = match answered {
            Ok(rows) => rows,
            Err(error) => return error,
        };
        wake_moved(&listening.waiters, &names, rows);
        tokio::time::sleep(listening.poll).await;
    }
}

/// Wakes the waiters of each of `names` whose counter in `rows` (place from 1,
/// counter) moved past what they saw.
fn wake_moved(
    waiters: &Mutex<HashMap<LockKey, KeyWaiters>>,
    names: &[(LockKey, i64)],
    rows: Vec<(i64, i64)>,
) {
    let mut map = waiters_of(waiters);
    for (i, released) in rows {
        let Some((key, _)) = usize::try_from(i - 1).ok().and_then(|i| names.get(i)) else {
            continue;
        };
        let Some(w) = map.get_mut(key) else { continue };
        if let Some(seen) = w.seen
            && released > seen
        {
            w.seen = Some(released);
            w.wake(released.abs_diff(seen));
        }
    }
}

pub(super) struct MySqlSubscription {
    pub(super) waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    pub(super) key: LockKey,
    pub(super) queued: bool,
    /// Its place among the key's waiters (`KeyWaiters::one` or `all`).
    pub(super) ticket: Ticket,
}

impl Subscription for MySqlSubscription {
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        self.ticket.wait(deadline)
    }

    fn pass_on(&mut self) {
        if !self.queued {
            self.ticket.pass_on();
        }
    }

    fn skip_signalled(&mut self) {
        self.ticket.skip();
    }
}

impl Drop for MySqlSubscription {
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
