//! Waiting for releases: the listening connection's task, and the waiters of this
//! process it wakes.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::PostgresBackend;
use crate::backend::{BoxFuture, FencingToken, Grant, Signal, Subscription, Ticket, Wake};
use crate::hold_id::HoldId;
use crate::key::LockKey;

/// The waiters of one key in this process.
pub(super) struct KeyWaiters {
    /// Waiters of exclusive locks and permits: one is woken per release.
    pub(super) one: Arc<Signal>,
    pub(super) ones: usize,
    /// Waiters of the queued modes: all are woken, the queue decides.
    pub(super) all: Arc<Signal>,
    pub(super) alls: usize,
    /// The exclusive waiters' places for a lock a release hands them.
    pub(super) slots: Vec<Arc<Slot>>,
}

/// Where a release that hands the lock to an exclusive waiter of this process
/// (`_hand_over`) leaves it, for the waiter's next attempt to take without a statement.
pub(super) struct Slot {
    pub(super) hold: HoldId,
    state: Mutex<SlotState>,
    /// Wakes the waiter when the lock is handed to it.
    handed: tokio::sync::Notify,
}

#[derive(Default)]
struct SlotState {
    /// When the last attempt that registered the waiter in the database, and was
    /// answered busy, was sent: the hand-over counts the lease from when that attempt
    /// ran, so from here it is believed for no longer than it lasts.
    asked: Option<std::time::Instant>,
    /// Registered in the database: leaving must unregister it (`_unwait`).
    registered: bool,
    /// When the waiter stops waiting, if ever.
    gives_up: Option<std::time::Instant>,
    /// Handed the lock: its token (0: none) and the lease's end, in microseconds after
    /// `asked`.
    handed: Option<(i64, u64)>,
}

impl Slot {
    pub(super) fn new(hold: HoldId) -> Self {
        Slot {
            hold,
            state: Mutex::default(),
            handed: tokio::sync::Notify::new(),
        }
    }

    fn state(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// An attempt sent at `sent` registered the waiter and was answered busy.
    pub(super) fn asked(&self, sent: std::time::Instant) {
        let mut state = self.state();
        state.asked = Some(sent);
        state.registered = true;
    }

    /// When the waiter stops waiting, if ever.
    pub(super) fn gives_up(&self) -> Option<std::time::Instant> {
        self.state().gives_up
    }

    /// An attempt took the lock (the database no longer has the waiter), or found it
    /// busy once the waiter's time was up (the database hands it nothing any more).
    pub(super) fn took(&self) {
        let mut state = self.state();
        state.registered = false;
        state.handed = None;
    }

    /// The lock a release handed to this waiter, now the caller's: believed until its
    /// lease's end as counted from `asked`.
    pub(super) fn take(&self) -> Option<Grant> {
        let mut state = self.state();
        let (token, valid_us) = state.handed.take()?;
        let asked = state.asked?;
        state.registered = false;
        let until = asked.checked_add(Duration::from_micros(valid_us))?;
        let valid_for = until.saturating_duration_since(std::time::Instant::now());
        let token = (token > 0).then(|| FencingToken::new(token.unsigned_abs()));
        Some(Grant::new(1, token).with_valid_for(valid_for))
    }

    fn hand(&self, token: i64, valid_us: u64) {
        self.state().handed = Some((token, valid_us));
        self.handed.notify_one();
    }

    fn has_handed(&self) -> bool {
        self.state().handed.is_some()
    }

    /// Whether leaving must take the waiter out of the database.
    fn registered(&self) -> bool {
        self.state().registered
    }
}

/// How often the listening connection is asked to answer (`SELECT 1`, within the
/// response timeout). Every statement the listening task sends starts with the comment
/// `/* tower-lock listener */`, so that `pg_stat_activity` names the listening sessions
/// (their last statement is that or `LISTEN`). A connection cut without a word never fails by itself: `LISTEN`
/// only reads, and a read on a dead connection waits until the kernel gives up (about
/// 15 minutes with Linux's defaults), or for ever behind a middlebox that still
/// acknowledges. Releases meanwhile would go unheard, and waiters sleep out the
/// holders' leases.
pub(super) const PROBE_EVERY: Duration = Duration::from_secs(2);

/// Where and how the listening task makes its connections.
pub(super) struct Listening {
    /// The application's pool, whose connect options each listening connection uses.
    pub(super) pool: PgPool,
    pub(super) channel: String,
    pub(super) live: Live,
    /// The response timeout: the bound of every statement on the listening connection.
    pub(super) within: Duration,
}

impl Listening {
    /// A new listening connection, holding the liveness lock and listening.
    ///
    /// It is made on a pool of its own, with the application pool's connect options
    /// (not its `after_connect` hook), and not on the application's pool: a listener
    /// given up on sends `UNLISTEN` and goes back to its pool with no bound on either,
    /// which on a connection cut without a word keeps its place in that pool for good.
    pub(super) async fn connect(&self) -> Result<PgListener, sqlx::Error> {
        let own = PgPoolOptions::new()
            .max_connections(1)
            .min_connections(0)
            .max_lifetime(None)
            .idle_timeout(None)
            .test_before_acquire(false)
            .acquire_timeout(self.pool.options().get_acquire_timeout())
            .connect_lazy_with((*self.pool.connect_options()).clone());
        let mut listener = PgListener::connect_with(&own).await?;
        within(self.within, self.live.hold(&mut listener)).await?;
        within(self.within, listener.listen(&self.channel)).await?;
        Ok(listener)
    }

