//! Lock owners and the per-request current owner.
//!
//! A lock is held by an [`Owner`], written `<client uuid>:<n>` like Redisson's
//! `<client uuid>:<thread id>`, or a string of your own. Ownership decides reentrancy: the same owner locking the
//! same key again (in the same mode, through the same [`LockClient`](crate::LockClient))
//! adds a guard to the hold it has instead of waiting for itself.
//!
//! In the store each hold has an identity of its own, a [`HoldId`](crate::HoldId), also
//! `<client uuid>:<n>` and used by no other hold
//! ([`LockGuard::hold_id`](crate::LockGuard::hold_id)): the owner decides which guards
//! share a hold, the hold's identity makes sure a guard's release, renewal or late
//! compensation only ever touches that hold. The two are different types, so one is
//! never passed where the other is meant.
//!
//! Ownership is per *request*, never per task or thread: HTTP/2 runs many requests on
//! one task, and a tokio task hops between threads. [`Owner::scope`] makes an owner
//! current for one future (a tokio task-local); every acquisition inside that future
//! that names no owner of its own acts as the current owner, and so re-enters. The
//! middleware scopes a fresh owner around each request this way. Outside any scope, each
//! acquisition gets a fresh owner of its own.
//!
//! # Example
//!
//! ```
//! use tower_lock::{LockClient, MemoryBackend, Owner};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! let client = LockClient::new(MemoryBackend::new());
//! let owner = client.new_owner();
//! owner
//!     .clone()
//!     .scope(async {
//!         let lock = client.get_lock("doc:7")?;
//!         let outer = lock.lock().await?;
//!         let inner = lock.try_lock().await?; // re-enters: same owner
//!         assert_eq!(inner.owner(), &owner);
//!         inner.unlock().await?;
//!         outer.unlock().await
//!     })
//!     .await
//! # }
//! ```
//!
//! # Cancel safety
//!
//! [`Owner::scope`] only sets a task-local while the inner future is polled; dropping it
//! drops the inner future and nothing else.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use crate::error::ConfigError;

type Result<T, E = ConfigError> = std::result::Result<T, E>;

/// The longest raw owner accepted by [`Owner::from_raw`], in bytes; the same for a
/// [`HoldId`](crate::HoldId).
pub const MAX_OWNER_LEN: usize = 256;

tokio::task_local! {
    static CURRENT: Owner;
}

/// Who holds a lock, on the client side: a request, a scope, or an owner of your own.
/// `<client uuid>:<n>` when the client makes it. Cheap to clone.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner(Arc<str>);

impl Owner {
    pub(crate) fn new(client_id: &str, n: u64) -> Self {
        // On every acquisition's path: one allocation, no formatting machinery.
        let mut digits = itoa::Buffer::new();
        let n = digits.format(n);
        Owner(crate::scratch::arc_str(|owner| {
            owner.push_str(client_id);
            owner.push(':');
            owner.push_str(n);
        }))
    }

    /// Uses `raw` as a logical owner of your own (a job id) for
    /// [`Lock::with_owner`](crate::Lock::with_owner), or for tests. An owner belongs to
    /// one [`LockClient`](crate::LockClient): re-entry is counted by the client that
    /// holds the lock. (A store's identity of one hold, such as a Redisson
    /// `<uuid>:<thread id>`, is a [`HoldId`](crate::HoldId).)
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`](crate::ConfigError::InvalidSetting) naming `owner` when `raw` is empty, longer than
    /// [`MAX_OWNER_LEN`] bytes, contains control characters, or ends in `:read` or
    /// `:write` (the suffixes a read-write lock's queue entries and write holds carry).
    pub fn from_raw(raw: impl AsRef<str>) -> Result<Self> {
        let raw = raw.as_ref();
        validate_identity("owner", raw)?;
        Ok(Owner(Arc::from(raw)))
    }

    /// The owner's string, shared: a fresh owner's is its hold's identity as well.
    pub(crate) fn shared(&self) -> Arc<str> {
        Arc::clone(&self.0)
    }

    pub(crate) fn into_shared(self) -> Arc<str> {
        self.0
    }

    /// The owner as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The owner made current by the innermost enclosing [`Owner::scope`], if any.
    pub fn current() -> Option<Owner> {
        CURRENT.try_with(Owner::clone).ok()
    }

    /// Runs `fut` with `self` as the current owner: acquisitions inside it that name no
    /// owner act as `self`, so locking a key `self` already holds re-enters.
    pub fn scope<F: Future>(self, fut: F) -> impl Future<Output = F::Output> {
        CURRENT.scope(self, fut)
    }

    /// Runs the synchronous `f` with `self` as the current owner.
    pub fn sync_scope<R>(self, f: impl FnOnce() -> R) -> R {
        CURRENT.sync_scope(self, f)
    }
}

/// The rules an owner and a hold identity share, the error naming `setting`.
pub(crate) fn validate_identity(setting: &'static str, raw: &str) -> Result<()> {
    if raw.is_empty() || raw.len() > MAX_OWNER_LEN || raw.chars().any(char::is_control) {
        return Err(ConfigError::invalid_setting(
            setting,
            format!(
                "must be 1 to {MAX_OWNER_LEN} bytes without control characters (got {} bytes)",
                raw.len()
            ),
        ));
    }
    if raw.ends_with(":read") || raw.ends_with(":write") {
        return Err(ConfigError::invalid_setting(
            setting,
            format!(
                "must not end in `:read` or `:write`, which read-write locks use as suffixes (got {raw:?})"
            ),
        ));
    }
    Ok(())
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Owner {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_and_validation() {
        assert_eq!(Owner::new("abc", 7).as_str(), "abc:7");
        assert_eq!(Owner::new("abc", 0).as_str(), "abc:0");
        assert_eq!(
            Owner::new("u", u64::MAX).as_str(),
            format!("u:{}", u64::MAX)
        );
        assert!(Owner::from_raw("uuid:1").is_ok());
        assert!(Owner::from_raw("").is_err());
        assert!(Owner::from_raw("a\0").is_err());
        assert!(Owner::from_raw("x".repeat(MAX_OWNER_LEN + 1)).is_err());
        assert!(Owner::from_raw("uuid:1:read").is_err());
        assert!(Owner::from_raw("uuid:1:write").is_err());
        assert!(Owner::from_raw("uuid:1:reader").is_ok());
    }

    #[tokio::test]
    async fn scope_sets_and_nests() {
        assert_eq!(Owner::current(), None);
        let a = Owner::new("c", 1);
        let b = Owner::new("c", 2);
        a.clone()
            .scope(async {
                assert_eq!(Owner::current(), Some(a.clone()));
                b.clone()
                    .scope(async { assert_eq!(Owner::current(), Some(b.clone())) })
                    .await;
                assert_eq!(Owner::current(), Some(a.clone()));
            })
            .await;
        assert_eq!(Owner::current(), None);
        assert_eq!(b.clone().sync_scope(Owner::current), Some(b));
    }
}
