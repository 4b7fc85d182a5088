//! The connections the backend keeps between its statements.
//!
//! sqlx's pool tests every connection it takes back (a `Sync` and its answer: a round
//! trip, which wakes the server once more per statement), whatever the pool's options.
//! A lock statement is one short round trip, so that test doubled the server's work
//! per statement. The backend keeps up to a few of the pool's connections checked out
//! after a statement that succeeded, and runs the next statement on one of them; one
//! that failed goes back to the pool, which tests it as before.
//!
//! sqlx's pool takes a connection back only once its statement has answered and a ping
//! has, with no bound on the wait. On a connection that died silently (a failover that
//! left the old server's address unanswering, a NAT that forgot the flow) neither
//! comes, and the connection holds its place in the pool for good: a few of them and
//! every statement of the backend fails, though the database is up and new connections
//! to it work. So a connection whose statement its caller gave up on (a timeout, a
//! cancelled caller) is closed instead, and the pool opens another when it needs one;
//! and a kept connection goes back to the pool only after answering a ping within the
//! response timeout, or is closed.
//!
//! A cut or a failover takes every connection at once, and the pool hands out its idle
//! ones untested (`test_before_acquire(false)`), or tests them within its acquire
//! timeout only: each dead one cost the statement that met it a failed call (a
//! response timeout, when the cut was silent), one after the other until the pool had
//! met them all. So a statement that meets a dead connection has every idle
//! connection, the pool's and the kept ones, taken at once and pinged together in a
//! task ([`Kept::check_idle`]): the next statements open fresh connections, and the
//! ones that answer go back to the pool (whose own ping on taking a connection back
//! has no bound: a cut landing between the two holds that place, as before).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};
use sqlx::{Connection, Postgres};

/// How long a kept connection may sit unused before it goes back to the pool (which
/// tests it) instead of carrying the next statement: traffic that stops for longer
/// does not keep connections from the rest of the application.
const IDLE_MAX: Duration = Duration::from_secs(1);

/// Connections checked out of the pool, idle, for the next statements.
pub(super) struct Kept {
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
    cap: usize,
    /// How long a kept connection has to answer a ping before it goes back to the pool.
    ping_within: Duration,
    /// Set while [`check_idle`](Self::check_idle) pings what it took.
    checking: AtomicBool,
}

impl Kept {
    /// Keeps at most `cap` connections (0: none, every statement takes one from the
    /// pool and gives it back); one that goes back answers a ping within `ping_within`
    /// first, or is closed.
    pub(super) fn new(cap: usize, ping_within: Duration) -> Self {
        Kept {
            idle: Mutex::new(Vec::with_capacity(cap)),
            cap,
            ping_within,
            checking: AtomicBool::new(false),
        }
    }

    /// The most connections kept.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Runs `run` on a kept connection, or on one taken from `pool`; keeps the
    /// connection afterwards if `run` succeeded, gives it back to the pool if it
    /// failed, and closes it if `run` is dropped before it answers. `sent` is set once
    /// `run` has a connection: until then, nothing of it can have reached the server.
    pub(super) async fn run<T>(
        &self,
        pool: &PgPool,
        sent: &AtomicBool,
        run: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let conn = match self.take() {
            Some(conn) => conn,
            None => pool.acquire().await?,
        };
        sent.store(true, Ordering::Relaxed);
        let mut unanswered = Unanswered(None);
        let out = run(unanswered.0.insert(conn)).await;
        let answered = unanswered.0.take();
        let out = match out {
            Ok(out) => out,
            Err(error) => {
                // A connection found dead is closed, not given back for the pool to
                // test (and log, once per dead connection, that the test failed).
                if let Some(mut conn) = answered
                    && super::connection_lost(&error)
                {
                    conn.close_on_drop();
                }
                return Err(error);
            }
        };
        if let Some(conn) = answered {
            self.put(conn);
        }
        Ok(out)
    }

    /// After a statement met a dead connection (no answer within the response timeout,
    /// or the connection's end): takes every idle connection, kept or in `pool`, so the
    /// next statements open fresh ones, and gives back in a task the ones that answer a
    /// ping within the response timeout, all pinged at once; closes the others. One
    /// check at a time: a statement that fails while one runs starts none.
    pub(super) fn check_idle(self: &Arc<Self>, pool: &PgPool) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        /// Ends the check however it ends.
        struct Checking(Arc<Kept>);
        impl Drop for Checking {
            fn drop(&mut self) {
                self.0.checking.store(false, Ordering::Release);
            }
        }
        if self.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        let checking = Checking(Arc::clone(self));
        let mut idle =
            std::mem::take(&mut *self.idle.lock().unwrap_or_else(PoisonError::into_inner));
        // Bounded: the ones taken stay out of the pool until the task gives them back.
        for _ in 0..pool.num_idle() {
            let Some(conn) = pool.try_acquire() else {
                break;
            };
            idle.push((conn, Instant::now()));
        }
        runtime.spawn(async move {
            checking.0.give_back(idle).await;
            drop(checking);
        });
    }

    /// Gives back to the pool every connection idle for longer than [`IDLE_MAX`], every
    /// [`IDLE_MAX`], until `stop` (the backend's end).
    pub(super) async fn sweep_until(self: Arc<Self>, stop: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(IDLE_MAX);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = stop.cancelled() => break,
                _ = tick.tick() => {}
            }
            let stale: Vec<_> = {
                let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
                let (stale, fresh) = std::mem::take(&mut *idle)
                    .into_iter()
                    .partition(|(_, since)| since.elapsed() > IDLE_MAX);
                *idle = fresh;
                stale
            };
            self.give_back(stale).await;
        }
        // The backend is gone: every kept connection goes back to the pool.
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(PoisonError::into_inner));
        self.give_back(idle).await;
    }

    /// Gives `conns` back to the pool, each once it has answered a ping within
    /// `ping_within` (all pinged at once); closes the others.
    async fn give_back(&self, conns: Vec<(PoolConnection<Postgres>, Instant)>) {
        let within = self.ping_within;
        futures_util::future::join_all(conns.into_iter().map(async |(mut conn, _)| {
            let answered = tokio::time::timeout(within, conn.ping()).await;
            if !matches!(answered, Ok(Ok(()))) {
                drop(conn.detach());
            }
        }))
        .await;
    }

    /// The kept connection used last, if that was within [`IDLE_MAX`]. Older ones
    /// (all of them, then) stay for the sweep to give back.
    fn take(&self) -> Option<PoolConnection<Postgres>> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        match idle.last() {
            Some((_, since)) if since.elapsed() <= IDLE_MAX => idle.pop().map(|(conn, _)| conn),
            _ => None,
        }
    }

    /// Keeps `conn` if there is room, and no check runs (which holds the pool's idle
    /// connections: one kept then could leave the pool none to give); else it goes
    /// back to the pool (outside the lock), which pings it at once: it has just
    /// answered.
    fn put(&self, conn: PoolConnection<Postgres>) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < self.cap && !self.checking.load(Ordering::Acquire) {
            idle.push((conn, Instant::now()));
            return;
        }
        drop(idle);
        drop(conn);
    }
}

/// A connection whose statement has not answered: dropped so, it is closed, not given
/// back to the pool (see the module's docs).
struct Unanswered(Option<PoolConnection<Postgres>>);

impl Drop for Unanswered {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}
