//! The backend's calls: the schema (`sql/mysql.sql`) for a table, the statements of the
//! hot path formatted once, and the operations that send them.

use std::time::Duration;

use sqlx::Row;
use sqlx::mysql::{MySqlConnection, MySqlPool};

use super::{MySqlBackend, map_error};
use crate::backend::clock::ArrivedLate;
use crate::backend::{
    Acquire, FencingToken, Grant, HoldInfo, LockMode, LockRequest, LockState, Release, Stored,
    WaiterScope, Waiters, queued,
};
use crate::error::{Error, Result, SetupError, StoreErrorKind};
use crate::hold_id::HoldId;
use crate::key::LockKey;

/// The schema, with `__T__` for the table, `__VERSION__` for [`SCHEMA_VERSION`], and
/// `__BEGIN__`/`__COMMIT__` for [`BEGIN`]/[`COMMIT`].
const SCHEMA: &str = include_str!("../../../sql/mysql.sql");

/// The start of every state-changing procedure's transaction, after its own
/// declarations: row-lock waits bounded to `p_wait_s` seconds, an error rolled back with
/// the session's bound restored, a READ COMMITTED transaction begun.
const BEGIN: &str = "DECLARE v_wait INT DEFAULT @@innodb_lock_wait_timeout;
    DECLARE EXIT HANDLER FOR SQLEXCEPTION
    BEGIN
        ROLLBACK;
        SET innodb_lock_wait_timeout = v_wait;
        RESIGNAL;
    END;
    SET innodb_lock_wait_timeout = p_wait_s;
    SET TRANSACTION ISOLATION LEVEL READ COMMITTED;
    START TRANSACTION;";

/// The end of [`BEGIN`]'s transaction: committed, the session's bound restored.
const COMMIT: &str = "COMMIT;
    SET innodb_lock_wait_timeout = v_wait;";

/// The version of `sql/mysql.sql` this build carries: a migration finding it in
/// `<table>_schema` changes nothing. Raise it with every change of the file.
const SCHEMA_VERSION: i64 = 3;

/// The statements, for one table.
pub(super) struct Statements {
    pub(super) acquire: String,
    pub(super) release: String,
    pub(super) replay_store: String,
    pub(super) replay_load: String,
    pub(super) renew: String,
    pub(super) abandon: String,
    pub(super) cancel: String,
    pub(super) force: String,
    pub(super) client_register: String,
    pub(super) client_name: String,
    pub(super) client_unregister: String,
    /// The release counters of the names in a JSON array: (place from 1, counter).
    pub(super) released: String,
    pub(super) sweep: String,
    /// The longest a call waits for a row lock, in whole seconds (at least 1: what
    /// `innodb_lock_wait_timeout` takes), from the response timeout.
    pub(super) wait_s: i64,
}

impl Statements {
    pub(super) fn new(table: &str, response_timeout: Duration) -> Self {
        let t = |sql: &str| sql.replace("__T__", table);
        Statements {
            acquire: t("CALL `__T___acquire`(?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"),
            release: t("CALL `__T___release`(?, ?, ?, ?, ?)"),
            replay_store: t("CALL `__T___replay_store`(?, ?, ?, ?, ?, ?, ?, ?)"),
            replay_load: t("SELECT record FROM `__T___replay` WHERE name = ? \
                  AND expires_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"),
            renew: t("CALL `__T___renew`(?, ?)"),
            abandon: t("CALL `__T___abandon`(?, ?, ?, ?, ?)"),
            cancel: t("CALL `__T___cancel`(?, ?, ?, ?)"),
            force: t("CALL `__T___force`(?, ?, ?)"),
            client_register: t("INSERT INTO `__T___clients` (id, name, expires_us) \
                 VALUES (?, ?, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) + ? * 1000) \
                 ON DUPLICATE KEY UPDATE name = VALUES(name), expires_us = VALUES(expires_us)"),
            client_name: t("SELECT name FROM `__T___clients` WHERE id = ? \
                  AND expires_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))"),
            client_unregister: t("DELETE FROM `__T___clients` WHERE id = ?"),
            released: t(
                "SELECT CAST(j.i AS SIGNED), CAST(COALESCE(n.released, 0) AS SIGNED) \
                   FROM JSON_TABLE(?, '$[*]' COLUMNS ( \
                            i FOR ORDINALITY, \
                            name VARCHAR(1280) CHARACTER SET utf8mb4 PATH '$')) j \
                   LEFT JOIN `__T___names` n ON n.name = j.name",
            ),
            sweep: t("CALL `__T___sweep`(?, ?)"),
            wait_s: wait_s(response_timeout),
        }
    }
}

