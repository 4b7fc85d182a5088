//! Named regression tests for bugs found in the PostgreSQL backend, each written before
//! its fix, on a real server and a database of its own.

use crate::common;

use std::time::Duration;

use common::postgres::{PgDatabase, take};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use tokio::time::Instant;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::backend::{Acquire, ClientNames, LockBackend, LockMode, LockRequest, Release};
use tower_lock::{HoldId, LockClient, LockKey, PostgresBackend};

fn req(key: &str, owner: &str, mode: LockMode) -> LockRequest {
    LockRequest::new(
        LockKey::new(key).unwrap(),
        HoldId::from_raw(owner).unwrap(),
        mode,
        Duration::from_secs(30),
    )
}

async fn on(db: &PgDatabase) -> PostgresBackend {
    PostgresBackend::builder(db.pool(4).await)
        .build()
        .await
        .unwrap()
}

/// A backend that sweeps every 2 s, keeping a free name's row 2 s (its token
/// retention).
async fn sweeping(db: &PgDatabase) -> PostgresBackend {
    PostgresBackend::builder(db.pool(4).await)
        .token_retention(Duration::from_secs(2))
        .build()
        .await
        .unwrap()
}

/// A backend whose exclusive waiters are handed released locks.
async fn handing(db: &PgDatabase) -> PostgresBackend {
    PostgresBackend::builder(db.pool(4).await)
        .hand_over(true)
        .build()
        .await
        .unwrap()
}

/// A pool of `db` whose sessions run REPEATABLE READ.
async fn repeatable_read_pool(db: &PgDatabase) -> sqlx::PgPool {
    let options = db.url.parse::<PgConnectOptions>().unwrap();
    PgPoolOptions::new()
        .max_connections(2)
        .after_connect(|conn, _| {
            Box::pin(async move {
                sqlx::Executor::execute(
                    conn,
                    "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ",
                )
                .await
                .map(|_| ())
            })
        })
        .connect_with(options)
        .await
        .unwrap()
}

/// Under REPEATABLE READ a function's snapshot predates the advisory lock it waits for,
/// so it could not see the holder that committed meanwhile and granted a second hold.
/// The functions now refuse any isolation but READ COMMITTED, as a misconfiguration.
#[tokio::test]
async fn a_session_not_in_read_committed_is_refused_not_granted_a_second_hold() {
    let db = PgDatabase::create().await;
    let pool = repeatable_read_pool(&db).await;
    let backend = PostgresBackend::builder(pool).build().await.unwrap();
    let err = backend
        .acquire(&req("k", "a:1", LockMode::Exclusive))
        .await
        .unwrap_err();
    assert!(!err.is_unavailable() && err.is_backend(), "{err:?}");
    assert!(err.to_string().contains("read committed"), "{err}");
}

/// Releases are refused too, in a session not in READ COMMITTED: the release statement
/// chooses its commit inline (`_left`) and must refuse as the function did, leaving
/// the hold as it was.
#[tokio::test]
async fn a_release_from_a_session_not_in_read_committed_is_refused_and_changes_nothing() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let held = req("k", "a:1", LockMode::Exclusive);
    take(&backend, &held).await;
    let pool = repeatable_read_pool(&db).await;
    let other = PostgresBackend::builder(pool)
        .migrate(false)
        .build()
        .await
        .unwrap();
    let err = other.release(&held).await.unwrap_err();
    assert!(err.to_string().contains("read committed"), "{err}");
    let holds: i32 = sqlx::query_scalar("SELECT holds FROM tower_lock_names WHERE name = 'k'")
        .fetch_one(&db.pool(1).await)
        .await
        .unwrap();
    assert_eq!(holds, 1);
    assert_eq!(backend.release(&held).await.unwrap(), Release::Released);
}

/// A schema that is not there (SQLSTATE 3F000) is a misconfiguration, not an outage:
/// a fail-open layer must not serve unlocked because of it.
#[tokio::test]
async fn a_missing_schema_fails_closed() {
    let db = PgDatabase::create().await;
    let backend = PostgresBackend::builder(db.pool(2).await)
        .schema("no_such_schema")
        .migrate(false)
        .build()
        .await
        .unwrap();
    // The exclusive mode's statement names the table: an undefined table (42P01).
    let err = backend
        .acquire(&req("k", "a:1", LockMode::Exclusive))
        .await
        .unwrap_err();
    assert!(!err.is_unavailable(), "{err:?}");
    assert!(err.to_string().contains("(SQLSTATE 42P01)"), "{err}");
    // The other modes call a function of the schema.
    let err = backend
        .acquire(&req("k", "a:1", LockMode::Read))
        .await
        .unwrap_err();
    assert!(!err.is_unavailable(), "{err:?}");
    // The kind says what to do; the SQLSTATE stays reachable, in the message and in
    // sqlx's error as the source.
    let tower_lock::Error::Store(store) = &err else {
        panic!("a store error: {err:?}")
    };
    assert_eq!(store.kind(), tower_lock::StoreErrorKind::Misconfigured);
    assert!(err.to_string().contains("(SQLSTATE 3F000)"), "{err}");
    match store.downcast_ref::<sqlx::Error>() {
        Some(sqlx::Error::Database(db)) => assert_eq!(db.code().as_deref(), Some("3F000")),
        other => panic!("sqlx's database error as the source: {other:?}"),
    }
}

/// Force-releasing the read lock while a writer holds the key removed the writer too
/// (the memory and Redis backends leave it): only read holds go, and only without a
/// writer; force-releasing the write lock with only readers present removes nothing.
#[tokio::test]
async fn force_releasing_the_read_lock_leaves_a_writer_alone() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let key = LockKey::new("rw").unwrap();
    let w = req("rw", "w:1", LockMode::Write);
    take(&backend, &w).await;
    assert!(!backend.force_release(&key, LockMode::Read).await.unwrap());
    assert!(
        backend.renew(&w).await.unwrap(),
        "the writer still holds it"
    );
    assert!(backend.force_release(&key, LockMode::Write).await.unwrap());
    let r = req("rw", "r:1", LockMode::Read);
    take(&backend, &r).await;
    assert!(!backend.force_release(&key, LockMode::Write).await.unwrap());
    assert!(
        backend.renew(&r).await.unwrap(),
        "the reader still holds it"
    );
    assert!(backend.force_release(&key, LockMode::Read).await.unwrap());
}

/// A read whose `writer` is `None` stands for its own owner: past that owner's write
/// hold it must not queue behind a writer that waits for that very hold.
#[tokio::test]
async fn a_read_without_a_named_writer_passes_its_own_owners_write_hold() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let mine = req("down", "o:1", LockMode::Write);
    take(&backend, &mine).await;
    let other = req("down", "w:2", LockMode::Write);
    assert!(matches!(
        backend.acquire(&other).await.unwrap(),
        Acquire::Busy { .. }
    ));
    let read = req("down", "o:1", LockMode::Read);
    assert!(
        matches!(backend.acquire(&read).await.unwrap(), Acquire::Acquired(_)),
        "downgrade"
    );
    backend.cancel_wait(&other).await.unwrap();
}

/// Expired holds, stale queue entries and expired client names were only ever deleted
/// by a later acquisition of the same name: with per-user keys they piled up. A
/// release of an expired hold deletes it, and the backend's sweep takes what expired.
/// The names table keeps a row per name (exclusive holds live there, updated in place):
/// the sweep takes the rows free for the token retention.
#[tokio::test]
async fn expired_rows_do_not_pile_up() {
    let db = PgDatabase::create().await;
    let backend = sweeping(&db).await;
    let mut short = req("gone", "a:1", LockMode::Read);
    short.lease = Duration::from_millis(20);
    take(&backend, &short).await;
    for i in 0..5 {
        let mode = if i % 2 == 0 {
            LockMode::Exclusive
        } else {
            LockMode::Read
        };
        let mut r = req(&format!("leaked{i}"), "b:1", mode);
        r.lease = Duration::from_millis(20);
        backend.acquire(&r).await.unwrap();
    }
    backend
        .register("old", "gone-pod", Duration::from_millis(20))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(60)).await;
    assert_eq!(backend.release(&short).await.unwrap(), Release::NotHeld);
    let rows = |sql: &'static str| {
        let pool = backend.pool().clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        rows("SELECT count(*) FROM tower_lock WHERE name = 'gone'").await,
        0
    );
    backend
        .register("new", "pod", Duration::from_secs(60))
        .await
        .unwrap();
    common::wait_until(Duration::from_secs(10), "swept", || async {
        rows("SELECT count(*) FROM tower_lock").await == 0
            && rows("SELECT count(*) FROM tower_lock_clients").await == 1
    })
    .await;
    assert_eq!(
        rows("SELECT count(*) FROM tower_lock_names").await,
        6,
        "a name used a moment ago keeps its row"
    );
    // The retention on: the rows are free and their last use (and token) that old.
    common::wait_until(Duration::from_secs(10), "the names swept", || async {
        rows("SELECT count(*) FROM tower_lock_names").await == 0
    })
    .await;
}

