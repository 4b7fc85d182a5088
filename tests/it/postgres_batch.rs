//! Group commit on PostgreSQL: exclusive acquisitions (and releases) that arrive while
//! one of their kind is on its way go together, in one statement and one transaction.
//! Each name in a batch must be answered as its own statement would answer it, the
//! transaction must commit as durably as its grants need, and no caller — stuck,
//! cancelled or parked — may hold up the others or leave a hold behind.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use common::postgres::{PgDatabase, take};
use sqlx::postgres::PgListener;
use sqlx::{PgPool, Postgres, Transaction};
use tower_lock::backend::{Acquire, LockBackend, LockMode, LockRequest, Release};
use tower_lock::{HoldId, LockClient, LockKey, PostgresBackend};

/// A request of `owner` for `key` in `mode`, with a 30 s lease.
fn moded(key: &str, owner: &str, mode: LockMode) -> LockRequest {
    LockRequest::new(
        LockKey::new(key).unwrap(),
        HoldId::from_raw(owner).unwrap(),
        mode,
        Duration::from_secs(30),
    )
}

/// An exclusive request of `owner` for `key`.
fn req(key: &str, owner: &str) -> LockRequest {
    moded(key, owner, LockMode::Exclusive)
}

async fn on(db: &PgDatabase) -> PostgresBackend {
    PostgresBackend::builder(db.pool(6).await)
        .build()
        .await
        .unwrap()
}

/// A transaction that holds the lock of `name`'s row (made if missing), as an
/// operation on the name would while it runs.
async fn lock_row(pool: &PgPool, name: &str) -> Transaction<'static, Postgres> {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT tower_lock_lock_name($1)")
        .bind(name)
        .execute(&mut *tx)
        .await
        .unwrap();
    tx
}

/// Whether a session of this database waits for a lock (a row's, here).
async fn someone_waits(pool: &PgPool) -> bool {
    common::postgres::waiting_for_a_lock(pool).await > 0
}