/// `wait` in whole seconds, rounded up, at least 1.
fn wait_s(wait: Duration) -> i64 {
    i64::try_from(wait.as_millis().div_ceil(1000))
        .unwrap_or(i64::MAX)
        .max(1)
}

/// The schema's statements for `table`, one by one.
pub(super) fn schema_statements(table: &str) -> Vec<String> {
    SCHEMA
        .replace("__T__", table)
        .replace("__VERSION__", &SCHEMA_VERSION.to_string())
        .replace("__BEGIN__", BEGIN)
        .replace("__COMMIT__", COMMIT)
        .split("\n//\n")
        .map(|s| s.trim().to_owned())
        .filter(|s| {
            s.lines()
                .any(|l| !l.trim().is_empty() && !l.trim_start().starts_with("--"))
        })
        .collect()
}

/// Creates the schema of `table` unless its version is there, behind a `GET_LOCK` of
/// the database and table so that two processes never interleave their statements.
pub(super) async fn migrate(pool: &MySqlPool, table: &str) -> Result<(), SetupError> {
    let mut conn = pool.acquire().await.map_err(map_error)?;
    let lock_name = format!("tower_lock migrate {table}");
    let got: Option<i64> = sqlx::query_scalar("SELECT GET_LOCK(CONCAT(DATABASE(), ' ', ?), 30)")
        .bind(&lock_name)
        .fetch_one(&mut *conn)
        .await
        .map_err(map_error)?;
    if got != Some(1) {
        return Err(Error::store(
            StoreErrorKind::Unavailable,
            "another process's migration held the schema lock for 30 s",
        )
        .into());
    }
    let migrated = migrate_on(&mut conn, table).await;
    let released = sqlx::query("SELECT RELEASE_LOCK(CONCAT(DATABASE(), ' ', ?))")
        .bind(&lock_name)
        .execute(&mut *conn)
        .await;
    migrated?;
    released.map_err(map_error)?;
    Ok(())
}

/// The migration proper, on the connection that holds the schema lock.
async fn migrate_on(conn: &mut MySqlConnection, table: &str) -> Result<(), SetupError> {
    let version_sql = format!("SELECT version FROM `{table}_schema` WHERE id = 1");
    let current: Option<i64> = match sqlx::query_scalar(&version_sql)
        .fetch_optional(&mut *conn)
        .await
    {
        Ok(version) => version,
        // No such table yet (1146): a first migration.
        Err(error) if super::error_number(&error) == Some(1146) => None,
        Err(error) => return Err(map_error(error).into()),
    };
    if current == Some(SCHEMA_VERSION) {
        return Ok(());
    }
    for statement in schema_statements(table) {
        // The text protocol: a procedure's definition cannot be a prepared statement.
        sqlx::Executor::execute(&mut *conn, statement.as_str())
            .await
            .map_err(map_error)?;
    }
    Ok(())
}

/// The first row of a `CALL`'s answer, read whole (`fetch_all`): `fetch_one` would
/// leave the rest of the answer (the `CALL`'s own status) for the pool to read when it
/// takes the connection back.
pub(super) fn first_row<T>(rows: Vec<T>) -> Result<T, sqlx::Error> {
    rows.into_iter().next().ok_or(sqlx::Error::RowNotFound)
}

/// `d` in whole milliseconds, as the procedures take it.
pub(super) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// A mode as the procedures take it: one letter.
pub(super) fn mode_char(mode: LockMode) -> &'static str {
    match mode {
        LockMode::Exclusive => "x",
        LockMode::Fair => "f",
        LockMode::Read => "r",
        LockMode::Write => "w",
        LockMode::Permits { .. } => "p",
    }
}