    /// Makes a new listening connection, backing off (jittered, doubling up to 2 s, from
    /// 50 ms again once one listens) between tries, until one listens; `None` when the
    /// backend stops first.
    async fn again(&self, stop: &CancellationToken, backoff: &mut Duration) -> Option<PgListener> {
        loop {
            let jittered = *backoff / 2 + backoff.mul_f64(fastrand::f64() / 2.0);
            tokio::select! {
                _ = stop.cancelled() => return None,
                _ = tokio::time::sleep(jittered) => {}
            }
            *backoff = (*backoff * 2).min(Duration::from_secs(2));
            let made = tokio::select! {
                _ = stop.cancelled() => return None,
                made = self.connect() => made,
            };
            match made {
                Ok(fresh) => return Some(fresh),
                Err(error) => {
                    tracing::debug!(%error, retry_in_ms = backoff.as_millis() as u64, "PostgreSQL listening connection failed");
                }
            }
        }
    }
}

/// `work`, or a timeout error once `bound` has passed.
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

/// The listening connection's task: wakes the waiters a notification names, and asks
/// the connection to answer every [`PROBE_EVERY`]. After a lost connection it wakes
/// them all once listening again (a release meanwhile was not heard): when `PgListener`
/// reconnected by itself (`Ok(None)`), and when it could not, or did not answer, and a
/// new listener is made here.
pub(super) async fn listen(
    mut listener: PgListener,
    origin: String,
    listening: Listening,
    waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    stop: CancellationToken,
) {
    let live = &listening.live;
    let mut session = Session::of(&mut listener, listening.within).await;
    let mut backoff = Duration::from_millis(50);
    let mut probe = tokio::time::interval_at(Instant::now() + PROBE_EVERY, PROBE_EVERY);
    probe.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let next = tokio::select! {
            _ = stop.cancelled() => return,
            next = listener.try_recv() => next,
            _ = probe.tick() => {
                match within(listening.within, sqlx::Executor::execute(&mut listener, "/* tower-lock listener */ SELECT 1")).await {
                    Ok(_) => continue,
                    Err(error) => Err(error),
                }
            }
        };
        let error = match next {
            Ok(Some(notification)) => {
                backoff = Duration::from_millis(50);
                wake_named(&waiters, notification.payload(), &origin);
                continue;
            }
            Ok(None) => {
                // The connection was lost, and its session's liveness lock with it;
                // `PgListener` made another and listens again. Notifications meanwhile
                // are lost: everyone tries again.
                crate::log_limit::warn_limited!(
                    crate::log_limit::stores(),
                    "PostgreSQL listening connection lost; reconnecting"
                );
                live.lost();
                match within(listening.within, live.hold(&mut listener)).await {
                    Ok(()) => {
                        session = Session::of(&mut listener, listening.within).await;
                        wake_everyone(&waiters);
                        continue;
                    }
                    Err(error) => error,
                }
            }
            Err(error) => error,
        };
        crate::log_limit::warn_limited!(crate::log_limit::stores(), "PostgreSQL listening connection failed; reconnecting", %error);
        live.lost();
        wake_everyone(&waiters);
        // A new listener, until one listens; `try_recv` would reconnect without a
        // word, and a release between now and then would go unheard.
        let Some(fresh) = listening.again(&stop, &mut backoff).await else {
            return;
        };
        // The one given up on goes in the background: see `Listening::connect`.
        listener = fresh;
        backoff = Duration::from_millis(50);
        if let Some(cut) = session.take() {
            cut.end(&mut listener, listening.within).await;
        }
        session = Session::of(&mut listener, listening.within).await;
        probe.reset();
        tracing::info!("PostgreSQL listening connection re-established");
        wake_everyone(&waiters);
    }
}

