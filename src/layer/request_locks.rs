//! [`RequestLocks`]: the locks a request holds, and their release — awaited when the
//! response (or body) is done, spawned when it is dropped.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};

use crate::error::Error;
use crate::key::LockKey;
use crate::lock::{FinishOnDrop, Guards, LockClient, Unlocking};

/// The locks a request holds, on their way out.
///
/// The response future (or body) drives the release in place and hands the response on
/// only once the locks are free, so the client's next request finds them free — with no
/// task and no cross-task wake-up on the way. Dropped mid-release (the client went
/// away), it moves the release under way into a spawned task, so it is never cut short.
pub(crate) struct RequestLocks {
    state: State,
}

enum State {
    /// Nothing held (an unlocked request, or released already).
    Empty,
    Holding {
        guard: Guards,
        client: LockClient,
    },
    /// Under way, driven by `poll_released`; finished in a task if dropped. The key is
    /// for the log line of a failure.
    Releasing {
        release: FinishOnDrop<Result<(), Error>>,
        key: Option<LockKey>,
        client: LockClient,
    },
}

impl RequestLocks {
    pub(crate) fn none() -> Self {
        RequestLocks {
            state: State::Empty,
        }
    }

    pub(crate) fn new(guard: Guards, client: LockClient) -> Self {
        RequestLocks {
            state: State::Holding { guard, client },
        }
    }

    pub(crate) fn is_holding(&self) -> bool {
        matches!(self.state, State::Holding { .. })
    }

    pub(crate) fn is_releasing(&self) -> bool {
        matches!(self.state, State::Releasing { .. })
    }

    /// Holding or releasing: not done yet.
    pub(crate) fn is_pending(&self) -> bool {
        !matches!(self.state, State::Empty)
    }

    /// Starts releasing, if holding; [`poll_released`](Self::poll_released) drives it.
    pub(crate) fn start(&mut self) {
        match std::mem::replace(&mut self.state, State::Empty) {
            State::Holding { guard, client } => {
                let key = guard.as_slice().first().map(|g| g.key().clone());
                match guard.start_unlock() {
                    // Released on the spot (an in-process store): nothing to drive.
                    Unlocking::Done(outcome) => report(outcome, key.as_ref(), &client),
                    Unlocking::Pending(release) => {
                        self.state = State::Releasing {
                            release,
                            key,
                            client,
                        };
                    }
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
        if let State::Releasing {
            release,
            key,
            client,
        } = &mut self.state
        {
            let outcome = ready!(Pin::new(release).poll(cx));
            report(outcome, key.as_ref(), client);
            self.state = State::Empty;
        }
        Poll::Ready(())
    }
}

impl Drop for RequestLocks {
    fn drop(&mut self) {
        if let State::Releasing {
            release,
            key,
            client,
        } = std::mem::replace(&mut self.state, State::Empty)
        {
            // Outside a runtime (never, when polled by hyper or axum) the release still
            // finishes, on the guard's runtime, only unreported.
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                runtime.spawn(async move { report(release.await, key.as_ref(), &client) });
            }
        }
    }
}

/// Logs a failed release of a request's lock; formats the key (redacted if so
/// configured) only then, never on the common path.
fn report(outcome: Result<(), Error>, key: Option<&LockKey>, client: &LockClient) {
    let Err(error) = outcome else {
        return;
    };
    let shown = key.map(|k| client.display_key(k).to_string());
    match error {
        Error::Lost => tracing::error!(
            key = shown,
            "the request's lock was lost before the request completed; work after the loss was not protected"
        ),
        error => tracing::warn!(
            key = shown,
            %error,
            "releasing the request's lock failed"
        ),
    }
}
