//! The flash-sale ("seckill") app: routes, handlers, the store, and the demo burst.
//!
//! Kept apart from `main` so the tests drive exactly this app (`tests/seckill.rs` and
//! `tests/redis_processes.rs` include this file with `#[path]`).
#![allow(dead_code)] // each includer uses a different part

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{Path, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, Request, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use tower_lock::extract::HeldLock;
use tower_lock::idempotency::{
    IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, IdempotencyLayer, IdempotencyRejection,
};
use tower_lock::layer::{KeyError, LockLayer, Rejection};
use tower_lock::{LockClient, LockKey};

/// The header that names the user. A real service would take the user from its
/// authentication (see `ExtensionKey`); a header keeps the demo curl-able.
pub const USER_HEADER: &str = "x-user-id";

/// The namespace of the order lock, `lock:order:{<user id>}`.
const ORDER_LOCK: &str = "lock:order";

pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A store failure, answered with 503.
#[derive(Debug)]
pub struct StoreError(pub String);

/// One order.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Order {
    pub order_id: u64,
    pub voucher_id: u64,
    pub user_id: u64,
    /// The fencing token of the lock the order was placed under.
    pub fencing_token: u64,
}

/// A voucher's state.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct VoucherView {
    pub id: u64,
    pub stock: i64,
    pub orders: u64,
}

/// Where vouchers and orders live. Each method is one step as a database would offer
/// it; only `take_stock` is atomic on its own (`UPDATE ... SET stock = stock - 1 WHERE
/// stock > 0`, or a Lua script in Redis). "Has this user ordered?" followed by "insert
/// the order" is a check-then-act race between a user's concurrent requests: the
/// per-user lock is what makes it safe.
pub trait Store: Send + Sync + 'static {
    /// The voucher, or `None` when there is no such voucher.
    fn voucher(&self, id: u64) -> BoxFut<'_, Result<Option<VoucherView>, StoreError>>;
    /// Whether `user` already has an order for `voucher`.
    fn has_order(&self, voucher: u64, user: u64) -> BoxFut<'_, Result<bool, StoreError>>;
    /// Takes one unit of stock if any is left; returns whether it did.
    fn take_stock(&self, voucher: u64) -> BoxFut<'_, Result<bool, StoreError>>;
    /// Records an order.
    fn insert_order(
        &self,
        voucher: u64,
        user: u64,
        fencing_token: u64,
    ) -> BoxFut<'_, Result<Order, StoreError>>;
    /// Every order of `voucher` (for checking the invariants).
    fn orders(&self, voucher: u64) -> BoxFut<'_, Result<Vec<Order>, StoreError>>;

    /// Starts `user`'s critical section on `voucher` under the lock's `fencing_token`
    /// (0: no lock): a store that enforces fencing raises the user's fence to the token
    /// and refuses (`false`) a token older than one it has seen, so a holder that lost
    /// its lock and acts late is kept out. The default enforces nothing.
    fn fence(
        &self,
        voucher: u64,
        user: u64,
        fencing_token: u64,
    ) -> BoxFut<'_, Result<bool, StoreError>> {
        let _ = (voucher, user, fencing_token);
        Box::pin(async { Ok(true) })
    }

    /// Takes one unit of stock and records the order. A store that enforces fencing
    /// does both in one transaction, and only while the user's fence is still at
    /// `fencing_token` (no newer holder has started since). The default is
    /// [`take_stock`](Store::take_stock) then [`insert_order`](Store::insert_order).
    fn place_order(
        &self,
        voucher: u64,
        user: u64,
        fencing_token: u64,
    ) -> BoxFut<'_, Result<Placed, StoreError>> {
        Box::pin(async move {
            if !self.take_stock(voucher).await? {
                return Ok(Placed::SoldOut);
            }
            Ok(Placed::Created(
                self.insert_order(voucher, user, fencing_token).await?,
            ))
        })
    }
}

