//! [`ResponseFuture`]: acquire, call the inner service as the request's owner, release.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use pin_project::pin_project;
use tower::Service;

use super::body::LockBody;
use super::layer::Core;
use super::policy::{OnLost, Rejection, ReleaseOn};
use super::release::Release;
use crate::backend::BoxFuture;
use crate::error::Result;
use crate::extract::HeldLock;
use crate::kinds::MultiGuard;
use crate::owner::Owner;

/// The response future of [`LockService`](super::LockService).
///
/// It runs `Acquiring → Calling → Releasing → Done`: it waits for the request's
/// lock(s), calls the inner service with the request's owner made
/// [current](Owner::scope), and releases once the response is ready (or hands the locks
/// to the [body](LockBody)). A failed acquisition ends in `Rejected`, answered by the
/// rejection handler.
///
/// # Cancel safety
///
/// Dropped while acquiring, it leaves no lock and no waiter behind (as
/// [`Lock::try_lock_for`](crate::Lock::try_lock_for)). Dropped while the inner service
/// runs, or while releasing, its locks are released in a spawned task.
#[pin_project]
pub struct ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    #[pin]
    state: State<S, B>,
    core: Arc<Core>,
    owner: Owner,
}

#[pin_project(project = StateProj, project_replace = StateOwn)]
enum State<S, B>
where
    S: Service<Request<B>>,
{
    Acquiring {
        acquire: BoxFuture<'static, Result<MultiGuard>>,
        svc: S,
        req: Request<B>,
    },
    Calling {
        #[pin]
        future: S::Future,
        release: Release,
        /// Fires when the lock is lost, if the policy cancels then.
        lost: Option<BoxFuture<'static, ()>>,
    },
    Releasing {
        release: Release,
        result: Option<std::result::Result<S::Response, S::Error>>,
    },
    Rejected {
        response: Option<Response<Bytes>>,
    },
    Done,
}

impl<S, B> ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    pub(crate) fn acquiring(
        core: Arc<Core>,
        owner: Owner,
        acquire: BoxFuture<'static, Result<MultiGuard>>,
        svc: S,
        req: Request<B>,
    ) -> Self {
        ResponseFuture {
            state: State::Acquiring { acquire, svc, req },
            core,
            owner,
        }
    }

    /// Calls the inner service at once, without a lock.
    pub(crate) fn unlocked(core: Arc<Core>, owner: Owner, mut svc: S, req: Request<B>) -> Self {
        let future = owner.clone().sync_scope(|| svc.call(req));
        ResponseFuture {
            state: State::Calling {
                future,
                release: Release::none(),
                lost: None,
            },
            core,
            owner,
        }
    }

    pub(crate) fn rejected(core: Arc<Core>, owner: Owner, rejection: &Rejection) -> Self {
        let response = core.reject(rejection);
        ResponseFuture {
            state: State::Rejected {
                response: Some(response),
            },
            core,
            owner,
        }
    }
}

impl<S, B, ResB> Future for ResponseFuture<S, B>
where
    S: Service<Request<B>, Response = Response<ResB>>,
{
    type Output = std::result::Result<Response<LockBody<ResB>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Acquiring { acquire, .. } => {
                    let outcome = ready!(acquire.as_mut().poll(cx));
                    let StateOwn::Acquiring {
                        mut svc, mut req, ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        continue; // not reached: the state was `Acquiring`
                    };
                    let (release, lost) = match outcome {
                        Ok(guard) => {
                            if let Some(held) = HeldLock::new(&guard) {
                                req.extensions_mut().insert(held);
                            }
                            let lost = (this.core.policy.on_lost == OnLost::Cancel).then(|| {
                                let lost: BoxFuture<'static, ()> = Box::pin(guard.lost().wait());
                                lost
                            });
                            (Release::new(guard, this.core.client.clone()), lost)
                        }
                        Err(error) => {
                            let rejection = this.core.policy.rejection_for(error);
                            match rejection {
                                Rejection::Unavailable { error, .. }
                                    if this.core.policy.fail_open =>
                                {
                                    tracing::warn!(
                                        %error,
                                        owner = %this.owner,
                                        "lock store failed; serving the request without its lock (fail-open)"
                                    );
                                    (Release::none(), None)
                                }
                                rejection => {
                                    tracing::debug!(?rejection, "request rejected by LockLayer");
                                    this.state.set(State::Rejected {
                                        response: Some(this.core.reject(&rejection)),
                                    });
                                    continue;
                                }
                            }
                        }
                    };
                    let future = this.owner.clone().sync_scope(|| svc.call(req));
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
                                    retry_after: this.core.policy.unavailable_retry_after,
                                };
                                // Drops the inner future and the guards (released in
                                // spawned tasks).
                                this.state.set(State::Rejected {
                                    response: Some(this.core.reject(&rejection)),
                                });
                                continue;
                            }
                            return Poll::Pending;
                        }
                    };
                    let mut release = std::mem::replace(release, Release::none());
                    let result = match result {
                        Ok(response) if this.core.policy.release_on == ReleaseOn::BodyEnd => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response.map(|b| LockBody::new(b, release))));
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

/// Answers a future polled after it completed (a caller bug) without panicking.
fn internal_error<B>() -> Response<LockBody<B>> {
    let mut response = Response::new(LockBody::rejection(Bytes::from_static(
        b"tower-lock: response future polled after completion",
    )));
    *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR;
    response
}

impl<S, B> fmt::Debug for ResponseFuture<S, B>
where
    S: Service<Request<B>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Acquiring { .. } => "Acquiring",
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
    use tower::{Layer, ServiceExt, service_fn};

    use crate::layer::{LockLayer, OnLost};
    use crate::{LockKey, MemoryBackend};

    fn key() -> LockKey {
        LockKey::new("fut").unwrap()
    }

    async fn ok(_: Request<()>) -> std::result::Result<Response<Full<Bytes>>, Infallible> {
        Ok(Response::new(Full::new(Bytes::from_static(b"body"))))
    }

    use super::*;

    #[tokio::test]
    async fn released_before_the_response_is_handed_on() {
        let backend = MemoryBackend::new();
        let svc = LockLayer::new(backend.clone(), |_: &Request<()>| key()).layer(service_fn(ok));
        let response = svc.oneshot(Request::new(())).await.unwrap();
        assert!(!backend.contains_key(&key()), "released with the response");
        assert!(!response.body().holds_locks());
    }

    #[tokio::test]
    async fn held_until_the_body_is_read_when_configured() {
        let backend = MemoryBackend::new();
        let layer = LockLayer::builder(backend.clone(), |_: &Request<()>| key())
            .hold_until_body_end(true)
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
        let layer = LockLayer::builder(backend.clone(), |_: &Request<()>| key())
            .with_lease(Duration::from_millis(30))
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
        let layer = LockLayer::builder(backend.clone(), |_: &Request<()>| key())
            .with_lease(Duration::from_millis(30))
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
