//! The statements the backend sends: the schema, the hot path's statements (formatted
//! once), and the calls that send them within the response timeout.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use sqlx::postgres::PgConnection;

use super::listener::{Slot, waiters_of};
use super::{PostgresBackend, batch, connection_lost, lost_connection, map_error};
use crate::backend::clock::ArrivedLate;
use crate::backend::{
    Acquire, FencingToken, Grant, HoldInfo, LockMode, LockRequest, LockState, Release, Stored,
    WaiterScope, Waiters, queued,
};
use crate::error::{Error, Result, StoreError, StoreErrorKind};
use crate::hold_id::HoldId;
use crate::key::LockKey;

/// The schema and functions, with `__S__` / `__T__` for the schema and table, and the
/// exclusive statements' places (`__LOCK_X__`, `__UNLOCK_X__`, `__LOCK_X_BATCH__`,
/// `__UNLOCK_X_BATCH__`) as function bodies.
const SCHEMA_SQL: &str = include_str!("../../../sql/postgres.sql");

/// An exclusive acquisition: one statement, sent as is (and the body of `_lock_x`).
const LOCK_X_SQL: &str = include_str!("../../../sql/lock_x.sql");

/// An exclusive release: one statement, sent as is (and the body of `_unlock_x`).
const UNLOCK_X_SQL: &str = include_str!("../../../sql/unlock_x.sql");

/// Exclusive acquisitions of several names in one statement (the body of
/// `_lock_x_batch`).
const LOCK_X_BATCH_SQL: &str = include_str!("../../../sql/lock_x_batch.sql");

/// Exclusive releases of several names in one statement (the body of
/// `_unlock_x_batch`).
const UNLOCK_X_BATCH_SQL: &str = include_str!("../../../sql/unlock_x_batch.sql");

/// How the exclusive acquisitions read the epoch gate (their `__GATE__`).
const GATE_SQL: &str = include_str!("../../../sql/gate.sql");

/// How an exclusive grant changes the name's row, and when it may (the acquisitions'
/// `__TAKE__`).
const TAKE_X_SQL: &str = include_str!("../../../sql/take_x.sql");

/// An exclusive acquisition's `sql` with the parts it shares with the other one (the
/// single statement, the batch) filled in.
fn with_parts(sql: &str) -> String {
    sql.replace("__GATE__", GATE_SQL.trim_end())
        .replace("__TAKE__", TAKE_X_SQL.trim_end())
}

/// The schema script for `schema`.`table` (validated identifiers).
pub(super) fn schema_sql(schema: &str, table: &str) -> String {
    for_table(
        &SCHEMA_SQL
            .replace("__LOCK_X_BATCH__", &with_parts(LOCK_X_BATCH_SQL))
            .replace("__UNLOCK_X_BATCH__", UNLOCK_X_BATCH_SQL)
            .replace("__LOCK_X__", &with_parts(LOCK_X_SQL))
            .replace("__UNLOCK_X__", UNLOCK_X_SQL)
            // The functions' callers bound their transactions' waits.
            .replace("__WAIT_MS__", "0"),
        schema,
        table,
    )
}

/// `sql` with `__S__` and `__T__` filled in.
fn for_table(sql: &str, schema: &str, table: &str) -> String {
    sql.replace("__S__", schema).replace("__T__", table)
}

/// The statements every acquisition, release and renewal sends, with the schema and
/// table filled in once at build (not formatted per call).
pub(super) struct Statements {
    acquire: String,
    release: String,
    lock_x: String,
    /// `lock_x` for a waiter's attempt: the lines marked `--W:` in.
    wait_x: String,
    unlock_x: String,
    pub(super) lock_x_batch: String,
    pub(super) unlock_x_batch: String,
    /// Acquisitions of the other modes, several names at once (`_acquire_batch`).
    pub(super) acquire_batch: String,
    /// Releases of the other modes, several names at once (`_release_batch`).
    pub(super) release_batch: String,
    renew: String,
    replay_store: String,
    replay_load: String,
    /// How long a statement waits for a lock in the database, in ms: the response
    /// timeout (`__WAIT_MS__`, see `_within` in `sql/postgres.sql`).
    wait_ms: String,
}

