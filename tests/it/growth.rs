//! Nothing a client sends grows the store without bound (issue 49): 10,000 distinct
//! keys of each kind (plain locks, fenced locks, idempotency records), then their
//! lifetimes pass, and the store is back where it started. Each test owns its store.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use futures_util::StreamExt;
use http::Request;
use http_body_util::Full;
use tower::{Layer, ServiceExt, service_fn};
use tower_lock::layer::HeaderKey;
use tower_lock::{IdempotencyLayer, Lease, LockClient, LockKey};

/// Distinct keys of each kind.
const KEYS: usize = 10_000;
/// How many at once.
const AT_ONCE: usize = 64;
/// The keys are free: a lock call returns at once, and waits only to ride out a store
/// answer slower than its response timeout on a loaded machine (this test is about
/// what stays in the store, not latency).
const RIDE_OUT: Duration = Duration::from_secs(10);

/// Takes `lock` and releases it.
async fn cycle(lock: tower_lock::Lock) {
    let guard = lock.try_lock_for(RIDE_OUT, Lease::Watchdog).await.unwrap();
    guard.unlock().await.unwrap();
}

/// The three kinds of keys, `KEYS` each: a plain lock, a fenced lock, and a request
/// through an idempotency layer whose records live `ttl`, spread over 100 callers.
async fn every_kind(client: &LockClient, ttl: Duration, round: &str) {
    let plain = futures_util::stream::iter(0..KEYS).for_each_concurrent(AT_ONCE, |i| async move {
        cycle(client.get_lock(format!("{round}:plain:{i}")).unwrap()).await;
    });
    plain.await;
    let fenced = futures_util::stream::iter(0..KEYS).for_each_concurrent(AT_ONCE, |i| async move {
        cycle(
            client
                .get_fenced_lock(format!("{round}:fenced:{i}"))
                .unwrap(),
        )
        .await;
    });
    fenced.await;
    let layer = IdempotencyLayer::builder(
        client.clone(),
        HeaderKey::new(http::header::HeaderName::from_static("x-user-id")),
    )
    .ttl(ttl)
    .build()
    .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from_static(
            b"{\"order\":42}",
        ))))
    }));
    let began = std::time::Instant::now();
    let requests = futures_util::stream::iter(0..KEYS).for_each_concurrent(AT_ONCE, |i| {
        let svc = svc.clone();
        let round = round.to_owned();
        async move {
            let req = Request::post("/orders")
                .header("x-user-id", (i % 100).to_string())
                .header("idempotency-key", format!("{round}-key-{i}"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            let res = svc.oneshot(req).await.unwrap();
            let status = res.status();
            if status != http::StatusCode::OK {
                let body = http_body_util::BodyExt::collect(res.into_body()).await;
                let body = body.map(|b| b.to_bytes()).unwrap_or_default();
                panic!("request {i}: {status} {}", String::from_utf8_lossy(&body));
            }
        }
    });
    requests.await;
    eprintln!(
        "{round}: {KEYS} new idempotency keys in {:.1} s",
        began.elapsed().as_secs_f64()
    );
}

#[cfg(feature = "redis")]
mod redis_store {
    use super::*;
    use common::redis_server::RedisServer;
    use tower_lock::RedisBackend;

    async fn info(conn: &mut redis::aio::MultiplexedConnection, field: &str) -> i64 {
        let info: String = redis::cmd("INFO")
            .arg("memory")
            .query_async(conn)
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .and_then(|v| v.trim().parse().ok())
            .unwrap()
    }

    async fn dbsize(conn: &mut redis::aio::MultiplexedConnection) -> i64 {
        redis::cmd("DBSIZE").query_async(conn).await.unwrap()
    }

    /// Keys that would live for good: no expiry (`PTTL` -1).
    async fn without_expiry(conn: &mut redis::aio::MultiplexedConnection) -> Vec<String> {
        let keys: Vec<String> = redis::cmd("KEYS").arg("*").query_async(conn).await.unwrap();
        let mut forever = Vec::new();
        for key in keys {
            let ttl: i64 = redis::cmd("PTTL")
                .arg(&key)
                .query_async(conn)
                .await
                .unwrap();
            if ttl == -1 {
                forever.push(key);
            }
        }
        forever
    }

    /// Issue 49, finding 1: every fenced name left a counter without expiry (10,000
    /// users: 1.67 MB for good). Now every key has an expiry, and once the token
    /// retention and the records' TTL have passed the server holds no key, and its
    /// memory is back to where it started.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_thousand_keys_of_each_kind_leave_nothing_behind() {
        let server = RedisServer::start().await;
        let mut conn = server.conn().await;
        let backend = RedisBackend::builder(server.url())
            .token_retention(Duration::from_secs(8))
            .build()
            .await
            .unwrap();
        let client = LockClient::new(backend);
        // A first round, and its keys gone, before the baseline: the scripts are loaded,
        // and the server's hash tables have grown to hold that many keys (it gives their
        // room back only in steps of its own); what a second round leaves is growth.
        every_kind(&client, Duration::from_secs(8), "first").await;
        let all_expired = || async {
            let mut conn = server.conn().await;
            // KEYS expires every key it meets that is past its time.
            let _: Vec<String> = redis::cmd("KEYS")
                .arg("*")
                .query_async(&mut conn)
                .await
                .unwrap();
            dbsize(&mut conn).await == 0
        };
        common::wait_until(
            Duration::from_secs(10),
            "the first round expired",
            all_expired,
        )
        .await;
        let before = info(&mut conn, "used_memory").await;

        every_kind(&client, Duration::from_secs(8), "second").await;
        let keys = dbsize(&mut conn).await;
        let peak = info(&mut conn, "used_memory").await;
        let forever = without_expiry(&mut conn).await;
        assert!(
            forever.is_empty(),
            "{} keys without expiry: {:?}",
            forever.len(),
            &forever[..forever.len().min(5)]
        );

        common::wait_until(Duration::from_secs(30), "every key expired", all_expired).await;
        let after = info(&mut conn, "used_memory").await;
        eprintln!("redis: {before} bytes before, {peak} at the peak ({keys} keys), {after} after");
        assert!(
            after - before < 256 * 1024,
            "{} bytes more than before",
            after - before
        );
    }

    /// A server out of memory (`maxmemory`, `noeviction`) that a flood of new names
    /// filled: lock calls fail as an outage (a layer answers 503, or fails open), a new
    /// backend still starts, and once the names' retention has passed the locks work
    /// again, with nothing done by hand. Before, the counters never expired, and the
    /// server stayed full for good.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_server_filled_by_new_names_refuses_for_a_while_then_recovers() {
        let server = RedisServer::start().await;
        let mut conn = server.conn().await;
        let used = info(&mut conn, "used_memory").await;
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory")
            .arg((used + 512 * 1024).to_string())
            .query_async(&mut conn)
            .await
            .unwrap();
        let () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("maxmemory-policy")
            .arg("noeviction")
            .query_async(&mut conn)
            .await
            .unwrap();
        let backend = RedisBackend::builder(server.url())
            .token_retention(Duration::from_secs(2))
            .build()
            .await
            .unwrap();
        let client = LockClient::new(backend);
        let mut refused = None;
        for i in 0..100_000 {
            let lock = client.get_fenced_lock(format!("flood:{i}")).unwrap();
            match lock.try_lock().await {
                Ok(guard) => guard.unlock().await.unwrap(),
                Err(error) => {
                    refused = Some((i, error));
                    break;
                }
            }
        }
        let (names, error) = refused.expect("the server filled up");
        assert!(
            error.is_unavailable(),
            "an outage, not a misconfiguration: {error}"
        );
        eprintln!("full after {names} names: {error}");

        let fresh = RedisBackend::builder(server.url()).build().await;
        assert!(
            fresh.is_ok(),
            "a new backend starts on a full server: {:?}",
            fresh.err()
        );

        let lock = client.get_fenced_lock("after-the-flood").unwrap();
        common::wait_until(Duration::from_secs(20), "locks work again", || async {
            match lock.try_lock().await {
                Ok(guard) => guard.unlock().await.is_ok(),
                Err(_) => false,
            }
        })
        .await;
    }
}