/// What an attempt answered, in classes that do not depend on timing: acquired, holds,
/// whether a token came and whether it is above `above`, and the ttl's class
/// ("none", "-2", "-1", "0", "wait").
type Answer = (bool, i32, Option<bool>, &'static str);

/// A row of `_lock_x_batch`: i, acquired, holds, token, ttl_ms.
type BatchRow = (i64, bool, i32, Option<i64>, Option<i64>);

fn classify(row: (bool, i32, Option<i64>, Option<i64>), above: i64) -> Answer {
    let (acquired, holds, token, ttl_ms) = row;
    let ttl = match ttl_ms {
        None => "none",
        Some(-2) => "-2",
        Some(-1) => "-1",
        Some(0) => "0",
        Some(ms) if ms > 0 => "wait",
        Some(_) => "other",
    };
    (acquired, holds, token.map(|t| t > above), ttl)
}

/// One attempt of the table below: the name's suffix, the owner, fenced, the deadline.
const ATTEMPTS: [(&str, &str, bool, i64); 8] = [
    ("never-seen", "a:1", false, 0),
    ("free-row", "a:2", false, 0),
    ("held", "a:3", false, 0),
    ("mine", "me:1", false, 0),
    ("expired", "a:4", false, 0),
    ("given-up", "me:2", false, 0),
    ("late", "a:5", false, 1),
    ("fenced", "a:6", true, 0),
];

/// What each attempt of [`ATTEMPTS`] must answer.
const EXPECTED: [Answer; 8] = [
    (true, 1, None, "none"),
    (true, 1, None, "none"),
    (false, 0, None, "wait"),
    (true, 2, None, "none"),
    (true, 1, None, "none"),
    (false, 0, None, "-1"),
    (false, 0, None, "-2"),
    (true, 1, Some(true), "none"),
];

/// Puts the names of [`ATTEMPTS`] under `prefix` in the states the attempts meet, and
/// answers the last token of the fenced one.
async fn prepare(backend: &PostgresBackend, pool: &PgPool, prefix: &str) -> i64 {
    let name = |suffix: &str| format!("{prefix}{suffix}");
    let free = req(&name("free-row"), "before:1");
    take(backend, &free).await;
    assert_eq!(backend.release(&free).await.unwrap(), Release::Released);
    take(backend, &req(&name("held"), "other:1")).await;
    take(backend, &req(&name("mine"), "me:1")).await;
    let mut short = req(&name("expired"), "other:2");
    short.lease = Duration::from_millis(1);
    take(backend, &short).await;
    backend
        .abandon(&req(&name("given-up"), "me:2"))
        .await
        .unwrap();
    let fenced = req(&name("fenced"), "before:2").fenced();
    take(backend, &fenced).await;
    assert_eq!(backend.release(&fenced).await.unwrap(), Release::Released);
    common::wait_until(
        Duration::from_secs(5),
        "the short lease ends on the database's clock",
        || async {
            sqlx::query_scalar::<_, bool>(
                "SELECT expires_at <= clock_timestamp() FROM tower_lock_names WHERE name = $1",
            )
            .bind(name("expired"))
            .fetch_one(pool)
            .await
            .unwrap()
        },
    )
    .await;
    sqlx::query_scalar("SELECT token FROM tower_lock_names WHERE name = $1")
        .bind(name("fenced"))
        .fetch_one(pool)
        .await
        .unwrap()
}

/// The rows the attempts left: owner and holds of each name under `prefix`, by suffix.
async fn rows(pool: &PgPool, prefix: &str) -> HashMap<String, (Option<String>, i32)> {
    let rows: Vec<(String, Option<String>, i32)> = sqlx::query_as(
        "SELECT name, CASE WHEN expires_at > clock_timestamp() THEN owner END, \
                CASE WHEN expires_at > clock_timestamp() THEN holds ELSE 0 END \
           FROM tower_lock_names WHERE name LIKE $1 || '%'",
    )
    .bind(prefix)
    .fetch_all(pool)
    .await
    .unwrap();
    rows.into_iter()
        .map(|(name, owner, holds)| (name[prefix.len()..].to_owned(), (owner, holds)))
        .collect()
}

/// Every case an exclusive attempt meets, once one statement per name and once all in
/// one batch: each name is answered alike, and left alike.
#[tokio::test]
async fn a_batch_answers_each_name_as_its_own_statement_would() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(2).await;
    let alone_token = prepare(&backend, &pool, "alone-").await;
    let batch_token = prepare(&backend, &pool, "batch-").await;

    let mut alone = Vec::new();
    for (suffix, owner, fenced, deadline) in ATTEMPTS {
        let row: (bool, i32, Option<i64>, Option<i64>) = sqlx::query_as(
            "SELECT acquired, holds, token, ttl_ms \
               FROM tower_lock_lock_x($1, $2, 30000, $3, $4, false)",
        )
        .bind(format!("alone-{suffix}"))
        .bind(owner)
        .bind(fenced)
        .bind(deadline)
        .fetch_one(&pool)
        .await
        .unwrap();
        alone.push(classify(row, alone_token));
    }
    assert_eq!(alone, EXPECTED);

    let names: Vec<String> = ATTEMPTS.iter().map(|a| format!("batch-{}", a.0)).collect();
    let owners: Vec<&str> = ATTEMPTS.iter().map(|a| a.1).collect();
    let fenced: Vec<bool> = ATTEMPTS.iter().map(|a| a.2).collect();
    let deadlines: Vec<i64> = ATTEMPTS.iter().map(|a| a.3).collect();
    let answered: Vec<BatchRow> = sqlx::query_as(
        "SELECT i, acquired, holds, token, ttl_ms \
           FROM tower_lock_lock_x_batch($1, $2, array_fill(30000::bigint, ARRAY[8]), $3, $4, \
                                        array_fill(false, ARRAY[8]))",
    )
    .bind(&names)
    .bind(&owners)
    .bind(&fenced)
    .bind(&deadlines)
    .fetch_all(&pool)
    .await
    .unwrap();
    let places: Vec<i64> = answered.iter().map(|row| row.0).collect();
    assert_eq!(places, (1..=8).collect::<Vec<i64>>());
    let batched: Vec<Answer> = answered
        .into_iter()
        .map(|(_, a, h, t, ttl)| classify((a, h, t, ttl), batch_token))
        .collect();
    assert_eq!(batched, EXPECTED);
    assert_eq!(rows(&pool, "batch-").await, rows(&pool, "alone-").await);
}

