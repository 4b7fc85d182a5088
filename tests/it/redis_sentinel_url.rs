//! `redis+sentinel://` URLs against a real primary, replica and two Sentinels:
//! `RedisBackend::from_url` and the `hammer` example, which reads its `--url` with it.

use crate::common;

use std::process::{Command, Stdio};

use common::sentinel::{MASTER, SentinelSet};
use tower_lock::{LockClient, RedisBackend, StoreErrorKind};

/// The URL of `set`'s primary, in database `db`.
fn sentinel_url(set: &SentinelSet, db: u8) -> String {
    let hosts: Vec<String> = set
        .sentinels
        .iter()
        .map(|s| format!("127.0.0.1:{}", s.port()))
        .collect();
    format!("redis+sentinel://{}/{MASTER}/{db}", hosts.join(","))
}

/// `GET`-style `cmd` on database `db` of the primary the Sentinels name.
async fn on_primary<T: redis::FromRedisValue>(set: &SentinelSet, db: u8, cmd: &redis::Cmd) -> T {
    let port = set.primary_port().await;
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}/{db}")).unwrap();
    let mut conn = client.get_multiplexed_async_connection().await.unwrap();
    cmd.query_async(&mut conn).await.unwrap()
}

/// A backend from a Sentinel URL takes its locks on the primary the Sentinels name, in
/// the URL's database, with replica acknowledgement as `RedisBackend::sentinel` has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_from_a_sentinel_url_locks_on_the_primary() {
    let set = SentinelSet::start(1, 2).await;
    let backend = RedisBackend::from_url(&sentinel_url(&set, 3))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend);
    let guard = client
        .get_lock("url:key")
        .unwrap()
        .try_lock()
        .await
        .unwrap();
    let in_db3: i64 = on_primary(&set, 3, redis::cmd("EXISTS").arg("url:key")).await;
    let in_db0: i64 = on_primary(&set, 0, redis::cmd("EXISTS").arg("url:key")).await;
    assert_eq!((in_db3, in_db0), (1, 0), "the hold is in database 3 only");
    guard.unlock().await.unwrap();
}

/// A bad Sentinel URL fails at `build` as a misconfiguration that says what is wrong.
#[tokio::test]
async fn a_sentinel_url_without_a_master_is_refused_at_build() {
    let err = RedisBackend::from_url("redis+sentinel://:pw@127.0.0.1:26379")
        .build()
        .await
        .expect_err("no master name");
    assert_eq!(err.store_kind(), Some(StoreErrorKind::Misconfigured));
    let message = err.to_string();
    assert!(message.contains("names no master"), "{message}");
    assert!(!message.contains("pw@"), "{message}");
}

/// Two `hammer` processes on one Sentinel URL: the locks and the counter go to the
/// primary the Sentinels name, and the counter comes out exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hammers_on_a_sentinel_url_keep_the_counter_exact() {
    const PROCESSES: u64 = 2;
    const TASKS: u64 = 3;
    const ITERS: u64 = 100;
    let set = SentinelSet::start(1, 2).await;
    let url = sentinel_url(&set, 2);
    let hammer = common::example_binary("hammer");
    let children: Vec<_> = (0..PROCESSES)
        .map(|_| {
            Command::new(&hammer)
                .args(["--url", &url, "--name", "url-hammer"])
                .args(["--iters", &ITERS.to_string(), "--tasks", &TASKS.to_string()])
                .args(["--counter-key", "url-hammer:counter"])
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn hammer")
        })
        .collect();
    let outputs = tokio::task::spawn_blocking(move || {
        children
            .into_iter()
            .map(|c| c.wait_with_output().expect("the hammer ran"))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap();
    for output in outputs {
        assert!(
            output.status.success(),
            "hammer failed: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let counter: u64 = on_primary(&set, 2, redis::cmd("GET").arg("url-hammer:counter")).await;
    assert_eq!(counter, PROCESSES * TASKS * ITERS);
}

/// The `seckill` demo with `REDIS_URL` a Sentinel URL: locks and store on the primary
/// the Sentinels name, and every invariant holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_seckill_demo_on_a_sentinel_url_keeps_the_invariants() {
    let set = SentinelSet::start(1, 2).await;
    let seckill = common::example_binary("seckill");
    let child = Command::new(&seckill)
        .env("REDIS_URL", sentinel_url(&set, 1))
        .args(["--demo", "--users", "40", "--per-user", "3"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn seckill");
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .expect("seckill ran");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "seckill failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains(&format!("primary {MASTER}")), "{stdout}");
    assert!(stdout.contains("all invariants held"), "{stdout}");
    let orders: Vec<String> = on_primary(&set, 1, redis::cmd("KEYS").arg("seckill:*")).await;
    assert!(
        !orders.is_empty(),
        "the store wrote to database 1 of the primary"
    );
}
