//! [`RedisBackendBuilder`]: the settings, checked when the backend is built, and
//! connecting to the target.

use std::sync::Arc;
use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, RedisResult};
use tokio_util::sync::CancellationToken;

use super::conn::{Conn, SingleConn};
use super::errors::{map_error, naming_the_server};
use super::inner::Inner;
use super::primary::Primary;
#[cfg(feature = "sentinel")]
use super::primary::Sentinels;
use super::scripts::{Publish, lease_ms};
#[cfg(feature = "sentinel")]
use super::switches;
use super::synced::Synced;
use super::{
    DEFAULT_CONNECTION_TIMEOUT, DEFAULT_PUBSUB_KEEPALIVE, DEFAULT_RECONNECT_RETRIES,
    DEFAULT_RESPONSE_TIMEOUT, DEFAULT_TOKEN_RETENTION, DEFAULT_WAITER_TIMEOUT, RedisBackend, batch,
    pubsub,
};
use crate::backend::clock::StoreClock;
use crate::backend::{QUEUED_MODES, StoreProfile};
use crate::error::{Error, Result, SetupError, StoreErrorKind};

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

/// Where the builder connects. Built once per backend, so its size does not matter.
#[allow(clippy::large_enum_variant)]
pub(super) enum Target {
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

impl RedisBackendBuilder {
    /// A builder for `target` with every default (see [`RedisBackend::builder`] and the
    /// other constructors).
    pub(super) fn new(target: Target) -> Self {
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
    /// [`MIN_WAITER_TIMEOUT`](super::MIN_WAITER_TIMEOUT). Live waiters poll every third of it, so a shorter timeout
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
        let primary = Primary::Sentinel(Arc::new(Sentinels::new(
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
