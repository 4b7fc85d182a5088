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
use super::release::Release;
use crate::backend::BoxFuture;
use crate::error::Result;
use crate::extract::HeldLock;
use crate::key::LockKey;
use crate::kinds::{MultiGuard, MultiLock};
use crate::lock::LayerOutcome;
use crate::lock::acquire::deadline_after;
use crate::lock::{Acquisition, begin_acquire};
use crate::owner::Owner;

/// The response future of [`LockService`](super::LockService).
///
/// It runs `Keying → Acquiring → Ready → Calling → Releasing → Done`: it derives the
/// request's key(s) from its head, waits for the lock(s), then waits for the inner
/// service to be ready (so a request waiting for a lock holds none of its capacity),
/// calls it with the request's owner made [current](Owner::scope), and releases once the
/// response is ready (or hands the locks to the [body](LockBody)). A failed derivation or
/// acquisition ends in `Rejected`, answered by the rejection handler.
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
    core: Arc<Core>,
    owner: Owner,
    /// The request was a `HEAD`: no body follows the response head.
    head: bool,
    /// The request's first key, once derived: for the observer's reports.
    key: Option<LockKey>,
    /// `tower_lock.layer`, entered while polled: the key namespace and the decision.
    span: tracing::Span,
}

/// The layer's span for one request.
fn layer_span() -> tracing::Span {
    tracing::debug_span!(
        "tower_lock.layer",
        namespace = tracing::field::Empty,
        decision = tracing::field::Empty,
    )
}

#[pin_project(project = StateProj, project_replace = StateOwn)]
enum State<S, B, KF>
where
    S: Service<Request<B>>,
{
    Keying {
        #[pin]
        keys: KF,
        body: Option<B>,
        svc: S,
    },
    Acquiring {
        acquire: BoxFuture<'static, Result<MultiGuard>>,
        svc: S,
        req: Request<B>,
    },
    Ready {
        svc: S,
        req: Option<Request<B>>,
        release: Release,
        lost: Option<BoxFuture<'static, ()>>,
    },
    Calling {
        #[pin]
        future: S::Future,
        release: Release,
        /// Fires when the lock is lost, if the configuration cancels then.
        lost: Option<BoxFuture<'static, ()>>,
    },
    Releasing {
        release: Release,
        result: Option<std::result::Result<S::Response, S::Error>>,
    },
    Rejected {
        response: Option<Response<RejectionBody>>,
    },
    Done,
}

impl<S, B, KF> ResponseFuture<S, B, KF>
where
    S: Service<Request<B>>,
{
    pub(crate) fn keying(core: Arc<Core>, owner: Owner, keys: KF, body: B, svc: S) -> Self {
        ResponseFuture {
            state: State::Keying {
                keys,
                body: Some(body),
                svc,
            },
            core,
            owner,
            head: false,
            key: None,
            span: layer_span(),
        }
    }

    /// Calls the inner service without a lock (once it is ready).
    pub(crate) fn unlocked(core: Arc<Core>, owner: Owner, svc: S, req: Request<B>) -> Self {
        ResponseFuture {
            head: req.method() == Method::HEAD,
            state: State::Ready {
                svc,
                req: Some(req),
                release: Release::none(),
                lost: None,
            },
            core,
            owner,
            key: None,
            span: tracing::Span::none(),
        }
    }
}

/// The request's locks, taken as its owner: one lock through the lock core's entry
/// point (answered on the spot when the store can, with no future to box), several as
/// one MultiLock.
fn acquire(core: &Arc<Core>, owner: &Owner, keys: Keys, method: &Method) -> Locking {
    let mode = core.config.mode.for_method(method);
    let fenced = core.config.fenced;
    let lock = |key| {
        let lock = core.client.lock_on(key, mode);
        if fenced { lock.fenced() } else { lock }
    };
    let (wait, lease) = (core.config.wait, core.config.lease);
    let owner = owner.clone();
    let keys = match keys.into_one() {
        Ok(key) => {
            // The common case: no MultiLock and no vectors.
            let deadline = deadline_after(Some(wait));
            return match begin_acquire(lock(key), Some(owner), deadline, lease) {
                Acquisition::Now(outcome) => Acquisition::Now(outcome.map(MultiGuard::one)),
                Acquisition::Later(waiting) => {
                    Acquisition::Later(Box::pin(async move { waiting.await.map(MultiGuard::one) }))
                }
            };
        }
        Err(keys) => keys,
    };
    let locks = MultiLock::new(keys.into_iter().map(lock));
    Acquisition::Later(Box::pin(async move {
        locks.acquire_as(owner, Some(wait), lease).await
    }))
}