/// A batched attempt whose owner was given up for good while it waited for the name's
/// row (after its snapshot) takes nothing, as a single statement would
/// (`an_attempt_overtaken_by_its_owners_abandonment_takes_nothing`); the other name of
/// its batch is taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_attempt_overtaken_by_its_owners_abandonment_takes_nothing() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(3).await;
    let late = req("late", "a:1");
    take(&backend, &late).await;
    assert_eq!(backend.release(&late).await.unwrap(), Release::Released);
    let mut blocker = lock_row(&pool, "late").await;
    let batch = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (i64, bool)>(
                "SELECT i, acquired FROM tower_lock_lock_x_batch(\
                     ARRAY['late', 'other'], ARRAY['a:1', 'b:1'], ARRAY[30000, 30000]::bigint[], \
                     ARRAY[false, false], ARRAY[0, 0]::bigint[], ARRAY[false, false])",
            )
            .fetch_all(&pool)
            .await
        }
    });
    common::wait_until(
        Duration::from_secs(5),
        "the batch waits for the row",
        || someone_waits(&pool),
    )
    .await;
    sqlx::query("SELECT tower_lock_abandon('late', 'a:1', 'x', 60000)")
        .execute(&mut *blocker)
        .await
        .unwrap();
    blocker.commit().await.unwrap();
    let answered = batch.await.unwrap().unwrap();
    assert_eq!(answered, [(1, false), (2, true)]);
    let rows = rows(&pool, "").await;
    assert_eq!(rows["late"], (None, 0));
    assert_eq!(rows["other"], (Some("b:1".to_owned()), 1));
}

/// Every case of an exclusive release, once one statement per name and once all in one
/// batch: answered alike, left alike, and the release of a name a waiter marked wanted
/// notifies it (and no other).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_releases_answers_each_as_its_own_statement_would() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(3).await;
    // (suffix, owner of the release)
    let releases = [
        ("twice", "me:1"),
        ("once", "me:2"),
        ("others", "me:3"),
        ("never", "me:4"),
        ("wanted", "me:5"),
    ];
    for prefix in ["alone-", "batch-"] {
        let name = |suffix: &str| format!("{prefix}{suffix}");
        take(&backend, &req(&name("twice"), "me:1")).await;
        take(&backend, &req(&name("twice"), "me:1")).await;
        take(&backend, &req(&name("once"), "me:2")).await;
        take(&backend, &req(&name("others"), "other:1")).await;
        take(&backend, &req(&name("wanted"), "me:5")).await;
        // A busy attempt marks the name wanted.
        let busy = backend.acquire(&req(&name("wanted"), "w:1")).await.unwrap();
        assert!(matches!(busy, Acquire::Busy { .. }), "{busy:?}");
    }
    let mut listener = PgListener::connect(&db.url).await.unwrap();
    listener.listen("tower_lock").await.unwrap();

    let mut alone = Vec::new();
    for (suffix, owner) in releases {
        let left: i32 = sqlx::query_scalar("SELECT tower_lock_unlock_x($1, $2, 30000, 'test')")
            .bind(format!("alone-{suffix}"))
            .bind(owner)
            .fetch_one(&pool)
            .await
            .unwrap();
        alone.push(left);
    }
    assert_eq!(alone, [1, 0, -1, -1, 0]);
    let heard = listener.recv().await.unwrap();
    assert_eq!(heard.payload(), "0test|alone-wanted");

    let names: Vec<String> = releases.iter().map(|r| format!("batch-{}", r.0)).collect();
    let owners: Vec<&str> = releases.iter().map(|r| r.1).collect();
    let answered: Vec<(i64, i32)> = sqlx::query_as(
        "SELECT i, holds_left \
           FROM tower_lock_unlock_x_batch($1, $2, array_fill(30000::bigint, ARRAY[5]), 'test')",
    )
    .bind(&names)
    .bind(&owners)
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut answered: Vec<(i64, i32)> = answered;
    answered.sort();
    assert_eq!(
        answered,
        [(1, 1), (2, 0), (3, -1), (4, -1), (5, 0)],
        "the batch answered otherwise than the single statements"
    );
    let heard = listener.recv().await.unwrap();
    assert_eq!(heard.payload(), "0test|batch-wanted");
    assert_eq!(rows(&pool, "batch-").await, rows(&pool, "alone-").await);
    // Nothing else was notified.
    let more = tokio::time::timeout(Duration::from_millis(200), listener.recv()).await;
    assert!(more.is_err(), "an extra notification: {more:?}");
}