impl Statements {
    /// The statements for the functions of `schema`.`table`, each waiting for a lock
    /// in the database no longer than `wait` (the response timeout).
    pub(super) fn new(schema: &str, table: &str, wait: Duration) -> Self {
        let qualified = &format!("{schema}.{table}");
        let wait_ms = wait_ms(wait);
        let filled = |body: &str| fill(body, qualified, &wait_ms);
        let exclusive = |sql: &str| for_table(sql, schema, table).replace("__WAIT_MS__", &wait_ms);
        Statements {
            acquire: filled(
                "SELECT acquired, holds, token, ttl_ms \
                   FROM __F___acquire(__F___within($1::text, __WAIT_MS__), \
                                      $2, $3, $4, $5, $6, $7, $8, $9)",
            ),
            release: filled(
                "SELECT __F___release(__F___within($1::text, __WAIT_MS__), $2, $3, $4, $5)",
            ),
            lock_x: exclusive(&with_parts(LOCK_X_SQL)),
            wait_x: exclusive(&with_parts(LOCK_X_SQL).replace("--W:", "")),
            unlock_x: exclusive(UNLOCK_X_SQL),
            lock_x_batch: exclusive(&with_parts(LOCK_X_BATCH_SQL)),
            unlock_x_batch: exclusive(UNLOCK_X_BATCH_SQL),
            acquire_batch: filled(
                "SELECT i, acquired, holds, token, ttl_ms \
                   FROM __F___acquire_batch(__F___within($1::text[], __WAIT_MS__), \
                                            $2, $3, $4, $5, $6, $7, $8, $9)",
            ),
            release_batch: filled(
                "SELECT i, holds_left \
                   FROM __F___release_batch(__F___within($1::text[], __WAIT_MS__), $2, $3, $4, $5)",
            ),
            renew: filled(
                "SELECT * FROM __F___renew(__F___within($1::text[], __WAIT_MS__), $2, $3, $4)",
            ),
            replay_store: filled(
                "SELECT stored, released \
                   FROM __F___replay_store(__F___within($1::text, __WAIT_MS__), \
                                           $2, $3, $4, $5, $6, $7, $8)",
            ),
            replay_load: filled(
                "SELECT record FROM __F___replay WHERE name = $1 AND expires_at > clock_timestamp()",
            ),
            wait_ms,
        }
    }
}

impl PostgresBackend {
    /// `body` with the functions' prefix (`__F__`) and the wait for a lock
    /// (`__WAIT_MS__`) filled in.
    pub(super) fn sql(&self, body: &str) -> String {
        fill(body, &self.inner.qualified, &self.inner.statements.wait_ms)
    }

