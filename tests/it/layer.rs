//! `LockLayer` policies, driven with `tower::ServiceExt::oneshot` on the memory backend.

use crate::common;

use std::convert::Infallible;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use common::{DownBackend, wait_until};
use http::{HeaderName, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use tokio::time::Instant;
use tower::{Layer, Service, ServiceExt, service_fn};
use tower_lock::backend::{
    Acquire, BoxFuture, Intercept, Intercepted, LockBackend, LockMode, LockRequest, Release,
};
use tower_lock::extract::Locks;
use tower_lock::layer::{HeaderKey, KeyError, LockBody, LockLayer, Rejection, key_fn};
use tower_lock::{Error, Lease, LockClient, LockKey, MemoryBackend, Owner, Result};

type Req = Request<()>;
type Res = Response<Full<Bytes>>;

const USER: HeaderName = HeaderName::from_static("x-user-id");

fn user(id: &str) -> Req {
    Request::builder()
        .method(Method::POST)
        .header(USER, id)
        .body(())
        .unwrap()
}

fn by_user() -> HeaderKey {
    HeaderKey::new(USER).namespace("user").unwrap()
}

fn key(s: &str) -> LockKey {
    LockKey::new(s).unwrap()
}

/// A handler that answers 200 with what it saw of its lock, counting calls.
fn handler(
    calls: Arc<AtomicUsize>,
) -> impl Service<Req, Response = Res, Error = Infallible, Future: Send> + Clone + Send {
    service_fn(move |req: Req| {
        let calls = calls.clone();
        async move {
            calls.fetch_add(1, Ordering::SeqCst);
            let held = req
                .extensions()
                .get::<Locks>()
                .and_then(Locks::held)
                .map(|h| {
                    h.keys()
                        .iter()
                        .map(LockKey::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                });
            let owner = Owner::current().map(|o| o.to_string()).unwrap_or_default();
            let locks_owner = req
                .extensions()
                .get::<Locks>()
                .map(|l| l.owner().to_string())
                .unwrap_or_default();
            assert_eq!(
                owner, locks_owner,
                "the scope's owner is the request's owner"
            );
            Ok(Response::new(Full::new(Bytes::from(
                held.unwrap_or_else(|| "unlocked".into()),
            ))))
        }
    })
}

async fn text(res: Response<LockBody<Full<Bytes>>>) -> (StatusCode, String) {
    let status = res.status();
    let body = res.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(body.to_vec()).unwrap())
}

#[tokio::test]
async fn locks_by_header_with_prefix() {
    let backend = MemoryBackend::new();
    let layer = LockLayer::builder(backend.clone(), by_user())
        .key_prefix("lock:order")
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let res = layer
        .layer(handler(calls.clone()))
        .oneshot(user("42"))
        .await
        .unwrap();
    assert_eq!(
        text(res).await,
        (StatusCode::OK, "lock:order:user:{42}".into())
    );
    assert!(backend.is_empty(), "released");
}

/// Busy after the wait: 429 with a `Retry-After` that says when retrying makes sense —
/// 1 s by default, whatever the watched holder's 30 s lease says; with a fixed lease the
/// holder's remaining lease when it is sooner than the configured value.
#[tokio::test(start_paused = true)]
async fn busy_after_the_wait_is_429_with_a_retry_after_that_says_when_to_retry() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let watched = client.get_lock("user:{7}").unwrap().lock().await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let layer = LockLayer::builder(client.clone(), by_user())
        .max_wait(Duration::from_millis(100))
        .build()
        .unwrap();
    let started = Instant::now();
    let res = layer
        .layer(handler(calls.clone()))
        .oneshot(user("7"))
        .await
        .unwrap();
    assert_eq!(
        started.elapsed(),
        Duration::from_millis(100),
        "waited the wait"
    );
    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(
        res.headers()[header::RETRY_AFTER],
        "1",
        "not the holder's 30 s watchdog lease"
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0, "the handler never ran");
    assert_eq!(backend.waiters(&key("user:{7}")), 0, "no waiter left");
    watched.unlock().await.unwrap();

    // Fixed leases: the holder's remaining lease is a real bound, sent when sooner than
    // the configured value (which caps it).
    let _fixed = client
        .get_lock("user:{7}")
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_millis(2500))
        .await
        .unwrap();
    let retry_after = |configured: u64| {
        let layer = LockLayer::builder(client.clone(), by_user())
            .max_wait(Duration::ZERO)
            .lease(Duration::from_secs(3))
            .busy_retry_after(Duration::from_secs(configured))
            .busy_status(StatusCode::LOCKED)
            .build()
            .unwrap();
        let svc = layer.layer(handler(calls.clone()));
        async move {
            let res = svc.oneshot(user("7")).await.unwrap();
            assert_eq!(res.status(), StatusCode::LOCKED);
            res.headers()[header::RETRY_AFTER]
                .to_str()
                .unwrap()
                .to_owned()
        }
    };
    assert_eq!(retry_after(10).await, "3", "2.5 s left, rounded up");
    assert_eq!(retry_after(2).await, "2", "capped");
}

