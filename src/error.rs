//! The crate's errors, by phase.
//!
//! - [`ConfigError`]: a mistake in what the caller asked for, found without I/O —
//!   `get_lock`, `LockKey::new`, the layers' and the client's builders.
//! - [`SetupError`]: building a backend that connects — a setting, or a store it could
//!   not reach or use.
//! - [`Error`]: at run time, every lock call. The variants keep the cases a caller
//!   handles differently apart: the lock was busy (try again later), the lock was lost
//!   while held (the critical section is compromised), the client was shut down, the
//!   store failed ([`Error::Store`]).
//!
//! `?` converts the first two into [`Error`], so one `Result` type can carry all three.
//!
//! # Store failures by kind
//!
//! What the crate does about a store failure follows its [`StoreErrorKind`], whichever
//! backend reported it and however: [unavailable](StoreErrorKind::Unavailable) (an
//! outage: retried while a lock call waits, and let through by a layer that fails open),
//! [misconfigured](StoreErrorKind::Misconfigured) or
//! [unexpected](StoreErrorKind::Unexpected) (both fail closed). [`Error::store_kind`],
//! [`Error::is_unavailable`], [`Error::is_retryable`] and [`Error::is_backend`] read it.
//! The store driver's own error is the [`source`](std::error::Error::source) of a
//! [`StoreError`], never a type in this crate's API: downcast it for a code of its own
//! (PostgreSQL's SQLSTATE, which the message also carries; a Redis error code).
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

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A type-erased error, as tower uses it.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What can go wrong with a lock at run time: taking, holding, releasing or inspecting
/// it. A caller matches on the variants — [`Busy`](Error::Busy) (try again later),
/// [`Lost`](Error::Lost) (the critical section is compromised),
/// [`Shutdown`](Error::Shutdown), [`Store`](Error::Store) (by its
/// [kind](StoreError::kind)) — or asks [`is_retryable`](Error::is_retryable).
/// [`Config`](Error::Config) is a mistake of the caller's found at run time (a lease out
/// of range); setup calls return [`ConfigError`] or [`SetupError`] alone.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
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

    /// The lock client was shut down ([`LockClient::shutdown`](crate::LockClient::shutdown)):
    /// it takes no more locks, and an acquisition that was waiting or in flight when it
    /// shut down gave up. Not a store failure and not retryable: a layer on a shut-down
    /// client fails closed (as misconfigured) even where it fails open, since serving a
    /// request unlocked is never the answer to a shutdown. Shut the client down after
    /// the server has drained its requests.
    #[error("the lock client was shut down")]
    Shutdown,

    /// The lock store failed: it could not be reached, refused the operation, or
    /// answered something this crate does not understand. Its
    /// [kind](StoreError::kind) says which, and decides what the crate does about it;
    /// the store driver's own error (redis-rs, sqlx, I/O), or a store-specific
    /// condition ([`NoQuorum`](crate::backend::redlock::NoQuorum), Redis's
    /// `WrongType`), is its [`source`](std::error::Error::source).
    #[error(transparent)]
    Store(#[from] StoreError),

    /// The call was given something it cannot use: an invalid key or setting, or a mode
    /// the backend does not implement. Retrying will not help; fix the caller.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

/// A mistake in what a caller asked for, found before anything reaches a store: an
/// invalid key, a setting out of range, a lock kind the backend does not implement.
/// Returned by the calls that set things up without I/O (`get_lock`, `LockKey::new`,
/// the layers' and the client's builders); at run time it is [`Error::Config`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The lock key is empty, too long, contains control characters or malformed
    /// hash-tag braces. See [`LockKey`](crate::LockKey) for the rules.
    #[error("invalid lock key: {reason}")]
    InvalidKey {
        /// What is wrong with the key.
        reason: String,
    },

    /// A setting is out of range (a zero lease, a wait that cannot be represented, a
    /// pool too small, ...). The message names the setting and the value.
    #[error("invalid configuration: `{name}` {reason}")]
    InvalidSetting {
        /// The setting, e.g. `lease`.
        name: &'static str,
        /// What is wrong with it, including the value given.
        reason: String,
    },

    /// The backend does not implement what was asked of it: a lock mode, or an
    /// extension such as administration.
    #[error("the {backend} backend does not support {what}")]
    Unsupported {
        /// The backend's name.
        backend: &'static str,
        /// What was asked for, e.g. `fair locks`.
        what: String,
    },
}

