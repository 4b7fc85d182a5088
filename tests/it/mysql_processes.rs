//! Separate processes on one MySQL/MariaDB database, as `postgres_processes.rs` runs
//! them on PostgreSQL (whose helpers and oracle these share): three `hammer` processes
//! contending on one lock keep a counter exact, and a `hammer` SIGKILLed while it holds
//! the lock (in the middle of its read-modify-write) leaves the lock to the others only
//! when its watchdog lease ends, without its unfinished increment.
//!
//! Each test has a database of its own (dropped afterwards) and kills every process it
//! starts. The counter is the row K of `hammer_counter`; every write also appends
//! `(value, pid, at_us)` to `hammer_counter_writes` in the same transaction, so with
//! exclusion the values written are 1 to N, each exactly once, and the database's clock
//! says when the first write after a kill happened.

use crate::common;

use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::mysql::MyDatabase;
use common::wait_until;
use sqlx::MySqlPool;
use tokio::time::Instant;

use crate::postgres_processes::{Hammer, ONE_AT_A_TIME, Writes, kill_cost_nothing, succeeded};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hammer_processes_keep_a_mysql_counter_exact() {
    const ITERS: u64 = 300;
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = MyDatabase::create().await;
    let started = Instant::now();
    let iters = ITERS.to_string();
    let hammers: Vec<Hammer> = (0..3)
        .map(|_| {
            Hammer::spawn(&[
                "--url",
                db.url(),
                "--name",
                "my-hammer",
                "--iters",
                &iters,
                "--counter-key",
                "my:counter",
            ])
        })
        .collect();
    let pids: Vec<u32> = hammers.iter().map(Hammer::id).collect();
    succeeded(hammers, Duration::from_secs(120)).await;
    let took = started.elapsed();

    let pool = db.pool(2).await;
    let counter = counter(&pool, "my:counter").await;
    let writes = writes(&pool, "my:counter").await;
    println!(
        "three hammers, {ITERS} iterations each: counter {counter}, {} writes, {took:.2?}",
        writes.count
    );
    assert_eq!(
        counter,
        3 * ITERS as i64,
        "lost updates: the processes did not exclude each other"
    );
    writes.assert_each_value_once(3 * ITERS);
    for pid in pids {
        assert_eq!(
            writes.by(pid),
            ITERS as i64,
            "process {pid} did not do all its increments"
        );
    }
    assert!(
        hold(&pool, "my-hammer").await.is_none(),
        "the lock was left behind"
    );
    pool.close().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_holder_frees_the_lock_after_its_lease_and_the_count_stays_exact() {
    const ITERS: u64 = 150;
    let lease = Duration::from_millis(1000);
    let _serial = ONE_AT_A_TIME.lock().await;
    let db = MyDatabase::create().await;
    // One connection: every other session on the database is a hammer's.
    let pool = db.pool(1).await;
    let watchdog = lease.as_millis().to_string();

    // The victim takes the lock and sits on it (ten minutes between its read and its
    // write), its watchdog renewing a 1 s lease.
    let mut victim = Hammer::spawn(&[
        "--url",
        db.url(),
        "--name",
        "my-killed",
        "--iters",
        "1",
        "--counter-key",
        "my:killed",
        "--watchdog-ms",
        &watchdog,
        "--hold-us",
        "600000000",
    ]);
    wait_until(
        Duration::from_secs(20),
        "the victim holds the lock",
        || async { hold(&pool, "my-killed").await.is_some() },
    )
    .await;
    let (victim_owner, _) = hold(&pool, "my-killed").await.expect("the victim's hold");
    // MySQL sessions carry no application name: the victim's are those open now.
    let victims_sessions = sessions(&pool).await;

    // Two more processes wait for the lock: each with its lock connection, its counter
    // connection and the listener that polls for releases while it waits.
    let iters = ITERS.to_string();
    let others: Vec<Hammer> = (0..2)
        .map(|_| {
            Hammer::spawn(&[
                "--url",
                db.url(),
                "--name",
                "my-killed",
                "--iters",
                &iters,
                "--counter-key",
                "my:killed",
                "--watchdog-ms",
                &watchdog,
            ])
        })
        .collect();
    let other_pids: Vec<u32> = others.iter().map(Hammer::id).collect();
    wait_until(
        Duration::from_secs(20),
        "the other two have their sessions and listen for releases",
        || async { sessions(&pool).await.len() >= victims_sessions.len() + 6 },
    )
    .await;

    // Kill right after a renewal has been seen, so the whole lease must run out.
    let (_, mut previous) = hold(&pool, "my-killed").await.expect("still held");
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let (_, at) = hold(&pool, "my-killed").await.expect("still held");
        if at > previous {
            break;
        }
        previous = at;
        assert!(
            Instant::now() < deadline,
            "the victim's watchdog never renewed"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    victim.kill();
    let killed_at = db_clock_us(&pool).await;
    // A renewal sent just before the kill still commits: read the end of the lease once
    // the server has closed the victim's sessions.
    wait_until(
        Duration::from_secs(5),
        "the victim's sessions are gone",
        || async {
            let open = sessions(&pool).await;
            !victims_sessions.iter().any(|id| open.contains(id))
        },
    )
    .await;
    let (owner, lease_end) = hold(&pool, "my-killed")
        .await
        .expect("the victim's hold is still there before its lease ends");
    assert_eq!(owner, victim_owner);
    assert_eq!(
        victim.child.wait().expect("reap the victim").signal(),
        Some(libc::SIGKILL)
    );

    succeeded(others, Duration::from_secs(120)).await;
    let lease_left = Duration::from_micros((lease_end - killed_at).max(0).unsigned_abs());
    assert!(
        lease_left <= lease,
        "{lease_left:?} of a {lease:?} lease left"
    );
    let writes = kill_cost_nothing(
        counter(&pool, "my:killed").await,
        writes(&pool, "my:killed").await,
        lease_end,
        (victim.id(), &other_pids),
        ITERS,
    );
    println!(
        "SIGKILL with {lease_left:?} of the lease left; first write {:.1} ms after the kill",
        (writes.first_at_us - killed_at) as f64 / 1000.0
    );
    assert!(
        hold(&pool, "my-killed").await.is_none(),
        "the lock was left behind"
    );
    pool.close().await;
}

/// The counter's value (0 when it was never written).
async fn counter(pool: &MySqlPool, key: &str) -> i64 {
    sqlx::query_scalar::<_, i64>("SELECT value FROM hammer_counter WHERE `key` = ?")
        .bind(key)
        .fetch_optional(pool)
        .await
        .unwrap()
        .unwrap_or(0)
}

/// What `hammer_counter_writes` says about one counter.
async fn writes(pool: &MySqlPool, key: &str) -> Writes {
    let (count, distinct, min, max, first_at_us): (
        i64,
        i64,
        Option<i64>,
        Option<i64>,
        Option<i64>,
    ) = sqlx::query_as(
        "SELECT CAST(COUNT(*) AS SIGNED), CAST(COUNT(DISTINCT value) AS SIGNED), \
                MIN(value), MAX(value), MIN(at_us) \
           FROM hammer_counter_writes WHERE `key` = ?",
    )
    .bind(key)
    .fetch_one(pool)
    .await
    .unwrap();
    let per_pid: Vec<(i32, i64)> = sqlx::query_as(
        "SELECT pid, CAST(COUNT(*) AS SIGNED) FROM hammer_counter_writes \
          WHERE `key` = ? GROUP BY pid",
    )
    .bind(key)
    .fetch_all(pool)
    .await
    .unwrap();
    Writes {
        count,
        distinct,
        min: min.unwrap_or(0),
        max: max.unwrap_or(0),
        first_at_us: first_at_us.expect("at least one write"),
        per_pid,
    }
}

/// The one unexpired hold of `name`: its owner and the end of its lease (the
/// database's clock, in microseconds since the epoch). `None` before the first hammer
/// has created the table.
async fn hold(pool: &MySqlPool, name: &str) -> Option<(Vec<u8>, i64)> {
    let tables: i64 = sqlx::query_scalar(
        "SELECT CAST(COUNT(*) AS SIGNED) FROM information_schema.tables \
          WHERE table_schema = DATABASE() AND table_name = 'tower_lock'",
    )
    .fetch_one(pool)
    .await
    .unwrap();
    if tables == 0 {
        return None;
    }
    // Unexpired on the database's clock: an expired row is no hold (the backend's
    // sweep deletes it later).
    sqlx::query_as(
        "SELECT owner, expires_us FROM tower_lock WHERE name = ? \
            AND expires_us > TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6))",
    )
    .bind(name)
    .fetch_optional(pool)
    .await
    .unwrap()
}

/// The ids of the other sessions on this database.
async fn sessions(pool: &MySqlPool) -> Vec<u64> {
    sqlx::query_scalar(
        "SELECT CAST(id AS SIGNED) FROM information_schema.processlist \
          WHERE db = DATABASE() AND id <> CONNECTION_ID()",
    )
    .fetch_all(pool)
    .await
    .unwrap()
    .into_iter()
    .map(|id: i64| id.unsigned_abs())
    .collect()
}

/// The database's clock, in microseconds since the epoch (as the lock table's leases).
async fn db_clock_us(pool: &MySqlPool) -> i64 {
    sqlx::query_scalar(
        "SELECT CAST(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) \
                AS SIGNED)",
    )
    .fetch_one(pool)
    .await
    .unwrap()
}