/// How many times an acquisition is sent again at once when it was refused past its
/// deadline on a fresh sample, before the refusal is passed on.
const AGAIN_LATE: u32 = 1;

impl MySqlBackend {
    /// The deadline, on the database's clock in microseconds, of an attempt sent now:
    /// its response times out when the database's clock has passed it (see
    /// [`clock`](crate::backend::clock)). Samples the clock when the last sample is old.
    async fn attempt_deadline(&self) -> Result<i64> {
        let window = self.inner.response_timeout;
        if let Some(deadline) = self.inner.clock.deadline(&(), window, 0) {
            return Ok(i64::try_from(deadline).unwrap_or(i64::MAX));
        }
        let now_us: i64 = self
            .on_connection(async |conn| {
                sqlx::query_scalar(
                    "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) AS SIGNED)",
                )
                .fetch_one(conn)
                .await
            })
            .await?;
        let received = std::time::Instant::now();
        self.inner
            .clock
            .record((), u64::try_from(now_us).unwrap_or(0), received, 0);
        let deadline = self
            .inner
            .clock
            .deadline(&(), window, 0)
            .unwrap_or(u64::MAX);
        Ok(i64::try_from(deadline).unwrap_or(i64::MAX))
    }

    pub(super) async fn acquire_now(&self, req: &LockRequest) -> Result<Acquire> {
        let mut again = AGAIN_LATE;
        loop {
            let deadline = self.attempt_deadline().await?;
            match self.attempt(req, deadline).await {
                Err(error) if ArrivedLate::of(&error).is_some() && again > 0 => {
                    again -= 1;
                    self.inner.clock.forget();
                }
                answer => return answer,
            }
        }
    }

    /// One attempt of `req` with its `deadline`: one call of `_acquire`.
    async fn attempt(&self, req: &LockRequest, deadline: i64) -> Result<Acquire> {
        let max = match req.mode {
            LockMode::Permits { max } => i64::from(max.get()),
            _ => 0,
        };
        let statements = &self.inner.statements;
        let row = self
            .on_connection(async |conn| {
                sqlx::query(&statements.acquire)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
                    .bind(max)
                    .bind(millis(req.lease))
                    .bind(req.fenced)
                    .bind(req.writer.as_ref().map(HoldId::as_str))
                    .bind(millis(self.inner.waiter_timeout))
                    .bind(deadline)
                    .bind(statements.wait_s)
                    .fetch_all(conn)
                    .await
                    .and_then(first_row)
            })
            .await?;
        let int = |i: usize| -> Result<Option<i64>> {
            row.try_get::<Option<i64>, _>(i).map_err(map_error)
        };
        let acquired = int(0)?.unwrap_or(0) != 0;
        let holds = int(1)?.unwrap_or(0);
        let token = int(2)?;
        let ttl_ms = int(3)?.unwrap_or(-1);
        let released = int(4)?.unwrap_or(0);
        if ttl_ms == -2 {
            return Err(ArrivedLate::error("MySQL", None));
        }
        if acquired {
            let token = token.map(|t| FencingToken::new(t.unsigned_abs()));
            return Ok(Acquire::Acquired(Grant::new(
                u32::try_from(holds).unwrap_or(1),
                token,
            )));
        }
        // What this process's waiters of the name have seen: a later release wakes them.
        self.saw(&req.key, released);
        let ttl = (ttl_ms >= 0).then(|| Duration::from_millis(ttl_ms.unsigned_abs()));
        Ok(Acquire::Busy { ttl })
    }

    pub(super) async fn release_now(&self, req: &LockRequest) -> Result<Release> {
        let statements = &self.inner.statements;
        let left: i64 = self
            .on_connection(async |conn| {
                sqlx::query_scalar(&statements.release)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
                    .bind(millis(req.lease))
                    .bind(statements.wait_s)
                    .fetch_all(conn)
                    .await
                    .and_then(first_row)
            })
            .await?;
        Ok(self.released(&req.key, left))
    }

