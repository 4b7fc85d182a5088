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
use super::policy::Rejection;
use crate::extract::Locks;
use crate::kinds::MultiLock;

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
    K: KeyExtractor<ReqB>,
{
    type Response = Response<LockBody<ResB>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqB>;

    /// Ready when the inner service is: waiting for a lock happens in the response
    /// future, so a request waiting on one key never holds up others.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<ReqB>) -> Self::Future {
        // The service that was polled ready goes with this request; a clone stays.
        let clone = self.inner.clone();
        let svc = std::mem::replace(&mut self.inner, clone);
        let core = Arc::clone(&self.shared.core);

        // One owner per request. An outer `LockLayer` already made one: act as it, so
        // the inner layer's locks re-enter rather than wait for the outer's.
        let owner = match req.extensions().get::<Locks>() {
            Some(outer) => outer.owner().clone(),
            None => core.client.new_owner(),
        };
        req.extensions_mut()
            .insert(Locks::new(core.client.clone(), owner.clone()));

        let keys = if core.policy.locks_method(req.method()) {
            self.shared.keys.extract(&req)
        } else {
            Ok(Vec::new())
        };
        let keys = match keys.and_then(|keys| core.prefixed(keys)) {
            Ok(keys) => keys,
            Err(error) => {
                return ResponseFuture::rejected(core, owner, &Rejection::BadKey(error));
            }
        };
        if keys.is_empty() {
            return ResponseFuture::unlocked(core, owner, svc, req);
        }

        let mode = core.policy.mode.for_method(req.method());
        let fenced = core.policy.fenced;
        let locks = MultiLock::new(keys.into_iter().map(|k| {
            let lock = core.client.lock_on(k, mode);
            if fenced { lock.fenced() } else { lock }
        }));
        let (wait, lease) = (core.policy.wait, core.policy.lease);
        let acting = owner.clone();
        let acquire = Box::pin(async move { locks.acquire_as(acting, Some(wait), lease).await });
        ResponseFuture::acquiring(core, owner, acquire, svc, req)
    }
}
