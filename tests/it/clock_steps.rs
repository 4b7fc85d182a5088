//! A store's clock that steps (issue 44, finding 1): every attempt carries a deadline
//! on the store's clock, computed from a sample of it; a step made every attempt look
//! late, and each was refused until the sample aged out (up to 30 s). Now a refusal
//! brings the store's clock, and the attempt goes again at once with a deadline on it.
//! The servers run under a clock shim ([`common::clock`]) the tests step.

use crate::common;

use std::time::Duration;

use common::clock::ClockShift;
use common::redis_server::RedisServer;
use tokio::time::Instant;
use tower_lock::{Lease, LockClient, RedisBackend};

/// A lock cycle right after each step of the server's clock: a single try (plain, fair,
/// read-write and permits: each has its own script), then a wait of 3 s. Before, a 5 s
/// forward step failed the single tries as outages and the wait after 3.00 s, 5 runs of
/// 5; now each goes through at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_step_of_the_redis_clock_costs_one_round_trip() {
    let clock = ClockShift::new();
    let server = RedisServer::start_with_env(&[], clock.env()).await;
    let client = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let plain = client.get_lock("stepped").unwrap();
    plain.try_lock().await.unwrap().unlock().await.unwrap();

    for (step, ahead) in [5u64, 10, 15].into_iter().enumerate() {
        clock.ahead(Duration::from_secs(ahead));
        let started = Instant::now();
        let guard = match step {
            0 => plain.try_lock().await,
            1 => {
                client
                    .get_fair_lock("stepped:fair")
                    .unwrap()
                    .try_lock()
                    .await
            }
            _ => {
                client
                    .get_read_write_lock("stepped:rw")
                    .unwrap()
                    .write_lock()
                    .try_lock()
                    .await
            }
        };
        let guard = guard.unwrap_or_else(|e| panic!("a single try {ahead} s ahead: {e}"));
        guard.unlock().await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "{:?}",
            started.elapsed()
        );
    }
    clock.ahead(Duration::from_secs(20));
    let started = Instant::now();
    let permits = client.get_permits("stepped:permits", 2).unwrap();
    permits.try_lock().await.unwrap().unlock().await.unwrap();
    clock.ahead(Duration::from_secs(25));
    plain
        .try_lock_for(Duration::from_secs(3), Lease::Watchdog)
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
}

/// A step back makes the sample's deadlines late by the step until it is taken again:
/// nothing is refused, and locks go on as before (what it costs in safety, an attempt
/// given up that can land for as long as the step, is in `backend::clock`'s docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backward_step_of_the_redis_clock_costs_no_lock_call() {
    let clock = ClockShift::new();
    let server = RedisServer::start_with_env(&[], clock.env()).await;
    let client = LockClient::new(RedisBackend::connect(server.url()).await.unwrap());
    let lock = client.get_lock("stepped-back").unwrap();
    lock.try_lock().await.unwrap().unlock().await.unwrap();
    clock.behind(Duration::from_secs(5));
    for _ in 0..3 {
        lock.try_lock().await.unwrap().unlock().await.unwrap();
    }
}

/// On PostgreSQL a refusal as late forgets the sample, and the attempt goes again at
/// once on a new one: a 5 s forward step of the database's clock costs one try's
/// round trips, not its wait.
#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forward_step_of_the_postgres_clock_costs_one_round_trip() {
    use common::postgres::PgServer;
    let clock = ClockShift::new();
    let env = clock.env();
    let Some(server) = tokio::task::spawn_blocking(move || PgServer::start_with_env(env))
        .await
        .unwrap()
    else {
        eprintln!("skipped: no PostgreSQL server binaries (.ci/run installs them)");
        return;
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&server.url())
        .await
        .unwrap();
    let backend = tower_lock::PostgresBackend::builder(pool)
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    let lock = client.get_lock("stepped").unwrap();
    lock.try_lock().await.unwrap().unlock().await.unwrap();
    clock.ahead(Duration::from_secs(5));
    let started = Instant::now();
    lock.try_lock()
        .await
        .expect("a single try after the step")
        .unlock()
        .await
        .unwrap();
    lock.try_lock_for(Duration::from_secs(3), Lease::Watchdog)
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    drop(server);
}

