//! The PostgreSQL backend: leased locks of every kind in a few tables, for services that
//! already run PostgreSQL and would rather not add Redis for locks (feature `postgres`).
//!
//! [`PostgresBackend`] works with the [`sqlx::PgPool`] the application already has (or
//! makes one from a URL). sqlx because it is what most axum services use for
//! PostgreSQL, and its `PgListener` re-`LISTEN`s by itself after a reconnect.
//!
//! # How it works
//!
//! - **Leases, not sessions.** A hold is a row `(name, owner, mode, holds, expires_at,
//!   token)`; the database's clock (`clock_timestamp()`) sets and checks every
//!   `expires_at`, never the client's. A crashed or paused holder's lock ends with its
//!   lease, whatever becomes of its connections, and any session can release it
//!   ([`force_release`](LockBackend::force_release)). No session-bound advisory lock
//!   holds a lock.
//! - **One statement per operation.** Every state change is one call of a PL/pgSQL
//!   function (`sql/postgres.sql`), which serializes the operations on one name with a
//!   transaction-scoped advisory lock on (the table, the name) — held for microseconds,
//!   never across a client round trip.
//! - **Waiting** is `LISTEN`/`NOTIFY` on one listening connection per backend: a
//!   release that frees a lock notifies the table's channel with the name, at commit;
//!   in each process one waiter of an exclusive lock or a permit is woken per release
//!   (all waiters of the queued modes, whose order the queue enforces). Waiters also
//!   wake when the holder's lease would end. After the listening connection drops, it
//!   reconnects, listens again and wakes every waiter (notifications may have been
//!   missed).
//! - **Fencing tokens** come from a sequence, raised to the database clock in
//!   microseconds and above the name's last token (the newest per name is kept in the
//!   `<table>_fence` table): strictly increasing per name, as on every backend.
//! - **Modes**: every [`LockMode`]. Fair, read and write waiters queue in
//!   `<table>_queue` in arrival order, with the same rules and eviction as the other
//!   backends (see [`memory`](super::memory)).
//! - **The watchdog** renews all of a client's holds in one statement per period.
//!
//! Tables (in the configured schema, named after the configured table, default
//! `tower_lock`): `tower_lock` (holds), `tower_lock_queue`, `tower_lock_fence`,
//! `tower_lock_clients`, the sequence `tower_lock_token` and the functions
//! `tower_lock_*`. They are created when the backend is built (unless
//! [`migrate(false)`](PostgresBackendBuilder::migrate)), or by
//! [`PostgresBackend::migrate`]; creating them is idempotent and safe from several
//! processes at once.
//!
//! The listening connection is one of the pool's connections, held for the backend's
//! life: size the pool one larger, and drop the backend before `PgPool::close`, which
//! waits for every connection to come back.
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
//! Connection failures, timeouts and a server shutting down surface as
//! [`Error::Backend`] (retryable: an outage); a schema that is missing or not this
//! crate's (an undefined function or table, a permission error) as
//! [`Error::UnexpectedReply`], so a misconfiguration fails closed.
//!
//! # Cancel safety
//!
//! A call dropped after it was sent may still run on the server; the client side
//! compensates (see [`Lock`](crate::Lock)). Dropping a subscription unregisters the
//! waiter at once.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool, PgPoolOptions};
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{
    Acquire, BoxFuture, FencingToken, Grant, Holder, LockBackend, LockMode, LockRequest, LockState,
    Release, Signal, Subscription, WaiterScope, Waiters, Wake,
};
use crate::backend::clock::StoreClock;
use crate::error::{Error, Result};
use crate::key::LockKey;
use crate::owner::Owner;

/// The schema and functions, with `__S__` / `__T__` for the schema and table.
const SCHEMA_SQL: &str = include_str!("../../sql/postgres.sql");

/// The table when none is configured: `tower_lock`.
pub const DEFAULT_TABLE: &str = "tower_lock";

/// The schema when none is configured: `public`.
pub const DEFAULT_SCHEMA: &str = "public";

