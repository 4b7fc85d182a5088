//! The Redis backend: Redisson-compatible locks of every kind across processes.
//!
//! [`RedisBackend`] keeps each lock exactly where and how Redisson keeps it, so a Java
//! service calling `redisson.getLock(NAME)` (or `getFairLock`, `getReadWriteLock`) and a
//! Rust service locking `NAME` in the same kind exclude each other. `{NAME}` below means
//! `NAME` in braces, or `NAME` as is when it already has a hash tag (Redisson's rule):
//!
//! | what | where | shape |
//! |---|---|---|
//! | the lock (exclusive, fair) | `NAME` (after the optional key prefix) | `RLock`'s hash: `<client uuid>:<owner id>` → hold count, lease by `PEXPIRE` (ms) |
//! | release channel | `redisson_lock__channel:{NAME}` | message `0`: wake one waiter; `1`: wake all |
//! | fencing counter (fenced locks only) | `redisson_lock_token:{NAME}` | `RFencedLock`'s string counter, `INCR`ed on every fenced acquisition (and raised to the server clock in µs), expires a [token retention](RedisBackendBuilder::token_retention) after its last token |
//! | fair and read-write wait queue | `redisson_lock_queue:{NAME}`, `redisson_lock_timeout:{NAME}` | `RFairLock`'s list of waiters and sorted set of their eviction times (server clock, ms) |
//! | fair waiter's wake-up | `redisson_lock__channel:{NAME}:<owner>` | `RFairLock`'s: `0` to the head of the queue |
//! | read-write lock | `NAME` | `RReadWriteLock`'s hash: `mode` → `read`/`write`, `<owner>` → read holds, `<owner>:write` → write holds |
//! | read hold leases | `{NAME}:<owner>:rwlock_timeout:<i>` | `RReadWriteLock`'s string per read hold (value `1`), `PEXPIRE`d |
//! | read-write channels | `redisson_rwlock:{NAME}` (Redisson's `0` / `1`), `redisson_rwlock:{NAME}:<owner>:read` / `:write` (a queued waiter's wake-up) | |
//! | permits | `NAME` and `tower_lock_permits:{NAME}` | hash `holds:<owner>` → holds; sorted set owner → end of lease (server clock, ms) |
//! | record for replay ([`ReplayStore`], exclusive locks) | `tower_lock_replay:{NAME}` | hash `token` → the writer's fencing token, `record` → the bytes; `PEXPIRE`d with the record's TTL |
//!
//! Every key and channel of a lock shares `NAME`'s Redis Cluster hash slot. Every state
//! change is one Lua script from the crate's `lua/` directory (the fair, read-write and
//! permit scripts and the exclusive batch with `lua/lib.lua`'s helpers in front), run through [`redis::Script`]
//! (`EVALSHA`, with `EVAL` fallback when the server does not have it cached).
//!
//! Exclusive acquisitions and releases are group-committed: one
//! that finds no such call in flight is sent at once, alone; those that arrive while
//! one is in flight wait for it and then go together, up to 128 in one call of
//! `lua/lock_batch.lua`, which does for each exactly what the single-key script would
//! (an operation on a key of the wrong type fails alone). The fixed cost of entering a
//! script is then paid once per batch, not once per lock. Every operation is sent by a
//! spawned task, so a caller that gives up, or whose future is parked and never polled
//! again, never holds up the others. On a cluster a batch is split by hash slot, and
//! each slot's share goes to its master in a call of its own, all at once.
//!
//! Every acquisition carries a deadline on the server's clock, one [response
//! timeout](RedisBackendBuilder::response_timeout) after it is sent; the scripts refuse
//! an acquisition that arrives later (a write delayed on a connection that was cut or
//! replaced meanwhile), so an attempt the client has given up on never takes a lock
//! later. The client maps its clock to the server's from a `TIME` sample (taken again
//! every 30 s, and after a timeout), as a lower bound that network delays cannot
//! break; the server's clock must not step back. On a cluster one sample serves every
//! node, so the nodes' clocks must agree within 50 ms (NTP keeps them far closer).
//!
//! # Lock kinds
//!
//! - **Exclusive** ([`LockMode::Exclusive`]): Redisson's `RLock`; a release wakes one
//!   waiter per process.
//! - **Fair**: waiters queue in arrival order and only the head may take a free lock; a
//!   waiter must poll again within the [waiter
//!   timeout](RedisBackendBuilder::waiter_timeout) or it loses its place (busy replies
//!   tell it to come back within a third of it). Unlike Redisson's, a waiter's eviction
//!   time is "now + waiter timeout", refreshed at every poll, not chained from the
//!   waiter ahead of it. A release wakes the head only, on its own channel. Shared with
//!   Redisson clients, exclusion always holds, but a Redisson client taking the lock
//!   from the queue subtracts its `threadWaitTime` from every waiter's eviction time:
//!   beyond two thirds of the waiter timeout between two polls (Redisson's default is 5
//!   minutes), the tower-lock waiters queued then are evicted and rejoin at the tail,
//!   and later waiters can go first (the README's Redisson section has the details).
//! - **Read / write**: Redisson's layout, plus the same wait queue (entries
//!   `<owner>:read` / `<owner>:write`) so that writers are not starved: a reader goes
//!   when no writer holds the lock and none waits ahead of it; a writer when nothing is
//!   held and nobody waits ahead of it. The write holder — or a read request naming it
//!   as its [`writer`](LockRequest::writer) — reads without waiting (downgrade); a
//!   reader asking to write waits like any writer, until every read hold
//!   — its own too — is released. A release wakes exactly the waiters the queue now lets
//!   go, each on its own channel, and publishes Redisson's `0` (read unlock) or `1`
//!   (write unlock) on `redisson_rwlock:{NAME}` for Redisson waiters when the lock is free.
//!   Read holds whose leases all ended (a crashed reader) are dropped by the next writer.
//! - **Permits**: at most `max` owners at once (`max` from each request), each with its
//!   own lease; expired holders are dropped inside the scripts, so a crashed holder's
//!   permit returns with its lease. A release wakes one waiter per process.
//!
//! Fenced acquisitions of every kind take their tokens from the one counter per name, so
//! they increase across the holders of a name whatever its kind (see [`FencingToken`]).
//! Unfenced locks of every kind leave no key behind once released and their queues are
//! empty: Redis memory does not grow with the number of names ever locked.
//!
//! Commands go over one multiplexed connection that reconnects by itself
//! ([`redis::aio::ConnectionManager`]); all waiters of a backend share one dedicated pub/sub
//! connection (see the registry in `pubsub.rs`): one `SUBSCRIBE` per channel however many
//! waiters, dropped with the last one, restored after a reconnect.
//!
//! # Example
//!
//! ```no_run
//! use tower_lock::{LockClient, RedisBackend};
//!
//! # async fn demo() -> Result<(), tower_lock::Error> {
//! let backend = RedisBackend::connect("redis://127.0.0.1:6379").await?;
//! let client = LockClient::new(backend);
//! let guard = client.get_lock("lock:order:{42}")?.lock().await?;
//! guard.unlock().await?;
//! # Ok(())
//! # }
//! ```
//!
//! TLS (`rediss://`, feature `tls`) and passwords in the URL
//! (`redis://:secret@host:6379/0`) work as they do in redis-rs. For a private CA, build
//! the client with [`redis::Client::build_with_tls`] and pass it to
//! [`RedisBackend::from_client`]. The `tls` feature selects rustls's `ring` crypto
//! provider; an application that enables another provider as well must install one with
//! `rustls::crypto::CryptoProvider::install_default` before connecting.
//!
//! # Errors
//!
//! Failures surface as [`Error::Store`], the redis-rs error as its source (for its
//! `code()`), with the kind that decides what is done about them: connection failures,
//! timeouts, cluster redirections, and what a server answers while it cannot serve
//! writes for a while (`LOADING` after a restart, `BUSY` behind a long script,
//! `NOREPLICAS`, `OOM`, `MASTERDOWN`, `READONLY` from a demoted primary) are
//! [unavailable](crate::StoreErrorKind::Unavailable) (retried while waiting, an unlock
//! tried again; a layer that fails open lets the request through); any other error the
//! server answered (a wrong password, `NOPERM`, a script error) is
//! [misconfigured](crate::StoreErrorKind::Misconfigured), and a reply this crate does not
//! understand [unexpected](crate::StoreErrorKind::Unexpected): both fail closed. A key
//! that holds another type (a string at `NAME`) is a misconfigured store whose source is
//! [`WrongType`].
//!
//! # Cancel safety
//!
//! A command future dropped after it was written may still run on the server; the client
//! side compensates (see [`Lock`](crate::Lock)) with
//! [`abandon`](LockBackend::abandon): a release (and leaving the queue) at once, and —
//! unless that found the hold — once more when the attempt's deadline has passed on the
//! server, by when the attempt has either landed or been refused. Dropping a
//! subscription unregisters the waiter at once; the `UNSUBSCRIBE` follows from the
//! connection task.

use std::borrow::Cow;
use std::fmt;
use std::sync::Arc;
use std::sync::LazyLock;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, FromRedisValue, IntoConnectionInfo, RedisError, RedisResult, Script};

use self::primary::Primary;
use tokio_util::sync::{CancellationToken, DropGuard};

use super::{
    Acquire, BoxFuture, ClientNames, FencingToken, Grant, HoldInfo, LockBackend, LockMode,
    LockRequest, LockState, QUEUED_MODES, Release, ReplayStore, StoreAdmin, StoreProfile,
    Subscription, WaiterScope, Waiters, queued,
};
use crate::backend::clock::{ArrivedLate, COMPENSATION_MARGIN, StoreClock};
use crate::error::{Error, Result, SetupError, StoreError, StoreErrorKind};
use crate::hold_id::HoldId;
use crate::key::LockKey;

mod batch;
mod modes;
mod primary;
mod pubsub;
mod replay;
#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub mod sentinel_url;
#[cfg(feature = "sentinel")]
mod switches;

#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub use sentinel_url::SentinelUrl;

/// The source of a [misconfigured](crate::StoreErrorKind::Misconfigured) store error
/// when a lock's key holds data of another type (a string where a lock hash should be):
/// something else writes under the lock's name. Downcast the error's source to tell it
/// apart: `store_error.downcast_ref::<WrongType>()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the store holds data of another type at the lock key")]
#[non_exhaustive]
pub struct WrongType;

/// The scheme of the URLs that name a primary by its Sentinels
/// ([`RedisBackend::from_url`]).
const SENTINEL_SCHEME: &str = "redis+sentinel://";

/// Per-command response timeout when none is configured: 1 s. Lock scripts take
/// microseconds; a reply that takes a second means the server is stalled or gone, and
/// callers are better told than kept waiting.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(1);

/// Connection timeout when none is configured: 1 s.
pub const DEFAULT_CONNECTION_TIMEOUT: Duration = Duration::from_secs(1);

/// How often the pub/sub connection is checked with a `PING` when nothing else is
/// configured: 5 s. A connection that died without a word (a partition, a NAT that
/// dropped it) is then replaced within 7.5 s, instead of leaving waiters to notice
/// releases only when the holder's lease runs out.
pub const DEFAULT_PUBSUB_KEEPALIVE: Duration = Duration::from_secs(5);

/// Reconnection attempts per failed command when none is configured: 2 (about 150 ms of
/// backoff), so an outage surfaces as an error quickly instead of stalling callers
/// behind a long retry chain; the next command tries again.
pub const DEFAULT_RECONNECT_RETRIES: usize = 2;

/// How long a fencing counter outlives its last token by default: 1 hour
/// ([`RedisBackendBuilder::token_retention`]). Tokens stay increasing through clock
/// steps back of up to an hour; a name locked once, fenced, leaves its counter in Redis
/// for that long.
pub const DEFAULT_TOKEN_RETENTION: Duration = Duration::from_secs(60 * 60);

pub use crate::backend::limits::{DEFAULT_WAITER_TIMEOUT, MIN_WAITER_TIMEOUT};

/// Renewals per script call in a watchdog batch: a bound on how long one call keeps
/// Redis busy (about a millisecond), not on the batch size; a larger batch is several
/// calls in one pipelined burst.
const RENEW_CHUNK: usize = 1000;

/// The message Redisson publishes on unlock: wake one waiter.
const UNLOCK_MESSAGE: &str = "0";

struct Scripts {
    acquire: Script,
    batch: Script,
    release: Script,
    renew: Script,
    renew_many: Script,
    force_release: Script,
    inspect: Script,
    replay_store: Script,
    #[cfg(feature = "cluster")]
    time: Script,
}

impl Scripts {
    fn new(publish: Publish) -> Self {
        Scripts {
            acquire: publish.script(include_str!("../../../lua/lock_acquire.lua")),
            batch: publish.with_lib(include_str!("../../../lua/lock_batch.lua")),
            release: publish.script(include_str!("../../../lua/lock_release.lua")),
            renew: publish.script(include_str!("../../../lua/lock_renew.lua")),
            renew_many: publish.script(include_str!("../../../lua/lock_renew_many.lua")),
            force_release: publish.script(include_str!("../../../lua/lock_force_release.lua")),
            inspect: publish.with_lib(include_str!("../../../lua/inspect.lua")),
            replay_store: publish.with_lib(include_str!("../../../lua/replay_store.lua")),
            #[cfg(feature = "cluster")]
            time: publish.script(include_str!("../../../lua/time.lua")),
        }
    }
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts::new(Publish::Classic));
static SHARDED_SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts::new(Publish::Sharded));

/// How the scripts publish releases: with classic `PUBLISH`, which a cluster forwards to
/// every node, or with sharded `SPUBLISH` (Redis 7), which stays on the key's shard and
/// reaches `SSUBSCRIBE`rs only — Redisson's choice on a cluster that supports it. The
/// `lua/` files say `redis.call('publish', ...)`; the sharded variant of each script is
/// the same text with that call renamed, so one file serves both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Publish {
    Classic,
    Sharded,
}

/// How every script in `lua/` calls `PUBLISH` (checked by a test), and its sharded form.
const PUBLISH_CALL: &str = "redis.call('publish', ";
const SPUBLISH_CALL: &str = "redis.call('spublish', ";

impl Publish {
    /// `source` as a script that publishes this way.
    fn script(self, source: &str) -> Script {
        Script::new(&self.text(source))
    }

    /// `body` after the helpers of `lua/lib.lua` it calls ([`modes::lib_for`]), as one
    /// script that publishes this way.
    fn with_lib(self, body: &str) -> Script {
        self.script(&modes::lib_for(body))
    }

    fn text(self, source: &str) -> String {
        match self {
            Publish::Classic => source.to_owned(),
            Publish::Sharded => source.replace(PUBLISH_CALL, SPUBLISH_CALL),
        }
    }

