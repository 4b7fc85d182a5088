//! [`PostgresBackendBuilder`]: the settings, checked when the backend is built.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::PgPool;
use tokio_util::sync::CancellationToken;

use super::conns::Kept;
use super::listener::{KeyWaiters, Listening, Live, listen};
use super::statements::{Statements, millis};
use super::{
    DEFAULT_KEPT_CONNECTIONS, DEFAULT_RESPONSE_TIMEOUT, DEFAULT_SCHEMA, DEFAULT_TABLE,
    DEFAULT_TOKEN_RETENTION, DEFAULT_WAITER_TIMEOUT, Inner, PostgresBackend, map_error,
    validate_identifier,
};
use crate::backend::clock::StoreClock;
use crate::backend::{QUEUED_MODES, StoreProfile};
use crate::error::{ConfigError, SetupError};
use crate::key::LockKey;

/// Configures a [`PostgresBackend`].
#[must_use]
pub struct PostgresBackendBuilder {
    pool: PgPool,
    schema: String,
    table: String,
    waiter_timeout: Duration,
    response_timeout: Duration,
    fast_grants: Option<Duration>,
    kept_connections: usize,
    hand_over: bool,
    migrate: bool,
    token_retention: Duration,
}

impl PostgresBackendBuilder {
    /// A builder on `pool` with every default.
    pub(super) fn new(pool: PgPool) -> Self {
        PostgresBackendBuilder {
            pool,
            schema: DEFAULT_SCHEMA.to_owned(),
            table: DEFAULT_TABLE.to_owned(),
            waiter_timeout: DEFAULT_WAITER_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            fast_grants: None,
            kept_connections: DEFAULT_KEPT_CONNECTIONS,
            hand_over: false,
            migrate: true,
            token_retention: DEFAULT_TOKEN_RETENTION,
        }
    }

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
    ///
    /// It bounds the database's side as well: each statement waits for a lock in the
    /// database (a row, a name's advisory lock) no longer than this (its transaction's
    /// `lock_timeout`), so that a statement its caller gave up on does not go on
    /// waiting there and keep its pool connection.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long a name's row (`<table>_names`, which keeps the name's last fencing
    /// token) outlives its last hold and token: [`DEFAULT_TOKEN_RETENTION`] by default.
    /// The backend sweeps on a schedule (every retention, between 1 s and 1 min, at
    /// most 1,000 rows of a table a statement) every row that expired and every name
    /// free for the retention whose token is a retention behind the database's clock:
    /// a token taken after that starts from the clock in microseconds, above every
    /// earlier one, unless the database's clock steps back by more than the retention.
    /// A name locked once leaves no row behind for longer than that. At least 1 s.
    pub fn token_retention(mut self, retention: Duration) -> Self {
        self.token_retention = retention;
        self
    }

