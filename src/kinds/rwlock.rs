//! The read-write lock handle.

use crate::backend::LockMode;
use crate::error::ConfigError;
use crate::key::{IntoLockKey, LockKey};
use crate::lock::{Lock, LockClient};

impl LockClient {
    /// The read-write lock named `key` (Redisson `getReadWriteLock`).
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] when `key` is not a valid [`LockKey`].
    pub fn get_read_write_lock(&self, key: impl IntoLockKey) -> Result<ReadWriteLock, ConfigError> {
        Ok(ReadWriteLock::new(self.clone(), key.into_lock_key()?))
    }
}

/// A read-write lock on one key (Redisson `RReadWriteLock`): many owners may hold the
/// [read lock](ReadWriteLock::read_lock) at once, or one owner the
/// [write lock](ReadWriteLock::write_lock).
///
/// Get it with [`LockClient::get_read_write_lock`].
///
/// - Readers share the key; a writer excludes readers and other writers.
/// - The writer's owner may take the read lock too, and keep it after releasing the
///   write lock (downgrade).
/// - A reader that asks for the write lock waits like any writer, until every read
///   hold — its own included — is gone: holding the read lock while waiting for the
///   write lock of the same key deadlocks on itself until the wait runs out (as in
///   Redisson). Release the read lock first.
/// - No starvation: blocked readers and writers queue in arrival order. Once a writer
///   waits, new readers queue behind it, so it gets in as soon as the readers it found
///   are done; the readers queued behind it are admitted together when it releases.
///   [`LockMode`](crate::LockMode#rules) gives the exact rules.
///
/// # Example
///
/// ```no_run
/// # async fn demo(client: tower_lock::LockClient) -> Result<(), tower_lock::Error> {
/// let rw = client.get_read_write_lock("doc:7")?;
/// let reading = rw.read_lock().lock().await?;
/// reading.unlock().await?;
/// let writing = rw.write_lock().lock().await?;
/// writing.unlock().await?;
/// # Ok(())
/// # }
/// ```
#[derive(Clone, Debug)]
pub struct ReadWriteLock {
    client: LockClient,
    key: LockKey,
}

impl ReadWriteLock {
    fn new(client: LockClient, key: LockKey) -> Self {
        ReadWriteLock { client, key }
    }

    /// The key.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// The shared side.
    pub fn read_lock(&self) -> Lock {
        self.client.lock_on(self.key.clone(), LockMode::Read)
    }

    /// The exclusive side.
    pub fn write_lock(&self) -> Lock {
        self.client.lock_on(self.key.clone(), LockMode::Write)
    }
}