    fn scripts(self) -> &'static Scripts {
        match self {
            Publish::Classic => &SCRIPTS,
            Publish::Sharded => &SHARDED_SCRIPTS,
        }
    }

    fn mode_scripts(self) -> &'static modes::ModeScripts {
        match self {
            Publish::Classic => &modes::MODE_SCRIPTS,
            Publish::Sharded => &modes::SHARDED_MODE_SCRIPTS,
        }
    }
}

/// A lock store on Redis. See the [module docs](self).
///
/// Cheap to clone: clones share the connection, the pub/sub registry and its task. The
/// task ends when the last clone is dropped.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
}

/// The command connection: one server, or a cluster (feature `cluster`).
enum Conn {
    Single(Box<SingleConn>),
    #[cfg(feature = "cluster")]
    Cluster(Box<redis::cluster_async::ClusterConnection>),
}

impl Conn {
    /// The single server's connection; `None` on a cluster.
    fn single(&self) -> Option<&SingleConn> {
        match self {
            Conn::Single(single) => Some(single),
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => None,
        }
    }

    async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        match self {
            Conn::Single(single) => single.invoke(invocation).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => invocation.invoke_async(&mut (**conn).clone()).await,
        }
    }

    async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        match self {
            Conn::Single(single) => single.query(cmd).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => cmd.query_async(&mut (**conn).clone()).await,
        }
    }
}

/// The primary's self-reconnecting connection, replaced when a command shows it cannot
/// serve any more.
///
/// `ConnectionManager` reconnects when a connection breaks, but a reply that never comes
/// (a connection that died without a word: a partition, a NAT that dropped it) is to it
/// a timeout to retry on the same connection — every later command would time out too,
/// until the operating system gives up on the socket, hours later. And it reconnects to
/// the address it started with, which after a Sentinel failover is no longer the
/// primary. So a command whose failure [calls for it](Primary::calls_for_new_connection)
/// swaps in a fresh, lazily connecting manager for the primary as it is now; the
/// generation makes concurrent failures on one dead connection replace it once.
///
/// A manager's connecting, with its timers, belongs to the tokio runtime that polls it
/// first. When a backend is shared by several runtimes and that one shuts down while the
/// manager is still connecting (or backing off between attempts), every later poll of
/// the manager panics, on every runtime, for good: it is poisoned. A command that
/// panics is therefore a connection that broke — an error, retryable as a dropped
/// connection — and the manager is replaced, as after a timeout.
struct SingleConn {
    primary: Primary,
    config: ConnectionManagerConfig,
    /// How long asking the Sentinels for the primary may take.
    connection_timeout: Duration,
    /// The connection, its generation and the address it goes to.
    current: std::sync::RwLock<(u64, ConnectionManager, String)>,
    /// Behind Sentinel, when the Sentinels last named this connection's server the
    /// primary while it had fewer replicas than acknowledgement wants: the connection's
    /// generation, the replicas it had, and when (see [`confirmed_primary`]).
    ///
    /// [`confirmed_primary`]: SingleConn::confirmed_primary
    confirmed: std::sync::Mutex<Option<(u64, u32, std::time::Instant)>>,
    /// One confirmation asked at a time; the others wait for its answer.
    confirming: tokio::sync::Mutex<()>,
    /// The connection's moves to another server, for commands in flight to hear of
    /// them (not of a replacement to the same server: a command only slow there is
    /// still answered).
    moved: tokio::sync::watch::Sender<u64>,
}

/// How long the Sentinels' word that a primary short of replicas is the primary holds.
/// A primary that lost its replicas to a failover (paused, cut off, then back) would
/// grant locks its successor grants too, were its shortfall taken for the deployment:
/// it is asked again within this, and whenever its count of replicas changes.
const CONFIRMED_FOR: Duration = Duration::from_secs(1);

impl SingleConn {
    fn new(
        primary: Primary,
        config: ConnectionManagerConfig,
        connection_timeout: Duration,
        (conn, addr): (ConnectionManager, String),
    ) -> Self {
        SingleConn {
            primary,
            config,
            connection_timeout,
            current: std::sync::RwLock::new((0, conn, addr)),
            confirmed: std::sync::Mutex::new(None),
            confirming: tokio::sync::Mutex::new(()),
            moved: tokio::sync::watch::Sender::new(0),
        }
    }

    /// `command`, unless the connection moves to another server (behind Sentinel: the
    /// primary moved) while it is in flight: it is given up then, as a connection that
    /// broke under it, and the lock core tries again at once on the new one. Its
    /// answer, should the old server ever give it, is nobody's (an attempt is refused
    /// once past its deadline; a late release is harmless).
    async fn unless_moved<T>(
        &self,
        command: impl std::future::Future<Output = Result<RedisResult<T>, Poisoned>>,
    ) -> Result<RedisResult<T>, Poisoned> {
        if !self.primary.follows_failovers() {
            return command.await;
        }
        let mut moved = self.moved.subscribe();
        let moves = *moved.borrow_and_update();
        tokio::select! {
            out = command => out,
            _ = moved.wait_for(|m| *m != moves) => {
                Ok(Err(RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "the Redis primary moved while the command was in flight",
                ))))
            }
        }
    }

    /// Whether writes on this connection may count on `replicas` replicas, fewer than
    /// acknowledgement wants, as all the deployment has. Without Sentinel, yes: nothing
    /// promotes a replica behind the client's back. Behind Sentinel, only while a
    /// majority of the Sentinels name this server the primary: a primary paused or cut
    /// off while they promoted one of its replicas comes back with none, and must not
    /// grant what its successor grants. Asked at most every [`CONFIRMED_FOR`] for the
    /// same count; a primary that moved is followed.
    async fn confirmed_primary(&self, replicas: u32) -> bool {
        if !self.primary.follows_failovers() {
            return true;
        }
        let holds = || {
            let generation = self.current().0;
            let confirmed = *self
                .confirmed
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            confirmed.is_some_and(|(g, n, at)| {
                g == generation && n == replicas && at.elapsed() < CONFIRMED_FOR
            })
        };
        if holds() {
            return true;
        }
        let _one_at_a_time = self.confirming.lock().await;
        if holds() {
            return true;
        }
        let (generation, here) = {
            let current = self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (current.0, current.2.clone())
        };
        let asked_at = std::time::Instant::now();
        if !self
            .primary
            .named_by_majority(&here, self.connection_timeout)
            .await
        {
            // Not this server, or not yet agreed: follow whoever they name now, and
            // count on no shortfall until a majority names the server written to.
            self.follow_primary().await;
            return false;
        }
        *self
            .confirmed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) =
            Some((generation, replicas, asked_at));
        true
    }

    /// A write's `ROLE` listed `replicas`: a confirmation for another count no longer
    /// holds (a replica that came and went may have been promoted meanwhile).
    fn note_replicas(&self, replicas: u32) {
        let mut confirmed = self
            .confirmed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if confirmed.is_some_and(|(_, n, _)| n != replicas) {
            *confirmed = None;
        }
    }

    /// The current connection and its generation.
    fn current(&self) -> (u64, ConnectionManager) {
        let current = self
            .current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (current.0, current.1.clone())
    }

    /// Runs a script. redis-rs loads a script Redis does not know and runs it once more;
    /// if the script cache was emptied in between (a restart, a failover to a replica,
    /// `SCRIPT FLUSH`), that second run finds no script either. It never ran, so it is
    /// loaded and run once more here.
    async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        let (generation, mut conn) = self.current();
        let sent = async {
            let result = Unpoisoned::new(invocation.invoke_async(&mut conn)).await;
            let no_script = redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
            match result {
                Ok(Err(error)) if error.kind() == no_script => {
                    tracing::debug!(
                        "the Redis script cache was emptied while a script loaded; again"
                    );
                    Unpoisoned::new(invocation.invoke_async(&mut conn)).await
                }
                result => result,
            }
        };
        let result = self.unless_moved(sent).await;
        self.after(generation, result).await
    }

    async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        let (generation, mut conn) = self.current();
        let sent = Unpoisoned::new(cmd.query_async(&mut conn));
        let result = self.unless_moved(sent).await;
        self.after(generation, result).await
    }

    /// `invocation` followed by `then` in one write on one connection, the replies as
    /// `R` (a tuple, the script's first): `then` (a `WAIT`) covers the script's writes,
    /// also when the connection is replaced right after. A script the server does not
    /// have yet is loaded, and the whole sent again.
    async fn invoke_then<R: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
        then: &[redis::Cmd],
    ) -> RedisResult<R> {
        let (generation, mut conn) = self.current();
        let mut pipe = redis::pipe();
        pipe.invoke_script(invocation);
        for cmd in then {
            pipe.add_command(cmd.clone());
        }
        let no_script = redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
        let sent = async {
            let mut result = Unpoisoned::new(pipe.query_async(&mut conn)).await;
            // Loaded and sent again; twice, should the cache be emptied in between.
            for _ in 0..2 {
                let Ok(Err(error)) = &result else { break };
                if error.kind() != no_script {
                    break;
                }
                result = match Unpoisoned::new(invocation.load_async(&mut conn)).await {
                    Ok(Ok(_)) => Unpoisoned::new(pipe.query_async(&mut conn)).await,
                    Ok(Err(error)) => Ok(Err(error)),
                    Err(poisoned) => Err(poisoned),
                };
            }
            result
        };
        let result = self.unless_moved(sent).await;
        self.after(generation, result).await
    }

    /// Replaces the connection of `generation` when `result` calls for it, or the
    /// connection panicked (see the type's docs).
    async fn after<T>(
        &self,
        generation: u64,
        result: Result<RedisResult<T>, Poisoned>,
    ) -> RedisResult<T> {
        let result = match result {
            Ok(result) => result,
            Err(Poisoned) => {
                let error = RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    "the Redis command connection was poisoned (a runtime it was tied to has shut down) and was replaced",
                ));
                self.replace(generation, &error).await;
                return Err(error);
            }
        };
        if let Err(error) = &result {
            if self.primary.calls_for_new_connection(error) {
                self.replace(generation, error).await;
            } else {
                self.after_refusal(error).await;
            }
        }
        result
    }

    /// Behind Sentinel, after a refusal that may mean this server is no longer the
    /// primary ([`PRIMARY_IN_DOUBT`]): asks the Sentinels, one caller at a time and at
    /// most every [`ASK_EVERY`](primary::ASK_EVERY), and moves if they name another
    /// primary. The others go on at once; the one asking waits for the answer, within
    /// the connection timeout.
    async fn after_refusal(&self, error: &RedisError) {
        if !refused_with(error, &PRIMARY_IN_DOUBT) {
            return;
        }
        if let Some(_asking) = self.primary.may_ask_again() {
            self.follow_primary().await;
        }
    }

    async fn replace(&self, generation: u64, why: &RedisError) {
        if self.current().0 != generation {
            return;
        }
        if let Some(client) = self.primary_now().await {
            self.swap(generation, client, &why.to_string());
        }
    }

    /// Behind Sentinel, moves to the primary the Sentinels name, if the connection is
    /// not there: a write that too few replicas acknowledged, or one refused for want of
    /// them, may mean this server lost them in a failover, and a primary that was
    /// replaced keeps answering until the Sentinels demote it.
    async fn follow_primary(&self) {
        if !self.primary.follows_failovers() {
            return;
        }
        let (generation, here) = {
            let current = self
                .current
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            (current.0, current.2.clone())
        };
        let Some(client) = self.primary_now().await else {
            return;
        };
        if client.get_connection_info().addr().to_string() != here {
            self.swap(generation, client, "the Sentinels name another primary");
        }
    }

    /// A client for the primary now, within the connection timeout.
    async fn primary_now(&self) -> Option<Client> {
        match tokio::time::timeout(self.connection_timeout, self.primary.client()).await {
            Ok(Ok(client)) => Some(client),
            Ok(Err(error)) => {
                crate::log_limit::warn_limited!(crate::log_limit::stores(), "could not find the Redis primary; keeping the connection", %error);
                None
            }
            Err(_) => {
                crate::log_limit::warn_limited!(
                    crate::log_limit::stores(),
                    "finding the Redis primary timed out; keeping the connection"
                );
                None
            }
        }
    }

    /// Swaps in a lazily connecting manager for `client` if the connection is still of
    /// `generation`.
    fn swap(&self, generation: u64, client: Client, why: &str) {
        let addr = client.get_connection_info().addr().to_string();
        let fresh = match ConnectionManager::new_lazy_with_config(client, self.config.clone()) {
            Ok(fresh) => fresh,
            Err(error) => {
                crate::log_limit::warn_limited!(crate::log_limit::stores(), "could not replace the Redis command connection", %error);
                return;
            }
        };
        let mut current = self
            .current
            .write()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if current.0 == generation {
            crate::log_limit::warn_limited!(crate::log_limit::stores(), "replacing the Redis command connection", why, to = %addr);
            let moved = current.2 != addr;
            *current = (generation + 1, fresh, addr);
            drop(current);
            if moved {
                self.moved.send_modify(|m| *m += 1);
                self.primary.note_move();
            }
        }
    }
}

/// A command whose connection panicked (see [`SingleConn`]).
struct Poisoned;

/// Polls a command, turning a panic out of it into [`Poisoned`].
#[pin_project::pin_project]
struct Unpoisoned<F> {
    #[pin]
    command: F,
}

impl<F> Unpoisoned<F> {
    fn new(command: F) -> Self {
        Unpoisoned { command }
    }
}

impl<F: std::future::Future> std::future::Future for Unpoisoned<F> {
    type Output = Result<F::Output, Poisoned>;

    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Self::Output> {
        let command = self.project().command;
        // The connection is dropped after a panic, never polled again: whatever state
        // the panic left inside it cannot be observed.
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| command.poll(cx))) {
            Ok(std::task::Poll::Ready(out)) => std::task::Poll::Ready(Ok(out)),
            Ok(std::task::Poll::Pending) => std::task::Poll::Pending,
            Err(_) => std::task::Poll::Ready(Err(Poisoned)),
        }
    }
}

/// Where the builder connects. Built once per backend, so its size does not matter.
#[allow(clippy::large_enum_variant)]
enum Target {
    Single(RedisResult<Client>),
    /// A URL that names no target: what is wrong with it.
    Invalid(String),
    #[cfg(feature = "cluster")]
    Cluster(RedisResult<Vec<redis::ConnectionInfo>>),
    #[cfg(feature = "sentinel")]
    Sentinel {
        master: String,
        sentinels: RedisResult<Vec<redis::ConnectionInfo>>,
    },
}

/// Which server a clock sample is of: the one server, or on a cluster the master
/// serving a slot.
#[cfg(feature = "cluster")]
type Node = Option<redis::cluster_routing::Slot>;
#[cfg(not(feature = "cluster"))]
type Node = ();