/// How long one call may take before it fails as an outage: 2 s. A lock statement takes
/// well under a millisecond; one that takes seconds means the server is stalled or
/// unreachable.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

pub use crate::backend::memory::DEFAULT_WAITER_TIMEOUT;

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
    watchdog_lease: Option<Duration>,
    store_id: String,
    /// This backend's name in its release notifications: its listener skips them.
    origin: String,
    waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    _stop_listener: DropGuard,
}

/// The statements every acquisition, release and renewal sends, with the schema and
/// table filled in once at build (not formatted per call).
struct Statements {
    acquire: String,
    release: String,
    renew: String,
}

/// The waiters of one key in this process.
struct KeyWaiters {
    /// Waiters of exclusive locks and permits: one is woken per release.
    one: Arc<Signal>,
    ones: usize,
    /// Waiters of the queued modes: all are woken, the queue decides.
    all: Arc<Signal>,
    alls: usize,
}

/// Configures a [`PostgresBackend`].
#[must_use]
pub struct PostgresBackendBuilder {
    pool: PgPool,
    schema: String,
    table: String,
    waiter_timeout: Duration,
    response_timeout: Duration,
    watchdog_lease: Option<Duration>,
    migrate: bool,
}

impl PostgresBackend {
    /// A backend on a new pool for `url` (`postgres://user:password@host:port/db`), with
    /// the default schema and table, created if missing.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a URL that is not one; [`Error::Backend`] when the
    /// server cannot be reached.
    pub async fn connect(url: &str) -> Result<Self> {
        let pool = PgPoolOptions::new()
            .max_connections(10)
            .acquire_timeout(DEFAULT_RESPONSE_TIMEOUT)
            .connect(url)
            .await
            .map_err(|e| match e {
                sqlx::Error::Configuration(e) => {
                    Error::invalid_config("url", format!("is not a PostgreSQL URL: {e}"))
                }
                e => map_error(e),
            })?;
        Self::builder(pool).build().await
    }

    /// Configures a backend on `pool`, the application's own.
    pub fn builder(pool: PgPool) -> PostgresBackendBuilder {
        PostgresBackendBuilder {
            pool,
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            waiter_timeout: DEFAULT_WAITER_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            watchdog_lease: None,
            migrate: true,
        }
    }

    /// Creates the tables and functions of `schema`.`table` in the database of `pool`
    /// if they are missing (and replaces the functions with this version's). Safe to run
    /// from several processes at once.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] for a schema or table name that is not a plain
    /// identifier; backend errors.
    pub async fn migrate(pool: &PgPool, schema: &str, table: &str) -> Result<()> {
        validate_identifier("schema", schema)?;
        validate_identifier("table", table)?;
        // One script, one implicit transaction, behind a transaction-scoped advisory
        // lock: concurrent CREATE ... IF NOT EXISTS from two processes can collide.
        let sql = [
            "SELECT pg_advisory_xact_lock(hashtext('tower_lock migrate'));\n",
            &SCHEMA_SQL.replace("__S__", schema).replace("__T__", table),
        ]
        .concat();
        sqlx::raw_sql(&sql).execute(pool).await.map_err(map_error)?;
        Ok(())
    }

    /// The pool.
    pub fn pool(&self) -> &PgPool {
        &self.inner.pool
    }

    /// The table of holds, qualified: `<schema>.<table>`; its companions add `_queue`,
    /// `_fence`, `_clients`.
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

    fn sql(&self, body: &str) -> String {
        fill(body, &self.inner.qualified)
    }

    /// Runs `call` within the response timeout.
    async fn timed<T>(&self, call: impl Future<Output = Result<T, sqlx::Error>>) -> Result<T> {
        match tokio::time::timeout(self.inner.response_timeout, call).await {
            Ok(result) => result.map_err(map_error),
            Err(_) => Err(Error::Backend(
                format!(
                    "PostgreSQL did not answer within {:?}",
                    self.inner.response_timeout
                )
                .into(),
            )),
        }
    }