    /// What a release that answered `left` (-1 not held, 0 released, n left) did; a
    /// release wakes this process's waiters at once.
    fn released(&self, key: &LockKey, left: i64) -> Release {
        match left {
            -1 => Release::NotHeld,
            0 => {
                self.wake_local(key);
                Release::Released
            }
            n => Release::Decremented {
                holds: u32::try_from(n).unwrap_or(u32::MAX),
            },
        }
    }

    pub(super) async fn store_and_release_now(
        &self,
        req: &LockRequest,
        token: FencingToken,
        record: &[u8],
        ttl: Duration,
    ) -> Result<Stored> {
        let token = i64::try_from(token.get()).map_err(|_| {
            Error::store(
                StoreErrorKind::Misconfigured,
                format!("the fencing token {token} is beyond MySQL's BIGINT"),
            )
        })?;
        let statements = &self.inner.statements;
        let row = self
            .on_connection(async |conn| {
                sqlx::query(&statements.replay_store)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
                    .bind(millis(req.lease))
                    .bind(token)
                    .bind(record)
                    .bind(millis(ttl))
                    .bind(statements.wait_s)
                    .fetch_all(conn)
                    .await
                    .and_then(first_row)
            })
            .await?;
        let stored: i64 = row.try_get(0).map_err(map_error)?;
        let left: i64 = row.try_get(1).map_err(map_error)?;
        Ok(Stored::new(stored != 0, self.released(&req.key, left)))
    }

    pub(super) async fn load_now(&self, key: &LockKey) -> Result<Option<Vec<u8>>> {
        let sql = &self.inner.statements.replay_load;
        let mut attempt = 0;
        loop {
            let loaded = self
                .on_connection(async |conn| {
                    sqlx::query_scalar(sql)
                        .bind(key.as_str())
                        .fetch_optional(conn)
                        .await
                })
                .await;
            match loaded {
                Err(error) if attempt == 0 && error.is_connection_lost() => attempt += 1,
                loaded => return loaded,
            }
        }
    }

    pub(super) async fn renew_all(&self, reqs: &[LockRequest]) -> Result<Vec<bool>> {
        let holds: Vec<(&str, &str, &str, i64)> = reqs
            .iter()
            .map(|r| {
                (
                    r.key.as_str(),
                    r.hold_id.as_str(),
                    mode_char(r.mode),
                    millis(r.lease),
                )
            })
            .collect();
        let json = json_array(holds.iter().map(|(name, owner, mode, ms)| {
            format!(
                "[{},{},{},{ms}]",
                json_string(name),
                json_string(owner),
                json_string(mode)
            )
        }));
        let statements = &self.inner.statements;
        let renewed: Vec<i64> = self
            .on_connection(async |conn| {
                sqlx::query_scalar(&statements.renew)
                    .bind(&json)
                    .bind(statements.wait_s)
                    .fetch_all(conn)
                    .await
            })
            .await?;
        let mut out = vec![false; reqs.len()];
        for i in renewed {
            // `FOR ORDINALITY` counts from 1.
            if let Some(slot) = usize::try_from(i - 1).ok().and_then(|i| out.get_mut(i)) {
                *slot = true;
            }
        }
        Ok(out)
    }

    pub(super) async fn state_of(&self, key: &LockKey, mode: LockMode) -> Result<LockState> {
        let table = &self.inner.table;
        let holds_sql = format!(
            "SELECT owner, mode, holds, \
                    CAST(CEIL((expires_us - TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))) / 1000) AS SIGNED), \
                    token \
               FROM `{table}` \
              WHERE name = ? \
                AND expires_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
              ORDER BY owner"
        );
        let rows = self
            .on_connection(async |conn| {
                sqlx::query(&holds_sql)
                    .bind(key.as_str())
                    .fetch_all(conn)
                    .await
            })
            .await?;
        let fence_sql = format!("SELECT token FROM `{table}_names` WHERE name = ?");
        let fence: Option<i64> = self
            .on_connection(async |conn| {
                sqlx::query_scalar(&fence_sql)
                    .bind(key.as_str())
                    .fetch_optional(conn)
                    .await
            })
            .await?;
        let waiters = self.waiters_for(key, mode).await?;
        let holders = rows
            .iter()
            .map(|row| hold_info_of(row, mode))
            .collect::<Result<Vec<_>>>()?;
        Ok(LockState::new(holders, waiters).with_fencing_token(
            fence
                .filter(|t| *t > 0)
                .map(|t| FencingToken::new(t.unsigned_abs())),
        ))
    }

