//! The MySQL/MariaDB backend: leased locks of every kind in a few InnoDB tables, for
//! services whose data already lives in MySQL or MariaDB (feature `mysql`).
//!
//! [`MySqlBackend`] works with the [`sqlx::MySqlPool`] the application already has (or
//! makes one from a URL). It is tested on MariaDB 10.11; the SQL keeps to what MariaDB
//! ≥ 10.6 and MySQL ≥ 8.0 share (InnoDB, procedures, `JSON_TABLE`). See
//! `docs/mysql.md` for the tables, what a crash, a failover and a clock step do, and the
//! server settings that matter.
//!
//! # How it works
//!
//! - **Leases, not sessions.** A hold is a row `(name, owner, mode, holds, expires_us,
//!   token)` of `<table>`; the database's clock (`UTC_TIMESTAMP(6)`) sets and checks
//!   every lease, never the client's. A crashed or paused holder's lock ends with its
//!   lease, whatever becomes of its connections. No session-bound `GET_LOCK` holds a
//!   lock.
//! - **One call per operation.** Every state change is one procedure call and one
//!   transaction (`sql/mysql.sql`), which first locks the name's row in
//!   `<table>_names`: that row lock serializes everything done to the name, and is
//!   held for the call alone, never across a client round trip.
//! - **Durability is the server's.** InnoDB makes a commit durable or not server-wide
//!   (`innodb_flush_log_at_trx_commit`), so the backend reads the setting when it is
//!   built: it refuses a server that may lose a commit in a crash of the server (`0`),
//!   and warns once where a crash of the machine may lose one (`2`, or a binary log
//!   not synced at each commit).
//! - **Waiting.** MySQL has no `LISTEN`/`NOTIFY`. Every release that frees a hold
//!   moves the name's release counter on, and a busy attempt answers the counter it
//!   saw. While anyone in a process waits, one connection of its backend reads the
//!   counters of every name waited for in one statement every
//!   [`wake_poll`](MySqlBackendBuilder::wake_poll) (2 ms), and wakes the waiters of the
//!   names that moved: one read per process, whatever the number of waiters, and none
//!   while nobody waits. A release in the same process wakes its waiters at once.
//!   Waiters also wake when the holder's lease would end. `docs/mysql.md` compares
//!   this with `GET_LOCK` and with polling by each waiter.
//! - **Fencing tokens** are the name's last token plus one, raised to the database
//!   clock in microseconds: strictly increasing per name, across restarts too.
//! - **Modes**: every [`LockMode`]. Fair, read and write waiters queue in
//!   `<table>_queue` in arrival order, with the same rules and eviction as the other
//!   backends.
//!
//! Tables (named after the configured table, default `tower_lock`, in the pool's
//! database): `tower_lock` (holds), `tower_lock_names`, `tower_lock_queue`,
//! `tower_lock_gone`, `tower_lock_clients`, `tower_lock_replay`,
//! `tower_lock_schema`, and the procedures `tower_lock_*`. They are created when the
//! backend is built (unless [`migrate(false)`](MySqlBackendBuilder::migrate)), or by
//! [`MySqlBackend::migrate`]; creating them is idempotent and safe from several
//! processes at once.
//!
//! The procedures run their own transactions: give the backend connections in
//! autocommit mode (sqlx's default), not ones inside an application transaction.
//!
//! # Example
//!
//! ```no_run
//! use tower_lock::{LockClient, MySqlBackend};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::MySqlPool::connect("mysql://app@127.0.0.1/app").await?;
//! let backend = MySqlBackend::builder(pool).table("app_locks").build().await?;
//! let client = LockClient::new(backend);
//! let guard = client.get_fenced_lock("lock:order:{42}")?.lock().await?;
//! // UPDATE orders SET ..., last_token = ? WHERE id = 42 AND last_token < ?
//! guard.unlock().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! Failures surface as [`Error::Store`] with the `sqlx::Error` as its source. Connection
//! failures, timeouts and lock-wait timeouts are
//! [unavailable](crate::StoreErrorKind::Unavailable) (an outage); a schema that is
//! missing or not this crate's, a permission error, or a read-only server is
//! [misconfigured](crate::StoreErrorKind::Misconfigured), so it fails closed. A
//! deadlock's victim applied nothing and goes again at once.
//!
//! # Cancel safety
//!
//! A call dropped after it was sent may still run on the server; the client side
//! compensates (see [`Lock`](crate::Lock)). Dropping a subscription unregisters the
//! waiter at once.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use sqlx::mysql::{MySqlConnection, MySqlPool, MySqlPoolOptions};
use tokio_util::sync::DropGuard;

