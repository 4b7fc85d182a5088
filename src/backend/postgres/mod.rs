//! The PostgreSQL backend: leased locks of every kind in a few tables, for services that
//! already run PostgreSQL and would rather not add Redis for locks (feature `postgres`).
//!
//! [`PostgresBackend`] works with the [`sqlx::PgPool`] the application already has (or
//! makes one from a URL). sqlx because it is what most axum services use for
//! PostgreSQL, and its `PgListener` re-`LISTEN`s by itself after a reconnect.
//!
//! # How it works
//!
//! - **Leases, not sessions.** Every name has a row in `<table>_names`, which holds its
//!   exclusive hold, updated in place; a hold of another mode is a row `(name, owner,
//!   mode, holds, expires_at, token)` of `<table>`. The database's clock
//!   (`clock_timestamp()`) sets and checks every `expires_at`, never the client's. A crashed or paused holder's lock ends with its
//!   lease, whatever becomes of its connections, and any session can release it
//!   ([`force_release`](StoreAdmin::force_release)). No session-bound advisory lock
//!   holds a lock.
//! - **One statement per operation.** An exclusive acquisition or release is one plain
//!   SQL statement on the name's row (`sql/lock_x.sql`, `sql/unlock_x.sql`), whose row
//!   lock serializes it with everything else done to the name. Every other state change
//!   is one call of a PL/pgSQL function (`sql/postgres.sql`), which takes a
//!   transaction-scoped advisory lock on (the table, the name), then the name's row —
//!   held for microseconds, never across a client round trip.
//! - **Group commit.** Acquisitions (and releases) that arrive while one of their kind
//!   is on its way go together, in one statement and one transaction
//!   (`sql/lock_x_batch.sql`, `sql/unlock_x_batch.sql` for the exclusive mode; the
//!   functions `_acquire_batch` and `_release_batch`, which call the single-name
//!   functions name by name, for the others): each name is answered as its own
//!   statement would answer it, and the grants share one commit. One that finds
//!   nothing on its way goes at once, alone. Batches are sent by a task of the backend,
//!   so a caller that gives up or is parked holds up no one.
//! - **Waiting** is `LISTEN`/`NOTIFY` on one listening connection per backend: a
//!   release that frees a lock notifies the table's channel with the name, at commit
//!   (an exclusive one only when a busy attempt marked the name wanted);
//!   with [`hand_over`](PostgresBackendBuilder::hand_over), a release that would free
//!   an exclusive lock a waiter waits for hands it to the oldest waiter registered in
//!   `<table>_waiters` instead, in the same transaction,
//!   and the notification carries the grant (the waiter takes it without a statement;
//!   a waiter that leaves passes a lock handed to it on, and one whose process died is
//!   skipped: its listening session's advisory lock is gone);
//!   in each process one waiter of an exclusive lock or a permit is woken per release
//!   (all waiters of the queued modes, whose order the queue enforces). Waiters also
//!   wake when the holder's lease would end. After the listening connection drops, it
//!   reconnects, listens again and wakes every waiter (notifications may have been
//!   missed). It is asked to answer every 2 s within the response timeout, since a
//!   connection cut without a word never fails by itself: one that does not answer is
//!   given up on and made again the same way.
//! - **Fencing tokens** are the name's last token plus one, raised to the database
//!   clock in microseconds (the last is kept in the name's row): strictly increasing
//!   per name, as on every backend.
//! - **Modes**: every [`LockMode`]. Fair, read and write waiters queue in
//!   `<table>_queue` in arrival order, with the same rules and eviction as the other
//!   backends (see [`LockMode`](super::LockMode#rules)).
//! - **The watchdog** renews all of a client's holds in one statement per period.
//!
//! Tables (in the configured schema, named after the configured table, default
//! `tower_lock`): `tower_lock_names` (a row per name), `tower_lock` (holds of the other
//! modes), `tower_lock_queue`, `tower_lock_clients`, `tower_lock_gone`,
//! `tower_lock_replay` (records for replay, see [`ReplayStore`]), `tower_lock_waiters`
//! (exclusive waiters a release hands the lock to), `tower_lock_fence`
//! and the sequence `tower_lock_token` (the previous version's, unused), and the
//! functions `tower_lock_*`. They are created when the backend is built (unless
//! [`migrate(false)`](PostgresBackendBuilder::migrate)), or by
//! [`PostgresBackend::migrate`]; creating them is idempotent and safe from several
//! processes at once.
//!
//! The listening connection is the backend's own, made with the pool's connect options
//! (not its `after_connect` hook) and kept outside the pool: each backend opens one
//! connection to the database beside its pool. Drop the backend before `PgPool::close`,
//! which waits for every connection to come back (the kept ones too). A pool that
//! carries lock traffic is best built with `PgPoolOptions::test_before_acquire(false)`:
//! the default pings every connection before each statement, a second round trip per
//! lock statement.
//!
//! # Example
//!
//! ```no_run
//! use tower_lock::{LockClient, PostgresBackend};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let pool = sqlx::PgPool::connect("postgres://app@127.0.0.1/app").await?;
//! let backend = PostgresBackend::builder(pool).table("app_locks").build().await?;
//! let client = LockClient::new(backend);
//! let guard = client.get_fenced_lock("lock:order:{42}")?.lock().await?;
//! // UPDATE orders SET ..., last_token = $token WHERE id = 42 AND last_token < $token
//! guard.unlock().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! Failures surface as [`Error::Store`] with the `sqlx::Error` as its source, and a
//! kind that decides what is done about them. Connection failures, timeouts and a
//! server shutting down are [unavailable](crate::StoreErrorKind::Unavailable)
//! (retryable: an outage); a schema that is missing or not this crate's (an undefined
//! function or table, a permission error) is
//! [misconfigured](crate::StoreErrorKind::Misconfigured), so it fails closed. The
//! SQLSTATE of an error the database answered is in the message, and is the `code()`
//! of the source's `sqlx::Error::Database`:
//!
//! ```
//! # fn sqlstate(error: &tower_lock::Error) -> Option<String> {
//! let tower_lock::Error::Store(store) = error else { return None };
//! match store.downcast_ref::<sqlx::Error>()? {
//!     sqlx::Error::Database(db) => db.code().map(|code| code.into_owned()),
//!     _ => None,
//! }
//! # }
//! ```
//!
//! # Cancel safety
//!
//! A call dropped after it was sent may still run on the server; the client side
//! compensates (see [`Lock`](crate::Lock)). Dropping a subscription unregisters the
//! waiter at once.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgPool, PgPoolOptions};
use tokio_util::sync::DropGuard;

