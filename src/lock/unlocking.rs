//! An unlock begun without waiting ([`Unlocking`]), and [`FinishOnDrop`], the future
//! that carries a release through to the end even when its caller goes away.
//!
//! Made by [`LockGuard::start_unlock`](super::LockGuard::start_unlock) and
//! `MultiGuard::start_unlock`; awaited by their `unlock`, and driven in place by the
//! layer's `RequestLocks` (`layer/request_locks.rs`), which hands a response on
//! only once its locks are free.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use tokio::runtime::Handle;

use crate::error::Result;

/// A guard's unlock, begun: see
/// [`LockGuard::start_unlock`](super::LockGuard::start_unlock).
pub(crate) enum Unlocking {
    Done(Result<()>),
    /// Cancel-safe: dropped before it finishes, the release goes on in a task.
    Pending(FinishOnDrop<Result<()>>),
}

/// A future that, dropped before it finishes, finishes in a task on `runtime` (or,
/// without one, is dropped: for futures made of parts that finish on their own).
pub(crate) struct FinishOnDrop<T: Send + 'static> {
    future: Option<Pin<Box<dyn Future<Output = T> + Send>>>,
    runtime: Option<Handle>,
}

impl<T: Send + 'static> FinishOnDrop<T> {
    pub(crate) fn new(
        runtime: Option<Handle>,
        future: impl Future<Output = T> + Send + 'static,
    ) -> Self {
        FinishOnDrop {
            future: Some(Box::pin(future)),
            runtime,
        }
    }
}

impl<T: Send + 'static> Future for FinishOnDrop<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let Some(future) = self.future.as_mut() else {
            return Poll::Pending;
        };
        let output = ready!(future.as_mut().poll(cx));
        self.future = None;
        Poll::Ready(output)
    }
}

impl<T: Send + 'static> Drop for FinishOnDrop<T> {
    fn drop(&mut self) {
        if let (Some(future), Some(runtime)) = (self.future.take(), self.runtime.as_ref()) {
            runtime.spawn(async move {
                let _ = future.await;
            });
        }
    }
}