use super::{
    Acquire, BoxFuture, ClientNames, FencingToken, LockBackend, LockMode, LockRequest, LockState,
    ReplayStore, StoreAdmin, StoreProfile, Stored, Subscription, queued,
};
use crate::backend::clock::StoreClock;
use crate::backend::limits::validate_identifier;
use crate::error::{ConfigError, Error, Result, SetupError, StoreError, StoreErrorKind};
use crate::key::LockKey;

mod builder;
mod listener;
mod statements;

pub use builder::MySqlBackendBuilder;
use listener::{KeyWaiters, MySqlSubscription, waiters_of};
use statements::{Statements, millis, mode_char};

/// The table when none is configured: `tower_lock`.
pub const DEFAULT_TABLE: &str = "tower_lock";

/// How long a name's row outlives its last hold and fencing token by default: 1 hour
/// ([`MySqlBackendBuilder::token_retention`]).
pub const DEFAULT_TOKEN_RETENTION: Duration = Duration::from_secs(60 * 60);

/// How long one call may take before it fails as an outage: 2 s. A lock call takes
/// about a millisecond; one that takes seconds means the server is stalled or
/// unreachable.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

pub use crate::backend::limits::DEFAULT_WAITER_TIMEOUT;

/// How often the listening connection reads the release counters while waiters wait,
/// by default: 2 ms ([`MySqlBackendBuilder::wake_poll`]). About ten round trips on a
/// local network: a release in another process wakes a waiter within a few
/// milliseconds, for one small read per process every 2 ms while anyone waits.
pub const DEFAULT_WAKE_POLL: Duration = Duration::from_millis(2);

/// A lock store on MySQL or MariaDB. See the [module docs](self).
///
/// Cheap to clone: clones share the pool and the listening task, which ends with the
/// last clone.
#[derive(Clone)]
pub struct MySqlBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: MySqlPool,
    /// The table, the prefix of every object's name.
    table: String,
    statements: Statements,
    /// The database's clock, for the deadlines of attempts.
    clock: StoreClock,
    waiter_timeout: Duration,
    response_timeout: Duration,
    token_retention: Duration,
    /// `mysql`; its identity is `mysql://<host>:<port>/<database>/<table>`.
    profile: StoreProfile,
    waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    /// Tells the listening task that a waiter's busy attempt saw a name's counter.
    nudge: Arc<tokio::sync::Notify>,
    /// A check of the pool's idle connections is under way (see `check_idle`).
    checking: Arc<AtomicBool>,
    _stop: DropGuard,
}

