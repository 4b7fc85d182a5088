//! [`LockMode`] and the rules every store implements for it.

use std::fmt;
use std::num::NonZeroU32;

/// How a lock is held. Backends return
/// [`ConfigError::Unsupported`](crate::ConfigError::Unsupported) for modes they do not implement.
///
/// # Rules
///
/// Every built-in backend implements every mode with the same rules (the conformance
/// suite checks them on each). A key is meant to be used in one family of modes —
/// exclusive/fair, read/write, or permits; holds of another family simply make the key
/// busy (as a Redisson `RLock` finds a read-write lock's hash busy).
///
/// - [`LockMode::Exclusive`]: one owner; waiters race for a release (one is woken).
/// - [`LockMode::Fair`]: one owner; waiters acquire in arrival order. A busy attempt
///   puts the owner at the tail of the key's queue; only the head may take a free lock.
///   A queued owner must poll again within the store's waiter timeout (Redisson's
///   `threadWaitTime`, [`DEFAULT_WAITER_TIMEOUT`](super::DEFAULT_WAITER_TIMEOUT)) or
///   it is evicted, so a waiter that vanished without
///   [`cancel_wait`](super::LockBackend::cancel_wait) cannot block the queue for longer
///   than that. To keep live waiters polling, a queued owner's
///   [`Acquire::Busy`](super::Acquire::Busy) ttl is never more than a third of the
///   waiter timeout. A release wakes the head waiter only.
/// - [`LockMode::Read`] / [`LockMode::Write`] on one key: many readers or one writer.
///   The writer's owner — or a request naming it as its
///   [`writer`](super::LockRequest::writer) — may also take read holds (downgrade: take
///   read, release write).
///   A reader that asks to write waits like any writer — until every read hold,
///   including its own, is released; a caller that holds a read lock and waits for the
///   write lock of the same key without releasing deadlocks on itself until its wait
///   runs out, as in Redisson.
///
///   Blocked readers and writers queue in arrival order (the same queue and eviction
///   as fair locks), and the queue decides who goes next: a writer goes when it is at
///   the head and no read hold is left; a reader goes when no writer holds the lock and
///   no writer waits ahead of it. So once a writer waits, new readers queue behind it
///   (readers that already hold a read lock, and the writer's own owner, re-enter
///   without queueing). **Bound**: a waiting writer acquires as soon as the read holds
///   present when it arrived are released (or their leases end) and the waiters ahead
///   of it have had their turn; a stream of new readers cannot delay it. Readers are
///   not starved by writers either: readers queued before the next writer are admitted
///   together when a write lock is released.
/// - [`LockMode::Permits`]: at most `max` distinct owners hold the key at once, each
///   with its own lease (a crashed holder's permit returns when its lease ends); an
///   owner that already holds a permit re-enters it. `max` is taken from each request;
///   callers of one key should agree on it. A release wakes one waiter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockMode {
    /// One owner at a time, reentrant, no ordering among waiters (Redisson `RLock`).
    Exclusive,
    /// One owner at a time, reentrant, waiters served in arrival order (Redisson
    /// `RFairLock`).
    Fair,
    /// Shared with other readers, excluded by a writer (Redisson `RReadWriteLock`'s
    /// read lock).
    Read,
    /// Exclusive against readers and writers (Redisson `RReadWriteLock`'s write lock).
    Write,
    /// One of at most `max` leased permits (a semaphore, like Redisson's
    /// `RPermitExpirableSemaphore`).
    Permits {
        /// Most owners that may hold the key at once.
        max: NonZeroU32,
    },
}

impl fmt::Display for LockMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LockMode::Exclusive => f.write_str("exclusive"),
            LockMode::Fair => f.write_str("fair"),
            LockMode::Read => f.write_str("read"),
            LockMode::Write => f.write_str("write"),
            LockMode::Permits { max } => write!(f, "permits({max})"),
        }
    }
}

/// The modes whose busy waiters queue in the built-in stores (fair, read, write); the
/// waiters of the others (exclusive, permits) race for a release.
pub(crate) const QUEUED_MODES: [LockMode; 3] = [LockMode::Fair, LockMode::Read, LockMode::Write];

/// Whether `mode` is one of [`QUEUED_MODES`].
pub(crate) fn queued(mode: LockMode) -> bool {
    matches!(mode, LockMode::Fair | LockMode::Read | LockMode::Write)
}
