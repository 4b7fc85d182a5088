//! [`LockService`]: the middleware made by [`LockLayer`](super::LockLayer).

use std::fmt;
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower::Service;

use super::body::LockBody;
use super::future::ResponseFuture;
use super::keys::KeyExtractor;
use super::layer::Shared;
use crate::extract::Locks;

/// Locks each request for the time `S` handles it. Made by
/// [`LockLayer`](super::LockLayer); see the [module docs](crate::layer).
pub struct LockService<S, K> {
    inner: S,
    shared: Arc<Shared<K>>,
}

impl<S, K> LockService<S, K> {
    pub(crate) fn new(inner: S, shared: Arc<Shared<K>>) -> Self {
        LockService { inner, shared }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, unwrapped.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, K> Clone for LockService<S, K> {
    fn clone(&self) -> Self {
        LockService {
            inner: self.inner.clone(),
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S: fmt::Debug, K> fmt::Debug for LockService<S, K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockService")
            .field("inner", &self.inner)
            .field("client", &self.shared.core.client)
            .finish_non_exhaustive()
    }
}

impl<S, K, ReqB, ResB> Service<Request<ReqB>> for LockService<S, K>
where
    S: Service<Request<ReqB>, Response = Response<ResB>> + Clone,
    K: KeyExtractor,
    ResB: http_body::Body,
{
    type Response = Response<LockBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB, K::Future>;

    /// Always ready: a request takes its lock first and asks the inner service for
    /// readiness only then, so a request waiting for a lock holds no capacity of the
    /// inner service (a `ConcurrencyLimit` permit, a `Buffer` slot, a rate limiter's
    /// token) — a request for a free key is never held up behind one waiting for a busy
    /// key. The inner service's backpressure then applies to requests that hold their
    /// locks.
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        // This clone is driven to readiness and called once the request holds its locks.
        let svc = self.inner.clone();
        let core = Arc::clone(&self.shared.core);

        // One owner per request. An outer `LockLayer` already made one: act as it, so
        // the inner layer's locks re-enter rather than wait for the outer's.
        let (owner, fresh) = Locks::attach(req.extensions_mut(), &core.client);

        if !core.config.locks_method(req.method()) {
            return ResponseFuture::unlocked(core, owner, svc, req);
        }
        let (parts, body) = req.into_parts();
        let keys = self.shared.keys.extract(parts);
        ResponseFuture::keying(core, owner, fresh, keys, body, svc)
    }
}
