//! [`MySqlBackendBuilder`]: the settings, checked when the backend is built, and the
//! server's durability, read then.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use sqlx::Row;
use sqlx::mysql::MySqlPool;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::listener::{KeyWaiters, Listening, listen};
use super::statements::{Statements, millis};
use super::{
    DEFAULT_RESPONSE_TIMEOUT, DEFAULT_TABLE, DEFAULT_TOKEN_RETENTION, DEFAULT_WAITER_TIMEOUT,
    DEFAULT_WAKE_POLL, Inner, MySqlBackend, map_error, validate_identifier,
};
use crate::backend::clock::StoreClock;
use crate::backend::{QUEUED_MODES, StoreProfile};
use crate::error::{ConfigError, SetupError};
use crate::key::LockKey;

/// Configures a [`MySqlBackend`].
#[must_use]
pub struct MySqlBackendBuilder {
    pool: MySqlPool,
    table: String,
    waiter_timeout: Duration,
    response_timeout: Duration,
    migrate: bool,
    token_retention: Duration,
    wake_poll: Duration,
}

impl MySqlBackendBuilder {
    /// A builder on `pool` with every default.
    pub(super) fn new(pool: MySqlPool) -> Self {
        MySqlBackendBuilder {
            pool,
            table: DEFAULT_TABLE.to_owned(),
            waiter_timeout: DEFAULT_WAITER_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            migrate: true,
            token_retention: DEFAULT_TOKEN_RETENTION,
            wake_poll: DEFAULT_WAKE_POLL,
        }
    }

    /// The name of the holds table, which the other tables and the procedures are
    /// named after (default [`DEFAULT_TABLE`]), in the pool's database. A plain
    /// identifier: lowercase ASCII letters, digits and `_`, not starting with a digit,
    /// at most 40 bytes.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long a queued waiter may go without asking before it is evicted. Default
    /// [`DEFAULT_WAITER_TIMEOUT`]; at least 3 ms.
    pub fn waiter_timeout(mut self, timeout: Duration) -> Self {
        self.waiter_timeout = timeout;
        self
    }

    /// How long one call may take before it fails as an outage. Default
    /// [`DEFAULT_RESPONSE_TIMEOUT`].
    ///
    /// It bounds the database's side as well: each call waits for a row lock no longer
    /// than this, rounded up to whole seconds (its `innodb_lock_wait_timeout`, set for
    /// the call and restored after it), so that a call its caller gave up on does not go
    /// on waiting there and keep its pool connection.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// How long a name's row (`<table>_names`, which keeps the name's last fencing
    /// token) outlives its last hold and token: [`DEFAULT_TOKEN_RETENTION`] by default.
    /// The backend sweeps on a schedule (every retention, between 1 s and 1 min, at
    /// most 1,000 rows of a table a call) every row that expired and every name free
    /// for the retention whose token is a retention behind the database's clock: a
    /// token taken after that starts from the clock in microseconds, above every
    /// earlier one, unless the database's clock steps back by more than the retention.
    /// At least 1 s.
    pub fn token_retention(mut self, retention: Duration) -> Self {
        self.token_retention = retention;
        self
    }

    /// How often, while anyone in this process waits, the backend's listening
    /// connection reads the release counters of the names waited for (one statement for
    /// all of them): [`DEFAULT_WAKE_POLL`] by default. A release in another process
    /// reaches a waiter here within about this plus a round trip; one in this process at
    /// once. Between 100 µs and 1 s.
    pub fn wake_poll(mut self, every: Duration) -> Self {
        self.wake_poll = every;
        self
    }

    /// Whether [`build`](Self::build) creates the tables and procedures (default
    /// `true`). Turn it off when migrations run elsewhere ([`MySqlBackend::migrate`])
    /// or the application's user may not create objects.
    pub fn migrate(mut self, migrate: bool) -> Self {
        self.migrate = migrate;
        self
    }

    /// Builds the backend: checks the server's durability, creates the schema objects
    /// (unless turned off) and starts listening for releases, on a connection of its
    /// own made with the pool's connect options (outside the pool). Must run inside a
    /// tokio runtime.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] naming the bad setting, or the server setting that lets a
    /// crash of the server lose a grant (`innodb_flush_log_at_trx_commit = 0`);
    /// [`SetupError::Store`] when the server cannot be reached or used.
    pub async fn build(self) -> Result<MySqlBackend, SetupError> {
        self.validate()?;
        check_durability(&self.pool).await?;
        if self.migrate {
            MySqlBackend::migrate(&self.pool, &self.table).await?;
        }
        let statements = Statements::new(&self.table, self.response_timeout);
        let waiters: Arc<Mutex<HashMap<LockKey, KeyWaiters>>> = Arc::default();
        let nudge = Arc::new(Notify::new());
        let listening = Listening {
            pool: self.pool.clone(),
            released_sql: statements.released.clone(),
            within: self.response_timeout,
            poll: self.wake_poll,
            waiters: Arc::clone(&waiters),
            nudge: Arc::clone(&nudge),
        };
        let first = listening.connect().await.map_err(map_error)?;
        let stop = CancellationToken::new();
        tokio::spawn(listen(listening, Some(first), stop.clone()));
        let backend = MySqlBackend {
            inner: Arc::new(Inner {
                profile: StoreProfile::new("mysql")
                    .with_store_id(self.store_id())
                    .with_queued_modes(QUEUED_MODES),
                statements,
                table: self.table,
                clock: StoreClock::default(),
                pool: self.pool,
                waiter_timeout: self.waiter_timeout,
                response_timeout: self.response_timeout,
                token_retention: self.token_retention,
                waiters,
                nudge,
                checking: Arc::default(),
                _stop: stop.clone().drop_guard(),
            }),
        };
        tokio::spawn(sweep_until(
            Arc::downgrade(&backend.inner),
            sweep_period(self.token_retention),
            stop,
        ));
        Ok(backend)
    }