struct Inner {
    conn: Conn,
    prefix: String,
    /// `redis`; its identity is the server (or cluster) and key prefix, the same in
    /// every process: `redis:<host>:<port>/<db>:<key prefix>`
    /// (`redis-cluster:<nodes>:<prefix>`).
    profile: StoreProfile,
    hub: pubsub::Hub,
    waiter_timeout: Duration,
    /// Group commit of exclusive acquisitions and releases (per hash slot on a cluster).
    batcher: batch::Batcher,
    /// The server's clock (each master's, on a cluster), for the deadlines of attempts.
    clock: StoreClock<Node>,
    /// An attempt's deadline is this long after it is sent: the response timeout, so
    /// that a reply that timed out leaves no attempt that could still take a lock.
    attempt_window: Duration,
    /// Replica acknowledgement of writes, when configured.
    synced: Option<Synced>,
    /// How the scripts publish releases (sharded on a Redis 7 cluster).
    publish: Publish,
    /// How long a fencing counter outlives its last token, in milliseconds, as the
    /// scripts take it ([`RedisBackendBuilder::token_retention`]).
    token_retention: String,
    _stop_hub: DropGuard,
}

/// The replicas that `ROLE`, asked of a primary, lists: the ones online (a replica
/// still taking its first copy is not). `None` for another reply (not a primary).
fn replicas_of_role(role: &redis::Value) -> Option<u32> {
    let redis::Value::Array(fields) = role else {
        return None;
    };
    match (fields.first(), fields.get(2)) {
        (Some(redis::Value::BulkString(kind)), Some(redis::Value::Array(replicas)))
            if kind == b"master" =>
        {
            u32::try_from(replicas.len()).ok()
        }
        _ => None,
    }
}

/// Whether enough replicas acknowledged a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Replicated {
    /// As many as configured (or acknowledgement is off).
    Enough,
    /// Fewer: `acked` of `wanted` within `timeout`.
    Short {
        acked: i64,
        wanted: u32,
        timeout: Duration,
    },
}

impl Replicated {
    /// An outage when too few replicas acknowledged.
    fn check(self) -> Result<()> {
        match self {
            Replicated::Enough => Ok(()),
            Replicated::Short {
                acked,
                wanted,
                timeout,
            } => Err(Error::store(
                StoreErrorKind::Unavailable,
                format!(
                    "only {acked} of {wanted} Redis replicas acknowledged the lock's write within {timeout:?}"
                ),
            )),
        }
    }
}

/// `invocation` followed by `then` (a `WAIT`) in one pipeline on a cluster: it goes to
/// the master of the script's slot (`WAIT` itself names no key), and a redirection moves
/// both. A script the node does not have yet is loaded, and the pair sent again.
#[cfg(feature = "cluster")]
async fn cluster_invoke_then<R: FromRedisValue>(
    conn: &redis::cluster_async::ClusterConnection,
    invocation: &redis::ScriptInvocation<'_>,
    then: &[redis::Cmd],
) -> RedisResult<R> {
    let mut conn = conn.clone();
    let mut pipe = redis::pipe();
    pipe.invoke_script(invocation);
    for cmd in then {
        pipe.add_command(cmd.clone());
    }
    let no_script = redis::ErrorKind::Server(redis::ServerErrorKind::NoScript);
    let mut result = pipe.query_async(&mut conn).await;
    for _ in 0..2 {
        match &result {
            Err(error) if error.kind() == no_script => {}
            _ => break,
        }
        invocation.load_async(&mut conn).await?;
        result = pipe.query_async(&mut conn).await;
    }
    result
}

impl Inner {
    async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let result = self.conn.invoke(invocation).await;
        self.checked(result)
    }

    /// Runs `cmd`, a command that may be sent twice (a read, `PING`, `TIME`, a `SET`
    /// or `DEL` of a client name). A connection found broken (a server restarted while
    /// the connection was idle) fails the first command sent over it, and the
    /// connection reconnects; so a command that met one is sent once more, at once,
    /// and a single call (a readiness probe, a stored response read) costs the restart
    /// no error, as a lock call does not.
    async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
        let result = self.conn.query(cmd).await;
        match self.checked(result) {
            Err(error) if error.is_connection_lost() => {
                tracing::debug!(%error, "the Redis connection broke under a command; sending it again");
                let result = self.conn.query(cmd).await;
                self.checked(result)
            }
            result => result,
        }
    }

    /// Runs `invocation`, a script that only reads, as [`query`](Self::query) runs a
    /// command: once more, at once, if it met a broken connection.
    async fn read<T: FromRedisValue>(&self, invocation: &redis::ScriptInvocation<'_>) -> Result<T> {
        match self.invoke(invocation).await {
            Err(error) if error.is_connection_lost() => {
                tracing::debug!(%error, "the Redis connection broke under a script; running it again");
                self.invoke(invocation).await
            }
            result => result,
        }
    }

    /// Runs `invocation`, a write. With replica acknowledgement, `WAIT` follows it in
    /// the same write on the same connection (on a cluster: to the master of the
    /// script's slot, in one pipeline), and the answer says whether enough replicas
    /// acknowledged. `ROLE` follows the `WAIT`: it says how many replicas the primary
    /// had then, so that, unless the count is strict, the count waited for follows them
    /// (see [`RedisBackendBuilder::synced_replicas`]).
    async fn write<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<(T, Replicated)> {
        let Some(synced) = &self.synced else {
            return Ok((self.invoke(invocation).await?, Replicated::Enough));
        };
        let epoch = self.primary_moves();
        let asked = synced.asked(epoch);
        let then = [synced.wait(asked), redis::cmd("ROLE")];
        let result: RedisResult<(T, i64, Option<redis::Value>)> = match &self.conn {
            Conn::Single(single) => single.invoke_then(invocation, &then).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => cluster_invoke_then(conn, invocation, &then).await,
        };
        let (value, mut acked, role) = self.checked(result)?;
        // What this write needed: the configured count, or no more than the replicas
        // the primary had, if that is all the deployment has (a replica that came since
        // the count was read makes this one short, and the next one waits for it too).
        let connected = role.as_ref().and_then(replicas_of_role);
        if let (Some(connected), Conn::Single(single)) = (connected, &self.conn) {
            single.note_replicas(connected);
        }
        let mut wanted = match connected {
            Some(connected) => synced.now_connected(epoch, connected),
            None => synced.replicas,
        };
        if let Some(connected) = connected
            && wanted < synced.replicas
            && !self.deployment_has(connected).await
        {
            wanted = synced.replicas;
        }
        // Asked for fewer than it needed (a primary not asked yet, or one that gained
        // a replica): it waits again, on the same connection, which covers its write.
        if acked < i64::from(wanted)
            && asked < wanted
            && let Conn::Single(single) = &self.conn
        {
            let again = single.query(&synced.wait(wanted)).await;
            acked = self.checked(again)?;
        }
        let replicated = if acked >= i64::from(wanted) {
            Replicated::Enough
        } else {
            if let Conn::Single(single) = &self.conn
                && let Some(_asking) = single.primary.may_ask_again()
            {
                single.follow_primary().await;
            }
            Replicated::Short {
                acked,
                wanted,
                timeout: synced.timeout,
            }
        };
        Ok((value, replicated))
    }

    /// Whether `replicas`, fewer than acknowledgement wants, are all the deployment
    /// has (see [`SingleConn::confirmed_primary`]). On a cluster, never: a master that
    /// comes back after its replica was promoted in its place cannot be told from one
    /// whose replicas are down, and the count stays the configured one.
    async fn deployment_has(&self, replicas: u32) -> bool {
        match &self.conn {
            Conn::Single(single) => single.confirmed_primary(replicas).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => false,
        }
    }

    /// A write that must reach the replicas (a renewal): an outage when it did not.
    async fn write_strict<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let (value, replicated) = self.write(invocation).await?;
        replicated.check()?;
        Ok(value)
    }

    /// A write waited for but not failed (a release: one lost in a failover leaves the
    /// hold until its lease ends, never a second holder).
    async fn write_waited<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let (value, replicated) = self.write(invocation).await?;
        if let Err(error) = replicated.check() {
            tracing::debug!(%error, "a lock release reached too few replicas");
        }
        Ok(value)
    }

    /// An acquisition: a grant too few replicas acknowledged is an outage (the lock core
    /// then gives the attempt up, which releases it); a busy answer stands.
    async fn write_grant(&self, invocation: &redis::ScriptInvocation<'_>) -> Result<Acquire> {
        let (reply, replicated): (Vec<i64>, _) = self.write(invocation).await?;
        let acquire = parse_acquire("acquire", &reply)?;
        if matches!(acquire, Acquire::Acquired(_)) {
            replicated.check()?;
        }
        Ok(acquire)
    }

    /// A command's result as this crate's; a timeout also puts the server's clock in
    /// doubt (the connection is replaced, and may reach another server), so the next
    /// attempt samples it again.
    fn checked<T>(&self, result: RedisResult<T>) -> Result<T> {
        result.map_err(|error| self.failed(error))
    }

    /// A command's error as this crate's (see [`checked`](Self::checked)).
    fn failed(&self, error: RedisError) -> Error {
        if error.is_timeout() {
            self.clock.forget();
        }
        map_error(error)
    }

    /// How many times the command connection moved to another primary (behind
    /// Sentinel; 0 otherwise).
    fn primary_moves(&self) -> u64 {
        self.conn
            .single()
            .map_or(0, |single| single.primary.moves())
    }

    /// Whether exclusive batches may be pipelined: on a single server without replica
    /// acknowledgement (see `batch::pipeline`).
    fn pipelines(&self) -> bool {
        self.conn.single().is_some() && self.synced.is_none()
    }

    /// The scripts' argument for whether `req` is fenced: the token retention in
    /// milliseconds, or `0` for an unfenced request.
    fn fenced_arg(&self, req: &LockRequest) -> &str {
        if req.fenced {
            &self.token_retention
        } else {
            "0"
        }
    }

    /// The server whose clock an attempt on `key` meets: the one server, or on a
    /// cluster the master of the key's slot.
    fn node_of(&self, key: &LockKey) -> Node {
        match &self.conn {
            Conn::Single(_) => {
                let _ = key;
                Node::default()
            }
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => Some(redis::cluster_routing::Slot::for_key(
                Names::lock(&self.prefix, key).as_bytes(),
            )),
        }
    }

    /// The deadline, on the clock of the server serving `key` in microseconds, of an
    /// attempt sent now: its reply times out when that clock has passed it (see
    /// [`clock`](crate::backend::clock)). Samples the clock first when the last sample
    /// is too old, or was taken before the connection moved to another server.
    async fn attempt_deadline(&self, key: &LockKey) -> Result<u64> {
        let node = self.node_of(key);
        let epoch = self.primary_moves();
        if let Some(deadline) = self.clock.deadline(&node, self.attempt_window, epoch) {
            return Ok(deadline);
        }
        let (secs, micros): (u64, u64) = match &self.conn {
            Conn::Single(_) => self.query(&redis::cmd("TIME")).await?,
            // `TIME` names no key: a script that does goes to the key's master.
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => {
                self.read(
                    &self
                        .publish
                        .scripts()
                        .time
                        .key(Names::lock(&self.prefix, key).as_ref()),
                )
                .await?
            }
        };
        let received = std::time::Instant::now();
        let now_us = secs.saturating_mul(1_000_000).saturating_add(micros);
        self.clock.record(node, now_us, received, epoch);
        Ok(self
            .clock
            .deadline(&node, self.attempt_window, epoch)
            .unwrap_or(u64::MAX))
    }

    /// After an attempt on `key` failed with `error`: a refusal as late brought the
    /// server's clock, the sample for the next attempt's deadline.
    fn sample_refusal(&self, key: &LockKey, error: &Error) {
        if let Some(ArrivedLate {
            now_us: Some(now_us),
            ..
        }) = ArrivedLate::of(error)
        {
            let epoch = self.primary_moves();
            let received = std::time::Instant::now();
            self.clock
                .record(self.node_of(key), *now_us, received, epoch);
        }
    }

    /// The deadline of an attempt on `key` sent now, if the clock sample allows it
    /// without I/O (the pipelined path, which never waits).
    fn deadline_now(&self, key: &LockKey) -> Option<u64> {
        self.clock.deadline(
            &self.node_of(key),
            self.attempt_window,
            self.primary_moves(),
        )
    }

    /// One exclusive acquisition, alone (`lua/lock_acquire.lua`), of the hash `lock`;
    /// fenced with the counter `fence`, when there is one.
    async fn acquire_one(
        &self,
        lock: impl redis::ToRedisArgs,
        fence: Option<impl redis::ToRedisArgs>,
        lease_ms: u64,
        owner: &str,
        deadline: u64,
    ) -> Result<Acquire> {
        let mut invocation = self.publish.scripts().acquire.key(lock);
        let fenced = fence.is_some();
        if let Some(fence) = fence {
            invocation.key(fence);
        }
        self.write_grant(
            invocation
                .arg(lease_ms)
                .arg(owner)
                .arg(if fenced {
                    self.token_retention.as_str()
                } else {
                    "0"
                })
                .arg(deadline),
        )
        .await
    }

    /// One exclusive release, alone (`lua/lock_release.lua`, which publishes on the
    /// lock's channel), of the hash `lock`.
    async fn release_one(
        &self,
        lock: impl redis::ToRedisArgs,
        lease_ms: u64,
        owner: &str,
    ) -> Result<Release> {
        let reply: i64 = self
            .write_waited(
                self.publish
                    .scripts()
                    .release
                    .key(lock)
                    .arg(lease_ms)
                    .arg(owner),
            )
            .await?;
        Ok(match reply {
            -1 => Release::NotHeld,
            0 => Release::Released,
            holds => Release::Decremented {
                holds: u32::try_from(holds).unwrap_or(u32::MAX),
            },
        })
    }
}

/// Configures a [`RedisBackend`]; from [`RedisBackend::builder`].
#[must_use]
pub struct RedisBackendBuilder {
    target: Target,
    key_prefix: String,
    waiter_timeout: Duration,
    response_timeout: Duration,
    connection_timeout: Duration,
    reconnect_retries: usize,
    pubsub_keepalive: Duration,
    lazy: bool,
    /// Replica acknowledgement: `None` for the target's default.
    synced: Option<SyncedConfig>,
    sharded_pubsub: ShardedPubSub,
    strict_replicas: bool,
    token_retention: Duration,
    #[cfg(feature = "sentinel")]
    sentinel_node: Option<redis::sentinel::SentinelNodeConnectionInfo>,
}