#[tokio::test]
async fn a_waiting_request_gets_the_lock_when_it_is_released() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let holder = client.get_lock("user:{8}").unwrap().lock().await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = LockLayer::new(client, by_user()).layer(handler(calls.clone()));
    let waiting = tokio::spawn(svc.oneshot(user("8")));
    wait_until(Duration::from_secs(5), "the request waits", || async {
        backend.waiters(&key("user:{8}")) == 1
    })
    .await;
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    holder.unlock().await.unwrap();
    let res = waiting.await.unwrap().unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(backend.is_empty());
}

#[tokio::test]
async fn a_request_waiting_on_one_key_does_not_hold_up_another() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let _holder = client.get_lock("user:{1}").unwrap().lock().await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let mut svc = LockLayer::new(client, by_user()).layer(handler(calls.clone()));

    // Same service instance: ready, call (waits in its future), ready again, call.
    let waiting = svc.ready().await.unwrap().call(user("1"));
    let waiting = tokio::spawn(waiting);
    let other = svc.ready().await.unwrap().call(user("2"));
    let res = tokio::time::timeout(Duration::from_secs(2), other)
        .await
        .expect("user 2 was held up by user 1's wait")
        .unwrap();
    assert_eq!(res.status(), StatusCode::OK);
    assert!(!waiting.is_finished());
    waiting.abort();
}

#[tokio::test]
async fn bad_and_missing_keys_are_400_and_the_handler_does_not_run() {
    let backend = MemoryBackend::new();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = LockLayer::new(backend.clone(), by_user()).layer(handler(calls.clone()));

    let missing = Request::builder().method(Method::POST).body(()).unwrap();
    let (status, body) = text(svc.clone().oneshot(missing).await.unwrap()).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body, "missing header `x-user-id`");

    let too_long = "9".repeat(5000);
    let res = svc.clone().oneshot(user(&too_long)).await.unwrap();
    assert_eq!(res.status(), StatusCode::BAD_REQUEST);
    assert!(res.headers().get(header::RETRY_AFTER).is_none());

    let failing = LockLayer::new(
        backend.clone(),
        key_fn(|_| Err::<LockKey, _>(KeyError::new("no tenant"))),
    );
    let (status, body) = text(
        failing
            .layer(handler(calls.clone()))
            .oneshot(user("1"))
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_REQUEST, "no tenant")
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(backend.is_empty());
}

#[tokio::test]
async fn no_key_and_filtered_methods_pass_through_unlocked_with_an_owner() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let _holder = client.get_lock("user:{5}").unwrap().lock().await.unwrap();
    let calls = Arc::new(AtomicUsize::new(0));

    let optional = LockLayer::new(client.clone(), by_user().optional());
    let anonymous = Request::new(());
    let (status, body) = text(
        optional
            .layer(handler(calls.clone()))
            .oneshot(anonymous)
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "unlocked"));

    let posts_only = LockLayer::builder(client, by_user())
        .methods([Method::POST])
        .max_wait(Duration::ZERO)
        .build()
        .unwrap();
    let svc = posts_only.layer(handler(calls.clone()));
    let mut get = user("5");
    *get.method_mut() = Method::GET;
    let (status, body) = text(svc.clone().oneshot(get).await.unwrap()).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "unlocked"));
    let res = svc.oneshot(user("5")).await.unwrap();
    assert_eq!(
        res.status(),
        StatusCode::TOO_MANY_REQUESTS,
        "POST is locked"
    );
}

