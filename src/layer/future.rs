//! [`ResponseFuture`]: key, acquire, drive the inner service's readiness, call it as the
//! request's owner, release.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode};
use http_body::Body;
use pin_project::pin_project;
use tower::Service;

use super::body::LockBody;
use super::config::{OnLost, ReleaseOn};
use super::keys::{Extracted, KeyError, Keys};
use super::layer::Core;
use super::rejection::{Rejection, RejectionBody};
use super::request_locks::RequestLocks;
use crate::backend::BoxFuture;
use crate::error::Result;
use crate::extract::{HeldLock, Locks};
use crate::key::LockKey;
use crate::kinds::MultiLock;
use crate::lock::LayerOutcome;
use crate::lock::acquire::deadline_after;
use crate::lock::{Acquisition, Acting, Guards, LostSignal, begin_acquire};
use crate::owner::Owner;

/// The response future of [`LockService`](super::LockService).
///
/// It runs `Keying → Acquiring → Ready → Calling → Releasing → Done`: it derives the
/// request's key(s) from its head, waits for the lock(s), then waits for the inner
/// service to be ready (so a request waiting for a lock holds none of its capacity),
/// calls it with the request's owner made [current](Owner::scope), and releases once the
/// response is ready (or hands the locks to the [body](LockBody)). A failed derivation or
/// acquisition ends at once with the rejection handler's answer.
///
/// # Cancel safety
///
/// Dropped while keying or acquiring, it leaves no lock and no waiter behind (as
/// [`Lock::try_lock_for`](crate::Lock::try_lock_for)). Dropped while waiting for the
/// inner service's readiness, while it runs, or while releasing, its locks are released
/// in a spawned task.
#[pin_project]
pub struct ResponseFuture<S, B, KF>
where
    S: Service<Request<B>>,
{
    #[pin]
    state: State<S, B, KF>,
    /// Declared after `state`, so that the inner future is dropped before the locks it
    /// ran under.
    request: Handling<S, B>,
    /// `tower_lock.layer`, entered while polled: the layer's name, the key namespace and
    /// the decision.
    span: tracing::Span,
}

/// The layer's span for one request.
fn layer_span(core: &Core) -> tracing::Span {
    tracing::debug_span!(
        "tower_lock.layer",
        layer = core.name(),
        namespace = tracing::field::Empty,
        decision = tracing::field::Empty,
    )
}

/// Where the request is. Each state holds only what is polled in it; what the request
/// carries from one state to the next is in [`Handling`].
#[pin_project(project = StateProj)]
enum State<S, B, KF>
where
    S: Service<Request<B>>,
{
    /// Deriving the keys from the request's head; the body waits here.
    Keying {
        #[pin]
        keys: KF,
        body: Option<B>,
    },
    /// Waiting for the locks.
    Acquiring {
        acquire: BoxFuture<'static, Result<Guards>>,
    },
    /// Locked, or passing through unlocked: waiting for the inner service's readiness.
    Ready,
    /// The inner service handles the request, as the request's owner.
    Calling {
        #[pin]
        future: S::Future,
    },
    /// The response is ready; its locks are released before it is handed on.
    Releasing {
        result: Option<std::result::Result<S::Response, S::Error>>,
    },
    Done,
}

/// A request on its way through the layer: what the steps of [`ResponseFuture`] carry
/// from one state to the next.
struct Handling<S, B> {
    core: Arc<Core>,
    owner: Owner,
    /// The owner was made for this request by this layer and has taken no lock yet.
    fresh_owner: bool,
    /// The inner service's clone: readied and called once the locks are held, then
    /// dropped.
    svc: Option<S>,
    /// The request, from when its keys are derived until the inner service takes it.
    req: Option<Request<B>>,
    /// The request was a `HEAD`: no body follows the response head.
    head: bool,
    /// The request's first key, once derived: for the observer's reports.
    key: Option<LockKey>,
    /// The request's locks, from their acquisition until released or handed to the body.
    locks: RequestLocks,
    /// The locks were taken: the inner service's answer is counted as served under them.
    locked: bool,
    /// The locks' lost signal, if the configuration cancels the handler when it fires.
    lost: Option<LostSignal>,
    /// Waits for [`lost`](Self::lost): made only once the inner future is pending (most
    /// handlers answer on their first poll, and then it costs no allocation).
    lost_wait: Option<BoxFuture<'static, ()>>,
}