/// What can go wrong building a backend that connects to its store: a setting it cannot
/// use, or a store it cannot reach or use (a refused connection, a missing table, a
/// server of another kind).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SetupError {
    /// A setting or URL the backend cannot use.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The store could not be reached or used; see [`StoreError::kind`].
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl SetupError {
    /// What kind of store failure this is, `None` for a setting.
    pub fn store_kind(&self) -> Option<StoreErrorKind> {
        match self {
            SetupError::Store(error) => Some(error.kind()),
            SetupError::Config(_) => None,
        }
    }

    /// Whether the store could not be reached (an outage: trying again later may
    /// work), as opposed to a setting or a store that refused.
    pub fn is_unavailable(&self) -> bool {
        self.store_kind() == Some(StoreErrorKind::Unavailable)
    }
}

impl From<SetupError> for Error {
    fn from(error: SetupError) -> Self {
        match error {
            SetupError::Config(error) => Error::Config(error),
            SetupError::Store(error) => Error::Store(error),
        }
    }
}

/// A runtime error where setup was expected: a builder's validation shared with the lock
/// path returns the setting, and a store failure at setup stays one.
impl From<Error> for SetupError {
    fn from(error: Error) -> Self {
        match error {
            Error::Config(error) => SetupError::Config(error),
            Error::Store(error) => SetupError::Store(error),
            other => SetupError::Store(StoreError::msg(
                StoreErrorKind::Unexpected,
                other.to_string(),
            )),
        }
    }
}

impl ConfigError {
    pub(crate) fn invalid_key(reason: impl Into<String>) -> Self {
        ConfigError::InvalidKey {
            reason: reason.into(),
        }
    }

    pub(crate) fn invalid_setting(name: &'static str, reason: impl Into<String>) -> Self {
        ConfigError::InvalidSetting {
            name,
            reason: reason.into(),
        }
    }
}

fn fmt_ttl(ttl: Option<Duration>) -> String {
    match ttl {
        Some(ttl) => format!(" (holder's lease ends in {} ms)", ttl.as_millis()),
        None => String::new(),
    }
}

impl Error {
    /// What kind of store failure this is: [`Error::Store`]'s kind; `None` for an error
    /// that is not the store's (the lock's state, the caller's input).
    pub fn store_kind(&self) -> Option<StoreErrorKind> {
        match self {
            Error::Store(error) => Some(error.kind()),
            Error::Busy { .. } | Error::Lost | Error::Shutdown | Error::Config(_) => None,
        }
    }

    /// Whether trying the same operation again later may succeed: the lock was busy, or
    /// the store was [unavailable](StoreErrorKind::Unavailable) (unreachable, timed out,
    /// no quorum). Invalid input, a lost lock, unsupported modes and a store that is
    /// misconfigured or answers something unexpected are not retryable.
    pub fn is_retryable(&self) -> bool {
        self.is_busy() || self.is_unavailable()
    }

    /// Whether the lock store could not answer: unreachable, timed out, a connection
    /// dropped, no quorum of nodes — an outage, which retrying (or failing open) is right
    /// for: its [kind](Error::store_kind) is [`StoreErrorKind::Unavailable`]. A store
    /// that answered something the crate cannot use (a key of another type, a reply it
    /// does not understand, a refusal) and a mode the backend does not implement are
    /// misconfigurations, not outages.
    pub fn is_unavailable(&self) -> bool {
        self.store_kind() == Some(StoreErrorKind::Unavailable)
    }