/// What [`Store::place_order`] did.
#[derive(Debug, PartialEq, Eq)]
pub enum Placed {
    Created(Order),
    SoldOut,
    /// Refused: a newer lock holder has started on this user since (a stale token).
    Stale,
}

fn stale() -> Response {
    json_error(
        StatusCode::CONFLICT,
        "stale_token",
        "this request's lock was taken over by a newer one; its write was refused",
    )
}

/// The in-memory store: one process.
#[derive(Default)]
pub struct MemoryStore {
    vouchers: Mutex<HashMap<u64, i64>>,
    orders: Mutex<Vec<Order>>,
    next_order: AtomicU64,
}

impl MemoryStore {
    /// A store with one voucher.
    pub fn with_voucher(id: u64, stock: i64) -> Self {
        let store = MemoryStore::default();
        lock(&store.vouchers).insert(id, stock);
        store
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Store for MemoryStore {
    fn voucher(&self, id: u64) -> BoxFut<'_, Result<Option<VoucherView>, StoreError>> {
        Box::pin(async move {
            let Some(stock) = lock(&self.vouchers).get(&id).copied() else {
                return Ok(None);
            };
            let orders = lock(&self.orders)
                .iter()
                .filter(|o| o.voucher_id == id)
                .count() as u64;
            Ok(Some(VoucherView { id, stock, orders }))
        })
    }

    fn has_order(&self, voucher: u64, user: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            Ok(lock(&self.orders)
                .iter()
                .any(|o| o.voucher_id == voucher && o.user_id == user))
        })
    }

    fn take_stock(&self, voucher: u64) -> BoxFut<'_, Result<bool, StoreError>> {
        Box::pin(async move {
            let mut vouchers = lock(&self.vouchers);
            match vouchers.get_mut(&voucher) {
                Some(stock) if *stock > 0 => {
                    *stock -= 1;
                    Ok(true)
                }
                _ => Ok(false),
            }
        })
    }

    fn insert_order(
        &self,
        voucher: u64,
        user: u64,
        fencing_token: u64,
    ) -> BoxFut<'_, Result<Order, StoreError>> {
        Box::pin(async move {
            let order = Order {
                order_id: self.next_order.fetch_add(1, Ordering::Relaxed) + 1,
                voucher_id: voucher,
                user_id: user,
                fencing_token,
            };
            lock(&self.orders).push(order.clone());
            Ok(order)
        })
    }

    fn orders(&self, voucher: u64) -> BoxFut<'_, Result<Vec<Order>, StoreError>> {
        Box::pin(async move {
            Ok(lock(&self.orders)
                .iter()
                .filter(|o| o.voucher_id == voucher)
                .cloned()
                .collect())
        })
    }
}

/// How the app is configured.
#[derive(Clone, Copy, Debug)]
pub struct Settings {
    /// How long an order request waits for its user's lock.
    pub wait: Duration,
    /// Simulated work between "has this user ordered?" and "insert the order" (a
    /// payment call, a slow database): it widens the race the lock closes.
    pub work: Duration,
    /// How long a retried order (the same `Idempotency-Key`) that arrives while its
    /// first request is still in flight waits for that request's answer, to replay it,
    /// before it is answered `409 in_flight`.
    pub wait_first: Duration,
    /// Serve orders without the per-user lock, to see the race.
    pub no_lock: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            wait: Duration::from_millis(50),
            work: Duration::from_millis(20),
            wait_first: Duration::from_secs(1),
            no_lock: false,
        }
    }
}

/// How many times the order handler ran in this process: the proof that a retried
/// order was answered from its stored response instead of ordering again. Also counted
/// as `seckill_order_handler_runs_total` on `/metrics`, for separate processes. Cheap to
/// clone: clones share one count.
#[derive(Clone, Debug, Default)]
pub struct HandlerRuns(Arc<AtomicU64>);

impl HandlerRuns {
    /// The runs so far.
    pub fn count(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }

