//! `IdempotencyLayer` over real HTTP (hyper clients, HTTP/1.1 and HTTP/2, against an axum
//! server on a socket), on every store that keeps responses: each rule of the layer,
//! and a seeded retry storm checked against an oracle.

use crate::common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path, State};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use common::http::{PROTOS, Proto, exchange};
use common::{Server, serve, wait_until};
use http::{HeaderMap, Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tokio::sync::Semaphore;
use tower_lock::extract::HeldLock;
use tower_lock::idempotency::{IdempotencyLayer, IdempotencyLayerBuilder, IdempotencyRejection};
use tower_lock::layer::{KeyError, key_fn};
use tower_lock::{LayerOutcome, LockClient, LockKey, MemoryBackend, NotStoredReason};

const DEADLINE: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------
// The application: orders, numbered by the handler, with behaviours a test asks for.
// ---------------------------------------------------------------------------------------

struct Orders {
    /// Handler runs, in total.
    runs: AtomicUsize,
    /// Handler runs that answered a final (non-5xx) response, per idempotency key (the
    /// header as sent).
    completed_by_key: Mutex<HashMap<String, usize>>,
    /// The bodies of those final responses, per key, in the order made.
    made_by_key: Mutex<HashMap<String, Vec<Bytes>>>,
    /// The keys of the lock each running handler holds.
    held: Mutex<Vec<LockKey>>,
    /// A `slow` handler takes a permit before answering (so a test decides when).
    gate: Semaphore,
    /// `slow` handlers that have started.
    entered: AtomicUsize,
}

impl Default for Orders {
    fn default() -> Self {
        Orders {
            runs: AtomicUsize::new(0),
            completed_by_key: Mutex::default(),
            made_by_key: Mutex::default(),
            held: Mutex::default(),
            gate: Semaphore::new(0),
            entered: AtomicUsize::new(0),
        }
    }
}

async fn order(
    State(orders): State<Arc<Orders>>,
    Path(voucher): Path<u32>,
    held: Option<HeldLock>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let n = orders.runs.fetch_add(1, Ordering::SeqCst) + 1;
    if let Some(held) = held {
        orders.held.lock().unwrap().push(held.key().clone());
    }
    let behave = headers.get("x-behave").map_or("", |v| v.to_str().unwrap());
    if let Some(ms) = headers.get("x-pause-ms") {
        let ms: u64 = ms.to_str().unwrap().parse().unwrap();
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if behave == "slow" {
        orders.entered.fetch_add(1, Ordering::SeqCst);
        orders.gate.acquire().await.unwrap().forget();
    }
    let text = format!(
        "{{\"order\":{n},\"voucher\":{voucher},\"bytes\":{}}}",
        body.len()
    );
    if let Some(key) = headers.get("idempotency-key")
        && behave != "fail"
    {
        let key = key.to_str().unwrap().to_owned();
        *orders
            .completed_by_key
            .lock()
            .unwrap()
            .entry(key.clone())
            .or_default() += 1;
        if behave.is_empty() {
            orders
                .made_by_key
                .lock()
                .unwrap()
                .entry(key)
                .or_default()
                .push(Bytes::from(text.clone()));
        }
    }
    if let Some(status) = headers.get("x-status") {
        let status: u16 = status.to_str().unwrap().parse().unwrap();
        return (StatusCode::from_u16(status).unwrap(), "not now").into_response();
    }
    match behave {
        "fail" => (StatusCode::INTERNAL_SERVER_ERROR, "boom").into_response(),
        "taken" => (StatusCode::CONFLICT, "sold out").into_response(),
        // Chunked, of unknown length: the text in three pieces.
        "stream" => {
            let (a, rest) = text.split_at(text.len() / 3);
            let (b, c) = rest.split_at(rest.len() / 2);
            let chunks =
                [a, b, c].map(|part| Ok::<_, std::io::Error>(Bytes::from(part.to_owned())));
            let body = Body::from_stream(futures_util::stream::iter(chunks));
            (StatusCode::CREATED, body).into_response()
        }
        // Chunked, 3 × 600 bytes: over the tests' 1,024-byte `max_stored_body`.
        "big-stream" => {
            let chunks =
                ["a", "b", "c"].map(|c| Ok::<_, std::io::Error>(Bytes::from(c.repeat(600))));
            let body = Body::from_stream(futures_util::stream::iter(chunks));
            (StatusCode::CREATED, body).into_response()
        }
        // Chunked: `first`, then `last` once a test gives the gate a permit.
        "slow-stream" => {
            use futures_util::StreamExt;
            let first = futures_util::stream::once(async {
                Ok::<_, std::io::Error>(Bytes::from("first;"))
            });
            let last = futures_util::stream::once(async move {
                orders.gate.acquire().await.unwrap().forget();
                Ok(Bytes::from("last"))
            });
            (StatusCode::CREATED, Body::from_stream(first.chain(last))).into_response()
        }
        "big" => "x".repeat(4096).into_response(),
        _ => (
            StatusCode::CREATED,
            [
                (header::CONTENT_TYPE, "application/json"),
                (header::LOCATION, &format!("/orders/{n}")),
                (header::SET_COOKIE, "session=secret"),
            ],
            text,
        )
            .into_response(),
    }
}

/// The caller, from `x-user` (a test's stand-in for authentication); none: no scope.
fn scope() -> impl tower_lock::layer::KeyExtractor {
    key_fn(|parts: &http::request::Parts| {
        parts
            .headers
            .get("x-user")
            .map(|user| {
                let user = user.to_str().map_err(|_| KeyError::new("bad x-user"))?;
                Ok::<_, KeyError>(LockKey::namespaced("user", user)?)
            })
            .transpose()
    })
}

fn builder(client: LockClient) -> IdempotencyLayerBuilder<impl tower_lock::layer::KeyExtractor> {
    IdempotencyLayer::builder(client, scope())
        .max_body(1024)
        .max_stored_body(1024)
}

struct App {
    server: Server,
    orders: Arc<Orders>,
}

async fn app(layer: IdempotencyLayer<impl tower_lock::layer::KeyExtractor>) -> App {
    let orders = Arc::new(Orders::default());
    let router = Router::new()
        .route(
            "/vouchers/{voucher}/orders",
            post(order).put(order).route_layer(layer),
        )
        .with_state(Arc::clone(&orders));
    App {
        server: serve(router).await,
        orders,
    }
}

impl App {
    fn addr(&self) -> SocketAddr {
        self.server.addr
    }

    fn runs(&self) -> usize {
        self.orders.runs.load(Ordering::SeqCst)
    }

    fn release_one(&self) {
        self.orders.gate.add_permits(1);
    }

    async fn wait_entered(&self, n: usize) {
        wait_until(DEADLINE, "the slow handler started", || async {
            self.orders.entered.load(Ordering::SeqCst) >= n
        })
        .await;
    }
}

// ---------------------------------------------------------------------------------------
// The client.
// ---------------------------------------------------------------------------------------

/// What the client received, whole.
#[derive(Debug, Clone)]
struct Got {
    status: StatusCode,
    headers: HeaderMap,
    body: Bytes,
}

impl Got {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(|v| v.to_str().unwrap())
    }

    fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    fn problem(&self) -> serde_json::Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{self:?}"
        );
        let json: serde_json::Value = serde_json::from_slice(&self.body).unwrap();
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        assert!(
            json["title"].is_string() && json["detail"].is_string(),
            "{json}"
        );
        assert!(
            json["type"]
                .as_str()
                .unwrap()
                .contains("docs/idempotency.md#"),
            "{json}"
        );
        json
    }
}