    /// The waiters of `key` in `mode`: those in the queue table for a queued mode, else
    /// those of this process (the database keeps no other record of them).
    async fn waiters_for(&self, key: &LockKey, mode: LockMode) -> Result<Waiters> {
        if !queued(mode) {
            let here = super::waiters_of(&self.inner.waiters)
                .get(key)
                .map_or(0, |w| w.ones);
            return Ok(Waiters::new(here, WaiterScope::Process));
        }
        let sql = format!(
            "SELECT COUNT(*) FROM `{}_queue` WHERE name = ? \
               AND evict_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
            self.inner.table
        );
        let queued: i64 = self
            .on_connection(async |conn| {
                sqlx::query_scalar(&sql)
                    .bind(key.as_str())
                    .fetch_one(conn)
                    .await
            })
            .await?;
        Ok(Waiters::new(
            usize::try_from(queued).unwrap_or(0),
            WaiterScope::Store,
        ))
    }
}

/// The [`HoldInfo`] a row of the holds table describes: owner, mode, holds, ms left,
/// token; `mode` is the one inspected, whose `max` a permit hold reports.
fn hold_info_of(row: &sqlx::mysql::MySqlRow, mode: LockMode) -> Result<HoldInfo> {
    let owner: Vec<u8> = row.try_get(0).map_err(map_error)?;
    let held: Vec<u8> = row.try_get(1).map_err(map_error)?;
    let holds: i32 = row.try_get(2).map_err(map_error)?;
    let ttl_ms: i64 = row.try_get(3).map_err(map_error)?;
    let token: Option<i64> = row.try_get(4).map_err(map_error)?;
    let owner = String::from_utf8_lossy(&owner);
    let hold_id = HoldId::from_raw(&*owner).map_err(|_| {
        Error::store(
            StoreErrorKind::Unexpected,
            format!("a hold with an invalid owner {owner:?}"),
        )
    })?;
    let held = match held.as_slice() {
        b"f" => LockMode::Fair,
        b"r" => LockMode::Read,
        b"w" => LockMode::Write,
        b"p" => match mode {
            LockMode::Permits { .. } => mode,
            _ => LockMode::Permits {
                max: std::num::NonZeroU32::MAX,
            },
        },
        _ => LockMode::Exclusive,
    };
    let ttl = Duration::from_millis(ttl_ms.max(0).unsigned_abs());
    Ok(
        HoldInfo::new(hold_id, held, u32::try_from(holds).unwrap_or(1), Some(ttl))
            .with_token(token.map(|t| FencingToken::new(t.unsigned_abs()))),
    )
}

/// `items` as a JSON array.
pub(super) fn json_array(items: impl Iterator<Item = String>) -> String {
    let mut out = String::from("[");
    for (i, item) in items.enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(&item);
    }
    out.push(']');
    out
}

/// `s` as a JSON string literal.
pub(super) fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_strings_escape_what_json_needs() {
        assert_eq!(json_string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
        assert_eq!(
            json_array(["1".to_owned(), "2".to_owned()].into_iter()),
            "[1,2]"
        );
        assert_eq!(json_array(std::iter::empty()), "[]");
    }

    #[test]
    fn the_schema_has_every_placeholder_filled() {
        let statements = schema_statements("t");
        assert!(statements.len() > 20, "{}", statements.len());
        for s in &statements {
            for placeholder in ["__T__", "__VERSION__", "__BEGIN__", "__COMMIT__"] {
                assert!(!s.contains(placeholder), "{placeholder} in {s}");
            }
        }
    }

    #[test]
    fn waits_are_whole_seconds_at_least_one() {
        assert_eq!(wait_s(Duration::from_millis(1)), 1);
        assert_eq!(wait_s(Duration::from_secs(2)), 2);
        assert_eq!(wait_s(Duration::from_millis(2001)), 3);
    }
}