/// What a step leads to: another state to poll, or the future's output.
enum Next<S, B, KF, O>
where
    S: Service<Request<B>>,
{
    State(State<S, B, KF>),
    Done(O),
}

impl<S, B, KF> ResponseFuture<S, B, KF>
where
    S: Service<Request<B>>,
{
    /// Derives the keys, then takes the locks as `owner` (`fresh`: made by this layer
    /// for this request).
    pub(crate) fn keying(
        core: Arc<Core>,
        owner: Owner,
        fresh: bool,
        keys: KF,
        body: B,
        svc: S,
    ) -> Self {
        let mut request = Handling::new(core, owner, svc, None);
        request.fresh_owner = fresh;
        ResponseFuture {
            state: State::Keying {
                keys,
                body: Some(body),
            },
            span: layer_span(&request.core),
            request,
        }
    }

    /// Calls the inner service without a lock (once it is ready).
    pub(crate) fn unlocked(core: Arc<Core>, owner: Owner, svc: S, req: Request<B>) -> Self {
        let mut request = Handling::new(core, owner, svc, None);
        request.head = req.method() == Method::HEAD;
        request.req = Some(req);
        ResponseFuture {
            state: State::Ready,
            request,
            span: tracing::Span::none(),
        }
    }
}

impl<S, B, KF, ResB> Future for ResponseFuture<S, B, KF>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    KF: Future<Output = Extracted>,
    ResB: Body,
{
    type Output = std::result::Result<Response<LockBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let _entered = this.span.enter();
        let request = this.request;
        loop {
            let next = match this.state.as_mut().project() {
                StateProj::Keying { keys, body } => {
                    let extracted = ready!(keys.poll(cx));
                    request.keyed(extracted, body.take(), this.span)
                }
                StateProj::Acquiring { acquire } => {
                    let outcome = ready!(acquire.as_mut().poll(cx));
                    request.acquired(outcome)
                }
                StateProj::Ready => ready!(request.poll_call(cx)),
                StateProj::Calling { future } => ready!(request.poll_response(future, cx)),
                StateProj::Releasing { result } => {
                    ready!(request.locks.poll_released(cx));
                    Next::Done(released(result.take()))
                }
                StateProj::Done => Next::Done(Ok(internal_error())),
            };
            match next {
                Next::State(state) => this.state.set(state),
                Next::Done(output) => {
                    // The inner future goes first, then the locks it ran under (their
                    // guards release in spawned tasks).
                    this.state.set(State::Done);
                    request.finish();
                    return Poll::Ready(output);
                }
            }
        }
    }
}

/// What [`ResponseFuture`] resolves to, for an inner service `S` whose body is `ResB`.
type Answer<S, B, ResB> =
    std::result::Result<Response<LockBody<ResB>>, <S as Service<Request<B>>>::Error>;

/// What a step of [`ResponseFuture`] leads to.
type Step<S, B, KF, ResB> = Next<S, B, KF, Answer<S, B, ResB>>;

impl<S, B> Handling<S, B> {
    fn new(core: Arc<Core>, owner: Owner, svc: S, req: Option<Request<B>>) -> Self {
        Handling {
            core,
            owner,
            fresh_owner: false,
            svc: Some(svc),
            req,
            head: false,
            key: None,
            locks: RequestLocks::none(),
            locked: false,
            lost: None,
            lost_wait: None,
        }
    }