/// A request: method, path, headers, body.
struct Req<'a> {
    method: Method,
    path: &'a str,
    headers: Vec<(&'a str, String)>,
    body: &'a str,
}

fn post_as<'a>(user: &str, key: &str) -> Req<'a> {
    Req {
        method: Method::POST,
        path: "/vouchers/1/orders",
        headers: vec![
            ("x-user", user.to_owned()),
            ("idempotency-key", key.to_owned()),
        ],
        body: "{\"qty\":1}",
    }
}

impl<'a> Req<'a> {
    fn with(mut self, name: &'a str, value: &str) -> Self {
        self.headers.push((name, value.to_owned()));
        self
    }

    fn path(mut self, path: &'a str) -> Self {
        self.path = path;
        self
    }

    fn body(mut self, body: &'a str) -> Self {
        self.body = body;
        self
    }

    fn method(mut self, method: Method) -> Self {
        self.method = method;
        self
    }

    fn build(&self, addr: SocketAddr) -> Request<Full<Bytes>> {
        let mut req = Request::builder()
            .method(self.method.clone())
            .uri(format!("http://{addr}{}", self.path));
        for (name, value) in &self.headers {
            req = req.header(*name, value);
        }
        req.body(Full::new(Bytes::copy_from_slice(self.body.as_bytes())))
            .unwrap()
    }
}

/// Sends `req` on a fresh connection and reads the whole response.
async fn send(addr: SocketAddr, proto: Proto, req: &Req<'_>) -> Got {
    let (head, body) = open(addr, proto, req).await;
    let body = tokio::time::timeout(DEADLINE, body.collect())
        .await
        .expect("no whole response in time");
    Got {
        status: head.status,
        headers: head.headers,
        body: body.unwrap().to_bytes(),
    }
}

/// A request sent in a task: for one that waits on a slow handler.
fn spawn_send(addr: SocketAddr, proto: Proto, req: Req<'static>) -> tokio::task::JoinHandle<Got> {
    tokio::spawn(async move { send(addr, proto, &req).await })
}

/// Observes the layer's outcomes, and counts the keys' locks taken (not the quotas'
/// permits).
#[derive(Default)]
struct Outcomes(
    Mutex<Vec<LayerOutcome>>,
    AtomicUsize,
    Mutex<Vec<NotStoredReason>>,
);

impl tower_lock::LockObserver for Outcomes {
    fn layer_outcome(&self, event: tower_lock::LayerEvent<'_>, outcome: LayerOutcome) {
        assert_eq!(event.kind, tower_lock::LayerKind::Idempotency);
        assert_eq!(event.namespace, "idempotency", "{event:?} {outcome}");
        assert_eq!(
            event.not_stored.is_some(),
            outcome == LayerOutcome::NotStored,
            "{event:?} {outcome}"
        );
        self.0.lock().unwrap().push(outcome);
        self.2.lock().unwrap().extend(event.not_stored);
    }

    fn acquired(&self, event: tower_lock::LockEvent<'_>, _waited: Duration) {
        if event.key.namespace() == "idempotency" {
            self.1.fetch_add(1, Ordering::SeqCst);
        }
    }
}

impl Outcomes {
    /// Why nothing was stored, in order.
    fn not_stored(&self) -> Vec<NotStoredReason> {
        self.2.lock().unwrap().clone()
    }

    fn count(&self, outcome: LayerOutcome) -> usize {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter(|o| **o == outcome)
            .count()
    }
}

// ---------------------------------------------------------------------------------------
// Stores.
// ---------------------------------------------------------------------------------------

/// A store every client of a test shares, as replicas share theirs.
pub(crate) trait Store: Send + Sync {
    /// A client of the store, as a replica would have (its own backend where the store
    /// has connections).
    async fn client(&self) -> LockClient;
}

/// A replica's client: a 3 s watchdog lease, so a lost lock is noticed within 1 s.
fn replica(backend: impl tower_lock::backend::LockBackend) -> LockClient {
    LockClient::builder(backend)
        .watchdog_lease(Duration::from_secs(3))
        .build()
        .unwrap()
}

pub(crate) struct Memory(MemoryBackend);

impl Store for Memory {
    async fn client(&self) -> LockClient {
        replica(self.0.clone())
    }
}

pub(crate) async fn memory() -> Memory {
    Memory(MemoryBackend::new())
}

/// A redis-server of the test's own; each client its own connections.
#[cfg(feature = "redis")]
pub(crate) struct Redis(common::redis_server::RedisServer);

#[cfg(feature = "redis")]
impl Store for Redis {
    async fn client(&self) -> LockClient {
        replica(
            tower_lock::RedisBackend::connect(self.0.url())
                .await
                .unwrap(),
        )
    }
}

#[cfg(feature = "redis")]
pub(crate) async fn redis() -> Redis {
    Redis(common::redis_server::RedisServer::start().await)
}

/// A database of the test's own; each client its own pool.
#[cfg(feature = "postgres")]
pub(crate) struct Postgres(common::postgres::PgDatabase);

#[cfg(feature = "postgres")]
impl Store for Postgres {
    async fn client(&self) -> LockClient {
        let backend = tower_lock::PostgresBackend::builder(self.0.pool(4).await)
            .build()
            .await
            .unwrap();
        replica(backend)
    }
}

#[cfg(feature = "postgres")]
pub(crate) async fn postgres() -> Postgres {
    Postgres(common::postgres::PgDatabase::create().await)
}

// ---------------------------------------------------------------------------------------
// The rules, one case each, run on every store.
// ---------------------------------------------------------------------------------------

/// The first request runs and is stored; a retry gets the same status, body and kept
/// headers with `Idempotent-Replayed: true`, and the handler does not run again; a
/// `Set-Cookie` is not replayed.
async fn a_retry_after_completion_replays_the_stored_response_byte_for_byte(store: &impl Store) {
    for proto in PROTOS {
        let observed = Arc::new(Outcomes::default());
        let client = with_observer(store, Arc::clone(&observed)).await;
        let app = app(builder(client).build().unwrap()).await;
        let key = format!("k-{proto:?}");
        let first = send(app.addr(), proto, &post_as("alice", &key)).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(!first.replayed());
        assert_eq!(first.header("set-cookie"), Some("session=secret"));
        for _ in 0..3 {
            let again = send(app.addr(), proto, &post_as("alice", &key)).await;
            assert_eq!(again.status, StatusCode::CREATED);
            assert!(again.replayed(), "{again:?}");
            assert_eq!(again.body, first.body, "byte for byte");
            assert_eq!(again.header("location"), first.header("location"));
            assert_eq!(again.header("content-type"), Some("application/json"));
            assert_eq!(again.header("set-cookie"), None, "not on the stored list");
        }
        assert_eq!(app.runs(), 1, "{proto:?}: the handler ran once");
        assert_eq!(observed.count(LayerOutcome::Stored), 1);
        assert_eq!(observed.count(LayerOutcome::Replayed), 3);
        assert_eq!(
            observed.1.load(Ordering::SeqCst),
            1,
            "a stored response is replayed without taking the lock"
        );
        // The handler saw the lock it ran under, in the layer's namespace.
        let held = app.orders.held.lock().unwrap().clone();
        assert_eq!(held.len(), 1);
        assert_eq!(held[0].namespace(), "idempotency");
    }
}