/// A batch that grants commits synchronously whatever the session says (a grant the
/// client hears of must survive a crash), unless every grant in it may be fast; one that
/// grants nothing, and a batch of releases that hands nothing over, commit without
/// waiting for the disk.
#[tokio::test]
async fn a_batch_commits_as_durably_as_its_grants_need() {
    let db = PgDatabase::create().await;
    let pool = db.pool(2).await;
    let backend = on(&db).await;
    let acquire = "SELECT count(*) FROM tower_lock_lock_x_batch($1, ARRAY['o:1', 'o:2'], \
                   ARRAY[30000, 30000]::bigint[], ARRAY[false, false], ARRAY[0, 0]::bigint[], $2)";
    let release = "SELECT count(*) FROM tower_lock_unlock_x_batch($1, ARRAY['o:1', 'o:2'], \
                   ARRAY[30000, 30000]::bigint[], 'test')";
    take(&backend, &req("e", "holder:1")).await;
    take(&backend, &req("f", "holder:2")).await;
    let cases: [(&str, [&str; 2], [bool; 2], &str); 5] = [
        // Grants, one not fast: durable.
        (acquire, ["a", "b"], [false, true], "on"),
        (release, ["a", "b"], [false, false], "off"),
        // Grants, every one fast.
        (acquire, ["c", "d"], [true, true], "off"),
        (release, ["c", "d"], [false, false], "off"),
        // Grants nothing: both names are held by others.
        (acquire, ["e", "f"], [false, false], "off"),
    ];
    for (sql, names, fast, expected) in cases {
        let mut tx = pool.begin().await.unwrap();
        // The opposite of what the batch must leave.
        let session = if expected == "on" { "off" } else { "on" };
        sqlx::query(&format!("SET LOCAL synchronous_commit = {session}"))
            .execute(&mut *tx)
            .await
            .unwrap();
        let query = sqlx::query_scalar::<_, i64>(sql).bind(names);
        let query = if sql == acquire {
            query.bind(fast)
        } else {
            query
        };
        assert_eq!(query.fetch_one(&mut *tx).await.unwrap(), 2);
        let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        assert_eq!(setting, expected, "{sql} on {names:?}, fast {fast:?}");
        tx.commit().await.unwrap();
    }
}

/// Exclusive acquisitions that arrive together through the backend are granted in
/// shared transactions (rows written by one transaction share its `xmin`), each by
/// its own owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exclusive_grants_that_arrive_together_share_a_transaction() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(2).await;
    // The database's clock sampled: every attempt goes straight to the batcher.
    take(&backend, &req("warm", "warm:1")).await;
    let mut transactions = Vec::new();
    for round in 0..5 {
        let attempts: Vec<_> = (0..32)
            .map(|i| {
                let backend = backend.clone();
                let req = req(&format!("together-{round}-{i}"), &format!("o:{round}-{i}"));
                tokio::spawn(async move { (backend.acquire(&req).await, req) })
            })
            .collect();
        for attempt in attempts {
            let (taken, req) = attempt.await.unwrap();
            assert!(matches!(taken, Ok(Acquire::Acquired(_))), "{taken:?}");
            let owner: Option<String> =
                sqlx::query_scalar("SELECT owner FROM tower_lock_names WHERE name = $1")
                    .bind(req.key.as_str())
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(owner.as_deref(), Some(req.hold_id.as_str()));
        }
        let shared: i64 = sqlx::query_scalar(
            "SELECT count(DISTINCT xmin::text) FROM tower_lock_names WHERE name LIKE $1",
        )
        .bind(format!("together-{round}-%"))
        .fetch_one(&pool)
        .await
        .unwrap();
        transactions.push(shared);
        if shared < 32 {
            return;
        }
    }
    panic!("32 grants at once were never batched, transactions per round: {transactions:?}");
}

/// An acquisition stuck in flight (its statement waits on the name's row, and its
/// future is not polled) holds up no one else's lock: what arrives meanwhile is sent
/// by the batcher's task, not queued behind it. Once the row is free, the stuck one is
/// answered too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_stuck_in_flight_holds_up_no_one_else() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(2).await;
    take(&backend, &req("stuck", "warm:1")).await;
    assert_eq!(
        backend.release(&req("stuck", "warm:1")).await.unwrap(),
        Release::Released
    );
    let blocker = lock_row(&pool, "stuck").await;
    let stuck_req = req("stuck", "s:1");
    let mut stuck = Box::pin(backend.acquire(&stuck_req));
    // Polled until its statement waits on the row, then left alone.
    common::wait_until(
        Duration::from_secs(5),
        "the attempt waits for the row",
        || {
            let polled = futures_util::FutureExt::now_or_never(&mut stuck);
            assert!(
                polled.is_none(),
                "answered while the row is locked: {polled:?}"
            );
            someone_waits(&pool)
        },
    )
    .await;
    for i in 0..5 {
        let other = req(&format!("free-{i}"), &format!("o:{i}"));
        let taken = tokio::time::timeout(Duration::from_secs(5), backend.acquire(&other))
            .await
            .expect("an acquisition waited behind the stuck one");
        assert!(matches!(taken, Ok(Acquire::Acquired(_))), "{taken:?}");
        let released = tokio::time::timeout(Duration::from_secs(5), backend.release(&other))
            .await
            .expect("a release waited behind the stuck acquisition");
        assert_eq!(released.unwrap(), Release::Released);
    }
    blocker.rollback().await.unwrap();
    let answered = tokio::time::timeout(Duration::from_secs(5), stuck)
        .await
        .expect("the stuck acquisition was never answered");
    assert!(matches!(answered, Ok(Acquire::Acquired(_))), "{answered:?}");
}

