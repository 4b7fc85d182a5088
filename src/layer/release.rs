//! Releasing a request's locks: awaited when the response (or body) is done, spawned
//! when it is dropped.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::task::JoinHandle;

use crate::error::Error;
use crate::kinds::MultiGuard;
use crate::lock::LockClient;

/// A request's locks on their way out.
///
/// The response future (or body) drives the release and hands the response on only once
/// the locks are free, so the client's next request finds them free. The release is
/// polled in place first: a store that answers at once (the memory backend) costs no
/// task. One still pending moves into a spawned task that is then awaited, so a
/// response future dropped mid-release does not cut the release short.
pub(crate) struct Release {
    state: State,
}

enum State {
    /// Nothing held (an unlocked request, or released already).
    Empty,
    Holding {
        guard: MultiGuard,
        client: LockClient,
    },
    /// Started, not polled yet: dropped now, its guards release on drop.
    Starting(Pin<Box<dyn Future<Output = ()> + Send>>),
    Releasing(JoinHandle<()>),
}

impl Release {
    pub(crate) fn none() -> Self {
        Release {
            state: State::Empty,
        }
    }

    pub(crate) fn new(guard: MultiGuard, client: LockClient) -> Self {
        Release {
            state: State::Holding { guard, client },
        }
    }

    pub(crate) fn is_holding(&self) -> bool {
        matches!(self.state, State::Holding { .. })
    }

    pub(crate) fn is_releasing(&self) -> bool {
        matches!(self.state, State::Starting(_) | State::Releasing(_))
    }

    /// Holding or releasing: not done yet.
    pub(crate) fn is_pending(&self) -> bool {
        !matches!(self.state, State::Empty)
    }

    /// Starts releasing, if holding; [`poll_released`](Self::poll_released) drives it.
    pub(crate) fn start(&mut self) {
        match std::mem::replace(&mut self.state, State::Empty) {
            State::Holding { guard, client } => {
                self.state = State::Starting(Box::pin(unlock(guard, client)));
            }
            other => self.state = other,
        }
    }

    /// Drops the locks now; their guards release in spawned tasks.
    pub(crate) fn drop_now(&mut self) {
        if self.is_holding() {
            self.state = State::Empty;
        }
    }

    /// Ready once the release has finished (at once when nothing is being released).
    pub(crate) fn poll_released(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if let State::Starting(release) = &mut self.state {
            if release.as_mut().poll(cx).is_ready() {
                self.state = State::Empty;
                return Poll::Ready(());
            }
            // Still under way: let it finish in its own task, whatever becomes of us.
            // Outside a runtime (never, when polled by hyper or axum) it is dropped
            // instead, and the lease ends the hold.
            let State::Starting(release) = std::mem::replace(&mut self.state, State::Empty) else {
                return Poll::Ready(());
            };
            match tokio::runtime::Handle::try_current() {
                Ok(runtime) => self.state = State::Releasing(runtime.spawn(release)),
                Err(_) => return Poll::Ready(()),
            }
        }
        if let State::Releasing(task) = &mut self.state {
            if let Poll::Ready(result) = Pin::new(task).poll(cx) {
                if let Err(error) = result {
                    tracing::warn!(%error, "the lock release task failed; the lease will end the hold");
                }
                self.state = State::Empty;
            } else {
                return Poll::Pending;
            }
        }
        Poll::Ready(())
    }
}

async fn unlock(guard: MultiGuard, client: LockClient) {
    let key = guard.guards().first().map(|g| g.key().clone());
    let shown = key.as_ref().map(|k| client.display_key(k).to_string());
    match guard.unlock().await {
        Ok(()) => {}
        Err(Error::Lost) => tracing::error!(
            key = shown,
            "the request's lock was lost before the request completed; work after the loss was not protected"
        ),
        Err(error) => tracing::warn!(
            key = shown,
            %error,
            "releasing the request's lock failed; its lease will end the hold"
        ),
    }
}