#[tokio::test]
async fn the_handler_re_enters_its_own_lock() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let inner_client = client.clone();
    let svc = LockLayer::new(client, by_user()).layer(service_fn(move |req: Req| {
        let client = inner_client.clone();
        async move {
            let held = req
                .extensions()
                .get::<Locks>()
                .and_then(Locks::held)
                .unwrap()
                .clone();
            // Through the current owner (plain Lock) and through `Locks`.
            let again = client
                .get_lock(held.key())
                .unwrap()
                .try_lock()
                .await
                .unwrap();
            let locks = req.extensions().get::<Locks>().unwrap();
            let third = locks.try_lock(held.key()).await.unwrap();
            let other = locks
                .try_lock_for("side", Duration::ZERO, Lease::Watchdog)
                .await
                .unwrap();
            assert_eq!(other.owner(), held.owner());
            let body = format!("{} {}", again.hold_count(), third.hold_count());
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::from(body))))
        }
    }));
    let (status, body) = text(svc.oneshot(user("3")).await.unwrap()).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "2 3"));
    wait_until(Duration::from_secs(5), "every hold released", || async {
        backend.is_empty()
    })
    .await;
}

#[tokio::test]
async fn several_keys_are_sorted_and_never_deadlock() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let (i, o) = (inside.clone(), overlaps.clone());
    let layer = LockLayer::new(
        client,
        key_fn(|parts| {
            if parts.headers.contains_key("x-reverse") {
                [key("acct:b"), key("acct:a")]
            } else {
                [key("acct:a"), key("acct:b")]
            }
        }),
    );
    let svc = layer.layer(service_fn(move |req: Req| {
        let (inside, overlaps) = (i.clone(), o.clone());
        async move {
            if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                overlaps.fetch_add(1, Ordering::SeqCst);
            }
            tokio::task::yield_now().await;
            inside.fetch_sub(1, Ordering::SeqCst);
            let keys = req
                .extensions()
                .get::<Locks>()
                .and_then(Locks::held)
                .unwrap()
                .keys()
                .to_vec();
            assert_eq!(keys, vec![key("acct:a"), key("acct:b")], "sorted");
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        }
    }));
    let mut tasks = Vec::new();
    for n in 0..200 {
        let mut req = Request::new(());
        if n % 2 == 1 {
            req.headers_mut().insert("x-reverse", "1".parse().unwrap());
        }
        tasks.push(tokio::spawn(svc.clone().oneshot(req)));
    }
    for t in tasks {
        let res = tokio::time::timeout(Duration::from_secs(20), t)
            .await
            .expect("deadlock")
            .unwrap()
            .unwrap();
        assert_eq!(res.status(), StatusCode::OK);
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0);
    assert!(backend.is_empty());
}