async fn with_observer(store: &impl Store, observer: Arc<Outcomes>) -> LockClient {
    let plain = store.client().await;
    LockClient::builder(Arc::clone(plain.backend()))
        .watchdog_lease(plain.watchdog_lease())
        .observer(observer)
        .build()
        .unwrap()
}

/// A retry while the first request runs gets `409` with `Retry-After` and a problem
/// body; once the first finishes, the retry is replayed.
async fn a_retry_while_the_first_is_in_flight_is_409_then_replayed(store: &impl Store) {
    for proto in PROTOS {
        let observed = Arc::new(Outcomes::default());
        let client = with_observer(store, Arc::clone(&observed)).await;
        let app = app(builder(client).build().unwrap()).await;
        let key = format!("slow-{proto:?}");
        let first = spawn_send(
            app.addr(),
            proto,
            post_as("alice", &key).with("x-behave", "slow"),
        );
        app.wait_entered(1).await;
        let busy = send(app.addr(), proto, &post_as("alice", &key)).await;
        assert_eq!(busy.status, StatusCode::CONFLICT, "{busy:?}");
        assert_eq!(busy.header("retry-after"), Some("1"));
        busy.problem();
        app.release_one();
        let first = first.await.unwrap();
        assert_eq!(first.status, StatusCode::CREATED);
        let again = send(app.addr(), proto, &post_as("alice", &key)).await;
        assert!(again.replayed());
        assert_eq!(again.body, first.body);
        assert_eq!(app.runs(), 1);
        assert_eq!(observed.count(LayerOutcome::InFlight), 1);
    }
}

/// With `max_wait`, retries arriving while the first runs wait for it and get its
/// response; the handler runs once.
async fn with_max_wait_retries_in_flight_wait_and_replay(store: &impl Store) {
    for proto in PROTOS {
        let client = store.client().await;
        let layer = builder(client).max_wait(DEADLINE).build().unwrap();
        let app = app(layer).await;
        let key = format!("wait-{proto:?}");
        let first = spawn_send(
            app.addr(),
            proto,
            post_as("alice", &key).with("x-behave", "slow"),
        );
        app.wait_entered(1).await;
        let retries: Vec<_> = (0..3)
            .map(|_| spawn_send(app.addr(), proto, post_as("alice", &key)))
            .collect();
        app.release_one();
        let first = first.await.unwrap();
        for retry in retries {
            let got = retry.await.unwrap();
            assert_eq!(got.status, StatusCode::CREATED, "{got:?}");
            assert!(got.replayed());
            assert_eq!(got.body, first.body);
        }
        assert_eq!(app.runs(), 1);
    }
}

/// A key reused for another request (another body, query or method) is `422`, and the
/// handler does not run for it.
async fn a_key_reused_for_another_request_is_422(store: &impl Store) {
    for proto in PROTOS {
        let observed = Arc::new(Outcomes::default());
        let client = with_observer(store, Arc::clone(&observed)).await;
        let app = app(builder(client).build().unwrap()).await;
        let key = format!("reuse-{proto:?}");
        let first = send(app.addr(), proto, &post_as("alice", &key)).await;
        assert_eq!(first.status, StatusCode::CREATED);
        for other in [
            post_as("alice", &key).body("{\"qty\":2}"),
            post_as("alice", &key).path("/vouchers/1/orders?coupon=x"),
        ] {
            let got = send(app.addr(), proto, &other).await;
            assert_eq!(got.status, StatusCode::UNPROCESSABLE_ENTITY, "{got:?}");
            assert!(
                got.problem()["type"]
                    .as_str()
                    .unwrap()
                    .ends_with("#mismatch")
            );
        }
        assert_eq!(app.runs(), 1);
        assert_eq!(observed.count(LayerOutcome::Mismatch), 2);
    }
}

/// A key is scoped to its caller, method and route: another user, method or voucher
/// with the same key runs the handler; a request without a caller passes through.
async fn keys_are_scoped_to_caller_method_and_route(store: &impl Store) {
    let client = store.client().await;
    let layer = builder(client)
        .methods([Method::POST, Method::PUT])
        .build()
        .unwrap();
    let app = app(layer).await;
    let proto = Proto::Http1;
    let base = send(app.addr(), proto, &post_as("alice", "same")).await;
    assert_eq!(base.status, StatusCode::CREATED);
    for other in [
        post_as("bob", "same"),
        post_as("alice", "same").method(Method::PUT),
        // The route template is the same, but the path differs: fingerprinted apart,
        // so the same key is a mismatch, not a replay of voucher 1's order.
        post_as("alice", "same").path("/vouchers/2/orders"),
    ] {
        let got = send(app.addr(), proto, &other).await;
        assert!(!got.replayed(), "{got:?}");
    }
    // Alice's PUT and Bob's POST ran; voucher 2 under the same route and key is 422.
    assert_eq!(app.runs(), 3);
    let no_caller = Req {
        method: Method::POST,
        path: "/vouchers/1/orders",
        headers: vec![("idempotency-key", "same".into())],
        body: "",
    };
    for _ in 0..2 {
        assert!(!send(app.addr(), proto, &no_caller).await.replayed());
    }
    assert_eq!(app.runs(), 5, "no caller: not covered");
}