    /// The deadline, on the database's clock in microseconds, of an attempt sent now:
    /// its response times out when the database's clock has passed it (see
    /// [`clock`](crate::backend::clock)). Samples the database's clock first when the
    /// last sample is too old.
    async fn attempt_deadline(&self) -> Result<i64> {
        let window = self.inner.response_timeout;
        if let Some(deadline) = self.inner.clock.deadline(window) {
            return Ok(i64::try_from(deadline).unwrap_or(i64::MAX));
        }
        let now_us: i64 = self
            .timed(
                sqlx::query_scalar(
                    "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
                )
                .fetch_one(&self.inner.pool),
            )
            .await?;
        let received = std::time::Instant::now();
        self.inner
            .clock
            .record(u64::try_from(now_us).unwrap_or(0), received);
        let deadline = self.inner.clock.deadline(window).unwrap_or(u64::MAX);
        Ok(i64::try_from(deadline).unwrap_or(i64::MAX))
    }

    async fn acquire_now(&self, req: &LockRequest) -> Result<Acquire> {
        let max = match req.mode {
            LockMode::Permits { max } => i32::try_from(max.get()).unwrap_or(i32::MAX),
            _ => 0,
        };
        let deadline = self.attempt_deadline().await?;
        let (acquired, holds, token, ttl_ms): (bool, i32, Option<i64>, Option<i64>) = self
            .timed(
                sqlx::query_as(&self.inner.statements.acquire)
                    .bind(req.key.as_str())
                    .bind(req.owner.as_str())
                    .bind(mode_char(req.mode))
                    .bind(max)
                    .bind(millis(req.lease))
                    .bind(req.fenced)
                    .bind(req.writer.as_ref().map(Owner::as_str))
                    .bind(millis(self.inner.waiter_timeout))
                    .bind(deadline)
                    .fetch_one(&self.inner.pool),
            )
            .await?;
        if ttl_ms == Some(-2) {
            return Err(Error::Backend(
                "the lock attempt reached PostgreSQL after its deadline and was refused".into(),
            ));
        }
        if acquired {
            let token = token.map(|t| FencingToken::new(t.unsigned_abs()));
            return Ok(Acquire::Acquired(Grant::new(
                u32::try_from(holds).unwrap_or(1),
                token,
            )));
        }
        let ttl = match ttl_ms {
            Some(ms) if ms >= 0 => Some(Duration::from_millis(ms.unsigned_abs())),
            _ => None,
        };
        Ok(Acquire::Busy { ttl })
    }

    async fn release_now(&self, req: &LockRequest) -> Result<Release> {
        let left: i32 = self
            .timed(
                sqlx::query_scalar(&self.inner.statements.release)
                    .bind(req.key.as_str())
                    .bind(req.owner.as_str())
                    .bind(mode_char(req.mode))
                    .bind(millis(req.lease))
                    .bind(&self.inner.origin)
                    .fetch_one(&self.inner.pool),
            )
            .await?;
        Ok(match left {
            -1 => Release::NotHeld,
            0 => {
                // This process's waiters hear it now, not a NOTIFY round trip later: a
                // releaser that asks again at once must find them ahead of it (no
                // barging). The NOTIFY names this backend, whose listener skips it.
                if let Some(w) = waiters_of(&self.inner.waiters).get(&req.key) {
                    w.one.notify_one();
                    w.all.notify_all();
                }
                Release::Released
            }
            n => Release::Decremented {
                holds: u32::try_from(n).unwrap_or(u32::MAX),
            },
        })
    }

    async fn renew_all(&self, reqs: &[LockRequest]) -> Result<Vec<bool>> {
        let names: Vec<&str> = reqs.iter().map(|r| r.key.as_str()).collect();
        let owners: Vec<&str> = reqs.iter().map(|r| r.owner.as_str()).collect();
        let modes: Vec<i8> = reqs.iter().map(|r| mode_char(r.mode)).collect();
        let leases: Vec<i64> = reqs.iter().map(|r| millis(r.lease)).collect();
        let renewed: Vec<i32> = self
            .timed(
                sqlx::query_scalar(&self.inner.statements.renew)
                    .bind(names)
                    .bind(owners)
                    .bind(modes)
                    .bind(leases)
                    .fetch_all(&self.inner.pool),
            )
            .await?;
        let mut out = vec![false; reqs.len()];
        for i in renewed {
            // `WITH ORDINALITY` counts from 1.
            if let Some(slot) = usize::try_from(i - 1).ok().and_then(|i| out.get_mut(i)) {
                *slot = true;
            }
        }
        Ok(out)
    }