impl MySqlBackend {
    /// A backend on a new pool for `url` (`mysql://user:password@host:port/db`), with
    /// the default table, created if missing.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] for a URL that is not one, or a server that may lose a
    /// commit in a crash; an [unavailable](crate::StoreErrorKind::Unavailable)
    /// [`SetupError::Store`] when the server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        let pool = MySqlPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(DEFAULT_RESPONSE_TIMEOUT)
            .test_before_acquire(false)
            .connect(url)
            .await
            .map_err(|e| match e {
                sqlx::Error::Configuration(e) => SetupError::Config(ConfigError::invalid_setting(
                    "url",
                    format!("is not a MySQL URL: {e}"),
                )),
                e => map_error(e).into(),
            })?;
        Self::builder(pool).build().await
    }

    /// Configures a backend on `pool`, the application's own.
    pub fn builder(pool: MySqlPool) -> MySqlBackendBuilder {
        MySqlBackendBuilder::new(pool)
    }

    /// Creates the tables and procedures of `table` in the database of `pool` if they
    /// are missing or of another version. Safe to run from several processes at once:
    /// they take turns behind a `GET_LOCK`, and a version already there is left alone.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] for a table name that is not a plain identifier;
    /// [`SetupError::Store`] when the database refuses or cannot be reached.
    pub async fn migrate(pool: &MySqlPool, table: &str) -> Result<(), SetupError> {
        validate_identifier("table", table)?;
        statements::migrate(pool, table).await
    }

    /// The pool.
    pub fn pool(&self) -> &MySqlPool {
        &self.inner.pool
    }

    /// The table of holds; its companions add `_names`, `_queue`, `_gone`,
    /// `_clients`, `_replay`, `_schema`.
    pub fn table(&self) -> &str {
        &self.inner.table
    }

    /// The configured waiter timeout; see [`MySqlBackendBuilder::waiter_timeout`].
    pub fn waiter_timeout(&self) -> Duration {
        self.inner.waiter_timeout
    }

    /// Waiters registered for `key` in this process, in every mode (a diagnostic).
    pub fn local_waiters(&self, key: &LockKey) -> usize {
        waiters_of(&self.inner.waiters)
            .get(key)
            .map_or(0, |w| w.ones + w.alls)
    }

    /// Runs `run` on one of the pool's connections within the response timeout. An
    /// error before the call was sent (no connection to be had) is one that applied
    /// nothing; a timeout after it is an outage whose call may still run.
    async fn on_connection<T>(
        &self,
        run: impl AsyncFnOnce(&mut MySqlConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T> {
        let inner = &*self.inner;
        let sent = AtomicBool::new(false);
        let work = async {
            let mut conn = InFlight(Some(inner.pool.acquire().await?));
            sent.store(true, Ordering::Relaxed);
            let Some(c) = conn.0.as_mut() else {
                return Err(sqlx::Error::PoolClosed);
            };
            let out = run(c).await;
            // Answered: back to the pool as it is.
            drop(conn.0.take());
            out
        };
        let ran = tokio::time::timeout(inner.response_timeout, work).await;
        let sent = sent.load(Ordering::Relaxed);
        match ran {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(error)) if !sent => Err(StoreError::not_applied(error).and_unanswered().into()),
            Ok(Err(error)) => {
                if connection_lost(&error) {
                    // The next connections may reach another server (a failover).
                    inner.clock.forget();
                    self.check_idle();
                    return Err(StoreError::connection_lost(error).into());
                }
                Err(map_error(error))
            }
            Err(_) => {
                inner.clock.forget();
                self.check_idle();
                let message = format!("MySQL did not answer within {:?}", inner.response_timeout);
                let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, message);
                let error = match sent {
                    true => StoreError::new(StoreErrorKind::Unavailable, timed_out),
                    false => StoreError::not_applied(timed_out),
                };
                Err(error.and_unanswered().into())
            }
        }
    }

    /// After a call met a dead connection (its end, or no answer within the response
    /// timeout): takes every idle connection of the pool, so the next calls open fresh
    /// ones, and gives back, from a task, those that answer a ping within the response
    /// timeout, all pinged at once; closes the others. After a restart of the server,
    /// the one call that found a dead connection fails, not one per pooled connection.
    /// One check at a time.
    fn check_idle(&self) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if self.inner.checking.swap(true, Ordering::AcqRel) {
            return;
        }
        /// Ends the check however it ends.
        struct Checking(Arc<AtomicBool>);
        impl Drop for Checking {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let checking = Checking(Arc::clone(&self.inner.checking));
        let pool = &self.inner.pool;
        // Bounded: the ones taken stay out of the pool until the task gives them back.
        let idle: Vec<_> = (0..pool.num_idle())
            .map_while(|_| pool.try_acquire())
            .collect();
        let within = self.inner.response_timeout;
        runtime.spawn(async move {
            futures_util::future::join_all(idle.into_iter().map(async |mut conn| {
                let answered =
                    tokio::time::timeout(within, sqlx::Connection::ping(&mut *conn)).await;
                if !matches!(answered, Ok(Ok(()))) {
                    drop(conn.detach());
                }
            }))
            .await;
            drop(checking);
        });
    }

    /// This process's waiters of `key` hear a release now, not after the listener's
    /// round trip: a releaser that asks again at once must find them ahead of it.
    fn wake_local(&self, key: &LockKey) {
        if let Some(w) = waiters_of(&self.inner.waiters).get(key) {
            w.one.notify_one();
            w.all.notify_all();
        }
    }
}

/// A pool connection with a call in flight. Dropped before the call's answer was read
/// whole (the caller gave up, or the response timeout did), it is closed rather than
/// given back: the pool would read the rest of the answer when it takes it back, and
/// sqlx's reading of a `CALL`'s answer cut short has panicked in that task (seen in the
/// history runs, which cancel calls at every await point).
struct InFlight(Option<sqlx::pool::PoolConnection<sqlx::MySql>>);

impl Drop for InFlight {
    fn drop(&mut self) {
        if let Some(conn) = self.0.take() {
            drop(conn.detach());
        }
    }
}