/// Issue 46, finding 2. Without a key a request passes through (it runs every time);
/// with `required`, it is `400`. A key that is present but unusable (malformed, too
/// long, empty, sent twice) is `400` with a problem body saying what is wrong, whether or
/// not the key is required: before, without `required` it passed through unprotected,
/// and a 256-byte key sent twice made two orders.
async fn a_missing_key_passes_and_an_unusable_one_is_400_even_when_not_required(
    store: &impl Store,
) {
    let observed = Arc::new(Outcomes::default());
    let client = with_observer(store, Arc::clone(&observed)).await;
    let lenient = app(builder(client).build().unwrap()).await;
    let strict = app_required(store).await;
    let none = Req {
        method: Method::POST,
        path: "/vouchers/1/orders",
        headers: vec![("x-user", "alice".into())],
        body: "",
    };
    for _ in 0..2 {
        let got = send(lenient.addr(), Proto::Http1, &none).await;
        assert_eq!(got.status, StatusCode::CREATED, "{got:?}");
    }
    assert_eq!(lenient.runs(), 2, "no key: passed through, run every time");
    let got = send(strict.addr(), Proto::Http1, &none).await;
    assert_eq!(got.status, StatusCode::BAD_REQUEST, "{got:?}");

    let long = "k".repeat(256);
    let with_keys = |keys: &[&str]| Req {
        headers: std::iter::once(("x-user", "alice".to_owned()))
            .chain(keys.iter().map(|k| ("idempotency-key", (*k).to_owned())))
            .collect(),
        ..none.clone_req()
    };
    let unusable = [
        with_keys(&["a b"]),
        with_keys(&["\"open"]),
        with_keys(&["\"\""]),
        with_keys(&[long.as_str()]),
        with_keys(&["same", "same"]),
        with_keys(&[long.as_str(), long.as_str()]),
    ];
    for app in [&lenient, &strict] {
        let runs = app.runs();
        for req in &unusable {
            for proto in PROTOS {
                let got = send(app.addr(), proto, req).await;
                assert_eq!(got.status, StatusCode::BAD_REQUEST, "{got:?}");
                let problem = got.problem();
                assert!(
                    problem["detail"]
                        .as_str()
                        .unwrap()
                        .contains("idempotency-key"),
                    "{problem}"
                );
            }
        }
        assert_eq!(app.runs(), runs, "an unusable key ran the handler");
    }
    // Counted as the layer's, in its namespace (the observer checks that): once per
    // unusable request sent to the lenient app.
    assert_eq!(
        observed.count(LayerOutcome::BadKey),
        unusable.len() * PROTOS.len()
    );
    // A quoted structured-field string and the same bare token are one key.
    let quoted = send(strict.addr(), Proto::Http2, &post_as("alice", "\"abc\"")).await;
    let bare = send(strict.addr(), Proto::Http2, &post_as("alice", "abc")).await;
    assert!(bare.replayed() && bare.body == quoted.body);
}

/// Issue 46, finding 1. The natural order: a per-user `LockLayer` inside the
/// `IdempotencyLayer` (`post(h).route_layer(per_user).route_layer(idempotency)`), with
/// the idempotency layer's defaults. A request that finds the user's lock busy gets the
/// lock layer's "busy, retry later"; that answer must not become the key's outcome.
/// Before, the default `store_if` (below 500) stored the 429, and every retry with the
/// key was answered the stored 429 for 24 hours: the order could never be placed. With
/// the busy status set to 409 (not one of `NEVER_STORED`) only the layer's `Transient`
/// mark keeps it out. And in the other order, the lock layer answers before the
/// idempotency layer sees the request.
async fn a_lock_layers_busy_answer_is_never_stored_and_its_retry_runs(store: &impl Store) {
    for (i, (busy_status, lock_outside)) in [
        (StatusCode::TOO_MANY_REQUESTS, false),
        (StatusCode::CONFLICT, false),
        (StatusCode::TOO_MANY_REQUESTS, true),
    ]
    .into_iter()
    .enumerate()
    {
        // A caller of its own per case: the store is shared, and so would the keys be.
        let user = format!("alice-{i}");
        let client = store.client().await;
        let per_user = tower_lock::LockLayer::builder(client.clone(), scope())
            .max_wait(Duration::ZERO)
            .busy_status(busy_status)
            .build()
            .unwrap();
        let idempotency = IdempotencyLayer::new(client, scope());
        let orders = Arc::new(Orders::default());
        let route = if lock_outside {
            post(order).route_layer(idempotency).route_layer(per_user)
        } else {
            post(order).route_layer(per_user).route_layer(idempotency)
        };
        let router = Router::new()
            .route("/vouchers/{voucher}/orders", route)
            .with_state(Arc::clone(&orders));
        let app = App {
            server: serve(router).await,
            orders,
        };
        let case = format!("busy {busy_status}, lock layer outside: {lock_outside}");

        let first = spawn_send(
            app.addr(),
            Proto::Http1,
            post_as(&user, "first").with("x-behave", "slow"),
        );
        app.wait_entered(1).await;
        for proto in PROTOS {
            let busy = send(app.addr(), proto, &post_as(&user, "second")).await;
            assert_eq!(busy.status, busy_status, "{case}: {busy:?}");
            assert!(!busy.replayed(), "{case}: {busy:?}");
        }
        app.release_one();
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED, "{case}");

        let retried = send(app.addr(), Proto::Http2, &post_as(&user, "second")).await;
        assert_eq!(retried.status, StatusCode::CREATED, "{case}: {retried:?}");
        assert!(!retried.replayed(), "{case}: the busy answer was stored");
        assert_eq!(app.runs(), 2, "{case}: the retry did not run the handler");
        let again = send(app.addr(), Proto::Http1, &post_as(&user, "second")).await;
        assert!(again.replayed(), "{case}: {again:?}");
        assert_eq!(again.body, retried.body, "{case}");
        assert_eq!(app.runs(), 2, "{case}");
    }
}

/// Issue 46, finding 1: the statuses that mean "not now" are never stored, whatever
/// `store_if` says, even when a handler answers them itself.
async fn transient_statuses_are_never_stored_whatever_store_if_says(store: &impl Store) {
    let app = app(builder(store.client().await)
        .store_if(|_| true)
        .build()
        .unwrap())
    .await;
    for (i, status) in tower_lock::idempotency::NEVER_STORED.iter().enumerate() {
        let key = format!("not-now-{i}");
        let req = post_as("alice", &key).with("x-status", status.as_str());
        let got = send(app.addr(), Proto::Http1, &req).await;
        assert_eq!(got.status, *status, "{got:?}");
        let again = send(app.addr(), Proto::Http1, &req).await;
        assert_eq!(again.status, *status, "{again:?}");
        assert!(!again.replayed(), "{status} was stored: {again:?}");
    }
    assert_eq!(app.runs(), 8, "every not-now answer ran again");
    // Any other status the hook accepts is stored, 5xx included.
    let req = post_as("alice", "boom").with("x-behave", "fail");
    send(app.addr(), Proto::Http1, &req).await;
    assert!(send(app.addr(), Proto::Http1, &req).await.replayed());
}

async fn app_required(store: &impl Store) -> App {
    app(builder(store.client().await)
        .required(true)
        .build()
        .unwrap())
    .await
}

impl Req<'_> {
    fn clone_req(&self) -> Self {
        Req {
            method: self.method.clone(),
            path: self.path,
            headers: self.headers.clone(),
            body: self.body,
        }
    }
}

/// A 5xx is not final: nothing is stored and the retry runs the handler again; a 4xx is
/// final, and is replayed.
async fn a_5xx_stores_nothing_and_a_4xx_is_replayed(store: &impl Store) {
    let observed = Arc::new(Outcomes::default());
    let client = with_observer(store, Arc::clone(&observed)).await;
    let app = app(builder(client).build().unwrap()).await;
    let failed = send(
        app.addr(),
        Proto::Http1,
        &post_as("alice", "k5").with("x-behave", "fail"),
    )
    .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let retried = send(app.addr(), Proto::Http1, &post_as("alice", "k5")).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(!retried.replayed());
    assert_eq!(app.runs(), 2);
    let taken = send(
        app.addr(),
        Proto::Http2,
        &post_as("alice", "k4").with("x-behave", "taken"),
    )
    .await;
    assert_eq!(taken.status, StatusCode::CONFLICT);
    let again = send(
        app.addr(),
        Proto::Http2,
        &post_as("alice", "k4").with("x-behave", "taken"),
    )
    .await;
    assert!(again.replayed());
    assert_eq!(again.text(), "sold out");
    assert_eq!(app.runs(), 3);
    assert_eq!(observed.count(LayerOutcome::NotStored), 1);
    assert_eq!(observed.count(LayerOutcome::Stored), 2);
}