/// A listening session on the server, as its process and start time name it (a process
/// id alone may be a later session's).
struct Session {
    pid: i32,
    started: String,
}

impl Session {
    /// The session `listener` is on; `None` when it does not say within `bound`.
    async fn of(listener: &mut PgListener, bound: Duration) -> Option<Self> {
        let asked = sqlx::query_as::<_, (i32, String)>(
            "/* tower-lock listener */ SELECT pid, backend_start::text FROM pg_stat_activity \
              WHERE pid = pg_backend_pid()",
        )
        .fetch_one(&mut *listener);
        match within(bound, asked).await {
            Ok((pid, started)) => Some(Session { pid, started }),
            Err(error) => {
                tracing::debug!(%error, "PostgreSQL listening session not identified");
                None
            }
        }
    }

    /// Ends this session from `listener`'s, if it still runs. A listening connection
    /// given up on without a word from the server (a silent cut) is, to the server, an
    /// idle client: it keeps the session (its `LISTEN`, its liveness lock, its place
    /// among the server's connections) until TCP gives up, for ever behind a middlebox
    /// that still acknowledges. Best effort: a role that may not signal it (another
    /// role's session) leaves it to TCP.
    async fn end(self, listener: &mut PgListener, bound: Duration) {
        let ended = sqlx::query_scalar::<_, bool>(
            "/* tower-lock listener */ SELECT coalesce(bool_or(pg_terminate_backend(pid)), false) \
               FROM pg_stat_activity \
              WHERE pid = $1 AND backend_start::text = $2",
        )
        .bind(self.pid)
        .bind(&self.started)
        .fetch_one(&mut *listener);
        match within(bound, ended).await {
            Ok(ended) => tracing::debug!(
                pid = self.pid,
                ended,
                "PostgreSQL listening session given up on"
            ),
            Err(error) => {
                tracing::debug!(%error, pid = self.pid, "PostgreSQL listening session given up on not ended")
            }
        }
    }
}