/// Whether a cluster's wake-ups go through sharded pub/sub (`SPUBLISH`/`SSUBSCRIBE`,
/// Redis 7): each release is published on its key's shard only, instead of being
/// forwarded to every node of the cluster as a classic `PUBLISH` is. See
/// [`RedisBackendBuilder::sharded_pubsub`].
///
/// A sharded message reaches sharded subscribers only, and a classic one classic
/// subscribers only: every client locking the same names must choose alike. Redisson
/// chooses with its `shardedSubscriptionMode` (default `AUTO`), as [`Auto`](Self::Auto)
/// does here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum ShardedPubSub {
    /// Sharded when the cluster's nodes know `PUBSUB SHARDNUMSUB` (Redis 7 and later),
    /// classic otherwise: the choice Redisson makes by default.
    #[default]
    Auto,
    /// Always sharded; the cluster must run Redis 7 or later.
    On,
    /// Always classic `PUBLISH`/`SUBSCRIBE`, as Redisson with
    /// `shardedSubscriptionMode: OFF`.
    Off,
}

/// Replica acknowledgement as configured ([`RedisBackendBuilder::synced_replicas`]):
/// writes wait until this many replicas have them, for at most this long.
#[derive(Clone, Copy, Debug)]
struct SyncedConfig {
    replicas: u32,
    timeout: Duration,
}

/// Replica acknowledgement in force.
#[derive(Debug)]
struct Synced {
    /// The most replicas a write waits for (all of them, when strict).
    replicas: u32,
    timeout: Duration,
    /// Wait for `replicas` whatever the primary has, not for the ones it has.
    strict: bool,
    /// The replicas the primary had at the last write's `ROLE`, and the connection's
    /// epoch (its moves to another primary) then: `epoch << 32 | replicas`, `u64::MAX`
    /// before the first.
    connected: std::sync::atomic::AtomicU64,
}

impl Synced {
    fn new(replicas: u32, timeout: Duration, strict: bool) -> Self {
        Synced {
            replicas,
            timeout,
            strict,
            connected: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }

    /// How many replicas the next write, on the connection of `epoch`, asks for: the
    /// configured count; or when it follows the deployment, no more than the primary
    /// had at the last write, and none on a primary not yet asked (the write's `ROLE`
    /// says, and it waits again for what it needed): a primary just moved to waits for
    /// no replica it may not have.
    fn asked(&self, epoch: u64) -> u32 {
        if self.strict {
            return self.replicas;
        }
        let connected = self.connected.load(std::sync::atomic::Ordering::Relaxed);
        if connected == u64::MAX || connected >> 32 != epoch & 0xffff_ffff {
            return 0;
        }
        self.replicas.min((connected & 0xffff_ffff) as u32)
    }

    /// A write on the connection of `epoch` found, by its `ROLE`, `connected` replicas:
    /// the count that write needed.
    fn now_connected(&self, epoch: u64, connected: u32) -> u32 {
        let packed = (epoch & 0xffff_ffff) << 32 | u64::from(connected);
        self.connected
            .store(packed, std::sync::atomic::Ordering::Relaxed);
        if self.strict {
            self.replicas
        } else {
            self.replicas.min(connected)
        }
    }

    fn wait(&self, replicas: u32) -> redis::Cmd {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(lease_ms(self.timeout));
        wait
    }
}

impl RedisBackend {
    /// Connects to the Redis server at `url` with the default settings.
    ///
    /// # Errors
    ///
    /// [`SetupError::Store`]: [misconfigured](crate::StoreErrorKind::Misconfigured) when the
    /// URL is invalid or the server refuses the credentials,
    /// [unavailable](crate::StoreErrorKind::Unavailable) when it cannot be reached.
    pub async fn connect(url: impl IntoConnectionInfo) -> Result<Self, SetupError> {
        Self::builder(url).build().await
    }

    /// Configures a backend for the server at `url` (`redis://`, `rediss://`,
    /// `redis+unix://`; user, password and database as redis-rs accepts them).
    pub fn builder(url: impl IntoConnectionInfo) -> RedisBackendBuilder {
        Self::builder_with(Target::Single(Client::open(url)))
    }

    /// Configures a backend from a URL: everything [`builder`](Self::builder) takes
    /// (`redis://`, `rediss://`, `redis+unix://`), and, with the `sentinel` feature, a
    /// primary named by its Sentinels, as several Redis clients write it:
    ///
    /// ```text
    /// redis+sentinel://[user:password@]host[:port][,host[:port]...]/master[/db]
    /// ```
    ///
    /// That is [`RedisBackend::sentinel`]`(master, hosts)` (a host without a port is a
    /// Sentinel on 26379; IPv6 addresses go in brackets), with the user, password
    /// (percent-encoded) and database as the primary's
    /// ([`sentinel_node`](RedisBackendBuilder::sentinel_node)). Sentinels with a
    /// password of their own, and TLS, take [`RedisBackend::sentinel`] with their URLs.
    ///
    /// A bad URL is reported by [`build`](RedisBackendBuilder::build): a
    /// [misconfigured](crate::StoreErrorKind::Misconfigured) [`Error::Store`] that says
    /// what is wrong (a missing master name, no Sentinel, a bad port) without repeating
    /// the credentials; so is a `redis+sentinel://` URL without the `sentinel` feature.
    ///
    /// ```no_run
    /// use tower_lock::RedisBackend;
    ///
    /// # async fn demo() -> Result<(), tower_lock::Error> {
    /// let url = std::env::var("REDIS_URL")
    ///     .unwrap_or_else(|_| "redis+sentinel://10.0.0.1,10.0.0.2,10.0.0.3/mymaster".into());
    /// let backend = RedisBackend::from_url(&url).build().await?;
    /// # Ok(())
    /// # }
    /// ```
    pub fn from_url(url: &str) -> RedisBackendBuilder {
        if url
            .get(..SENTINEL_SCHEME.len())
            .is_some_and(|s| s.eq_ignore_ascii_case(SENTINEL_SCHEME))
        {
            Self::from_sentinel_url(url)
        } else {
            Self::builder(url)
        }
    }

    #[cfg(feature = "sentinel")]
    fn from_sentinel_url(url: &str) -> RedisBackendBuilder {
        match SentinelUrl::parse_reason(url) {
            Ok(parsed) => {
                let sentinels = parsed.sentinels().iter().map(String::as_str);
                Self::sentinel(parsed.master(), sentinels).sentinel_node(parsed.node_info())
            }
            Err(reason) => {
                Self::builder_with(Target::Invalid(format!("the Sentinel URL {reason}")))
            }
        }
    }

    #[cfg(not(feature = "sentinel"))]
    fn from_sentinel_url(_url: &str) -> RedisBackendBuilder {
        Self::builder_with(Target::Invalid(format!(
            "{SENTINEL_SCHEME} URLs need the `sentinel` feature"
        )))
    }

    /// Configures a backend using an existing redis-rs client.
    pub fn from_client(client: Client) -> RedisBackendBuilder {
        Self::builder_with(Target::Single(Ok(client)))
    }

    /// Configures a backend for a Redis Cluster reached through `nodes` (any subset of
    /// its nodes; the topology is discovered). On Redis 7 and later, releases are
    /// published with sharded `SPUBLISH` and waiters listen on the node of each
    /// channel's slot; on older servers with classic `PUBLISH`, which the cluster
    /// forwards to every node, heard on the first reachable node of `nodes` (see
    /// [`sharded_pubsub`](RedisBackendBuilder::sharded_pubsub)).
    #[cfg(feature = "cluster")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cluster")))]
    pub fn cluster<T: IntoConnectionInfo>(
        nodes: impl IntoIterator<Item = T>,
    ) -> RedisBackendBuilder {
        let nodes = nodes
            .into_iter()
            .map(IntoConnectionInfo::into_connection_info)
            .collect::<RedisResult<Vec<_>>>();
        Self::builder_with(Target::Cluster(nodes))
    }

    /// Configures a backend for the primary that the Sentinels at `sentinels` monitor as
    /// `master` (any subset of them; the first that answers is asked). The backend asks
    /// them again whenever its connection cannot serve any more — a timeout, a
    /// connection gone or refused, a write refused as `READONLY` — so it follows a
    /// failover without a restart: commands, the batcher, the watchdog and the pub/sub
    /// connection move to the new primary. A write refused as `NOREPLICAS` or
    /// `MASTERDOWN` makes it ask them too (at most every 200 ms), and move if they name
    /// another primary: one cut off from its replicas and from the Sentinels is not
    /// demoted while the cut lasts.
    ///
    /// Locks wait for [replica acknowledgement](RedisBackendBuilder::synced_replicas)
    /// by default here: one replica, within half the response timeout.
    ///
    /// The Sentinels' own password and TLS go in their URLs
    /// (`redis://:secret@sentinel-1:26379`); the primary's in
    /// [`sentinel_node`](RedisBackendBuilder::sentinel_node).
    ///
    /// ```no_run
    /// use tower_lock::RedisBackend;
    ///
    /// # async fn demo() -> Result<(), tower_lock::Error> {
    /// let backend = RedisBackend::sentinel(
    ///     "mymaster",
    ///     ["redis://10.0.0.1:26379", "redis://10.0.0.2:26379", "redis://10.0.0.3:26379"],
    /// )
    /// .build()
    /// .await?;
    /// # Ok(())
    /// # }
    /// ```
    #[cfg(feature = "sentinel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
    pub fn sentinel<T: IntoConnectionInfo>(
        master: impl Into<String>,
        sentinels: impl IntoIterator<Item = T>,
    ) -> RedisBackendBuilder {
        let sentinels = sentinels
            .into_iter()
            .map(IntoConnectionInfo::into_connection_info)
            .collect::<RedisResult<Vec<_>>>();
        Self::builder_with(Target::Sentinel {
            master: master.into(),
            sentinels,
        })
    }

    fn builder_with(target: Target) -> RedisBackendBuilder {
        RedisBackendBuilder {
            target,
            key_prefix: String::new(),
            waiter_timeout: DEFAULT_WAITER_TIMEOUT,
            response_timeout: DEFAULT_RESPONSE_TIMEOUT,
            connection_timeout: DEFAULT_CONNECTION_TIMEOUT,
            reconnect_retries: DEFAULT_RECONNECT_RETRIES,
            pubsub_keepalive: DEFAULT_PUBSUB_KEEPALIVE,
            lazy: false,
            synced: None,
            sharded_pubsub: ShardedPubSub::Auto,
            strict_replicas: false,
            token_retention: DEFAULT_TOKEN_RETENTION,
            #[cfg(feature = "sentinel")]
            sentinel_node: None,
        }
    }

    /// The Redis key of the lock named `key` (the prefix followed by the key).
    pub fn lock_name(&self, key: &LockKey) -> String {
        Names::lock(&self.inner.prefix, key).into_owned()
    }

    /// The channel releases of `key` are published on.
    pub fn channel_name(&self, key: &LockKey) -> String {
        Names::channel(&self.inner.prefix, key)
    }

    /// The key of `key`'s fencing counter (Redisson `RFencedLock`'s
    /// `redisson_lock_token:{NAME}`), which fenced locks keep.
    pub fn fence_name(&self, key: &LockKey) -> String {
        Names::fence(&self.inner.prefix, key)
    }

    /// The wait queue of `key`'s fair or read-write lock (a list of waiters in arrival
    /// order; their eviction times are in a sorted set beside it).
    pub fn queue_name(&self, key: &LockKey) -> String {
        Names::queue(&self.inner.prefix, key)
    }

    /// The sorted set of `key`'s permit holders (owner → end of lease, server time in
    /// ms).
    pub fn permits_name(&self, key: &LockKey) -> String {
        Names::permits(&self.inner.prefix, key)
    }

    /// The key of the record kept for replay under `key`'s lock
    /// ([`ReplayStore`]): `tower_lock_replay:{NAME}`, in the lock's hash slot.
    pub fn replay_name(&self, key: &LockKey) -> String {
        Names::replay(&self.inner.prefix, key)
    }

    /// How many replicas each write waits for now, with replica acknowledgement
    /// ([`RedisBackendBuilder::synced_replicas`]): the configured count when strict,
    /// else no more than the replicas the primary had at the last write or
    /// [`ping`](crate::LockClient::ping) (0 before the first on this primary: it reads
    /// the count, and waits for what it needs).
    /// `None` when writes wait for no replica.
    pub fn acknowledging_replicas(&self) -> Option<u32> {
        let epoch = self.inner.primary_moves();
        self.inner.synced.as_ref().map(|synced| synced.asked(epoch))
    }

    /// The configured waiter timeout; see [`RedisBackendBuilder::waiter_timeout`].
    pub fn waiter_timeout(&self) -> Duration {
        self.inner.waiter_timeout
    }

    /// Waiters registered for `key` in this process, in every mode (a diagnostic).
    pub fn local_waiters(&self, key: &LockKey) -> usize {
        let prefix = &self.inner.prefix;
        let shared = Names::channel(prefix, key);
        let owned = [
            [shared.as_str(), ":"].concat(),
            [Names::rw_channel(prefix, key).as_str(), ":"].concat(),
        ];
        self.inner.hub.waiters_where(|channel| {
            channel == shared || owned.iter().any(|p| channel.starts_with(p.as_str()))
        })
    }

    async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        self.inner.invoke(invocation).await
    }

    /// Runs `op` for `req` in a batch; behind Sentinel, a refusal that may mean the
    /// server is no longer the primary makes the backend ask the Sentinels (see
    /// [`SingleConn::after_refusal`]).
    async fn batched(&self, op: batch::Op, req: &LockRequest) -> Result<batch::OpReply> {
        let reply = batch::run(&self.inner, op, req).await;
        if let Err(error) = &reply
            && let Some(single) = self.inner.conn.single()
            && let Some(error) = redis_error_of(error)
        {
            single.after_refusal(error).await;
        }
        reply
    }

    async fn acquire_exclusive(&self, req: &LockRequest) -> Result<Acquire> {
        match self.batched(batch::Op::Acquire, req).await? {
            batch::OpReply::Acquire(acquire) => Ok(acquire),
            batch::OpReply::Release(_) => Err(Error::store(
                StoreErrorKind::Unexpected,
                "an acquisition was answered as a release",
            )),
        }
    }

    async fn release_exclusive(&self, req: &LockRequest) -> Result<Release> {
        match self.batched(batch::Op::Release, req).await? {
            batch::OpReply::Release(release) => Ok(release),
            batch::OpReply::Acquire(_) => Err(Error::store(
                StoreErrorKind::Unexpected,
                "a release was answered as an acquisition",
            )),
        }
    }

    /// Releases `req`'s hold and leaves its queue; returns whether it held the lock.
    async fn take_back(&self, req: &LockRequest) -> Result<bool> {
        let released = self.release(req).await;
        if queued(req.mode) {
            self.cancel_wait_mode(req).await?;
        }
        Ok(!matches!(released?, Release::NotHeld))
    }