/// Issue 46, finding 3: a handler's `201` with a chunked body of a few bytes (unknown
/// length) was passed through unstored, and the retry placed the order again. It is
/// read up to `max_stored_body`, stored, and replayed byte for byte.
async fn a_streamed_response_that_fits_is_stored_and_replayed(store: &impl Store) {
    let observed = Arc::new(Outcomes::default());
    let client = with_observer(store, Arc::clone(&observed)).await;
    let app = app(builder(client).build().unwrap()).await;
    for proto in PROTOS {
        let key = format!("stream-{proto:?}");
        let req = post_as("alice", &key).with("x-behave", "stream");
        let first = send(app.addr(), proto, &req).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        assert!(!first.replayed());
        let second = send(app.addr(), proto, &req).await;
        assert!(second.replayed(), "{second:?}");
        assert_eq!(second.status, StatusCode::CREATED);
        assert_eq!(second.body, first.body);
    }
    assert_eq!(app.runs(), 2, "a retry ran the handler again");
    assert_eq!(observed.count(LayerOutcome::Stored), 2);
    assert_eq!(observed.count(LayerOutcome::Replayed), 2);
}

/// A body over `max_stored_body`, sized or streamed, reaches the client whole and is not
/// stored (a retry runs again), counted `not_stored` with `too_large`. A request body
/// over `max_body` is `413`.
async fn a_response_too_large_passes_through_whole_unstored(store: &impl Store) {
    let observed = Arc::new(Outcomes::default());
    let client = with_observer(store, Arc::clone(&observed)).await;
    let app = app(builder(client).build().unwrap()).await;
    for (behave, len) in [("big", 4096), ("big-stream", 1800)] {
        for proto in PROTOS {
            let key = format!("{behave}-{proto:?}");
            let req = post_as("alice", &key).with("x-behave", behave);
            let first = send(app.addr(), proto, &req).await;
            assert!(first.status.is_success(), "{first:?}");
            assert_eq!(first.body.len(), len);
            let second = send(app.addr(), proto, &req).await;
            assert!(!second.replayed());
            assert_eq!(second.body, first.body);
        }
    }
    assert_eq!(app.runs(), 8);
    assert_eq!(observed.not_stored(), vec![NotStoredReason::TooLarge; 8]);
    let big = "y".repeat(2000);
    let got = send(
        app.addr(),
        Proto::Http1,
        &post_as("alice", "huge").body(&big),
    )
    .await;
    assert_eq!(got.status, StatusCode::PAYLOAD_TOO_LARGE);
    got.problem();
    assert_eq!(app.runs(), 8);
}

/// A stream still coming after `max_stored_body_wait` is not held back to its end: the
/// client reads its first chunk while the handler has yet to make the last, and nothing
/// is stored (`too_slow`); the key's lock is free meanwhile.
async fn a_slow_stream_is_passed_on_as_it_comes_and_not_stored(store: &impl Store) {
    let observed = Arc::new(Outcomes::default());
    let client = with_observer(store, Arc::clone(&observed)).await;
    let layer = builder(client)
        .max_stored_body_wait(Duration::from_millis(200))
        .build()
        .unwrap();
    let app = app(layer).await;
    for proto in PROTOS {
        let key = format!("slow-{proto:?}");
        let req = post_as("alice", &key).with("x-behave", "slow-stream");
        let (head, mut body) = open(app.addr(), proto, &req).await;
        assert_eq!(head.status, StatusCode::CREATED);
        let first = tokio::time::timeout(DEADLINE, body.frame())
            .await
            .expect("the first chunk was held back")
            .unwrap()
            .unwrap();
        assert_eq!(first.into_data().unwrap(), "first;");
        wait_until(DEADLINE, "the lock released unstored", || async {
            observed.not_stored().len() == app.runs()
        })
        .await;
        app.release_one();
        let rest = tokio::time::timeout(DEADLINE, body.collect())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(rest.to_bytes(), "last");
    }
    assert_eq!(observed.not_stored(), vec![NotStoredReason::TooSlow; 2]);
    assert_eq!(observed.count(LayerOutcome::Stored), 0);
}

/// Sends `req` on a fresh connection and returns the response's head and its body,
/// unread.
async fn open(
    addr: SocketAddr,
    proto: Proto,
    req: &Req<'_>,
) -> (http::response::Parts, hyper::body::Incoming) {
    tokio::time::timeout(DEADLINE, exchange(addr, proto, req.build(addr)))
        .await
        .expect("no response head in time")
        .into_parts()
}

/// Issue 46, finding 4: Stripe's behaviour in one line. With `store_if(stripe)` a 5xx
/// is stored and replayed (the handler runs once), while "not now" answers (503, 429)
/// are still never stored. With the default a 5xx is not (see
/// `a_5xx_stores_nothing_and_a_4xx_is_replayed`).
async fn the_stripe_preset_replays_a_5xx_but_never_a_not_now(store: &impl Store) {
    let layer = builder(store.client().await)
        .store_if(tower_lock::idempotency::stripe)
        .build()
        .unwrap();
    let app = app(layer).await;
    for proto in PROTOS {
        let key = format!("fail-{proto:?}");
        let req = post_as("alice", &key).with("x-behave", "fail");
        let first = send(app.addr(), proto, &req).await;
        assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
        let second = send(app.addr(), proto, &req).await;
        assert!(second.replayed(), "{second:?}");
        assert_eq!(second.status, StatusCode::INTERNAL_SERVER_ERROR);
        assert_eq!(second.body, first.body);
    }
    assert_eq!(app.runs(), 2);
    for status in ["503", "429"] {
        let key = format!("not-now-{status}");
        let req = post_as("alice", &key).with("x-status", status);
        for _ in 0..2 {
            let got = send(app.addr(), Proto::Http1, &req).await;
            assert_eq!(got.status.as_str(), status);
            assert!(!got.replayed());
        }
    }
    assert_eq!(app.runs(), 6, "a \"not now\" was stored");
}