    /// Done: drops the locks not handed on (their guards release in spawned tasks), and
    /// the service and the request if they were not called.
    fn finish(&mut self) {
        self.locks.drop_now();
        self.lost = None;
        self.lost_wait = None;
        self.svc = None;
        self.req = None;
    }
}

impl<S, B, ResB> Handling<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
    ResB: Body,
{
    /// The keys are derived: pass the request through unlocked (no keys), reject it (a
    /// bad key), or take its locks.
    fn keyed<KF>(
        &mut self,
        (parts, keys): Extracted,
        body: Option<B>,
        span: &tracing::Span,
    ) -> Step<S, B, KF, ResB> {
        let Some(body) = body else {
            return Next::Done(Ok(internal_error()));
        };
        self.head = parts.method == Method::HEAD;
        let req = Request::from_parts(parts, body);
        let keys = match keys.and_then(|keys| self.core.prefixed(keys)) {
            Ok(keys) => keys,
            Err(error) => return rejected(reject_bad_key(&self.core, error)),
        };
        let Some(first) = keys.as_slice().first() else {
            span.record("decision", "unlocked");
            self.req = Some(req);
            return Next::State(State::Ready);
        };
        span.record("namespace", first.namespace());
        self.key = Some(first.clone());
        let fresh = std::mem::take(&mut self.fresh_owner);
        let locking = acquire(&self.core, &self.owner, fresh, keys, req.method());
        self.req = Some(req);
        match locking {
            Acquisition::Now(outcome) => self.acquired(outcome),
            Acquisition::Later(acquire) => Next::State(State::Acquiring { acquire }),
        }
    }

    /// The acquisition's outcome: ready to call the inner service with the locks held
    /// (or, failing open, without them), or rejected.
    fn acquired<KF>(&mut self, outcome: Result<Guards>) -> Step<S, B, KF, ResB> {
        let error = match outcome {
            Ok(guard) => {
                self.hold(guard);
                return Next::State(State::Ready);
            }
            Err(error) => error,
        };
        let core = &self.core;
        match core.config.rejection_for(error) {
            Rejection::Unavailable { error, .. } if core.config.fail_open => {
                core.report.outage(core.name(), &error, true);
                core.outcome(self.key.as_ref(), LayerOutcome::FailOpen);
                Next::State(State::Ready)
            }
            rejection => {
                match &rejection {
                    Rejection::Unavailable { error, .. } => {
                        core.report.outage(core.name(), error, false);
                    }
                    Rejection::Misconfigured(error) => {
                        core.report.misconfigured(core.name(), error);
                    }
                    rejection => tracing::debug!(?rejection, "request rejected by LockLayer"),
                }
                rejected(core.reject(rejection, self.key.as_ref()))
            }
        }
    }

    /// The locks are held: the request carries them (for the extractors), and so does
    /// the future, until they are released.
    fn hold(&mut self, guard: Guards) {
        tracing::Span::current().record("decision", "locked");
        self.locked = true;
        if let (Some(held), Some(req)) = (HeldLock::new(&guard), self.req.as_mut()) {
            Locks::record_held(req.extensions_mut(), held, false);
        }
        if self.core.config.on_lost == OnLost::Cancel {
            self.lost = Some(guard.lost());
        }
        self.locks = RequestLocks::new(guard, self.core.client.clone());
    }

    /// Waits for the inner service's readiness (the locks are held by now), then calls
    /// it as the request's owner.
    fn poll_call<KF>(&mut self, cx: &mut Context<'_>) -> Poll<Step<S, B, KF, ResB>> {
        let Some(svc) = self.svc.as_mut() else {
            return Poll::Ready(Next::Done(Ok(internal_error())));
        };
        if let Err(error) = ready!(svc.poll_ready(cx)) {
            return Poll::Ready(Next::Done(Err(error)));
        }
        let Some(req) = self.req.take() else {
            return Poll::Ready(Next::Done(Ok(internal_error())));
        };
        let future = self.owner.clone().sync_scope(|| svc.call(req));
        // The clone has served its purpose; dropped now, as `call` takes `&mut self`.
        self.svc = None;
        Poll::Ready(Next::State(State::Calling { future }))
    }

    /// Polls the inner future as the request's owner. Its response is handed on; if the
    /// locks are lost first and the configuration cancels then, the answer is
    /// [`Rejection::Lost`] and the inner future is dropped.
    fn poll_response<KF>(
        &mut self,
        future: Pin<&mut S::Future>,
        cx: &mut Context<'_>,
    ) -> Poll<Step<S, B, KF, ResB>> {
        if let Poll::Ready(result) = self.owner.clone().sync_scope(|| future.poll(cx)) {
            return Poll::Ready(self.respond(result));
        }
        let Some(lost) = self.lost.as_ref() else {
            return Poll::Pending;
        };
        let wait = self.lost_wait.get_or_insert_with(|| Box::pin(lost.wait()));
        ready!(wait.as_mut().poll(cx));
        tracing::error!(
            owner = %self.owner,
            "the request's lock was lost while it was being handled; cancelling it"
        );
        let rejection = Rejection::Lost {
            retry_after: self.core.config.unavailable_retry_after,
        };
        Poll::Ready(rejected(self.core.reject(rejection, self.key.as_ref())))
    }

    /// The inner service answered: the response is handed on with the locks in its body,
    /// or once they are released.
    fn respond<KF>(
        &mut self,
        result: std::result::Result<S::Response, S::Error>,
    ) -> Step<S, B, KF, ResB> {
        self.lost = None;
        self.lost_wait = None;
        if self.locked {
            self.core.outcome(self.key.as_ref(), LayerOutcome::Served);
        }
        match result {
            Ok(response) if self.body_holds_locks(&response) => {
                let locks = std::mem::replace(&mut self.locks, RequestLocks::none());
                Next::Done(Ok(with_locks_in_body(response, locks)))
            }
            result => {
                self.locks.start();
                Next::State(State::Releasing {
                    result: Some(result),
                })
            }
        }
    }

    /// With [`ReleaseOn::BodyEnd`] the body holds the locks and releases them before its
    /// last byte; a response that will send no body (to a HEAD, a 204 or 304, an empty
    /// body) releases them with its head instead.
    fn body_holds_locks(&self, response: &Response<ResB>) -> bool {
        self.core.config.release_on == ReleaseOn::BodyEnd
            && !self.head
            && !bodiless(response.status())
            && !response.body().is_end_stream()
    }
}