/// The names table's sweep keeps a name whose fencing token is less than the token
/// retention behind the clock (tokens taken fast run ahead of it): deleting it would
/// let the next token, taken from the clock, go backwards.
#[tokio::test]
async fn a_swept_name_never_takes_a_smaller_token() {
    let db = PgDatabase::create().await;
    let backend = sweeping(&db).await;
    let mut fenced = req("fenced", "a:1", LockMode::Exclusive);
    fenced.fenced = true;
    let Acquire::Acquired(grant) = backend.acquire(&fenced).await.unwrap() else {
        panic!("busy")
    };
    let first = grant.token().unwrap().get();
    assert_eq!(backend.release(&fenced).await.unwrap(), Release::Released);
    // Free for longer than the retention, but its token a minute ahead of the clock.
    sqlx::query(
        "UPDATE tower_lock_names SET expires_at = expires_at - interval '1 minute', \
                token = tower_lock_now_us() + 60000000",
    )
    .execute(backend.pool())
    .await
    .unwrap();
    let ahead: i64 = sqlx::query_scalar("SELECT token FROM tower_lock_names")
        .fetch_one(backend.pool())
        .await
        .unwrap();
    assert!(ahead.unsigned_abs() > first);
    // Two sweeps and more: the row stays, its token ahead.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let kept: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_lock_names")
        .fetch_one(backend.pool())
        .await
        .unwrap();
    assert_eq!(kept, 1, "a name whose token is ahead of the clock is kept");
    let Acquire::Acquired(grant) = backend.acquire(&fenced).await.unwrap() else {
        panic!("busy")
    };
    assert!(
        grant.token().unwrap().get() > ahead.unsigned_abs(),
        "the token went backwards"
    );
}

/// Issue 25: records kept for replay expire, and nothing else would ever delete those
/// of names never written again (one idempotency key per request): they would pile up
/// as expired holds did. Each store deletes up to 8 expired records of any name, and
/// the backend's sweep takes them all with the other expired rows.
#[tokio::test]
async fn expired_records_do_not_pile_up() {
    use tower_lock::backend::ReplayStore;

    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = backend.pool().clone();
    // Records that expired a second ago, of names nobody writes again.
    let expired = |n: i64| {
        let pool = pool.clone();
        async move {
            sqlx::query(
                "INSERT INTO tower_lock_replay (name, token, record, expires_at) \
                 SELECT 'once:' || i || ':' || random(), i, '\\x00', clock_timestamp() - interval '1 second' \
                   FROM generate_series(1, $1) AS i",
            )
            .bind(n)
            .execute(&pool)
            .await
            .unwrap();
        }
    };
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    let expired_now =
        || count("SELECT count(*) FROM tower_lock_replay WHERE expires_at <= clock_timestamp()");
    let store = |name: &'static str| {
        let backend = backend.clone();
        async move {
            let req = req(name, "writer:1", LockMode::Exclusive).fenced();
            let Acquire::Acquired(grant) = backend.acquire(&req).await.unwrap() else {
                panic!("{name} is free")
            };
            let record = bytes::Bytes::from_static(b"response");
            let stored = backend
                .store_and_release(
                    &req,
                    grant.token().unwrap(),
                    record,
                    Duration::from_secs(60),
                )
                .await
                .unwrap();
            assert!(stored.stored, "{name}");
        }
    };

    expired(12).await;
    store("live:1").await;
    assert_eq!(expired_now().await, 4, "a store deletes 8 expired records");
    store("live:2").await;
    assert_eq!(expired_now().await, 0, "the next store deletes the rest");
    assert_eq!(count("SELECT count(*) FROM tower_lock_replay").await, 2);

    let sweeping = sweeping(&db).await;
    expired(3).await;
    common::wait_until(Duration::from_secs(10), "the sweep takes them", || async {
        expired_now().await == 0
    })
    .await;
    assert_eq!(count("SELECT count(*) FROM tower_lock_replay").await, 2);
    drop(sweeping);
}

/// An attempt dropped in flight was compensated by a release on another of the pool's
/// connections, which could reach the server first: the late attempt then took a hold
/// (or a place in the queue) that nobody stood for, until its lease or the waiter
/// timeout ended it — seen as a queue entry left behind by
/// `read::dropped_waiter_leaves_nothing` under load. An abandoned owner's late attempts
/// now take nothing.
#[tokio::test]
async fn a_late_attempt_of_an_abandoned_owner_takes_nothing() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    for (mode, blocker) in [
        (LockMode::Exclusive, None),
        (LockMode::Write, Some(LockMode::Read)),
    ] {
        let key = format!("late-{mode}");
        if let Some(blocker) = blocker {
            let held = req(&key, "holder:1", blocker);
            take(&backend, &held).await;
        }
        let gone = req(&key, "gone:1", mode);
        // The compensation arrives first ...
        backend.abandon(&gone).await.unwrap();
        // ... then the attempt it was meant to undo.
        assert!(matches!(
            backend.acquire(&gone).await.unwrap(),
            Acquire::Busy { .. }
        ));
        let state = backend
            .inspect(&LockKey::new(&key).unwrap(), mode)
            .await
            .unwrap();
        assert!(
            state.holders.iter().all(|h| h.hold_id.as_str() != "gone:1"),
            "{state:?}"
        );
        assert_eq!(state.waiters.count, 0, "{state:?}");
    }
    // Someone else still gets the free lock.
    let other = req("late-exclusive", "other:1", LockMode::Exclusive);
    take(&backend, &other).await;
}

/// Issue 20, item 1: an owner holds a key with a fixed 1 s lease; two of its tasks
/// re-enter at once with `try_lock_for(0, 4 s)` and `try_lock_for(0, 2 s)`. Both renew,
/// and `_renew` set `expires_at` outright, so the database kept whichever landed last
/// while the client kept the longer belief: once 2 s had passed, another client got the
/// lock while the 4 s guard still believed in it. The pool has two connections, one of
/// which listens, so the two renewals queue for the other in the order they were sent
/// (4 s, then 2 s) every time, as on one busy connection. The database must keep the
/// longest lease.
#[tokio::test]
async fn concurrent_reentries_keep_the_longest_lease_in_the_database() {
    let db = PgDatabase::create().await;
    let backend = PostgresBackend::builder(db.pool(2).await)
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let intruder = LockClient::new(on(&db).await);
    let key = LockKey::new("reentries-with-different-leases").unwrap();
    let lock = client
        .get_lock(&key)
        .unwrap()
        .with_owner(client.new_owner());
    let outer = lock
        .try_lock_for(Duration::ZERO, Duration::from_secs(1))
        .await
        .unwrap();
    let sent = Instant::now();
    // Polled in this order on one thread: the 4 s renewal is sent, then the 2 s one.
    let (long, short) = tokio::join!(
        lock.try_lock_for(Duration::ZERO, Duration::from_secs(4)),
        lock.try_lock_for(Duration::ZERO, Duration::from_secs(2)),
    );
    let (long, short) = (long.unwrap(), short.unwrap());
    assert_eq!((long.hold_count(), short.hold_count()), (2, 3));
    // Past the 2 s lease, and for half a second more, well inside the 4 s one.
    tokio::time::sleep_until(sent + Duration::from_millis(2500)).await;
    let other = intruder.get_lock(&key).unwrap();
    while sent.elapsed() < Duration::from_secs(3) {
        assert!(!long.is_lost(), "the 4 s guard gave up on its own");
        match other.try_lock().await {
            Err(e) if e.is_busy() => {}
            Ok(_) => panic!(
                "another client got the lock {:?} after the 4 s re-entry, while its guard believed in it",
                sent.elapsed()
            ),
            Err(e) => panic!("{e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    drop((outer, short));
    long.unlock().await.unwrap();
}

/// A pool of one connection was accepted, and then every locked request waited out the
/// response timeout and failed as an outage ("PostgreSQL did not answer within 2s"):
/// the listener kept the only connection. `build` refused it from then on. The
/// listener's connection is now its own, outside the pool: one connection is enough to
/// take a lock and to wait for one.
#[tokio::test]
async fn a_pool_of_one_connection_takes_locks_and_waits_for_them() {
    let db = PgDatabase::create().await;
    let backend = PostgresBackend::builder(db.pool(1).await)
        .response_timeout(Duration::from_secs(2))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    let started = Instant::now();
    client
        .get_lock("small-pool")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(1));
    // A release by another process is heard: the listener does not need the pool.
    let guard = LockClient::new(on(&db).await)
        .get_lock("small-pool")
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap();
    let lock = client.get_lock("small-pool").unwrap();
    let waiter = tokio::spawn(async move {
        lock.try_lock_for(Duration::from_secs(30), tower_lock::Lease::Watchdog)
            .await
    });
    let admin = db.pool(1).await;
    common::postgres::wait_until_wanted(&admin, "small-pool").await;
    guard.unlock().await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), waiter)
        .await
        .expect("the waiter heard the release")
        .unwrap()
        .unwrap();
    got.unlock().await.unwrap();
}

