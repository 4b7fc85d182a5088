//! `redact_keys(true)` holds everywhere: with every span and event of this crate
//! recorded at TRACE level, through acquisition, waiting on Redis pub/sub, loss, a failed
//! release and the layer, the user part of a key never shows up.

use crate::common;

use std::time::Duration;

use bytes::Bytes;
use common::log::Captured;
use common::redis_server::RedisServer;
use http::Request;
use http_body_util::Full;
use tower::{Layer, ServiceExt, service_fn};
use tower_lock::layer::{HeaderKey, LockLayer};
use tower_lock::{Error, LockClient, LockKey, RedisBackend};
use tracing_subscriber::fmt::format::FmtSpan;

const SECRET: &str = "alice@example.com";

#[test]
fn redacted_keys_never_reach_spans_or_events() {
    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_span_events(FmtSpan::NEW | FmtSpan::CLOSE)
        .with_ansi(false)
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .finish();
    crate::common::log_capture_sees_every_callsite();
    let _default = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let server = RedisServer::start().await;
        let backend = RedisBackend::connect(server.url()).await.unwrap();
        let client = LockClient::builder(backend)
            .name("replica-1")
            .redact_keys(true)
            .watchdog_lease(Duration::from_millis(300))
            .build()
            .unwrap();
        let key = LockKey::namespaced("lock:user", SECRET).unwrap();
        let lock = client.get_fenced_lock(&key).unwrap();

        // Held, waited for over pub/sub, handed over.
        let first = lock.lock().await.unwrap();
        let waiter = tokio::spawn({
            let lock = lock.clone();
            async move {
                lock.try_lock_for(Duration::from_secs(5), Duration::from_secs(5))
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        first.unlock().await.unwrap();
        let second = waiter.await.unwrap().unwrap();
        second.unlock().await.unwrap();

        // Lost behind a watched holder's back: the watchdog logs the loss.
        let watched = lock.lock().await.unwrap();
        assert!(lock.force_unlock().await.unwrap());
        tokio::time::timeout(Duration::from_secs(5), watched.lost().wait())
            .await
            .unwrap();
        assert!(matches!(watched.unlock().await, Err(Error::Lost)));

        // The layer: a busy request, then one whose release fails (the store is gone).
        let layer = LockLayer::builder(
            client.clone(),
            HeaderKey::new(http::HeaderName::from_static("x-user"))
                .namespace("lock:user")
                .unwrap(),
        )
        .max_wait(Duration::from_millis(20))
        .build()
        .unwrap();
        let svc = layer.layer(service_fn(|_: Request<Full<Bytes>>| async {
            Ok::<_, std::convert::Infallible>(http::Response::new(Full::new(Bytes::new())))
        }));
        let request = || {
            Request::builder()
                .header("x-user", SECRET)
                .body(Full::new(Bytes::new()))
                .unwrap()
        };
        let held = lock.lock().await.unwrap();
        let busy = svc.clone().oneshot(request()).await.unwrap();
        assert_eq!(busy.status(), tower_lock::layer::DEFAULT_BUSY_STATUS);
        held.unlock().await.unwrap();
        // A guard dropped while the store is down: its release fails, and is logged.
        let dropped = lock.lock().await.unwrap();
        drop(server);
        drop(dropped);
        tokio::time::sleep(Duration::from_millis(1500)).await;
    });
    drop(rt);

    let text = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
    for expected in [
        "tower_lock.acquire",
        "tower_lock.hold",
        "tower_lock.layer",
        "lock lost",
        "release of a dropped guard failed",
        "namespace=\"lock:user\"",
        "decision=\"busy\"",
    ] {
        assert!(text.contains(expected), "no {expected:?} in:\n{text}");
    }
    let escaped = SECRET.replace('@', "%40");
    for (n, line) in text.lines().enumerate() {
        assert!(
            !line.contains("alice") && !line.contains(&escaped),
            "line {n} shows the key: {line}"
        );
    }
}

/// Issue 49, finding 4: no error a backend builds from a URL with a password repeats
/// the password, whatever is wrong with the URL or the server: unreachable, a port
/// that is not one, a `redis+sentinel://` URL whose password holds `/` and `:`.
#[tokio::test]
async fn no_error_built_from_a_url_repeats_its_password() {
    const SECRET: &str = "Zx81kQ9wSecret";
    let port = common::redis_server::free_port();
    let urls = [
        format!("redis://:{SECRET}@127.0.0.1:{port}/0"),
        format!("redis://app:{SECRET}@127.0.0.1:{port}"),
        format!("redis://app:{SECRET}@127.0.0.1:notaport"),
        format!("redis://app:{SECRET}@/0"),
        format!("rediss://app:{SECRET}@127.0.0.1:{port}"),
        format!("redis+sentinel://app:{SECRET}/x:y@127.0.0.1:{port}/mymaster"),
        format!("redis+sentinel://:{SECRET}:z@127.0.0.1:notaport/mymaster"),
        format!("redis+sentinel://:{SECRET}@/mymaster"),
        format!("http://app:{SECRET}@127.0.0.1:{port}"),
    ];
    for url in &urls {
        let built = RedisBackend::from_url(url)
            .connection_timeout(Duration::from_millis(200))
            .build()
            .await;
        let Err(error) = built else {
            panic!("{url}: built");
        };
        let shown = format!("{error} {error:?}");
        assert!(!shown.contains(SECRET), "{url}: {shown}");
    }
    #[cfg(feature = "postgres")]
    for url in [
        format!("postgres://app:{SECRET}@127.0.0.1:{port}/db"),
        format!("postgres://app:{SECRET}@127.0.0.1:notaport/db"),
    ] {
        let Err(error) = tower_lock::PostgresBackend::connect(&url).await else {
            panic!("{url}: built");
        };
        let shown = format!("{error} {error:?}");
        assert!(!shown.contains(SECRET), "{url}: {shown}");
    }
}

/// Issue 49, finding 5: the PostgreSQL backend logged the raw key when a waiter's
/// unregistering failed, though the client redacts keys (the backend never sees that
/// setting). It logs the hold now. A waiter registered for the hand-over gives up while
/// the database does not answer (its statements held in a proxy), at TRACE.
#[cfg(feature = "postgres")]
#[test]
fn a_postgres_waiter_that_cannot_unregister_logs_no_key() {
    use common::proxy::{Direction, FaultProxy, Flow};
    use tower_lock::PostgresBackend;

    let captured = Captured::default();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_ansi(false)
        .with_writer({
            let captured = captured.clone();
            move || captured.clone()
        })
        .finish();
    crate::common::log_capture_sees_every_callsite();
    let _default = tracing::subscriber::set_default(subscriber);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let db = common::postgres::PgDatabase::create().await;
        let proxy = FaultProxy::start(([127, 0, 0, 1], 5432).into()).await;
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(4)
            .connect(&db.url_through(proxy.port()))
            .await
            .unwrap();
        let backend = PostgresBackend::builder(pool)
            .hand_over(true)
            .response_timeout(Duration::from_millis(300))
            .build()
            .await
            .unwrap();
        let client = LockClient::builder(backend)
            .redact_keys(true)
            .build()
            .unwrap();
        let key = LockKey::namespaced("lock:user", SECRET).unwrap();
        let held = client.get_lock(&key).unwrap().lock().await.unwrap();
        let waiter = tokio::spawn({
            let lock = client.get_lock(&key).unwrap();
            async move {
                lock.try_lock_for(Duration::from_millis(600), Duration::from_secs(5))
                    .await
            }
        });
        common::wait_until(Duration::from_secs(5), "the waiter registered", || async {
            let pool = db.pool(1).await;
            let n: i64 = sqlx::query_scalar("SELECT count(*) FROM tower_lock_waiters")
                .fetch_one(&pool)
                .await
                .unwrap();
            n > 0
        })
        .await;
        proxy.set_flow(Direction::Up, Flow::Hold);
        assert!(waiter.await.unwrap().is_err());
        common::wait_until(
            Duration::from_secs(5),
            "the unregistering failed",
            || async {
                String::from_utf8_lossy(&captured.0.lock().unwrap()).contains("not unregistered")
            },
        )
        .await;
        proxy.set_flow(Direction::Up, Flow::Pass);
        drop(held);
    });
    drop(rt);
    let text = String::from_utf8_lossy(&captured.0.lock().unwrap()).into_owned();
    let escaped = SECRET.replace('@', "%40");
    for (n, line) in text.lines().enumerate() {
        assert!(
            !line.contains("alice") && !line.contains(&escaped),
            "line {n} shows the key: {line}"
        );
    }
}