    async fn state_of(&self, key: &LockKey, mode: LockMode) -> Result<LockState> {
        let holds_sql = self.sql(
            "SELECT owner, mode, holds, \
                    ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint, token \
               FROM __F__ WHERE name = $1 AND expires_at > clock_timestamp() ORDER BY owner",
        );
        let rows: Vec<(String, i8, i32, i64, Option<i64>)> = self
            .timed(
                sqlx::query_as(&holds_sql)
                    .bind(key.as_str())
                    .fetch_all(&self.inner.pool),
            )
            .await?;
        let fence_sql = self.sql("SELECT token FROM __F___fence WHERE name = $1");
        let fence: Option<i64> = self
            .timed(
                sqlx::query_scalar(&fence_sql)
                    .bind(key.as_str())
                    .fetch_optional(&self.inner.pool),
            )
            .await?;
        let waiters = if self.queues_waiters(mode) {
            let queue_sql = self.sql(
                "SELECT count(*) FROM __F___queue WHERE name = $1 AND evict_at > clock_timestamp()",
            );
            let queued: i64 = self
                .timed(
                    sqlx::query_scalar(&queue_sql)
                        .bind(key.as_str())
                        .fetch_one(&self.inner.pool),
                )
                .await?;
            Waiters::new(usize::try_from(queued).unwrap_or(0), WaiterScope::Store)
        } else {
            let here = waiters_of(&self.inner.waiters)
                .get(key)
                .map_or(0, |w| w.ones);
            Waiters::new(here, WaiterScope::Process)
        };
        let mut holders = Vec::with_capacity(rows.len());
        for (owner, held, holds, ttl_ms, token) in rows {
            let owner = Owner::from_raw(&owner).map_err(|_| {
                Error::UnexpectedReply(format!("a hold with an invalid owner {owner:?}"))
            })?;
            let held = match u8::try_from(held).unwrap_or(b'x') {
                b'f' => LockMode::Fair,
                b'r' => LockMode::Read,
                b'w' => LockMode::Write,
                b'p' => match mode {
                    LockMode::Permits { .. } => mode,
                    _ => LockMode::Permits {
                        max: std::num::NonZeroU32::MAX,
                    },
                },
                _ => LockMode::Exclusive,
            };
            let ttl = Duration::from_millis(ttl_ms.max(0).unsigned_abs());
            holders.push(
                Holder::new(owner, held, u32::try_from(holds).unwrap_or(1), Some(ttl))
                    .with_token(token.map(|t| FencingToken::new(t.unsigned_abs()))),
            );
        }
        Ok(LockState::new(holders, waiters)
            .with_fencing_token(fence.map(|t| FencingToken::new(t.unsigned_abs()))))
    }
}

impl PostgresBackendBuilder {
    /// The schema of the tables (default [`DEFAULT_SCHEMA`]); must exist. A plain
    /// identifier: lowercase ASCII letters, digits and `_`, not starting with a digit,
    /// at most 40 bytes.
    pub fn schema(mut self, schema: impl Into<String>) -> Self {
        self.schema = schema.into();
        self
    }

    /// The name of the holds table and the prefix of its companions (default
    /// [`DEFAULT_TABLE`]); the same rules as [`schema`](Self::schema). Backends on
    /// different tables share nothing: not a lock, not a fencing token.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long a queued waiter may go without polling before it is evicted. Default
    /// [`DEFAULT_WAITER_TIMEOUT`]; at least 3 ms.
    pub fn waiter_timeout(mut self, timeout: Duration) -> Self {
        self.waiter_timeout = timeout;
        self
    }