    /// The typed condition behind a store failure, if it is an `E`: a store-specific
    /// one ([`NoQuorum`](crate::backend::redlock::NoQuorum) for RedLock, Redis's
    /// `WrongType`) or the driver's error (a `redis::RedisError`, a `sqlx::Error`).
    /// `None` for another error, or another type.
    ///
    /// ```
    /// use tower_lock::{Error, StoreError, StoreErrorKind};
    ///
    /// let io = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
    /// let error = Error::from(StoreError::new(StoreErrorKind::Unavailable, io));
    /// let io = error.store_source::<std::io::Error>().unwrap();
    /// assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
    /// assert!(Error::Lost.store_source::<std::io::Error>().is_none());
    /// ```
    pub fn store_source<E: std::error::Error + 'static>(&self) -> Option<&E> {
        match self {
            Error::Store(error) => error.downcast_ref::<E>(),
            _ => None,
        }
    }

    /// Whether this is [`Error::Busy`]: another owner holds the lock.
    pub fn is_busy(&self) -> bool {
        matches!(self, Error::Busy { .. })
    }

    /// Whether the error comes from the lock store (unreachable, refused, unexpected
    /// data: any [kind](Error::store_kind)) rather than from the lock's state or the
    /// caller's input.
    pub fn is_backend(&self) -> bool {
        self.store_kind().is_some()
    }

    /// Whether the store's connection broke under the operation: see
    /// [`StoreError::is_connection_lost`].
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn is_connection_lost(&self) -> bool {
        matches!(self, Error::Store(error) if error.is_connection_lost())
    }

    /// Whether the store cannot have applied the operation: see
    /// [`StoreError::not_applied`].
    pub(crate) fn is_not_applied(&self) -> bool {
        matches!(self, Error::Store(error) if error.is_not_applied())
    }

    /// Whether the store gave no answer (a timeout, a connection that broke or could
    /// not be made), rather than answering with a refusal.
    pub(crate) fn is_unanswered(&self) -> bool {
        matches!(self, Error::Store(error) if error.unanswered)
    }

    /// Whether one more try at once may well work: the connection broke under the
    /// operation, or the store's refusal mended its own cause.
    pub(crate) fn again_at_once(&self) -> bool {
        matches!(self, Error::Store(error) if error.again_at_once)
    }

    /// The same error again, for each of several operations that failed together (a
    /// batch of renewals): every variant's data is cloneable, a store error's source
    /// shared.
    #[cfg_attr(
        not(any(feature = "redis", feature = "postgres", feature = "mysql")),
        allow(dead_code)
    )]
    pub(crate) fn duplicate(&self) -> Error {
        match self {
            Error::Busy { holder_ttl } => Error::Busy {
                holder_ttl: *holder_ttl,
            },
            Error::Lost => Error::Lost,
            Error::Shutdown => Error::Shutdown,
            Error::Store(error) => Error::Store(error.clone()),
            Error::Config(error) => Error::Config(error.clone()),
        }
    }

    /// A store failure of `kind`, described by `message` (no driver error behind it).
    pub(crate) fn store(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        Error::Store(StoreError::msg(kind, message))
    }

    pub(crate) fn invalid_config(name: &'static str, reason: impl Into<String>) -> Self {
        Error::Config(ConfigError::invalid_setting(name, reason))
    }
}

/// What kind of failure a lock store had. Behaviour follows the kind, whichever backend
/// reported it: whether a lock call retries, and whether a layer configured to fail open
/// lets a request through.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// The store could not answer: unreachable, refused the connection, timed out, a
    /// connection that dropped, an operation never sent or refused for arriving after
    /// its deadline. An outage: retrying later may work ([`Error::is_retryable`]), a
    /// waiting lock call retries until its deadline, and a layer configured to fail open
    /// serves the request unlocked.
    Unavailable,
    /// The store answered, refusing the operation for a reason retrying will not fix —
    /// almost always how it is set up: a missing schema, table or function, missing
    /// permissions, a wrong password, a read-only replica, a script the server rejects.
    /// Fails closed, even where the layer fails open.
    Misconfigured,
    /// The store answered something this crate does not understand: a reply of another
    /// shape, a hold with an identity that is not one. Fails closed.
    Unexpected,
}

