//! `LockLayer` behind a real socket: concurrent HTTP/1 and HTTP/2 clients, and clients
//! that hang up.

use crate::common;

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use bytes::Bytes;
use common::wait_until;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tower_lock::layer::{HeaderKey, LockLayer};
use tower_lock::{LockClient, LockKey, MemoryBackend};

#[cfg(feature = "redis")]
use common::redis_server::RedisServer;
#[cfg(feature = "redis")]
use tower_lock::RedisBackend;

/// What the handler saw.
#[derive(Default)]
struct Stats {
    /// Requests inside the handler, per key.
    inside: Mutex<HashMap<String, usize>>,
    /// Times a request entered while another of the same key was inside.
    overlaps: AtomicUsize,
    /// Ids of requests that entered the handler.
    entered: Mutex<HashSet<u64>>,
    completed: AtomicUsize,
}

/// Leaves the handler's "inside" count even when the handler is cancelled.
struct Inside {
    stats: Arc<Stats>,
    key: String,
}

impl Drop for Inside {
    fn drop(&mut self) {
        if let Some(n) = self.stats.inside.lock().unwrap().get_mut(&self.key) {
            *n -= 1;
        }
    }
}

struct Server {
    addr: SocketAddr,
    backend: Backend,
    client: LockClient,
    stats: Arc<Stats>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The lock store behind a test server.
enum Backend {
    Memory(MemoryBackend),
    /// A real redis-server of this test's own (dropped, and killed, with the server).
    #[cfg(feature = "redis")]
    Redis(RedisBackend, RedisServer),
}

impl Backend {
    fn memory() -> Self {
        Backend::Memory(MemoryBackend::new())
    }

    #[cfg(feature = "redis")]
    async fn redis() -> Self {
        let server = RedisServer::start().await;
        let backend = RedisBackend::connect(server.url()).await.unwrap();
        Backend::Redis(backend, server)
    }

    fn client(&self) -> LockClient {
        match self {
            Backend::Memory(backend) => LockClient::new(backend.clone()),
            #[cfg(feature = "redis")]
            Backend::Redis(backend, _) => LockClient::new(backend.clone()),
        }
    }