/// Acquisitions cancelled at random points, queued or in flight, among others that
/// complete: once the cancelled ones are given up, no name is left held. A queued
/// attempt whose caller left is still sent, and its grant taken back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelled_batched_acquisitions_leave_no_hold() {
    let db = PgDatabase::create().await;
    let client = LockClient::new(on(&db).await);
    let pool = db.pool(2).await;
    let mut rng = fastrand::Rng::with_seed(23);
    let (mut cancelled, mut completed) = (0, 0);
    for round in 0..10 {
        // Cancellation points up to 40 ms in, and further each round until some
        // complete: on a loaded machine a lock can take longer than the first rounds
        // allow.
        let span = 40_000u64 << if completed == 0 { round } else { 0 };
        let tasks: Vec<_> = (0..32)
            .map(|i| {
                let lock = client.get_lock(format!("cancel-{round}-{i}")).unwrap();
                let within = Duration::from_micros(rng.u64(0..span));
                tokio::spawn(async move {
                    match tokio::time::timeout(within, lock.lock()).await {
                        Ok(guard) => {
                            guard.unwrap().unlock().await.unwrap();
                            true
                        }
                        Err(_) => false,
                    }
                })
            })
            .collect();
        for task in tasks {
            if task.await.unwrap() {
                completed += 1;
            } else {
                cancelled += 1;
            }
        }
        if cancelled > 32 && completed > 32 {
            break;
        }
    }
    assert!(
        cancelled > 0 && completed > 0,
        "cancelled {cancelled}, completed {completed}"
    );
    common::wait_until(
        Duration::from_secs(10),
        "no name held (a lease is 30 s)",
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM tower_lock_names \
                  WHERE name LIKE 'cancel-%' AND owner IS NOT NULL \
                    AND expires_at > clock_timestamp()",
            )
            .fetch_one(&pool)
            .await
            .unwrap()
                == 0
        },
    )
    .await;
}

/// A batch of releases that hands a name to a registered waiter (with hand-over) grants
/// it, so it commits to disk, whatever the session says and whatever the releases
/// after it in the batch (name order) would set.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_of_releases_that_hands_a_name_over_commits_to_disk() {
    let db = PgDatabase::create().await;
    let holder = on(&db).await;
    let waiter = PostgresBackend::builder(db.pool(3).await)
        .hand_over(true)
        .build()
        .await
        .unwrap();
    let pool = db.pool(2).await;
    take(&holder, &req("handed", "holder:1")).await;
    let waiting = req("handed", "waiter:1");
    let _sub = waiter.subscribe(&waiting).await.unwrap();
    let busy = waiter.acquire(&waiting).await.unwrap();
    assert!(matches!(busy, Acquire::Busy { .. }), "{busy:?}");
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SET LOCAL synchronous_commit = off")
        .execute(&mut *tx)
        .await
        .unwrap();
    // "handed" is handed over; "z-none" (after it in name order) releases nothing,
    // which alone would commit without waiting for the disk.
    let mut answered: Vec<(i64, i32)> = sqlx::query_as(
        "SELECT i, holds_left FROM tower_lock_unlock_x_batch(\
             ARRAY['handed', 'z-none'], ARRAY['holder:1', 'nobody:1'], \
             ARRAY[30000, 30000]::bigint[], 'test')",
    )
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    answered.sort();
    assert_eq!(answered, [(1, -2), (2, -1)]);
    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    assert_eq!(setting, "on");
    tx.commit().await.unwrap();
    let owner: Option<String> =
        sqlx::query_scalar("SELECT owner FROM tower_lock_names WHERE name = 'handed'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(owner.as_deref(), Some("waiter:1"));
}

fn permits(max: u32) -> LockMode {
    LockMode::Permits {
        max: std::num::NonZeroU32::new(max).unwrap(),
    }
}

