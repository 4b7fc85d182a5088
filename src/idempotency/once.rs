//! Idempotency for functions: [`Idempotent`], the store-and-release step of
//! [`IdempotencyLayer`](super::IdempotencyLayer) for work outside HTTP — a queue
//! consumer that receives a message twice, a scheduled job two replicas start at once.

use std::fmt;
use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, StatusCode};

use super::record::{Fingerprint, Record};
use crate::StoreErrorKind;
use crate::error::{ConfigError, Error};
use crate::extract::HeldLock;
use crate::key::LockKey;
use crate::lock::LockClient;

/// How long a result is kept for replay by default: 24 hours, as the layer's
/// [`DEFAULT_TTL`](super::DEFAULT_TTL).
pub const DEFAULT_RESULT_TTL: Duration = super::DEFAULT_TTL;

/// The largest result kept by default: 64 KiB. A larger one is returned but not kept
/// ([`Done::Unstored`]): the work runs again on a retry.
pub const DEFAULT_MAX_RESULT: usize = 64 * 1024;

/// A value an [`Idempotent`] run returns and keeps for replay, as bytes.
///
/// Implemented for [`Bytes`], `Vec<u8>`, [`String`] and `()`; with the `serde`
/// feature, [`Json`] keeps any serde type as JSON.
pub trait Stored: Sized {
    /// The bytes kept.
    fn to_stored(&self) -> Bytes;

    /// The value again, from the bytes [`to_stored`](Self::to_stored) made.
    ///
    /// # Errors
    ///
    /// Why the bytes are not a value of this type (a record written by another type,
    /// or another version of it).
    fn from_stored(bytes: Bytes) -> Result<Self, String>;
}

impl Stored for Bytes {
    fn to_stored(&self) -> Bytes {
        self.clone()
    }

    fn from_stored(bytes: Bytes) -> Result<Self, String> {
        Ok(bytes)
    }
}

impl Stored for Vec<u8> {
    fn to_stored(&self) -> Bytes {
        Bytes::copy_from_slice(self)
    }

    fn from_stored(bytes: Bytes) -> Result<Self, String> {
        Ok(bytes.to_vec())
    }
}

impl Stored for String {
    fn to_stored(&self) -> Bytes {
        Bytes::copy_from_slice(self.as_bytes())
    }

    fn from_stored(bytes: Bytes) -> Result<Self, String> {
        String::from_utf8(bytes.to_vec()).map_err(|e| e.to_string())
    }
}

impl Stored for () {
    fn to_stored(&self) -> Bytes {
        Bytes::new()
    }

    fn from_stored(bytes: Bytes) -> Result<Self, String> {
        if bytes.is_empty() {
            Ok(())
        } else {
            Err(format!("{} bytes kept where nothing was", bytes.len()))
        }
    }
}

/// Any serde type, kept as JSON (the `serde` feature).
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use tower_lock::idempotency::Json;
/// use tower_lock::{LockClient, MemoryBackend};
///
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct Receipt { charge: u64 }
///
/// let client = LockClient::new(MemoryBackend::new());
/// let message = br#"{"order":7,"amount":1200}"#;
/// let done = client
///     .idempotent("payment:order-7")?
///     .run(message, |_held| async { Ok::<_, std::io::Error>(Json(Receipt { charge: 1200 })) })
///     .await?;
/// assert_eq!(done.into_value().0.charge, 1200);
/// # Ok(())
/// # }
/// ```
#[cfg(feature = "serde")]
#[cfg_attr(docsrs, doc(cfg(feature = "serde")))]
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Json<T>(pub T);

#[cfg(feature = "serde")]
impl<T: serde::Serialize + serde::de::DeserializeOwned> Stored for Json<T> {
    fn to_stored(&self) -> Bytes {
        // A type whose serialization fails (a map with non-string keys) keeps an empty
        // record, which then fails to read as one: the replay reports it.
        serde_json::to_vec(&self.0).map_or_else(|_| Bytes::new(), Bytes::from)
    }

    fn from_stored(bytes: Bytes) -> Result<Self, String> {
        serde_json::from_slice(&bytes)
            .map(Json)
            .map_err(|e| e.to_string())
    }
}

/// What an [`Idempotent`] run gave: the value, and whether the work ran for it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[must_use]
pub enum Done<T> {
    /// The work ran, and its result is kept: every later run with the key replays it.
    Ran(T),
    /// The work ran, but its result is not kept (larger than
    /// [`max_result`](Idempotent::max_result), the store failed, or the lock was lost
    /// as it was stored): a later run with the key runs the work again.
    Unstored(T),
    /// An earlier run's kept result; the work did not run.
    Replayed(T),
}

impl<T> Done<T> {
    /// The value, however it came.
    pub fn into_value(self) -> T {
        match self {
            Done::Ran(value) | Done::Unstored(value) | Done::Replayed(value) => value,
        }
    }

    /// The value, borrowed.
    pub fn value(&self) -> &T {
        match self {
            Done::Ran(value) | Done::Unstored(value) | Done::Replayed(value) => value,
        }
    }