    async fn inspect_state(&self, key: &LockKey, mode: LockMode) -> Result<LockState> {
        let prefix = &self.inner.prefix;
        let reply: Vec<String> = self
            .inner
            .read(
                self.inner
                    .publish
                    .scripts()
                    .inspect
                    .key(Names::lock(prefix, key).as_ref())
                    .key(Names::fence(prefix, key))
                    .key(Names::queue(prefix, key))
                    .key(Names::permits(prefix, key))
                    .key(Names::lease_prefix(prefix, key)),
            )
            .await?;
        let waiters = if !queued(mode) {
            // Nobody records these waiters in Redis: they sleep on the release channel.
            let channel = Names::channel(prefix, key);
            let here = self.inner.hub.waiters_where(|c| c == channel);
            Waiters::new(here, WaiterScope::Process)
        } else {
            Waiters::new(0, WaiterScope::Store)
        };
        parse_inspect(&reply, mode, waiters)
    }

    async fn force_release_exclusive(&self, key: &LockKey) -> Result<bool> {
        let prefix = &self.inner.prefix;
        let removed: i64 = self
            .invoke(
                self.inner
                    .publish
                    .scripts()
                    .force_release
                    .key(Names::lock(prefix, key).as_ref())
                    .key(Names::channel(prefix, key))
                    .key(Names::permits(prefix, key))
                    .arg(UNLOCK_MESSAGE),
            )
            .await?;
        Ok(removed == 1)
    }

    /// Indices of `reqs` that one renewal script may cover together: all of them on a
    /// single server; those of one hash slot on a cluster (a script's keys must share a
    /// slot there).
    fn renewal_groups(&self, reqs: &[LockRequest]) -> Vec<Vec<usize>> {
        match &self.inner.conn {
            Conn::Single(_) => vec![(0..reqs.len()).collect()],
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => {
                let mut groups: std::collections::HashMap<_, Vec<usize>> = Default::default();
                for (i, req) in reqs.iter().enumerate() {
                    let slot = redis::cluster_routing::Slot::for_key(
                        Names::lock(&self.inner.prefix, &req.key).as_bytes(),
                    );
                    groups.entry(slot).or_default().push(i);
                }
                groups.into_values().collect()
            }
        }
    }

    /// Renews `reqs` in as few script calls as the slots allow: `mixed` picks the script
    /// that renews holds of every mode, else all are exclusive or fair holds (the plain
    /// lock's hash and field), renewed by the lighter one.
    async fn renew_batch(&self, reqs: &[LockRequest], mixed: bool) -> Vec<Result<bool>> {
        let groups = self.renewal_groups(reqs);
        let batches: Vec<&[usize]> = groups
            .iter()
            .flat_map(|group| group.chunks(RENEW_CHUNK))
            .collect();
        // All batches are sent at once; the multiplexed connection pipelines them, so a
        // period costs one round trip per connection.
        let calls = batches.iter().map(|batch| async move {
            let invocation =
                renewal_script(self.inner.publish, &self.inner.prefix, reqs, batch, mixed);
            let reply: Result<Vec<i64>> = self.inner.write_strict(&invocation).await;
            reply
        });
        let replies = futures_util::future::join_all(calls).await;
        let mut out: Vec<Option<Result<bool>>> = (0..reqs.len()).map(|_| None).collect();
        for (batch, reply) in batches.iter().zip(replies) {
            match reply {
                Ok(flags) if flags.len() == batch.len() => {
                    for (&i, flag) in batch.iter().zip(flags) {
                        out[i] = Some(Ok(flag == 1));
                    }
                }
                Ok(flags) => {
                    for &i in *batch {
                        out[i] = Some(Err(unexpected("renew_many", &flags)));
                    }
                }
                Err(error) => {
                    for &i in *batch {
                        out[i] = Some(Err(error.duplicate()));
                    }
                }
            }
        }
        out.into_iter()
            .map(|r| {
                r.unwrap_or_else(|| {
                    Err(Error::store(StoreErrorKind::Unexpected, "renewal not sent"))
                })
            })
            .collect()
    }
}

/// The script call that renews the holds `batch` picks out of `reqs`: the one for every
/// mode when `mixed`, else the lighter one for plain (exclusive and fair) holds.
fn renewal_script(
    publish: Publish,
    prefix: &str,
    reqs: &[LockRequest],
    batch: &[usize],
    mixed: bool,
) -> redis::ScriptInvocation<'static> {
    if mixed {
        let mut invocation = publish.mode_scripts().renew_many_modes.prepare_invoke();
        for &i in batch {
            invocation
                .key(Names::lock(prefix, &reqs[i].key).as_ref())
                .key(modes::batch_companion(prefix, &reqs[i]));
        }
        for &i in batch {
            invocation.arg(modes::batch_tag(reqs[i].mode));
            invocation
                .arg(lease_ms(reqs[i].lease))
                .arg(reqs[i].hold_id.as_str());
        }
        invocation
    } else {
        let mut invocation = publish.scripts().renew_many.prepare_invoke();
        for &i in batch {
            invocation.key(Names::lock(prefix, &reqs[i].key).as_ref());
        }
        for &i in batch {
            invocation
                .arg(lease_ms(reqs[i].lease))
                .arg(reqs[i].hold_id.as_str());
        }
        invocation
    }
}

fn lease_ms(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// `PTTL` → remaining lease: -1 (no expiry) → `None`; -2 (gone) → zero.
fn ttl_of(pttl: i64) -> Option<Duration> {
    match pttl {
        -1 => None,
        ms => Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
    }
}

/// The error of an attempt the server refused because it arrived after its deadline
/// (`now_us`: the server's clock at the refusal, when the script said it).
fn arrived_late(now_us: Option<i64>) -> Error {
    let now_us = now_us
        .and_then(|t| u64::try_from(t).ok())
        .filter(|&t| t > 0);
    ArrivedLate::error("Redis", now_us)
}

/// `{1, holds}`, `{1, holds, token}`, `{0, ttl}` or `{-1, now}` (arrived late) → the
/// outcome.
fn parse_acquire(op: &str, reply: &[i64]) -> Result<Acquire> {
    let holds = |h: i64| u32::try_from(h).unwrap_or(u32::MAX);
    match reply {
        [-1] => Err(arrived_late(None)),
        [-1, now] => Err(arrived_late(Some(*now))),
        [1, h] => Ok(Acquire::Acquired(Grant::new(holds(*h), None))),
        [1, h, token] if *token > 0 => Ok(Acquire::Acquired(Grant::new(
            holds(*h),
            Some(FencingToken::new(token.unsigned_abs())),
        ))),
        [0, ttl] => Ok(Acquire::Busy { ttl: ttl_of(*ttl) }),
        other => Err(unexpected(op, other)),
    }
}

/// `inspect.lua`'s reply → the state. `waiters` is this process's count for modes the
/// store does not queue; for queued modes the queue's length replaces it.
fn parse_inspect(reply: &[String], mode: LockMode, mut waiters: Waiters) -> Result<LockState> {
    let bad = || {
        Error::store(
            StoreErrorKind::Unexpected,
            format!("inspect script answered {reply:?}"),
        )
    };
    let [fence, queued, rest @ ..] = reply else {
        return Err(bad());
    };
    if rest.len() % 5 != 0 {
        return Err(bad());
    }
    let fencing_token = match fence.as_str() {
        "" => None,
        n => Some(FencingToken::new(n.parse().map_err(|_| bad())?)),
    };
    if waiters.scope == WaiterScope::Store {
        waiters.count = queued.parse().map_err(|_| bad())?;
    }
    let mut holders = Vec::with_capacity(rest.len() / 5);
    for h in rest.chunks_exact(5) {
        let hold_id = HoldId::from_raw(&h[0]).map_err(|_| bad())?;
        let held = match h[1].as_str() {
            "r" => LockMode::Read,
            "w" => LockMode::Write,
            "p" => match mode {
                LockMode::Permits { .. } => mode,
                _ => LockMode::Permits {
                    max: std::num::NonZeroU32::MAX,
                },
            },
            _ if mode == LockMode::Fair => LockMode::Fair,
            _ => LockMode::Exclusive,
        };
        let holds: u32 = h[2].parse().map_err(|_| bad())?;
        let ttl = ttl_of(h[3].parse().map_err(|_| bad())?);
        let token = match h[4].as_str() {
            "" => None,
            n => Some(FencingToken::new(n.parse().map_err(|_| bad())?)),
        };
        holders.push(HoldInfo::new(hold_id, held, holds, ttl).with_token(token));
    }
    Ok(LockState::new(holders, waiters).with_fencing_token(fencing_token))
}

fn unexpected(op: &str, reply: &[i64]) -> Error {
    Error::store(
        StoreErrorKind::Unexpected,
        format!("{op} script answered {reply:?}"),
    )
}

/// redis-rs's error → the crate's: a key of another type is [`WrongType`], any
/// other failure a [`StoreError`] of its kind.
/// `error`, from connecting to `addr` (`host:port`, never with the password the URL may
/// carry), saying where: an operator reading "connection refused" at startup needs to
/// know which server refused.
fn naming_the_server(error: Error, addr: &str) -> Error {
    match error {
        Error::Store(store) => {
            let message = format!("cannot connect to Redis at {addr}: {}", store.message());
            Error::Store(store.with_message(message))
        }
        other => other,
    }
}

fn map_error(error: RedisError) -> Error {
    let wrong_type = error.code() == Some("WRONGTYPE")
        || error.detail().is_some_and(|d| d.contains("WRONGTYPE"))
        || error.to_string().contains("WRONGTYPE");
    if wrong_type {
        let message = format!("{WrongType}: {error}");
        Error::Store(
            StoreError::new(StoreErrorKind::Misconfigured, WrongType).with_message(message),
        )
    } else {
        Error::Store(store_error(error))
    }
}

/// The kind of a redis-rs error, with the error as the source. The server could not be
/// reached or did not answer (I/O, a dropped or refused connection, a timeout, a cluster
/// redirection or a cluster that is down, inside a script too), or refused the command
/// for now ([`REFUSED_FOR_NOW`]): unavailable; a connection that broke under the command
/// (not one that timed out) says so, for the lock core's retry. A reply redis-rs could
/// not parse or convert: unexpected. Anything else the server answered
/// (authentication, permissions, a script error): misconfigured; but a write refused by
/// a replica that was the primary (`READONLY`) is a connection to replace.
fn store_error(error: RedisError) -> StoreError {
    // The Sentinels named no primary: they are moving it (a failover), or cannot be
    // reached. An outage, as a primary that cannot be reached is; nothing was sent.
    #[cfg(feature = "sentinel")]
    if matches!(
        error.kind(),
        redis::ErrorKind::MasterNameNotFoundBySentinel
            | redis::ErrorKind::NoValidReplicasFoundBySentinel
    ) {
        return StoreError::not_applied(error).and_unanswered();
    }
    let unavailable = error.is_io_error()
        || error.is_connection_dropped()
        || error.is_connection_refusal()
        || error.is_timeout()
        || error.is_cluster_error()
        || cluster_refused_script(&error)
        || refused_for_now(&error);
    if unavailable {
        // Refused while connecting: nothing was written. redis-rs counts it as a
        // dropped connection too, and so does the lock core's retry at once.
        if error.is_connection_refusal() {
            return StoreError::not_applied(error)
                .and_connection_lost()
                .and_unanswered();
        }
        if error.is_connection_dropped() && !error.is_timeout() {
            return StoreError::connection_lost(error);
        }
        let unanswered = error.is_io_error() || error.is_timeout();
        let error = StoreError::new(StoreErrorKind::Unavailable, error);
        return if unanswered {
            error.and_unanswered()
        } else {
            error
        };
    }
    // A primary demoted to a replica (a Sentinel failover): the backend moves to the new
    // primary, and trying again at once goes there.
    if error.code() == Some("READONLY") {
        return StoreError::connection_lost(error);
    }
    let kind = match error.kind() {
        redis::ErrorKind::Parse | redis::ErrorKind::UnexpectedReturnType => {
            StoreErrorKind::Unexpected
        }
        _ => StoreErrorKind::Misconfigured,
    };
    StoreError::new(kind, error)
}

/// What a server answers while it cannot serve writes, for a while, whoever asks:
/// reading its data back after a restart, another client's script running too long,
/// too few replicas for `min-replicas-to-write`, memory full, a replica cut off from
/// its primary. Each is an outage (retried while waiting, an unlock tried again), not
/// a misconfiguration.
const REFUSED_FOR_NOW: [&str; 5] = ["LOADING", "BUSY", "NOREPLICAS", "OOM", "MASTERDOWN"];

/// Of [`REFUSED_FOR_NOW`], what a server answers when it may no longer be the primary:
/// one cut off from its replicas, which the Sentinels may have replaced by one of them
/// (`NOREPLICAS`), or a replica cut off from its primary (`MASTERDOWN`).
const PRIMARY_IN_DOUBT: [&str; 2] = ["NOREPLICAS", "MASTERDOWN"];

/// Whether the server refused the command, or a script's command, with one of
/// [`REFUSED_FOR_NOW`].
fn refused_for_now(error: &RedisError) -> bool {
    refused_with(error, &REFUSED_FOR_NOW)
}

/// Whether the server refused the command, or a script's command, with one of `codes`.
/// A refusal inside the batch script arrives as its text; one in a pipeline (a script
/// and its `WAIT`, with replica acknowledgement) among the pipeline's errors, where
/// redis-rs names the code only of the errors it knows.
fn refused_with(error: &RedisError, codes: &[&str]) -> bool {
    let names = |text: &str| {
        let word = text.trim_start_matches(['-', '"']);
        codes.iter().any(|code| {
            word.strip_prefix(code)
                .is_some_and(|rest| rest.starts_with([' ', '"', ':']))
        })
    };
    if error.code().is_some_and(|code| codes.contains(&code)) || error.detail().is_some_and(names) {
        return true;
    }
    error.clone().into_server_errors().is_some_and(|errors| {
        errors
            .iter()
            .any(|(_, e)| codes.contains(&e.code()) || e.details().is_some_and(names))
    })
}

/// The redis-rs error behind one of this crate's, if it has one.
fn redis_error_of(error: &Error) -> Option<&RedisError> {
    match error {
        Error::Store(store) => std::error::Error::source(store)?.downcast_ref(),
        _ => None,
    }
}

/// Whether Redis Cluster stopped a script at a command whose key is not served here
/// now ([`moved_away`]) or because the cluster is down. Every name of a lock shares its
/// slot, so neither says anything about the script: the slot is migrating, or the
/// cluster is failing over. The script may have written before it was stopped; the
/// lock core takes back what a failed attempt may have taken, as for any outage.
fn cluster_refused_script(error: &RedisError) -> bool {
    let said = |text: &str| moved_away(text) || text.contains("cluster is down");
    error.detail().is_some_and(said) || said(&error.to_string())
}

/// Whether `message` is Redis Cluster's refusal of a script's command on a key the node
/// does not serve now: in a migrating slot, a key missing from the source is the
/// target's, so a script that deletes a lock there cannot look at it again.
pub(super) fn moved_away(message: &str) -> bool {
    message.contains("non local key")
}

/// The Redis names of one lock. Built without `format!`: this is on every operation's
/// path, and with no key prefix the lock's own name is the key itself (no allocation).
struct Names;

/// A companion's name ([`Names::companion`]), written where it is needed — into a
/// command's buffer as it is encoded — without a string of its own.
#[derive(Clone, Copy)]
pub(super) struct Companion<'a> {
    kind: &'a str,
    prefix: &'a str,
    key: &'a LockKey,
}