    fn record(&self) {
        self.0.fetch_add(1, Ordering::SeqCst);
        #[cfg(feature = "metrics")]
        metrics::counter!("seckill_order_handler_runs_total").increment(1);
    }
}

#[derive(Clone)]
struct AppState {
    store: Arc<dyn Store>,
    work: Duration,
    runs: HandlerRuns,
}

/// An error answer: `{"error": code, "message": text}`.
pub fn json_error(status: StatusCode, code: &str, message: &str) -> Response {
    let body = serde_json::json!({ "error": code, "message": message });
    (status, axum::Json(body)).into_response()
}

fn parse_user(value: Option<&HeaderValue>) -> Result<u64, &'static str> {
    let value = value.ok_or("missing header `x-user-id`")?;
    value
        .to_str()
        .ok()
        .and_then(|v| v.parse().ok())
        .ok_or("header `x-user-id` must be a number")
}

/// The order lock's key: `lock:order:{<user id>}`, one lock per user.
fn order_key(parts: &Parts) -> Result<LockKey, KeyError> {
    let user = parse_user(parts.headers.get(USER_HEADER)).map_err(KeyError::new)?;
    Ok(LockKey::namespaced(ORDER_LOCK, &user.to_string())?)
}

/// Whose `Idempotency-Key` it is: the user, as the order lock has it, so that one user
/// can never be answered with another's order. A request without a valid user is not
/// covered: the order lock (or, with `--no-lock`, the handler) answers it `400`.
fn user_scope(parts: &Parts) -> Option<LockKey> {
    let user = parse_user(parts.headers.get(USER_HEADER)).ok()?;
    LockKey::namespaced("user", &user.to_string()).ok()
}

/// The layer's rejections in the app's one JSON error shape, with their status and
/// `Retry-After`.
fn json_rejection(rejection: Rejection) -> Response {
    let code = match rejection {
        Rejection::Busy { .. } => "busy",
        Rejection::BadKey(_) => "bad_request",
        Rejection::Unavailable { .. } => "lock_unavailable",
        Rejection::Lost { .. } => "lock_lost",
        _ => "lock_error",
    };
    let retry_after = rejection
        .retry_after_secs()
        .map(|secs| [(header::RETRY_AFTER, secs.to_string())]);
    let error = json_error(rejection.status(), code, &rejection.message());
    (retry_after, error).into_response()
}

/// The idempotency layer's rejections in the same shape (the layer adds `Retry-After`).
fn json_replay_rejection(rejection: IdempotencyRejection) -> Response {
    let code = match &rejection {
        IdempotencyRejection::InFlight { .. } => "in_flight",
        IdempotencyRejection::Mismatch => "key_reused",
        IdempotencyRejection::Unavailable { .. } => "lock_unavailable",
        IdempotencyRejection::Lost { .. } => "lock_lost",
        rejection if rejection.status().is_client_error() => "bad_request",
        _ => "lock_error",
    };
    json_error(rejection.status(), code, &rejection.detail())
}

/// The app: `POST /vouchers/{id}/orders` (locked per user, retries with an
/// `Idempotency-Key` replayed) and `GET /vouchers/{id}`. The handler counts its runs in
/// `runs`.
///
/// # Errors
///
/// An invalid lock configuration (a wait out of range), or a lock store that keeps no
/// responses for replay.
pub fn app(
    client: LockClient,
    store: Arc<dyn Store>,
    settings: Settings,
    runs: HandlerRuns,
) -> Result<Router, tower_lock::Error> {
    app_on(client.clone(), client, store, settings, runs)
}