#[cfg(feature = "postgres")]
mod postgres_store {
    use super::*;
    use common::postgres::PgDatabase;
    use tower_lock::PostgresBackend;

    /// The rows of the backend's tables.
    async fn rows(pool: &sqlx::PgPool) -> i64 {
        let mut total = 0;
        for table in [
            "tower_lock",
            "tower_lock_names",
            "tower_lock_queue",
            "tower_lock_waiters",
            "tower_lock_gone",
            "tower_lock_clients",
            "tower_lock_replay",
        ] {
            let n: i64 = sqlx::query_scalar(&format!("SELECT count(*) FROM {table}"))
                .fetch_one(pool)
                .await
                .unwrap();
            total += n;
        }
        total
    }

    /// Issue 49, finding 2: only a named client's registration swept, and an unnamed
    /// client (`LockClient::new`, `LockLayer::new`) never did: every distinct name kept
    /// its row for good. Now the backend sweeps on a schedule, in bounded steps, and
    /// every row is gone once the token retention and the records' TTL have passed.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn ten_thousand_keys_of_each_kind_leave_no_row_behind() {
        let db = PgDatabase::create().await;
        let pool = db.pool(8).await;
        // A response timeout for a loaded machine: every request must be served.
        let backend = PostgresBackend::builder(pool.clone())
            .token_retention(Duration::from_secs(1))
            .response_timeout(Duration::from_secs(10))
            .build()
            .await
            .unwrap();
        let client = LockClient::new(backend);
        assert_eq!(rows(&pool).await, 0);
        every_kind(&client, Duration::from_secs(2), "pg").await;
        let peak = rows(&pool).await;
        common::wait_until(Duration::from_secs(60), "every row swept", || async {
            rows(&pool).await == 0
        })
        .await;
        // The sweep runs meanwhile: the peak is what was left when the run ended.
        eprintln!("postgres: {peak} rows at the end of the run, none after");
        assert!(peak > 0, "the run left rows to sweep");
    }
}