/// One attempt of the other modes: name suffix, owner, mode, max permits, writer,
/// deadline.
type OtherAttempt = (
    &'static str,
    &'static str,
    &'static str,
    i32,
    Option<&'static str>,
    i64,
);

/// Every case of the modes other than the exclusive one that a batch meets, once one
/// call per name and once all in one batch: each name is answered alike, and holds and
/// queues are left alike.
#[tokio::test]
async fn other_modes_in_a_batch_answer_as_their_own_calls_would() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(2).await;
    for prefix in ["alone-", "batch-"] {
        let name = |suffix: &str| format!("{prefix}{suffix}");
        for (suffix, owner, mode) in [
            ("read-shared", "other:1", LockMode::Read),
            ("write-blocked", "other:2", LockMode::Read),
            ("downgrade", "me:4", LockMode::Write),
            ("permits-full", "other:3", permits(2)),
            ("permits-full", "other:4", permits(2)),
            ("permits-room", "other:5", permits(2)),
            ("fair-mine", "me:8", LockMode::Fair),
        ] {
            take(&backend, &moded(&name(suffix), owner, mode)).await;
        }
        backend
            .abandon(&moded(&name("given-up"), "me:9", LockMode::Fair))
            .await
            .unwrap();
    }
    let attempts: [OtherAttempt; 10] = [
        ("fair-free", "me:1", "f", 0, None, 0),
        ("read-shared", "me:2", "r", 0, None, 0),
        ("write-blocked", "me:3", "w", 0, None, 0),
        ("downgrade", "me:5", "r", 0, Some("me:4"), 0),
        ("permits-full", "me:6", "p", 2, None, 0),
        ("permits-room", "me:7", "p", 2, None, 0),
        ("fair-mine", "me:8", "f", 0, None, 0),
        ("given-up", "me:9", "f", 0, None, 0),
        ("late", "me:10", "f", 0, None, 1),
        ("write-free", "me:11", "w", 0, None, 0),
    ];
    let expected: [Answer; 10] = [
        (true, 1, None, "none"),
        (true, 1, None, "none"),
        (false, 0, None, "wait"),
        (true, 1, None, "none"),
        (false, 0, None, "wait"),
        (true, 1, None, "none"),
        (true, 2, None, "none"),
        (false, 0, None, "-1"),
        (false, 0, None, "-2"),
        (true, 1, None, "none"),
    ];
    let mut alone = Vec::new();
    for (suffix, owner, mode, max, writer, deadline) in attempts {
        let row: (bool, i32, Option<i64>, Option<i64>) = sqlx::query_as(
            "SELECT acquired, holds, token, ttl_ms \
               FROM tower_lock_acquire($1, $2, $3::\"char\", $4, 30000, false, $5, 30000, $6)",
        )
        .bind(format!("alone-{suffix}"))
        .bind(owner)
        .bind(mode)
        .bind(max)
        .bind(writer)
        .bind(deadline)
        .fetch_one(&pool)
        .await
        .unwrap();
        alone.push(classify(row, 0));
    }
    assert_eq!(alone, expected);

    let names: Vec<String> = attempts.iter().map(|a| format!("batch-{}", a.0)).collect();
    let owners: Vec<&str> = attempts.iter().map(|a| a.1).collect();
    let modes: Vec<&str> = attempts.iter().map(|a| a.2).collect();
    let max: Vec<i32> = attempts.iter().map(|a| a.3).collect();
    let writers: Vec<Option<&str>> = attempts.iter().map(|a| a.4).collect();
    let deadlines: Vec<i64> = attempts.iter().map(|a| a.5).collect();
    let answered: Vec<BatchRow> = sqlx::query_as(
        "SELECT i, acquired, holds, token, ttl_ms \
           FROM tower_lock_acquire_batch($1, $2, $3::\"char\"[], $4, \
                array_fill(30000::bigint, ARRAY[10]), array_fill(false, ARRAY[10]), $5, 30000, $6) \
          ORDER BY i",
    )
    .bind(&names)
    .bind(&owners)
    .bind(&modes)
    .bind(&max)
    .bind(&writers)
    .bind(&deadlines)
    .fetch_all(&pool)
    .await
    .unwrap();
    let batched: Vec<Answer> = answered
        .into_iter()
        .map(|(_, a, h, t, ttl)| classify((a, h, t, ttl), 0))
        .collect();
    assert_eq!(batched, expected);
    let left = |prefix: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (String, String, String, i32)>(
                "SELECT substr(name, length($1) + 1), owner, mode::text, holds FROM tower_lock \
                  WHERE name LIKE $1 || '%' AND expires_at > clock_timestamp() \
                 UNION ALL \
                 SELECT substr(name, length($1) + 1), owner, 'queued ' || mode::text, 0 \
                   FROM tower_lock_queue WHERE name LIKE $1 || '%' ORDER BY 1, 2, 3",
            )
            .bind(prefix)
            .fetch_all(&pool)
            .await
            .unwrap()
        }
    };
    assert_eq!(left("batch-").await, left("alone-").await);

    // And the releases: one held twice, one held once (freed), one not held.
    let releases = [
        ("fair-mine", "me:8", "f"),
        ("read-shared", "me:2", "r"),
        ("late", "me:10", "f"),
    ];
    let mut alone = Vec::new();
    for (suffix, owner, mode) in releases {
        let left: i32 =
            sqlx::query_scalar("SELECT tower_lock_release($1, $2, $3::\"char\", 30000, 'test')")
                .bind(format!("alone-{suffix}"))
                .bind(owner)
                .bind(mode)
                .fetch_one(&pool)
                .await
                .unwrap();
        alone.push(left);
    }
    assert_eq!(alone, [1, 0, -1]);
    let names: Vec<String> = releases.iter().map(|r| format!("batch-{}", r.0)).collect();
    let owners: Vec<&str> = releases.iter().map(|r| r.1).collect();
    let modes: Vec<&str> = releases.iter().map(|r| r.2).collect();
    let batched: Vec<i32> = sqlx::query_scalar(
        "SELECT holds_left FROM tower_lock_release_batch($1, $2, $3::\"char\"[], \
                array_fill(30000::bigint, ARRAY[3]), 'test') ORDER BY i",
    )
    .bind(&names)
    .bind(&owners)
    .bind(&modes)
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(batched, alone);
    assert_eq!(left("batch-").await, left("alone-").await);
}