#[tokio::test]
async fn backend_down_fails_closed_with_503_or_open_when_asked() {
    let calls = Arc::new(AtomicUsize::new(0));
    let closed = LockLayer::new(DownBackend, by_user()).layer(handler(calls.clone()));
    let res = closed.oneshot(user("1")).await.unwrap();
    assert_eq!(res.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(res.headers()[header::RETRY_AFTER], "1");
    assert_eq!(calls.load(Ordering::SeqCst), 0);

    let open = LockLayer::builder(DownBackend, by_user())
        .fail_open(true)
        .unavailable_retry_after(Duration::from_millis(1500))
        .build()
        .unwrap()
        .layer(handler(calls.clone()));
    let (status, body) = text(open.oneshot(user("1")).await.unwrap()).await;
    assert_eq!((status, body.as_str()), (StatusCode::OK, "unlocked"));
    assert_eq!(calls.load(Ordering::SeqCst), 1);

    // The configured Retry-After, rounded up.
    let closed = LockLayer::builder(DownBackend, by_user())
        .unavailable_retry_after(Duration::from_millis(1500))
        .build()
        .unwrap()
        .layer(handler(calls.clone()));
    let res = closed.oneshot(user("1")).await.unwrap();
    assert_eq!(res.headers()[header::RETRY_AFTER], "2");
}

#[tokio::test]
async fn a_custom_rejection_handler_answers_every_case() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = seen.clone();
    let layer = LockLayer::builder(DownBackend, by_user())
        .on_rejection(move |r: Rejection| {
            s.lock().unwrap().push(format!("{r:?}"));
            let body = format!(r#"{{"error":"{}"}}"#, r.status().as_u16());
            Response::builder()
                .status(r.status())
                .body(Full::new(Bytes::from(body)))
                .unwrap()
        })
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = layer.layer(handler(calls));
    let (status, body) = text(svc.clone().oneshot(user("1")).await.unwrap()).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::SERVICE_UNAVAILABLE, r#"{"error":"503"}"#)
    );
    let (status, body) = text(svc.oneshot(Request::new(())).await.unwrap()).await;
    assert_eq!(
        (status, body.as_str()),
        (StatusCode::BAD_REQUEST, r#"{"error":"400"}"#)
    );
    let seen = seen.lock().unwrap();
    assert!(seen[0].starts_with("Unavailable"), "{seen:?}");
    assert!(seen[1].starts_with("BadKey"), "{seen:?}");
}

#[tokio::test]
async fn the_inner_services_error_passes_through_unchanged() {
    #[derive(Debug, PartialEq)]
    struct Boom;
    let svc = LockLayer::new(MemoryBackend::new(), by_user())
        .layer(service_fn(|_: Req| async { Err::<Res, _>(Boom) }));
    assert_eq!(svc.oneshot(user("1")).await.unwrap_err(), Boom);
}

/// Records the modes asked for and, like a backend without the lock kinds, answers
/// `Unsupported` for everything but exclusive locks.
type ExclusiveOnly = Intercepted<MemoryBackend, ModeCheck>;

#[derive(Clone, Default)]
struct ModeCheck {
    modes: Arc<Mutex<Vec<LockMode>>>,
}

impl ModeCheck {
    fn check(&self, req: &LockRequest) -> Result<()> {
        self.modes.lock().unwrap().push(req.mode);
        match req.mode {
            LockMode::Exclusive => Ok(()),
            mode => Err(tower_lock::ConfigError::Unsupported {
                backend: "exclusive-only",
                what: format!("{mode} locks"),
            }
            .into()),
        }
    }
}

impl Intercept<MemoryBackend> for ModeCheck {
    fn acquire<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move {
            self.check(req)?;
            inner.acquire(req).await
        })
    }

    fn acquire_now(&self, inner: &MemoryBackend, req: &LockRequest) -> Option<Result<Acquire>> {
        if let Err(error) = self.check(req) {
            return Some(Err(error));
        }
        inner.local()?.acquire_now(req)
    }
}

#[tokio::test]
async fn modes_are_chosen_as_configured_and_unsupported_ones_are_500() {
    let backend = ExclusiveOnly::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let rw = LockLayer::builder(backend.clone(), by_user())
        .read_write_by_method()
        .build()
        .unwrap()
        .layer(handler(calls.clone()));
    for method in [
        Method::GET,
        Method::HEAD,
        Method::OPTIONS,
        Method::POST,
        Method::DELETE,
    ] {
        let mut req = user("1");
        *req.method_mut() = method;
        let (status, body) = text(rw.clone().oneshot(req).await.unwrap()).await;
        assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR);
        assert!(body.contains("misconfigured"), "{body}");
        assert!(
            !body.contains("support"),
            "details are logged, not sent: {body}"
        );
    }
    let fair = LockLayer::builder(backend.clone(), by_user())
        .fair()
        .build()
        .unwrap();
    let permits = LockLayer::builder(backend.clone(), by_user())
        .permits(3)
        .build()
        .unwrap();
    for layer in [fair, permits] {
        let res = layer
            .layer(handler(calls.clone()))
            .oneshot(user("1"))
            .await
            .unwrap();
        assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
    }
    let three = std::num::NonZeroU32::new(3).unwrap();
    assert_eq!(
        *backend.intercept().modes.lock().unwrap(),
        [
            LockMode::Read,
            LockMode::Read,
            LockMode::Read,
            LockMode::Write,
            LockMode::Write,
            LockMode::Fair,
            LockMode::Permits { max: three },
        ]
    );
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    assert!(backend.inner().is_empty());

    // Fail-open is for outages, not for configuration the backend cannot serve.
    let open = LockLayer::builder(backend.clone(), by_user())
        .fair()
        .fail_open(true)
        .build()
        .unwrap();
    let res = open
        .layer(handler(calls.clone()))
        .oneshot(user("1"))
        .await
        .unwrap();
    assert_eq!(res.status(), StatusCode::INTERNAL_SERVER_ERROR);
}

