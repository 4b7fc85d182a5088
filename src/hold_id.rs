//! A hold's own identity in the store.
//!
//! Every acquisition that reaches the store takes a *hold* under an identity of its own,
//! a [`HoldId`] `<client uuid>:<n>`, that no other hold ever uses — not a later hold of
//! the same [`Owner`](crate::Owner), not a hold of another kind on the same name. The
//! owner is the client-side grouping that decides which guards share a hold (re-entry);
//! the hold's identity is what the store records, and what every release, renewal and
//! compensation names, so each of them can only ever touch that one hold.
//!
//! A backend sees hold identities only: [`LockRequest::hold_id`](crate::backend::LockRequest::hold_id),
//! [`HoldInfo::hold_id`](crate::HoldInfo::hold_id). A guard tells its own with
//! [`LockGuard::hold_id`](crate::LockGuard::hold_id).
//!
//! # Example
//!
//! ```
//! use tower_lock::{HoldId, LockClient, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! let client = LockClient::new(MemoryBackend::new());
//! let lock = client.get_lock("doc:7")?;
//! let first = lock.lock().await?;
//! let state = lock.inspect().await?;
//! assert_eq!(&state.holders[0].hold_id, first.hold_id());
//! first.unlock().await?;
//!
//! // The same owner's next lock is a new hold, with a new identity.
//! let second = lock.lock().await?;
//! assert_ne!(second.hold_id(), &state.holders[0].hold_id);
//!
//! // A Redisson client's `<uuid>:<thread id>` is a hold identity too.
//! assert!(HoldId::from_raw("5f0e7c8a-2b1d-4c3e-9f7a-0d6e8b1c2a3f:1").is_ok());
//! # Ok(())
//! # }
//! ```

use std::fmt;
use std::sync::Arc;

use crate::error::ConfigError;

type Result<T, E = ConfigError> = std::result::Result<T, E>;
use crate::owner::{Owner, validate_identity};

/// One hold's identity in the store: `<client uuid>:<n>`, used by no other hold.
/// Cheap to clone.
///
/// Its rules are an [`Owner`]'s (a fresh owner is its first hold's identity): 1 to
/// [`MAX_OWNER_LEN`](crate::MAX_OWNER_LEN) bytes, no control characters, not ending in
/// `:read` or `:write`.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HoldId(Arc<str>);

impl HoldId {
    /// `<client_id>:<n>`, for a client's `n`-th identity.
    pub(crate) fn new(client_id: &str, n: u64) -> Self {
        HoldId(Owner::new(client_id, n).into_shared())
    }

    /// The identity of a fresh owner's hold: the owner's own string, which the client
    /// made for this hold alone (no allocation).
    pub(crate) fn of_fresh_owner(owner: &Owner) -> Self {
        HoldId(owner.shared())
    }

    /// Uses `raw` as a hold identity: for driving a
    /// [`LockBackend`](crate::backend::LockBackend) directly, for a hold another client
    /// took (a Redisson `<uuid>:<thread id>`), or for tests. A hold identity must be
    /// used by one hold only: a second acquisition under the same identity re-enters
    /// that hold in the store.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`](crate::ConfigError::InvalidSetting) naming `hold_id` when `raw`
    /// is empty, longer than [`MAX_OWNER_LEN`](crate::MAX_OWNER_LEN) bytes, contains
    /// control characters, or ends in `:read` or `:write` (the suffixes a read-write
    /// lock's queue entries and write holds carry).
    pub fn from_raw(raw: impl AsRef<str>) -> Result<Self> {
        let raw = raw.as_ref();
        validate_identity("hold_id", raw)?;
        Ok(HoldId(Arc::from(raw)))
    }

    /// The identity as text, exactly as stored in the backend.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for HoldId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&*self.0, f)
    }
}

impl fmt::Display for HoldId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for HoldId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ConfigError;

    #[test]
    fn the_rules_are_an_owners() {
        assert_eq!(HoldId::new("abc", 7).as_str(), "abc:7");
        assert!(HoldId::from_raw("5f0e7c8a-uuid:7").is_ok());
        assert!(HoldId::from_raw("uuid:1:reader").is_ok());
        for bad in [
            String::new(),
            "a\0".into(),
            "x".repeat(crate::MAX_OWNER_LEN + 1),
            "uuid:1:read".into(),
            "uuid:1:write".into(),
        ] {
            assert!(
                matches!(
                    HoldId::from_raw(&bad),
                    Err(ConfigError::InvalidSetting {
                        name: "hold_id",
                        ..
                    })
                ),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn a_fresh_owners_hold_shares_its_string() {
        let owner = Owner::new("c", 3);
        let id = HoldId::of_fresh_owner(&owner);
        assert_eq!(id.as_str(), owner.as_str());
        assert!(std::ptr::eq(id.as_str(), owner.as_str()));
    }
}