impl Companion<'_> {
    fn tagged(&self) -> bool {
        self.prefix.contains('{') || self.key.as_str().contains('{')
    }

    fn len(&self) -> usize {
        let braces = if self.tagged() { 0 } else { 2 };
        self.kind.len() + 1 + braces + self.prefix.len() + self.key.as_str().len()
    }
}

impl fmt::Display for Companion<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (open, close) = if self.tagged() { ("", "") } else { ("{", "}") };
        write!(
            f,
            "{}:{open}{}{}{close}",
            self.kind,
            self.prefix,
            self.key.as_str()
        )
    }
}

impl redis::ToRedisArgs for Companion<'_> {
    /// Written in pieces, without the formatting machinery (on every release's path).
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let (open, close): (&[u8], &[u8]) = if self.tagged() {
            (b"", b"")
        } else {
            (b"{", b"}")
        };
        let mut arg = out.writer_for_next_arg();
        // Writing into the command's own buffer cannot fail.
        for piece in [
            self.kind.as_bytes(),
            b":",
            open,
            self.prefix.as_bytes(),
            self.key.as_str().as_bytes(),
            close,
        ] {
            let _ = arg.write_all(piece);
        }
    }
}

/// The lock hash's name ([`Names::lock`]), written into a command as it is encoded:
/// no string of its own, with a key prefix or without.
#[derive(Clone, Copy)]
pub(super) struct LockName<'a> {
    prefix: &'a str,
    key: &'a LockKey,
}

impl fmt::Display for LockName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.prefix, self.key.as_str())
    }
}

impl redis::ToRedisArgs for LockName<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        if self.prefix.is_empty() {
            out.write_arg(self.key.as_str().as_bytes());
        } else {
            let mut arg = out.writer_for_next_arg();
            // Writing into the command's own buffer cannot fail.
            let _ = arg.write_all(self.prefix.as_bytes());
            let _ = arg.write_all(self.key.as_str().as_bytes());
        }
    }
}

impl Names {
    /// The lock hash's name, as a [`LockName`] written in place.
    pub(super) fn lock_of<'a>(prefix: &'a str, key: &'a LockKey) -> LockName<'a> {
        LockName { prefix, key }
    }

    /// The release channel, as a [`Companion`] written in place.
    pub(super) fn channel_of<'a>(prefix: &'a str, key: &'a LockKey) -> Companion<'a> {
        Companion {
            kind: "redisson_lock__channel",
            prefix,
            key,
        }
    }

    /// The fencing counter, as a [`Companion`] written in place.
    pub(super) fn fence_of<'a>(prefix: &'a str, key: &'a LockKey) -> Companion<'a> {
        Companion {
            kind: "redisson_lock_token",
            prefix,
            key,
        }
    }

    /// The lock hash: the prefix followed by the key.
    fn lock<'a>(prefix: &str, key: &'a LockKey) -> Cow<'a, str> {
        if prefix.is_empty() {
            Cow::Borrowed(key.as_str())
        } else {
            Cow::Owned([prefix, key.as_str()].concat())
        }
    }

    /// A companion of the lock (its channel, its fencing counter): `<kind>:{NAME}`, or
    /// `<kind>:NAME` when NAME already has a hash tag — Redisson's naming, which keeps
    /// companions in the lock's cluster slot.
    fn companion(kind: &str, prefix: &str, key: &LockKey) -> String {
        let name = Companion { kind, prefix, key };
        let mut text = String::with_capacity(name.len());
        // Writing to a String cannot fail.
        let _ = fmt::Write::write_fmt(&mut text, format_args!("{name}"));
        text
    }

    fn channel(prefix: &str, key: &LockKey) -> String {
        Self::channel_of(prefix, key).to_string()
    }

    /// Where a client's name is registered: `tower_lock_client:<client uuid>`.
    fn client(prefix: &str, id: &str) -> String {
        [prefix, "tower_lock_client:", id].concat()
    }

    /// The fencing counter: Redisson `RFencedLock`'s.
    fn fence(prefix: &str, key: &LockKey) -> String {
        Self::fence_of(prefix, key).to_string()
    }

    /// The wait queue of fair and read-write locks (Redisson `RFairLock`'s list).
    fn queue(prefix: &str, key: &LockKey) -> String {
        Self::companion("redisson_lock_queue", prefix, key)
    }

    /// The waiters' eviction times (Redisson `RFairLock`'s sorted set).
    fn queue_timeouts(prefix: &str, key: &LockKey) -> String {
        Self::companion("redisson_lock_timeout", prefix, key)
    }

    /// The read-write lock's channel (Redisson `RReadWriteLock`'s); queued waiters
    /// listen on `<it>:<queue entry>`.
    fn rw_channel(prefix: &str, key: &LockKey) -> String {
        Self::companion("redisson_rwlock", prefix, key)
    }

    /// The holders of permits (owner → end of lease).
    fn permits(prefix: &str, key: &LockKey) -> String {
        Self::companion("tower_lock_permits", prefix, key)
    }

    /// The record kept for replay under the lock ([`ReplayStore`]).
    fn replay(prefix: &str, key: &LockKey) -> String {
        Self::companion("tower_lock_replay", prefix, key)
    }

    /// The prefix of read holds' lease keys, `<it>:<owner>:rwlock_timeout:<i>`: Redisson's
    /// `suffixName` rule, `{NAME}` or NAME itself when it has a hash tag.
    fn lease_prefix(prefix: &str, key: &LockKey) -> String {
        let name = Self::lock(prefix, key);
        if name.contains('{') {
            name.into_owned()
        } else {
            ["{", name.as_ref(), "}"].concat()
        }
    }

    /// A read-write waiter's place in the queue: `<hold id>:read` or `<hold id>:write`.
    fn queue_entry(hold_id: &HoldId, mode: LockMode) -> String {
        let suffix = if mode == LockMode::Read {
            ":read"
        } else {
            ":write"
        };
        [hold_id.as_str(), suffix].concat()
    }

    /// The channel a waiter of `req` listens on: the lock's channel for exclusive locks
    /// and permits (a release wakes one waiter), the owner's own channel for queued
    /// modes (a release wakes exactly the waiters the queue lets go).
    fn wait_channel(prefix: &str, req: &LockRequest) -> String {
        match req.mode {
            LockMode::Fair => [
                Self::channel(prefix, &req.key).as_str(),
                ":",
                req.hold_id.as_str(),
            ]
            .concat(),
            LockMode::Read | LockMode::Write => [
                Self::rw_channel(prefix, &req.key).as_str(),
                ":",
                Self::queue_entry(&req.hold_id, req.mode).as_str(),
            ]
            .concat(),
            _ => Self::channel(prefix, &req.key),
        }
    }
}

impl RedisBackendBuilder {
    /// A namespace in front of every Redis key of the backend, joined to the lock's name
    /// with `:` as every prefix of the crate is: `key_prefix("myapp")` gives
    /// `myapp:NAME` (and `redisson_lock__channel:{myapp:NAME}` for its channel). Default:
    /// none, so names match Redisson's exactly. A [`Namespace`](crate::Namespace): at
    /// most [`MAX_NAMESPACE_LEN`](crate::MAX_NAMESPACE_LEN) bytes, segments joined by
    /// single `:`s without one at either end (the joining `:` is added), no braces or
    /// control characters; [`build`](Self::build) names `key_prefix` otherwise. (Up to
    /// 0.1, the prefix was prepended as is and was written `"myapp:"`; write `"myapp"`
    /// for the same keys.)
    pub fn key_prefix(mut self, prefix: impl Into<String>) -> Self {
        self.key_prefix = prefix.into();
        self
    }

    /// How long a queued waiter of a fair or read-write lock may go without polling
    /// before it loses its place (Redisson's `threadWaitTime`, which defaults to 5
    /// minutes there). Default [`DEFAULT_WAITER_TIMEOUT`] (5 s); at least
    /// [`MIN_WAITER_TIMEOUT`]. Live waiters poll every third of it, so a shorter timeout
    /// skips vanished waiters sooner at the cost of more polls. Backends sharing a
    /// queue may use different timeouts: each waiter carries its own.
    pub fn waiter_timeout(mut self, timeout: Duration) -> Self {
        self.waiter_timeout = timeout;
        self
    }

    /// Per-command response timeout (default [`DEFAULT_RESPONSE_TIMEOUT`]).
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Connection timeout (default [`DEFAULT_CONNECTION_TIMEOUT`]).
    pub fn connection_timeout(mut self, timeout: Duration) -> Self {
        self.connection_timeout = timeout;
        self
    }

    /// How often the shared pub/sub connection is checked with a `PING` (default
    /// [`DEFAULT_PUBSUB_KEEPALIVE`]); one unanswered for half of it is replaced. Between
    /// 10 ms and 1 hour.
    pub fn pubsub_keepalive(mut self, every: Duration) -> Self {
        self.pubsub_keepalive = every;
        self
    }

    /// Reconnection attempts per failed command (default [`DEFAULT_RECONNECT_RETRIES`]).
    pub fn reconnect_retries(mut self, retries: usize) -> Self {
        self.reconnect_retries = retries;
        self
    }

    /// Connect on first use instead of in [`build`](Self::build) (default: `false`,
    /// so an application learns at start that its Redis is unreachable). A lazy backend
    /// builds while its server is down, and every call fails with a connection error
    /// until the server is back: what a [`RedLock`](crate::backend::redlock::RedLock) node needs,
    /// where a node that is down is a failed vote, not a failed client. Not for clusters
    /// (feature `cluster`), whose topology is discovered when connecting.
    pub fn lazy_connect(mut self, lazy: bool) -> Self {
        self.lazy = lazy;
        self
    }

    /// Replica acknowledgement, as Redisson's synced eval: every acquisition, renewal
    /// and release is followed, in the same write on the same connection, by `WAIT`
    /// for the replicas the primary has, at most `replicas` of them, within `timeout`.
    /// An acquisition or renewal that fewer replicas acknowledged in time fails as an
    /// outage (retryable): the lock core gives the attempt up, which releases the
    /// grant, and the watchdog counts the renewal as failed. A release is waited for,
    /// not failed (one lost in a failover leaves the hold until its lease ends, never a
    /// second holder). A batch of grouped operations waits once. On a cluster the
    /// `WAIT` goes with the script to the master of its slot. `replicas` 0 turns it
    /// off.
    ///
    /// The count follows the deployment, as Redisson's does: a write waits for
    /// `min(replicas, the replicas the primary has)`, read with `ROLE` after every
    /// write (online replicas; one still taking its first copy is not counted). A
    /// primary with no replica cannot lose a grant to a promotion, and a replica that
    /// connects takes a whole copy first; so after a failover to the last replica, or
    /// while a replica is down, locks go on instead of failing until a replica is back.
    /// Behind Sentinel a primary short of replicas counts on the ones it has only while
    /// the Sentinels name it the primary (asked at most every second, and whenever its
    /// count changes): one that lost its replicas to a failover while it was paused or
    /// cut off must not grant what its successor grants. A replica that is connected
    /// but does not acknowledge (stalled, cut off) still fails writes until the primary
    /// drops it. On a cluster the count is strict: a master back from such a failover
    /// cannot be told from one whose replicas are down.
    /// [`strict_replicas`](Self::strict_replicas) waits for `replicas` whatever the
    /// primary has; see [`RedisBackend::acknowledging_replicas`] for the count in force.
    ///
    /// Default: off for a single server and a cluster; 1 replica within half the
    /// response timeout behind [Sentinel](RedisBackend::sentinel).
    ///
    /// What it promises: a grant the client was told about had reached every replica
    /// the primary had (up to `replicas`), so a failover that promotes one of them
    /// keeps it. What it does not: replication stays asynchronous and `WAIT` is not
    /// consensus — a failover may promote a replica that had not acknowledged, and a
    /// write the primary applied but failed to replicate in time stays on the primary
    /// until the release undoes it. Fencing tokens remain the protection a store that
    /// must never take a stale write should use.
    pub fn synced_replicas(mut self, replicas: u32, timeout: Duration) -> Self {
        self.synced = Some(SyncedConfig { replicas, timeout });
        self
    }

    /// How long a fencing counter (`redisson_lock_token:{NAME}`) outlives the last
    /// token it gave: [`DEFAULT_TOKEN_RETENTION`] by default. Each fenced acquisition
    /// gives the counter an expiry: this long after the server's clock reaches the
    /// token (tokens are at least the clock in microseconds). Once the counter is gone
    /// the clock is past every token it gave, and the next counter starts from the
    /// clock, above them all: tokens never go backwards, unless the server's clock
    /// steps back by more than the retention after the counter expired (the same
    /// clock runs the expiry, so a step before it only delays it). A name locked once,
    /// fenced, leaves nothing in Redis after it.
    ///
    /// A Redisson `RFencedLock` sharing the name `INCR`s the counter without the clock:
    /// after an idle spell of the retention its tokens start again from 1, as after a
    /// Redis restart without persistence. At least 1 s.
    pub fn token_retention(mut self, retention: Duration) -> Self {
        self.token_retention = retention;
        self
    }

    /// With replica acknowledgement, wait for the configured count of replicas
    /// whatever the primary has: a primary with fewer fails every grant and renewal as
    /// an outage until enough replicas are back. Default: `false` (the count follows
    /// the replicas the primary has; see [`synced_replicas`](Self::synced_replicas)).
    pub fn strict_replicas(mut self, strict: bool) -> Self {
        self.strict_replicas = strict;
        self
    }

    /// Whether a cluster publishes releases and listens for them with sharded pub/sub
    /// (see [`ShardedPubSub`]). Default: [`ShardedPubSub::Auto`], sharded on Redis 7
    /// and later, as Redisson does. Only a [cluster](RedisBackend::cluster) has shards:
    /// [`ShardedPubSub::On`] for any other target is refused at build.
    pub fn sharded_pubsub(mut self, mode: ShardedPubSub) -> Self {
        self.sharded_pubsub = mode;
        self
    }

