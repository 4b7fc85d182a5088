//! The backend's sweep of rows nobody needs any more: expired holds, queue places,
//! waiter registrations, given-up owners, client names and records, and the rows of
//! names that have been free for a token retention.
//!
//! Every such row counts as absent wherever it is read, so deleting it changes nothing
//! but the table's size; and without a sweep, every distinct name ever locked (one per
//! user, per `Idempotency-Key`) keeps a row for good. So each backend sweeps on a
//! schedule of its own, whatever its clients are (named or not), in bounded steps: at
//! most [`SWEEP_BATCH`] rows of each table per statement, and at once again while a
//! statement found that many.
//!
//! A name's row goes once it has been free for the token retention and its last
//! fencing token is a retention behind the database's clock: a token taken after that
//! (from the clock, as for a name never seen) is still greater, unless the clock steps
//! back by more than the retention.

use std::sync::Weak;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use super::{Inner, PostgresBackend};
use crate::error::Result;

/// The most rows of one table one sweep statement deletes: enough that a backlog
/// drains in a few statements, few enough that a statement is short.
pub(super) const SWEEP_BATCH: i64 = 1000;

/// The longest pause between two sweeps.
const SWEEP_EVERY_MAX: Duration = Duration::from_secs(60);

/// The shortest pause between two sweeps, also the pause while a backlog drains.
const SWEEP_EVERY_MIN: Duration = Duration::from_secs(1);

/// How often a backend with this token retention sweeps: every retention, between
/// [`SWEEP_EVERY_MIN`] and [`SWEEP_EVERY_MAX`].
pub(super) fn period(retention: Duration) -> Duration {
    retention.clamp(SWEEP_EVERY_MIN, SWEEP_EVERY_MAX)
}

/// Sweeps every `period` until `stop` (the backend's end), or the backend is gone.
pub(super) async fn sweep_until(inner: Weak<Inner>, period: Duration, stop: CancellationToken) {
    let mut pause = period;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(pause) => {}
        }
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let backend = PostgresBackend { inner };
        pause = match backend.sweep().await {
            // A full batch somewhere: more to sweep, soon.
            Ok(most) if most >= SWEEP_BATCH => SWEEP_EVERY_MIN,
            Ok(_) => period,
            Err(error) => {
                tracing::debug!(%error, "sweeping expired lock rows failed; trying again later");
                period
            }
        };
    }
}

impl PostgresBackend {
    /// One bounded sweep: at most [`SWEEP_BATCH`] rows of each table. Returns the most
    /// rows one table had deleted.
    ///
    /// It skips every row another transaction holds (`FOR UPDATE SKIP LOCKED`), so it
    /// never waits for one: an acquisition deletes its names' expired holds one name
    /// after another, and a sweep that waited for the rows it met could hold a row the
    /// acquisition waits for while waiting for one the acquisition holds, a deadlock
    /// PostgreSQL ended by failing one of them. A row skipped is the next sweep's.
    pub(super) async fn sweep(&self) -> Result<i64> {
        let sql = self.sql(
            "WITH names AS ( \
                 DELETE FROM __F___names WHERE ctid IN ( \
                     SELECT ctid FROM __F___names \
                      WHERE expires_at < clock_timestamp() - $1 * interval '1 millisecond' \
                        AND others_until < clock_timestamp() - $1 * interval '1 millisecond' \
                        AND coalesce(token, 0) < __F___now_us() - $1 * 1000 \
                      LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   AND __F___within(__WAIT_MS__) RETURNING 1 \
             ), holds AS ( \
                 DELETE FROM __F__ WHERE ctid IN ( \
                     SELECT ctid FROM __F__ WHERE expires_at <= clock_timestamp() LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   AND __F___within(__WAIT_MS__) RETURNING 1 \
             ), queue AS ( \
                 DELETE FROM __F___queue WHERE ctid IN ( \
                     SELECT ctid FROM __F___queue WHERE evict_at <= clock_timestamp() LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   AND __F___within(__WAIT_MS__) RETURNING 1 \
             ), clients AS ( \
                 DELETE FROM __F___clients WHERE ctid IN ( \
                     SELECT ctid FROM __F___clients WHERE expires_at <= clock_timestamp() LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   AND __F___within(__WAIT_MS__) RETURNING 1 \
             ), gone AS ( \
                 DELETE FROM __F___gone WHERE ctid IN ( \
                     SELECT ctid FROM __F___gone WHERE until <= clock_timestamp() LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   AND __F___within(__WAIT_MS__) RETURNING 1 \
             ), waiters AS ( \
                 DELETE FROM __F___waiters WHERE ctid IN ( \
                     SELECT ctid FROM __F___waiters WHERE until <= clock_timestamp() LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   AND __F___within(__WAIT_MS__) RETURNING 1 \
             ), replay AS ( \
                 DELETE FROM __F___replay WHERE ctid IN ( \
                     SELECT ctid FROM __F___replay WHERE expires_at <= clock_timestamp() LIMIT $2 FOR UPDATE SKIP LOCKED) \
                   AND __F___within(__WAIT_MS__) RETURNING 1 \
             ) \
             SELECT greatest((SELECT count(*) FROM names), (SELECT count(*) FROM holds), \
                             (SELECT count(*) FROM queue), (SELECT count(*) FROM clients), \
                             (SELECT count(*) FROM gone), (SELECT count(*) FROM waiters), \
                             (SELECT count(*) FROM replay))",
        );
        let retention = super::millis(self.inner.token_retention);
        self.on_connection(async |conn| {
            sqlx::query_scalar(&sql)
                .bind(retention)
                .bind(SWEEP_BATCH)
                .fetch_one(conn)
                .await
        })
        .await
    }
}