/// The app with the users' order locks on `order_locks` and the idempotency keys
/// (their locks and the stored answers) on `replays`: two stores, where the order
/// locks' store keeps no responses (ZooKeeper). The request's one owner holds both its
/// locks, in the same order as on one store.
///
/// # Errors
///
/// As [`app`]; `replays` must keep responses for replay.
pub fn app_on(
    order_locks: LockClient,
    replays: LockClient,
    store: Arc<dyn Store>,
    settings: Settings,
    runs: HandlerRuns,
) -> Result<Router, tower_lock::Error> {
    let state = AppState {
        store,
        work: settings.work,
        runs,
    };
    let mut order = post(create_order);
    if !settings.no_lock {
        let layer = LockLayer::builder(order_locks, order_key)
            .name("orders")
            .max_wait(settings.wait)
            .fenced(true)
            .on_rejection(json_rejection)
            .build()?;
        order = order.route_layer(layer);
    }
    // Added last, the idempotency layer wraps the order lock, on purpose:
    // - A retry is answered from its key's stored response, or told its first is still
    //   in flight (`409 in_flight`), without queueing for the user's lock: a storm of
    //   retries never makes the user's other orders wait, and a retry is never answered
    //   `429 busy` because of its own first request. Inside, every retry would queue for
    //   the user's lock first, and a replay would cost a lock round trip.
    // - One owner, and the locks always taken in one order: the order lock finds the
    //   idempotency layer's `Locks` extension and holds the user's key as that request's
    //   owner (as a nested `LockLayer` does). Every request takes its idempotency key's
    //   lock before the user's, and no holder of a user's lock ever waits for an
    //   idempotency key's, so two requests never wait for each other in a cycle.
    // - The handler still fences with the order lock's token: the inner `LockLayer`
    //   puts its `HeldLock` over the idempotency layer's.
    // The order lock's own answers reach the idempotency layer as the handler's would;
    // its `429 busy` (and its 503s) are marked transient, and never stored. A `409
    // stale_token` (a newer holder took the user's lock over) is stored only if this
    // request's idempotency lock outlived that takeover: a pause or an outage long
    // enough to lose the user's lock loses the idempotency lock, renewed by the same
    // watchdog, too, and nothing is stored for a request whose own lock was lost.
    let replays = IdempotencyLayer::builder(replays, user_scope)
        .name("order-replays")
        .max_wait(settings.wait_first)
        .on_rejection(json_replay_rejection)
        .build()?;
    order = order.route_layer(replays);
    Ok(Router::new()
        .route("/vouchers/{id}/orders", order)
        .route("/vouchers/{id}", get(show_voucher))
        .with_state(state))
}

async fn show_voucher(State(state): State<AppState>, Path(id): Path<u64>) -> Response {
    match state.store.voucher(id).await {
        Ok(Some(voucher)) => axum::Json(voucher).into_response(),
        Ok(None) => json_error(StatusCode::NOT_FOUND, "not_found", "no such voucher"),
        Err(StoreError(e)) => json_error(StatusCode::SERVICE_UNAVAILABLE, "store", &e),
    }
}

async fn create_order(
    State(state): State<AppState>,
    Path(id): Path<u64>,
    held: Option<HeldLock>,
    headers: HeaderMap,
) -> Response {
    state.runs.record();
    // The layer has checked the header already; without the layer (--no-lock) this
    // is where a bad one is caught.
    let user = match parse_user(headers.get(USER_HEADER)) {
        Ok(user) => user,
        Err(message) => return json_error(StatusCode::BAD_REQUEST, "bad_request", message),
    };
    // The order lock's token only: the store fences per user, and the token of another
    // key (the idempotency lock's, with `--no-lock`) is not ordered with the user's.
    let token = held
        .filter(|held| held.key().namespace() == ORDER_LOCK)
        .and_then(|held| held.fencing_token())
        .map_or(0, |t| t.get());
    match place(&state, id, user, token).await {
        Ok(response) => response,
        Err(StoreError(e)) => json_error(StatusCode::SERVICE_UNAVAILABLE, "store", &e),
    }
}