impl fmt::Display for StoreErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StoreErrorKind::Unavailable => "unavailable",
            StoreErrorKind::Misconfigured => "misconfigured",
            StoreErrorKind::Unexpected => "answered unexpectedly",
        })
    }
}

/// A failure of the lock store: its [kind](StoreErrorKind), a message, and the store
/// driver's own error as its [`source`](std::error::Error::source) (a
/// `redis::RedisError`, a `sqlx::Error`, an `std::io::Error`), so that no driver's type
/// is part of this crate's API and none is lost either. Cheap to clone (the source is
/// shared).
///
/// A backend outside the crate reports its failures as one of these, choosing the kind:
/// `Err(StoreError::new(StoreErrorKind::Unavailable, io_error).into())`.
///
/// # Example
///
/// The driver's error, for a code of its own (PostgreSQL's SQLSTATE, a Redis error
/// code), by downcasting the source:
///
/// ```
/// use tower_lock::{Error, StoreError, StoreErrorKind};
///
/// let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "refused");
/// let error = Error::from(StoreError::new(StoreErrorKind::Unavailable, io));
/// assert!(error.is_unavailable() && error.is_retryable());
/// assert_eq!(error.to_string(), "lock store unavailable: refused");
///
/// let Error::Store(store) = &error else { unreachable!() };
/// let io = store.downcast_ref::<std::io::Error>().unwrap();
/// assert_eq!(io.kind(), std::io::ErrorKind::ConnectionRefused);
/// // The same through `std::error::Error::source`, on the crate's `Error` itself:
/// let source = std::error::Error::source(&error).unwrap();
/// assert!(source.downcast_ref::<std::io::Error>().is_some());
/// ```
#[derive(Clone)]
pub struct StoreError {
    kind: StoreErrorKind,
    message: String,
    source: Option<Arc<dyn std::error::Error + Send + Sync + 'static>>,
    connection_lost: bool,
    not_applied: bool,
    /// Worth one more try at once: the connection broke (and is being replaced), or
    /// the store refused the attempt for a reason the refusal itself mended (a clock
    /// sample it brought).
    again_at_once: bool,
    /// The store gave no answer (a timeout, a connection that broke or could not be
    /// made), as opposed to one that answered with a refusal: a cleanup sent now would
    /// most likely meet the same.
    unanswered: bool,
}

impl StoreError {
    /// A failure of `kind`, caused by the driver's error `source`; the message is the
    /// source's.
    pub fn new(kind: StoreErrorKind, source: impl Into<BoxError>) -> Self {
        let source: BoxError = source.into();
        StoreError {
            kind,
            message: source.to_string(),
            source: Some(Arc::from(source)),
            connection_lost: false,
            not_applied: false,
            again_at_once: false,
            unanswered: false,
        }
    }

    /// A failure of `kind` that no driver error stands behind (a reply of the wrong
    /// shape, a deadline that passed), described by `message`.
    pub fn msg(kind: StoreErrorKind, message: impl Into<String>) -> Self {
        StoreError {
            kind,
            message: message.into(),
            source: None,
            connection_lost: false,
            not_applied: false,
            again_at_once: false,
            unanswered: false,
        }
    }