#[test]
fn the_builder_names_bad_values() {
    let b = || LockLayer::builder(MemoryBackend::new(), by_user());
    let cases: Vec<(_, &str)> = vec![
        (
            b().max_wait(Duration::from_secs(3600)).build(),
            "`max_wait`",
        ),
        (b().lease(Duration::ZERO).build(), "`lease`"),
        (b().busy_status(StatusCode::OK).build(), "`busy_status`"),
        (b().methods([]).build(), "`methods`"),
        (b().key_prefix("a{b").build(), "`key_prefix`"),
        (b().key_prefix("").build(), "`key_prefix`"),
        (
            b().key_prefix("p".repeat(tower_lock::MAX_NAMESPACE_LEN + 1))
                .build(),
            "`key_prefix`",
        ),
        (b().permits(0).build(), "`permits`"),
        (
            b().unavailable_retry_after(Duration::ZERO).build(),
            "`unavailable_retry_after`",
        ),
        (
            b().busy_retry_after(Duration::from_secs(7200)).build(),
            "`busy_retry_after`",
        ),
        // One kind of lock per layer: a second mode setter is refused, not obeyed.
        (b().permits(2).fair().build(), "`mode`"),
        (b().fair().read_write_by_method().build(), "`mode`"),
        (b().permits(2).permits(3).build(), "`mode`"),
    ];
    for (result, name) in cases {
        match result {
            Err(tower_lock::ConfigError::InvalidSetting { .. }) => {
                let text = result.unwrap_err().to_string();
                assert!(text.contains(name), "{text}");
            }
            other => panic!("{name}: expected InvalidSetting, got {other:?}"),
        }
    }
    assert!(b().max_wait(Duration::ZERO).build().is_ok());
    assert!(
        b().fair().fair().build().is_ok(),
        "the same kind twice is fine"
    );
}

#[tokio::test]
async fn dropped_futures_leave_no_lock_and_no_waiter() {
    let backend = MemoryBackend::new();
    let client = LockClient::new(backend.clone());
    let entered = Arc::new(tokio::sync::Notify::new());
    let e = entered.clone();
    let svc = LockLayer::new(client.clone(), by_user()).layer(service_fn(move |_: Req| {
        let entered = e.clone();
        async move {
            entered.notify_one();
            std::future::pending::<()>().await;
            Ok::<Res, Infallible>(Response::new(Full::new(Bytes::new())))
        }
    }));
    // Inside the handler.
    let inside = tokio::spawn(svc.clone().oneshot(user("1")));
    entered.notified().await;
    assert!(backend.contains_key(&key("user:{1}")));
    // Waiting behind it.
    let waiting = tokio::spawn(svc.clone().oneshot(user("1")));
    wait_until(
        Duration::from_secs(5),
        "the second request waits",
        || async { backend.waiters(&key("user:{1}")) == 1 },
    )
    .await;
    waiting.abort();
    inside.abort();
    wait_until(Duration::from_secs(5), "no lock and no waiter", || async {
        backend.is_empty()
    })
    .await;
    assert_eq!(client.watched_locks(), 0);
}

/// Holds every release until the gate opens, as a slow store would.
type SlowRelease = Intercepted<MemoryBackend, ReleaseGate>;

#[derive(Clone, Default)]
struct ReleaseGate {
    gate: Arc<tokio::sync::Notify>,
    open: Arc<std::sync::atomic::AtomicBool>,
}