async fn place(
    state: &AppState,
    voucher: u64,
    user: u64,
    fencing_token: u64,
) -> Result<Response, StoreError> {
    let store = &state.store;
    if store.voucher(voucher).await?.is_none() {
        return Ok(json_error(
            StatusCode::NOT_FOUND,
            "not_found",
            "no such voucher",
        ));
    }
    if !store.fence(voucher, user, fencing_token).await? {
        return Ok(stale());
    }
    if store.has_order(voucher, user).await? {
        return Ok(json_error(
            StatusCode::CONFLICT,
            "duplicate_order",
            "this user already ordered this voucher",
        ));
    }
    if !state.work.is_zero() {
        tokio::time::sleep(state.work).await;
    }
    match store.place_order(voucher, user, fencing_token).await? {
        Placed::Created(order) => Ok((StatusCode::CREATED, axum::Json(order)).into_response()),
        Placed::SoldOut => Ok(json_error(StatusCode::CONFLICT, "sold_out", "sold out")),
        Placed::Stale => Ok(stale()),
    }
}

/// The demo burst's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Burst {
    /// Users, all ordering at once.
    pub users: u64,
    /// Orders per user, sent at once, each with an `Idempotency-Key` of its own.
    pub per_user: u64,
    /// How many more times each order is sent with its key, as by a client whose
    /// answers get lost: the odd-numbered retries together with the first send (while
    /// it is in flight), the even-numbered ones once the first has its answer.
    pub retries: u64,
    /// At most this many requests in flight at once, to stay within file-descriptor
    /// limits.
    pub in_flight: usize,
}

impl Default for Burst {
    fn default() -> Self {
        Burst {
            users: 300,
            per_user: 5,
            retries: 2,
            in_flight: 250,
        }
    }
}

/// What the demo burst saw.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Tally {
    /// HTTP requests sent, retries included.
    pub requests: u64,
    /// Orders sent: distinct `Idempotency-Key`s.
    pub keys: u64,
    /// Answers the handler gave (replays are counted apart): orders created (201), ...
    pub created: u64,
    /// ... orders refused as the user's second (409 `duplicate_order`) ...
    pub duplicates: u64,
    /// ... and orders refused for want of stock (409 `sold_out`).
    pub sold_out: u64,
    /// Answers replayed from their key's stored response (`Idempotent-Replayed: true`).
    pub replayed: u64,
    /// The retries that found a stored response: of each key's answers (201 or 409
    /// `duplicate_order` / `sold_out`, from the handler or replayed), all but the one
    /// its handler's run gave.
    pub retries_answered: u64,
    /// Keys whose answers are not all the same bytes.
    pub keys_differ: u64,
    /// `429 busy` (another order of the user held their lock), sent again after
    /// `Retry-After`.
    pub busy: u64,
    /// `409 in_flight` (the key's first request was still running), sent again after
    /// `Retry-After`.
    pub in_flight: u64,
    /// Anything else (transport errors, unexpected statuses, a send that got no answer
    /// in all its attempts).
    pub other: u64,
    /// The first of those, to tell what went wrong.
    pub first_other: Option<String>,
    pub stock_left: i64,
    pub orders: u64,
}

impl Tally {
    /// Counts what the requests of one order (one key) got.
    fn count_order(&mut self, outcomes: Vec<Outcome>) {
        self.keys += 1;
        let mut answers: Vec<(StatusCode, Bytes)> = Vec::new();
        for outcome in outcomes {
            self.requests += u64::from(!matches!(outcome, Outcome::GaveUp(_)));
            match outcome {
                Outcome::Answer {
                    kind,
                    replayed,
                    status,
                    body,
                } => {
                    *match (replayed, kind) {
                        (true, _) => &mut self.replayed,
                        (false, Answered::Created) => &mut self.created,
                        (false, Answered::Duplicate) => &mut self.duplicates,
                        (false, Answered::SoldOut) => &mut self.sold_out,
                    } += 1;
                    answers.push((status, body));
                }
                Outcome::Busy(_) => self.busy += 1,
                Outcome::InFlight(_) => self.in_flight += 1,
                Outcome::Other(what) | Outcome::GaveUp(what) => {
                    self.other += 1;
                    self.first_other.get_or_insert(what);
                }
            }
        }
        if let Some(first) = answers.first() {
            self.retries_answered += answers.len() as u64 - 1;
            if answers.iter().any(|answer| answer != first) {
                self.keys_differ += 1;
            }
        }
    }
}