/// Regression (issue 24, item 10): every start printed PostgreSQL's INFO notices
/// ("relation ... already exists, skipping") from the migration's `CREATE ... IF NOT
/// EXISTS`, once per object. A second migration of the same tables now sends none.
#[tokio::test(flavor = "current_thread")]
async fn a_migration_of_existing_tables_sends_no_notices() {
    use std::sync::{Arc, Mutex};
    use tracing_subscriber::layer::SubscriberExt;

    /// Collects the messages of sqlx's notice events.
    struct Notices(Arc<Mutex<Vec<String>>>);
    impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for Notices {
        fn on_event(
            &self,
            event: &tracing::Event<'_>,
            _: tracing_subscriber::layer::Context<'_, S>,
        ) {
            if event.metadata().target() == "sqlx::postgres::notice" {
                let mut text = String::new();
                event.record(
                    &mut |field: &tracing::field::Field, value: &dyn std::fmt::Debug| {
                        text.push_str(&format!("{}={value:?} ", field.name()));
                    },
                );
                self.0.lock().unwrap().push(text);
            }
        }
    }

    let db = PgDatabase::create().await;
    let pool = db.pool(2).await;
    PostgresBackend::migrate(&pool, "public", "tower_lock")
        .await
        .unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let subscriber = tracing_subscriber::registry().with(Notices(Arc::clone(&seen)));
    crate::common::log_capture_sees_every_callsite();
    let _default = tracing::subscriber::set_default(subscriber);
    PostgresBackend::migrate(&pool, "public", "tower_lock")
        .await
        .unwrap();
    let _backend = PostgresBackend::builder(pool).build().await.unwrap();
    let seen = seen.lock().unwrap();
    assert!(seen.is_empty(), "notices: {seen:#?}");
}

/// Issue 23: a release used to notify every time, and at 32 workers on their own names
/// the commits serialized on the notification queue's lock. A release now notifies only
/// a name a busy attempt marked wanted: the first notification a listener hears is the
/// contended name's, not the one released with nobody waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_notifies_only_a_name_someone_waits_for() {
    let db = PgDatabase::create().await;
    let holder = on(&db).await;
    let waiter = on(&db).await;
    let mut listener = sqlx::postgres::PgListener::connect(&db.url).await.unwrap();
    listener.listen("tower_lock").await.unwrap();

    let alone = req("alone", "a:1", LockMode::Exclusive);
    assert!(matches!(
        holder.acquire(&alone).await.unwrap(),
        Acquire::Acquired(_)
    ));
    assert_eq!(holder.release(&alone).await.unwrap(), Release::Released);

    let wanted = req("wanted", "a:1", LockMode::Exclusive);
    assert!(matches!(
        holder.acquire(&wanted).await.unwrap(),
        Acquire::Acquired(_)
    ));
    let busy = waiter
        .acquire(&req("wanted", "b:1", LockMode::Exclusive))
        .await
        .unwrap();
    assert!(matches!(busy, Acquire::Busy { ttl: Some(_) }), "{busy:?}");
    assert_eq!(holder.release(&wanted).await.unwrap(), Release::Released);

    let heard = tokio::time::timeout(Duration::from_secs(5), listener.recv())
        .await
        .expect("the release of a wanted name notifies")
        .unwrap();
    assert!(
        heard.payload().ends_with("|wanted"),
        "the first notification: {:?}",
        heard.payload()
    );
}

/// Issue 23: an exclusive attempt is one statement without the name's advisory lock, so
/// it reads the abandoned owners (`tower_lock_gone`) in its snapshot. An attempt that
/// took its snapshot before an abandonment of its owner committed, and reached the
/// name's row after it, would not see the record and took the lock for an owner given
/// up for good. The abandonment bumps the row's `gen`, which the attempt checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_overtaken_by_its_owners_abandonment_takes_nothing() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(2).await;
    let outcome = overtaken_by_an_abandonment(&backend, &pool, "late", "a:1").await;
    assert!(
        !matches!(outcome, Acquire::Acquired(_)),
        "an abandoned owner took the lock: {outcome:?}"
    );
    let owner: Option<String> = sqlx::query_scalar(
        "SELECT owner FROM tower_lock_names WHERE name = 'late' AND expires_at > clock_timestamp()",
    )
    .fetch_optional(&pool)
    .await
    .unwrap()
    .flatten();
    assert_eq!(owner, None);
}

/// What an attempt of `owner` on `name` answers when it took its snapshot before the
/// abandonment of `a:1` on the name committed, and reached the name's row after it:
/// the row exists and is free (`a:1` took and released it), a transaction holds its
/// lock while the attempt starts, then abandons `a:1` and commits.
async fn overtaken_by_an_abandonment(
    backend: &PostgresBackend,
    pool: &sqlx::PgPool,
    name: &str,
    owner: &str,
) -> Acquire {
    let earlier = req(name, "a:1", LockMode::Exclusive);
    take(backend, &earlier).await;
    assert_eq!(backend.release(&earlier).await.unwrap(), Release::Released);
    let mut blocker = pool.begin().await.unwrap();
    sqlx::query("SELECT tower_lock_lock_name($1)")
        .bind(name)
        .execute(&mut *blocker)
        .await
        .unwrap();
    // The attempt starts (its snapshot: no abandonment) and waits for the row.
    let attempt = tokio::spawn({
        let backend = backend.clone();
        let attempt = req(name, owner, LockMode::Exclusive);
        async move { backend.acquire(&attempt).await }
    });
    common::wait_until(
        Duration::from_secs(5),
        "the attempt waits for the row",
        || async { common::postgres::waiting_for_a_lock(pool).await > 0 },
    )
    .await;
    // `a:1` is given up for good, and that commits before the attempt goes on.
    sqlx::query("SELECT tower_lock_abandon($1, 'a:1', 'x', 60000)")
        .bind(name)
        .execute(&mut *blocker)
        .await
        .unwrap();
    blocker.commit().await.unwrap();
    attempt.await.unwrap().unwrap()
}

/// Issue 23: with releases notifying only names marked wanted, a waiter of another
/// process must still hear the release, not sleep to the end of the holder's lease: its
/// busy attempt marks the name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_of_another_process_hears_the_release() {
    let db = PgDatabase::create().await;
    let here = LockClient::new(on(&db).await);
    let there = LockClient::new(on(&db).await);
    let guard = here
        .get_lock("handoff")
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap();
    let lock = there.get_lock("handoff").unwrap();
    let waiter = tokio::spawn(async move {
        lock.try_lock_for(Duration::from_secs(20), tower_lock::Lease::Watchdog)
            .await
    });
    let pool = db.pool(1).await;
    common::postgres::wait_until_wanted(&pool, "handoff").await;
    guard.unlock().await.unwrap();
    let got = waiter.await.unwrap().expect("the waiter took the lock");
    got.unlock().await.unwrap();
}