    /// Opt-in fast mode: an exclusive grant whose lease is at most `max_lease` commits
    /// without waiting for the disk (`synchronous_commit = off` for its transaction),
    /// which saves the grant's `fdatasync` — most of an uncontended lock's time on
    /// PostgreSQL.
    ///
    /// **What it costs.** A crash of the server (or of its machine, or a failover to a
    /// standby) may lose such a grant after its client was told "acquired". So after a
    /// crash, **nothing is granted on this table, in any mode, for `max_lease`**: an
    /// epoch gate, an `UNLOGGED` table that crash recovery empties, closes at the first
    /// attempt after the restart and opens one `max_lease` later, when every grant the
    /// crash may have lost has ended. A clean shutdown loses nothing and closes no gate.
    /// Longer leases (a fixed lease above `max_lease`, or a watchdog lease above it) are
    /// granted durably as without this setting; so are the other modes.
    ///
    /// [`build`](Self::build) records the mode in the table (durably, before any fast
    /// grant), and it stays on for the table: every backend of the table, fast or not,
    /// honours the gate. Keep `max_lease` near the watchdog lease: it is the outage a
    /// crash costs. At least 1 ms.
    ///
    /// ```no_run
    /// # async fn demo(pool: sqlx::PgPool) -> Result<(), tower_lock::Error> {
    /// use std::time::Duration;
    /// let backend = tower_lock::PostgresBackend::builder(pool)
    ///     .fast_grants(Duration::from_secs(10)) // after a crash: no grants for 10 s
    ///     .build()
    ///     .await?;
    /// // Watchdog holds within the fast grants' bound:
    /// let client = tower_lock::LockClient::builder(backend)
    ///     .watchdog_lease(Duration::from_secs(10))
    ///     .build()?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn fast_grants(mut self, max_lease: Duration) -> Self {
        self.fast_grants = Some(max_lease);
        self
    }

    /// How many of the pool's connections the backend keeps checked out between its
    /// exclusive acquisitions and releases (default [`DEFAULT_KEPT_CONNECTIONS`]: none).
    /// sqlx's pool tests every connection it takes back with a round trip of its own,
    /// whatever its options: through the pool, a lock statement costs the server two
    /// wake-ups. On a kept connection it costs one (at one worker, 1.6× the lock+unlock
    /// rate; see `docs/performance.md`).
    ///
    /// Meant for a pool of the backend's own: while locks are busy, kept connections are
    /// not available to anything else on the pool, the backend's other statements
    /// included (which then share what is left). At most `max_connections - 1` are kept,
    /// so that the other statements always find one. A kept connection idle for a second
    /// goes back to the pool once it has answered a ping within the response timeout (it
    /// is closed otherwise); one whose statement failed always does, and the pool tests
    /// it; one whose statement was given up on (the response timeout, a cancelled
    /// caller) is closed, as is any connection's of the pool.
    pub fn kept_connections(mut self, n: usize) -> Self {
        self.kept_connections = n;
        self
    }

    /// Opt-in hand-over (default off): this backend's exclusive waiters register in the
    /// database (`<table>_waiters`), and a release, by any backend of the table, hands
    /// the lock to the oldest registered waiter still waiting, in the release's own
    /// transaction. The waiter takes it without a statement of its own: a handoff costs
    /// one transaction instead of a release, a notification and the waiter's own
    /// attempt (at the median 32–37 µs instead of 330–370 µs at 8 workers; see
    /// `docs/performance.md`).
    ///
    /// **What it changes.** Waiters are served oldest first across every process that
    /// opted in, instead of whoever tries first after the release. A busy attempt also
    /// writes the registration, and a waiter that leaves early (cancelled) takes it
    /// back with one more statement. A waiter is never handed a lock past the time it
    /// gives up, or once its process is gone (its listening session's advisory lock
    /// is the proof); a waiter whose future is parked without being dropped can be
    /// handed one, which then lapses with its lease, like a holder that stopped.
    ///
    /// Off by default because of what it did to a burst where each name is wanted by
    /// more callers than its wait lets through (the flash-sale demo: 5 orders of 20 ms
    /// behind a 50 ms wait): retries that were handed their idempotency key at once
    /// went on to contend for the user's lock, and 4,900 orders were answered busy
    /// instead of 3,000.
    pub fn hand_over(mut self, on: bool) -> Self {
        self.hand_over = on;
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
    /// listening for releases, on a connection of its own made with the pool's connect
    /// options (outside the pool). Must run inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] naming the bad setting; [`SetupError::Store`] when the
    /// server cannot be reached or used.
    pub async fn build(self) -> Result<PostgresBackend, SetupError> {
        self.validate()?;
        if self.migrate {
            PostgresBackend::migrate(&self.pool, &self.schema, &self.table).await?;
        }
        if let Some(max_lease) = self.fast_grants {
            let sql = format!("SELECT {}.{}_enable_fast($1)", self.schema, self.table);
            sqlx::query(&sql)
                .bind(millis(max_lease))
                .execute(&self.pool)
                .await
                .map_err(map_error)?;
        }
        let qualified = format!("{}.{}", self.schema, self.table);
        // The liveness lock this backend's waiters register with, held by the listening
        // session (only when they register: with hand-over).
        let listening = Listening {
            pool: self.pool.clone(),
            channel: self.table.clone(),
            live: Live::new(&qualified, self.hand_over),
            within: self.response_timeout,
        };
        let listener = listening.connect().await.map_err(map_error)?;
        let live = listening.live.clone();
        let waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>> = Arc::default();
        let stop = CancellationToken::new();
        let origin = uuid::Uuid::new_v4().simple().to_string();
        tokio::spawn(listen(
            listener,
            origin.clone(),
            listening,
            Arc::clone(&waiters),
            stop.clone(),
        ));
        let max_kept = usize::try_from(self.pool.options().get_max_connections())
            .unwrap_or(usize::MAX)
            .saturating_sub(1);
        let kept = Arc::new(Kept::new(
            self.kept_connections.min(max_kept),
            self.response_timeout,
        ));
        if kept.cap() > 0 {
            tokio::spawn(Arc::clone(&kept).sweep_until(stop.clone()));
        }
        let backend = PostgresBackend {
            inner: Arc::new(Inner {
                statements: Statements::new(&self.schema, &self.table, self.response_timeout),
                qualified,
                clock: StoreClock::default(),
                profile: StoreProfile::new("postgres")
                    .with_store_id(self.store_id())
                    .with_queued_modes(QUEUED_MODES),
                pool: self.pool,
                waiter_timeout: self.waiter_timeout,
                response_timeout: self.response_timeout,
                fast_grants: self.fast_grants,
                kept,
                batcher: Default::default(),
                origin,
                waiters,
                hand_over: self.hand_over,
                live,
                token_retention: self.token_retention,
                _stop_listener: stop.clone().drop_guard(),
            }),
        };
        tokio::spawn(super::sweep::sweep_until(
            Arc::downgrade(&backend.inner),
            super::sweep::period(self.token_retention),
            stop,
        ));
        Ok(backend)
    }

    /// Checks every setting, in the order of their errors.
    fn validate(&self) -> Result<(), ConfigError> {
        validate_identifier("schema", &self.schema)?;
        validate_identifier("table", &self.table)?;
        crate::backend::limits::validate_waiter_timeout(self.waiter_timeout)?;
        if self.response_timeout.is_zero() {
            return Err(ConfigError::invalid_setting(
                "response_timeout",
                "must be positive (got 0)",
            ));
        }
        if self.token_retention < Duration::from_secs(1) || self.token_retention > crate::MAX_LEASE
        {
            return Err(ConfigError::invalid_setting(
                "token_retention",
                format!(
                    "must be between 1 s and 365 days (got {:?})",
                    self.token_retention
                ),
            ));
        }
        if self
            .fast_grants
            .is_some_and(|max| max < Duration::from_millis(1))
        {
            return Err(ConfigError::invalid_setting(
                "fast_grants",
                "the longest fast lease must be at least 1 ms",
            ));
        }
        Ok(())
    }

    /// The store's identity: `postgres://<host>:<port>/<database>/<schema>.<table>`.
    fn store_id(&self) -> String {
        let options = self.pool.connect_options();
        format!(
            "postgres://{}:{}/{}/{}.{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or(""),
            self.schema,
            self.table
        )
    }
}
