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
/// The release runs in a spawned task that the response future (or body) then awaits,
/// so the response is only delivered once the locks are free — the client's next
/// request finds them free — and a response future dropped mid-release does not cut
/// the release short.
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
        matches!(self.state, State::Releasing(_))
    }

    /// Holding or releasing: not done yet.
    pub(crate) fn is_pending(&self) -> bool {
        !matches!(self.state, State::Empty)
    }

    /// Starts releasing, if holding.
    pub(crate) fn start(&mut self) {
        match std::mem::replace(&mut self.state, State::Empty) {
            // Outside a runtime (never, when polled by hyper or axum) the guard is
            // dropped instead, which still releases on the runtime the lock was taken on.
            State::Holding { guard, client } => {
                if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                    self.state = State::Releasing(runtime.spawn(unlock(guard, client)));
                }
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