    /// Runs `run` on one of the backend's connections (a kept one, or one of the
    /// pool's) within the response timeout: see [`Kept::run`](super::conns::Kept::run)
    /// for what becomes of the connection, closed if the timeout ends the statement.
    /// A connection found dead (no answer, or its end) has every idle one checked
    /// ([`Kept::check_idle`](super::conns::Kept::check_idle)).
    pub(super) async fn on_connection<T>(
        &self,
        run: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T> {
        let inner = &*self.inner;
        let sent = AtomicBool::new(false);
        let run = inner.kept.run(&inner.pool, &sent, run);
        let ran = tokio::time::timeout(inner.response_timeout, run).await;
        let sent = sent.load(Ordering::Relaxed);
        match ran {
            Ok(Ok(out)) => Ok(out),
            Ok(Err(error)) if !sent => {
                // No connection to be had: the statement never left.
                inner.kept.check_idle(&inner.pool);
                Err(StoreError::not_applied(error).and_unanswered().into())
            }
            Ok(Err(error)) => {
                if connection_lost(&error) {
                    // The next connections may reach another server (a failover).
                    inner.clock.forget();
                    inner.kept.check_idle(&inner.pool);
                    return Err(lost_connection(error));
                }
                Err(map_error(error))
            }
            Err(_) => {
                inner.clock.forget();
                inner.kept.check_idle(&inner.pool);
                let message = format!(
                    "PostgreSQL did not answer within {:?}",
                    inner.response_timeout
                );
                let timed_out = std::io::Error::new(std::io::ErrorKind::TimedOut, message);
                let error = match sent {
                    true => StoreError::new(StoreErrorKind::Unavailable, timed_out),
                    false => StoreError::not_applied(timed_out),
                };
                Err(error.and_unanswered().into())
            }
        }
    }

    /// Whether a statement that may run twice (a read, `SELECT 1`) and failed with
    /// `error` on its `attempt`-th try (from 0) goes once more: at once, when its
    /// connection was found dead (a server restarted while the connection sat in the
    /// pool), so that a single call (a readiness probe, a stored response read) costs
    /// the restart no error, as a lock call does not.
    pub(super) fn read_again(attempt: u32, error: &Error) -> bool {
        let again = attempt == 0 && error.is_connection_lost();
        if again {
            tracing::debug!(%error, "a PostgreSQL connection was dead; the statement goes again");
        }
        again
    }

    /// The deadline, on the database's clock in microseconds, of an attempt sent now:
    /// its response times out when the database's clock has passed it (see
    /// [`clock`](crate::backend::clock)). Samples the database's clock first when the
    /// last sample is too old.
    pub(super) async fn attempt_deadline(&self) -> Result<i64> {
        let window = self.inner.response_timeout;
        if let Some(deadline) = self.inner.clock.deadline(&(), window, 0) {
            return Ok(i64::try_from(deadline).unwrap_or(i64::MAX));
        }
        let now_us: i64 = self
            .on_connection(async |conn| {
                sqlx::query_scalar(
                    "SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint",
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
        // An exclusive waiter's attempt: the lock a release handed it is taken without
        // a statement; else the attempt registers it (with the process's liveness key).
        let slot = if self.inner.hand_over && req.mode == LockMode::Exclusive {
            self.slot_of(req)
        } else {
            None
        };
        if let Some(slot) = &slot
            && let Some(grant) = slot.take()
        {
            return Ok(Acquire::Acquired(grant));
        }
        let mut again = AGAIN_NOW;
        loop {
            let deadline = self.attempt_deadline().await?;
            let answer = match &slot {
                // Alone, or with others that arrive together (group commit).
                None => batch::acquire(self, req, deadline).await?,
                Some(slot) => self.attempt(req, deadline, Some(slot)).await?,
            };
            // Busy with nothing blocking from now on: something changed under the
            // attempt (the name's `gen` moved past its snapshot: an owner was given up
            // for good meanwhile, maybe another; or the row appeared after it). Its
            // answer is "try again now", which a new snapshot settles.
            match answer {
                Acquire::Busy { ttl: Some(ttl) } if ttl.is_zero() && again > 0 => again -= 1,
                answer => return Ok(answer),
            }
        }
    }

    /// One attempt of `req` with its `deadline`, as one statement: an exclusive one
    /// straight to its statement (`_acquire` would only pass it on), a waiter's (with
    /// its `slot`) registering it; every other mode through `_acquire`.
    pub(super) async fn attempt(
        &self,
        req: &LockRequest,
        deadline: i64,
        slot: Option<&Arc<Slot>>,
    ) -> Result<Acquire> {
        let max = permits_max(req.mode);
        let query = if req.mode == LockMode::Exclusive {
            let query = sqlx::query_as(match slot {
                Some(_) => &self.inner.statements.wait_x,
                None => &self.inner.statements.lock_x,
            })
            .bind(req.key.as_str())
            .bind(req.hold_id.as_str())
            .bind(millis(req.lease))
            .bind(req.fenced)
            .bind(deadline)
            .bind(self.inner.fast_grants.is_some_and(|max| req.lease <= max));
            match slot {
                Some(slot) => query
                    .bind(self.inner.live.key())
                    .bind(self.gives_up_us(slot)),
                None => query,
            }
        } else {
            sqlx::query_as(&self.inner.statements.acquire)
                .bind(req.key.as_str())
                .bind(req.hold_id.as_str())
                .bind(mode_char(req.mode))
                .bind(max)
                .bind(millis(req.lease))
                .bind(req.fenced)
                .bind(req.writer.as_ref().map(HoldId::as_str))
                .bind(millis(self.inner.waiter_timeout))
                .bind(deadline)
        };
        let sent = std::time::Instant::now();
        let row: AttemptRow = self
            .on_connection(async |conn| query.fetch_one(conn).await)
            .await?;
        let (acquired, holds, _, _) = row;
        if let Some(slot) = slot
            && row.3 != Some(-2)
        {
            if acquired || slot.gives_up().is_some_and(|at| sent >= at) {
                // Took the lock; or answered busy after the waiter's time was up, so
                // the database hands it nothing from now on (`gives_up_us`), and had
                // handed it nothing before, or this attempt would have taken it: the
                // waiter need not be taken out of the database when it leaves.
                slot.took();
            } else if holds == 1 {
                // Registered by this attempt (`sql/lock_x.sql`).
                slot.asked(sent);
            }
        }
        Self::acquire_answer(row)
    }

    /// What an attempt answered (acquired, holds, token, ttl_ms) as its outcome; a
    /// refusal past its deadline (ttl_ms -2) as an outage.
    pub(super) fn acquire_answer((acquired, holds, token, ttl_ms): AttemptRow) -> Result<Acquire> {
        if ttl_ms == Some(-2) {
            return Err(ArrivedLate::error("PostgreSQL", None));
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

    /// When the waiter of `slot` stops waiting, on the database's clock in microseconds
    /// (0: never): a lower bound of the clock there when it stops here (see
    /// [`clock`](crate::backend::clock)), so that the database stops handing it the
    /// lock no later than it stops waiting. Called after `attempt_deadline`, which
    /// keeps the sample fresh.
    fn gives_up_us(&self, slot: &Slot) -> i64 {
        slot.gives_up()
            .and_then(|at| {
                let left = at.saturating_duration_since(std::time::Instant::now());
                self.inner.clock.deadline(&(), left, 0)
            })
            .map_or(0, |us| i64::try_from(us).unwrap_or(i64::MAX).max(1))
    }

    /// The slot of `req`'s hold, when it waits for `req.key` exclusively here.
    fn slot_of(&self, req: &LockRequest) -> Option<Arc<Slot>> {
        let waiters = waiters_of(&self.inner.waiters);
        let w = waiters.get(&req.key)?;
        w.slots.iter().find(|s| s.hold == req.hold_id).cloned()
    }

    /// Takes the exclusive waiter `hold` out of the database in a task of its own (it
    /// left: a subscription dropped), passing on a lock a release handed it meanwhile.
    /// Without a runtime, or when the statement fails, the registration lapses by
    /// itself soon after what blocked it would have ended.
    pub(super) fn unwait_later(&self, key: LockKey, hold: HoldId) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let backend = self.clone();
        runtime.spawn(async move {
            let sql =
                backend.sql("SELECT __F___unwait(__F___within($1::text, __WAIT_MS__), $2, $3)");
            let left = backend
                .on_connection(async |conn| {
                    sqlx::query(&sql)
                        .bind(key.as_str())
                        .bind(hold.as_str())
                        .bind(&backend.inner.origin)
                        .execute(conn)
                        .await
                })
                .await;
            if let Err(error) = left {
                // The hold, not the key: the backend does not know whether its client
                // redacts keys, and a hold id names no user.
                tracing::debug!(%error, hold_id = %hold, "PostgreSQL waiter not unregistered");
            }
        });
    }

    pub(super) async fn release_now(&self, req: &LockRequest) -> Result<Release> {
        // Alone, or with others that arrive together (group commit).
        batch::release(self, req).await
    }

    /// One release of `req`, as one statement.
    pub(super) async fn release_alone(&self, req: &LockRequest) -> Result<Release> {
        let query = if req.mode == LockMode::Exclusive {
            sqlx::query_scalar(&self.inner.statements.unlock_x)
                .bind(req.key.as_str())
                .bind(req.hold_id.as_str())
                .bind(millis(req.lease))
                .bind(&self.inner.origin)
        } else {
            sqlx::query_scalar(&self.inner.statements.release)
                .bind(req.key.as_str())
                .bind(req.hold_id.as_str())
                .bind(mode_char(req.mode))
                .bind(millis(req.lease))
                .bind(&self.inner.origin)
        };
        let left: i32 = self
            .on_connection(async |conn| query.fetch_one(conn).await)
            .await?;
        Ok(self.released(&req.key, left))
    }

    /// What `_release` answered (`left`: -1, 0, holds left; -2 from an exclusive
    /// release, which handed the lock to a waiter) for `key`, as the outcome; a release
    /// that freed the lock wakes this process's waiters now. One that handed it over
    /// leaves that to the notification, which reaches the waiter the lock was handed
    /// to first (`listener::hand`): woken now, a waiter here would try before it, and
    /// the waiter itself would take its lock with a statement instead of without.
    pub(super) fn released(&self, key: &LockKey, left: i32) -> Release {
        match left {
            -1 => Release::NotHeld,
            -2 => Release::Released,
            0 => {
                // This process's waiters hear it now, not a NOTIFY round trip later: a
                // releaser that asks again at once must find them ahead of it (no
                // barging). The NOTIFY names this backend, whose listener skips it.
                if let Some(w) = waiters_of(&self.inner.waiters).get(key) {
                    w.one.notify_one();
                    w.all.notify_all();
                }
                Release::Released
            }
            n => Release::Decremented {
                holds: u32::try_from(n).unwrap_or(u32::MAX),
            },
        }
    }

    /// [`ReplayStore::store_and_release`](crate::backend::ReplayStore::store_and_release):
    /// one call of `_replay_store`, which releases with `_release`.
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
                format!("the fencing token {token} is beyond PostgreSQL's bigint"),
            )
        })?;
        let (stored, left): (bool, i32) = self
            .on_connection(async |conn| {
                sqlx::query_as(&self.inner.statements.replay_store)
                    .bind(req.key.as_str())
                    .bind(req.hold_id.as_str())
                    .bind(mode_char(req.mode))
                    .bind(millis(req.lease))
                    .bind(&self.inner.origin)
                    .bind(token)
                    .bind(record)
                    .bind(millis(ttl))
                    .fetch_one(conn)
                    .await
            })
            .await?;
        Ok(Stored::new(stored, self.released(&req.key, left)))
    }

    /// [`ReplayStore::load`](crate::backend::ReplayStore::load): the unexpired record.
    pub(super) async fn load_now(&self, key: &LockKey) -> Result<Option<Vec<u8>>> {
        let mut attempt = 0;
        loop {
            let loaded = self
                .on_connection(async |conn| {
                    sqlx::query_scalar(&self.inner.statements.replay_load)
                        .bind(key.as_str())
                        .fetch_optional(conn)
                        .await
                })
                .await;
            match loaded {
                Err(error) if Self::read_again(attempt, &error) => attempt += 1,
                loaded => return loaded,
            }
        }
    }

    pub(super) async fn renew_all(&self, reqs: &[LockRequest]) -> Result<Vec<bool>> {
        let names: Vec<&str> = reqs.iter().map(|r| r.key.as_str()).collect();
        let owners: Vec<&str> = reqs.iter().map(|r| r.hold_id.as_str()).collect();
        let modes: Vec<i8> = reqs.iter().map(|r| mode_char(r.mode)).collect();
        let leases: Vec<i64> = reqs.iter().map(|r| millis(r.lease)).collect();
        let renewed: Vec<i32> = self
            .on_connection(async |conn| {
                sqlx::query_scalar(&self.inner.statements.renew)
                    .bind(names)
                    .bind(owners)
                    .bind(modes)
                    .bind(leases)
                    .fetch_all(conn)
                    .await
            })
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

    pub(super) async fn state_of(&self, key: &LockKey, mode: LockMode) -> Result<LockState> {
        // The exclusive hold lives in the name's row, the others in the holds table.
        let holds_sql = self.sql(
            "SELECT owner, 'x'::\"char\", holds, \
                    ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint, \
                    CASE WHEN fenced THEN token END \
               FROM __F___names \
              WHERE name = $1 AND owner IS NOT NULL AND expires_at > clock_timestamp() \
             UNION ALL \
             SELECT owner, mode, holds, \
                    ceil(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint, token \
               FROM __F__ WHERE name = $1 AND expires_at > clock_timestamp() \
             ORDER BY 1",
        );
        let rows: Vec<HoldRow> = self
            .on_connection(async |conn| {
                sqlx::query_as(&holds_sql)
                    .bind(key.as_str())
                    .fetch_all(conn)
                    .await
            })
            .await?;
        let fence_sql = self.sql("SELECT token FROM __F___names WHERE name = $1");
        let fence: Option<i64> = self
            .on_connection(async |conn| {
                sqlx::query_scalar(&fence_sql)
                    .bind(key.as_str())
                    .fetch_optional(conn)
                    .await
            })
            .await?
            .flatten();
        let waiters = self.waiters_for(key, mode).await?;
        let holders = rows
            .into_iter()
            .map(|row| hold_info_of(row, mode))
            .collect::<Result<Vec<_>>>()?;
        Ok(LockState::new(holders, waiters)
            .with_fencing_token(fence.map(|t| FencingToken::new(t.unsigned_abs()))))
    }

    /// The waiters of `key` in `mode`: those in the queue table for a queued mode, else
    /// those of this process (the database keeps no other record of them).
    async fn waiters_for(&self, key: &LockKey, mode: LockMode) -> Result<Waiters> {
        if !queued(mode) {
            let here = waiters_of(&self.inner.waiters)
                .get(key)
                .map_or(0, |w| w.ones);
            return Ok(Waiters::new(here, WaiterScope::Process));
        }
        let queue_sql = self.sql(
            "SELECT count(*) FROM __F___queue WHERE name = $1 AND evict_at > clock_timestamp()",
        );
        let queued: i64 = self
            .on_connection(async |conn| {
                sqlx::query_scalar(&queue_sql)
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

/// How many times an acquisition is sent again at once when its attempt answered busy
/// with nothing blocking (see `acquire_now`), before that answer is passed on.
const AGAIN_NOW: u32 = 2;

/// What an attempt answers: acquired, holds, token, ttl_ms (see `sql/lock_x.sql`).
pub(super) type AttemptRow = (bool, i32, Option<i64>, Option<i64>);

/// A row of the holds table as [`state_of`](PostgresBackend::state_of) reads it: owner,
/// mode, holds, milliseconds left, token.
type HoldRow = (String, i8, i32, i64, Option<i64>);

/// The [`HoldInfo`] a row of the holds table describes (its `owner` column is the
/// hold's identity); `mode` is the one inspected, whose
/// `max` a permit hold reports.
fn hold_info_of((owner, held, holds, ttl_ms, token): HoldRow, mode: LockMode) -> Result<HoldInfo> {
    let hold_id = HoldId::from_raw(&owner).map_err(|_| {
        Error::store(
            StoreErrorKind::Unexpected,
            format!("a hold with an invalid owner {owner:?}"),
        )
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
    Ok(
        HoldInfo::new(hold_id, held, u32::try_from(holds).unwrap_or(1), Some(ttl))
            .with_token(token.map(|t| FencingToken::new(t.unsigned_abs()))),
    )
}

/// `body` with `__F__` replaced by the qualified table.
fn fill(body: &str, qualified: &str, wait_ms: &str) -> String {
    body.replace("__F__", qualified)
        .replace("__WAIT_MS__", wait_ms)
}

/// `wait` in whole milliseconds, as `lock_timeout` takes it: at least 1 (0 would
/// turn the bound off), at most what the setting holds.
fn wait_ms(wait: Duration) -> String {
    let ms = wait.as_nanos().div_ceil(1_000_000);
    ms.clamp(1, i32::MAX as u128).to_string()
}

/// A mode as the functions take it: one byte (PostgreSQL's `"char"`).
pub(super) fn mode_char(mode: LockMode) -> i8 {
    let c = match mode {
        LockMode::Exclusive => b'x',
        LockMode::Fair => b'f',
        LockMode::Read => b'r',
        LockMode::Write => b'w',
        LockMode::Permits { .. } => b'p',
    };
    c as i8
}

/// The permits of a permit mode as the functions take them (0 for the other modes).
pub(super) fn permits_max(mode: LockMode) -> i32 {
    match mode {
        LockMode::Permits { max } => i32::try_from(max.get()).unwrap_or(i32::MAX),
        _ => 0,
    }
}

pub(super) fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let sql = schema_sql("s", "t");
        assert!(!sql.contains("__"), "a placeholder is left");
        assert!(sql.contains("s.t_names"));
        assert!(sql.contains("s.t_acquire("));
        assert!(sql.contains("s.t_replay_store("));
    }

    #[test]
    fn every_statement_has_every_placeholder_filled_and_bounds_its_waits() {
        let statements = Statements::new("s", "t", Duration::from_millis(1500));
        for sql in [
            &statements.acquire,
            &statements.release,
            &statements.lock_x,
            &statements.wait_x,
            &statements.unlock_x,
            &statements.lock_x_batch,
            &statements.unlock_x_batch,
            &statements.acquire_batch,
            &statements.release_batch,
            &statements.renew,
            &statements.replay_store,
        ] {
            assert!(!sql.contains("__"), "a placeholder is left:\n{sql}");
            assert!(sql.contains("s.t_within("), "no bound on its waits:\n{sql}");
            assert!(sql.contains(", 1500)") || sql.contains("(1500)"), "{sql}");
        }
    }

    #[test]
    fn waits_are_whole_milliseconds_within_what_lock_timeout_takes() {
        assert_eq!(wait_ms(Duration::from_nanos(1)), "1");
        assert_eq!(wait_ms(Duration::from_micros(1500)), "2");
        assert_eq!(wait_ms(Duration::from_secs(2)), "2000");
        assert_eq!(wait_ms(Duration::MAX), i32::MAX.to_string());
    }
}