/// A request's locks, taken on the spot or still to wait for.
type Locking = Acquisition<MultiGuard, BoxFuture<'static, Result<MultiGuard>>>;

/// The state after the acquisition's `outcome`: ready to call the inner service with
/// the locks held (or, failing open, without them), or rejected.
fn acquired<S, B, KF>(
    core: &Core,
    owner: &Owner,
    key: Option<&LockKey>,
    outcome: Result<MultiGuard>,
    svc: S,
    mut req: Request<B>,
) -> State<S, B, KF>
where
    S: Service<Request<B>>,
{
    let (release, lost) = match outcome {
        Ok(guard) => {
            tracing::Span::current().record("decision", "locked");
            if let Some(held) = HeldLock::new(&guard) {
                req.extensions_mut().insert(held);
            }
            let lost = (core.config.on_lost == OnLost::Cancel).then(|| {
                let lost: BoxFuture<'static, ()> = Box::pin(guard.lost().wait());
                lost
            });
            (Release::new(guard, core.client.clone()), lost)
        }
        Err(error) => match core.config.rejection_for(error) {
            Rejection::Unavailable { error, .. } if core.config.fail_open => {
                tracing::warn!(
                    %error,
                    owner = %owner,
                    "lock store failed; serving the request without its lock (fail-open)"
                );
                core.outcome(key, LayerOutcome::FailOpen);
                (Release::none(), None)
            }
            rejection => {
                if let Rejection::Misconfigured(error) = &rejection {
                    tracing::error!(%error, "request rejected: the lock is misconfigured");
                } else {
                    tracing::debug!(?rejection, "request rejected by LockLayer");
                }
                return State::Rejected {
                    response: Some(core.reject(rejection, key)),
                };
            }
        },
    };
    State::Ready {
        svc,
        req: Some(req),
        release,
        lost,
    }
}