/// Issue 23: kept connections skip the pool's test of a connection it takes back. One
/// killed while kept fails the next statement on it (an outage, retryable), goes back to
/// the pool, and the statement after that runs; the backend's other statements, which
/// take connections from the pool, are not starved by the kept ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_that_died_fails_once_and_is_replaced() {
    let db = PgDatabase::create().await;
    let options = db
        .url
        .parse::<PgConnectOptions>()
        .unwrap()
        .application_name("tl-kept");
    let pool = PgPoolOptions::new()
        .max_connections(4)
        .connect_with(options)
        .await
        .unwrap();
    let backend = PostgresBackend::builder(pool)
        .kept_connections(8)
        .build()
        .await
        .unwrap();
    let lock = req("kept", "a:1", LockMode::Exclusive);
    take(&backend, &lock).await;
    assert_eq!(backend.release(&lock).await.unwrap(), Release::Released);
    let admin = db.pool(1).await;
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
          WHERE application_name = 'tl-kept' AND query NOT LIKE 'LISTEN%' \
            AND query NOT LIKE '/* tower-lock listener */%'",
    )
    .fetch_one(&admin)
    .await
    .unwrap();
    assert!(killed >= 1, "the kept connection was there to kill");
    let mut failures = 0;
    let mut granted = false;
    for _ in 0..3 {
        match backend.acquire(&lock).await {
            Ok(Acquire::Acquired(_)) => {
                granted = true;
                break;
            }
            Ok(other) => panic!("{other:?}"),
            Err(e) => {
                assert!(e.is_unavailable(), "{e:?}");
                failures += 1;
            }
        }
    }
    assert!(
        granted,
        "the lock was never granted after {failures} failures"
    );
    assert!(
        failures <= 1,
        "{failures} statements failed on dead connections"
    );
    // The other statements run beside a stream of kept-connection ones.
    let stream = tokio::spawn({
        let backend = backend.clone();
        async move {
            let other = req("kept:stream", "b:1", LockMode::Exclusive);
            for _ in 0..200 {
                backend.acquire(&other).await.unwrap();
                backend.release(&other).await.unwrap();
            }
        }
    });
    for _ in 0..20 {
        backend
            .inspect(&LockKey::new("kept").unwrap(), LockMode::Exclusive)
            .await
            .unwrap();
    }
    stream.await.unwrap();
    assert_eq!(backend.release(&lock).await.unwrap(), Release::Released);
}

/// `req` waiting on `backend`: subscribed, and its attempt answered busy (with
/// hand-over, which registers it).
async fn wait_busy(
    backend: &PostgresBackend,
    req: &LockRequest,
) -> Box<dyn tower_lock::backend::Subscription> {
    let sub = backend.subscribe(req).await.unwrap();
    let busy = backend.acquire(req).await.unwrap();
    assert!(matches!(busy, Acquire::Busy { .. }), "{busy:?}");
    sub
}

/// The waiter of `sub` is woken within 5 s, and its next attempt takes `req`.
async fn woken_then_takes(
    backend: &PostgresBackend,
    sub: &mut Box<dyn tower_lock::backend::Subscription>,
    req: &LockRequest,
) {
    let deadline = Instant::now() + Duration::from_secs(5);
    assert_eq!(
        sub.wait(deadline).await,
        tower_lock::backend::Wake::Notified
    );
    take(backend, req).await;
}

/// The exclusive name's holder and waiters as the database has them: the holder, and
/// the registered waiters in the order a release hands the name to them.
async fn owner_and_waiters(
    conn: &mut sqlx::PgConnection,
    name: &str,
) -> (Option<String>, Vec<String>) {
    let owner: Option<String> = sqlx::query_scalar(
        "SELECT owner FROM tower_lock_names WHERE name = $1 AND expires_at > clock_timestamp()",
    )
    .bind(name)
    .fetch_optional(&mut *conn)
    .await
    .unwrap()
    .flatten();
    let waiters: Vec<String> =
        sqlx::query_scalar("SELECT owner FROM tower_lock_waiters WHERE name = $1 ORDER BY since")
            .bind(name)
            .fetch_all(&mut *conn)
            .await
            .unwrap();
    (owner, waiters)
}

/// Issue 23: a handoff used to be a release, a notification, then the waiter's own
/// attempt, committed to disk a second time: 390 µs at the median where the advisory
/// lock takes 28. A release now hands the name to its oldest registered waiter in the
/// same transaction, and the waiter takes it without a statement. Shown with the
/// waiter's pool exhausted: the only way it can take the lock is what the release left
/// it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_hands_the_lock_to_its_waiter_which_takes_it_without_a_statement() {
    let db = PgDatabase::create().await;
    let holder = on(&db).await;
    // One connection, for statements (the listener's is its own).
    let waiter_pool = db.pool(1).await;
    let waiter = PostgresBackend::builder(waiter_pool.clone())
        .hand_over(true)
        .build()
        .await
        .unwrap();
    let held = req("handed", "a:1", LockMode::Exclusive).fenced();
    let wanted = req("handed", "b:1", LockMode::Exclusive).fenced();
    let Acquire::Acquired(first) = holder.acquire(&held).await.unwrap() else {
        panic!("the name is free");
    };
    let mut sub = waiter.subscribe(&wanted).await.unwrap();
    let busy = waiter.acquire(&wanted).await.unwrap();
    assert!(matches!(busy, Acquire::Busy { .. }), "{busy:?}");

    let mut hog = waiter_pool.acquire().await.unwrap();
    assert_eq!(
        owner_and_waiters(&mut hog, "handed").await,
        (Some("a:1".into()), vec!["b:1".into()])
    );
    assert_eq!(holder.release(&held).await.unwrap(), Release::Released);
    assert_eq!(
        owner_and_waiters(&mut hog, "handed").await,
        (Some("b:1".into()), vec![]),
        "the release handed the name to its waiter"
    );

    let deadline = Instant::now() + Duration::from_secs(5);
    assert_eq!(
        sub.wait(deadline).await,
        tower_lock::backend::Wake::Notified
    );
    let taken = tokio::time::timeout(Duration::from_secs(1), waiter.acquire(&wanted))
        .await
        .expect("the handed lock is taken without a connection")
        .unwrap();
    let Acquire::Acquired(grant) = taken else {
        panic!("handed, yet {taken:?}");
    };
    assert_eq!(grant.holds(), 1);
    assert!(
        grant.token() > first.token(),
        "a fenced waiter is handed the next token: {:?} after {:?}",
        grant.token(),
        first.token()
    );
    let valid = grant.valid_for().expect("believed for the lease left");
    assert!(
        valid <= Duration::from_secs(30) && valid > Duration::from_secs(25),
        "{valid:?}"
    );
    drop(sub);
    drop(hog);
    assert_eq!(waiter.release(&wanted).await.unwrap(), Release::Released);
}

/// Issue 23: a waiter that leaves (a timeout, a cancelled request) after a release
/// handed it the name, before it took it, must not keep the name for a lease: leaving
/// takes it out of the waiters and passes the name on to the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_that_leaves_passes_on_the_lock_handed_to_it() {
    let db = PgDatabase::create().await;
    let holder = on(&db).await;
    let first = handing(&db).await;
    let second = handing(&db).await;
    let pool = db.pool(2).await;
    let held = req("passed", "a:1", LockMode::Exclusive);
    let leaving = req("passed", "b:1", LockMode::Exclusive);
    let staying = req("passed", "c:1", LockMode::Exclusive);
    take(&holder, &held).await;
    let leaving_sub = wait_busy(&first, &leaving).await;
    let mut staying_sub = wait_busy(&second, &staying).await;
    assert_eq!(holder.release(&held).await.unwrap(), Release::Released);
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        owner_and_waiters(&mut conn, "passed").await,
        (Some("b:1".into()), vec!["c:1".into()]),
        "handed to the oldest waiter"
    );

    // The first waiter leaves without taking it.
    drop(leaving_sub);
    common::wait_until(
        Duration::from_secs(5),
        "the name passes on to the next waiter",
        || {
            let pool = pool.clone();
            async move {
                let mut conn = pool.acquire().await.unwrap();
                owner_and_waiters(&mut conn, "passed").await == (Some("c:1".into()), vec![])
            }
        },
    )
    .await;
    woken_then_takes(&second, &mut staying_sub, &staying).await;
    drop(staying_sub);
    assert_eq!(second.release(&staying).await.unwrap(), Release::Released);
    assert_eq!(owner_and_waiters(&mut conn, "passed").await, (None, vec![]));
}