/// The request's locks, taken as its owner (`fresh`: made for this request, with no lock
/// taken yet): one lock through the lock core's entry point (answered on the spot when
/// the store can, with no future to box), several as one MultiLock.
fn acquire(core: &Core, owner: &Owner, fresh: bool, keys: Keys, method: &Method) -> Locking {
    let config = &core.config;
    let mode = config.mode.for_method(method);
    let lock = |key| {
        let lock = core.client.lock_on(key, mode);
        if config.fenced { lock.fenced() } else { lock }
    };
    let (wait, lease) = (config.wait, config.lease);
    let keys = match keys.into_one() {
        Ok(key) => {
            // The common case: no MultiLock and no vectors.
            let deadline = deadline_after(Some(wait));
            let acting = if fresh {
                Acting::First(owner.clone())
            } else {
                Acting::As(owner.clone())
            };
            return match begin_acquire(lock(key), acting, deadline, lease) {
                Acquisition::Now(outcome) => Acquisition::Now(outcome.map(Guards::One)),
                Acquisition::Later(waiting) => {
                    Acquisition::Later(Box::pin(async move { waiting.await.map(Guards::One) }))
                }
            };
        }
        Err(keys) => keys,
    };
    // Several holds, each with an identity of its own.
    let owner = owner.clone();
    let locks = MultiLock::new(keys.into_iter().map(lock));
    Acquisition::Later(Box::pin(async move {
        locks.acquire_as(owner, Some(wait), lease).await
    }))
}