    /// How to reach the primary the Sentinels name: its password, user, database and
    /// TLS (redis-rs's [`SentinelNodeConnectionInfo`](redis::sentinel::SentinelNodeConnectionInfo)).
    /// Default: no password, database 0, no TLS.
    #[cfg(feature = "sentinel")]
    #[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
    pub fn sentinel_node(mut self, node: redis::sentinel::SentinelNodeConnectionInfo) -> Self {
        self.sentinel_node = Some(node);
        self
    }

    /// Validates the settings, connects, and starts the pub/sub task.
    ///
    /// # Errors
    ///
    /// [`SetupError::Config`] naming the bad setting; [`SetupError::Store`] when the URL
    /// is invalid or (unless [lazy](Self::lazy_connect)) the server cannot be reached
    /// (see [`RedisBackend::connect`]).
    pub async fn build(mut self) -> Result<RedisBackend, SetupError> {
        self.validate()?;
        // From here on the prefix is as keys start with it: the segments and the `:`
        // that joins them to the lock's name (`myapp` → `myapp:NAME`).
        if !self.key_prefix.is_empty() {
            self.key_prefix.push(':');
        }
        let Connected {
            conn,
            pubsub,
            publish,
            store_id,
        } = self.connect().await?;
        let synced = self.synced();
        let shutdown = CancellationToken::new();
        let hub = pubsub::Hub::start(pubsub, self.pubsub_keepalive, shutdown.clone());
        let backend = RedisBackend {
            inner: Arc::new(Inner {
                conn,
                profile: StoreProfile::new("redis")
                    .with_store_id(store_id)
                    .with_queued_modes(QUEUED_MODES),
                prefix: self.key_prefix,
                hub,
                waiter_timeout: self.waiter_timeout,
                batcher: batch::Batcher::default(),
                clock: StoreClock::default(),
                attempt_window: self.response_timeout,
                synced,
                publish,
                token_retention: lease_ms(self.token_retention).to_string(),
                _stop_hub: shutdown.clone().drop_guard(),
            }),
        };
        #[cfg(feature = "sentinel")]
        if let Some(single) = backend.inner.conn.single()
            && let Some((master, nodes)) = single.primary.sentinels()
        {
            switches::watch(Arc::downgrade(&backend.inner), master, nodes, shutdown);
        }
        Ok(backend)
    }

    /// Replica acknowledgement as configured, or the target's default: one replica
    /// within half the response timeout behind Sentinel, none elsewhere.
    fn synced(&self) -> Option<Synced> {
        let configured = match self.synced {
            Some(synced) => Some(synced),
            #[cfg(feature = "sentinel")]
            None if matches!(self.target, Target::Sentinel { .. }) => Some(SyncedConfig {
                replicas: 1,
                timeout: self.response_timeout / 2,
            }),
            None => None,
        };
        configured.filter(|s| s.replicas > 0).map(|s| {
            Synced::new(
                s.replicas,
                s.timeout,
                self.strict_replicas || self.is_cluster(),
            )
        })
    }

    fn is_cluster(&self) -> bool {
        #[cfg(feature = "cluster")]
        if matches!(self.target, Target::Cluster(_)) {
            return true;
        }
        false
    }

    /// Checks every setting but the target, in the order of their errors.
    fn validate(&self) -> Result<()> {
        if self.token_retention < Duration::from_secs(1) || self.token_retention > crate::MAX_LEASE
        {
            return Err(Error::invalid_config(
                "token_retention",
                format!(
                    "must be between 1 s and 365 days (got {:?})",
                    self.token_retention
                ),
            ));
        }
        if let Some(synced) = self.synced
            && synced.replicas > 0
            && (synced.timeout.is_zero() || synced.timeout >= self.response_timeout)
        {
            return Err(Error::invalid_config(
                "synced_replicas",
                format!(
                    "timeout must be above zero and below the response timeout of {:?}, which bounds the write and its WAIT together (got {:?})",
                    self.response_timeout, synced.timeout
                ),
            ));
        }
        if self.sharded_pubsub == ShardedPubSub::On && !self.is_cluster() {
            return Err(Error::invalid_config(
                "sharded_pubsub",
                "is for a cluster, the only target with shards (got On)",
            ));
        }
        crate::namespace::Namespace::for_setting("key_prefix", self.key_prefix.clone())?;
        for (name, value) in [
            ("response_timeout", self.response_timeout),
            ("connection_timeout", self.connection_timeout),
        ] {
            if value.is_zero() {
                return Err(Error::invalid_config(
                    name,
                    "must be greater than zero (got 0)",
                ));
            }
        }
        crate::backend::limits::validate_waiter_timeout(self.waiter_timeout)?;
        if self.pubsub_keepalive < Duration::from_millis(10)
            || self.pubsub_keepalive > Duration::from_secs(3600)
        {
            return Err(Error::invalid_config(
                "pubsub_keepalive",
                format!(
                    "must be between 10 ms and 1 hour (got {:?})",
                    self.pubsub_keepalive
                ),
            ));
        }
        Ok(())
    }

    /// Connects to the target (unless lazy, for a single server).
    async fn connect(&self) -> Result<Connected> {
        match &self.target {
            Target::Single(client) => {
                let client = client.clone().map_err(map_error)?;
                let info = client.get_connection_info();
                let store_id = format!(
                    "redis:{}/{}:{}",
                    info.addr(),
                    info.redis_settings().db(),
                    self.key_prefix
                );
                self.connect_single(Primary::Fixed(client), store_id).await
            }
            Target::Invalid(reason) => {
                Err(Error::store(StoreErrorKind::Misconfigured, reason.clone()))
            }
            #[cfg(feature = "cluster")]
            Target::Cluster(nodes) => self.connect_cluster(nodes).await,
            #[cfg(feature = "sentinel")]
            Target::Sentinel { master, sentinels } => {
                self.connect_sentinel(master, sentinels).await
            }
        }
    }

    /// Connects to `primary` (unless lazy).
    async fn connect_single(&self, primary: Primary, store_id: String) -> Result<Connected> {
        let config = ConnectionManagerConfig::new()
            .set_response_timeout(Some(self.response_timeout))
            .set_connection_timeout(Some(self.connection_timeout))
            .set_number_of_retries(self.reconnect_retries)
            .set_min_delay(Duration::from_millis(50));
        let client = tokio::time::timeout(self.connection_timeout, primary.client())
            .await
            .map_err(|_| {
                Error::store(
                    StoreErrorKind::Unavailable,
                    "finding the Redis primary timed out",
                )
            })?
            .map_err(map_error)?;
        let addr = client.get_connection_info().addr().to_string();
        let conn = if self.lazy {
            ConnectionManager::new_lazy_with_config(client, config.clone()).map_err(map_error)?
        } else {
            ConnectionManager::new_with_config(client, config.clone())
                .await
                .map_err(|e| naming_the_server(map_error(e), &addr))?
        };
        Ok(Connected {
            conn: Conn::Single(Box::new(SingleConn::new(
                primary.clone(),
                config,
                self.connection_timeout,
                (conn, addr),
            ))),
            pubsub: pubsub::Source::Nodes(vec![primary]),
            publish: Publish::Classic,
            store_id,
        })
    }

    /// Connects to the primary the Sentinels name (it must be found now, also when
    /// lazy).
    #[cfg(feature = "sentinel")]
    async fn connect_sentinel(
        &self,
        master: &str,
        sentinels: &RedisResult<Vec<redis::ConnectionInfo>>,
    ) -> Result<Connected> {
        let sentinels = sentinels.clone().map_err(map_error)?;
        if sentinels.is_empty() {
            return Err(Error::invalid_config(
                "sentinels",
                "must name at least one Sentinel (got none)",
            ));
        }
        let mut addrs: Vec<String> = sentinels.iter().map(|i| i.addr().to_string()).collect();
        addrs.sort();
        // (The database the node info names is not readable here; two backends on one
        // primary's different databases share the id, which only orders MultiLocks.)
        let store_id = format!(
            "redis-sentinel:{master}@{}:{}",
            addrs.join(","),
            self.key_prefix
        );
        let client = redis::sentinel::SentinelClient::build(
            sentinels.clone(),
            String::from(master),
            self.sentinel_node.clone(),
            redis::sentinel::SentinelServerType::Master,
        )
        .map_err(map_error)?;
        let primary = Primary::Sentinel(Arc::new(primary::Sentinels::new(
            client,
            String::from(master),
            sentinels,
        )));
        self.connect_single(primary, store_id).await
    }

    #[cfg(feature = "cluster")]
    async fn connect_cluster(
        &self,
        nodes: &RedisResult<Vec<redis::ConnectionInfo>>,
    ) -> Result<Connected> {
        if self.lazy {
            return Err(Error::invalid_config(
                "lazy_connect",
                "is not supported for a cluster, which connects to discover its topology (got true)",
            ));
        }
        let nodes = nodes.clone().map_err(map_error)?;
        if nodes.is_empty() {
            return Err(Error::invalid_config(
                "cluster nodes",
                "must name at least one node (got none)",
            ));
        }
        let pubsub_nodes = nodes
            .iter()
            .cloned()
            .map(Client::open)
            .collect::<RedisResult<Vec<_>>>()
            .map_err(map_error)?;
        let client = redis::cluster::ClusterClient::builder(nodes.clone())
            .response_timeout(self.response_timeout)
            .connection_timeout(self.connection_timeout)
            .retries(u32::try_from(self.reconnect_retries).unwrap_or(u32::MAX))
            .build()
            .map_err(map_error)?;
        let mut addrs: Vec<String> = pubsub_nodes
            .iter()
            .map(|c| c.get_connection_info().addr().to_string())
            .collect();
        addrs.sort();
        let conn = client
            .get_async_connection()
            .await
            .map_err(|e| naming_the_server(map_error(e), &addrs.join(",")))?;
        let store_id = format!("redis-cluster:{}:{}", addrs.join(","), self.key_prefix);
        let mut conn = conn;
        let sharded = match self.sharded_pubsub {
            ShardedPubSub::On => true,
            ShardedPubSub::Off => false,
            // Redisson's test: every node knows the sharded pub/sub commands.
            ShardedPubSub::Auto => redis::cmd("PUBSUB")
                .arg("SHARDNUMSUB")
                .query_async::<redis::Value>(&mut conn)
                .await
                .is_ok(),
        };
        let (pubsub, publish) = if sharded {
            let source = pubsub::Source::Sharded {
                nodes,
                response_timeout: self.response_timeout,
                connection_timeout: self.connection_timeout,
            };
            (source, Publish::Sharded)
        } else {
            let nodes = pubsub_nodes.into_iter().map(Primary::Fixed).collect();
            (pubsub::Source::Nodes(nodes), Publish::Classic)
        };
        Ok(Connected {
            conn: Conn::Cluster(Box::new(conn)),
            pubsub,
            publish,
            store_id,
        })
    }
}

/// What [`RedisBackendBuilder::build`] connected: the command connection, where the
/// pub/sub connection listens, how releases are published, and the store's identity.
struct Connected {
    conn: Conn,
    pubsub: pubsub::Source,
    publish: Publish,
    store_id: String,
}

impl LockBackend for RedisBackend {
    fn profile(&self) -> &StoreProfile {
        &self.inner.profile
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move {
            let acquired = match req.mode {
                LockMode::Exclusive => self.acquire_exclusive(req).await,
                _ => self.acquire_mode(req).await,
            };
            if let Err(error) = &acquired {
                self.inner.sample_refusal(&req.key, error);
            }
            acquired
        })
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            if !plain_hash(req.mode) {
                return self.renew_mode(req).await;
            }
            let renewed: i64 = self
                .inner
                .write_strict(
                    self.inner
                        .publish
                        .scripts()
                        .renew
                        .key(Names::lock(&self.inner.prefix, &req.key).as_ref())
                        .arg(lease_ms(req.lease))
                        .arg(req.hold_id.as_str()),
                )
                .await?;
            Ok(renewed == 1)
        })
    }

    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            let mixed = !reqs.iter().all(|r| plain_hash(r.mode));
            self.renew_batch(reqs, mixed).await
        })
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move {
            match req.mode {
                LockMode::Exclusive => self.release_exclusive(req).await,
                _ => self.release_mode(req).await,
            }
        })
    }

    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        // Queued modes keep their order in the store; the others wait on the lock's
        // shared channel. The atomic check keeps the uncontended path free of names.
        !queued(req.mode)
            && self.inner.hub.anyone_waits()
            && self
                .inner
                .hub
                .waiters(&Names::channel(&self.inner.prefix, &req.key))
                > 0
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            let channel = Names::wait_channel(&self.inner.prefix, req);
            Ok(self.inner.hub.subscribe(channel).await)
        })
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.cancel_wait_mode(req))
    }

    /// Releases and dequeues the owner at once; then, unless that found its hold (the
    /// attempt had landed), once more when the attempt's deadline has passed on the
    /// server. An attempt still on its way — over a connection that was cut or replaced
    /// meanwhile, which a release over the new one can overtake — is refused by then,
    /// or has landed and is undone. What is left if the second pass cannot reach Redis
    /// either: a hold until its lease ends, a queue place until the waiter timeout.
    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if let Ok(true) = self.take_back(req).await {
                return Ok(());
            }
            tokio::time::sleep(self.inner.attempt_window + COMPENSATION_MARGIN).await;
            self.take_back(req).await.map(|_| ())
        })
    }

    /// Records beside the exclusive locks; see `replay.rs`.
    fn replays(&self) -> Option<&dyn ReplayStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn StoreAdmin> {
        Some(self)
    }
}

impl StoreAdmin for RedisBackend {
    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            match mode {
                LockMode::Exclusive => self.force_release_exclusive(key).await,
                _ => self.force_release_mode(key, mode).await,
            }
        })
    }

    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.inspect_state(key, mode))
    }

    fn clients(&self) -> Option<&dyn ClientNames> {
        Some(self)
    }

    /// `PING`, on the connection lock calls use; with replica acknowledgement `ROLE`
    /// instead, which also reads how many replicas the primary has now (see
    /// [`RedisBackend::acknowledging_replicas`]).
    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let Some(synced) = &self.inner.synced else {
                return self.inner.query::<()>(&redis::cmd("PING")).await;
            };
            let epoch = self.inner.primary_moves();
            let role: redis::Value = self.inner.query(&redis::cmd("ROLE")).await?;
            if let Some(connected) = replicas_of_role(&role) {
                synced.now_connected(epoch, connected);
            }
            Ok(())
        })
    }
}