/// Issue 23: a process that died while waiting (its registration outlives it until what
/// blocked it ends) must never be handed the name: nobody would release it before its
/// lease ends. Its listening session's liveness lock is gone with it, and the release
/// skips it for the next waiter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_process_died_is_never_handed_the_lock() {
    let db = PgDatabase::create().await;
    let holder = on(&db).await;
    let waiter = handing(&db).await;
    let pool = db.pool(2).await;
    let held = req("orphan", "a:1", LockMode::Exclusive);
    let alive = req("orphan", "c:1", LockMode::Exclusive);
    take(&holder, &held).await;
    // A waiter of a process that died: registered first, with a liveness key no session
    // holds any more.
    sqlx::query(
        "INSERT INTO tower_lock_waiters \
         VALUES ('orphan', 'dead:1', clock_timestamp() - interval '1 second', \
                 clock_timestamp(), clock_timestamp() + interval '30 seconds', 0, \
                 30000, false, false, 7)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let mut sub = wait_busy(&waiter, &alive).await;
    assert_eq!(holder.release(&held).await.unwrap(), Release::Released);
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        owner_and_waiters(&mut conn, "orphan").await,
        (Some("c:1".into()), vec![]),
        "handed past the dead waiter, whose registration is gone"
    );
    woken_then_takes(&waiter, &mut sub, &alive).await;
}

/// Issue 23: a waiter whose time is up may be gone before its leaving reaches the
/// database (the cancelled future's task, a pool queue): handed the name, it would keep
/// it for a lease while the live waiters behind it time out. In a burst, 37% of the
/// hand-overs went to such waiters. A waiter registers when it gives up, and is not
/// handed the name past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_past_its_time_is_not_handed_the_lock() {
    let db = PgDatabase::create().await;
    let holder = on(&db).await;
    let waiter = handing(&db).await;
    let pool = db.pool(2).await;
    let held = req("late-waiter", "a:1", LockMode::Exclusive);
    let wanted = req("late-waiter", "b:1", LockMode::Exclusive);
    take(&holder, &held).await;
    let mut sub = waiter.subscribe(&wanted).await.unwrap();
    sub.gives_up_at(Instant::now() + Duration::from_millis(200));
    assert!(matches!(
        waiter.acquire(&wanted).await.unwrap(),
        Acquire::Busy { .. }
    ));
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        owner_and_waiters(&mut conn, "late-waiter").await,
        (Some("a:1".into()), vec!["b:1".into()])
    );
    // Its time runs out (its leaving has not reached the database).
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(holder.release(&held).await.unwrap(), Release::Released);
    let (owner, _) = owner_and_waiters(&mut conn, "late-waiter").await;
    assert_eq!(owner, None, "not handed to a waiter past its time");
    // Its last attempt, after its time, finds the name free.
    take(&waiter, &wanted).await;
    drop(sub);
}

/// Hand-over is opt-in: a backend without it never registers its waiters, and a release
/// frees the name as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_hand_over_waiters_are_not_registered() {
    let db = PgDatabase::create().await;
    let holder = on(&db).await;
    let waiter = on(&db).await;
    let pool = db.pool(2).await;
    let held = req("plain", "a:1", LockMode::Exclusive);
    let wanted = req("plain", "b:1", LockMode::Exclusive);
    take(&holder, &held).await;
    let sub = wait_busy(&waiter, &wanted).await;
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        owner_and_waiters(&mut conn, "plain").await,
        (Some("a:1".into()), vec![])
    );
    assert_eq!(holder.release(&held).await.unwrap(), Release::Released);
    assert_eq!(owner_and_waiters(&mut conn, "plain").await, (None, vec![]));
    drop(sub);
}

/// `.ci/run` failed `a_stalled_statement_times_out_and_leaves_nothing`: a fresh
/// owner's `try_lock` of a free name answered busy (ttl 0). Its attempt had taken its
/// snapshot before the abandonment of another owner of the name committed (the stalled
/// attempt's compensation), and reached the row after it: the row's `gen` had moved,
/// which makes an attempt take nothing whoever its owner. That answer means "try again
/// now", and the backend now does, with a new snapshot, before it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_overtaken_by_another_owners_abandonment_still_takes_a_free_lock() {
    let db = PgDatabase::create().await;
    let backend = on(&db).await;
    let pool = db.pool(2).await;
    let outcome = overtaken_by_an_abandonment(&backend, &pool, "free", "b:1").await;
    assert!(
        matches!(outcome, Acquire::Acquired(_)),
        "a free lock answered {outcome:?}"
    );
}

/// Runs `sql` (no parameters, no rows wanted) on `conn`.
async fn run_sql(conn: &mut sqlx::PgConnection, sql: &str) {
    sqlx::raw_sql(sql).execute(conn).await.unwrap();
}

/// The body of the installed SQL function `function`: the statement the backend sends,
/// parameters and all.
async fn function_body(conn: &mut sqlx::PgConnection, function: &str) -> String {
    sqlx::query_scalar("SELECT prosrc FROM pg_proc WHERE proname = $1")
        .bind(function)
        .fetch_one(conn)
        .await
        .unwrap()
}

/// Found while making the exclusive statements leaner: reading the epoch gate with a
/// join of its two tables made the planner, on tables it had no statistics for yet,
/// estimate the statement above `jit_above_cost`, and every execution then compiled
/// it with LLVM (hundreds of milliseconds: attempts timed out). Each exclusive
/// statement must also choose its commit (`_grant`, `_left`) inline, as an expression,
/// not by running a function per attempt: that is what it was made lean for.
#[tokio::test]
async fn the_exclusive_statements_stay_cheap_to_plan_and_choose_their_commit_inline() {
    let db = PgDatabase::create().await;
    let _backend = on(&db).await; // installs the schema
    let pool = db.pool(1).await;
    let mut conn = pool.acquire().await.unwrap();
    let jit_above: f64 = sqlx::query_scalar::<_, String>("SHOW jit_above_cost")
        .fetch_one(&mut *conn)
        .await
        .unwrap()
        .parse()
        .unwrap();
    run_sql(&mut conn, "SET plan_cache_mode = force_generic_plan").await;
    let statements = [
        (
            "tower_lock_lock_x",
            "text, text, bigint, boolean, bigint, boolean",
            "'k', 'a:1', 30000, false, 0, false",
        ),
        (
            "tower_lock_unlock_x",
            "text, text, bigint, text",
            "'k', 'a:1', 30000, 'o'",
        ),
        (
            "tower_lock_lock_x_batch",
            "text[], text[], bigint[], boolean[], bigint[], boolean[]",
            "'{k}', '{a:1}', '{30000}', '{f}', '{0}', '{f}'",
        ),
        (
            "tower_lock_unlock_x_batch",
            "text[], text[], bigint[], text",
            "'{k}', '{a:1}', '{30000}', 'o'",
        ),
    ];
    for (function, types, args) in statements {
        let body = function_body(&mut conn, function).await;
        run_sql(&mut conn, &format!("PREPARE s ({types}) AS {body}")).await;
        let plan: Vec<String> =
            sqlx::query_scalar(&format!("EXPLAIN (VERBOSE) EXECUTE s ({args})"))
                .fetch_all(&mut *conn)
                .await
                .unwrap();
        run_sql(&mut conn, "DEALLOCATE s").await;
        let plan = plan.join("\n");
        let total: f64 = plan
            .split_once("..")
            .and_then(|(_, rest)| rest.split_once(' '))
            .map(|(cost, _)| cost.parse().unwrap())
            .unwrap();
        assert!(
            total < jit_above / 10.0,
            "{function}: estimated at {total}, JIT starts at {jit_above}:\n{plan}"
        );
        assert!(plan.contains("set_config("), "{function}:\n{plan}");
        for called in [
            "tower_lock_grant(",
            "tower_lock_left(",
            "tower_lock_released(",
        ] {
            assert!(!plan.contains(called), "{function} calls {called}:\n{plan}");
        }
    }
}

