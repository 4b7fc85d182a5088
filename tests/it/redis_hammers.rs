//! `hammer` processes on Redis locks, counted in PostgreSQL, whose `hammer_counter_writes`
//! says which process wrote which value and when (the helpers and the oracle are
//! `postgres_processes.rs`'s, which runs the same on PostgreSQL locks). What this adds
//! to `tests/redis_processes.rs` (its own binary, with a holder child of its own):
//! there a waiter must get a killed holder's lock within its lease and a little; here
//! nobody may write before that lease ends on the server, a `hammer` killed in the
//! middle of its read-modify-write must leave no increment, and the same hammers run
//! on a Redis Cluster whose slot moves under them.

use crate::common;

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::postgres::PgDatabase;
use common::redis_server::RedisServer;
use common::wait_until;
use tokio::time::Instant;

use crate::postgres_processes::{
    Hammer, ONE_AT_A_TIME, activity, db_clock_us, succeeded, the_kill_cost_nothing,
};

const NAME: &str = "redis-killed";

/// The holders of the lock `NAME` (its hash), and the lease left in milliseconds.
async fn hold(redis: &mut redis::aio::MultiplexedConnection) -> (HashMap<String, i64>, i64) {
    let holders: HashMap<String, i64> = redis::cmd("HGETALL")
        .arg(NAME)
        .query_async(redis)
        .await
        .unwrap();
    let pttl: i64 = redis::cmd("PTTL")
        .arg(NAME)
        .query_async(redis)
        .await
        .unwrap();
    (holders, pttl)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkilled_holder_frees_the_redis_lock_after_its_lease_and_the_count_stays_exact() {
    const ITERS: u64 = 150;
    let lease = Duration::from_millis(1000);
    let _serial = ONE_AT_A_TIME.lock().await;
    let server = RedisServer::start().await;
    let mut redis = server.conn().await;
    let db = PgDatabase::create().await;
    let pool = db.pool(2).await;
    let watchdog = lease.as_millis().to_string();
    // Names this test's processes, whatever else runs on the server.
    let (victim_app, other_app) = (
        format!("hammer-victim-{}", std::process::id()),
        format!("hammer-other-{}", std::process::id()),
    );
    let counter_as = |app: &str| format!("{}?application_name={app}", db.url);
    let hammer = |counter_url: &str, iters: &str, hold_us: Option<&str>| {
        let mut args = vec![
            "--url".to_owned(),
            server.url(),
            "--counter-url".to_owned(),
            counter_url.to_owned(),
            "--name".to_owned(),
            NAME.to_owned(),
            "--iters".to_owned(),
            iters.to_owned(),
            "--counter-key".to_owned(),
            NAME.to_owned(),
            "--watchdog-ms".to_owned(),
            watchdog.clone(),
        ];
        if let Some(hold_us) = hold_us {
            args.extend(["--hold-us".to_owned(), hold_us.to_owned()]);
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Hammer::spawn(&args)
    };

    // The victim takes the lock, reads the counter and sits on it (ten minutes between
    // its read and its write), its watchdog renewing a 1 s lease.
    let mut victim = hammer(&counter_as(&victim_app), "1", Some("600000000"));
    wait_until(
        Duration::from_secs(20),
        "the victim holds the lock and has read the counter",
        || {
            let mut redis = redis.clone();
            let pool = pool.clone();
            let app = victim_app.clone();
            async move {
                hold(&mut redis).await.0.len() == 1
                    && activity(&pool, &app, "SELECT value FROM hammer_counter%").await == 1
            }
        },
    )
    .await;
    let (victim_holds, _) = hold(&mut redis).await;

    // Two more processes wait for the lock, subscribed to its release channel.
    let iters = ITERS.to_string();
    let others: Vec<Hammer> = (0..2)
        .map(|_| hammer(&counter_as(&other_app), &iters, None))
        .collect();
    let other_pids: Vec<u32> = others.iter().map(Hammer::id).collect();
    let channel = format!("redisson_lock__channel:{{{NAME}}}");
    wait_until(
        Duration::from_secs(20),
        "the other two subscribe to the release channel",
        || {
            let mut redis = redis.clone();
            let channel = channel.clone();
            async move {
                let counts: (String, i64) = redis::cmd("PUBSUB")
                    .arg("NUMSUB")
                    .arg(&channel)
                    .query_async(&mut redis)
                    .await
                    .unwrap();
                counts.1 == 2
            }
        },
    )
    .await;

    // Kill right after a renewal has been seen, so the whole lease must run out.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut previous = hold(&mut redis).await.1;
    loop {
        let (_, pttl) = hold(&mut redis).await;
        if pttl > previous {
            break;
        }
        previous = pttl;
        assert!(
            Instant::now() < deadline,
            "the victim's watchdog never renewed"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    victim.kill();
    assert_eq!(
        victim.child.wait().expect("reap the victim").signal(),
        Some(libc::SIGKILL)
    );
    // The end of the lease on the database's clock: read that clock first, then the lease
    // left, so the estimate is never later than the real end (a renewal sent just before
    // the kill may still land: it is read after the process is gone).
    let now_us = db_clock_us(&pool).await;
    let (holders, pttl) = hold(&mut redis).await;
    assert_eq!(
        holders, victim_holds,
        "the victim's hold before its lease ends"
    );
    let lease_end_us = now_us + pttl * 1000;

    succeeded(others, Duration::from_secs(120)).await;
    assert!(
        pttl <= lease.as_millis() as i64,
        "{pttl} ms of a {lease:?} lease left"
    );
    println!("SIGKILL with {pttl} ms of the lease left");
    the_kill_cost_nothing(&pool, NAME, lease_end_us, (victim.id(), &other_pids), ITERS).await;
    assert!(
        hold(&mut redis).await.0.is_empty(),
        "the lock was left behind"
    );
    pool.close().await;
}

/// Three `hammer` processes of two tasks each on one lock of a three-master Redis
/// Cluster, its slot moved to another master and back, key by key, while they run:
/// the counter comes out exact, every value written once, every process did all of its
/// increments, no lock call failed (a `hammer` exits 1 on any), and nothing is left on
/// any node.
///
/// Few increments land while the slot is between masters (4 to 8 in a move of about
/// 1.1 s, against about 200 a second between the moves): a release that runs on the
/// target (the lock missing from the source) publishes its wake-up there with
/// `SPUBLISH`, and the waiters, subscribed on the source, which serves the slot's
/// channels until the move ends, do not hear it. They go on by their own re-checks.
/// (`INFO commandstats` in one run: 4 of the 7 releases of a move published on the
/// target.)
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hammer_processes_on_a_cluster_keep_the_count_exact_through_a_slot_move() {
    use crate::postgres_processes::{counter, writes};
    use common::redis_server::RedisCluster;

    const ITERS: u64 = 200;
    const TASKS: u64 = 2;
    const NAME: &str = "{moving-hammer}";
    let _serial = ONE_AT_A_TIME.lock().await;
    let cluster = RedisCluster::start(3).await;
    let db = PgDatabase::create().await;
    let pool = db.pool(2).await;
    let urls = cluster.urls().join(",");
    let (iters, tasks) = (ITERS.to_string(), TASKS.to_string());
    let hammers: Vec<Hammer> = (0..3)
        .map(|_| {
            Hammer::spawn(&[
                "--cluster",
                "--url",
                &urls,
                "--counter-url",
                &db.url,
                "--name",
                NAME,
                "--iters",
                &iters,
                "--tasks",
                &tasks,
                "--counter-key",
                NAME,
                // A wake-up lost in the move costs a waiter a lease at most.
                "--watchdog-ms",
                "3000",
            ])
        })
        .collect();
    let pids: Vec<u32> = hammers.iter().map(Hammer::id).collect();
    let total = 3 * TASKS * ITERS;
    let progress = |at_least: u64| {
        let pool = pool.clone();
        async move {
            wait_until(
                Duration::from_secs(60),
                &format!("the counter reaches {at_least}"),
                || {
                    let pool = pool.clone();
                    async move {
                        // The hammers make the counter's table once they run.
                        let made: Option<String> =
                            sqlx::query_scalar("SELECT to_regclass('hammer_counter')::text")
                                .fetch_one(&pool)
                                .await
                                .unwrap();
                        made.is_some() && counter(&pool, NAME).await >= at_least as i64
                    }
                },
            )
            .await;
        }
    };
    progress(total / 6).await;
    let slot = cluster.slot_of(NAME).await;
    // Keys beside the lock in its slot, so that a move, a key at a time, lasts a second
    // or so (the lock's key moves somewhere among them).
    let mut raw = redis::cluster::ClusterClient::new(cluster.urls())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    for i in 0..50 {
        let () = redis::cmd("SET")
            .arg(format!("{NAME}:filler:{i}"))
            .arg(i)
            .query_async(&mut raw)
            .await
            .unwrap();
    }
    let home = cluster.master_of(slot).await;
    let away = cluster.another_master(home).await;
    let (before, started) = (counter(&pool, NAME).await, Instant::now());
    cluster
        .migrate_slot(slot, away, 1, Duration::from_millis(20))
        .await;
    let (moved_at, moved) = (counter(&pool, NAME).await, Instant::now());
    println!(
        "{} increments while the slot moved away, in {:?}",
        moved_at - before,
        moved - started
    );
    progress((moved_at as u64 + total / 6).min(total)).await;
    let (before, started) = (counter(&pool, NAME).await, Instant::now());
    println!(
        "{} increments between the moves, in {:?}",
        before - moved_at,
        started - moved
    );
    cluster
        .migrate_slot(slot, home, 1, Duration::from_millis(20))
        .await;
    println!(
        "{} increments while the slot moved back, in {:?}",
        counter(&pool, NAME).await - before,
        started.elapsed()
    );
    succeeded(hammers, Duration::from_secs(120)).await;
    let counter = counter(&pool, NAME).await;
    let writes = writes(&pool, NAME).await;
    println!(
        "three hammers of {TASKS} tasks through a slot move there and back: counter \
         {counter}, {} writes",
        writes.count
    );
    assert_eq!(counter, total as i64, "lost or extra updates");
    writes.assert_each_value_once(total);
    for pid in pids {
        assert_eq!(writes.by(pid), (TASKS * ITERS) as i64, "process {pid}");
    }
    for node in &cluster.nodes {
        let mut left = node.keys("*moving-hammer*").await;
        left.retain(|k| !k.contains(":filler:"));
        assert!(left.is_empty(), "left on {}: {left:?}", node.port());
    }
    pool.close().await;
}
