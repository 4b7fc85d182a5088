//! Regression tests for the sequences an independent safety review found: ways for two
//! owners to believe they hold one exclusive lock, or for a cancelled attempt to leave
//! state behind in the store.
//!
//! Each test asserts the behaviour the library must have once fixed (the review's
//! "intended" behaviour), one test per sequence and backend. Memory cases run on paused
//! tokio time where leases or timeouts are involved; Redis cases run on a real
//! `redis-server` per test (`common::redis_server`) in real time.
//!
//! Where a sequence needs a reply to arrive late, or a call to fail, the store is wrapped
//! by [`Faulty`], which delegates every call to the real backend and only adds delays or
//! failures around it; nothing is mocked.

use crate::common;
use tower_lock::backend::StoreAdmin as _;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{spawn_acquire, wait_until};
use tokio::time::Instant;
use tower_lock::backend::{
    Acquire, BoxFuture, Intercept, Intercepted, LockBackend, LockMode, LockRequest, Release,
};
use tower_lock::kinds::MultiLock;
use tower_lock::{
    Error, Lease, LockClient, LockGuard, LockKey, MemoryBackend, Owner, Result, StoreError,
    StoreErrorKind,
};

// ---------------------------------------------------------------------------------------
// The fault-injecting wrapper
// ---------------------------------------------------------------------------------------

/// Faults armed on a [`Faulty`] backend.
#[derive(Default)]
struct Faults {
    /// The next acquire reaches the store and takes effect there, then its reply is held
    /// back this long (a slow network on the way back).
    delay_next_reply: Option<Duration>,
    /// The next acquire fails with a retryable backend error without reaching the store.
    fail_next_unsent: bool,
    /// Every release waits this long before it reaches the store.
    release_delay: Option<Duration>,
    /// The next release waits this long before it reaches the store (so a release sent
    /// after it can overtake it, as on another connection).
    delay_next_release: Option<Duration>,
    /// Every renew reaches the store and takes effect there, then its reply is held
    /// back this long.
    renew_reply_delay: Option<Duration>,
    /// The next `renew_many` (the watchdog's) reaches the store and takes effect there,
    /// then its reply waits until this gate opens.
    hold_next_renewals_reply: Option<Gate>,
    /// Every `renew_many` reaches the store and takes effect there, then its answer is
    /// lost: it fails as an outage.
    lose_renewal_answers: bool,
}

/// A gate a call waits at until the test opens it.
#[derive(Clone)]
struct Gate(Arc<tokio::sync::watch::Sender<bool>>);

impl Gate {
    fn new() -> Self {
        Gate(Arc::new(tokio::sync::watch::Sender::new(false)))
    }

    fn open(&self) {
        self.0.send_replace(true);
    }

    async fn pass(&self) {
        let _ = self.0.subscribe().wait_for(|&open| open).await;
    }
}

/// What a [`Faulty`] backend has seen, so tests can check that a fault really hit.
#[derive(Default)]
struct Seen {
    /// Acquires answered by the store.
    acquires: AtomicUsize,
    /// Acquires applied by the store whose reply was then delayed.
    delayed_replies: AtomicUsize,
    /// Acquires failed without reaching the store.
    failed_unsent: AtomicUsize,
    releases_started: AtomicUsize,
    releases_finished: AtomicUsize,
    /// Watchdog renewals applied by the store whose reply is held at a gate.
    held_renewal_replies: AtomicUsize,
    /// Watchdog renewals applied by the store whose answer was lost.
    lost_renewal_answers: AtomicUsize,
}

/// A real backend with faults injected around its calls by an [`Injector`]. Every call
/// reaches the wrapped store through the path production takes (the in-process fast
/// path, the store's own `abandon`), delayed or failed only where a fault is armed.
type Faulty = Intercepted<Arc<dyn LockBackend>, Injector>;

fn faulty(inner: impl LockBackend) -> Faulty {
    Intercepted::new(Arc::new(inner), Injector::default())
}

/// The faults armed on a [`Faulty`] backend, and what they hit.
#[derive(Clone, Default)]
struct Injector {
    faults: Arc<Mutex<Faults>>,
    seen: Arc<Seen>,
}

impl Injector {
    fn arm(&self, f: impl FnOnce(&mut Faults)) {
        f(&mut self.faults.lock().unwrap());
    }

    fn acquires(&self) -> usize {
        self.seen.acquires.load(Ordering::SeqCst)
    }

    fn delayed_replies(&self) -> usize {
        self.seen.delayed_replies.load(Ordering::SeqCst)
    }

    #[cfg_attr(not(feature = "axum"), allow(dead_code))]
    fn failed_unsent(&self) -> usize {
        self.seen.failed_unsent.load(Ordering::SeqCst)
    }

    fn held_renewal_replies(&self) -> usize {
        self.seen.held_renewal_replies.load(Ordering::SeqCst)
    }

    /// Releases started (spawned ones and the store's own `abandon` included) that have
    /// not finished.
    fn releases_in_flight(&self) -> usize {
        self.seen.releases_started.load(Ordering::SeqCst)
            - self.seen.releases_finished.load(Ordering::SeqCst)
    }

    /// Whether an acquire fault is armed: the next acquisition then goes the async way.
    fn acquire_armed(&self) -> bool {
        let faults = self.faults.lock().unwrap();
        faults.delay_next_reply.is_some() || faults.fail_next_unsent
    }

    /// The delay armed for the next release, taken.
    fn release_delay(&self) -> Option<Duration> {
        let mut faults = self.faults.lock().unwrap();
        faults.delay_next_release.take().or(faults.release_delay)
    }

    /// Whether a release delay is armed: the next release then goes the async way.
    fn release_armed(&self) -> bool {
        let faults = self.faults.lock().unwrap();
        faults.delay_next_release.is_some() || faults.release_delay.is_some()
    }

    /// A release starts: counted finished when the returned value is dropped.
    fn release_started(&self) -> ReleaseInFlight {
        self.seen.releases_started.fetch_add(1, Ordering::SeqCst);
        ReleaseInFlight(Arc::clone(&self.seen))
    }
}

/// Counts a release as finished when its future completes or is dropped.
struct ReleaseInFlight(Arc<Seen>);

impl Drop for ReleaseInFlight {
    fn drop(&mut self) {
        self.0.releases_finished.fetch_add(1, Ordering::SeqCst);
    }
}

type Inner = Arc<dyn LockBackend>;

impl Intercept<Inner> for Injector {
    fn acquire<'a>(
        &'a self,
        inner: &'a Inner,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move {
            let (delay, fail) = {
                let mut faults = self.faults.lock().unwrap();
                (
                    faults.delay_next_reply.take(),
                    std::mem::take(&mut faults.fail_next_unsent),
                )
            };
            if fail {
                self.seen.failed_unsent.fetch_add(1, Ordering::SeqCst);
                return Err(StoreError::msg(
                    StoreErrorKind::Unavailable,
                    "connection reset before the request was sent (injected)",
                )
                .into());
            }
            let outcome = inner.acquire(req).await;
            self.seen.acquires.fetch_add(1, Ordering::SeqCst);
            if let Some(delay) = delay {
                self.seen.delayed_replies.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(delay).await;
            }
            outcome
        })
    }

    fn acquire_now(&self, inner: &Inner, req: &LockRequest) -> Option<Result<Acquire>> {
        if self.acquire_armed() {
            return None;
        }
        let answer = inner.local()?.acquire_now(req)?;
        self.seen.acquires.fetch_add(1, Ordering::SeqCst);
        Some(answer)
    }

    fn renew<'a>(&'a self, inner: &'a Inner, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let delay = self.faults.lock().unwrap().renew_reply_delay;
            let renewed = inner.renew(req).await;
            if let Some(delay) = delay {
                tokio::time::sleep(delay).await;
            }
            renewed
        })
    }

    fn renew_many<'a>(
        &'a self,
        inner: &'a Inner,
        reqs: &'a [LockRequest],
    ) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            let (gate, lose) = {
                let mut faults = self.faults.lock().unwrap();
                (
                    faults.hold_next_renewals_reply.take(),
                    faults.lose_renewal_answers,
                )
            };
            let renewed = inner.renew_many(reqs).await;
            if let Some(gate) = gate {
                self.seen
                    .held_renewal_replies
                    .fetch_add(1, Ordering::SeqCst);
                gate.pass().await;
            }
            if lose {
                self.seen
                    .lost_renewal_answers
                    .fetch_add(1, Ordering::SeqCst);
                let lost = StoreError::msg(
                    StoreErrorKind::Unavailable,
                    "the renewal's answer was lost (injected)",
                );
                return reqs.iter().map(|_| Err(lost.clone().into())).collect();
            }
            renewed
        })
    }

    fn release<'a>(
        &'a self,
        inner: &'a Inner,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Release>> {
        let in_flight = self.release_started();
        Box::pin(async move {
            let _in_flight = in_flight;
            if let Some(delay) = self.release_delay() {
                tokio::time::sleep(delay).await;
            }
            inner.release(req).await
        })
    }

    fn release_now(&self, inner: &Inner, req: &LockRequest) -> Option<Result<Release>> {
        if self.release_armed() {
            return None;
        }
        let answer = inner.local()?.release_now(req)?;
        drop(self.release_started());
        Some(answer)
    }

    /// The store's own `abandon`, held back by the release delays as a release is: a
    /// slow store is slow to take back too.
    fn abandon<'a>(&'a self, inner: &'a Inner, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        let in_flight = self.release_started();
        Box::pin(async move {
            let _in_flight = in_flight;
            if let Some(delay) = self.release_delay() {
                tokio::time::sleep(delay).await;
            }
            inner.abandon(req).await
        })
    }
}