use bytes::Bytes;

use super::{
    Acquire, BoxFuture, ClientNames, FencingToken, LockBackend, LockMode, LockRequest, LockState,
    Release, ReplayStore, Signal, StoreAdmin, StoreProfile, Stored, Subscription, queued,
};
use crate::backend::clock::StoreClock;
use crate::backend::limits::validate_identifier;
use crate::error::{ConfigError, Error, Result, SetupError, StoreError, StoreErrorKind};
use crate::key::LockKey;

mod batch;
mod builder;
mod conns;
mod listener;
mod statements;
mod sweep;

pub use builder::PostgresBackendBuilder;
use listener::{KeyWaiters, Live, PgSubscription, Slot, waiters_of};
use statements::{Statements, millis, mode_char};

/// The table when none is configured: `tower_lock`.
pub const DEFAULT_TABLE: &str = "tower_lock";

/// The schema when none is configured: `public`.
pub const DEFAULT_SCHEMA: &str = "public";

/// How long a name's row outlives its last hold and fencing token by default: 1 hour
/// ([`PostgresBackendBuilder::token_retention`]).
pub const DEFAULT_TOKEN_RETENTION: Duration = Duration::from_secs(60 * 60);

/// How long one call may take before it fails as an outage: 2 s. A lock statement takes
/// well under a millisecond; one that takes seconds means the server is stalled or
/// unreachable.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

pub use crate::backend::limits::DEFAULT_WAITER_TIMEOUT;

/// How many of the pool's connections the backend keeps between its statements when
/// not told otherwise: none. See [`PostgresBackendBuilder::kept_connections`].
pub const DEFAULT_KEPT_CONNECTIONS: usize = 0;

/// A lock store on PostgreSQL. See the [module docs](self).
///
/// Cheap to clone: clones share the pool and the listening task, which ends with the
/// last clone.
#[derive(Clone)]
pub struct PostgresBackend {
    inner: Arc<Inner>,
}