/// Found measuring the flash-sale demo: the batched exclusive statements were planned
/// afresh on every execution (hundreds of microseconds of planning for a statement
/// that runs in about as long), because the planner read each call's arrays as
/// constants and, for the few names of a typical batch, always found that plan
/// cheaper than the one it would keep. A prepared batch statement must settle on one
/// plan after PostgreSQL's five trial plans, as the single statements do.
#[tokio::test]
async fn the_batch_statements_settle_on_one_plan_instead_of_planning_every_call() {
    let db = PgDatabase::create().await;
    let _backend = on(&db).await; // installs the schema
    let pool = db.pool(1).await;
    let mut conn = pool.acquire().await.unwrap();
    let version: i32 = sqlx::query_scalar("SELECT current_setting('server_version_num')::int")
        .fetch_one(&mut *conn)
        .await
        .unwrap();
    if version < 14_00_00 {
        eprintln!("skipped: PostgreSQL {version} does not count plans per statement");
        return;
    }
    run_sql(&mut conn, "SET plan_cache_mode = auto").await;
    let statements = [
        (
            function_body(&mut conn, "tower_lock_lock_x_batch").await,
            "text[], text[], bigint[], boolean[], bigint[], boolean[]",
            "ARRAY['k#', 'j#'], '{a:1,a:1}', '{30000,30000}', '{f,t}', '{0,0}', '{f,f}'",
        ),
        (
            function_body(&mut conn, "tower_lock_unlock_x_batch").await,
            "text[], text[], bigint[], text",
            "ARRAY['k#', 'j#'], '{a:1,a:1}', '{30000,30000}', 'o'",
        ),
        (
            "SELECT * FROM tower_lock_acquire_batch($1, $2, $3, $4, $5, $6, $7, $8, $9)".into(),
            "text[], text[], \"char\"[], integer[], bigint[], boolean[], text[], bigint, bigint[]",
            "ARRAY['r#', 's#'], '{a:1,a:1}', '{r,f}', '{0,0}', '{30000,30000}', '{f,t}', \
             '{NULL,NULL}', 0, '{0,0}'",
        ),
        (
            "SELECT * FROM tower_lock_release_batch($1, $2, $3, $4, $5)".into(),
            "text[], text[], \"char\"[], bigint[], text",
            "ARRAY['r#', 's#'], '{a:1,a:1}', '{r,f}', '{30000,30000}', 'o'",
        ),
    ];
    for (statement, types, args) in &statements {
        run_sql(&mut conn, &format!("PREPARE s ({types}) AS {statement}")).await;
        for call in 0..12 {
            let args = args.replace('#', &call.to_string());
            run_sql(&mut conn, &format!("EXECUTE s ({args})")).await;
        }
        let (generic, custom): (i64, i64) = sqlx::query_as(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements WHERE name = 's'",
        )
        .fetch_one(&mut *conn)
        .await
        .unwrap();
        run_sql(&mut conn, "DEALLOCATE s").await;
        assert!(
            custom <= 5 && generic == 12 - custom,
            "planned {custom} times for 12 calls ({generic} with the kept plan):\n{statement}"
        );
    }
}

/// Found probing a stalled name (a foreign transaction holding its row): every
/// statement sent on it gave up in the client at the response timeout, but went on
/// waiting in the server, and its pool connection with it (sqlx takes a connection
/// back only once its statement has answered). A few timed-out attempts on one name
/// took every connection of the pool, and then every other name failed too, for as
/// long as the stall lasted. A statement of the backend now stops waiting for a lock
/// in the server when its sender stops waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_name_keeps_no_statement_waiting_past_its_timeout_nor_the_other_names_waiting() {
    let db = PgDatabase::create().await;
    let timeout = Duration::from_millis(300);
    let backend = PostgresBackend::builder(db.pool(4).await)
        .response_timeout(timeout)
        .build()
        .await
        .unwrap();
    let stalled = "regress:stalled";
    let released = "regress:released";
    let held = req(released, "a:1", LockMode::Exclusive);
    take(&backend, &held).await;
    let pool = db.pool(2).await;
    let mut blocker = pool.begin().await.unwrap();
    for name in [stalled, released] {
        sqlx::query("SELECT public.tower_lock_lock_name($1)")
            .bind(name)
            .execute(&mut *blocker)
            .await
            .unwrap();
    }
    // Each kind of statement on a stalled name: an exclusive attempt alone, two more
    // sent together while it waits (a batch, with a free name before the stalled one),
    // another mode's attempt, a renewal and a release.
    let (alone, queued, free) = (
        req(stalled, "c:1", LockMode::Exclusive),
        req(stalled, "c:2", LockMode::Exclusive),
        req("regress:free", "c:3", LockMode::Exclusive),
    );
    let (alone, (queued, free)) = tokio::join!(backend.acquire(&alone), async {
        common::wait_until(Duration::from_secs(1), "the first attempt waits", || {
            let pool = pool.clone();
            async move { common::postgres::waiting_for_a_lock(&pool).await > 0 }
        })
        .await;
        tokio::join!(backend.acquire(&queued), backend.acquire(&free))
    });
    let outcomes = [
        alone.map(|_| ()),
        queued.map(|_| ()),
        free.map(|_| ()),
        backend
            .acquire(&req(stalled, "d:1", LockMode::Fair))
            .await
            .map(|_| ()),
        backend.renew(&held).await.map(|_| ()),
        backend.release(&held).await.map(|_| ()),
    ];
    for outcome in &outcomes {
        assert!(
            outcome.as_ref().is_err_and(|e| e.is_unavailable()),
            "{outcome:?}"
        );
    }
    common::wait_until(
        Duration::from_secs(3),
        "no statement waits any more",
        || {
            let pool = pool.clone();
            async move { common::postgres::waiting_for_a_lock(&pool).await == 0 }
        },
    )
    .await;
    // The stall goes on, and the other names with it.
    let other = req("regress:other", "e:1", LockMode::Exclusive);
    take(&backend, &other).await;
    assert_eq!(backend.release(&other).await.unwrap(), Release::Released);
    blocker.commit().await.unwrap();
    // Nothing the stalled statements asked for was done behind their senders' backs.
    assert_eq!(backend.release(&held).await.unwrap(), Release::Released);
    take(&backend, &req(stalled, "f:1", LockMode::Exclusive)).await;
    take(&backend, &req("regress:free", "f:1", LockMode::Exclusive)).await;
}

/// A backend on `db` through a proxy whose connections can be cut without a word: a
/// pool of three, a response timeout of 300 ms, `kept` connections kept.
async fn through_a_proxy(
    db: &PgDatabase,
    kept: usize,
) -> (common::redis_server::FreezableProxy, PostgresBackend) {
    let proxy = common::redis_server::FreezableProxy::start(5432).await;
    let through = db.url_through(proxy.port);
    let pool = PgPoolOptions::new()
        .max_connections(3)
        .acquire_timeout(Duration::from_secs(2))
        .connect(&through)
        .await
        .unwrap();
    let backend = PostgresBackend::builder(pool)
        .response_timeout(Duration::from_millis(300))
        .kept_connections(kept)
        .build()
        .await
        .unwrap();
    (proxy, backend)
}