/// A request's locks, taken on the spot or still to wait for.
type Locking = Acquisition<Guards, BoxFuture<'static, Result<Guards>>>;

/// `response` with the locks in its body, which releases them before its last byte.
fn with_locks_in_body<ResB: Body>(
    response: Response<ResB>,
    locks: RequestLocks,
) -> Response<LockBody<ResB>> {
    let length = response
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse().ok());
    response.map(|b| LockBody::with_length(b, locks, length))
}

/// The inner service's answer, its locks released.
fn released<ResB: Body, E>(
    result: Option<std::result::Result<Response<ResB>, E>>,
) -> std::result::Result<Response<LockBody<ResB>>, E> {
    match result {
        Some(result) => result.map(|res| res.map(|b| LockBody::new(b, RequestLocks::none()))),
        None => Ok(internal_error()),
    }
}

/// A step's end with the rejection handler's `response`.
fn rejected<S, B, KF, ResB>(response: Response<RejectionBody>) -> Step<S, B, KF, ResB>
where
    S: Service<Request<B>>,
{
    Next::Done(Ok(response.map(LockBody::rejection)))
}

/// Statuses whose responses carry no body, whatever the body says.
fn bodiless(status: StatusCode) -> bool {
    status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
}

/// The rejection of a request whose key could not be derived; a server-side fault is
/// logged here (once per cause), since its text does not reach the client.
fn reject_bad_key(core: &Core, error: KeyError) -> Response<RejectionBody> {
    if error.is_server_error() {
        let cause = format_args!("the request's lock key could not be derived: {error}");
        core.report.misconfigured(core.name(), &cause);
    } else {
        tracing::debug!(%error, "request rejected: bad lock key");
    }
    core.reject(Rejection::BadKey(error), None)
}

/// Answers a future polled after it completed (a caller bug) without panicking.
fn internal_error<B>() -> Response<LockBody<B>> {
    let body = http_body_util::Full::new(Bytes::from_static(
        b"tower-lock: response future polled after completion",
    ));
    let mut response =
        super::rejection::boxed_response(Response::new(body)).map(LockBody::rejection);
    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    response
}