    /// Whether this is an earlier run's result (the work did not run).
    pub fn is_replayed(&self) -> bool {
        matches!(self, Done::Replayed(_))
    }
}

/// Why an [`Idempotent`] run gave no value.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdempotentError<E> {
    /// Another run with the key is still working, and did not finish within
    /// [`max_wait`](Idempotent::max_wait). Retry later (a queue: leave the message to
    /// be redelivered).
    #[error("another run with this key is still in flight")]
    InFlight,
    /// The key was used before with another fingerprint: it names another piece of
    /// work. Retrying cannot help.
    #[error("the key was used before with another fingerprint")]
    Mismatch,
    /// The work failed with this error; nothing was kept, and a retry runs it again.
    #[error("the work failed: {0}")]
    Failed(E),
    /// The lock store failed (unreachable: [`Error::is_unavailable`]), the lock was
    /// lost while the work ran ([`Error::Lost`]; the work was cancelled and nothing
    /// kept), the store keeps no results ([`Error::Config`]), or a kept result could
    /// not be read as the type asked for.
    #[error(transparent)]
    Lock(Error),
}

impl<E> IdempotentError<E> {
    /// Whether a later retry can succeed: in flight, the work's own failure, or the
    /// store unavailable or the lock lost. Not a mismatch or a misconfiguration.
    pub fn is_retryable(&self) -> bool {
        match self {
            IdempotentError::InFlight | IdempotentError::Failed(_) => true,
            IdempotentError::Mismatch => false,
            IdempotentError::Lock(error) => matches!(error, Error::Lost) || error.is_retryable(),
        }
    }
}

/// Runs a piece of work once per key and replays its result, across every process that
/// shares the lock store: made by [`LockClient::idempotent`].
///
/// [`run`](Self::run) reads the key's kept result and replays it; else it takes the
/// key's fenced lock and, under it, runs the work and keeps its result in the same
/// store step that releases the lock — the step that makes
/// [`IdempotencyLayer`](super::IdempotencyLayer) safe. A run whose lock was lost (a
/// pause past its lease, a failover) cannot keep its result over a later run's.
///
/// ```
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
/// use std::time::Duration;
/// use tower_lock::idempotency::Done;
/// use tower_lock::{LockClient, MemoryBackend};
///
/// let client = LockClient::new(MemoryBackend::new());
/// let message = b"ship order 17"; // what identifies the work: a retry's is the same
/// for delivery in 0..2 {
///     let done = client
///         .idempotent("shipment:17")?
///         .ttl(Duration::from_secs(3600))
///         .run(message, |held| async move {
///             // `held.fencing_token()` fences the work's own writes.
///             let _ = held.fencing_token();
///             Ok::<_, std::io::Error>(String::from("parcel 1"))
///         })
///         .await?;
///     assert_eq!(done.is_replayed(), delivery == 1);
///     assert_eq!(done.value(), "parcel 1");
/// }
/// # Ok(())
/// # }
/// ```
///
/// # What it promises
///
/// As the layer: the work runs at most once per key while its result is kept (the
/// [`ttl`](Self::ttl)), unless it fails, is cancelled or loses its lock, when nothing
/// is kept and a retry runs it again. For exactly-once, fence the work's own writes
/// with the [`HeldLock`]'s token, or make them idempotent. Unlike the layer it keeps
/// no quotas: its keys come from your own jobs, not from any client.
///
/// # Cancel safety
///
/// Dropped while the work runs, the work is dropped with it, the lock released in a
/// task, and nothing kept: a retry runs it again.
#[derive(Clone)]
pub struct Idempotent {
    client: LockClient,
    key: LockKey,
    ttl: Duration,
    wait: Duration,
    max_result: usize,
}

impl fmt::Debug for Idempotent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotent")
            .field(
                "key",
                &format_args!("{}", self.client.display_key(&self.key)),
            )
            .field("ttl", &self.ttl)
            .field("wait", &self.wait)
            .finish_non_exhaustive()
    }
}

impl Idempotent {
    pub(crate) fn new(client: LockClient, key: LockKey) -> Self {
        Idempotent {
            client,
            key,
            ttl: DEFAULT_RESULT_TTL,
            wait: Duration::ZERO,
            max_result: DEFAULT_MAX_RESULT,
        }
    }

    /// How long the result is kept and replayed. Default: [`DEFAULT_RESULT_TTL`] (24 h);
    /// 1 ms..=[`MAX_TTL`](super::MAX_TTL).
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// How long a run waits for another run with the key to finish, and then replays
    /// its result. Default: zero — [`IdempotentError::InFlight`] at once;
    /// at most [`MAX_WAIT`](crate::layer::MAX_WAIT).
    pub fn max_wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// The largest result kept, in bytes. Default: [`DEFAULT_MAX_RESULT`]; a larger one
    /// is returned as [`Done::Unstored`].
    pub fn max_result(mut self, bytes: usize) -> Self {
        self.max_result = bytes;
        self
    }

    /// The key's lock.
    pub fn key(&self) -> &LockKey {
        &self.key
    }