    /// How long one call may take before it fails as an outage. Default
    /// [`DEFAULT_RESPONSE_TIMEOUT`].
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// The watchdog lease clients of this backend use unless told otherwise.
    pub fn watchdog_lease(mut self, lease: Duration) -> Self {
        self.watchdog_lease = Some(lease);
        self
    }

    /// Whether [`build`](Self::build) creates the tables and functions (default `true`).
    /// Turn it off when migrations run elsewhere ([`PostgresBackend::migrate`]) or the
    /// application's role may not create objects.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Builds the backend: creates the schema objects (unless turned off) and starts
    /// listening for releases. Must run inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the bad setting; backend errors when the server
    /// cannot be reached.
    pub async fn build(self) -> Result<PostgresBackend> {
        validate_identifier("schema", &self.schema)?;
        validate_identifier("table", &self.table)?;
        super::validate_waiter_timeout(self.waiter_timeout)?;
        if self.response_timeout.is_zero() {
            return Err(Error::invalid_config(
                "response_timeout",
                "must be positive (got 0)",
            ));
        }
        if let Some(lease) = self.watchdog_lease {
            crate::lock::validate_watchdog_lease(lease)?;
        }
        if self.migrate {
            PostgresBackend::migrate(&self.pool, &self.schema, &self.table).await?;
        }
        let mut listener = PgListener::connect_with(&self.pool)
            .await
            .map_err(map_error)?;
        listener.listen(&self.table).await.map_err(map_error)?;
        let waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>> = Arc::default();
        let stop = CancellationToken::new();
        let origin = uuid::Uuid::new_v4().simple().to_string();
        tokio::spawn(listen(
            listener,
            origin.clone(),
            self.pool.clone(),
            self.table.clone(),
            Arc::clone(&waiters),
            stop.clone(),
        ));
        let options = self.pool.connect_options();
        let store_id = format!(
            "postgres://{}:{}/{}/{}.{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or(""),
            self.schema,
            self.table
        );
        let qualified = format!("{}.{}", self.schema, self.table);
        let statements = Statements {
            acquire: fill(
                "SELECT acquired, holds, token, ttl_ms FROM __F___acquire($1, $2, $3, $4, $5, $6, $7, $8, $9)",
                &qualified,
            ),
            release: fill("SELECT __F___release($1, $2, $3, $4, $5)", &qualified),
            renew: fill("SELECT * FROM __F___renew($1, $2, $3, $4)", &qualified),
        };
        Ok(PostgresBackend {
            inner: Arc::new(Inner {
                qualified,
                statements,
                clock: StoreClock::default(),
                pool: self.pool,
                waiter_timeout: self.waiter_timeout,
                response_timeout: self.response_timeout,
                watchdog_lease: self.watchdog_lease,
                store_id,
                origin,
                waiters,
                _stop_listener: stop.drop_guard(),
            }),
        })
    }
}

/// The listening connection's task: wakes the waiters a notification names. After a
/// lost connection it wakes them all once listening again (a release meanwhile was not
/// heard): when `PgListener` reconnected by itself (`Ok(None)`), and when it could not
/// and a new listener is made here.
async fn listen(
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
                let payload = notification.payload();
                let (all, rest) = match payload.split_at_checked(1) {
                    Some(("1", rest)) => (true, rest),
                    Some((_, rest)) => (false, rest),
                    None => continue,
                };
                // `<origin>|<name>`: a release by this backend woke its waiters already.
                let Some((from, name)) = rest.split_once('|') else {
                    continue;
                };
                if from == origin {
                    continue;
                }
                let Ok(key) = LockKey::new(name) else {
                    continue;
                };
                if let Some(w) = waiters_of(&waiters).get(&key) {
                    if all {
                        w.one.notify_all();
                    } else {
                        w.one.notify_one();
                    }
                    w.all.notify_all();
                }
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
                loop {
                    let jittered = backoff / 2 + backoff.mul_f64(fastrand::f64() / 2.0);
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(jittered) => {}
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    match relisten(&pool, &channel).await {
                        Ok(fresh) => {
                            listener = fresh;
                            tracing::info!("PostgreSQL listening connection re-established");
                            wake_everyone(&waiters);
                            break;
                        }
                        Err(error) => {
                            tracing::debug!(%error, retry_in_ms = backoff.as_millis() as u64, "PostgreSQL listening connection failed");
                        }
                    }
                }
            }
        }
    }
}