/// Found reading sqlx's pool after the fix above: a connection whose statement timed
/// out went back to the pool, which takes a connection back only once its statement
/// has answered and a ping has, however long that takes. On a connection cut silently
/// (a failover that left the old server's address unanswering, a NAT that forgot the
/// flow) neither ever comes: each statement in flight at the cut held its place in the
/// pool for good, and after one cut every lock failed, though the database was up and
/// new connections reached it. A connection whose statement its caller gave up on is
/// now closed, and the pool opens another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_cut_silently_mid_statement_are_replaced_not_waited_for() {
    let db = PgDatabase::create().await;
    let (proxy, backend) = through_a_proxy(&db, 0).await;
    let direct = db.pool(2).await;
    let cycle = async |name: String| -> tower_lock::Result<()> {
        let req = req(&name, "a:1", LockMode::Exclusive);
        let taken = backend.acquire(&req).await?;
        assert!(matches!(taken, Acquire::Acquired(_)), "{taken:?}");
        assert_eq!(backend.release(&req).await?, Release::Released);
        Ok(())
    };
    let mut name = 0;
    let mut next_name = || {
        name += 1;
        format!("regress:cut:{name}")
    };
    for cut in 0..3 {
        // Every connection of the pool busy with a statement that
        // waits (behind a transaction holding its name's row), then all of them cut;
        // new connections get through.
        let stalled = next_name();
        let held = req(&stalled, "h:1", LockMode::Exclusive);
        take(&backend, &held).await;
        let mut blocker = direct.begin().await.unwrap();
        sqlx::query("SELECT public.tower_lock_lock_name($1)")
            .bind(&stalled)
            .execute(&mut *blocker)
            .await
            .unwrap();
        // Three kinds, which the backend sends each at once (of one kind, the later
        // ones would wait for the first in a batch).
        let attempts = [
            tokio::spawn({
                let (backend, req) = (backend.clone(), req(&stalled, "b:1", LockMode::Exclusive));
                async move { backend.acquire(&req).await.map(drop) }
            }),
            tokio::spawn({
                let (backend, req) = (backend.clone(), req(&stalled, "b:2", LockMode::Fair));
                async move { backend.acquire(&req).await.map(drop) }
            }),
            tokio::spawn({
                let (backend, held) = (backend.clone(), held.clone());
                async move { backend.release(&held).await.map(drop) }
            }),
        ];
        common::wait_until(Duration::from_secs(2), "three statements wait", || async {
            common::postgres::waiting_for_a_lock(&direct).await == 3
        })
        .await;
        proxy.freeze_existing();
        for attempt in attempts {
            let outcome = attempt.await.unwrap();
            assert!(
                outcome.as_ref().is_err_and(|e| e.is_unavailable()),
                "{outcome:?}"
            );
        }
        blocker.commit().await.unwrap();
        let cut_at = Instant::now();
        let mut in_a_row = 0;
        while in_a_row < 3 {
            assert!(
                cut_at.elapsed() < Duration::from_secs(5),
                "cut {cut}: locks still fail {:?} after it",
                cut_at.elapsed()
            );
            match cycle(next_name()).await {
                Ok(()) => in_a_row += 1,
                Err(error) => {
                    assert!(error.is_unavailable(), "{error:?}");
                    in_a_row = 0;
                }
            }
        }
    }
}

/// The same cut, with kept connections idle: one went back to the pool after a
/// second unused, and the pool's ping of it never answered, so each cut took the
/// kept connections' places for good. A kept connection now goes back only once it
/// has answered a ping within the response timeout, and is closed otherwise.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_connections_cut_silently_are_closed_not_given_back() {
    let db = PgDatabase::create().await;
    let (proxy, backend) = through_a_proxy(&db, 2).await;
    let mut name = 0;
    let mut cycle = async || -> tower_lock::Result<()> {
        name += 1;
        let req = req(&format!("regress:kept:{name}"), "a:1", LockMode::Exclusive);
        let taken = backend.acquire(&req).await?;
        assert!(matches!(taken, Acquire::Acquired(_)), "{taken:?}");
        assert_eq!(backend.release(&req).await?, Release::Released);
        Ok(())
    };
    for cut in 0..3 {
        cycle().await.unwrap();
        proxy.freeze_existing();
        // Idle past a second: the kept connections go back to the pool, or not.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        let cut_at = Instant::now();
        let mut in_a_row = 0;
        while in_a_row < 3 {
            assert!(
                cut_at.elapsed() < Duration::from_secs(5),
                "cut {cut}: locks still fail {:?} after the sweep",
                cut_at.elapsed()
            );
            match cycle().await {
                Ok(()) => in_a_row += 1,
                Err(error) => {
                    assert!(error.is_unavailable(), "{error:?}");
                    in_a_row = 0;
                }
            }
        }
    }
}

/// Found following the listener-cut test below, which took up to 10 s to get a lock
/// after a cut: a silent cut kills every idle connection of the pool at once, and
/// each one cost the statement that met it a response timeout, one failed call after
/// another (and a waiter's backoff between them) until the pool had met them all. A
/// statement that gets no answer now has every idle connection (the pool's and the
/// kept ones) pinged at once within the response timeout, and the silent ones closed:
/// one failed call, whatever the pool's size, with the pool's own test before each
/// statement or without, and with the pool's acquire timeout as long as the response
/// timeout (the pool's test of a dead connection then fails the statement as a pool
/// timeout, which the first version of the fix did not count). The response timeout
/// is 2 s: this machine's disk holds a commit a few hundred milliseconds at times,
/// which is a slow server, not a cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_statement_meeting_a_silent_cut_clears_every_dead_idle_connection() {
    const POOL: u32 = 8;
    const RESPONSE: Duration = Duration::from_secs(2);
    let db = PgDatabase::create().await;
    for (test_before_acquire, kept, acquire) in [
        (false, 0, 2 * RESPONSE),
        (true, 2, 2 * RESPONSE),
        (true, 0, RESPONSE),
    ] {
        let proxy = common::redis_server::FreezableProxy::start(5432).await;
        let through = db.url_through(proxy.port);
        let pool = PgPoolOptions::new()
            .max_connections(POOL)
            .test_before_acquire(test_before_acquire)
            .acquire_timeout(acquire)
            .connect(&through)
            .await
            .unwrap();
        let mut cycle = common::postgres::lock_cycles(&pool, RESPONSE, kept, "regress:idle").await;
        cycle().await.unwrap();
        common::postgres::every_connection_idle(&pool, POOL).await;
        proxy.freeze_existing();
        let failed =
            common::postgres::failed_before_three_in_a_row(Duration::from_secs(30), cycle).await;
        assert!(
            failed <= 1,
            "test before acquire {test_before_acquire}, {kept} kept, acquire timeout \
             {acquire:?}: {failed} calls failed after the cut, each on a dead idle \
             connection"
        );
    }
}

/// The same, with every connection of the pool ended under it: its sessions ended by
/// the server (as an administrator's `pg_terminate_backend` or a crash ends them, with
/// a `57P01` each), or its sockets reset on the way (a middlebox or a lost host: an I/O
/// error each). Each idle connection failed the statement that met it, at once, one
/// failed call after another. Now the first failure has the others checked, and they
/// are all replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_ended_under_the_pool_cost_one_failed_call_not_one_each() {
    const POOL: u32 = 8;
    let db = PgDatabase::create().await;
    let admin = db.pool(1).await;
    for (reset, kept) in [(false, 0), (false, 2), (true, 0)] {
        let proxy = common::proxy::FaultProxy::start(([127, 0, 0, 1], 5432).into()).await;
        let app = format!("tl-ended-{reset}-{kept}");
        let options: PgConnectOptions = db
            .url_through(proxy.port())
            .parse::<PgConnectOptions>()
            .unwrap()
            .application_name(&app);
        let pool = PgPoolOptions::new()
            .max_connections(POOL)
            // As the docs recommend; with its test on, the pool's ping finds each
            // ended session at once and opens another.
            .test_before_acquire(false)
            .acquire_timeout(Duration::from_secs(4))
            .connect_with(options)
            .await
            .unwrap();
        let prefix = format!("regress:ended:{reset}:{kept}");
        let mut cycle =
            common::postgres::lock_cycles(&pool, Duration::from_secs(2), kept, &prefix).await;
        cycle().await.unwrap();
        common::postgres::every_connection_idle(&pool, POOL).await;
        if reset {
            proxy.cut();
        } else {
            let ended: i64 = sqlx::query_scalar(
                // With a timeout: returns once each session has ended, not when signalled.
                "SELECT count(*) FILTER (WHERE ended) FROM \
                   (SELECT pg_terminate_backend(pid, 5000) AS ended \
                      FROM pg_stat_activity WHERE application_name = $1) t",
            )
            .bind(&app)
            .fetch_one(&admin)
            .await
            .unwrap();
            // The pool's, and the listening connection (made with the same options).
            assert!(ended > i64::from(POOL), "{ended} sessions ended");
        }
        let failed =
            common::postgres::failed_before_three_in_a_row(Duration::from_secs(15), cycle).await;
        assert!(
            failed <= 1,
            "reset {reset}, {kept} kept: {failed} calls failed after the sessions ended, each on a dead \
             idle connection"
        );
    }
}