    /// Runs `work` once for the key, or replays what an earlier run kept.
    ///
    /// `fingerprint` identifies the work (a message's body, a job's arguments): a run
    /// with the key and another fingerprint is [`IdempotentError::Mismatch`]. `work` is
    /// given the [`HeldLock`] it runs under, with its fencing token and lost signal; it
    /// is dropped if the lock is lost first.
    ///
    /// # Errors
    ///
    /// See [`IdempotentError`].
    pub async fn run<T, E, F, Fut>(
        self,
        fingerprint: impl AsRef<[u8]>,
        work: F,
    ) -> Result<Done<T>, IdempotentError<E>>
    where
        T: Stored,
        F: FnOnce(HeldLock) -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        self.check().map_err(|e| IdempotentError::Lock(e.into()))?;
        let fingerprint = Fingerprint::from_content(fingerprint.as_ref());
        if let Some(done) = self.load(fingerprint).await? {
            return Ok(done);
        }
        // A fresh owner: two runs of one task or process must not re-enter each other.
        let lock = self
            .client
            .get_fenced_lock(self.key.clone())
            .map_err(|e| IdempotentError::Lock(e.into()))?
            .with_owner(self.client.new_owner());
        let lease = crate::layer::config::request_lease(&self.client);
        let guard = match lock.try_lock_for(self.wait, lease).await {
            Ok(guard) => guard,
            // Still running, unless it kept its result since the read above.
            Err(e) if e.is_busy() => {
                return match self.load(fingerprint).await? {
                    Some(done) => Ok(done),
                    None => Err(IdempotentError::InFlight),
                };
            }
            Err(e) => return Err(IdempotentError::Lock(e)),
        };
        // Under the lock: a run that finished before it was taken kept its result.
        match self.load(fingerprint).await {
            Ok(None) => {}
            found => {
                let _ = guard.unlock().await;
                return found.and_then(|done| done.ok_or(IdempotentError::InFlight));
            }
        }
        let held = HeldLock::of_guard(&guard);
        let lost = guard.lost();
        let value = tokio::select! {
            biased;
            result = work(held) => result,
            () = lost.wait() => {
                let _ = guard.unlock().await;
                return Err(IdempotentError::Lock(Error::Lost));
            }
        };
        let value = match value {
            Ok(value) => value,
            Err(error) => {
                let _ = guard.unlock().await;
                return Err(IdempotentError::Failed(error));
            }
        };
        let bytes = value.to_stored();
        if bytes.len() > self.max_result {
            let _ = guard.unlock().await;
            return Ok(Done::Unstored(value));
        }
        let record = Record::new(fingerprint, StatusCode::OK, &HeaderMap::new(), &[], bytes);
        match guard.unlock_storing(record.encode(), self.ttl).await {
            Ok(true) => Ok(Done::Ran(value)),
            Ok(false) => Ok(Done::Unstored(value)),
            Err(error) => {
                tracing::warn!(%error, key = %self.client.display_key(&self.key), "result not kept for replay; a retry will run the work again");
                Ok(Done::Unstored(value))
            }
        }
    }

    fn check(&self) -> Result<(), ConfigError> {
        if self.ttl < Duration::from_millis(1) || self.ttl > super::MAX_TTL {
            return Err(ConfigError::invalid_setting(
                "ttl",
                format!("must be 1 ms..={:?} (got {:?})", super::MAX_TTL, self.ttl),
            ));
        }
        if self.wait > crate::layer::MAX_WAIT {
            return Err(ConfigError::invalid_setting(
                "max_wait",
                format!(
                    "must be at most {:?} (got {:?})",
                    crate::layer::MAX_WAIT,
                    self.wait
                ),
            ));
        }
        Ok(())
    }

    /// The kept result for the key, replayed; `None` when there is none.
    async fn load<T: Stored, E>(
        &self,
        fingerprint: Fingerprint,
    ) -> Result<Option<Done<T>>, IdempotentError<E>> {
        let replays = self.client.backend().replays().ok_or_else(|| {
            IdempotentError::Lock(Error::Config(ConfigError::Unsupported {
                backend: self.client.backend().profile().name(),
                what: "records of results for replay (idempotent runs)".to_owned(),
            }))
        })?;
        let Some(bytes) = replays
            .load(&self.key)
            .await
            .map_err(IdempotentError::Lock)?
        else {
            return Ok(None);
        };
        let unreadable = |why: String| {
            IdempotentError::Lock(Error::store(
                StoreErrorKind::Unexpected,
                format!("the kept result cannot be read: {why}"),
            ))
        };
        let record = Record::decode(&bytes).map_err(|e| unreadable(e.to_string()))?;
        if record.fingerprint != fingerprint {
            return Err(IdempotentError::Mismatch);
        }
        T::from_stored(record.body)
            .map(|value| Some(Done::Replayed(value)))
            .map_err(unreadable)
    }
}

impl LockClient {
    /// Runs work once per `key` and replays its result: see [`Idempotent`].
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidKey`] when `key` is not a valid [`LockKey`].
    pub fn idempotent(&self, key: impl crate::IntoLockKey) -> Result<Idempotent, ConfigError> {
        Ok(Idempotent::new(self.clone(), key.into_lock_key()?))
    }
}