/// A replay runs the `on_replay` hook, told when the response was stored and when it
/// expires; a first answer does not. The problem `type` links follow
/// `problem_type_base`.
async fn a_replay_runs_the_response_hook_and_problems_link_where_told(store: &impl Store) {
    let ttl = Duration::from_secs(600);
    let layer = builder(store.client().await)
        .ttl(ttl)
        .problem_type_base("https://api.example.com/problems")
        .on_replay(|head, replay| {
            let kept = replay.expires_at.duration_since(replay.stored_at).unwrap();
            let left = replay
                .expires_at
                .duration_since(std::time::SystemTime::now())
                .unwrap();
            head.headers.insert("x-kept", kept.as_secs().into());
            head.headers.insert("x-expires-in", left.as_secs().into());
        })
        .build()
        .unwrap();
    let app = app(layer).await;
    let req = post_as("alice", "hooked");
    let first = send(app.addr(), Proto::Http2, &req).await;
    assert_eq!(first.header("x-kept"), None);
    let second = send(app.addr(), Proto::Http1, &req).await;
    assert!(second.replayed());
    assert_eq!(second.header("x-kept"), Some("600"));
    let left: u64 = second.header("x-expires-in").unwrap().parse().unwrap();
    assert!((590..=600).contains(&left), "{left}");
    let mismatch = send(app.addr(), Proto::Http1, &req.clone_req().body("other")).await;
    assert_eq!(mismatch.status, StatusCode::UNPROCESSABLE_ENTITY);
    let json: serde_json::Value = serde_json::from_slice(&mismatch.body).unwrap();
    assert_eq!(json["type"], "https://api.example.com/problems#mismatch");
    assert_eq!(mismatch.header("x-kept"), None);
}

/// A client that goes away mid-handler cancels it: nothing is stored, the lock is free
/// at once (no lease to wait out), and the retry runs.
async fn a_cancelled_request_stores_nothing_and_its_retry_runs(store: &impl Store) {
    let app = app(builder(store.client().await).build().unwrap()).await;
    let first = spawn_send(
        app.addr(),
        Proto::Http1,
        post_as("alice", "gone").with("x-behave", "slow"),
    );
    app.wait_entered(1).await;
    first.abort();
    let _ = first.await;
    // The server notices the closed connection and drops the handler; the retry then
    // finds the lock free and runs (a `409` until then).
    let retried = retry_until_not_409(&app, &post_as("alice", "gone")).await;
    assert_eq!(retried.status, StatusCode::CREATED, "{retried:?}");
    assert!(!retried.replayed());
    assert_eq!(app.runs(), 2);
}