/// The invariants after a burst, each with whether it held.
#[derive(Debug)]
pub struct Verdict {
    pub checks: Vec<(String, bool)>,
}

impl Verdict {
    pub fn held(&self) -> bool {
        self.checks.iter().all(|(_, ok)| *ok)
    }
}

type HttpClient = Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>;

/// Fires `shape.users` × `shape.per_user` concurrent orders, each with its own
/// `Idempotency-Key` and sent `1 + shape.retries` times with it, at the servers on
/// `addrs` (the sends of one order spread over the servers in turn, so that its retries
/// reach other servers than its first; at most `shape.in_flight` requests at once).
/// A send answered `429 busy` or `409 in_flight` is sent again after `Retry-After`,
/// until it has its answer. Then reads the voucher back from the first server.
///
/// # Errors
///
/// When `addrs` is empty or the voucher cannot be read back.
pub async fn burst(addrs: &[SocketAddr], voucher: u64, shape: Burst) -> Result<Tally, String> {
    let Some(&first) = addrs.first() else {
        return Err("no server to send the burst to".into());
    };
    let client: HttpClient = Client::builder(TokioExecutor::new()).build_http();
    let gate = Arc::new(tokio::sync::Semaphore::new(shape.in_flight.max(1)));
    // Keys of this burst only: the responses an earlier run stored in the same store
    // are replayed for a day, and must not answer this run's orders.
    let run = format!("{:016x}", fastrand::u64(..));
    let mut tasks = tokio::task::JoinSet::new();
    for user in 1..=shape.users {
        for i in 0..shape.per_user {
            let order = Arc::new(OrderSender {
                client: client.clone(),
                gate: Arc::clone(&gate),
                voucher,
                user,
                key: format!("{run}-{user}-{i}"),
            });
            let to = (0..=shape.retries)
                .map(|j| addrs[((user + i + j) % addrs.len() as u64) as usize])
                .collect();
            tasks.spawn(order.send_all(to));
        }
    }
    let mut tally = Tally::default();
    for outcomes in tasks.join_all().await {
        tally.count_order(outcomes);
    }
    let uri = format!("http://{first}/vouchers/{voucher}");
    let res = client
        .get(uri.parse().map_err(|e| format!("{e}"))?)
        .await
        .map_err(|e| format!("reading the voucher: {e}"))?;
    let body = res
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    let view: serde_json::Value = serde_json::from_slice(&body).map_err(|e| e.to_string())?;
    tally.stock_left = view["stock"].as_i64().ok_or("no stock in the voucher")?;
    tally.orders = view["orders"].as_u64().ok_or("no orders in the voucher")?;
    Ok(tally)
}

/// Which answer an order got.
#[derive(Debug, Clone, Copy)]
enum Answered {
    Created,
    Duplicate,
    SoldOut,
}

/// What one request got.
#[derive(Debug)]
enum Outcome {
    /// An answer to the order (201, or 409 `duplicate_order` or `sold_out`): the
    /// handler's, or its replay.
    Answer {
        kind: Answered,
        replayed: bool,
        status: StatusCode,
        body: Bytes,
    },
    /// `429 busy`: to be sent again after this long.
    Busy(Duration),
    /// `409 in_flight`: to be sent again after this long.
    InFlight(Duration),
    /// Anything else.
    Other(String),
    /// No answer in all the attempts of one send (not a request itself).
    GaveUp(String),
}

/// How many times one send is made before it gives up waiting for an answer.
const ATTEMPTS: u32 = 30;