/// Acquisitions of the other modes that arrive together through the backend are
/// granted in shared transactions, each by its own owner, and released together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_mode_grants_that_arrive_together_share_a_transaction() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(2).await;
    take(&backend, &moded("warm", "warm:1", LockMode::Read)).await;
    let modes = [LockMode::Read, LockMode::Fair, LockMode::Write, permits(3)];
    let mut transactions = Vec::new();
    for round in 0..5 {
        let attempts: Vec<_> = (0..32)
            .map(|i| {
                let backend = backend.clone();
                let req = moded(
                    &format!("others-{round}-{i}"),
                    &format!("o:{round}-{i}"),
                    modes[i % modes.len()],
                );
                tokio::spawn(async move { (backend.acquire(&req).await, req) })
            })
            .collect();
        let mut held = Vec::new();
        for attempt in attempts {
            let (taken, req) = attempt.await.unwrap();
            assert!(matches!(taken, Ok(Acquire::Acquired(_))), "{taken:?}");
            held.push(req);
        }
        let (owners, shared): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE owner = 'o:' || substr(name, 8)), \
                    count(DISTINCT xmin::text) \
               FROM tower_lock WHERE name LIKE $1",
        )
        .bind(format!("others-{round}-%"))
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(owners, 32, "a hold under another owner");
        let releases: Vec<_> = held
            .into_iter()
            .map(|req| {
                let backend = backend.clone();
                tokio::spawn(async move { backend.release(&req).await })
            })
            .collect();
        for release in releases {
            assert_eq!(release.await.unwrap().unwrap(), Release::Released);
        }
        transactions.push(shared);
        if shared < 32 {
            return;
        }
    }
    panic!("32 grants at once were never batched, transactions per round: {transactions:?}");
}