struct Inner {
    pool: PgPool,
    /// `<schema>.<table>`, the prefix of every function.
    qualified: String,
    /// The hot path's statements, formatted once.
    statements: Statements,
    /// The database's clock, for the deadlines of attempts.
    clock: StoreClock,
    waiter_timeout: Duration,
    response_timeout: Duration,
    /// The longest lease granted fast (without waiting for the disk), if any.
    fast_grants: Option<Duration>,
    /// Connections kept between statements (see `conns`).
    kept: Arc<conns::Kept>,
    /// Exclusive operations waiting to go together (see `batch`).
    batcher: batch::Batcher,
    /// `postgres`; its identity is
    /// `postgres://<host>:<port>/<database>/<schema>.<table>`.
    profile: StoreProfile,
    /// This backend's name in its release notifications: its listener skips them.
    origin: String,
    waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    /// Exclusive waiters register for a release to hand them the lock
    /// ([`PostgresBackendBuilder::hand_over`]).
    hand_over: bool,
    /// The listening session's liveness lock, which exclusive waiters register with.
    live: Live,
    /// How long a name's row outlives its last fencing token
    /// ([`PostgresBackendBuilder::token_retention`]).
    token_retention: Duration,
    _stop_listener: DropGuard,
}

impl PostgresBackend {
    /// A backend on a new pool for `url` (`postgres://user:password@host:port/db`), with
    /// the default schema and table, created if missing.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] for a URL that is not one; an
    /// [unavailable](crate::StoreErrorKind::Unavailable) [`SetupError::Store`] when the
    /// server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self, SetupError> {
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(DEFAULT_RESPONSE_TIMEOUT)
            .connect(url)
            .await
            .map_err(|e| match e {
                sqlx::Error::Configuration(e) => SetupError::Config(ConfigError::invalid_setting(
                    "url",
                    format!("is not a PostgreSQL URL: {e}"),
                )),
                e => map_error(e).into(),
            })?;
        Self::builder(pool).build().await
    }

    /// Configures a backend on `pool`, the application's own.
    pub fn builder(pool: PgPool) -> PostgresBackendBuilder {
        PostgresBackendBuilder::new(pool)
    }

    /// Creates the tables and functions of `schema`.`table` in the database of `pool`
    /// if they are missing (and replaces the functions with this version's). Safe to run
    /// from several processes at once.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] for a schema or table name that is not a plain
    /// identifier; [`SetupError::Store`] when the database refuses or cannot be reached.
    pub async fn migrate(pool: &PgPool, schema: &str, table: &str) -> Result<(), SetupError> {
        validate_identifier("schema", schema)?;
        validate_identifier("table", table)?;
        // One script, one implicit transaction, behind a transaction-scoped advisory
        // lock: concurrent CREATE ... IF NOT EXISTS from two processes can collide.
        // Without notices for the transaction: every start would otherwise log one
        // "already exists, skipping" per object.
        let sql = [
            "SELECT pg_advisory_xact_lock(hashtext('tower_lock migrate'));\n",
            "SET LOCAL client_min_messages = warning;\n",
            &statements::schema_sql(schema, table),
        ]
        .concat();
        sqlx::raw_sql(&sql).execute(pool).await.map_err(map_error)?;
        Ok(())
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The table of holds, qualified: `<schema>.<table>`; its companions add `_names`,
    /// `_queue`, `_clients`, `_gone`, `_replay`.
    pub fn qualified_table(&self) -> &str {
        &self.inner.qualified
    }

    /// The configured waiter timeout; see [`PostgresBackendBuilder::waiter_timeout`].
    pub fn waiter_timeout(&self) -> Duration {
        self.inner.waiter_timeout
    }

    /// Waiters registered for `key` in this process, in every mode (a diagnostic).
    pub fn local_waiters(&self, key: &LockKey) -> usize {
        waiters_of(&self.inner.waiters)
            .get(key)
            .map_or(0, |w| w.ones + w.alls)
    }
}

impl LockBackend for PostgresBackend {
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