impl LockBackend for MySqlBackend {
    fn profile(&self) -> &StoreProfile {
        &self.inner.profile
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move {
            let acquired = self.acquire_now(req).await;
            if let Err(error) = &acquired
                && crate::backend::clock::ArrivedLate::of(error).is_some()
            {
                // The database's clock is not where the sample put it (a step, a
                // failover): the retry samples it anew.
                self.inner.clock.forget();
            }
            acquired
        })
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let renewed = self.renew_all(std::slice::from_ref(req)).await?;
            Ok(renewed.first().copied().unwrap_or(false))
        })
    }

    /// One call for every hold.
    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            match self.renew_all(reqs).await {
                Ok(renewed) => renewed.into_iter().map(Ok).collect(),
                Err(error) => reqs.iter().map(|_| Err(error.duplicate())).collect(),
            }
        })
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<super::Release>> {
        Box::pin(self.release_now(req))
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            let queued = queued(req.mode);
            let mut map = waiters_of(&self.inner.waiters);
            let w = map.entry(req.key.clone()).or_insert_with(KeyWaiters::new);
            let ticket = if queued {
                w.alls += 1;
                w.all.register()
            } else {
                w.ones += 1;
                w.one.register()
            };
            drop(map);
            let sub: Box<dyn Subscription> = Box::new(MySqlSubscription {
                waiters: Arc::clone(&self.inner.waiters),
                key: req.key.clone(),
                queued,
                ticket,
            });
            Ok(sub)
        })
    }

    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        !queued(req.mode)
            && waiters_of(&self.inner.waiters)
                .get(&req.key)
                .is_some_and(|w| w.ones > 0)
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let sql = &self.inner.statements.cancel;
            let wait_s = self.inner.statements.wait_s;
            self.on_connection(async |conn| {
                sqlx::query(sql)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
                    .bind(wait_s)
                    .execute(conn)
                    .await
            })
            .await?;
            Ok(())
        })
    }

    /// Releases and dequeues the owner, and refuses its late attempts: one of them may
    /// still be on its way over another of the pool's connections, and must not take
    /// a hold or a place in the queue nobody stands for.
    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            // Long enough that an attempt still arriving is one the response timeout
            // already gave up on, and past the lease of anything it could have taken.
            let keep = self.inner.response_timeout * 2 + req.lease;
            let sql = &self.inner.statements.abandon;
            let wait_s = self.inner.statements.wait_s;
            self.on_connection(async |conn| {
                sqlx::query(sql)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
                    .bind(millis(keep))
                    .bind(wait_s)
                    .execute(conn)
                    .await
            })
            .await?;
            Ok(())
        })
    }

    fn replays(&self) -> Option<&dyn ReplayStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn StoreAdmin> {
        Some(self)
    }
}

impl StoreAdmin for MySqlBackend {
    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let sql = &self.inner.statements.force;
            let wait_s = self.inner.statements.wait_s;
            let freed: i64 = self
                .on_connection(async |conn| {
                    sqlx::query_scalar(sql)
                        .bind(key.as_str())
                        .bind(mode_char(mode))
                        .bind(wait_s)
                        .fetch_all(conn)
                        .await
                        .and_then(statements::first_row)
                })
                .await?;
            Ok(freed != 0)
        })
    }

    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.state_of(key, mode))
    }

    fn clients(&self) -> Option<&dyn ClientNames> {
        Some(self)
    }

    /// `SELECT 1` on one of the pool's connections, within the response timeout.
    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut attempt = 0;
            loop {
                let answered = self
                    .on_connection(async |conn| sqlx::query("SELECT 1").execute(conn).await)
                    .await;
                match answered {
                    Err(error) if attempt == 0 && error.is_connection_lost() => attempt += 1,
                    answered => return answered.map(drop),
                }
            }
        })
    }
}

/// Names live in `<table>_clients`, swept of expired rows by the backend's sweep.
impl ClientNames for MySqlBackend {
    fn register<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let sql = &self.inner.statements.client_register;
            self.on_connection(async |conn| {
                sqlx::query(sql)
                    .bind(id)
                    .bind(name)
                    .bind(millis(ttl))
                    .execute(conn)
                    .await
            })
            .await?;
            Ok(())
        })
    }

    fn names<'a>(&'a self, ids: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<Option<String>>>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(ids.len());
            let sql = &self.inner.statements.client_name;
            for id in ids {
                let name: Option<Vec<u8>> = self
                    .on_connection(async |conn| {
                        sqlx::query_scalar(sql).bind(*id).fetch_optional(conn).await
                    })
                    .await?;
                out.push(name.map(|n| String::from_utf8_lossy(&n).into_owned()));
            }
            Ok(out)
        })
    }

    fn unregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let sql = &self.inner.statements.client_unregister;
            self.on_connection(async |conn| sqlx::query(sql).bind(id).execute(conn).await)
                .await
                .map(drop)
        })
    }
}