/// In memory: the map of locks and the records are dropped once they expire.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_keys_of_each_kind_leave_nothing_in_memory() {
    let backend = tower_lock::MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    every_kind(&client, Duration::from_millis(500), "memory").await;
    common::wait_until(Duration::from_secs(5), "every record dropped", || async {
        backend.is_empty() && backend.records() == 0
    })
    .await;
    let _ = LockKey::new("unused");
}

/// Everyone's quota of stored responses in parts (one per 4,096 records): the layer
/// never keeps more than `max_records`, nearly that many before its first `503`, and
/// both parts fill. With one name for everyone's quota, every new key of every caller
/// queued on it (on PostgreSQL some waited past their turn and were answered 503 far
/// below the cap).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn everyones_quota_in_parts_keeps_at_most_max_records() {
    const MAX: u32 = 8_192;
    const SENT: usize = 9_000;
    let backend = tower_lock::MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let layer = IdempotencyLayer::builder(
        client.clone(),
        HeaderKey::new(http::header::HeaderName::from_static("x-user-id")),
    )
    .max_records(MAX)
    .build()
    .unwrap();
    let svc = layer.layer(service_fn(|_req: Request<Full<Bytes>>| async {
        Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::from_static(b"{}"))))
    }));
    let statuses = futures_util::stream::iter(0..SENT)
        .map(|i| {
            let svc = svc.clone();
            async move {
                let req = Request::post("/orders")
                    .header("x-user-id", (i % 10).to_string())
                    .header("idempotency-key", format!("key-{i}"))
                    .body(Full::new(Bytes::new()))
                    .unwrap();
                svc.oneshot(req).await.unwrap().status()
            }
        })
        .buffer_unordered(AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    let stored = statuses
        .iter()
        .filter(|s| **s == http::StatusCode::OK)
        .count();
    let full = statuses
        .iter()
        .filter(|s| **s == http::StatusCode::SERVICE_UNAVAILABLE)
        .count();
    eprintln!("{stored} stored of {SENT} sent, {full} answered 503; at most {MAX}");
    assert_eq!(stored + full, SENT, "only stored or refused as full");
    assert!(stored <= MAX as usize, "{stored} stored, over {MAX}");
    assert!(stored >= MAX as usize * 97 / 100, "only {stored} stored");
    let parts: std::collections::BTreeSet<String> = backend
        .keys()
        .iter()
        .filter(|k| k.namespace().ends_with("quota-total"))
        .map(|k| k.as_str().to_owned())
        .collect();
    assert_eq!(parts.len(), 2, "{parts:?}");
}