/// On a Redis Cluster each master's clock has its sample: the deadlines sent to a
/// master are on its own clock, though another master's is 5 s ahead. With one sample
/// for all, an attempt sent to the masters in step after a sample of the one ahead
/// carried a deadline 5 s late, which a given-up attempt could land within. The
/// deadlines are read back from each master's slow log (every command logged).
#[cfg(feature = "cluster")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_cluster_master_gets_deadlines_on_its_own_clock() {
    use common::redis_server::RedisCluster;
    let clocks: Vec<ClockShift> = (0..3).map(|_| ClockShift::new()).collect();
    clocks[1].ahead(Duration::from_secs(5));
    let env: Vec<_> = clocks.iter().map(ClockShift::env).collect();
    let cluster = RedisCluster::start_with_env(3, &env).await;
    for node in &cluster.nodes {
        let mut conn = node.conn().await;
        for (name, value) in [
            ("slowlog-log-slower-than", "0"),
            ("slowlog-max-len", "10000"),
        ] {
            let () = redis::cmd("CONFIG")
                .arg("SET")
                .arg(name)
                .arg(value)
                .query_async(&mut conn)
                .await
                .unwrap();
        }
    }
    let backend = RedisBackend::cluster(cluster.urls()).build().await.unwrap();
    let client = LockClient::new(backend);
    // Keys over every master, in turns, so that each attempt follows one on another
    // master.
    for round in 0..5 {
        for i in 0..30 {
            let lock = client.get_lock(format!("skewed:{i}")).unwrap();
            lock.try_lock().await.unwrap().unlock().await.unwrap();
        }
        let _ = round;
    }
    let mut checked = 0;
    for node in &cluster.nodes {
        let mut conn = node.conn().await;
        let log: Vec<redis::Value> = redis::cmd("SLOWLOG")
            .arg("GET")
            .arg("10000")
            .query_async(&mut conn)
            .await
            .unwrap();
        for entry in log {
            let redis::Value::Array(fields) = entry else {
                continue;
            };
            let (Some(redis::Value::Int(at_s)), Some(redis::Value::Array(args))) =
                (fields.get(1), fields.get(3))
            else {
                continue;
            };
            // A deadline is the one argument that reads as a time in microseconds.
            for arg in args {
                let redis::Value::BulkString(arg) = arg else {
                    continue;
                };
                let Ok(us) = std::str::from_utf8(arg).unwrap_or("").parse::<i64>() else {
                    continue;
                };
                if us < 1_000_000_000_000_000 {
                    continue;
                }
                let ahead = us - at_s * 1_000_000;
                assert!(
                    (-1_000_000..=3_000_000).contains(&ahead),
                    "a deadline {ahead} µs from the clock of the master on port {}",
                    node.port()
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 100, "{checked} deadlines found in the slow logs");
}

/// Behind Sentinel, a failover to a replica whose clock is 5 s ahead: the samples of
/// the old primary's clock made every attempt on the new one look late, and a caller
/// with 8 s to wait failed after 8.00 s (3 of 3). Now the first refusal brings the new
/// primary's clock.
#[cfg(feature = "sentinel")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failover_to_a_primary_whose_clock_is_ahead_costs_one_round_trip() {
    use common::sentinel::SentinelSet;
    let clocks: Vec<ClockShift> = (0..2).map(|_| ClockShift::new()).collect();
    clocks[1].ahead(Duration::from_secs(5));
    let env: Vec<_> = clocks.iter().map(ClockShift::env).collect();
    let mut set = SentinelSet::start_with_env(1, 3, &env).await;
    let backend = RedisBackend::sentinel(common::sentinel::MASTER, set.sentinel_urls())
        .response_timeout(Duration::from_millis(600))
        .connection_timeout(Duration::from_millis(600))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    let lock = client.get_lock("failover-clock").unwrap();
    lock.try_lock().await.unwrap().unlock().await.unwrap();
    let old = set.primary_port().await;
    set.node(old).kill();
    let new = set.wait_for_new_primary(old, Duration::from_secs(30)).await;
    let promoted = Instant::now();
    lock.try_lock_for(Duration::from_secs(8), Lease::Watchdog)
        .await
        .expect("the lock on the new primary")
        .unlock()
        .await
        .unwrap();
    assert!(
        promoted.elapsed() < Duration::from_secs(3),
        "{:?} after the promotion of {new}",
        promoted.elapsed()
    );
}

/// Issue 49, finding 1: every fencing counter lived forever. It now expires a token
/// retention after its last token, and tokens still never go backwards: they are at
/// least the server clock in microseconds, the counter outlives its last token by the
/// retention, and the same clock runs its expiry. Shown across the counter's expiry,
/// and a step of the clock back by less than the retention after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fencing_tokens_keep_increasing_past_their_counters_expiry() {
    let clock = ClockShift::new();
    let server = RedisServer::start_with_env(&[], clock.env()).await;
    let backend = RedisBackend::builder(server.url())
        .token_retention(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let lock = client.get_fenced_lock("fenced").unwrap();
    let key = tower_lock::LockKey::new("fenced").unwrap();
    let counter = backend.fence_name(&key);
    let mut conn = server.conn().await;

    let mut last = 0u64;
    let token = async || {
        let guard = lock.try_lock().await.unwrap();
        let token = guard.fencing_token().unwrap().get();
        guard.unlock().await.unwrap();
        token
    };
    for step in 0..4 {
        let next = token().await;
        assert!(next > last, "step {step}: {next} after {last}");
        last = next;
        let ttl: i64 = redis::cmd("PTTL")
            .arg(&counter)
            .query_async(&mut conn)
            .await
            .unwrap();
        // A retention after the clock reaches the token: just that while tokens are
        // the clock, more while the clock is behind them (after a step back).
        assert!(
            ttl >= 9_000 && (step != 0 || ttl <= 10_100),
            "step {step}: the counter expires a retention after its token ({ttl} ms)"
        );
        match step {
            // Past the counter's expiry: it is gone, and the next starts from the clock.
            0 => clock.ahead(Duration::from_secs(11)),
            // Back by less than the retention, after that.
            1 => clock.ahead(Duration::from_secs(2)),
            _ => clock.ahead(Duration::from_secs(25)),
        }
        if step == 2 {
            let exists: bool = redis::cmd("EXISTS")
                .arg(&counter)
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(!exists, "the counter expired");
        }
    }
}