/// Found probing the listening connection after the fixes above: cut without a word, it
/// never failed (`PgListener` waits for the next message for ever), so releases by
/// other processes went unheard and each waiter slept out its holder's lease. The
/// listening connection is now asked to answer every few seconds, within the response
/// timeout, and made again when it does not; the waiters then all try again. Three cuts
/// in a row, then a release heard without one: a listener given up on goes back to its
/// pool with no bound, and on the application's pool each one took a place for good.
/// The cut session, which the server keeps (it sees an idle client), is ended there by
/// the new listener.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_cut_silently_listens_again_and_hears_the_next_release() {
    let db = PgDatabase::create().await;
    let (proxy, waiting) = through_a_proxy(&db, 0).await;
    let holding = LockClient::new(on(&db).await);
    let waiting = LockClient::new(waiting);
    let admin = db.pool(1).await;
    // The database clock at the last cut: the listener made after it is the one the
    // next round cuts (the waiter may take the lock before it listens again).
    let mut cut_at = None::<f64>;
    for round in 0..4 {
        let cut = round < 3;
        if let Some(cut_at) = cut_at {
            common::wait_until(
                Duration::from_secs(10),
                "a listener made after the cut",
                || {
                    let admin = admin.clone();
                    async move {
                        sqlx::query_scalar::<_, bool>(
                            "SELECT count(*) > 0 FROM pg_stat_activity \
                          WHERE datname = current_database() \
                            AND extract(epoch FROM backend_start) > $1 \
                            AND (query LIKE 'LISTEN%' OR query LIKE '/* tower-lock listener */%')",
                        )
                        .bind(cut_at)
                        .fetch_one(&admin)
                        .await
                        .unwrap()
                    }
                },
            )
            .await;
            // The cut listening session, which the server cannot tell from an idle one,
            // is ended there: two listen, this backend's and the holding one's.
            common::wait_until(
                Duration::from_secs(5),
                "the cut listening session ended",
                || {
                    let admin = admin.clone();
                    async move {
                        sqlx::query_scalar::<_, i64>(
                            "SELECT count(*) FROM pg_stat_activity \
                              WHERE datname = current_database() \
                                AND (query LIKE 'LISTEN%' OR query LIKE '/* tower-lock listener */%')",
                        )
                        .fetch_one(&admin)
                        .await
                        .unwrap()
                            == 2
                    }
                },
            )
            .await;
            // The cut also left the waiter's idle pool connections dead, and each one
            // costs the statement that meets it a response timeout (see above): a
            // waiter's first attempt meeting two of them would fail. Used up first.
            let drained_at = Instant::now();
            let mut in_a_row = 0;
            while in_a_row < 3 {
                assert!(
                    drained_at.elapsed() < Duration::from_secs(5),
                    "round {round}: locks still fail {:?} after the cut",
                    drained_at.elapsed()
                );
                let name = format!(
                    "regress:listener:{round}:{}",
                    drained_at.elapsed().as_nanos()
                );
                match waiting.get_lock(name.as_str()).unwrap().try_lock().await {
                    Ok(taken) => match taken.unlock().await {
                        Ok(()) => in_a_row += 1,
                        Err(error) => {
                            assert!(error.is_unavailable(), "{error:?}");
                            in_a_row = 0;
                        }
                    },
                    Err(error) => {
                        assert!(error.is_unavailable(), "{error:?}");
                        in_a_row = 0;
                    }
                }
            }
        }
        let guard = holding
            .get_lock("regress:listener")
            .unwrap()
            .try_lock_for(Duration::ZERO, Duration::from_secs(60))
            .await
            .unwrap();
        let lock = waiting.get_lock("regress:listener").unwrap();
        // The waiter's failed calls, for the message should it not get the lock.
        let failures = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(Duration, String)>::new()));
        let waiter = tokio::spawn({
            let failures = std::sync::Arc::clone(&failures);
            let started = Instant::now();
            async move {
                // A call whose wait ends in an outage fails as one; that is not what
                // this test is about (its calls ride the dead connections out).
                loop {
                    match lock
                        .try_lock_for(Duration::from_secs(30), tower_lock::Lease::Watchdog)
                        .await
                    {
                        Err(error) if error.is_unavailable() => {
                            failures
                                .lock()
                                .unwrap()
                                .push((started.elapsed(), error.to_string()));
                        }
                        done => break done,
                    }
                }
            }
        });
        common::postgres::wait_until_wanted(&admin, "regress:listener").await;
        // Only the listener is cut while it matters: no statement of the waiter's is in
        // flight (a statement cut would fail, and the waiter try again by itself).
        common::wait_until(Duration::from_secs(5), "the waiter sleeps", || {
            let admin = admin.clone();
            async move {
                sqlx::query_scalar::<_, i64>(
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
                      AND state = 'active' AND pid <> pg_backend_pid()",
                )
                .fetch_one(&admin)
                .await
                .unwrap()
                    == 0
            }
        })
        .await;
        if cut {
            proxy.freeze_existing();
            cut_at = Some(
                sqlx::query_scalar("SELECT extract(epoch FROM clock_timestamp())::float8")
                    .fetch_one(&admin)
                    .await
                    .unwrap(),
            );
        }
        guard.unlock().await.unwrap();
        let released_at = Instant::now();
        // Bounded well below the holder's 60 s lease, which a waiter that never heard
        // the release would sleep out. Not 10 s: woken by the new listener, the waiter
        // meets the pool's connections the cut left dead one by one, each a response
        // timeout, and rides that out within its wait with a backoff that doubles to
        // 1 s; `.ci/run` once needed more than 10 s for it on a loaded machine.
        let got = match tokio::time::timeout(Duration::from_secs(25), waiter).await {
            Ok(got) => got,
            Err(_) => {
                let sessions: Vec<(i32, String, String, String)> = sqlx::query_as(
                    "SELECT pid, coalesce(state, ''), backend_start::text, left(query, 60) \
                       FROM pg_stat_activity \
                      WHERE datname = current_database() AND pid <> pg_backend_pid()",
                )
                .fetch_all(&admin)
                .await
                .unwrap();
                panic!(
                    "round {round}: the waiter did not take the lock within 25 s; its failed \
                     calls: {:?}; the sessions now: {sessions:?}",
                    failures.lock().unwrap()
                )
            }
        }
        .unwrap()
        .unwrap_or_else(|e| panic!("round {round}: the waiter failed: {e:?}"));
        assert!(
            released_at.elapsed() < Duration::from_secs(5),
            "round {round}: the waiter took the lock {:?} after the release",
            released_at.elapsed()
        );
        got.unlock().await.unwrap();
    }
}

/// The sweep and a batch of acquisitions deadlocked (SQLSTATE 40P01, seen in the
/// growth test when the whole suite ran, and in the server's log): the batch deletes
/// the expired holds of its names one name after another, while the sweep deleted the
/// expired holds of every name in one statement, and each waited for a row the other
/// had deleted. When PostgreSQL chose the batch as the victim, its requests failed
/// (an idempotency layer answered 503). The sweep now skips rows another transaction
/// holds, so it never waits for one: here a transaction holds one expired row, and
/// the sweep takes the other without waiting for it, then that one once it is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sweep_waits_for_no_row_another_transaction_holds() {
    let db = PgDatabase::create().await;
    let backend = sweeping(&db).await;
    for name in ["held", "free"] {
        let mut r = req(name, "a:1", LockMode::Read);
        r.lease = Duration::from_millis(20);
        take(&backend, &r).await;
    }
    let pool = db.pool(2).await;
    let count = |sql: &'static str| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>(sql)
                .fetch_one(&pool)
                .await
                .unwrap()
        }
    };
    common::wait_until(Duration::from_secs(5), "both holds expired", || async {
        count("SELECT count(*) FROM tower_lock WHERE expires_at <= clock_timestamp()").await == 2
    })
    .await;
    // Another transaction holds the expired row of `held`, as a batch deleting it does.
    let mut holding = pool.begin().await.unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM tower_lock WHERE name = 'held' FOR UPDATE) h",
    )
    .fetch_one(&mut *holding)
    .await
    .unwrap();
    assert_eq!(held, 1);
    common::wait_until(
        Duration::from_secs(8),
        "the free row swept while the other is held",
        || async { count("SELECT count(*) FROM tower_lock WHERE name = 'free'").await == 0 },
    )
    .await;
    assert_eq!(
        count("SELECT count(*) FROM tower_lock WHERE name = 'held'").await,
        1,
        "a row another transaction holds is left for a later sweep"
    );
    holding.rollback().await.unwrap();
    common::wait_until(
        Duration::from_secs(8),
        "the held row swept once let go",
        || async { count("SELECT count(*) FROM tower_lock WHERE name = 'held'").await == 0 },
    )
    .await;
}
