//! Lock kinds beyond the plain reentrant lock.
//!
//! Most kinds are a [`Lock`](crate::Lock) in another [`LockMode`](crate::LockMode) and share
//! its whole API — waiting, watchdog, guard, lost signal, fencing:
//!
//! | kind | how to get it | what it solves |
//! |---|---|---|
//! | reentrant lock | [`LockClient::get_lock`](crate::LockClient::get_lock) | one owner at a time |
//! | fair lock | [`LockClient::get_fair_lock`](crate::LockClient::get_fair_lock) | waiters served in arrival order: no starvation |
//! | read-write lock | [`LockClient::get_read_write_lock`](crate::LockClient::get_read_write_lock) | many readers or one writer |
//! | permits | [`LockClient::get_permits`](crate::LockClient::get_permits) | at most N holders at once (a leased semaphore) |
//! | MultiLock | [`MultiLock`] | several locks, all or none |
//! | RedLock | a [`LockClient`](crate::LockClient) over a [`RedLock`] backend | a lock that survives losing a minority of independent stores |
//!
//! Backends implement the modes — both built-in backends, memory and Redis, implement
//! every one; a backend that does not answers
//! [`ConfigError::Unsupported`](crate::ConfigError::Unsupported). The modes' exact semantics — queue
//! order, the read-write starvation policy, permits' leases — are described with
//! [`LockMode`](crate::LockMode#rules); every backend implements the same rules.

mod multi;
mod rwlock;

// RedLock is a backend: its home is `backend::redlock`; these paths stay for its users.
pub use crate::backend::redlock;
pub use crate::backend::redlock::{Quorum, RedLock, RedLockBuilder};
pub use multi::{MultiGuard, MultiLock};
pub use rwlock::ReadWriteLock;
