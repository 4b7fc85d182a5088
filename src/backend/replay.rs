//! Responses kept for replay: the store side of the `IdempotencyLayer`.
//!
//! A [`ReplayStore`] keeps one opaque record per lock key, written only by a request
//! that still holds that key's lock, and read by the requests that come after it. The
//! layer decides what a record holds (the response, the request's fingerprint); the
//! store only promises *when* a record can be written.

use std::time::Duration;

use bytes::Bytes;
use futures_util::future::BoxFuture;

use super::{FencingToken, LockRequest, Release};
use crate::Result;
use crate::key::LockKey;

/// What [`ReplayStore::store_and_release`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stored {
    /// Whether the record was written: the hold still held its lock in the store and no
    /// record with a greater token was there.
    pub stored: bool,
    /// What releasing one hold of the request did, exactly as
    /// [`LockBackend::release`](super::LockBackend::release) reports it.
    pub release: Release,
}

impl Stored {
    /// The outcome: `stored` or not, and what the release did.
    pub const fn new(stored: bool, release: Release) -> Self {
        Stored { stored, release }
    }
}

/// Records kept beside the locks, for replaying a request's response: an extension of
/// [`LockBackend`](super::LockBackend), found through
/// [`LockBackend::replays`](super::LockBackend::replays). A store that keeps none does
/// not implement it, and an `IdempotencyLayer` on it is refused when it is built.
///
/// # Contract
///
/// - A record lives under the lock's key, in the store's own namespace for records (it
///   never collides with a lock, a queue or a fence of any key), and is gone once its
///   TTL has run out: [`load`](Self::load) never returns an expired record, and the
///   store does not keep it long past that.
/// - [`store_and_release`](Self::store_and_release) is one atomic step in the store: the
///   check that the hold still holds its lock, the write, and the release. A hold that
///   lost its lock (its lease ran out, it was force-released) can never write, whatever
///   the delay of its call; and a record carrying a greater fencing token is never
///   overwritten.
/// - Records are kept under [exclusive](super::LockMode::Exclusive) locks, the mode the
///   layer takes; a store may refuse other modes with a
///   [misconfigured](crate::StoreErrorKind::Misconfigured) error.
pub trait ReplayStore: Send + Sync {
    /// The record kept for the lock `key`, unless there is none or its TTL has run out.
    fn load<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Bytes>>>;

    /// If `req.hold_id` still holds the lock `req.key` (in `req.mode`) and no record
    /// with a token greater than `token` is kept for it, keeps `record` for `ttl`
    /// (replacing any older one); then, whether it stored or not, releases one hold of
    /// `req` exactly as [`LockBackend::release`](super::LockBackend::release) does.
    fn store_and_release<'a>(
        &'a self,
        req: &'a LockRequest,
        token: FencingToken,
        record: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Stored>>;
}