    /// One statement for every hold.
    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            match self.renew_all(reqs).await {
                Ok(renewed) => renewed.into_iter().map(Ok).collect(),
                Err(error) => reqs.iter().map(|_| Err(error.duplicate())).collect(),
            }
        })
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.release_now(req))
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            let queued = queued(req.mode);
            let mut map = waiters_of(&self.inner.waiters);
            let w = map.entry(req.key.clone()).or_insert_with(|| KeyWaiters {
                one: Arc::new(Signal::new()),
                ones: 0,
                all: Arc::new(Signal::new()),
                alls: 0,
                slots: Vec::new(),
            });
            // An exclusive waiter registers in the database with its attempts, for a
            // release to hand it the lock (see `listener::Slot`).
            let slot = (self.inner.hand_over && req.mode == LockMode::Exclusive).then(|| {
                let slot = Arc::new(Slot::new(req.hold_id.clone()));
                w.slots.push(Arc::clone(&slot));
                (slot, self.clone())
            });
            let ticket = if queued {
                w.alls += 1;
                w.all.register()
            } else {
                w.ones += 1;
                w.one.register()
            };
            drop(map);
            let sub: Box<dyn Subscription> = Box::new(PgSubscription {
                waiters: Arc::clone(&self.inner.waiters),
                key: req.key.clone(),
                queued,
                ticket,
                slot,
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
            let sql = self.sql("SELECT __F___cancel(__F___within($1::text, __WAIT_MS__), $2, $3)");
            self.on_connection(async |conn| {
                sqlx::query(&sql)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
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
            let sql =
                self.sql("SELECT __F___abandon(__F___within($1::text, __WAIT_MS__), $2, $3, $4)");
            self.on_connection(async |conn| {
                sqlx::query(&sql)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
                    .bind(millis(keep))
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

impl StoreAdmin for PostgresBackend {
    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let sql = self.sql("SELECT __F___force(__F___within($1::text, __WAIT_MS__), $2)");
            self.on_connection(async |conn| {
                sqlx::query_scalar(&sql)
                    .bind(key.as_str())
                    .bind(mode_char(mode))
                    .fetch_one(conn)
                    .await
            })
            .await
        })
    }

    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.state_of(key, mode))
    }

    fn clients(&self) -> Option<&dyn ClientNames> {
        Some(self)
    }

    /// `SELECT 1` on one of the backend's connections, within the response timeout.
    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut attempt = 0;
            loop {
                let answered = self
                    .on_connection(async |conn| sqlx::query("SELECT 1").execute(conn).await)
                    .await;
                match answered {
                    Err(error) if Self::read_again(attempt, &error) => attempt += 1,
                    answered => return answered.map(drop),
                }
            }
        })
    }
}

/// Names live in `<table>_clients`, swept of expired rows by the backend's sweep.
impl ClientNames for PostgresBackend {
    fn register<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let sql = self.sql(
                "INSERT INTO __F___clients (id, name, expires_at) \
                 VALUES (__F___within($1::text, __WAIT_MS__), $2, \
                         clock_timestamp() + $3 * interval '1 millisecond') \
                 ON CONFLICT (id) DO UPDATE SET name = excluded.name, expires_at = excluded.expires_at",
            );
            self.on_connection(async |conn| {
                sqlx::query(&sql)
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
            let sql = self.sql(
                "SELECT id, name FROM __F___clients \
                  WHERE id = ANY($1) AND expires_at > clock_timestamp()",
            );
            let rows: Vec<(String, String)> = self
                .on_connection(async |conn| {
                    sqlx::query_as(&sql)
                        .bind(ids.to_vec())
                        .fetch_all(conn)
                        .await
                })
                .await?;
            Ok(ids
                .iter()
                .map(|id| {
                    rows.iter()
                        .find(|(k, _)| k == id)
                        .map(|(_, name)| name.clone())
                })
                .collect())
        })
    }

    fn unregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let sql =
                self.sql("DELETE FROM __F___clients WHERE id = $1 AND __F___within(__WAIT_MS__)");
            self.on_connection(async |conn| sqlx::query(&sql).bind(id).execute(conn).await)
                .await
                .map(drop)
        })
    }
}

/// Records live in `<table>_replay` (name, token, record, expires_at), one row per lock
/// name, written by the function `<table>_replay_store`: it releases the hold with
/// `<table>_release` — the release the backend's [`release`](LockBackend::release)
/// makes, notification and wake-ups included — and writes the record in the same
/// transaction if that release found the hold (unexpired on the database's clock) and
/// no unexpired record with a greater token is kept, all under the lock of the name's
/// row.
///
/// Every mode is kept (the release decides who holds what). A stored record commits
/// synchronously, as a grant does: a response a retry is to replay survives a crash
/// of the server, whatever the session's `synchronous_commit`. Expired records count as
/// absent; each store deletes a few of any name, and client registration sweeps them
/// with the other expired rows.
impl ReplayStore for PostgresBackend {
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

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("store", &self.inner.profile.store_id())
            .field("waiter_timeout", &self.inner.waiter_timeout)
            .finish()
    }
}