/// `body` with `__F__` replaced by the qualified table.
fn fill(body: &str, qualified: &str) -> String {
    body.replace("__F__", qualified)
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

fn waiters_of(
    waiters: &Mutex<HashMap<LockKey, KeyWaiters>>,
) -> MutexGuard<'_, HashMap<LockKey, KeyWaiters>> {
    waiters.lock().unwrap_or_else(PoisonError::into_inner)
}

struct PgSubscription {
    waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>>,
    key: LockKey,
    queued: bool,
    signal: Arc<Signal>,
    seen: u64,
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

impl LockBackend for PostgresBackend {
    fn name(&self) -> &'static str {
        "postgres"
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(self.acquire_now(req))
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
                Err(error) => {
                    let message = error.to_string();
                    reqs.iter()
                        .map(|_| Err(Error::Backend(message.clone().into())))
                        .collect()
                }
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
            let queued = self.queues_waiters(req.mode);
            let mut map = waiters_of(&self.inner.waiters);
            let w = map.entry(req.key.clone()).or_insert_with(|| KeyWaiters {
                one: Arc::new(Signal::new()),
                ones: 0,
                all: Arc::new(Signal::new()),
                alls: 0,
            });
            let signal = if queued {
                w.alls += 1;
                Arc::clone(&w.all)
            } else {
                w.ones += 1;
                Arc::clone(&w.one)
            };
            let seen = signal.seen();
            drop(map);
            let sub: Box<dyn Subscription> = Box::new(PgSubscription {
                waiters: Arc::clone(&self.inner.waiters),
                key: req.key.clone(),
                queued,
                signal,
                seen,
            });
            Ok(sub)
        })
    }

    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        !self.queues_waiters(req.mode)
            && waiters_of(&self.inner.waiters)
                .get(&req.key)
                .is_some_and(|w| w.ones > 0)
    }

    fn queues_waiters(&self, mode: LockMode) -> bool {
        matches!(mode, LockMode::Fair | LockMode::Read | LockMode::Write)
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let sql = self.sql("SELECT __F___cancel($1, $2, $3)");
            self.timed(
                sqlx::query(&sql)
                    .bind(req.key.as_str())
                    .bind(req.owner.as_str())
                    .bind(mode_char(req.mode))
                    .execute(&self.inner.pool),
            )
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
            let sql = self.sql("SELECT __F___abandon($1, $2, $3, $4)");
            self.timed(
                sqlx::query(&sql)
                    .bind(req.key.as_str())
                    .bind(req.owner.as_str())
                    .bind(mode_char(req.mode))
                    .bind(millis(keep))
                    .execute(&self.inner.pool),
            )
            .await?;
            Ok(())
        })
    }

    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let sql = self.sql("SELECT __F___force($1, $2)");
            self.timed(
                sqlx::query_scalar(&sql)
                    .bind(key.as_str())
                    .bind(mode_char(mode))
                    .fetch_one(&self.inner.pool),
            )
            .await
        })
    }

    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.state_of(key, mode))
    }

    fn register_client<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let sql = self.sql(
                "INSERT INTO __F___clients (id, name, expires_at) \
                 VALUES ($1, $2, clock_timestamp() + $3 * interval '1 millisecond') \
                 ON CONFLICT (id) DO UPDATE SET name = excluded.name, expires_at = excluded.expires_at",
            );
            self.timed(
                sqlx::query(&sql)
                    .bind(id)
                    .bind(name)
                    .bind(millis(ttl))
                    .execute(&self.inner.pool),
            )
            .await?;
            // Every client registers now and then: it sweeps what expired, so names
            // locked once (a crashed holder, a vanished waiter) leave no rows behind.
            // Expired rows count as absent everywhere, so deleting them changes nothing.
            let sweep = self.sql(
                "DELETE FROM __F__ WHERE expires_at <= clock_timestamp(); \
                 DELETE FROM __F___queue WHERE evict_at <= clock_timestamp(); \
                 DELETE FROM __F___clients WHERE expires_at <= clock_timestamp(); \
                 DELETE FROM __F___gone WHERE until <= clock_timestamp();",
            );
            self.timed(sqlx::raw_sql(&sweep).execute(&self.inner.pool))
                .await?;
            Ok(())
        })
    }

    fn client_names<'a>(
        &'a self,
        ids: &'a [&'a str],
    ) -> BoxFuture<'a, Result<Vec<Option<String>>>> {
        Box::pin(async move {
            let sql = self.sql(
                "SELECT id, name FROM __F___clients \
                  WHERE id = ANY($1) AND expires_at > clock_timestamp()",
            );
            let rows: Vec<(String, String)> = self
                .timed(
                    sqlx::query_as(&sql)
                        .bind(ids.to_vec())
                        .fetch_all(&self.inner.pool),
                )
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

    fn watchdog_lease(&self) -> Option<Duration> {
        self.inner.watchdog_lease
    }

    /// `postgres://<host>:<port>/<database>/<schema>.<table>`.
    fn store_id(&self) -> String {
        self.inner.store_id.clone()
    }
}

impl fmt::Debug for PostgresBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PostgresBackend")
            .field("store", &self.inner.store_id)
            .field("waiter_timeout", &self.inner.waiter_timeout)
            .finish()
    }
}