/// Names live at `<prefix>client:<id>`, a string key with a TTL.
impl ClientNames for RedisBackend {
    fn register<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("SET");
            cmd.arg(Names::client(&self.inner.prefix, id))
                .arg(name)
                .arg("PX")
                .arg(lease_ms(ttl));
            self.inner.query::<()>(&cmd).await
        })
    }

    fn names<'a>(&'a self, ids: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<Option<String>>>> {
        Box::pin(async move {
            let mut names = Vec::with_capacity(ids.len());
            // One GET each: on a cluster the names live in different slots.
            for id in ids {
                let mut cmd = redis::cmd("GET");
                cmd.arg(Names::client(&self.inner.prefix, id));
                names.push(self.inner.query::<Option<String>>(&cmd).await?);
            }
            Ok(names)
        })
    }

    fn unregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("DEL");
            cmd.arg(Names::client(&self.inner.prefix, id));
            self.inner.query::<()>(&cmd).await
        })
    }
}

/// Modes held as a plain `RLock` hash field (exclusive and fair), renewed alike.
fn plain_hash(mode: LockMode) -> bool {
    matches!(mode, LockMode::Exclusive | LockMode::Fair)
}

impl fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisBackend")
            .field("prefix", &self.inner.prefix)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A batch operation's refusal, as `lock_batch.lua` returns its text.
    fn in_batch(message: &str) -> RedisError {
        RedisError::from((
            redis::ErrorKind::Extension,
            "lock script error",
            message.to_owned(),
        ))
    }

    #[test]
    fn refusals_for_now_are_outages_and_nothing_like_them_is() {
        for message in [
            "NOREPLICAS Not enough good replicas to write. script: 89, on @user_script:43.",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "\"BUSY\": Redis is busy running a script.",
            "MASTERDOWN Link with MASTER is down",
            "LOADING Redis is loading the dataset in memory",
        ] {
            let kind = store_error(in_batch(message)).kind();
            assert_eq!(kind, StoreErrorKind::Unavailable, "{message}");
        }
        for message in [
            "BUSYGROUP Consumer Group name already exists",
            "ERR OOM in the middle",
            "NOPERM this user has no permissions",
            "user_script:1: Script attempted to access nonexistent global variable",
        ] {
            let kind = store_error(in_batch(message)).kind();
            assert_eq!(kind, StoreErrorKind::Misconfigured, "{message}");
        }
    }

    /// Issue 44, finding 3: the Sentinels naming no primary while they move it was a
    /// misconfiguration (the layer answered 500, releases were given up). It is an
    /// outage, and nothing was sent.
    #[cfg(feature = "sentinel")]
    #[test]
    fn sentinels_naming_no_primary_is_an_outage() {
        for kind in [
            redis::ErrorKind::MasterNameNotFoundBySentinel,
            redis::ErrorKind::NoValidReplicasFoundBySentinel,
        ] {
            let error = store_error(RedisError::from((kind, "no primary now")));
            assert_eq!(error.kind(), StoreErrorKind::Unavailable, "{kind:?}");
            assert!(error.is_not_applied(), "{kind:?}");
        }
    }

    /// The replicas `ROLE` lists, asked of a primary; nothing for a replica's answer.
    #[test]
    fn a_primarys_role_lists_its_replicas() {
        use redis::Value;
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let replica = Value::Array(vec![bulk("127.0.0.1"), bulk("6380"), bulk("42")]);
        let primary = |replicas: Vec<Value>| {
            Value::Array(vec![bulk("master"), Value::Int(42), Value::Array(replicas)])
        };
        assert_eq!(replicas_of_role(&primary(vec![])), Some(0));
        assert_eq!(
            replicas_of_role(&primary(vec![replica.clone(), replica])),
            Some(2)
        );
        let of_a_replica = Value::Array(vec![
            bulk("slave"),
            bulk("127.0.0.1"),
            Value::Int(6379),
            bulk("connected"),
            Value::Int(42),
        ]);
        assert_eq!(replicas_of_role(&of_a_replica), None);
    }

    /// What makes a backend behind Sentinel ask where the primary is, found behind
    /// this crate's error as the batch path sees it: only the two refusals of a server
    /// that may no longer be the primary.
    #[test]
    fn a_primary_in_doubt_is_found_behind_the_crates_error() {
        let in_doubt = |message: &str| {
            let error = map_error(in_batch(message));
            redis_error_of(&error).is_some_and(|e| refused_with(e, &PRIMARY_IN_DOUBT))
        };
        assert!(in_doubt(
            "\"NOREPLICAS\": Not enough good replicas to write."
        ));
        assert!(in_doubt("MASTERDOWN Link with MASTER is down"));
        for message in [
            "LOADING Redis is loading the dataset in memory",
            "OOM command not allowed when used memory > 'maxmemory'.",
            "ERR NOREPLICAS in the middle",
        ] {
            assert!(!in_doubt(message), "{message}");
        }
        let wrong = Error::Store(StoreError::new(StoreErrorKind::Misconfigured, WrongType));
        assert!(redis_error_of(&wrong).is_none());
    }

    /// Issue 49: no lock key can be another lock's companion key. Every companion the
    /// backend names begins with one of the reserved prefixes, and no key or
    /// namespace may.
    #[test]
    fn every_companion_name_is_reserved() {
        let key = LockKey::new("anyLock").unwrap();
        let companions = [
            Names::channel("", &key),
            Names::fence("", &key),
            Names::replay("", &key),
            Names::queue("", &key),
            Names::queue_timeouts("", &key),
            Names::rw_channel("", &key),
            Names::permits("", &key),
            Names::client("", "id"),
        ];
        for name in &companions {
            assert!(
                crate::RESERVED_PREFIXES.iter().any(|p| name.starts_with(p)),
                "{name}"
            );
            assert!(LockKey::new(name).is_err(), "{name} taken as a lock key");
        }
        for prefix in crate::RESERVED_PREFIXES {
            let namespace = prefix.trim_end_matches(':');
            assert!(LockKey::namespaced(namespace, "x").is_err(), "{namespace}");
            assert!(crate::Namespace::new(namespace).is_err(), "{namespace}");
        }
        assert!(
            LockKey::new("redisson_lock").is_ok(),
            "only the companions' forms"
        );
        assert!(LockKey::new(crate::backend::PING_KEY).is_ok());
    }

    #[test]
    fn names_follow_redisson() {
        let key = LockKey::new("anyLock").unwrap();
        assert_eq!(Names::lock("", &key), "anyLock");
        assert_eq!(Names::channel("", &key), "redisson_lock__channel:{anyLock}");
        assert_eq!(Names::fence("", &key), "redisson_lock_token:{anyLock}");
        assert_eq!(Names::replay("", &key), "tower_lock_replay:{anyLock}");

        assert_eq!(Names::queue("", &key), "redisson_lock_queue:{anyLock}");
        assert_eq!(
            Names::queue_timeouts("", &key),
            "redisson_lock_timeout:{anyLock}"
        );
        assert_eq!(Names::rw_channel("", &key), "redisson_rwlock:{anyLock}");
        assert_eq!(Names::lease_prefix("", &key), "{anyLock}");
        let owner = HoldId::from_raw("uuid:1").unwrap();
        let wait = |mode| {
            Names::wait_channel(
                "",
                &LockRequest::new(key.clone(), owner.clone(), mode, Duration::from_secs(1)),
            )
        };
        assert_eq!(
            wait(LockMode::Exclusive),
            "redisson_lock__channel:{anyLock}"
        );
        assert_eq!(
            wait(LockMode::Fair),
            "redisson_lock__channel:{anyLock}:uuid:1"
        );
        assert_eq!(
            wait(LockMode::Read),
            "redisson_rwlock:{anyLock}:uuid:1:read"
        );
        assert_eq!(
            wait(LockMode::Write),
            "redisson_rwlock:{anyLock}:uuid:1:write"
        );

        let key = LockKey::namespaced("lock:order", "42").unwrap();
        assert_eq!(Names::lock("app:", &key), "app:lock:order:{42}");
        assert_eq!(Names::lease_prefix("app:", &key), "app:lock:order:{42}");
        assert_eq!(
            Names::channel("app:", &key),
            "redisson_lock__channel:app:lock:order:{42}"
        );
        assert_eq!(
            Names::fence("app:", &key),
            "redisson_lock_token:app:lock:order:{42}"
        );
        assert_eq!(
            Names::replay("app:", &key),
            "tower_lock_replay:app:lock:order:{42}"
        );
    }

    #[test]
    fn names_written_in_place_are_the_names() {
        let packed = |arg: &dyn Fn(&mut redis::Cmd)| {
            let mut cmd = redis::cmd("X");
            arg(&mut cmd);
            cmd.get_packed_command()
        };
        for key in ["anyLock", "lock:order:{42}", "é:{ü}"] {
            for prefix in ["", "app:", "a{b}:"] {
                let key = LockKey::new(key).unwrap();
                assert_eq!(
                    packed(&|c| {
                        c.arg(Names::lock_of(prefix, &key));
                    }),
                    packed(&|c| {
                        c.arg(Names::lock(prefix, &key).as_ref());
                    }),
                    "{prefix}{key} lock"
                );
                assert_eq!(
                    packed(&|c| {
                        c.arg(Names::channel_of(prefix, &key));
                    }),
                    packed(&|c| {
                        c.arg(Names::channel(prefix, &key));
                    }),
                    "{prefix}{key} channel"
                );
                assert_eq!(
                    packed(&|c| {
                        c.arg(Names::fence_of(prefix, &key));
                    }),
                    packed(&|c| {
                        c.arg(Names::fence(prefix, &key));
                    }),
                    "{prefix}{key} fence"
                );
            }
        }
    }

    #[cfg(feature = "cluster")]
    #[test]
    fn companion_keys_share_the_lock_slot() {
        use redis::cluster_routing::Slot;
        for key in ["anyLock", "lock:order:{42}", "a{b}c", "x", "é:{ü}"] {
            for prefix in ["", "app:"] {
                let key = LockKey::new(key).unwrap();
                let slot = Slot::for_key(Names::lock(prefix, &key).as_bytes());
                assert_eq!(
                    Slot::for_key(Names::channel(prefix, &key)),
                    slot,
                    "{key} channel"
                );
                assert_eq!(
                    Slot::for_key(Names::fence(prefix, &key)),
                    slot,
                    "{key} fence"
                );
                let owner = HoldId::from_raw("5f0e7c8a-uuid:7").unwrap();
                let lease_key = [
                    Names::lease_prefix(prefix, &key).as_str(),
                    ":",
                    owner.as_str(),
                    ":rwlock_timeout:1",
                ]
                .concat();
                let mut companions = vec![
                    ("queue", Names::queue(prefix, &key)),
                    ("queue timeouts", Names::queue_timeouts(prefix, &key)),
                    ("rw channel", Names::rw_channel(prefix, &key)),
                    ("permits", Names::permits(prefix, &key)),
                    ("record for replay", Names::replay(prefix, &key)),
                    ("read lease key", lease_key),
                ];
                for mode in [
                    LockMode::Exclusive,
                    LockMode::Fair,
                    LockMode::Read,
                    LockMode::Write,
                ] {
                    let req =
                        LockRequest::new(key.clone(), owner.clone(), mode, Duration::from_secs(1));
                    companions.push(("wait channel", Names::wait_channel(prefix, &req)));
                }
                for (what, name) in companions {
                    assert_eq!(Slot::for_key(name.as_bytes()), slot, "{key} {what}: {name}");
                }
            }
        }
    }

    #[test]
    fn ttl_and_lease_conversions() {
        assert_eq!(ttl_of(-1), None);
        assert_eq!(ttl_of(-2), Some(Duration::ZERO));
        assert_eq!(ttl_of(1500), Some(Duration::from_millis(1500)));
        assert_eq!(lease_ms(Duration::from_micros(10)), 1);
        assert_eq!(lease_ms(Duration::from_secs(30)), 30_000);
    }

    #[test]
    fn scripts_are_the_lua_files() {
        assert!(SCRIPTS.acquire.get_hash().len() == 40);
        assert_ne!(SCRIPTS.acquire.get_hash(), SCRIPTS.release.get_hash());
    }

    /// Every file in `lua/`, with its text.
    fn lua_files() -> Vec<(std::path::PathBuf, String)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("lua");
        std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let source = std::fs::read_to_string(&path).unwrap();
                (path, source)
            })
            .collect()
    }

    /// Redis 7.0 turns a Lua number passed to `redis.call` into text with `snprintf`
    /// (`%.17g`): about 2,000 instructions an argument, as much as the command it goes
    /// to. A constant argument is written as a string (`'1'`, not `1`), so no script
    /// pays that for a literal.
    #[test]
    fn no_script_passes_a_number_literal_to_redis() {
        let mut calls = 0;
        for (path, source) in lua_files() {
            for line in source.lines().filter(|l| !l.trim_start().starts_with("--")) {
                for (at, _) in line.match_indices("redis.call(") {
                    calls += 1;
                    let rest = &line[at + "redis.call(".len()..];
                    // The call's arguments: up to its closing parenthesis, split at
                    // the commas outside nested calls.
                    let (mut depth, mut args, mut arg) = (0, Vec::new(), String::new());
                    for c in rest.chars() {
                        match c {
                            '(' => depth += 1,
                            ')' if depth == 0 => break,
                            ')' => depth -= 1,
                            ',' if depth == 0 => {
                                args.push(std::mem::take(&mut arg));
                                continue;
                            }
                            _ => {}
                        }
                        arg.push(c);
                    }
                    args.push(arg);
                    for arg in &args {
                        assert!(
                            arg.trim().parse::<f64>().is_err(),
                            "{}: `{}` passes the number {} to Redis",
                            path.display(),
                            line.trim(),
                            arg.trim()
                        );
                    }
                }
            }
        }
        assert!(calls >= 100, "found only {calls} calls");
    }

    /// The sharded scripts are the files with `PUBLISH` renamed: every publish in
    /// `lua/` must be spelled as [`PUBLISH_CALL`], or the rename would miss it and a
    /// cluster's waiters would sleep through that release.
    #[test]
    fn every_publish_in_the_scripts_is_renamed_for_sharded_pubsub() {
        let mut publishes = 0;
        for (path, source) in lua_files() {
            let code: String = source
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .map(|l| format!("{}\n", l.to_lowercase()))
                .collect();
            let calls = code.matches("publish").count();
            let spelled = code.matches(PUBLISH_CALL).count();
            assert_eq!(
                calls,
                spelled,
                "{} publishes in another spelling",
                path.display()
            );
            let sharded = Publish::Sharded.text(&source);
            assert!(!sharded.contains(PUBLISH_CALL), "{}", path.display());
            assert_eq!(sharded.matches(SPUBLISH_CALL).count(), spelled);
            publishes += spelled;
        }
        assert!(publishes >= 10, "found only {publishes} publishes");
        assert_ne!(
            SCRIPTS.release.get_hash(),
            SHARDED_SCRIPTS.release.get_hash()
        );
        // The replay store releases with lib.lua's `release_hold`: renamed there too.
        assert_ne!(
            SCRIPTS.replay_store.get_hash(),
            SHARDED_SCRIPTS.replay_store.get_hash()
        );
    }
}