/// Whether `error` says the connection it came on is gone (its socket failed, or the
/// server is ending its sessions: SQLSTATE class 57P, a shutdown or a crash), or may
/// be (the pool timed out handing one out: with its test before acquire, that is a
/// dead idle connection's ping, unanswered): the connections idle beside it likely
/// are too.
fn connection_lost(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => db.code().is_some_and(|code| code.starts_with("57P")),
        _ => false,
    }
}

/// A statement's error on a connection found dead ([`connection_lost`]): an outage
/// whose connection broke under it, which the lock core tries once more at once.
fn lost_connection(error: sqlx::Error) -> Error {
    let described = sqlstate_of(&error).map(|(code, message)| described("failed", &message, &code));
    let lost = StoreError::connection_lost(error);
    match described {
        Some(message) => lost.with_message(message).into(),
        None => lost.into(),
    }
}

/// The SQLSTATE and message of an error the database answered.
fn sqlstate_of(error: &sqlx::Error) -> Option<(String, String)> {
    match error {
        sqlx::Error::Database(db) => db
            .code()
            .map(|code| (code.into_owned(), db.message().to_owned())),
        _ => None,
    }
}

fn described(what: &str, message: &str, code: &str) -> String {
    format!("PostgreSQL {what} a lock statement: {message} (SQLSTATE {code})")
}

/// sqlx's error → the crate's, the `sqlx::Error` as the source. A store set up wrong
/// is a misconfiguration, which fails closed: undefined objects, syntax, permissions
/// (SQLSTATE classes 42, 28), a schema that is not there (3F), an isolation level the
/// functions refuse or another unsupported feature (0A), bad data (22), a read-only
/// standby (25006). A transaction the database rolled back for a deadlock or a
/// serialization failure (class 40) applied nothing and is worth one more try at once.
/// Anything else (I/O, timeouts, a server shutting down or not accepting connections,
/// a cancelled statement) is an outage. An error the database answered keeps its
/// SQLSTATE in the message.
fn map_error(error: sqlx::Error) -> Error {
    let Some((code, message)) = sqlstate_of(&error) else {
        return StoreError::new(StoreErrorKind::Unavailable, error).into();
    };
    if code.starts_with("40") {
        return StoreError::not_applied(error)
            .with_message(described("rolled back", &message, &code))
            .and_again_at_once()
            .into();
    }
    let misconfigured = ["42", "28", "3F", "0A", "22"]
        .iter()
        .any(|class| code.starts_with(class))
        || code == "25006";
    let (kind, what) = if misconfigured {
        (StoreErrorKind::Misconfigured, "refused")
    } else {
        (StoreErrorKind::Unavailable, "failed")
    };
    StoreError::new(kind, error)
        .with_message(described(what, &message, &code))
        .into()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A deadlock's victim (the sweep's with a batch, before the sweep skipped held
    /// rows) failed its requests: a rollback applied nothing, and goes again at once.
    #[test]
    fn a_rolled_back_transaction_applied_nothing_and_goes_again() {
        for code in ["40P01", "40001"] {
            let error = map_error(sqlx::Error::Database(Box::new(Rolled(code))));
            assert!(error.is_unavailable(), "{code}");
            assert!(error.is_not_applied(), "{code}");
            assert!(error.again_at_once(), "{code}");
            assert!(error.to_string().contains(code), "{error}");
        }
    }

    /// A database error with the SQLSTATE `.0`.
    #[derive(Debug)]
    struct Rolled(&'static str);

    impl std::fmt::Display for Rolled {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("deadlock detected")
        }
    }

    impl std::error::Error for Rolled {}

    impl sqlx::error::DatabaseError for Rolled {
        fn message(&self) -> &str {
            "deadlock detected"
        }
        fn code(&self) -> Option<std::borrow::Cow<'_, str>> {
            Some(self.0.into())
        }
        fn as_error(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn as_error_mut(&mut self) -> &mut (dyn std::error::Error + Send + Sync + 'static) {
            self
        }
        fn into_error(self: Box<Self>) -> Box<dyn std::error::Error + Send + Sync + 'static> {
            self
        }
        fn kind(&self) -> sqlx::error::ErrorKind {
            sqlx::error::ErrorKind::Other
        }
    }

    #[test]
    fn identifiers_are_checked() {
        for ok in ["tower_lock", "a", "locks_2", "public"] {
            assert!(validate_identifier("table", ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "Locks",
            "2locks",
            "a-b",
            "a;drop table x",
            "a.b",
            &"x".repeat(41),
        ] {
            assert!(validate_identifier("table", bad).is_err(), "{bad:?}");
        }
    }
}