/// A mode as the functions take it: one byte (PostgreSQL's `"char"`).
fn mode_char(mode: LockMode) -> i8 {
    let c = match mode {
        LockMode::Exclusive => b'x',
        LockMode::Fair => b'f',
        LockMode::Read => b'r',
        LockMode::Write => b'w',
        LockMode::Permits { .. } => b'p',
    };
    c as i8
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

fn validate_identifier(name: &'static str, value: &str) -> Result<()> {
    let ok = !value.is_empty()
        && value.len() <= 40
        && value
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
        && !value.as_bytes()[0].is_ascii_digit();
    if ok {
        Ok(())
    } else {
        Err(Error::invalid_config(
            name,
            format!(
                "must be a plain identifier: 1 to 40 of a-z, 0-9 and _, not starting with a digit (got {value:?})"
            ),
        ))
    }
}

/// sqlx's error → the crate's. A store set up wrong is a misconfiguration, which
/// fails closed: undefined objects, syntax, permissions (SQLSTATE classes 42, 28), a
/// schema that is not there (3F), an isolation level the functions refuse or another
/// unsupported feature (0A), bad data (22), a read-only standby (25006). Anything else
/// (I/O, timeouts, a server shutting down or not accepting connections, a cancelled
/// statement) is an outage.
fn map_error(error: sqlx::Error) -> Error {
    if let sqlx::Error::Database(db) = &error
        && let Some(code) = db.code()
        && (["42", "28", "3F", "0A", "22"]
            .iter()
            .any(|class| code.starts_with(class))
            || code == "25006")
    {
        return Error::UnexpectedReply(format!("PostgreSQL refused a lock statement: {db}"));
    }
    Error::Backend(Box::new(error))
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn modes_are_one_byte_each() {
        let modes = [
            LockMode::Exclusive,
            LockMode::Fair,
            LockMode::Read,
            LockMode::Write,
            LockMode::Permits {
                max: std::num::NonZeroU32::MIN,
            },
        ];
        let chars: std::collections::HashSet<i8> = modes.into_iter().map(mode_char).collect();
        assert_eq!(chars.len(), 5);
    }

    #[test]
    fn the_schema_has_every_placeholder_filled() {
        let sql = SCHEMA_SQL.replace("__S__", "s").replace("__T__", "t");
        assert!(!sql.contains("__"), "a placeholder is left");
        assert!(sql.contains("s.t_acquire("));
    }
}