/// The longest pause between two attempts of a send, whatever `Retry-After` says.
const LONGEST_PAUSE: Duration = Duration::from_secs(5);

/// One order, as its client sends it: a user, a voucher and an `Idempotency-Key`.
struct OrderSender {
    client: HttpClient,
    gate: Arc<tokio::sync::Semaphore>,
    voucher: u64,
    user: u64,
    key: String,
}

impl OrderSender {
    /// Sends the order to each of `addrs` with its key: the first send and the
    /// odd-numbered retries at once, then each even-numbered retry once the first send
    /// has its answer.
    async fn send_all(self: Arc<Self>, addrs: Vec<SocketAddr>) -> Vec<Outcome> {
        let Some(&first) = addrs.first() else {
            return Vec::new();
        };
        let racers: Vec<SocketAddr> = addrs.iter().skip(1).step_by(2).copied().collect();
        // The first send and the retries racing it take their permits together, so
        // that they are in flight together.
        let permits = u32::try_from(racers.len() + 1).unwrap_or(u32::MAX);
        let mut permits = match Arc::clone(&self.gate).acquire_many_owned(permits).await {
            Ok(permits) => permits,
            Err(e) => return vec![Outcome::GaveUp(e.to_string())],
        };
        let mut racing = tokio::task::JoinSet::new();
        for addr in racers {
            let (order, permit) = (Arc::clone(&self), permits.split(1));
            racing.spawn(async move { order.send_until_answered(addr, permit).await });
        }
        let mut outcomes = self.send_until_answered(first, Some(permits)).await;
        for &addr in addrs.iter().skip(2).step_by(2) {
            outcomes.extend(self.send_until_answered(addr, None).await);
        }
        for racer in racing.join_all().await {
            outcomes.extend(racer);
        }
        outcomes
    }

    /// Sends the order to `addr` until it is answered: again after each `429 busy` or
    /// `409 in_flight`, once its `Retry-After` has passed. The first attempt goes with
    /// `permit` when given one.
    async fn send_until_answered(
        &self,
        addr: SocketAddr,
        mut permit: Option<tokio::sync::OwnedSemaphorePermit>,
    ) -> Vec<Outcome> {
        let mut outcomes = Vec::new();
        for _ in 0..ATTEMPTS {
            let permit = match permit.take() {
                Some(permit) => permit,
                None => match Arc::clone(&self.gate).acquire_owned().await {
                    Ok(permit) => permit,
                    Err(e) => {
                        outcomes.push(Outcome::GaveUp(e.to_string()));
                        return outcomes;
                    }
                },
            };
            let outcome = self.send(addr).await;
            drop(permit);
            let pause = match outcome {
                Outcome::Busy(pause) | Outcome::InFlight(pause) => pause,
                outcome => {
                    outcomes.push(outcome);
                    return outcomes;
                }
            };
            outcomes.push(outcome);
            tokio::time::sleep(pause.min(LONGEST_PAUSE)).await;
        }
        outcomes.push(Outcome::GaveUp(format!(
            "no answer to user {}'s order {} after {ATTEMPTS} attempts",
            self.user, self.key
        )));
        outcomes
    }

