//! [`PostgresBackendBuilder`]: the settings, checked when the backend is built.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sqlx::postgres::{PgListener, PgPool};
use tokio_util::sync::CancellationToken;

use super::listener::{KeyWaiters, listen};
use super::statements::Statements;
use super::{
    DEFAULT_RESPONSE_TIMEOUT, DEFAULT_SCHEMA, DEFAULT_TABLE, DEFAULT_WAITER_TIMEOUT, Inner,
    MIN_POOL_SIZE, PostgresBackend, map_error, validate_identifier,
};
use crate::backend::clock::StoreClock;
use crate::backend::{QUEUED_MODES, StoreProfile};
use crate::error::{Error, Result};
use crate::key::LockKey;

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

impl PostgresBackendBuilder {
    /// A builder on `pool` with every default.
    pub(super) fn new(pool: PgPool) -> Self {
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
    /// listening for releases, on a connection of the pool it keeps for that. Must run
    /// inside a tokio runtime.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidConfig`] naming the bad setting — among them a pool of fewer than
    /// [`MIN_POOL_SIZE`] connections (`max_connections`), since the listener keeps one;
    /// backend errors when the server cannot be reached.
    pub async fn build(self) -> Result<PostgresBackend> {
        self.validate()?;
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
        let qualified = format!("{}.{}", self.schema, self.table);
        Ok(PostgresBackend {
            inner: Arc::new(Inner {
                statements: Statements::new(&self.schema, &self.table),
                qualified,
                clock: StoreClock::default(),
                profile: StoreProfile::new("postgres")
                    .with_store_id(self.store_id())
                    .with_queued_modes(QUEUED_MODES)
                    .with_watchdog_lease(self.watchdog_lease),
                pool: self.pool,
                waiter_timeout: self.waiter_timeout,
                response_timeout: self.response_timeout,
                origin,
                waiters,
                _stop_listener: stop.drop_guard(),
            }),
        })
    }

    /// Checks every setting, in the order of their errors.
    fn validate(&self) -> Result<()> {
        validate_identifier("schema", &self.schema)?;
        validate_identifier("table", &self.table)?;
        // The listener keeps one of the pool's connections for `LISTEN`: with no second
        // one, every statement would wait for a connection until it timed out.
        let max_connections = self.pool.options().get_max_connections();
        if max_connections < MIN_POOL_SIZE {
            return Err(Error::invalid_config(
                "max_connections",
                format!(
                    "the pool allows {max_connections} connection(s), and the backend's listener keeps one for LISTEN; set PgPoolOptions::max_connections to at least {MIN_POOL_SIZE}"
                ),
            ));
        }
        crate::backend::limits::validate_waiter_timeout(self.waiter_timeout)?;
        if self.response_timeout.is_zero() {
            return Err(Error::invalid_config(
                "response_timeout",
                "must be positive (got 0)",
            ));
        }
        if let Some(lease) = self.watchdog_lease {
            crate::backend::limits::validate_watchdog_lease(lease)?;
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