    /// An [unavailable](StoreErrorKind::Unavailable) store whose connection broke under
    /// the operation (a store that restarted while the connection was idle, a reset
    /// connection), as opposed to one that timed out or refused to connect: the backend
    /// is reconnecting, and trying again at once may well work. The lock core does, once,
    /// for a first attempt (see [`StoreError::is_connection_lost`]).
    pub fn connection_lost(source: impl Into<BoxError>) -> Self {
        StoreError {
            connection_lost: true,
            again_at_once: true,
            unanswered: true,
            ..StoreError::new(StoreErrorKind::Unavailable, source)
        }
    }

    /// An [unavailable](StoreErrorKind::Unavailable) store that cannot have applied the
    /// operation: it never reached the store (no connection could be made, or none was
    /// to be had from a pool), or the store refused it having changed nothing (an
    /// attempt past its deadline). The lock core then has nothing to take back: an
    /// acquisition that failed so sends no [`abandon`](crate::backend::LockBackend::abandon),
    /// which in an outage would only be one more command to retry, and to land on the
    /// store the moment it is back. Say it only when it is certain: a command written
    /// to a connection that then broke may have been applied.
    pub fn not_applied(source: impl Into<BoxError>) -> Self {
        StoreError {
            not_applied: true,
            ..StoreError::new(StoreErrorKind::Unavailable, source)
        }
    }

    /// The same failure, described by `message` instead of the source's own (which
    /// stays the [`source`](std::error::Error::source)).
    #[must_use]
    pub fn with_message(mut self, message: impl Into<String>) -> Self {
        self.message = message.into();
        self
    }

    /// The message alone, without the kind [`Display`](fmt::Display) puts first.
    #[cfg(feature = "redis")]
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// What kind of failure this is.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// Whether the store's connection broke under the operation (see
    /// [`StoreError::connection_lost`]). A first acquisition attempt that fails so is
    /// tried once more, at once, as a new hold: a store restart costs no caller an
    /// error.
    pub fn is_connection_lost(&self) -> bool {
        self.connection_lost
    }

    /// Whether the store cannot have applied the operation (see
    /// [`StoreError::not_applied`]).
    pub fn is_not_applied(&self) -> bool {
        self.not_applied
    }

    /// Marks the failure as also one of a connection that broke
    /// ([`StoreError::connection_lost`]): a connection refused while the backend
    /// reconnects is both, never sent and worth one more try at once.
    #[cfg(feature = "redis")]
    pub(crate) fn and_connection_lost(mut self) -> Self {
        self.connection_lost = true;
        self.again_at_once = true;
        self
    }

    /// Marks the failure as one the store gave no answer to (a timeout, an I/O error),
    /// as opposed to a refusal it answered.
    #[cfg(any(
        feature = "redis",
        feature = "postgres",
        feature = "mysql",
        feature = "zookeeper"
    ))]
    pub(crate) fn and_unanswered(mut self) -> Self {
        self.unanswered = true;
        self
    }

    /// Marks the failure as worth one more try at once, though no connection broke: a
    /// refusal that mended its own cause (an attempt refused as late, whose refusal
    /// brought the store's clock).
    #[cfg(any(feature = "redis", feature = "postgres", feature = "mysql"))]
    pub(crate) fn and_again_at_once(mut self) -> Self {
        self.again_at_once = true;
        self
    }

    /// The driver's error behind this one, if it is an `E`: a `redis::RedisError` (its
    /// `code()`), a `sqlx::Error` (a `Database` error's `code()` is the SQLSTATE), an
    /// `std::io::Error`.
    pub fn downcast_ref<E: std::error::Error + 'static>(&self) -> Option<&E> {
        self.source.as_deref()?.downcast_ref::<E>()
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "lock store {}: {}", self.kind, self.message)
    }
}