/// Records live in `<table>_replay` (name, token, record, expires_us), one row per lock
/// name, written by the procedure `<table>_replay_store`: it releases the hold as
/// [`release`](LockBackend::release) does, wake-ups included, and writes the record in
/// the same transaction if that release found the hold (unexpired on the database's
/// clock) and no unexpired record with a greater token is kept, all under the lock of
/// the name's row. Expired records count as absent; each store deletes a few of any
/// name, and the backend's sweep the rest.
impl ReplayStore for MySqlBackend {
    fn load<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Bytes>>> {
        Box::pin(async move { Ok(self.load_now(key).await?.map(Bytes::from)) })
    }

    fn store_and_release<'a>(
        &'a self,
        req: &'a LockRequest,
        token: FencingToken,
        record: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Stored>> {
        Box::pin(async move { self.store_and_release_now(req, token, &record, ttl).await })
    }
}

impl fmt::Debug for MySqlBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("MySqlBackend")
            .field("store", &self.inner.profile.store_id())
            .field("waiter_timeout", &self.inner.waiter_timeout)
            .finish()
    }
}

/// MySQL's own number of an error the server answered.
fn error_number(error: &sqlx::Error) -> Option<u16> {
    match error {
        sqlx::Error::Database(db) => db
            .try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>()
            .map(|e| e.number()),
        _ => None,
    }
}

/// Whether `error` says the connection it came on is gone: its socket failed, or the
/// server is shutting down or went away (1053, 2006, 2013), or the pool timed out.
fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut | sqlx::Error::Protocol(_) => true,
        _ => matches!(error_number(error), Some(1053 | 1077 | 2006 | 2013)),
    }
}

/// sqlx's error → the crate's, the `sqlx::Error` as the source. A store set up wrong is
/// a misconfiguration, which fails closed: missing objects, syntax, permissions
/// (SQLSTATE classes 42, 28, and 3D, no database), bad data (22), a read-only server
/// (1290, 1792, 1836). A deadlock's victim (1213) applied nothing and is worth one more
/// try at once. Anything else (I/O, timeouts, a lock wait that timed out, an
/// interrupted query, a server shutting down) is an outage. An error the database
/// answered keeps its number and SQLSTATE in the message.
fn map_error(error: sqlx::Error) -> Error {
    let (code, message, number) = match &error {
        sqlx::Error::Database(db) => (
            db.code().map(|c| c.into_owned()).unwrap_or_default(),
            db.message().to_owned(),
            error_number(&error).unwrap_or(0),
        ),
        // An answer this build cannot read: not an outage.
        sqlx::Error::ColumnDecode { .. }
        | sqlx::Error::Decode(_)
        | sqlx::Error::ColumnNotFound(_) => {
            return StoreError::new(StoreErrorKind::Unexpected, error).into();
        }
        _ => return StoreError::new(StoreErrorKind::Unavailable, error).into(),
    };
    let described = |what: &str| {
        format!("MySQL {what} a lock call: {message} (error {number}, SQLSTATE {code})")
    };
    if number == 1213 || code.starts_with("40") {
        return StoreError::not_applied(error)
            .with_message(described("rolled back"))
            .and_again_at_once()
            .into();
    }
    let misconfigured = ["42", "28", "3D", "22", "0A"]
        .iter()
        .any(|class| code.starts_with(class))
        || matches!(number, 1290 | 1792 | 1836);
    let (kind, what) = if misconfigured {
        (StoreErrorKind::Misconfigured, "refused")
    } else {
        (StoreErrorKind::Unavailable, "failed")
    };
    StoreError::new(kind, error)
        .with_message(described(what))
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_checked() {
        for ok in ["tower_lock", "a", "locks_2"] {
            assert!(validate_identifier("table", ok).is_ok(), "{ok}");
        }
        for bad in ["", "Locks", "2locks", "a-b", "a`b", "a.b", &"x".repeat(41)] {
            assert!(validate_identifier("table", bad).is_err(), "{bad:?}");
        }
    }
}
