//! The administration of a store, beside the lock operations: reading a lock's state,
//! removing a lock whatever its holder, a readiness probe, and the record of client
//! names. An extension of [`LockBackend`], reached through [`LockBackend::admin`].

use std::time::Duration;

use super::{BoxFuture, LockBackend, LockMode, LockState};
use crate::error::{ConfigError, Result};
use crate::key::LockKey;

/// The lock [`StoreAdmin::ping`]'s default inspects: `tower_lock:ping`, a name no lock
/// of the crate's takes.
pub const PING_KEY: &str = "tower_lock:ping";

/// What an operator, a readiness probe or an inspection asks of a store: nothing a lock
/// needs to be taken, held or released. Found through [`LockBackend::admin`]; every
/// built-in backend has it. On a backend without it, [`Lock::inspect`](crate::Lock::inspect),
/// [`Lock::force_unlock`](crate::Lock::force_unlock) and
/// [`LockClient::ping`](crate::LockClient::ping) answer
/// [`ConfigError::Unsupported`].
pub trait StoreAdmin: Send + Sync {
    /// What the store holds for `key` right now, read without changing anything: every
    /// live hold of the name (whatever its kind), the name's newest fencing token, and
    /// who waits — counted by the store for modes it queues (fair, read, write), else by
    /// this backend instance (see [`WaiterScope`](super::WaiterScope)). `mode` says which
    /// waiters to count, and fills in the `max` of permit holds.
    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>>;

    /// Removes every hold on `key` in `mode` whatever its identity, and wakes waiters;
    /// returns whether anything was held. An administrative escape hatch (Redisson's
    /// `forceUnlock`): the holders are not told until their next renewal or release.
    fn force_release<'a>(&'a self, key: &'a LockKey, mode: LockMode)
    -> BoxFuture<'a, Result<bool>>;

    /// One round trip to the store, changing nothing: `Ok` when it answered, for
    /// readiness probes ([`LockClient::ping`](crate::LockClient::ping)). An error of
    /// kind [unavailable](crate::StoreErrorKind::Unavailable) when it did not.
    ///
    /// The default [inspects](StoreAdmin::inspect) the lock [`PING_KEY`], which nobody
    /// takes: a real round trip on any store. Stores with a cheaper no-op override it
    /// (Redis `PING`, PostgreSQL `SELECT 1`, RedLock: a quorum of nodes answering
    /// theirs).
    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let key = LockKey::new(PING_KEY)?;
            self.inspect(&key, LockMode::Exclusive).await.map(drop)
        })
    }

    /// The store's record of client names, if it keeps one; see [`ClientNames`]. The
    /// default is `None`: inspections show no names of other processes' clients.
    fn clients(&self) -> Option<&dyn ClientNames> {
        None
    }
}

/// The client names a store records, so that any process inspecting a lock can say
/// which process holds it ([`LockClientBuilder::name`](crate::LockClientBuilder::name)).
/// Found through [`StoreAdmin::clients`]: a store that keeps no names does not
/// implement it.
pub trait ClientNames: Send + Sync {
    /// Records in the store that the client `id` (the UUID part of its owners) is named
    /// `name`, for `ttl`.
    fn register<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>>;

    /// The names registered for client `ids`, in the same order (`None`: none
    /// registered, or expired).
    fn names<'a>(&'a self, ids: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<Option<String>>>>;

    /// Removes the name of the client `id`, which is shutting down
    /// ([`LockClient::shutdown`](crate::LockClient::shutdown)). The default removes
    /// nothing: the record then ends with its TTL.
    fn unregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        let _ = id;
        Box::pin(async { Ok(()) })
    }
}

/// `backend`'s administration, or the error that says it has none.
pub(crate) fn admin_of(backend: &dyn LockBackend) -> Result<&dyn StoreAdmin> {
    backend.admin().ok_or_else(|| {
        ConfigError::Unsupported {
            backend: backend.profile().name(),
            what: "administration (inspect, force_release, ping)".to_owned(),
        }
        .into()
    })
}

/// The client names `backend` records, if it has administration and keeps them.
pub(crate) fn clients_of(backend: &dyn LockBackend) -> Option<&dyn ClientNames> {
    backend.admin()?.clients()
}
