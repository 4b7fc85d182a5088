//! The crate's one error type.
//!
//! Every fallible operation returns [`Result<T>`](Result), whose error is [`Error`]. The
//! variants keep the cases a caller handles differently apart: the lock was busy (try
//! again later), the lock was lost while held (the critical section is compromised), the
//! input was invalid (fix the caller), the backend failed (the store is unreachable or
//! answered something unexpected).
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::{Error, LockClient, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Error> {
//! let client = LockClient::new(MemoryBackend::new());
//! let lock = client.get_lock("orders:42")?;
//! let _held = lock.lock().await?;
//!
//! // Another owner gives up at once:
//! let other = client.get_lock("orders:42")?;
//! match other.try_lock().await {
//!     Err(Error::Busy { holder_ttl }) => assert!(holder_ttl.is_some()),
//!     other => panic!("expected busy, got {other:?}"),
//! }
//! # Ok(())
//! # }
//! ```

use std::time::Duration;

/// A type-erased error, as tower uses it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong when taking, holding or releasing a lock.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The lock key is empty, too long, contains control characters or malformed
    /// hash-tag braces. See [`LockKey`](crate::LockKey) for the rules.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// What is wrong with the key.
        reason: String,
    },

    /// A configuration value is out of range (a zero lease, a wait that cannot be
    /// represented, ...). The message names the setting and the value.
    #[error("invalid configuration: `{name}` {reason}")]
    InvalidConfig {
        /// The setting, e.g. `lease`.
        name: &'static str,
        /// What is wrong with it, including the value given.
        reason: String,
    },

    /// The lock is held by another owner and the wait (if any) ran out.
    #[error("lock is busy{}", fmt_ttl(*.holder_ttl))]
    Busy {
        /// How long the holder's lease still had to run at the last attempt; `None` when
        /// the holder's lock has no expiry (or the backend cannot tell).
        holder_ttl: Option<Duration>,
    },

    /// The lock was lost while held: its lease ran out (renewals failed, or an explicit
    /// lease ended), or it was removed behind the holder's back. Whatever the holder did
    /// after that moment was not protected by the lock.
    #[error("lock was lost while held (lease expired or lock removed)")]
    Lost,

    /// The backend does not implement this lock mode.
    #[error("the {backend} backend does not support {mode} locks")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// The mode asked for.
        mode: crate::LockMode,
    },

    /// The key exists in the store but does not hold a lock of the expected shape (for
    /// Redis: a string where a lock hash should be).
    #[error("the store holds data of another type at the lock key")]
    WrongType,

    /// A quorum-based lock (RedLock) could not reach a majority of its nodes.
    #[error("no quorum: {acquired} of {total} nodes answered, {needed} needed")]
    NoQuorum {
        /// Nodes that granted the lock (or answered).
        acquired: usize,
        /// Nodes needed.
        needed: usize,
        /// Nodes in all.
        total: usize,
    },

    /// The store answered something this crate does not understand.
    #[error("unexpected reply from the lock store: {0}")]
    UnexpectedReply(String),

    /// A Redis command failed (connection refused or lost, timeout, script error).
    #[cfg(feature = "redis")]
    #[cfg_attr(docsrs, doc(cfg(feature = "redis")))]
    #[error("redis error: {0}")]
    Redis(#[from] redis::RedisError),

    /// Any other backend failure, for backends outside this crate.
    #[error("lock backend error: {0}")]
    Backend(#[source] BoxError),
}

fn fmt_ttl(ttl: Option<Duration>) -> String {
    match ttl {
        Some(ttl) => format!(" (holder's lease ends in {} ms)", ttl.as_millis()),
        None => String::new(),
    }
}

impl Error {
    /// Whether trying the same operation again later may succeed: the lock was busy, the
    /// store was unreachable or a quorum was not reached. Invalid input, a lost lock and
    /// unsupported modes are not retryable.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Busy { .. } | Error::NoQuorum { .. } | Error::Backend(_) => true,
            #[cfg(feature = "redis")]
            Error::Redis(e) => {
                e.is_io_error()
                    || e.is_connection_dropped()
                    || e.is_connection_refusal()
                    || e.is_timeout()
                    || e.is_cluster_error()
                    // A primary demoted to a replica (a failover): the next command goes
                    // to the new primary.
                    || e.code() == Some("READONLY")
            }
            Error::InvalidKey { .. }
            | Error::InvalidConfig { .. }
            | Error::Lost
            | Error::Unsupported { .. }
            | Error::WrongType
            | Error::UnexpectedReply(_) => false,
        }
    }

    /// Whether the lock store could not answer: unreachable, timed out, a connection
    /// dropped, no quorum of nodes — an outage, which retrying (or failing open) is right
    /// for. A store that answered something the crate cannot use (a key of another type,
    /// a reply it does not understand) and a mode the backend does not implement are
    /// misconfigurations, not outages.
    pub fn is_unavailable(&self) -> bool {
        !self.is_busy() && self.is_retryable()
    }

    /// Whether this is [`Error::Busy`]: another owner holds the lock.
    pub fn is_busy(&self) -> bool {
        matches!(self, Error::Busy { .. })
    }

    /// Whether the error comes from the lock store (unreachable, failed command,
    /// unexpected data) rather than from the lock's state or the caller's input.
    pub fn is_backend(&self) -> bool {
        match self {
            Error::Backend(_)
            | Error::WrongType
            | Error::UnexpectedReply(_)
            | Error::NoQuorum { .. } => true,
            #[cfg(feature = "redis")]
            Error::Redis(_) => true,
            _ => false,
        }
    }

    /// Whether the store's connection broke under the operation (a store that
    /// restarted, a connection reset), as opposed to a store that did not answer in
    /// time or refused to connect: the backend is reconnecting, and trying again at once
    /// may well work.
    pub(crate) fn is_connection_lost(&self) -> bool {
        match self {
            #[cfg(feature = "redis")]
            Error::Redis(e) => {
                (e.is_connection_dropped() && !e.is_timeout()) || e.code() == Some("READONLY")
            }
            _ => false,
        }
    }

    pub(crate) fn invalid_key(reason: impl Into<String>) -> Self {
        Error::InvalidKey {
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid_config(name: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            name,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_lowercase_without_period() {
        let errors = [
            Error::invalid_key("is empty"),
            Error::invalid_config("lease", "must be at least 1 ms (got 0 ns)"),
            Error::Busy {
                holder_ttl: Some(Duration::from_millis(1500)),
            },
            Error::Busy { holder_ttl: None },
            Error::Lost,
            Error::WrongType,
            Error::NoQuorum {
                acquired: 2,
                needed: 3,
                total: 5,
            },
        ];
        for e in errors {
            let s = e.to_string();
            assert!(s.chars().next().unwrap().is_lowercase(), "{s}");
            assert!(!s.ends_with('.'), "{s}");
        }
        assert_eq!(
            Error::Busy {
                holder_ttl: Some(Duration::from_millis(1500))
            }
            .to_string(),
            "lock is busy (holder's lease ends in 1500 ms)"
        );
    }

    #[test]
    fn retryable_classification() {
        assert!(Error::Busy { holder_ttl: None }.is_retryable());
        assert!(!Error::Lost.is_retryable());
        assert!(!Error::invalid_key("x").is_retryable());
        assert!(Error::Backend("down".into()).is_retryable());
        assert!(Error::Backend("down".into()).is_backend());
        assert!(!Error::Lost.is_backend());
        assert!(Error::Backend("down".into()).is_unavailable());
        assert!(!Error::WrongType.is_unavailable());
        assert!(!Error::Busy { holder_ttl: None }.is_unavailable());
    }
}
