//! Separate processes on one Redis server: a `hammer` SIGKILLed while it holds the lock
//! (in the middle of its read-modify-write) leaves the lock to the others only when its
//! watchdog lease ends on the server, and without its unfinished increment. The
//! counter lives in PostgreSQL, whose `hammer_counter_writes` says which process wrote
//! which value and when (see `postgres_processes.rs`, which runs the same on PostgreSQL
//! locks and whose helpers this uses).

use crate::common;

use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::time::Duration;

use common::postgres::PgDatabase;
use common::redis_server::RedisServer;
use common::wait_until;
use tokio::time::Instant;

use crate::postgres_processes::{
    Hammer, ONE_AT_A_TIME, activity, counter, db_clock_us, outputs, writes,
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

    for out in outputs(others, Duration::from_secs(120)).await {
        assert!(
            out.status.success(),
            "hammer failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let counter = counter(&pool, NAME).await;
    let writes = writes(&pool, NAME).await;
    let first_after_end = writes.first_at_us - lease_end_us;
    println!(
        "SIGKILL with {pttl} ms of the lease left; first write {:.1} ms after the lease \
         ended; counter {counter}, {} writes",
        first_after_end as f64 / 1000.0,
        writes.count
    );
    // Nobody got in before the lease ended, and the waiters got in soon after.
    assert!(
        first_after_end >= 0,
        "a write {} µs before the killed holder's lease ended",
        -first_after_end
    );
    assert!(
        first_after_end <= 300_000,
        "the first write came {first_after_end} µs after the lease ended"
    );
    assert!(
        pttl <= lease.as_millis() as i64,
        "{pttl} ms of a {lease:?} lease left"
    );
    // Exact, and without the victim's unfinished increment: it read 0 and never wrote 1.
    assert_eq!(
        counter,
        2 * ITERS as i64,
        "lost or extra updates around the kill"
    );
    writes.assert_each_value_once(2 * ITERS);
    assert_eq!(writes.by(victim.id()), 0, "the killed process wrote");
    for pid in other_pids {
        assert_eq!(writes.by(pid), ITERS as i64, "process {pid}");
    }
    assert!(
        hold(&mut redis).await.0.is_empty(),
        "the lock was left behind"
    );
    pool.close().await;
}