impl fmt::Debug for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("StoreError");
        d.field("kind", &self.kind).field("message", &self.message);
        if let Some(source) = &self.source {
            d.field("source", source);
        }
        if self.connection_lost {
            d.field("connection_lost", &true);
        }
        if self.not_applied {
            d.field("not_applied", &true);
        }
        d.finish()
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|source| source as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_is_lowercase_without_period() {
        let errors = [
            Error::Config(ConfigError::invalid_key("is empty")),
            Error::invalid_config("lease", "must be at least 1 ms (got 0 ns)"),
            Error::Busy {
                holder_ttl: Some(Duration::from_millis(1500)),
            },
            Error::Busy { holder_ttl: None },
            Error::Lost,
            Error::Shutdown,
            Error::store(StoreErrorKind::Unavailable, "connection refused"),
            Error::Config(ConfigError::Unsupported {
                backend: "memory",
                what: "fair locks".to_owned(),
            }),
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
    fn behaviour_follows_the_kind() {
        assert!(Error::Busy { holder_ttl: None }.is_retryable());
        assert!(!Error::Busy { holder_ttl: None }.is_unavailable());
        assert!(!Error::Busy { holder_ttl: None }.is_backend());
        assert!(!Error::Lost.is_retryable());
        assert!(!Error::Lost.is_backend());
        assert!(!Error::from(ConfigError::invalid_key("x")).is_retryable());
        assert!(!Error::from(ConfigError::invalid_key("x")).is_backend());

        let down = Error::store(StoreErrorKind::Unavailable, "down");
        assert!(down.is_retryable() && down.is_unavailable() && down.is_backend());
        assert!(!down.is_connection_lost());
        for fails_closed in [
            Error::store(StoreErrorKind::Misconfigured, "no such table"),
            Error::store(StoreErrorKind::Unexpected, "a reply of another shape"),
        ] {
            assert!(fails_closed.is_backend(), "{fails_closed}");
            assert!(!fails_closed.is_retryable(), "{fails_closed}");
            assert!(!fails_closed.is_unavailable(), "{fails_closed}");
        }
        let setup = SetupError::from(StoreError::msg(StoreErrorKind::Unavailable, "refused"));
        assert_eq!(setup.store_kind(), Some(StoreErrorKind::Unavailable));
        assert!(Error::from(setup).is_unavailable());
        let setup = SetupError::from(ConfigError::invalid_setting("url", "is not one"));
        assert_eq!(setup.store_kind(), None);
        assert!(matches!(
            Error::from(setup),
            Error::Config(ConfigError::InvalidSetting { name: "url", .. })
        ));
        assert_eq!(Error::Lost.store_kind(), None);
        assert_eq!(Error::Shutdown.store_kind(), None);
        assert!(!Error::Shutdown.is_retryable());
    }

    #[test]
    fn a_store_error_keeps_the_drivers_error_as_its_source() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset by peer");
        let error = Error::from(StoreError::connection_lost(io));
        assert_eq!(error.to_string(), "lock store unavailable: reset by peer");
        assert!(error.is_unavailable() && error.is_connection_lost());
        let source = std::error::Error::source(&error).expect("the driver's error");
        let io = source
            .downcast_ref::<std::io::Error>()
            .expect("an io::Error");
        assert_eq!(io.kind(), std::io::ErrorKind::ConnectionReset);

        let Error::Store(store) = error.duplicate() else {
            unreachable!()
        };
        assert!(store.is_connection_lost());
        assert!(store.downcast_ref::<std::io::Error>().is_some(), "shared");
        assert!(store.downcast_ref::<std::fmt::Error>().is_none());

        let refused = StoreError::new(StoreErrorKind::Misconfigured, std::fmt::Error)
            .with_message("relation \"locks\" does not exist (SQLSTATE 42P01)");
        assert_eq!(
            refused.to_string(),
            "lock store misconfigured: relation \"locks\" does not exist (SQLSTATE 42P01)"
        );
        assert!(std::error::Error::source(&refused).is_some());
        let plain = StoreError::msg(StoreErrorKind::Unexpected, "inspect answered [1]");
        assert_eq!(
            plain.to_string(),
            "lock store answered unexpectedly: inspect answered [1]"
        );
        assert!(std::error::Error::source(&plain).is_none());
    }
}