    /// Waits (with a deadline) until the store keeps nothing for `keys` — no lock, no
    /// waiter, no subscription — and, where the store can tell, nothing for any key.
    async fn assert_nothing_left(&self, keys: &[&str]) {
        let keys: Vec<LockKey> = keys
            .iter()
            .map(|k| LockKey::namespaced("", k).unwrap())
            .collect();
        match self {
            Backend::Memory(backend) => {
                wait_until(
                    Duration::from_secs(10),
                    "no lock entry and no waiter left",
                    || async { backend.is_empty() },
                )
                .await;
                for key in &keys {
                    assert!(!backend.contains_key(key));
                    assert_eq!(backend.waiters(key), 0);
                }
            }
            #[cfg(feature = "redis")]
            Backend::Redis(backend, server) => {
                // Fencing counters (`redisson_lock_token:*`) stay by design; nothing else may.
                wait_until(Duration::from_secs(10), "no lock key left", || async {
                    server
                        .keys("*")
                        .await
                        .iter()
                        .all(|k| k.starts_with("redisson_lock_token:"))
                })
                .await;
                let mut raw = server.conn().await;
                for key in &keys {
                    let exists: i64 = redis::cmd("EXISTS")
                        .arg(backend.lock_name(key))
                        .query_async(&mut raw)
                        .await
                        .unwrap();
                    assert_eq!(exists, 0, "lock {key} left in Redis");
                    assert_eq!(backend.local_waiters(key), 0, "waiters of {key} left");
                }
                let channels: Vec<String> = keys.iter().map(|k| backend.channel_name(k)).collect();
                wait_until(
                    Duration::from_secs(10),
                    "every channel unsubscribed",
                    || async {
                        server.subscribers(&channels).await.iter().all(|n| *n == 0)
                            && server.active_channels().await.is_empty()
                    },
                )
                .await;
            }
        }
    }
}

/// A server whose `POST /work` is locked by header `x-key` and works for `work`.
async fn server(backend: Backend, work: Duration) -> Server {
    let client = backend.client();
    let stats = Arc::new(Stats::default());
    let s = stats.clone();
    let handler = move |headers: HeaderMap| {
        let stats = s.clone();
        async move {
            let header = |name| {
                headers
                    .get(name)
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned()
            };
            let key = header("x-key");
            {
                let mut inside = stats.inside.lock().unwrap();
                let n = inside.entry(key.clone()).or_default();
                *n += 1;
                if *n > 1 {
                    stats.overlaps.fetch_add(1, Ordering::SeqCst);
                }
            }
            let _inside = Inside {
                stats: stats.clone(),
                key,
            };
            if let Ok(id) = header("x-id").parse() {
                stats.entered.lock().unwrap().insert(id);
            }
            tokio::time::sleep(work).await;
            stats.completed.fetch_add(1, Ordering::SeqCst);
            "done"
        }
    };
    let layer = LockLayer::builder(client.clone(), HeaderKey::new("x-key".parse().unwrap()))
        .max_wait(Duration::from_secs(60))
        .build()
        .unwrap();
    let app = Router::new().route("/work", post(handler)).layer(layer);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Server {
        addr,
        backend,
        client,
        stats,
        task,
    }
}

fn work_request(addr: SocketAddr, key: &str, id: u64) -> Request<Empty<Bytes>> {
    Request::post(format!("http://{addr}/work"))
        .header("x-key", key)
        .header("x-id", id)
        .body(Empty::new())
        .unwrap()
}

/// One HTTP/2 connection with prior knowledge (no upgrade dance).
async fn h2_connection(addr: SocketAddr) -> http2::SendRequest<Empty<Bytes>> {
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = http2::handshake(TokioExecutor::new(), TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

async fn status_of(res: hyper::Response<hyper::body::Incoming>) -> StatusCode {
    let status = res.status();
    res.into_body().collect().await.unwrap();
    status
}

/// Two requests with the same key on ONE HTTP/2 connection — one tokio task on the
/// server — are two owners and run one after the other; with different keys they run
/// side by side.
async fn same_key_on_one_http2_connection_serializes(backend: Backend) {
    let server = server(backend, Duration::from_millis(150)).await;
    let sender = h2_connection(server.addr).await;

    let a = sender
        .clone()
        .send_request(work_request(server.addr, "same", 1));
    let b = sender
        .clone()
        .send_request(work_request(server.addr, "same", 2));
    let (a, b) = tokio::join!(a, b);
    assert_eq!(status_of(a.unwrap()).await, StatusCode::OK);
    assert_eq!(status_of(b.unwrap()).await, StatusCode::OK);
    assert_eq!(
        server.stats.overlaps.load(Ordering::SeqCst),
        0,
        "ran together"
    );
    assert_eq!(server.stats.completed.load(Ordering::SeqCst), 2);

    // Different keys on the same connection: both are inside at once at some point.
    let x = tokio::spawn(
        sender
            .clone()
            .send_request(work_request(server.addr, "x", 3)),
    );
    let y = tokio::spawn(
        sender
            .clone()
            .send_request(work_request(server.addr, "y", 4)),
    );
    wait_until(
        Duration::from_secs(5),
        "both keys inside the handler at once",
        || async {
            let inside = server.stats.inside.lock().unwrap();
            inside.get("x") == Some(&1) && inside.get("y") == Some(&1)
        },
    )
    .await;
    assert_eq!(status_of(x.await.unwrap().unwrap()).await, StatusCode::OK);
    assert_eq!(status_of(y.await.unwrap().unwrap()).await, StatusCode::OK);
    server
        .backend
        .assert_nothing_left(&["same", "x", "y"])
        .await;
    assert_eq!(server.client.watched_locks(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_on_one_http2_connection_serializes_on_memory() {
    same_key_on_one_http2_connection_serializes(Backend::memory()).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_key_on_one_http2_connection_serializes_on_redis() {
    same_key_on_one_http2_connection_serializes(Backend::redis().await).await;
}

/// Concurrent HTTP/1 requests on separate connections: per key, one at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_http1_requests_serialize_per_key() {
    let server = server(Backend::memory(), Duration::from_millis(10)).await;
    let client: Client<_, Empty<Bytes>> = Client::builder(TokioExecutor::new()).build_http();
    let mut tasks = Vec::new();
    for id in 0..40u64 {
        let req = work_request(server.addr, &format!("k{}", id % 4), id);
        tasks.push(tokio::spawn(client.request(req)));
    }
    for t in tasks {
        assert_eq!(status_of(t.await.unwrap().unwrap()).await, StatusCode::OK);
    }
    assert_eq!(server.stats.overlaps.load(Ordering::SeqCst), 0);
    assert_eq!(server.stats.completed.load(Ordering::SeqCst), 40);
    server
        .backend
        .assert_nothing_left(&["k0", "k1", "k2", "k3"])
        .await;
}

/// 1,000 requests over HTTP/2 (50 connections) on 20 keys; half the clients hang up — some while their
/// request waits for its lock, some while it is inside the handler. Afterwards no lock
/// and no waiter is left, no two requests of one key overlapped, and every request
/// that stayed got its answer.
async fn disconnect_storm_leaves_nothing_behind(backend: Backend) {
    const REQUESTS: u64 = 1000;
    const KEYS: u64 = 20;
    let server = server(backend, Duration::from_millis(4)).await;
    // Many connections, few hang-ups each: h2 servers answer a burst of stream resets
    // on one connection with GOAWAY (rapid-reset protection), which is not under test.
    const CONNECTIONS: u64 = 50;
    let mut senders = Vec::new();
    for _ in 0..CONNECTIONS {
        senders.push(h2_connection(server.addr).await);
    }
    let cancelled = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for id in 0..REQUESTS {
        let mut sender = senders[(id % CONNECTIONS) as usize].clone();
        let req = work_request(server.addr, &format!("k{}", id % KEYS), id);
        let stats = server.stats.clone();
        let cancelled = cancelled.clone();
        tasks.push(tokio::spawn(async move {
            let response = sender.send_request(req);
            match id % 4 {
                // Kept: must succeed.
                0 | 1 => Some(status_of(response.await.unwrap()).await),
                // Hang up while waiting: after a moment, unless already answered.
                2 => {
                    let delay = Duration::from_millis(1 + id % 20);
                    match tokio::time::timeout(delay, response).await {
                        Ok(res) => Some(status_of(res.unwrap()).await),
                        Err(_) => {
                            cancelled.fetch_add(1, Ordering::SeqCst);
                            None
                        }
                    }
                }
                // Hang up once inside the handler.
                _ => {
                    let entered = async {
                        while !stats.entered.lock().unwrap().contains(&id) {
                            tokio::time::sleep(Duration::from_millis(1)).await;
                        }
                    };
                    tokio::select! {
                        res = response => Some(status_of(res.unwrap()).await),
                        () = entered => {
                            cancelled.fetch_add(1, Ordering::SeqCst);
                            None
                        }
                    }
                }
            }
        }));
    }
    let mut answered = 0;
    for t in tasks {
        let outcome = tokio::time::timeout(Duration::from_secs(60), t)
            .await
            .expect("a request hung")
            .unwrap();
        if let Some(status) = outcome {
            assert_eq!(status, StatusCode::OK);
            answered += 1;
        }
    }
    let cancelled = cancelled.load(Ordering::SeqCst);
    assert_eq!(answered + cancelled, REQUESTS as usize);
    assert!(answered >= 500, "every kept request answered ({answered})");
    let entered = server.stats.entered.lock().unwrap().len();
    let completed = server.stats.completed.load(Ordering::SeqCst);
    assert!(
        entered > completed,
        "some were cancelled inside the handler"
    );
    assert!(
        entered < REQUESTS as usize,
        "some were cancelled before they got the lock"
    );

    let keys: Vec<String> = (0..KEYS).map(|k| format!("k{k}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    server.backend.assert_nothing_left(&keys).await;
    assert_eq!(server.client.watched_locks(), 0);
    assert_eq!(server.stats.overlaps.load(Ordering::SeqCst), 0);
    eprintln!(
        "storm: {answered} answered, {cancelled} cancelled ({} inside the handler)",
        entered - completed
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_storm_leaves_nothing_behind_on_memory() {
    disconnect_storm_leaves_nothing_behind(Backend::memory()).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disconnect_storm_leaves_nothing_behind_on_redis() {
    disconnect_storm_leaves_nothing_behind(Backend::redis().await).await;
}