impl<S, B, KF> fmt::Debug for ResponseFuture<S, B, KF>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Keying { .. } => "Keying",
            State::Acquiring { .. } => "Acquiring",
            State::Ready => "Ready",
            State::Calling { .. } => "Calling",
            State::Releasing { .. } => "Releasing",
            State::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("owner", &self.request.owner)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use std::convert::Infallible;
    use std::time::Duration;

    use http_body_util::{BodyExt, Full};
    use tower::{Layer, Service, ServiceExt, service_fn};

    use http::request::Parts;

    use crate::layer::{LockLayer, OnLost};
    use crate::{LockKey, MemoryBackend};

    fn key() -> LockKey {
        LockKey::new("fut").unwrap()
    }

    async fn ok(_: Request<()>) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
        Ok(Response::new(Full::new(Bytes::from_static(b"body"))))
    }

    use super::*;

    /// Polled outside a tokio runtime, a locked request is a 500, not a panic.
    #[test]
    fn outside_a_runtime_a_request_is_a_500_not_a_panic() {
        use std::task::Waker;
        let backend = MemoryBackend::new();
        let mut svc = LockLayer::new(backend, |_: &Parts| key()).layer(service_fn(ok));
        let mut cx = Context::from_waker(Waker::noop());
        assert!(svc.poll_ready(&mut cx).is_ready());
        let mut future = std::pin::pin!(svc.call(Request::new(())));
        match future.as_mut().poll(&mut cx) {
            Poll::Ready(Ok(response)) => {
                assert_eq!(response.status(), StatusCode::INTERNAL_SERVER_ERROR);
            }
            other => panic!(
                "expected a 500, got {:?}",
                other.map(|r| r.map(|r| r.status()))
            ),
        }
    }

    #[tokio::test]
    async fn released_before_the_response_is_handed_on() {
        let backend = MemoryBackend::new();
        let svc = LockLayer::new(backend.clone(), |_: &Parts| key()).layer(service_fn(ok));
        let response = svc.oneshot(Request::new(())).await.unwrap();
        assert!(!backend.contains_key(&key()), "released with the response");
        assert!(!response.body().holds_locks());
    }

    #[tokio::test]
    async fn held_until_the_body_is_read_when_configured() {
        let backend = MemoryBackend::new();
        let layer = LockLayer::builder(backend.clone(), |_: &Parts| key())
            .release_on(ReleaseOn::BodyEnd)
            .build()
            .unwrap();
        let response = layer
            .layer(service_fn(ok))
            .oneshot(Request::new(()))
            .await
            .unwrap();
        assert!(
            backend.contains_key(&key()),
            "still held after the future resolved"
        );
        assert!(response.body().holds_locks());
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(body, "body");
        assert!(
            !backend.contains_key(&key()),
            "released once the body was read"
        );
    }

    /// A response future dropped while the handler runs drops the handler first, then
    /// releases the lock: what the handler's destructors do (a rollback) is still done
    /// under the lock.
    #[tokio::test]
    async fn the_handler_is_dropped_before_its_lock_is_released() {
        struct Probe(MemoryBackend, Arc<std::sync::Mutex<Option<bool>>>);
        impl Drop for Probe {
            fn drop(&mut self) {
                *self.1.lock().unwrap() = Some(self.0.contains_key(&key()));
            }
        }
        let backend = MemoryBackend::new();
        let held_at_drop = Arc::new(std::sync::Mutex::new(None));
        let (store, seen) = (backend.clone(), held_at_drop.clone());
        let handler = service_fn(move |_: Request<()>| {
            let probe = Probe(store.clone(), seen.clone());
            async move {
                let _probe = probe;
                std::future::pending::<()>().await;
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        });
        let svc = LockLayer::new(backend.clone(), |_: &Parts| key()).layer(handler);
        let mut future = Box::pin(svc.oneshot(Request::new(())));
        assert!(futures_util::FutureExt::now_or_never(&mut future).is_none());
        assert!(backend.contains_key(&key()), "held while the handler runs");
        drop(future);
        assert_eq!(
            *held_at_drop.lock().unwrap(),
            Some(true),
            "dropped under the lock"
        );
        assert!(
            !backend.contains_key(&key()),
            "released once the handler was dropped"
        );
    }

    #[tokio::test]
    async fn a_lost_lock_cancels_the_handler() {
        let backend = MemoryBackend::new();
        let layer = LockLayer::builder(backend.clone(), |_: &Parts| key())
            .lease(Duration::from_millis(30))
            .build()
            .unwrap();
        let finished = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = finished.clone();
        let slow = service_fn(move |_: Request<()>| {
            let flag = flag.clone();
            async move {
                tokio::time::sleep(Duration::from_secs(10)).await;
                flag.store(true, std::sync::atomic::Ordering::SeqCst);
                Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
            }
        });
        let started = tokio::time::Instant::now();
        let response = layer.layer(slow).oneshot(Request::new(())).await.unwrap();
        assert_eq!(response.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(response.headers()[http::header::RETRY_AFTER], "1");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(!finished.load(std::sync::atomic::Ordering::SeqCst));

        // With `Continue`, the handler runs to the end.
        let layer = LockLayer::builder(backend.clone(), |_: &Parts| key())
            .lease(Duration::from_millis(30))
            .on_lost(OnLost::Continue)
            .build()
            .unwrap();
        let slow = service_fn(|_: Request<()>| async {
            tokio::time::sleep(Duration::from_millis(80)).await;
            Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
        });
        let response = layer.layer(slow).oneshot(Request::new(())).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
    }
}