async fn retry_until_not_409(app: &App, req: &Req<'_>) -> Got {
    let deadline = tokio::time::Instant::now() + DEADLINE;
    loop {
        let got = send(app.addr(), Proto::Http1, req).await;
        if got.status != StatusCode::CONFLICT || tokio::time::Instant::now() > deadline {
            return got;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A lock lost while the handler runs (force-released) cancels the handler: `503`
/// with a problem body, nothing stored, and the retry runs.
async fn a_lost_lock_cancels_the_handler_and_stores_nothing(store: &impl Store) {
    let client = store.client().await;
    let app = app(builder(client.clone()).build().unwrap()).await;
    let first = spawn_send(
        app.addr(),
        Proto::Http2,
        post_as("alice", "lost").with("x-behave", "slow"),
    );
    app.wait_entered(1).await;
    let key = app.orders.held.lock().unwrap()[0].clone();
    assert!(
        client
            .get_fenced_lock(key)
            .unwrap()
            .force_unlock()
            .await
            .unwrap()
    );
    let got = first.await.unwrap();
    assert_eq!(got.status, StatusCode::SERVICE_UNAVAILABLE, "{got:?}");
    assert!(got.header("retry-after").is_some());
    assert!(got.problem()["type"].as_str().unwrap().ends_with("#lost"));
    let retried = send(app.addr(), Proto::Http2, &post_as("alice", "lost")).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    assert!(!retried.replayed());
}

/// `GET` and `PUT` are not covered by default; a custom rejection handler answers every
/// rejection, and still gets `Retry-After`.
async fn uncovered_methods_pass_and_rejections_can_be_customized(store: &impl Store) {
    // The handler answers, though `problem_type_base` (which sets the default answers'
    // links) comes after it: it replaced the handler at first.
    let layer = builder(store.client().await)
        .on_rejection(|r: IdempotencyRejection| {
            (r.status(), format!("custom {}", r.status().as_u16()))
        })
        .problem_type_base("https://api.example.com/problems")
        .build()
        .unwrap();
    let app = app(layer).await;
    for _ in 0..2 {
        let put = send(
            app.addr(),
            Proto::Http1,
            &post_as("alice", "p").method(Method::PUT),
        )
        .await;
        assert!(!put.replayed());
    }
    assert_eq!(app.runs(), 2);
    let first = spawn_send(
        app.addr(),
        Proto::Http1,
        post_as("alice", "c").with("x-behave", "slow"),
    );
    app.wait_entered(1).await;
    let busy = send(app.addr(), Proto::Http1, &post_as("alice", "c")).await;
    assert_eq!(busy.status, StatusCode::CONFLICT);
    assert_eq!(busy.text(), "custom 409");
    assert_eq!(busy.header("retry-after"), Some("1"));
    app.release_one();
    first.await.unwrap();
}

/// A seeded storm of retries: per key, several requests (some concurrent, some failing
/// with 5xx, some cancelled by their client). The oracle: per key, the handler answered
/// a final status at most once, and every final response received for a key is the same
/// bytes.
async fn a_seeded_retry_storm_runs_each_key_once_and_replays_it_exactly(store: &impl Store) {
    let seed: u64 = std::env::var("STORM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("STORM_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let layer = builder(store.client().await)
        .max_wait(Duration::from_millis(rng.u64(0..50)))
        .build()
        .unwrap();
    let app = app(layer).await;
    let finals: Arc<Mutex<HashMap<String, Vec<Got>>>> = Arc::default();
    let mut cancels: HashMap<String, usize> = HashMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    const KEYS: usize = 16;
    const PER_KEY: usize = 8;
    for i in 0..KEYS * PER_KEY {
        let key = format!("storm-{}", i % KEYS);
        let proto = PROTOS[rng.usize(0..2)];
        let fail = rng.u8(0..10) == 0;
        let pause = rng.u64(0..20);
        let cancel_after = (rng.u8(0..8) == 0).then(|| Duration::from_millis(rng.u64(0..25)));
        if cancel_after.is_some() {
            *cancels.entry(key.clone()).or_default() += 1;
        }
        let delay = Duration::from_millis(rng.u64(0..60));
        let addr = app.addr();
        let finals = Arc::clone(&finals);
        tasks.spawn(async move {
            tokio::time::sleep(delay).await;
            let mut req = post_as("alice", &key).with("x-pause-ms", &pause.to_string());
            if fail {
                req = req.with("x-behave", "fail");
            }
            let exchange = send(addr, proto, &req);
            let got = match cancel_after {
                Some(after) => match tokio::time::timeout(after, exchange).await {
                    Ok(got) => got,
                    Err(_) => return,
                },
                None => exchange.await,
            };
            match got.status {
                StatusCode::CREATED => finals.lock().unwrap().entry(key).or_default().push(got),
                StatusCode::CONFLICT | StatusCode::INTERNAL_SERVER_ERROR => {}
                other => panic!("seed {seed}: unexpected {other}: {got:?}"),
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    // Every final response of a key is one response, byte for byte, and only one of
    // them is not a replay: the run that stored it.
    let finals = finals.lock().unwrap();
    for (key, got) in finals.iter() {
        assert!(
            got.windows(2).all(|w| w[0].body == w[1].body),
            "seed {seed}: {key}: {got:?}"
        );
        let first_hand = got.iter().filter(|g| !g.replayed()).count();
        assert!(
            first_hand <= 1,
            "seed {seed}: {key}: {first_hand} answers not replayed"
        );
    }
    // Per key, the handler answered finally once — or once more per request whose client
    // went away mid-handler (a run cancelled before its store stores nothing).
    let completed = app.orders.completed_by_key.lock().unwrap().clone();
    for (key, runs) in &completed {
        let allowed = 1 + cancels.get(key).copied().unwrap_or(0);
        assert!(
            *runs <= allowed,
            "seed {seed}: {key}: {runs} final runs, {allowed} allowed"
        );
        if finals.contains_key(key) {
            assert!(
                *runs >= 1,
                "seed {seed}: {key}: replayed a response never made"
            );
        }
    }
    println!(
        "storm: {} requests, {} keys answered 201, {} handler runs, {} cancellations",
        KEYS * PER_KEY,
        finals.len(),
        app.runs(),
        cancels.values().sum::<usize>(),
    );
}

/// Building on a store that keeps no responses (RedLock) names the client.
#[tokio::test]
async fn a_store_without_replays_is_refused_at_build() {
    let redlock = tower_lock::backend::redlock::RedLock::new(vec![
        MemoryBackend::new(),
        MemoryBackend::new(),
        MemoryBackend::new(),
    ])
    .unwrap();
    let client = LockClient::new(redlock);
    let err = IdempotencyLayer::builder(client.clone(), scope())
        .build()
        .unwrap_err();
    assert!(
        matches!(err, tower_lock::ConfigError::Unsupported { .. }),
        "{err}"
    );
    // `new` cannot fail, as `LockLayer::new` cannot: the layer answers 500, and runs
    // nothing, where `build` refused.
    let app = app(IdempotencyLayer::new(client, scope())).await;
    let got = send(app.addr(), Proto::Http1, &post_as("alice", "k")).await;
    assert_eq!(got.status, StatusCode::INTERNAL_SERVER_ERROR, "{got:?}");
    got.problem();
    assert_eq!(app.runs(), 0);
    let err = builder(LockClient::new(MemoryBackend::new()))
        .problem_type_base("https://example.com/a b")
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            tower_lock::ConfigError::InvalidSetting {
                name: "problem_type_base",
                ..
            }
        ),
        "{err}"
    );
    let err = builder(LockClient::new(MemoryBackend::new()))
        .key_prefix("a{b")
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            tower_lock::ConfigError::InvalidSetting {
                name: "key_prefix",
                ..
            }
        ),
        "{err}"
    );
    let err = builder(LockClient::new(MemoryBackend::new()))
        .ttl(Duration::ZERO)
        .build()
        .unwrap_err();
    assert!(
        matches!(
            err,
            tower_lock::ConfigError::InvalidSetting { name: "ttl", .. }
        ),
        "{err}"
    );
}

/// Inside a `LockLayer` (one order at a time per user), the handler keeps the outer
/// layer's `HeldLock` — the lock it fences its writes with — and both locks are taken
/// by one owner; the retry is still replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inside_a_lock_layer_the_handler_keeps_the_outer_held_lock() {
    let client = LockClient::new(MemoryBackend::new());
    let per_user = tower_lock::LockLayer::builder(client.clone(), scope())
        .key_prefix("lock:order")
        .fenced(true)
        .build()
        .unwrap();
    let orders = Arc::new(Orders::default());
    let router = Router::new()
        .route(
            "/vouchers/{voucher}/orders",
            post(order)
                .route_layer(builder(client).build().unwrap())
                .route_layer(per_user),
        )
        .with_state(Arc::clone(&orders));
    let app = App {
        server: serve(router).await,
        orders,
    };
    let first = send(app.addr(), Proto::Http2, &post_as("alice", "k")).await;
    let again = send(app.addr(), Proto::Http2, &post_as("alice", "k")).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(again.replayed() && again.body == first.body);
    let held = app.orders.held.lock().unwrap().clone();
    assert_eq!(held.len(), 1);
    assert_eq!(held[0].as_str(), "lock:order:user:{alice}");
}

/// The layer's outcomes per idempotency key (the header's value).
#[derive(Default)]
struct KeyedOutcomes(Mutex<Vec<(String, LayerOutcome)>>);

impl tower_lock::LockObserver for KeyedOutcomes {
    fn layer_outcome(&self, event: tower_lock::LayerEvent<'_>, outcome: LayerOutcome) {
        let key = event.key.map_or(String::new(), |k| {
            // `idempotency:{<scope>%0A<method>%0A<route>%0A<key>}`
            let tag = k.hash_tag().unwrap_or_default();
            tag.rsplit("%0A").next().unwrap_or_default().to_owned()
        });
        self.0.lock().unwrap().push((key, outcome));
    }
}

/// A seeded retry storm on Redis through a link that fails: connections cut, answers
/// held past the response timeout, requests delayed. Requests may now fail (503), and
/// a run whose store step failed stores nothing (or stores with its reply lost), so
/// keys may run more than once; what must hold whatever the faults: a key stores at
/// most one outcome, and every replay is, byte for byte, a response the handler made
/// for that key, the same one for every replay of it.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_storm_through_a_faulty_link_replays_only_what_a_run_made_redis() {
    use common::proxy::{Direction, FaultProxy, Flow};

    let seed: u64 = std::env::var("STORM_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| fastrand::u64(..));
    println!("STORM_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let server = common::redis_server::RedisServer::start().await;
    let proxy = Arc::new(FaultProxy::start(([127, 0, 0, 1], server.port()).into()).await);
    let backend = tower_lock::RedisBackend::builder(format!("redis://{}", proxy.addr()))
        .response_timeout(Duration::from_millis(150))
        .build()
        .await
        .unwrap();
    let observed = Arc::new(KeyedOutcomes::default());
    let client = LockClient::builder(backend)
        .watchdog_lease(Duration::from_millis(900))
        .observer(Arc::clone(&observed))
        .build()
        .unwrap();
    let app = app(builder(client)
        .max_wait(Duration::from_millis(200))
        .build()
        .unwrap())
    .await;

    let nemesis = {
        let proxy = Arc::clone(&proxy);
        let mut rng = fastrand::Rng::with_seed(seed ^ 0x5eed);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(rng.u64(10..60))).await;
                match rng.u8(0..3) {
                    0 => proxy.cut(),
                    1 => {
                        proxy.set_flow(Direction::Down, Flow::Hold);
                        tokio::time::sleep(Duration::from_millis(rng.u64(20..1200))).await;
                        proxy.set_flow(Direction::Down, Flow::Pass);
                    }
                    _ => {
                        let delay = Duration::from_millis(rng.u64(1..40));
                        proxy.set_flow(Direction::Up, Flow::Delay(delay));
                        tokio::time::sleep(Duration::from_millis(rng.u64(20..200))).await;
                        proxy.set_flow(Direction::Up, Flow::Pass);
                    }
                }
            }
        })
    };

    const KEYS: usize = 12;
    const PER_KEY: usize = 10;
    let replays: Arc<Mutex<HashMap<String, Vec<Bytes>>>> = Arc::default();
    let mut statuses: HashMap<u16, usize> = HashMap::new();
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..KEYS * PER_KEY {
        let key = format!("faulty-{}", i % KEYS);
        let proto = PROTOS[rng.usize(0..2)];
        let pause = rng.u64(0..30);
        let delay = Duration::from_millis(rng.u64(0..1500));
        let fail = rng.u8(0..10) == 0;
        let addr = app.addr();
        let replays = Arc::clone(&replays);
        tasks.spawn(async move {
            tokio::time::sleep(delay).await;
            let mut req = post_as("alice", &key).with("x-pause-ms", &pause.to_string());
            if fail {
                req = req.with("x-behave", "fail");
            }
            let got = send(addr, proto, &req).await;
            if got.replayed() {
                replays
                    .lock()
                    .unwrap()
                    .entry(key)
                    .or_default()
                    .push(got.body.clone());
            }
            got.status.as_u16()
        });
    }
    while let Some(done) = tasks.join_next().await {
        *statuses.entry(done.unwrap()).or_default() += 1;
    }
    nemesis.abort();
    for status in statuses.keys() {
        assert!(
            [201, 409, 500, 503].contains(status),
            "seed {seed}: unexpected status {status}: {statuses:?}"
        );
    }
    let made = app.orders.made_by_key.lock().unwrap().clone();
    let outcomes = observed.0.lock().unwrap().clone();
    let replays = replays.lock().unwrap();
    for (key, bodies) in replays.iter() {
        assert!(
            bodies.windows(2).all(|w| w[0] == w[1]),
            "seed {seed}: {key}: two outcomes replayed"
        );
        let made = made.get(key).map(Vec::as_slice).unwrap_or_default();
        assert!(
            made.contains(&bodies[0]),
            "seed {seed}: {key}: replayed {:?}, made {made:?}",
            bodies[0]
        );
    }
    for i in 0..KEYS {
        let key = format!("faulty-{i}");
        let stored = outcomes
            .iter()
            .filter(|(k, o)| *k == key && *o == LayerOutcome::Stored)
            .count();
        assert!(stored <= 1, "seed {seed}: {key} stored {stored} outcomes");
    }
    let count = |o: LayerOutcome| outcomes.iter().filter(|(_, x)| *x == o).count();
    println!(
        "faulty storm: {} requests {statuses:?}; stored {}, not stored {}, replayed {}, in flight {}, unavailable {}, lost {}; {} connections",
        KEYS * PER_KEY,
        count(LayerOutcome::Stored),
        count(LayerOutcome::NotStored),
        count(LayerOutcome::Replayed),
        count(LayerOutcome::InFlight),
        count(LayerOutcome::Unavailable),
        count(LayerOutcome::Lost),
        proxy.stats().accepted,
    );
    // The storm met its faults, and replays happened despite them.
    assert!(
        count(LayerOutcome::Replayed) > 0,
        "seed {seed}: no replay at all"
    );
}

