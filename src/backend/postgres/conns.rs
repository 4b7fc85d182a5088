//! The connections the backend keeps between its statements.
//!
//! sqlx's pool tests every connection it takes back (a `Sync` and its answer: a round
//! trip, which wakes the server once more per statement), whatever the pool's options.
//! A lock statement is one short round trip, so that test doubled the server's work
//! per statement. The backend keeps up to a few of the pool's connections checked out
//! after a statement that succeeded, and runs the next statement on one of them; one
//! that failed, or whose statement was dropped mid-way (a timeout, a cancelled caller),
//! goes back to the pool, which tests it as before.

use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use sqlx::Postgres;
use sqlx::pool::PoolConnection;
use sqlx::postgres::{PgConnection, PgPool};

/// How long a kept connection may sit unused before it goes back to the pool (which
/// tests it) instead of carrying the next statement: traffic that stops for longer
/// does not keep connections from the rest of the application.
const IDLE_MAX: Duration = Duration::from_secs(1);

/// Connections checked out of the pool, idle, for the next statements.
pub(super) struct Kept {
    idle: Mutex<Vec<(PoolConnection<Postgres>, Instant)>>,
    cap: usize,
}

impl Kept {
    /// Keeps at most `cap` connections (0: none, every statement takes one from the
    /// pool and gives it back).
    pub(super) fn new(cap: usize) -> Self {
        Kept {
            idle: Mutex::new(Vec::with_capacity(cap)),
            cap,
        }
    }

    /// The most connections kept.
    pub(super) fn cap(&self) -> usize {
        self.cap
    }

    /// Runs `run` on a kept connection, or on one taken from `pool`; keeps the
    /// connection afterwards if `run` succeeded.
    pub(super) async fn run<T>(
        &self,
        pool: &PgPool,
        run: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, sqlx::Error> {
        let mut conn = match self.take() {
            Some(conn) => conn,
            None => pool.acquire().await?,
        };
        let out = run(&mut conn).await?;
        self.put(conn);
        Ok(out)
    }

    /// Gives back to the pool every connection idle for longer than [`IDLE_MAX`], every
    /// [`IDLE_MAX`], until `stop` (the backend's end).
    pub(super) async fn sweep_until(
        self: std::sync::Arc<Self>,
        stop: tokio_util::sync::CancellationToken,
    ) {
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
            drop(stale);
        }
        // The backend is gone: every kept connection goes back to the pool.
        let idle = std::mem::take(&mut *self.idle.lock().unwrap_or_else(PoisonError::into_inner));
        drop(idle);
    }

    /// A kept connection used within [`IDLE_MAX`]; older ones go back to the pool.
    fn take(&self) -> Option<PoolConnection<Postgres>> {
        let mut stale = Vec::new();
        let fresh = {
            let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
            loop {
                match idle.pop() {
                    Some((conn, since)) if since.elapsed() <= IDLE_MAX => break Some(conn),
                    Some((conn, _)) => stale.push(conn),
                    None => break None,
                }
            }
        };
        // Returned (and tested) by the pool, outside the lock.
        drop(stale);
        fresh
    }

    /// Keeps `conn` if there is room; else it goes back to the pool (outside the lock).
    fn put(&self, conn: PoolConnection<Postgres>) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        if idle.len() < self.cap {
            idle.push((conn, Instant::now()));
            return;
        }
        drop(idle);
        drop(conn);
    }
}