/// Wakes the waiters of the key a notification names. Its payload is
/// `<0|1><origin>|<name>`: `0` wakes one waiter of an exclusive lock or a permit, `1`
/// all of them; the queued modes' waiters all wake either way (their queue decides). A
/// release by this backend (`origin`) woke its waiters already.
fn wake_named(waiters: &Mutex<HashMap<LockKey, KeyWaiters>>, payload: &str, origin: &str) {
    if let Some(handed) = payload.strip_prefix('g') {
        return hand(waiters, handed);
    }
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

/// A release handed a lock to an exclusive waiter (`_hand_over`): its notification, after
/// the `g`, is `<origin>|<token>|<valid_us>|<owner length>|<owner>|<name>`. The waiter,
/// if it is this process's, finds the lock in its slot. Like any release, it also wakes
/// one waiter of the name here (after the slot is filled, so that a waiter woken is
/// never the one handed the lock trying with a statement), which a waiter lining up
/// behind this process's others waits for. This one also when this backend released:
/// its release left the wake-up to the notification.
fn hand(waiters: &Mutex<HashMap<LockKey, KeyWaiters>>, handed: &str) {
    let mut fields = handed.splitn(5, '|');
    let (Some(_origin), Some(token), Some(valid_us), Some(owner_len), Some(rest)) = (
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
        fields.next(),
    ) else {
        return;
    };
    let (Ok(token), Ok(valid_us), Ok(owner_len)) = (
        token.parse::<i64>(),
        valid_us.parse::<u64>(),
        owner_len.parse::<usize>(),
    ) else {
        return;
    };
    let (Some(owner), Some(name)) = (
        rest.get(..owner_len),
        rest.get(owner_len..).and_then(|r| r.strip_prefix('|')),
    ) else {
        return;
    };
    let Ok(key) = LockKey::new(name) else {
        return;
    };
    if let Some(w) = waiters_of(waiters).get(&key) {
        if let Some(slot) = w.slots.iter().find(|s| s.hold.as_str() == owner) {
            slot.hand(token, valid_us);
        }
        w.one.notify_one();
    }
}

/// The advisory lock the listening session holds while it lives: waiters register with
/// its key, and a release hands a lock only to a waiter whose key is held (so never to
/// one of a process that died). 0 while no session holds one.
#[derive(Clone)]
pub(super) struct Live {
    /// `<schema>.<table> waiters`: the lock's class is its `hashtext`.
    class: Arc<str>,
    key: Arc<AtomicI32>,
    /// Whether any waiter registers with it (hand-over): else none is taken.
    used: bool,
}

impl Live {
    pub(super) fn new(qualified: &str, used: bool) -> Self {
        Live {
            class: format!("{qualified} waiters").into(),
            key: Arc::default(),
            used,
        }
    }

    /// The key a waiter registers with: the session's, or 1 (which no session holds:
    /// the waiter is then never handed a lock, and comes back by itself) while none.
    pub(super) fn key(&self) -> i32 {
        match self.key.load(Ordering::Acquire) {
            0 => 1,
            key => key,
        }
    }

    fn lost(&self) {
        self.key.store(0, Ordering::Release);
    }

    /// Takes a lock of a random key (never 0 or 1) on the listening session, held until
    /// the session ends (when used).
    pub(super) async fn hold(&self, listener: &mut PgListener) -> Result<(), sqlx::Error> {
        if !self.used {
            return Ok(());
        }
        loop {
            let key = fastrand::i32(2..);
            let taken: bool = sqlx::query_scalar(
                "/* tower-lock listener */ SELECT pg_try_advisory_lock(hashtext($1), $2)",
            )
            .bind(&*self.class)
            .bind(key)
            .fetch_one(&mut *listener)
            .await?;
            if taken {
                self.key.store(key, Ordering::Release);
                return Ok(());
            }
        }
    }
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
    /// Its place among the key's waiters (`KeyWaiters::one` or `all`).
    pub(super) ticket: Ticket,
    /// An exclusive waiter's slot, and the backend that takes it out of the database
    /// when it leaves registered.
    pub(super) slot: Option<(Arc<Slot>, PostgresBackend)>,
}

impl Subscription for PgSubscription {
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        let Some((slot, _)) = &self.slot else {
            return self.ticket.wait(deadline);
        };
        let slot = Arc::clone(slot);
        let released = self.ticket.wait(deadline);
        Box::pin(async move {
            if slot.has_handed() {
                return Wake::Notified;
            }
            tokio::select! {
                wake = released => wake,
                () = slot.handed.notified() => Wake::Notified,
            }
        })
    }

    fn pass_on(&mut self) {
        if !self.queued {
            self.ticket.pass_on();
        }
    }
    fn skip_signalled(&mut self) {
        self.ticket.skip();
    }

    fn gives_up_at(&mut self, deadline: Instant) {
        if let Some((slot, _)) = &self.slot {
            slot.state().gives_up = Some(deadline.into_std());
        }
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
            if let Some((slot, _)) = &self.slot {
                w.slots.retain(|s| !Arc::ptr_eq(s, slot));
            }
            if w.ones == 0 && w.alls == 0 {
                map.remove(&self.key);
            }
        }
        drop(map);
        // Registered and leaving without the lock: out of the database, with a lock
        // handed to it meanwhile passed on.
        if let Some((slot, backend)) = self.slot.take()
            && slot.registered()
        {
            backend.unwait_later(self.key.clone(), slot.hold.clone());
        }
    }
}