/// Issue 49, finding 3: nothing limited how many responses one caller could have
/// stored (20,000 keys from one user: 10.8 MB in memory, for 24 h; 1 MiB a response
/// filled any store). Each caller may have `max_records_per_scope` at once: a new key
/// past that is `429` with `Retry-After`, and its handler does not run; a retry of a
/// stored key still replays, other callers go on, a response not stored takes no place,
/// and once the caller's oldest expires a new key runs. All callers together may have
/// `max_records`: past that, `503`.
async fn stored_responses_are_capped_per_caller_and_in_all(store: &impl Store) {
    let ttl = Duration::from_secs(3);
    let layer = builder(store.client().await)
        .max_records_per_scope(2)
        .max_records(3)
        .ttl(ttl)
        .build()
        .unwrap();
    let app = app(layer).await;
    let order =
        async |user: &str, key: &str| send(app.addr(), Proto::Http1, &post_as(user, key)).await;
    let started = tokio::time::Instant::now();
    assert_eq!(order("alice", "a1").await.status, StatusCode::CREATED);
    // A 5xx is not stored: it takes no place.
    let failed = send(
        app.addr(),
        Proto::Http2,
        &post_as("alice", "a-fail").with("x-behave", "fail"),
    )
    .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(order("alice", "a2").await.status, StatusCode::CREATED);
    let runs = app.runs();
    let over = order("alice", "a3").await;
    assert_eq!(over.status, StatusCode::TOO_MANY_REQUESTS, "{over:?}");
    let retry_after: u64 = over.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=3).contains(&retry_after), "{retry_after}");
    assert_eq!(
        over.problem()["type"].as_str().unwrap().rsplit('#').next(),
        Some("too-many-records")
    );
    assert_eq!(app.runs(), runs, "the handler did not run");
    assert!(
        order("alice", "a1").await.replayed(),
        "a stored key still replays"
    );
    // Another caller goes on, until everyone's are taken.
    assert_eq!(order("bob", "b1").await.status, StatusCode::CREATED);
    let full = order("carol", "c1").await;
    assert_eq!(full.status, StatusCode::SERVICE_UNAVAILABLE, "{full:?}");
    assert!(full.header("retry-after").is_some());
    assert_eq!(app.runs(), runs + 1);
    // Once alice's oldest has expired, her new key runs.
    wait_until(ttl + DEADLINE, "a place free again", || async {
        order("alice", "a4").await.status == StatusCode::CREATED
    })
    .await;
    assert!(started.elapsed() >= ttl - Duration::from_secs(1));
}

macro_rules! idempotency_tests {
    ($module:ident, $store:expr; $($case:ident),* $(,)?) => {
        mod $module {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $case() {
                    let store = $store.await;
                    super::$case(&store).await;
                }
            )*
        }
    };
    ($module:ident, $store:expr) => {
        idempotency_tests!($module, $store;
            a_retry_after_completion_replays_the_stored_response_byte_for_byte,
            a_retry_while_the_first_is_in_flight_is_409_then_replayed,
            with_max_wait_retries_in_flight_wait_and_replay,
            a_key_reused_for_another_request_is_422,
            keys_are_scoped_to_caller_method_and_route,
            a_missing_key_passes_and_an_unusable_one_is_400_even_when_not_required,
            a_lock_layers_busy_answer_is_never_stored_and_its_retry_runs,
            transient_statuses_are_never_stored_whatever_store_if_says,
            a_5xx_stores_nothing_and_a_4xx_is_replayed,
            the_stripe_preset_replays_a_5xx_but_never_a_not_now,
            a_replay_runs_the_response_hook_and_problems_link_where_told,
            a_streamed_response_that_fits_is_stored_and_replayed,
            a_response_too_large_passes_through_whole_unstored,
            a_slow_stream_is_passed_on_as_it_comes_and_not_stored,
            a_cancelled_request_stores_nothing_and_its_retry_runs,
            a_lost_lock_cancels_the_handler_and_stores_nothing,
            uncovered_methods_pass_and_rejections_can_be_customized,
            a_seeded_retry_storm_runs_each_key_once_and_replays_it_exactly,
            stored_responses_are_capped_per_caller_and_in_all,
        );
    };
}

idempotency_tests!(memory, super::memory());
#[cfg(feature = "redis")]
idempotency_tests!(redis, super::redis());
#[cfg(feature = "postgres")]
idempotency_tests!(postgres, super::postgres());