// ---------------------------------------------------------------------------------------
// The two stores
// ---------------------------------------------------------------------------------------

/// A store under test: the wrapped backend every client uses, and what the store holds.
trait Store {
    fn faulty(&self) -> &Faulty;

    /// A new client (a new set of owners) on the store.
    fn client(&self) -> LockClient {
        LockClient::new(self.faulty().clone())
    }

    /// The holds on `key`, described for messages; empty when nothing is held.
    async fn holders(&self, key: &LockKey) -> Vec<String>;

    /// How many waiters the store has queued for `key` (fair and read-write queue).
    async fn queue_len(&self, key: &LockKey) -> usize;

    /// How many waiters of this process are subscribed for `key`.
    fn waiters(&self, key: &LockKey) -> usize;

    /// Waits until nothing holds or queues on `key`, or panics saying what was left.
    async fn wait_clear(&self, key: &LockKey, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(3);
        loop {
            let holders = self.holders(key).await;
            let queued = self.queue_len(key).await;
            if holders.is_empty() && queued == 0 {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {key} still has holds {holders:?} and {queued} queued waiter(s)"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

struct Memory {
    backend: MemoryBackend,
    faulty: Faulty,
}

impl Memory {
    fn new() -> Self {
        let backend = MemoryBackend::new();
        Memory {
            faulty: faulty(backend.clone()),
            backend,
        }
    }
}

impl Store for Memory {
    fn faulty(&self) -> &Faulty {
        &self.faulty
    }

    async fn holders(&self, key: &LockKey) -> Vec<String> {
        self.backend
            .holders(key)
            .into_iter()
            .map(|h| format!("{} {} x{}", h.hold_id, h.mode, h.holds))
            .collect()
    }

    async fn queue_len(&self, key: &LockKey) -> usize {
        self.backend.queue_len(key)
    }

    fn waiters(&self, key: &LockKey) -> usize {
        self.backend.waiters(key)
    }
}

#[cfg(feature = "redis")]
struct Redis {
    server: common::redis_server::RedisServer,
    backend: tower_lock::RedisBackend,
    faulty: Faulty,
}

#[cfg(feature = "redis")]
impl Redis {
    async fn start() -> Self {
        let server = common::redis_server::RedisServer::start().await;
        let backend = tower_lock::RedisBackend::connect(server.url())
            .await
            .unwrap();
        Redis {
            faulty: faulty(backend.clone()),
            backend,
            server,
        }
    }

    async fn pttl(&self, key: &LockKey) -> i64 {
        redis::cmd("PTTL")
            .arg(self.backend.lock_name(key))
            .query_async(&mut self.server.conn().await)
            .await
            .unwrap()
    }
}

#[cfg(feature = "redis")]
impl Store for Redis {
    fn faulty(&self) -> &Faulty {
        &self.faulty
    }

    async fn holders(&self, key: &LockKey) -> Vec<String> {
        let fields: Vec<(String, String)> = redis::cmd("HGETALL")
            .arg(self.backend.lock_name(key))
            .query_async(&mut self.server.conn().await)
            .await
            .unwrap();
        fields
            .into_iter()
            .filter(|(field, _)| field != "mode")
            .map(|(field, holds)| format!("{field} x{holds}"))
            .collect()
    }

    async fn queue_len(&self, key: &LockKey) -> usize {
        redis::cmd("LLEN")
            .arg(self.backend.queue_name(key))
            .query_async(&mut self.server.conn().await)
            .await
            .unwrap()
    }

    fn waiters(&self, key: &LockKey) -> usize {
        self.backend.local_waiters(key)
    }
}

// ---------------------------------------------------------------------------------------
// Shared checks
// ---------------------------------------------------------------------------------------

/// Watches `guard`'s lock for at least `window`, and on until no release is in flight on
/// the wrapper (a late release is what frees a hold behind its guard's back): another
/// owner's `try_lock` must be busy throughout, and the guard must not report itself
/// lost. Returns what went wrong, prefixed with `what`.
async fn held_exclusively(
    faulty: &Faulty,
    intruder: &LockClient,
    guard: &LockGuard,
    window: Duration,
    what: &str,
) -> Vec<String> {
    let lock = intruder
        .lock_in_mode(guard.key().clone(), guard.mode())
        .unwrap()
        .with_owner(intruder.new_owner());
    let started = Instant::now();
    loop {
        if guard.is_lost() {
            return vec![format!("{what}: the guard reports its lock lost")];
        }
        match lock.try_lock().await {
            Err(e) if e.is_busy() => {}
            Ok(stolen) => {
                let _ = stolen.unlock().await;
                return vec![format!(
                    "{what}: another owner acquired {} while the guard lived",
                    guard.key()
                )];
            }
            Err(e) => return vec![format!("{what}: the other owner's try_lock failed: {e}")],
        }
        let elapsed = started.elapsed();
        if elapsed >= window && faulty.intercept().releases_in_flight() == 0 {
            return Vec::new();
        }
        assert!(
            elapsed < window + Duration::from_secs(5),
            "{what}: a release stayed in flight for 5 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Fails listing `violations` (the first few, when there are many).
fn assert_none(violations: Vec<String>) {
    const SHOWN: usize = 8;
    if violations.is_empty() {
        return;
    }
    let more = match violations.len().saturating_sub(SHOWN) {
        0 => String::new(),
        n => format!("\n  ... and {n} more"),
    };
    panic!(
        "{} violation(s):\n  {}{more}",
        violations.len(),
        violations[..violations.len().min(SHOWN)].join("\n  ")
    );
}

fn key(name: impl Into<String>) -> LockKey {
    LockKey::new(name.into()).unwrap()
}

/// How long to watch a hold for a late release: virtual time on memory, real on Redis.
const WATCH: Duration = Duration::from_millis(150);

// ---------------------------------------------------------------------------------------
// 1. Drop, then re-lock by the same owner
// ---------------------------------------------------------------------------------------

/// How the owner is made explicit.
#[derive(Clone, Copy, Debug)]
enum Via {
    WithOwner,
    Scope,
}

/// Locks, drops the guard (its release is spawned) and locks again at once, as
/// `lock`'s owner (explicit, or the current scope's). The second guard's lock must stay
/// held while it lives, and its unlock must succeed.
async fn relock_once(
    store: &impl Store,
    intruder: &LockClient,
    lock: &tower_lock::Lock,
    what: &str,
) -> Vec<String> {
    let g1 = lock.lock().await.unwrap();
    drop(g1);
    let g2 = lock.lock().await.unwrap();
    let mut violations = held_exclusively(store.faulty(), intruder, &g2, WATCH, what).await;
    if let Err(e) = g2.unlock().await {
        violations.push(format!("{what}: the second guard's unlock failed: {e}"));
    }
    violations
}

/// [`relock_once`] `iterations` times, each on a fresh key and owner.
async fn drop_then_relock(store: &impl Store, via: Via, iterations: usize) {
    let client = store.client();
    let intruder = store.client();
    let mut violations = Vec::new();
    for i in 0..iterations {
        let key = key(format!("relock-{via:?}-{i}"));
        let owner = client.new_owner();
        let lock = client.get_lock(&key).unwrap();
        let what = format!("run {i}");
        violations.extend(match via {
            Via::WithOwner => relock_once(store, &intruder, &lock.with_owner(owner), &what).await,
            Via::Scope => {
                owner
                    .scope(relock_once(store, &intruder, &lock, &what))
                    .await
            }
        });
        store.wait_clear(&key, &what).await;
    }
    assert_none(violations);
}

// Sequence 1 (drop, then re-lock by the same owner), `Lock::with_owner`.
#[tokio::test(start_paused = true)]
async fn drop_then_relock_with_owner_keeps_the_new_hold_memory() {
    drop_then_relock(&Memory::new(), Via::WithOwner, 5).await;
}

// Sequence 1 (drop, then re-lock by the same owner), `Owner::scope`.
#[tokio::test(start_paused = true)]
async fn drop_then_relock_in_an_owner_scope_keeps_the_new_hold_memory() {
    drop_then_relock(&Memory::new(), Via::Scope, 5).await;
}

// Sequence 1 (drop, then re-lock by the same owner), `Lock::with_owner`, 20 runs.
#[cfg(feature = "redis")]
#[tokio::test]
async fn drop_then_relock_with_owner_keeps_the_new_hold_redis() {
    drop_then_relock(&Redis::start().await, Via::WithOwner, 20).await;
}

// Sequence 1 (drop, then re-lock by the same owner), `Owner::scope`, 20 runs.
#[cfg(feature = "redis")]
#[tokio::test]
async fn drop_then_relock_in_an_owner_scope_keeps_the_new_hold_redis() {
    drop_then_relock(&Redis::start().await, Via::Scope, 20).await;
}

#[cfg(feature = "axum")]
mod web {
    use axum::Router;
    use axum::body::Body;
    use axum::extract::Request;
    use axum::routing::post;
    use http::HeaderName;
    pub use http::StatusCode;
    use http_body_util::BodyExt;
    use tower::ServiceExt;
    use tower_lock::LockClient;
    use tower_lock::extract::Locks;
    use tower_lock::layer::{HeaderKey, LockLayer};

    pub const USER: HeaderName = HeaderName::from_static("x-user-id");

    /// The key the layer derives for user `1`.
    pub const USER_KEY: &str = "user:{1}";

    /// POSTs `/` as user 1.
    pub async fn call(app: &Router) -> (StatusCode, String) {
        let req = Request::post("/")
            .header(USER, "1")
            .body(Body::empty())
            .unwrap();
        let res = app.clone().oneshot(req).await.unwrap();
        let status = res.status();
        let body = res.into_body().collect().await.unwrap().to_bytes();
        (status, String::from_utf8(body.to_vec()).unwrap())
    }

    /// The handler's verdict: `200 ok`, or `500` with what went wrong.
    pub fn verdict(violations: Vec<String>) -> (StatusCode, String) {
        if violations.is_empty() {
            (StatusCode::OK, "ok".to_owned())
        } else {
            (StatusCode::INTERNAL_SERVER_ERROR, violations.join("\n  "))
        }
    }

    /// A router whose handler loops `let _g = locks.lock(k).await?` `iterations` times,
    /// checking each hold while `_g` lives.
    pub fn relock_loop(
        client: &LockClient,
        faulty: super::Faulty,
        intruder: LockClient,
        iterations: usize,
    ) -> Router {
        let handler = move |locks: Locks| {
            let (faulty, intruder) = (faulty.clone(), intruder.clone());
            async move {
                let mut violations = Vec::new();
                for i in 0..iterations {
                    let _g = match locks.lock("relock-in-handler").await {
                        Ok(g) => g,
                        Err(e) => return verdict(vec![format!("run {i}: lock failed: {e}")]),
                    };
                    let what = format!("run {i}");
                    violations.extend(
                        super::held_exclusively(&faulty, &intruder, &_g, super::WATCH, &what).await,
                    );
                }
                verdict(violations)
            }
        };
        Router::new()
            .route("/", post(handler))
            .layer(LockLayer::new(
                client.clone(),
                HeaderKey::new(USER).namespace("user").unwrap(),
            ))
    }
}

/// A handler that re-locks one key in a loop through the `Locks` extractor; every hold
/// must stay held for the iteration it belongs to.
#[cfg(feature = "axum")]
async fn relock_through_locks(store: &impl Store, iterations: usize) {
    let client = store.client();
    let app = web::relock_loop(&client, store.faulty().clone(), store.client(), iterations);
    let (status, body) = web::call(&app).await;
    assert_eq!(
        status,
        web::StatusCode::OK,
        "the handler found violations:\n  {body}"
    );
    store
        .wait_clear(&key("relock-in-handler"), "after the request")
        .await;
}

// Sequence 1 (drop, then re-lock by the same owner) through an axum handler looping
// `let _g = locks.lock(k).await?` with the `Locks` extractor.
#[cfg(feature = "axum")]
#[tokio::test(start_paused = true)]
async fn drop_then_relock_through_the_locks_extractor_keeps_the_new_hold_memory() {
    relock_through_locks(&Memory::new(), 5).await;
}

// Sequence 1 (drop, then re-lock by the same owner) through an axum handler, 20 loops.
#[cfg(all(feature = "axum", feature = "redis"))]
#[tokio::test]
async fn drop_then_relock_through_the_locks_extractor_keeps_the_new_hold_redis() {
    relock_through_locks(&Redis::start().await, 20).await;
}

// ---------------------------------------------------------------------------------------
// 2. An expired guard comes back to life
// ---------------------------------------------------------------------------------------

/// After `g1` is lost and its owner locked again (`g2`): `g1` stays lost, its unlock says
/// `Lost`, and `g2`'s hold is untouched.
async fn old_guard_stays_lost(
    store: &impl Store,
    intruder: &LockClient,
    g1: LockGuard,
    g2: LockGuard,
    what: &str,
) -> Vec<String> {
    let mut violations = Vec::new();
    if !g1.is_lost() {
        violations.push(format!(
            "{what}: g1.is_lost() turned false again after the re-lock"
        ));
    }
    match g1.unlock().await {
        Err(Error::Lost) => {}
        other => violations.push(format!(
            "{what}: g1.unlock() returned {other:?}, not Err(Lost)"
        )),
    }
    violations.extend(held_exclusively(store.faulty(), intruder, &g2, WATCH, what).await);
    if let Err(e) = g2.unlock().await {
        violations.push(format!("{what}: g2.unlock() failed: {e}"));
    }
    violations
}

/// g1 with a fixed 100 ms lease expires; owner B takes and releases the key; g1's owner
/// locks again (g2).
async fn expired_guard_then_relock(store: &impl Store) {
    let client = store.client();
    let intruder = store.client();
    let key = key("expired-guard");
    let lock = client
        .get_lock(&key)
        .unwrap()
        .with_owner(client.new_owner());
    let g1 = lock
        .try_lock_for(Duration::ZERO, Duration::from_millis(100))
        .await
        .unwrap();
    wait_until(
        Duration::from_secs(3),
        "g1's lease ends in the store",
        || async { store.holders(&key).await.is_empty() },
    )
    .await;
    wait_until(Duration::from_secs(1), "g1 knows it is lost", || async {
        g1.is_lost()
    })
    .await;
    let b = client.get_lock(&key).unwrap().try_lock().await.unwrap();
    b.unlock().await.unwrap();
    let g2 = lock.lock().await.unwrap();
    let violations = old_guard_stays_lost(store, &intruder, g1, g2, "fixed lease").await;
    store.wait_clear(&key, "at the end").await;
    assert_none(violations);
}

// Sequence 2 (an expired guard comes back to life), fixed 100 ms lease.
#[tokio::test(start_paused = true)]
async fn an_expired_guard_stays_lost_after_its_owner_relocks_memory() {
    expired_guard_then_relock(&Memory::new()).await;
}

// Sequence 2 (an expired guard comes back to life), fixed 100 ms lease.
#[cfg(feature = "redis")]
#[tokio::test]
async fn an_expired_guard_stays_lost_after_its_owner_relocks_redis() {
    expired_guard_then_relock(&Redis::start().await).await;
}

// Sequence 2, watched variant: a watchdog guard whose renewals could not run before its
// lease ended (time jumps far past the lease in one step, so the store expires the hold
// before the watchdog renews it), then the same owner locks again. Two timings: the
// re-lock comes before the watchdog's next look, or after the watchdog found the loss.
#[tokio::test(start_paused = true)]
async fn a_watchdog_guard_that_expired_unrenewed_stays_lost_after_its_owner_relocks_memory() {
    let store = Memory::new();
    let lease = Duration::from_millis(300);
    let client = LockClient::builder(store.faulty().clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let intruder = store.client();
    let mut violations = Vec::new();
    for watchdog_looked_first in [false, true] {
        let what = if watchdog_looked_first {
            "re-lock after the watchdog's look"
        } else {
            "re-lock before the watchdog's look"
        };
        let key = key(format!("watched-expired-{watchdog_looked_first}"));
        let lock = client
            .get_lock(&key)
            .unwrap()
            .with_owner(client.new_owner());
        let g1 = lock.lock().await.unwrap();
        assert!(g1.is_watched());
        tokio::time::advance(lease * 10).await;
        assert!(g1.is_lost(), "{what}: the lease ended unrenewed");
        assert!(
            store.holders(&key).await.is_empty(),
            "{what}: the store expired the hold"
        );
        if watchdog_looked_first {
            wait_until(
                Duration::from_secs(5),
                "the watchdog dropped the lost hold",
                || async { client.watched_locks() == 0 },
            )
            .await;
        }
        let g2 = lock.lock().await.unwrap();
        violations.extend(old_guard_stays_lost(&store, &intruder, g1, g2, what).await);
        store.wait_clear(&key, what).await;
    }
    assert_none(violations);
}

// ---------------------------------------------------------------------------------------
// 3. Exclusive and fair lock on one name, one owner
// ---------------------------------------------------------------------------------------

/// Owner O holds the exclusive lock `k` and asks for the fair lock `k`: busy, and the
/// exclusive hold is unaffected.
async fn fair_after_exclusive(store: &impl Store) {
    let client = store.client();
    let intruder = store.client();
    let key = key("exclusive-then-fair");
    let owner = client.new_owner();
    let exclusive = client
        .get_lock(&key)
        .unwrap()
        .with_owner(owner.clone())
        .lock()
        .await
        .unwrap();
    let mut violations = Vec::new();
    let fair = client
        .get_fair_lock(&key)
        .unwrap()
        .with_owner(owner.clone())
        .try_lock()
        .await;
    let fair = match fair {
        Err(e) if e.is_busy() => None,
        Ok(g) => {
            violations.push(format!(
                "the fair lock was granted to the exclusive lock's owner (hold count {})",
                g.hold_count()
            ));
            Some(g)
        }
        Err(e) => {
            violations.push(format!("the fair try_lock failed with {e:?}, not Busy"));
            None
        }
    };
    violations.extend(
        held_exclusively(
            store.faulty(),
            &intruder,
            &exclusive,
            WATCH,
            "exclusive hold",
        )
        .await,
    );
    if let Err(e) = exclusive.unlock().await {
        violations.push(format!("the exclusive unlock failed: {e}"));
    }
    if let Some(fair) = fair {
        let holders = store.holders(&key).await;
        if holders.is_empty() && !fair.is_lost() {
            violations.push(
                "unlocking the exclusive guard freed the fair hold, and the fair guard is not lost"
                    .to_owned(),
            );
        }
        let _ = fair.unlock().await;
    }
    store.wait_clear(&key, "at the end").await;
    assert_none(violations);
}

// Sequence 3 (exclusive and fair lock on one name, one owner): the fair lock is busy.
#[tokio::test]
async fn the_fair_lock_is_busy_for_the_owner_of_the_exclusive_lock_of_the_same_name_memory() {
    fair_after_exclusive(&Memory::new()).await;
}

// Sequence 3 (exclusive and fair lock on one name, one owner): the fair lock is busy.
#[cfg(feature = "redis")]
#[tokio::test]
async fn the_fair_lock_is_busy_for_the_owner_of_the_exclusive_lock_of_the_same_name_redis() {
    fair_after_exclusive(&Redis::start().await).await;
}

/// A MultiLock over [exclusive k, fair k] with one owner: `try_lock` fails and nothing
/// is left held or queued.
async fn multilock_exclusive_and_fair(store: &impl Store) {
    let client = store.client();
    let key = key("multi-exclusive-fair");
    let multi = MultiLock::new([
        client.get_lock(&key).unwrap(),
        client.get_fair_lock(&key).unwrap(),
    ])
    .with_owner(client.new_owner());
    let outcome = multi.try_lock().await;
    let mut violations = Vec::new();
    match outcome {
        Err(_) => {}
        Ok(both) => {
            violations.push(format!(
                "try_lock succeeded, hold counts {:?}",
                both.guards()
                    .iter()
                    .map(LockGuard::hold_count)
                    .collect::<Vec<_>>()
            ));
            let _ = both.unlock().await;
        }
    }
    store.wait_clear(&key, "after the MultiLock").await;
    assert_none(violations);
}

// Sequence 3: a MultiLock over [exclusive k, fair k] with one owner must not succeed.
#[tokio::test]
async fn a_multilock_over_the_exclusive_and_fair_lock_of_one_name_fails_and_holds_nothing_memory() {
    multilock_exclusive_and_fair(&Memory::new()).await;
}

// Sequence 3: a MultiLock over [exclusive k, fair k] with one owner must not succeed.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_multilock_over_the_exclusive_and_fair_lock_of_one_name_fails_and_holds_nothing_redis() {
    multilock_exclusive_and_fair(&Redis::start().await).await;
}

// ---------------------------------------------------------------------------------------
// 4. A cancelled fair or read-write attempt stays in the queue
// ---------------------------------------------------------------------------------------

/// A holder holds `key` in `holder`; an attempt in `cancelled` mode is queued by the
/// store, then cancelled before its reply arrives; a waiter in `next` mode queues
/// behind. When the holder unlocks, the waiter must get the lock promptly (not after the
/// cancelled attempt's place times out), and the queue must be empty afterwards.
async fn cancelled_queued_attempt(
    store: &impl Store,
    holder: LockMode,
    cancelled: LockMode,
    next: LockMode,
) {
    let client = store.client();
    let key = key(format!("cancelled-{cancelled}"));
    let lock = |mode| client.lock_in_mode(&key, mode).unwrap();
    let held = lock(holder).lock().await.unwrap();

    store
        .faulty()
        .intercept()
        .arm(|f| f.delay_next_reply = Some(Duration::from_secs(2)));
    let attempt = tokio::time::timeout(Duration::from_millis(100), lock(cancelled).lock()).await;
    assert!(attempt.is_err(), "the attempt's reply was held back");
    assert_eq!(
        store.faulty().intercept().delayed_replies(),
        1,
        "the store applied the cancelled attempt"
    );

    // The waiter is asleep once it has subscribed and tried again after subscribing.
    let attempts = store.faulty().intercept().acquires();
    let waiter = spawn_acquire(lock(next), Duration::from_secs(20));
    wait_until(Duration::from_secs(5), "the next waiter waits", || async {
        store.waiters(&key) == 1 && store.faulty().intercept().acquires() >= attempts + 2
    })
    .await;
    let queued = store.queue_len(&key).await;
    let released_at = Instant::now();
    held.unlock().await.unwrap();
    let (acquired_at, guard) = waiter.await.unwrap().unwrap();
    let handoff = acquired_at.duration_since(released_at);
    guard.unlock().await.unwrap();
    assert!(
        handoff < Duration::from_millis(500),
        "the next {next} waiter got the lock {handoff:?} after the holder unlocked \
         (the queue had {queued} entries when the holder unlocked; the waiter is one)"
    );
    store
        .wait_clear(&key, "the queue after the waiter unlocked")
        .await;
}

// Sequence 4 (a cancelled fair attempt stays in the queue).
#[tokio::test(start_paused = true)]
async fn a_cancelled_fair_attempt_leaves_the_queue_memory() {
    cancelled_queued_attempt(
        &Memory::new(),
        LockMode::Fair,
        LockMode::Fair,
        LockMode::Fair,
    )
    .await;
}

// Sequence 4 (a cancelled read attempt stays in the queue): a writer queued behind the
// cancelled reader.
#[tokio::test(start_paused = true)]
async fn a_cancelled_read_attempt_leaves_the_queue_memory() {
    cancelled_queued_attempt(
        &Memory::new(),
        LockMode::Write,
        LockMode::Read,
        LockMode::Write,
    )
    .await;
}

// Sequence 4 (a cancelled write attempt stays in the queue).
#[tokio::test(start_paused = true)]
async fn a_cancelled_write_attempt_leaves_the_queue_memory() {
    cancelled_queued_attempt(
        &Memory::new(),
        LockMode::Write,
        LockMode::Write,
        LockMode::Write,
    )
    .await;
}

// Sequence 4 (a cancelled fair attempt stays in the queue).
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_cancelled_fair_attempt_leaves_the_queue_redis() {
    cancelled_queued_attempt(
        &Redis::start().await,
        LockMode::Fair,
        LockMode::Fair,
        LockMode::Fair,
    )
    .await;
}

// Sequence 4 (a cancelled read attempt stays in the queue): a writer queued behind the
// cancelled reader.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_cancelled_read_attempt_leaves_the_queue_redis() {
    cancelled_queued_attempt(
        &Redis::start().await,
        LockMode::Write,
        LockMode::Read,
        LockMode::Write,
    )
    .await;
}

// Sequence 4 (a cancelled write attempt stays in the queue).
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_cancelled_write_attempt_leaves_the_queue_redis() {
    cancelled_queued_attempt(
        &Redis::start().await,
        LockMode::Write,
        LockMode::Write,
        LockMode::Write,
    )
    .await;
}

// ---------------------------------------------------------------------------------------
// 5. Phantom holds
// ---------------------------------------------------------------------------------------

/// An acquire by a fixed owner (`with_owner`), applied by the store with a 30 s lease,
/// is cancelled before its reply arrives. The key must be free again promptly, and no
/// hold of that owner may stay in the store.
async fn cancelled_fixed_owner_attempt(store: &impl Store) {
    let client = store.client();
    let other = store.client();
    let key = key("phantom");
    let owner = client.new_owner();
    store
        .faulty()
        .intercept()
        .arm(|f| f.delay_next_reply = Some(Duration::from_secs(2)));
    let attempt = tokio::time::timeout(
        Duration::from_millis(100),
        client
            .get_lock(&key)
            .unwrap()
            .with_owner(owner.clone())
            .try_lock_for(Duration::ZERO, Duration::from_secs(30)),
    )
    .await;
    assert!(attempt.is_err(), "the attempt's reply was held back");
    assert_eq!(
        store.faulty().intercept().delayed_replies(),
        1,
        "the store applied the cancelled attempt"
    );

    let started = Instant::now();
    let next = other
        .get_lock(&key)
        .unwrap()
        .with_owner(other.new_owner())
        .try_lock_for(Duration::from_secs(1), Lease::Watchdog)
        .await;
    let took = started.elapsed();
    let holders = store.holders(&key).await;
    let next = next.unwrap_or_else(|e| {
        panic!(
            "the key stayed locked after the cancelled attempt: {e} (after {took:?}; holds {holders:?})"
        )
    });
    assert!(
        !holders.iter().any(|h| h.contains(owner.as_str())),
        "the cancelled owner still has a hold: {holders:?}"
    );
    next.unlock().await.unwrap();
    store.wait_clear(&key, "at the end").await;
}

// Sequence 5 (phantom holds): a cancelled acquire by a fixed owner.
#[tokio::test(start_paused = true)]
async fn a_cancelled_attempt_by_a_fixed_owner_leaves_no_phantom_hold_memory() {
    cancelled_fixed_owner_attempt(&Memory::new()).await;
}

// Sequence 5 (phantom holds): a cancelled acquire by a fixed owner.
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_cancelled_attempt_by_a_fixed_owner_leaves_no_phantom_hold_redis() {
    cancelled_fixed_owner_attempt(&Redis::start().await).await;
}

// ---------------------------------------------------------------------------------------
// 6. fail_open and the pending compensation
// ---------------------------------------------------------------------------------------

/// The layer's attempt fails without reaching the store and fail-open serves the
/// request; the compensating release for that attempt is slow. The handler locks the
/// same key through `Locks` and keeps it ~1 s: nobody else may get it meanwhile.
#[cfg(feature = "axum")]
async fn fail_open_then_lock_in_the_handler(store: &impl Store) {
    use axum::Router;
    use axum::routing::post;
    use tower_lock::extract::Locks;
    use tower_lock::layer::{HeaderKey, LockLayer};

    let client = store.client();
    let faulty = store.faulty().clone();
    let intruder = store.client();
    let handler = move |locks: Locks| {
        let (faulty, intruder) = (faulty.clone(), intruder.clone());
        async move {
            let guard = match locks.lock(web::USER_KEY).await {
                Ok(g) => g,
                Err(e) => return web::verdict(vec![format!("the handler's lock failed: {e}")]),
            };
            let mut violations = held_exclusively(
                &faulty,
                &intruder,
                &guard,
                Duration::from_secs(1),
                "the handler's hold",
            )
            .await;
            if let Err(e) = guard.unlock().await {
                violations.push(format!("the handler's unlock failed: {e}"));
            }
            web::verdict(violations)
        }
    };
    let layer = LockLayer::builder(client, HeaderKey::new(web::USER).namespace("user").unwrap())
        .fail_open(true)
        .build()
        .unwrap();
    let app = Router::new().route("/", post(handler)).layer(layer);

    store.faulty().intercept().arm(|f| {
        f.fail_next_unsent = true;
        f.release_delay = Some(Duration::from_millis(300));
    });
    let (status, body) = web::call(&app).await;
    store.faulty().intercept().arm(|f| f.release_delay = None);
    assert_eq!(
        store.faulty().intercept().failed_unsent(),
        1,
        "the layer's attempt failed"
    );
    assert_eq!(
        status,
        web::StatusCode::OK,
        "the handler found violations:\n  {body}"
    );
    store
        .wait_clear(&key(web::USER_KEY), "after the request")
        .await;
}

// Sequence 6 (fail_open serves the request as the owner whose compensating release is
// still pending).
#[cfg(feature = "axum")]
#[tokio::test(start_paused = true)]
async fn a_late_fail_open_compensation_never_frees_the_handlers_lock_memory() {
    fail_open_then_lock_in_the_handler(&Memory::new()).await;
}

// Sequence 6 (fail_open serves the request as the owner whose compensating release is
// still pending).
#[cfg(all(feature = "axum", feature = "redis"))]
#[tokio::test]
async fn a_late_fail_open_compensation_never_frees_the_handlers_lock_redis() {
    fail_open_then_lock_in_the_handler(&Redis::start().await).await;
}

// ---------------------------------------------------------------------------------------
// 7a. Concurrent unlocks of one owner's re-entrant guards
// ---------------------------------------------------------------------------------------

/// How the two unlocks run at once.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Together {
    /// `tokio::join!(g1.unlock(), g2.unlock())` on one task.
    Joined,
    /// Each unlock in a task of its own, in parallel on a multi-thread runtime.
    Spawned,
    /// `tokio::join!`, with g1's release reaching the store 20 ms late, after g2's (two
    /// commands in flight delivered out of order, as over two connections).
    JoinedOutOfOrder,
}

/// 50 rounds of each [`Together`]: g1, then re-entered g2, then both unlocked at once.
/// Both unlocks must return Ok: the owner held the lock twice and released it twice.
async fn concurrent_unlocks(store: &impl Store) {
    const RUNS: usize = 50;
    let client = store.client();
    let mut violations = Vec::new();
    for i in 0..RUNS {
        for how in [
            Together::Joined,
            Together::Spawned,
            Together::JoinedOutOfOrder,
        ] {
            let key = key(format!("concurrent-unlock-{i}-{how:?}"));
            let lock = client
                .get_lock(&key)
                .unwrap()
                .with_owner(client.new_owner());
            let g1 = lock.lock().await.unwrap();
            let g2 = lock.lock().await.unwrap();
            assert_eq!(g2.hold_count(), 2);
            let (r1, r2) = match how {
                Together::Joined => tokio::join!(g1.unlock(), g2.unlock()),
                Together::Spawned => {
                    let (a, b) = tokio::join!(tokio::spawn(g1.unlock()), tokio::spawn(g2.unlock()));
                    (a.unwrap(), b.unwrap())
                }
                Together::JoinedOutOfOrder => {
                    store
                        .faulty()
                        .intercept()
                        .arm(|f| f.delay_next_release = Some(Duration::from_millis(20)));
                    tokio::join!(g1.unlock(), g2.unlock())
                }
            };
            if r1.is_err() || r2.is_err() {
                violations.push((how, format!("run {i}: g1 → {r1:?}, g2 → {r2:?}")));
            }
            store.wait_clear(&key, "after both unlocks").await;
        }
    }
    // One line per way of unlocking: how often an unlock failed, and the first case.
    let summary = [
        Together::Joined,
        Together::Spawned,
        Together::JoinedOutOfOrder,
    ]
    .into_iter()
    .filter_map(|how| {
        let failed: Vec<&String> = violations
            .iter()
            .filter(|(h, _)| *h == how)
            .map(|(_, v)| v)
            .collect();
        let first = failed.first()?;
        Some(format!(
            "{how:?}: {} of {RUNS} runs, e.g. {first}",
            failed.len()
        ))
    })
    .collect();
    assert_none(summary);
}

// Sequence 7a (two concurrent unlocks of one owner's re-entrant guards).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_unlocks_of_reentrant_guards_both_succeed_memory() {
    concurrent_unlocks(&Memory::new()).await;
}

// Sequence 7a (two concurrent unlocks of one owner's re-entrant guards).
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_unlocks_of_reentrant_guards_both_succeed_redis() {
    concurrent_unlocks(&Redis::start().await).await;
}

// ---------------------------------------------------------------------------------------
// 7b. The watchdog task lives on whichever runtime registered first
// ---------------------------------------------------------------------------------------

const SHORT_LEASE: Duration = Duration::from_millis(300);

/// `client` is shared by two runtimes on separate threads. Runtime A takes a watched
/// lock first (so the watchdog task runs on A), runtime `b` takes a watched lock, then A
/// shuts down. B's lock must still be renewed, with no further registration, for four
/// lease periods: `intruder` never gets it and it is never lost.
fn renewals_outlive_the_first_runtime(
    b: &tokio::runtime::Runtime,
    client: LockClient,
    intruder: LockClient,
) {
    let (a_locked, a_locked_rx) = std::sync::mpsc::channel();
    let (shut_a, shut_a_rx) = std::sync::mpsc::channel::<()>();
    let client_a = client.clone();
    let a = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async {
            let guard = client_a
                .get_lock("first-on-a")
                .unwrap()
                .lock()
                .await
                .unwrap();
            assert!(guard.is_watched());
            // Keep it watched until A is gone, so the task on A is alive meanwhile.
            std::mem::forget(guard);
        });
        a_locked.send(()).unwrap();
        shut_a_rx.recv().unwrap();
        drop(runtime);
    });
    a_locked_rx.recv().unwrap();
    let guard = b.block_on(client.get_lock("second-on-b").unwrap().lock());
    let guard = guard.unwrap();
    shut_a.send(()).unwrap();
    a.join().unwrap();
    b.block_on(async {
        let lock = intruder
            .get_lock("second-on-b")
            .unwrap()
            .with_owner(intruder.new_owner());
        let until = Instant::now() + SHORT_LEASE * 4;
        while Instant::now() < until {
            assert!(
                !guard.is_lost(),
                "B's lock was lost: nothing renewed it after runtime A shut down"
            );
            if let Ok(stolen) = lock.try_lock().await {
                let _ = stolen.unlock().await;
                panic!(
                    "another client took B's lock: nothing renewed it after runtime A shut down"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        guard.unlock().await.unwrap();
    });
}

// Sequence 7b (the watchdog task lives on whichever runtime registered first).
#[test]
fn the_watchdog_keeps_renewing_after_the_runtime_it_started_on_shuts_down_memory() {
    let b = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = Memory::new();
    let client = LockClient::builder(store.faulty().clone())
        .watchdog_lease(SHORT_LEASE)
        .build()
        .unwrap();
    renewals_outlive_the_first_runtime(&b, client, store.client());
}

// Sequence 7b (the watchdog task lives on whichever runtime registered first).
#[cfg(feature = "redis")]
#[test]
fn the_watchdog_keeps_renewing_after_the_runtime_it_started_on_shuts_down_redis() {
    // Runtime B makes the server and the connection, so both outlive runtime A.
    let b = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let store = b.block_on(Redis::start());
    let client = LockClient::builder(store.faulty().clone())
        .watchdog_lease(SHORT_LEASE)
        .build()
        .unwrap();
    renewals_outlive_the_first_runtime(&b, client, store.client());
    drop(store);
}

// ---------------------------------------------------------------------------------------
// 7b'. Renewals outlive a runtime that re-entered or took a hold (issue 20, item 6)
// ---------------------------------------------------------------------------------------

/// What the short-lived runtime B does with the hold that the long-lived runtime A also
/// stands for, as the same owner.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum OnB {
    /// A takes the hold; B re-enters it and drops its guard before it shuts down.
    ReentersAndLeaves,
    /// A takes the hold; B re-enters it, and its guard is still alive when B shuts
    /// down (it is dropped later, on a plain thread).
    ReentersAndOutlives,
    /// B takes the hold and A re-enters it; B's guard is still alive when B shuts down.
    TakesAndOutlives,
}

/// `client` and one owner hold a watched lock on the long-lived runtime `a` and on a
/// short-lived runtime B (current-thread, on its own thread), as `how` says; then B
/// shuts down. A's guard still stands for the hold, so the hold must go on being
/// renewed, with no new acquisition, for four watchdog leases: `intruder` never gets it
/// and A's guard is never lost.
fn renewals_outlive_a_short_lived_runtime(
    a: &tokio::runtime::Runtime,
    client: LockClient,
    intruder: LockClient,
    how: OnB,
) {
    let name = format!("held-on-a-and-b-{how:?}");
    let lock = client
        .get_lock(name.as_str())
        .unwrap()
        .with_owner(client.new_owner());
    let a_first = how != OnB::TakesAndOutlives;
    let mut guard = a_first.then(|| a.block_on(lock.lock()).unwrap());
    let (b_locked, b_locked_rx) = std::sync::mpsc::channel();
    let (shut_b, shut_b_rx) = std::sync::mpsc::channel::<()>();
    let on_b = {
        let lock = lock.clone();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            let on_b = runtime.block_on(async {
                let on_b = lock.lock().await.unwrap();
                assert!(on_b.is_watched());
                assert_eq!(on_b.hold_count(), if a_first { 2 } else { 1 });
                if how == OnB::ReentersAndLeaves {
                    drop(on_b);
                    return None;
                }
                Some(on_b)
            });
            b_locked.send(()).unwrap();
            shut_b_rx.recv().unwrap();
            drop(runtime);
            on_b
        })
    };
    b_locked_rx.recv().unwrap();
    if !a_first {
        let reentered = a.block_on(lock.lock()).unwrap();
        assert_eq!(reentered.hold_count(), 2, "A re-entered B's hold");
        guard = Some(reentered);
    }
    let guard = guard.unwrap();
    assert!(guard.is_watched());
    shut_b.send(()).unwrap();
    let on_b = on_b.join().unwrap();
    a.block_on(async {
        let stranger = intruder
            .get_lock(name.as_str())
            .unwrap()
            .with_owner(intruder.new_owner());
        let until = Instant::now() + SHORT_LEASE * 4;
        while Instant::now() < until {
            assert!(
                !guard.is_lost(),
                "{how:?}: A's guard was lost: nothing renewed the hold after runtime B shut down"
            );
            if let Ok(stolen) = stranger.try_lock().await {
                let _ = stolen.unlock().await;
                panic!(
                    "{how:?}: another client took A's lock: nothing renewed it after runtime B \
                     shut down"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    });
    // B's guard leaves on a plain thread (no runtime); A's guard is the last and releases.
    drop(on_b);
    a.block_on(async {
        guard.unlock().await.unwrap();
        stranger_gets_it(&intruder, &name, how).await;
    });
}

/// Once the owner's last guard is gone, the lock is free for another client at once.
async fn stranger_gets_it(intruder: &LockClient, name: &str, how: OnB) {
    let got = intruder
        .get_lock(name)
        .unwrap()
        .with_owner(intruder.new_owner())
        .try_lock()
        .await;
    match got {
        Ok(guard) => guard.unlock().await.unwrap(),
        Err(e) => panic!("{how:?}: the lock stayed held after its last guard's unlock: {e}"),
    }
}

/// The long-lived runtime A: multi-thread, one worker.
fn runtime_a() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

/// A client of `store` whose watched locks have a [`SHORT_LEASE`].
fn short_lease_client(store: &impl Store) -> LockClient {
    LockClient::builder(store.faulty().clone())
        .watchdog_lease(SHORT_LEASE)
        .build()
        .unwrap()
}

// Issue 20, item 6: a re-entry from a short-lived runtime moved the hold's renewals to
// it, and they stopped when it shut down.
#[test]
fn renewals_outlive_a_runtime_that_reentered_and_left_memory() {
    let store = Memory::new();
    let client = short_lease_client(&store);
    renewals_outlive_a_short_lived_runtime(
        &runtime_a(),
        client,
        store.client(),
        OnB::ReentersAndLeaves,
    );
}

// Issue 20, item 6, with the re-entered guard still alive when its runtime shuts down.
#[test]
fn renewals_outlive_a_runtime_that_reentered_and_shut_down_memory() {
    let store = Memory::new();
    let client = short_lease_client(&store);
    renewals_outlive_a_short_lived_runtime(
        &runtime_a(),
        client,
        store.client(),
        OnB::ReentersAndOutlives,
    );
}

// Issue 20, item 6, the other way round: the hold's renewals pass from the runtime that
// took it, when it shuts down, to one that re-entered it.
#[test]
fn renewals_outlive_the_runtime_that_took_a_hold_another_reentered_memory() {
    let store = Memory::new();
    let client = short_lease_client(&store);
    renewals_outlive_a_short_lived_runtime(
        &runtime_a(),
        client,
        store.client(),
        OnB::TakesAndOutlives,
    );
}

// Issue 20, item 6: a re-entry from a short-lived runtime moved the hold's renewals to
// it, and they stopped when it shut down.
#[cfg(feature = "redis")]
#[test]
fn renewals_outlive_a_runtime_that_reentered_and_left_redis() {
    // Runtime A makes the server and the connection, so both outlive runtime B.
    let a = runtime_a();
    let store = a.block_on(Redis::start());
    let client = short_lease_client(&store);
    renewals_outlive_a_short_lived_runtime(&a, client, store.client(), OnB::ReentersAndLeaves);
    drop(store);
}

// Issue 20, item 6, with the re-entered guard still alive when its runtime shuts down.
#[cfg(feature = "redis")]
#[test]
fn renewals_outlive_a_runtime_that_reentered_and_shut_down_redis() {
    // Runtime A makes the server and the connection, so both outlive runtime B.
    let a = runtime_a();
    let store = a.block_on(Redis::start());
    let client = short_lease_client(&store);
    renewals_outlive_a_short_lived_runtime(&a, client, store.client(), OnB::ReentersAndOutlives);
    drop(store);
}

// Issue 20, item 6, the other way round: the hold's renewals pass from the runtime that
// took it, when it shuts down, to one that re-entered it.
#[cfg(feature = "redis")]
#[test]
fn renewals_outlive_the_runtime_that_took_a_hold_another_reentered_redis() {
    // Runtime A makes the server and the connection, so both outlive runtime B.
    let a = runtime_a();
    let store = a.block_on(Redis::start());
    let client = short_lease_client(&store);
    renewals_outlive_a_short_lived_runtime(&a, client, store.client(), OnB::TakesAndOutlives);
    drop(store);
}
// ---------------------------------------------------------------------------------------
// 7c. Owners the read-write scripts would misread
// ---------------------------------------------------------------------------------------

// Sequence 7c: `Owner::from_raw` rejects owners ending in `:read` or `:write`, which the
// read-write scripts take for queue entries or write fields.
#[test]
fn owner_from_raw_rejects_owners_ending_in_read_or_write() {
    for raw in ["client:read", "client:write", "a:b:read", ":write"] {
        match Owner::from_raw(raw) {
            Err(tower_lock::ConfigError::InvalidSetting { .. }) => {}
            other => panic!("Owner::from_raw({raw:?}) gave {other:?}, not InvalidSetting"),
        }
    }
    // Only the exact suffixes are reserved.
    for raw in ["client:1", "client:reader", "read", "client:writes"] {
        assert!(Owner::from_raw(raw).is_ok(), "{raw:?} is a valid owner");
    }
}

// ---------------------------------------------------------------------------------------
// 7d. A hold with no expiry keeps none
// ---------------------------------------------------------------------------------------

// Sequence 7d: a hold with no expiry (PERSISTed after acquiring) stays without expiry
// when its owner re-enters it through `LockBackend::acquire`, and when one of its holds
// is released (the lease is "extended, never shortened" in both).
#[cfg(feature = "redis")]
#[tokio::test]
async fn reentry_keeps_a_hold_without_expiry_without_expiry_redis() {
    let store = Redis::start().await;
    let backend = &store.backend;
    let key = key("persisted");
    let req = LockRequest::new(
        key.clone(),
        tower_lock::HoldId::from_raw("persisted-owner:1").unwrap(),
        LockMode::Exclusive,
        Duration::from_secs(30),
    );
    assert!(matches!(
        backend.acquire(&req).await.unwrap(),
        Acquire::Acquired(g) if g.holds() == 1
    ));
    let persisted: i64 = redis::cmd("PERSIST")
        .arg(backend.lock_name(&key))
        .query_async(&mut store.server.conn().await)
        .await
        .unwrap();
    assert_eq!(persisted, 1);
    assert_eq!(store.pttl(&key).await, -1, "the hold has no expiry");

    let mut violations = Vec::new();
    assert!(matches!(
        backend.acquire(&req).await.unwrap(),
        Acquire::Acquired(g) if g.holds() == 2
    ));
    let pttl = store.pttl(&key).await;
    if pttl != -1 {
        violations.push(format!("after a re-entry the hold expires in {pttl} ms"));
    }
    assert!(matches!(
        backend.release(&req).await.unwrap(),
        Release::Decremented { holds: 1 }
    ));
    let pttl = store.pttl(&key).await;
    if pttl != -1 {
        violations.push(format!(
            "after releasing one of two holds the hold expires in {pttl} ms"
        ));
    }
    assert_eq!(backend.release(&req).await.unwrap(), Release::Released);
    assert_none(violations);
}

/// Found by the history checker on Redis: a permit's end was stored as Redis `TIME` in
/// whole milliseconds (rounded down) plus the lease, and dropped once the server's
/// millisecond clock reached it — up to a millisecond before its holder, which counts
/// the lease from before it sent the request, stopped believing in it. Another owner
/// could take the permit in that window. A permit must stay in the store for as long as
/// its guard believes in it.
#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_outlives_its_holders_belief_redis() {
    let server = common::redis_server::RedisServer::start().await;
    let backend = tower_lock::RedisBackend::connect(server.url())
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let key = LockKey::new("permit-edge").unwrap();
    let lock = client.get_permits(&key, 1).unwrap();
    let mut early = 0;
    for round in 0..300 {
        let guard = lock
            .try_lock_for(Duration::ZERO, Duration::from_millis(3))
            .await
            .unwrap();
        let intruder = LockRequest::new(
            key.clone(),
            tower_lock::HoldId::from_raw(format!("intruder:{round}")).unwrap(),
            LockMode::Permits {
                max: std::num::NonZeroU32::new(1).unwrap(),
            },
            Duration::from_secs(10),
        );
        // Ask until the store lets another owner in; the guard must not believe in its
        // permit any more by then.
        loop {
            let got_in = matches!(
                backend.acquire(&intruder).await.unwrap(),
                Acquire::Acquired(_)
            );
            if got_in {
                if !guard.is_lost() {
                    early += 1;
                }
                break;
            }
        }
        assert_eq!(backend.release(&intruder).await.unwrap(), Release::Released);
        drop(guard);
    }
    assert_eq!(
        early, 0,
        "{early} of 300 permits were handed to another owner while their holder still believed in them"
    );
}

/// Found by the history checker on Redis (a re-entered permit, believed but gone from the
/// store): when a hold with a fixed lease is re-entered by a watched guard, the watchdog
/// renews it by what is left of the fixed lease when that exceeds its own. It rounded
/// that remainder *down* to whole milliseconds, so the store's lease ended up to a
/// millisecond before the end the guards still believed in (which only ever extends), and
/// another owner could take the lock in between. The memory store counts exactly, so
/// paused time with a sub-millisecond offset shows it every time.
#[tokio::test(start_paused = true)]
async fn a_renewal_never_ends_the_stores_lease_before_the_guards_belief_memory() {
    let store = Memory::new();
    let client = LockClient::builder(store.faulty().clone())
        .watchdog_lease(Duration::from_millis(30))
        .build()
        .unwrap();
    let intruder = store.client();
    let key = key("renewal-rounding");
    let lock = client
        .get_lock(&key)
        .unwrap()
        .with_owner(client.new_owner());
    tokio::time::advance(Duration::from_micros(500)).await;
    let fixed = lock
        .try_lock_for(Duration::ZERO, Duration::from_millis(100))
        .await
        .unwrap();
    // The watched re-entry starts the watchdog 0.3 ms later: every renewal then sees a
    // remainder with a fraction of a millisecond.
    tokio::time::advance(Duration::from_micros(300)).await;
    let watched = lock.lock().await.unwrap();
    assert!(watched.is_watched());
    // Renewals at 10 ms, 20 ms, … each re-lease the remainder; the watched guard goes
    // after the one at 60 ms, so that renewal's lease is the store's last word while the
    // fixed guard still believes in its own end.
    for _ in 0..65 {
        tokio::time::advance(Duration::from_millis(1)).await;
    }
    drop(watched);
    let deadline = Instant::now() + Duration::from_millis(200);
    let mut overlaps = 0;
    while Instant::now() < deadline {
        tokio::time::advance(Duration::from_micros(100)).await;
        if !fixed.is_lost()
            && let Ok(g) = intruder
                .get_lock(&key)
                .unwrap()
                .try_lock_for(Duration::ZERO, Duration::from_secs(1))
                .await
        {
            overlaps += 1;
            g.unlock().await.unwrap();
        }
    }
    assert_eq!(
        overlaps, 0,
        "another owner took the lock while the re-entered hold was still believed"
    );
    drop(fixed);
    store.wait_clear(&key, "at the end").await;
}

/// The lock of each kind on `key`, by a short name.
fn lock_of_kind(client: &LockClient, key: &LockKey, kind: &str) -> tower_lock::Lock {
    match kind {
        "exclusive" => client.get_lock(key),
        "fair" => client.get_fair_lock(key),
        "permits" => client.get_permits(key, 1),
        "read" => client.get_read_write_lock(key).map(|rw| rw.read_lock()),
        "write" => client.get_read_write_lock(key).map(|rw| rw.write_lock()),
        other => panic!("no kind {other}"),
    }
    .unwrap()
}

const KINDS: [&str; 5] = ["exclusive", "fair", "permits", "read", "write"];

/// For every pair of kinds (but the exclusive and the fair lock, one hash in the store): a
/// hold of one kind on a name, then `force_unlock` of a lock of another kind on the same
/// name. The force-unlock must answer `false` and leave the hold
/// (an operator forcing the read-write lock `k` must not free the exclusive lock `k`).
async fn force_unlock_of_another_kind(store: &impl Store) {
    let client = store.client();
    let mut violations = Vec::new();
    for held in KINDS {
        for forced in KINDS {
            let exclusive_family = |k: &str| k != "read";
            // The exclusive and the fair lock of a name are one hash (Redisson's
            // layout): forcing either frees it, as in Redisson.
            let one_hash = |a: &str, b: &str| a == "exclusive" && b == "fair";
            if held == forced
                || one_hash(held, forced)
                || one_hash(forced, held)
                || (held == "read" && forced == "write")
                || (held == "write" && forced == "read")
                || !(exclusive_family(held) || exclusive_family(forced))
            {
                continue;
            }
            let what = format!("{held} held, {forced} forced");
            let key = key(format!("force-{held}-{forced}"));
            let guard = lock_of_kind(&client, &key, held).lock().await.unwrap();
            match lock_of_kind(&client, &key, forced).force_unlock().await {
                Ok(false) => {}
                other => violations.push(format!("{what}: force_unlock returned {other:?}")),
            }
            if store.holders(&key).await.is_empty() {
                violations.push(format!("{what}: the hold is gone from the store"));
            }
            if let Err(e) = guard.unlock().await {
                violations.push(format!("{what}: the guard's unlock failed: {e}"));
            }
            store.wait_clear(&key, &what).await;
        }
    }
    assert_none(violations);
}

// Found reading the scripts while chasing a history-checker finding: the read-write
// force-release pruned the hash before looking at whose it was, and took an exclusive,
// fair or permit holder's field for a read hold whose leases had ended.
#[tokio::test]
async fn force_unlock_never_frees_a_hold_of_another_kind_memory() {
    force_unlock_of_another_kind(&Memory::new()).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn force_unlock_never_frees_a_hold_of_another_kind_redis() {
    force_unlock_of_another_kind(&Redis::start().await).await;
}

// ---------------------------------------------------------------------------------------
// 8. A renewal shortens the store's lease below a guard's belief (issue 20, item 1)
// ---------------------------------------------------------------------------------------

/// An owner holds `key` with a fixed 1 s lease; two of its tasks re-enter at once with
/// `try_lock_for(0, 4 s)` and `try_lock_for(0, 2 s)`, so both renewals are sent before
/// either answers, the 4 s one first. The store kept whichever landed last (2 s) while
/// the client kept the longer belief: once 2 s had passed, another client got the lock
/// while the 4 s guard still believed in it. The store must keep the longest lease.
async fn concurrent_reentries_with_different_leases(store: &impl Store) {
    let client = store.client();
    let intruder = store.client();
    let key = key("reentries-with-different-leases");
    let lock = client
        .get_lock(&key)
        .unwrap()
        .with_owner(client.new_owner());
    let outer = lock
        .try_lock_for(Duration::ZERO, Duration::from_secs(1))
        .await
        .unwrap();
    // Both renewals are sent before either answers (polled in this order on one
    // thread: the 4 s one first), however fast the store answers.
    store
        .faulty()
        .intercept()
        .arm(|f| f.renew_reply_delay = Some(Duration::from_millis(10)));
    let sent = Instant::now();
    let (long, short) = tokio::join!(
        lock.try_lock_for(Duration::ZERO, Duration::from_secs(4)),
        lock.try_lock_for(Duration::ZERO, Duration::from_secs(2)),
    );
    let (long, short) = (long.unwrap(), short.unwrap());
    assert_eq!((long.hold_count(), short.hold_count()), (2, 3));
    // Past the 2 s lease, and for half a second more, well inside the 4 s one.
    tokio::time::sleep_until(sent + Duration::from_millis(2500)).await;
    let violations = held_exclusively(
        store.faulty(),
        &intruder,
        &long,
        Duration::from_millis(500),
        "past the 2 s lease",
    )
    .await;
    drop((outer, long, short));
    store.wait_clear(&key, "at the end").await;
    assert_none(violations);
}

// Sequence 8 (two re-entries with different fixed leases at once).
#[tokio::test(start_paused = true)]
async fn concurrent_reentries_keep_the_longest_lease_in_the_store_memory() {
    concurrent_reentries_with_different_leases(&Memory::new()).await;
}

// Sequence 8 (two re-entries with different fixed leases at once).
#[cfg(feature = "redis")]
#[tokio::test]
async fn concurrent_reentries_keep_the_longest_lease_in_the_store_redis() {
    concurrent_reentries_with_different_leases(&Redis::start().await).await;
}

/// A MultiLock with a fixed 100 ms lease holds `a` and waits for `b`; meanwhile its
/// owner re-enters `a` with the watchdog (3 s lease, renewed every second). Then the
/// MultiLock takes `b` and pins both locks to 100 ms.
///
/// `crossing`: the watchdog's first renewal reaches the store, and its answer is held
/// back until the pin is done — a renewal that crossed the pin on the way. The pin set
/// the store's lease to 100 ms outright, the watchdog's late answer kept the watched
/// guard believing in seconds, and another owner got `a` before the watchdog's next
/// renewal found it gone.
///
/// Not `crossing`: the pin comes before the watchdog's first renewal. Once the store
/// kept the longer lease, the pin still set the hold's belief to exactly 100 ms, so the
/// watched guard reported its lock lost while the store held it for it.
async fn multilock_pin_against_a_watched_reentry(store: &impl Store, crossing: bool) {
    let faulty = store.faulty();
    let client = LockClient::builder(faulty.clone())
        .watchdog_lease(Duration::from_secs(3))
        .build()
        .unwrap();
    let other = store.client();
    let owner = client.new_owner();
    let (a, b) = (key("pin-a"), key("pin-b"));
    let blocker = other
        .get_lock(&b)
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_secs(30))
        .await
        .unwrap();
    let multi = MultiLock::new([client.get_lock(&a).unwrap(), client.get_lock(&b).unwrap()])
        .with_owner(owner.clone());
    let pinned = tokio::spawn(async move {
        multi
            .try_lock_for(Duration::from_secs(5), Duration::from_millis(100))
            .await
    });
    wait_until(
        Duration::from_secs(5),
        "the MultiLock holds a and waits for b",
        || async { store.waiters(&b) == 1 },
    )
    .await;
    let gate = Gate::new();
    if crossing {
        faulty
            .intercept()
            .arm(|f| f.hold_next_renewals_reply = Some(gate.clone()));
    }
    let watched = client
        .get_lock(&a)
        .unwrap()
        .with_owner(owner)
        .lock()
        .await
        .unwrap();
    assert!(watched.is_watched());
    assert_eq!(
        watched.hold_count(),
        2,
        "a watched re-entry of the MultiLock's hold"
    );
    if crossing {
        wait_until(
            Duration::from_secs(5),
            "the watchdog's renewal of a reached the store",
            || async { faulty.intercept().held_renewal_replies() == 1 },
        )
        .await;
    }
    blocker.unlock().await.unwrap();
    let both = pinned.await.unwrap().unwrap();
    gate.open();
    let violations = held_exclusively(
        faulty,
        &other,
        &watched,
        Duration::from_secs(1),
        "after the pin",
    )
    .await;
    drop((watched, both));
    store.wait_clear(&a, "a at the end").await;
    store.wait_clear(&b, "b at the end").await;
    assert_none(violations);
}

// Sequence 8b (a MultiLock's lease pin crossing a watched re-entry's renewal).
#[tokio::test(start_paused = true)]
async fn a_multilock_pin_never_shortens_a_watched_reentrys_lease_memory() {
    multilock_pin_against_a_watched_reentry(&Memory::new(), true).await;
}

// Sequence 8b (a MultiLock's lease pin crossing a watched re-entry's renewal).
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_multilock_pin_never_shortens_a_watched_reentrys_lease_redis() {
    multilock_pin_against_a_watched_reentry(&Redis::start().await, true).await;
}

// Sequence 8c (a MultiLock's lease pin before a watched re-entry's first renewal).
#[tokio::test(start_paused = true)]
async fn a_multilock_pin_never_cuts_a_watched_guards_belief_memory() {
    multilock_pin_against_a_watched_reentry(&Memory::new(), false).await;
}

// Sequence 8c (a MultiLock's lease pin before a watched re-entry's first renewal).
#[cfg(feature = "redis")]
#[tokio::test]
async fn a_multilock_pin_never_cuts_a_watched_guards_belief_redis() {
    multilock_pin_against_a_watched_reentry(&Redis::start().await, false).await;
}

// ---------------------------------------------------------------------------------------
// A MultiLock guard with a lost lock, unlocked while another release fails
// ---------------------------------------------------------------------------------------

/// Releases of its key fail as an outage without reaching the store (the fast path is
/// refused for them too); everything else goes through.
#[derive(Clone)]
struct FailReleasesOf(LockKey);

impl<B: LockBackend> Intercept<B> for FailReleasesOf {
    fn release<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        if req.key == self.0 {
            return Box::pin(async {
                Err(StoreError::msg(
                    StoreErrorKind::Unavailable,
                    "the store did not answer the release (injected)",
                )
                .into())
            });
        }
        inner.release(req)
    }

    fn release_now(&self, inner: &B, req: &LockRequest) -> Option<Result<Release>> {
        if req.key == self.0 {
            return None;
        }
        inner.local()?.release_now(req)
    }
}

/// Found by the Redis nemesis campaign (seed 600 of 1,000 histories of 60 ops): a
/// MultiLock guard one of whose locks had been lost was unlocked while the store
/// timed out another of its releases, and `MultiGuard::unlock` answered that store
/// error, the first error in lock order, instead of `Lost`. A holder told only "the
/// store is unavailable" may take its work for done under the lock; `Lost` says it was
/// not. Both orders of the two locks (one store, so they sort by name): `Lost` either
/// way, with exactly one of the two locks lost before the unlock.
#[tokio::test(start_paused = true)]
async fn a_multilock_with_a_lost_lock_unlocks_as_lost_even_when_another_release_fails() {
    for (fails, lost) in [("a", "b"), ("b", "a")] {
        let (fails, lost) = (key(fails), key(lost));
        let store = MemoryBackend::new();
        let backend = Intercepted::new(store.clone(), FailReleasesOf(fails.clone()));
        let lease = Duration::from_millis(300);
        let client = LockClient::builder(backend)
            .watchdog_lease(lease)
            .build()
            .unwrap();
        let multi = MultiLock::new([
            client.get_lock(&fails).unwrap(),
            client.get_lock(&lost).unwrap(),
        ]);
        let guard = multi.try_lock().await.unwrap();
        // The store forgets one hold; the watchdog's next renewal finds it gone.
        assert!(
            store
                .force_release(&lost, LockMode::Exclusive)
                .await
                .unwrap()
        );
        wait_until(
            Duration::from_secs(5),
            "the watchdog saw the hold gone",
            || {
                let lost_now = guard.is_lost();
                async move { lost_now }
            },
        )
        .await;
        let still_held: Vec<bool> = guard.guards().iter().map(|g| !g.is_lost()).collect();
        assert_eq!(
            still_held.iter().filter(|held| **held).count(),
            1,
            "only {lost}'s lock is lost"
        );
        let unlocked = guard.unlock().await;
        assert!(
            matches!(unlocked, Err(Error::Lost)),
            "{fails} fails to release, {lost} lost: {unlocked:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------
// A hold the watchdog gave up, kept by the store
// ---------------------------------------------------------------------------------------

/// The watchdog's renewals reach the store and take effect there, but their answers are
/// lost (a one-way partition, a store that answers after the watchdog stopped waiting).
/// The guard is told its hold is lost when its lease runs out by the client's clock,
/// while the store, which applied every renewal, keeps the hold for up to a lease more:
/// a phantom every other owner waited out, for as long as the lost guard lived (a
/// handler that does not watch its lost signal) or its release met the same outage.
/// The watchdog now takes back in the store a hold it gives up: nothing is held a
/// third of a lease after the guard is told, with the guard still alive.
async fn a_hold_the_watchdog_gave_up(faulty: &Faulty, store: &dyn LockBackend) {
    let lease = Duration::from_secs(3);
    let client = LockClient::builder(faulty.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let key = key("watchdog-gave-up");
    let guard = client.get_lock(&key).unwrap().lock().await.unwrap();
    faulty.intercept().arm(|f| f.lose_renewal_answers = true);
    wait_until(lease * 2, "the guard is told its hold is lost", || {
        let lost = guard.is_lost();
        async move { lost }
    })
    .await;
    assert!(
        faulty
            .intercept()
            .seen
            .lost_renewal_answers
            .load(Ordering::SeqCst)
            > 0,
        "renewals reached the store"
    );
    wait_until(
        lease / 3,
        "the lost hold taken back in the store",
        || async {
            store
                .admin()
                .unwrap()
                .inspect(&key, LockMode::Exclusive)
                .await
                .unwrap()
                .holders
                .is_empty()
        },
    )
    .await;
    assert!(guard.is_lost());
    drop(guard);
}

#[tokio::test(start_paused = true)]
async fn a_hold_the_watchdog_gave_up_is_taken_back_in_the_store_memory() {
    let store = Memory::new();
    a_hold_the_watchdog_gave_up(&store.faulty, &store.backend).await;
}

#[cfg(feature = "redis")]
#[tokio::test]
async fn a_hold_the_watchdog_gave_up_is_taken_back_in_the_store_redis() {
    let store = Redis::start().await;
    a_hold_the_watchdog_gave_up(&store.faulty, &store.backend).await;
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn a_hold_the_watchdog_gave_up_is_taken_back_in_the_store_postgres() {
    let db = common::postgres::PgDatabase::create().await;
    let backend = tower_lock::PostgresBackend::builder(db.pool(4).await)
        .build()
        .await
        .unwrap();
    a_hold_the_watchdog_gave_up(&faulty(backend.clone()), &backend).await;
}

/// The same for a renewal the store applied whose answer came only after the lease had
/// run out by the client's clock: the guard was told its hold is lost, and the late
/// "renewed" does not bring it back; the store, though, keeps the hold for a lease from
/// that renewal. It is taken back too. (Renewals' answers are lost until just before
/// the lease ends, so the one answered late is the last the watchdog sends.)
#[tokio::test(start_paused = true)]
async fn a_hold_renewed_only_after_its_lease_ran_out_is_taken_back_in_the_store() {
    let store = Memory::new();
    let lease = Duration::from_secs(3);
    let client = LockClient::builder(store.faulty.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let key = key("renewed-too-late");
    let start = Instant::now();
    let guard = client.get_lock(&key).unwrap().lock().await.unwrap();
    let faults = store.faulty.intercept();
    faults.arm(|f| f.lose_renewal_answers = true);
    tokio::time::sleep_until(start + lease - lease / 15).await;
    assert!(!guard.is_lost());
    let gate = Gate::new();
    faults.arm(|f| {
        f.lose_renewal_answers = false;
        f.hold_next_renewals_reply = Some(gate.clone());
    });
    wait_until(lease, "the guard is told its hold is lost", || {
        let lost = guard.is_lost();
        async move { lost }
    })
    .await;
    wait_until(
        lease,
        "a renewal reached the store, its answer held",
        || async { faults.held_renewal_replies() == 1 },
    )
    .await;
    assert_eq!(
        store.holders(&key).await.len(),
        1,
        "the renewals kept it there"
    );
    gate.open();
    wait_until(
        lease / 6,
        "the lost hold taken back in the store",
        || async { store.holders(&key).await.is_empty() },
    )
    .await;
    drop(guard);
}