/// The watchdog's renewal of several holds locked their names' rows in the order it
/// was given them, where a batch locks them in name order: a renewal holding `q` and
/// waiting for `p`, behind a batch that took `p` and wanted `q`, waited in a cycle until
/// PostgreSQL cancelled one of them (`deadlock detected`, a second later). Renewals now
/// lock their rows in name order too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_and_a_batch_never_wait_for_each_other_in_a_cycle() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(4).await;
    take(&backend, &req("p", "a:1")).await;
    take(&backend, &req("q", "a:2")).await;
    let blocker = lock_row(&pool, "p").await;
    // The batch first: it waits for p, holding nothing.
    let batch = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query_as::<_, (i64, bool)>(
                "SELECT i, acquired FROM tower_lock_lock_x_batch(\
                     ARRAY['p', 'q'], ARRAY['b:1', 'b:2'], ARRAY[30000, 30000]::bigint[], \
                     ARRAY[false, false], ARRAY[0, 0]::bigint[], ARRAY[false, false])",
            )
            .fetch_all(&pool)
            .await
        }
    });
    common::wait_until(Duration::from_secs(5), "the batch waits for p", || {
        someone_waits(&pool)
    })
    .await;
    // Then the renewal, given q before p.
    let renewal = tokio::spawn({
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i32>(
                "SELECT * FROM tower_lock_renew(ARRAY['q', 'p'], ARRAY['a:2', 'a:1'], \
                     ARRAY['x', 'x']::\"char\"[], ARRAY[30000, 30000]::bigint[])",
            )
            .fetch_all(&pool)
            .await
        }
    });
    common::wait_until(Duration::from_secs(5), "the renewal waits too", || async {
        common::postgres::waiting_for_a_lock(&pool).await >= 2
    })
    .await;
    blocker.rollback().await.unwrap();
    let batch = batch.await.unwrap().expect("the batch failed");
    assert_eq!(batch, [(1, false), (2, false)]);
    let mut renewed = renewal.await.unwrap().expect("the renewal failed");
    renewed.sort();
    assert_eq!(renewed, [1, 2]);
}

/// The epoch gate, read by the statements themselves: with fast grants enabled and the
/// gate gone (a crash emptied it), the first attempt, alone or in a batch, sets it one
/// max lease ahead and nothing is granted until it opens; then both grant alike.
#[tokio::test]
async fn a_closed_epoch_gate_refuses_a_batch_as_it_refuses_a_single_statement() {
    let db = PgDatabase::create().await;
    let _backend = on(&db).await;
    let pool = db.pool(2).await;
    sqlx::query("SELECT tower_lock_enable_fast(60000)")
        .execute(&pool)
        .await
        .unwrap();
    let single = |name: &'static str| {
        sqlx::query_as::<_, (bool, Option<i64>)>(
            "SELECT acquired, ttl_ms FROM tower_lock_lock_x($1, 'a:1', 30000, false, 0, false)",
        )
        .bind(name)
    };
    let batch = || {
        sqlx::query_as::<_, (bool, Option<i64>)>(
            "SELECT acquired, ttl_ms FROM tower_lock_lock_x_batch(\
             ARRAY['batch-a', 'batch-b'], ARRAY['b:1', 'b:2'], ARRAY[30000, 30000]::bigint[], \
             ARRAY[false, false], ARRAY[0, 0]::bigint[], ARRAY[false, false]) ORDER BY i",
        )
    };
    // Each form in turn finds the gate gone, as crash recovery leaves the UNLOGGED
    // table, and must set it itself.
    for by_batch in [true, false] {
        sqlx::query("DELETE FROM tower_lock_epoch")
            .execute(&pool)
            .await
            .unwrap();
        let answered = if by_batch {
            batch().fetch_all(&pool).await.unwrap()
        } else {
            vec![single("alone").fetch_one(&pool).await.unwrap()]
        };
        for (acquired, ttl) in answered {
            assert!(!acquired, "granted with the gate gone (batch: {by_batch})");
            assert!(matches!(ttl, Some(50_000..=60_000)), "{ttl:?}");
        }
        let ready_in: f64 = sqlx::query_scalar(
            "SELECT extract(epoch FROM ready_at - clock_timestamp())::float8 FROM tower_lock_epoch",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert!(
            (50.0..=60.0).contains(&ready_in),
            "the gate opens in {ready_in} s"
        );
    }
    // The gate set and closed: both forms read it so.
    let answered = batch().fetch_all(&pool).await.unwrap();
    assert!(
        answered.iter().all(|(acquired, _)| !acquired),
        "{answered:?}"
    );
    let (acquired, ttl) = single("alone").fetch_one(&pool).await.unwrap();
    assert!(!acquired && matches!(ttl, Some(50_000..=60_000)), "{ttl:?}");
    assert_eq!(
        rows(&pool, "")
            .await
            .values()
            .filter(|r| r.0.is_some())
            .count(),
        0
    );

    sqlx::query("UPDATE tower_lock_epoch SET ready_at = clock_timestamp() - interval '1 second'")
        .execute(&pool)
        .await
        .unwrap();
    assert!(single("alone").fetch_one(&pool).await.unwrap().0);
    assert_eq!(
        batch().fetch_all(&pool).await.unwrap(),
        [(true, None), (true, None)]
    );
}