    /// One request, and what it got.
    async fn send(&self, addr: SocketAddr) -> Outcome {
        let req = Request::post(format!("http://{addr}/vouchers/{}/orders", self.voucher))
            .header(USER_HEADER, self.user)
            .header(IDEMPOTENCY_KEY, &self.key)
            .body(Empty::new());
        let req = match req {
            Ok(req) => req,
            Err(e) => return Outcome::Other(e.to_string()),
        };
        let res = match self.client.request(req).await {
            Ok(res) => res,
            Err(e) => return Outcome::Other(e.to_string()),
        };
        let (head, body) = res.into_parts();
        let body = match body.collect().await {
            Ok(body) => body.to_bytes(),
            Err(e) => return Outcome::Other(e.to_string()),
        };
        let error = serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v["error"].as_str().map(str::to_owned));
        let kind = match (head.status, error.as_deref()) {
            (StatusCode::CREATED, _) => Answered::Created,
            (StatusCode::CONFLICT, Some("duplicate_order")) => Answered::Duplicate,
            (StatusCode::CONFLICT, Some("sold_out")) => Answered::SoldOut,
            (StatusCode::CONFLICT, Some("in_flight")) => {
                return Outcome::InFlight(retry_after(&head.headers));
            }
            (StatusCode::TOO_MANY_REQUESTS, _) => return Outcome::Busy(retry_after(&head.headers)),
            (status, _) => {
                let body = String::from_utf8_lossy(&body);
                return Outcome::Other(format!("{status}: {body}"));
            }
        };
        Outcome::Answer {
            kind,
            replayed: head
                .headers
                .get(IDEMPOTENT_REPLAYED)
                .is_some_and(|v| v == "true"),
            status: head.status,
            body,
        }
    }
}

/// `Retry-After` in seconds, as the layers send it; 1 s when it is missing.
fn retry_after(headers: &HeaderMap) -> Duration {
    headers
        .get(header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok())
        .map_or(Duration::from_secs(1), Duration::from_secs)
}

/// Checks the invariants against the store, the tally and the number of times the
/// order handler ran on the servers (`handler_runs`: the sum of their
/// [`HandlerRuns`]).
///
/// # Errors
///
/// When the store cannot be read.
pub async fn verdict(
    store: &dyn Store,
    voucher: u64,
    initial_stock: i64,
    tally: &Tally,
    handler_runs: u64,
) -> Result<Verdict, StoreError> {
    let orders = store.orders(voucher).await?;
    let mut per_user: BTreeMap<u64, u32> = BTreeMap::new();
    for o in &orders {
        *per_user.entry(o.user_id).or_default() += 1;
    }
    let worst = per_user.values().copied().max().unwrap_or(0);
    let count = orders.len() as i64;
    let (keys, replayed, retries) = (tally.keys, tally.replayed, tally.retries_answered);
    Ok(Verdict {
        checks: vec![
            (
                format!("at most one order per user (most for one user: {worst})"),
                worst <= 1,
            ),
            (
                format!(
                    "orders + stock = initial stock ({count} + {} = {initial_stock})",
                    tally.stock_left
                ),
                count + tally.stock_left == initial_stock,
            ),
            (
                format!("stock >= 0 ({})", tally.stock_left),
                tally.stock_left >= 0,
            ),
            (
                format!(
                    "201 answers from the handler = orders stored ({} = {count})",
                    tally.created
                ),
                tally.created as i64 == count,
            ),
            (
                format!("handler runs = distinct keys ({handler_runs} = {keys})"),
                handler_runs == keys,
            ),
            (
                format!("replayed = retries that found a stored response ({replayed} = {retries})"),
                replayed == retries,
            ),
            (
                format!(
                    "every answer of a key is the same bytes (keys with two answers: {})",
                    tally.keys_differ
                ),
                tally.keys_differ == 0,
            ),
        ],
    })
}

/// The demo's table.
pub fn table(tally: &Tally) -> String {
    let rows = [
        ("requests", tally.requests as i64),
        ("orders (keys)", tally.keys as i64),
        ("created (201)", tally.created as i64),
        ("duplicates (409)", tally.duplicates as i64),
        ("sold out (409)", tally.sold_out as i64),
        ("replayed (201/409)", tally.replayed as i64),
        ("busy (429), sent again", tally.busy as i64),
        ("in flight (409), again", tally.in_flight as i64),
        ("other", tally.other as i64),
        ("stock left", tally.stock_left),
    ];
    let mut out =
        String::from("| outcome                |  count |\n|------------------------|-------:|\n");
    for (name, n) in rows {
        out.push_str(&format!("| {name:<22} | {n:>6} |\n"));
    }
    out
}
