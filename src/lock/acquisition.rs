//! The one way in to an acquisition: [`begin_acquire`] answers on the spot when the
//! store can (an in-process store with a free lock, or a re-entry), and otherwise hands
//! back the wait to drive, which does not try that fast path again.
//!
//! [`Lock`] (through [`acquire_as`](super::acquire::acquire_as)) awaits what it gets;
//! the layer's response future answers a request on the spot, or boxes the wait into
//! its state.

use std::borrow::Borrow;
use std::future::Future;

use tokio::time::Instant;

use super::acquire::{acquire_waiting, try_acquire_now};
use super::{Lease, Lock, LockGuard};
use crate::error::Result;
use crate::owner::Owner;

/// An acquisition begun: of one lock by [`begin_acquire`] (`G` is a [`LockGuard`]), or
/// of a request's locks by the layer.
pub(crate) enum Acquisition<G, W> {
    /// Answered without waiting and without I/O: the guard, or why there is none.
    Now(Result<G>),
    /// Still to do: the wait, or the store's answer over I/O, as a future of `Result<G>`.
    Later(W),
}

/// Acquires `lock` as `owner` (`None`: a fresh owner, used for this acquisition only),
/// waiting until `deadline` (`None`: as long as it takes), holding it with `lease`.
///
/// The fast path is tried here, once: a backend that answers without I/O and a lock
/// that is free (or the owner's own, to re-enter) give [`Acquisition::Now`]. Anything
/// else gives the rest of the acquisition as [`Acquisition::Later`]; dropped before it
/// finishes, it leaves no lock and no waiter behind.
pub(crate) fn begin_acquire<L>(
    lock: L,
    owner: Option<Owner>,
    deadline: Option<Instant>,
    lease: Lease,
) -> Acquisition<LockGuard, impl Future<Output = Result<LockGuard>> + Send>
where
    L: Borrow<Lock> + Send,
{
    if let Some(done) = try_acquire_now(lock.borrow(), owner.clone(), lease) {
        return Acquisition::Now(done);
    }
    Acquisition::Later(async move { acquire_waiting(lock.borrow(), owner, deadline, lease).await })
}