impl Intercept<MemoryBackend> for ReleaseGate {
    fn release<'a>(
        &'a self,
        inner: &'a MemoryBackend,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move {
            while !self.open.load(Ordering::SeqCst) {
                self.gate.notified().await;
            }
            inner.release(req).await
        })
    }

    /// A closed gate sends the release the async way, to wait there.
    fn release_now(&self, inner: &MemoryBackend, req: &LockRequest) -> Option<Result<Release>> {
        if !self.open.load(Ordering::SeqCst) {
            return None;
        }
        inner.local()?.release_now(req)
    }
}

/// The client hangs up while the layer is releasing: the release still completes.
#[tokio::test]
async fn a_response_dropped_mid_release_still_releases() {
    let backend = SlowRelease::default();
    let calls = Arc::new(AtomicUsize::new(0));
    let svc = LockLayer::new(backend.clone(), by_user()).layer(handler(calls.clone()));
    let pending = tokio::time::timeout(Duration::from_millis(100), svc.oneshot(user("7"))).await;
    assert!(pending.is_err(), "the response waits for the release");
    assert_eq!(calls.load(Ordering::SeqCst), 1, "the handler ran");
    let key = LockKey::namespaced("user", "7").unwrap();
    assert!(
        backend.inner().contains_key(&key),
        "still held: the release is stalled"
    );
    backend.intercept().open.store(true, Ordering::SeqCst);
    backend.intercept().gate.notify_waiters();
    wait_until(
        Duration::from_secs(2),
        "the dropped response's release completed",
        || async { !backend.inner().contains_key(&key) },
    )
    .await;
}

/// Counts every question an acquisition puts to the store, by either route.
#[derive(Clone, Default)]
struct CountAsks(Arc<AtomicUsize>);

impl<B: LockBackend> Intercept<B> for CountAsks {
    fn acquire<'a>(&'a self, inner: &'a B, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        inner.acquire(req)
    }

    fn acquire_now(&self, inner: &B, req: &LockRequest) -> Option<Result<Acquire>> {
        let answer = inner.local()?.acquire_now(req)?;
        self.0.fetch_add(1, Ordering::SeqCst);
        Some(answer)
    }
}

/// A busy acquisition on a store with a fast path asks twice before it sleeps: the fast
/// path's question, whose busy answer the wait starts from, and the one after
/// subscribing (a release in between must not be missed); then once more when its time
/// is up. It asked the fast path's question again first. The same through `Lock` and
/// through the layer, which share the one entry point.
#[tokio::test(start_paused = true)]
async fn a_busy_acquisition_asks_the_store_twice_before_it_sleeps() {
    let backend = Intercepted::new(MemoryBackend::new(), CountAsks::default());
    let asks = backend.intercept().0.clone();
    let client = LockClient::new(backend.clone());
    let held = client
        .get_lock("user:{7}")
        .unwrap()
        .try_lock_for(Duration::ZERO, Duration::from_secs(60))
        .await
        .unwrap();
    let layer = LockLayer::builder(client.clone(), by_user())
        .max_wait(Duration::from_millis(100))
        .build()
        .unwrap();
    let calls = Arc::new(AtomicUsize::new(0));

    for by in ["Lock", "the layer"] {
        asks.store(0, Ordering::SeqCst);
        let waiting = tokio::spawn({
            let (client, svc) = (client.clone(), layer.layer(handler(calls.clone())));
            async move {
                if by == "Lock" {
                    let lock = client.get_lock("user:{7}").unwrap();
                    let busy = lock
                        .try_lock_for(Duration::from_millis(100), Lease::Watchdog)
                        .await;
                    assert!(matches!(busy, Err(Error::Busy { .. })), "{busy:?}");
                } else {
                    let res = svc.oneshot(user("7")).await.unwrap();
                    assert_eq!(res.status(), StatusCode::TOO_MANY_REQUESTS);
                }
            }
        });
        // Paused time moves on only once the waiter sleeps.
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(backend.inner().waiters(&key("user:{7}")), 1, "{by} waits");
        assert_eq!(
            asks.load(Ordering::SeqCst),
            2,
            "asks by {by} before it sleeps"
        );
        waiting.await.unwrap();
        assert_eq!(asks.load(Ordering::SeqCst), 3, "asks by {by} in all");
    }
    assert_eq!(calls.load(Ordering::SeqCst), 0);
    held.unlock().await.unwrap();
}
