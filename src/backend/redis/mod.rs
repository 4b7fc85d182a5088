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
//! they increase across the holders of a name whatever its kind (see
//! [`FencingToken`](super::FencingToken)).
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

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

#[cfg(any(feature = "cluster", feature = "sentinel"))]
use redis::RedisResult;
use redis::{Client, FromRedisValue, IntoConnectionInfo};

use super::{
    Acquire, BoxFuture, ClientNames, LockBackend, LockMode, LockRequest, LockState, Release,
    ReplayStore, StoreAdmin, StoreProfile, Subscription, WaiterScope, Waiters, queued,
};
use crate::backend::clock::COMPENSATION_MARGIN;
use crate::error::{Error, Result, SetupError, StoreErrorKind};
use crate::key::LockKey;

mod batch;
mod builder;
mod conn;
mod errors;
mod inner;
mod modes;
mod names;
mod primary;
mod pubsub;
mod replay;
mod scripts;
#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub mod sentinel_url;
#[cfg(feature = "sentinel")]
mod switches;
mod synced;

use builder::Target;
pub use builder::{RedisBackendBuilder, ShardedPubSub};
use conn::Conn;
use errors::redis_error_of;
use inner::Inner;
use names::Names;
use scripts::{lease_ms, parse_inspect, renewal_script, unexpected};
use synced::replicas_of_role;

#[cfg(feature = "sentinel")]
#[cfg_attr(docsrs, doc(cfg(feature = "sentinel")))]
pub use sentinel_url::SentinelUrl;

/// The source of a [misconfigured](crate::StoreErrorKind::Misconfigured) store error
/// when a lock's key holds data of another type (a string where a lock hash should be):
/// something else writes under the lock's name. Downcast the error's source to tell it
/// apart: `error.store_source::<WrongType>()`.
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

/// A lock store on Redis. See the [module docs](self).
///
/// Cheap to clone: clones share the connection, the pub/sub registry and its task. The
/// task ends when the last clone is dropped.
#[derive(Clone)]
pub struct RedisBackend {
    inner: Arc<Inner>,
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
        RedisBackendBuilder::new(Target::Single(Client::open(url)))
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
                RedisBackendBuilder::new(Target::Invalid(format!("the Sentinel URL {reason}")))
            }
        }
    }

    #[cfg(not(feature = "sentinel"))]
    fn from_sentinel_url(_url: &str) -> RedisBackendBuilder {
        RedisBackendBuilder::new(Target::Invalid(format!(
            "{SENTINEL_SCHEME} URLs need the `sentinel` feature"
        )))
    }

    /// Configures a backend using an existing redis-rs client.
    pub fn from_client(client: Client) -> RedisBackendBuilder {
        RedisBackendBuilder::new(Target::Single(Ok(client)))
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
        RedisBackendBuilder::new(Target::Cluster(nodes))
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
        RedisBackendBuilder::new(Target::Sentinel {
            master: master.into(),
            sentinels,
        })
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
    /// [`SingleConn::after_refusal`](conn::SingleConn::after_refusal)).
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