    /// Checks every setting, in the order of their errors.
    fn validate(&self) -> Result<(), ConfigError> {
        validate_identifier("table", &self.table)?;
        crate::backend::limits::validate_waiter_timeout(self.waiter_timeout)?;
        if self.wake_poll < Duration::from_micros(100) || self.wake_poll > Duration::from_secs(1) {
            return Err(ConfigError::invalid_setting(
                "wake_poll",
                format!("must be between 100 µs and 1 s (got {:?})", self.wake_poll),
            ));
        }
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
        Ok(())
    }

    /// The store's identity: `mysql://<host>:<port>/<database>/<table>`.
    fn store_id(&self) -> String {
        let options = self.pool.connect_options();
        format!(
            "mysql://{}:{}/{}/{}",
            options.get_host(),
            options.get_port(),
            options.get_database().unwrap_or(""),
            self.table
        )
    }
}

/// What a crash may cost on the server found: InnoDB makes commits durable server-wide,
/// so the backend cannot raise it per call as it does on PostgreSQL.
///
/// - `innodb_flush_log_at_trx_commit = 1`, and no binary log or `sync_binlog = 1`: a
///   grant its client was told about survives a crash of the server and of its machine.
/// - `= 2`, or a binary log not synced at each commit: it survives a crash of the
///   server (the log is in the operating system's hands at the commit), not one of the
///   machine. The backend starts, and says so once (WARN).
/// - `= 0`: a crash of the server itself may lose the last second of grants, so two
///   owners could each be told they hold one lock. The backend refuses to start.
async fn check_durability(pool: &MySqlPool) -> Result<(), SetupError> {
    // On a connection of its own: a future over `&MySqlPool` as the executor is not
    // `Send` for every lifetime, which a caller in a `Send` future needs.
    let mut conn = pool.acquire().await.map_err(map_error)?;
    let row = sqlx::query(
        "SELECT CAST(@@innodb_flush_log_at_trx_commit AS SIGNED), CAST(@@log_bin AS SIGNED), \
                CAST(@@sync_binlog AS SIGNED)",
    )
    .fetch_one(&mut *conn)
    .await
    .map_err(map_error)?;
    let flush: i64 = row.try_get(0).map_err(map_error)?;
    let log_bin: i64 = row.try_get(1).map_err(map_error)?;
    let sync_binlog: i64 = row.try_get(2).map_err(map_error)?;
    match durability(flush, log_bin != 0, sync_binlog) {
        Durability::Full => Ok(()),
        Durability::ServerCrash(why) => {
            tracing::warn!(
                "MySQL: a lock granted just before a crash of the machine (not of the server alone) may be lost: {why}"
            );
            Ok(())
        }
        Durability::None => Err(ConfigError::invalid_setting(
            "innodb_flush_log_at_trx_commit",
            "is 0 on this server: a crash of the server may lose grants their clients were told about, \
             and then a second owner is granted a lock the first still holds; set it to 1 (or 2)",
        )
        .into()),
    }
}

/// What a crash may cost, by the server's settings.
#[derive(Debug, PartialEq, Eq)]
enum Durability {
    /// Grants survive a crash of the server and of the machine.
    Full,
    /// Grants survive a crash of the server, not of the machine: why.
    ServerCrash(&'static str),
    /// A crash of the server may lose grants.
    None,
}

fn durability(flush_log_at_trx_commit: i64, log_bin: bool, sync_binlog: i64) -> Durability {
    match flush_log_at_trx_commit {
        0 => Durability::None,
        1 if !log_bin || sync_binlog == 1 => Durability::Full,
        1 => Durability::ServerCrash(
            "the binary log is not synced at each commit (sync_binlog <> 1)",
        ),
        _ => Durability::ServerCrash(
            "innodb_flush_log_at_trx_commit = 2 writes the log at commit but syncs it once a second",
        ),
    }
}

/// The most rows of one table one sweep call deletes.
const SWEEP_BATCH: i64 = 1000;

/// How often a backend with this token retention sweeps: every retention, between 1 s
/// and 1 min.
fn sweep_period(retention: Duration) -> Duration {
    retention.clamp(Duration::from_secs(1), Duration::from_secs(60))
}

/// Sweeps every `period` (soon again after a full batch) until `stop`, or the backend
/// is gone.
async fn sweep_until(inner: Weak<Inner>, period: Duration, stop: CancellationToken) {
    let mut pause = period;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let backend = MySqlBackend { inner };
        let retention = millis(backend.inner.token_retention);
        let sql = &backend.inner.statements.sweep;
        let swept: crate::Result<i64> = backend
            .on_connection(async |conn| {
                sqlx::query_scalar(sql)
                    .bind(retention)
                    .bind(SWEEP_BATCH)
                    .fetch_all(conn)
                    .await
                    .and_then(super::statements::first_row)
            })
            .await;
        pause = match swept {
            Ok(most) if most >= SWEEP_BATCH => Duration::from_secs(1),
            Ok(_) => period,
            Err(error) => {
                tracing::debug!(%error, "sweeping expired lock rows failed; trying again later");
                period
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durability_follows_the_servers_settings() {
        assert_eq!(durability(1, false, 0), Durability::Full);
        assert_eq!(durability(1, true, 1), Durability::Full);
        assert!(matches!(durability(1, true, 0), Durability::ServerCrash(_)));
        assert!(matches!(
            durability(2, false, 0),
            Durability::ServerCrash(_)
        ));
        assert_eq!(durability(0, false, 1), Durability::None);
    }
}