/// Statuses whose responses carry no body, whatever the body says.
fn bodiless(status: StatusCode) -> bool {
    status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
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
        loop {
            match this.state.as_mut().project() {
                StateProj::Keying { keys, .. } => {
                    let (parts, keys) = ready!(keys.poll(cx));
                    let StateOwn::Keying { body, svc, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        continue; // not reached: the state was `Keying`
                    };
                    let Some(body) = body else {
                        return Poll::Ready(Ok(internal_error()));
                    };
                    *this.head = parts.method == Method::HEAD;
                    let req = Request::from_parts(parts, body);
                    match keys.and_then(|keys| this.core.prefixed(keys)) {
                        Ok(keys) if keys.is_empty() => {
                            this.span.record("decision", "unlocked");
                            this.state.set(State::Ready {
                                svc,
                                req: Some(req),
                                release: Release::none(),
                                lost: None,
                            });
                        }
                        Ok(keys) => {
                            if let Some(first) = keys.as_slice().first() {
                                this.span.record("namespace", first.namespace());
                                *this.key = Some(first.clone());
                            }
                            let key = this.key.as_ref();
                            match acquire(this.core, this.owner, keys, req.method()) {
                                Acquisition::Later(acquire) => {
                                    this.state.set(State::Acquiring { acquire, svc, req });
                                }
                                Acquisition::Now(outcome) => {
                                    let next =
                                        acquired(this.core, this.owner, key, outcome, svc, req);
                                    this.state.set(next);
                                }
                            }
                        }
                        Err(error) => {
                            let response = reject_bad_key(this.core, error);
                            this.state.set(State::Rejected {
                                response: Some(response),
                            });
                        }
                    }
                }
                StateProj::Acquiring { acquire, .. } => {
                    let outcome = ready!(acquire.as_mut().poll(cx));
                    let StateOwn::Acquiring { svc, req, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        continue; // not reached: the state was `Acquiring`
                    };
                    let next =
                        acquired(this.core, this.owner, this.key.as_ref(), outcome, svc, req);
                    this.state.set(next);
                }
                StateProj::Ready {
                    svc, req, release, ..
                } => {
                    // The locks are held: now ask the inner service for its capacity.
                    if let Err(error) = ready!(svc.poll_ready(cx)) {
                        release.drop_now();
                        this.state.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                    let Some(req) = req.take() else {
                        return Poll::Ready(Ok(internal_error()));
                    };
                    let future = this.owner.clone().sync_scope(|| svc.call(req));
                    let StateOwn::Ready { release, lost, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        continue; // not reached: the state was `Ready`
                    };
                    this.state.set(State::Calling {
                        future,
                        release,
                        lost,
                    });
                }
                StateProj::Calling {
                    future,
                    release,
                    lost,
                } => {
                    let polled = this.owner.clone().sync_scope(|| future.poll(cx));
                    let result = match polled {
                        Poll::Ready(result) => result,
                        Poll::Pending => {
                            if let Some(lost) = lost
                                && lost.as_mut().poll(cx).is_ready()
                            {
                                tracing::error!(
                                    owner = %this.owner,
                                    "the request's lock was lost while it was being handled; cancelling it"
                                );
                                let rejection = Rejection::Lost {
                                    retry_after: this.core.config.unavailable_retry_after,
                                };
                                // Drops the inner future and the guards (released in
                                // spawned tasks).
                                this.state.set(State::Rejected {
                                    response: Some(this.core.reject(rejection, this.key.as_ref())),
                                });
                                continue;
                            }
                            return Poll::Pending;
                        }
                    };
                    let mut release = std::mem::replace(release, Release::none());
                    let result = match result {
                        // The body holds the locks and releases them before its last
                        // byte; a response that will send no body (to a HEAD, a 204 or
                        // 304, an empty body) releases them with its head instead.
                        Ok(response)
                            if this.core.config.release_on == ReleaseOn::BodyEnd
                                && !*this.head
                                && !bodiless(response.status())
                                && !response.body().is_end_stream() =>
                        {
                            this.state.set(State::Done);
                            let length = response
                                .headers()
                                .get(http::header::CONTENT_LENGTH)
                                .and_then(|v| v.to_str().ok()?.parse().ok());
                            return Poll::Ready(Ok(
                                response.map(|b| LockBody::with_length(b, release, length))
                            ));
                        }
                        result => result,
                    };
                    release.start();
                    this.state.set(State::Releasing {
                        release,
                        result: Some(result),
                    });
                }
                StateProj::Releasing { release, result } => {
                    ready!(release.poll_released(cx));
                    let result = result.take();
                    this.state.set(State::Done);
                    return Poll::Ready(match result {
                        Some(result) => {
                            result.map(|res| res.map(|b| LockBody::new(b, Release::none())))
                        }
                        None => Ok(internal_error()),
                    });
                }
                StateProj::Rejected { response } => {
                    let response = response.take();
                    this.state.set(State::Done);
                    return Poll::Ready(Ok(match response {
                        Some(response) => response.map(LockBody::rejection),
                        None => internal_error(),
                    }));
                }
                StateProj::Done => return Poll::Ready(Ok(internal_error())),
            }
        }
    }
}

/// The rejection of a request whose key could not be derived; a server-side fault is
/// logged here, since its text does not reach the client.
fn reject_bad_key(core: &Core, error: KeyError) -> Response<RejectionBody> {
    if error.is_server_error() {
        tracing::error!(%error, "request rejected: its lock key could not be derived");
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
            State::Ready { .. } => "Ready",
            State::Calling { .. } => "Calling",
            State::Releasing { .. } => "Releasing",
            State::Rejected { .. } => "Rejected",
            State::Done => "Done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .field("owner", &self.owner)
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
