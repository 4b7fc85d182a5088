//! Where the primary is: one fixed server, or whichever server the Sentinels name now.
//!
//! A backend on a single server connects to one address for good; redis-rs's
//! `ConnectionManager` reconnects to it after a dropped connection. A backend behind
//! Sentinel (feature `sentinel`) asks the Sentinels for the primary whenever it needs a
//! new connection — at start, and when a command on the current one times out, finds it
//! gone or refused, or is refused as `READONLY` (a primary demoted to a replica) — so
//! the command connection, the batcher and the watchdog that use it, and the pub/sub
//! connection all move to the new primary after a failover, without a restart.
//!
//! A primary cut off from its replicas and from the Sentinels is not demoted while the
//! cut lasts: it goes on answering, and refuses writes `NOREPLICAS` where
//! `min-replicas-to-write` is set. Such a refusal (and `MASTERDOWN`, from a replica)
//! makes the backend ask the Sentinels too, at most every [`ASK_EVERY`]; it moves only
//! when they name another primary. Whichever connection sees the move first, the
//! others follow it: the batches' connection is made again, and the pub/sub connection
//! reconnects ([`Primary::moved`]).

use redis::{Client, RedisError, RedisResult};

/// How often a refusal that may mean the primary moved makes the backend ask the
/// Sentinels, at most: every waiter meets the refusal on each try.
#[cfg(feature = "sentinel")]
pub(super) const ASK_EVERY: std::time::Duration = std::time::Duration::from_millis(200);

/// The server a connection goes to. (Built once per backend and per pub/sub node, so
/// the size of a client does not matter.)
#[derive(Clone)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Primary {
    /// One server, always the same.
    Fixed(Client),
    /// The primary the Sentinels name, asked again for every new connection.
    #[cfg(feature = "sentinel")]
    Sentinel(std::sync::Arc<Sentinels>),
}

/// The Sentinels of one backend, and word of the primary's moves among its connections.
#[cfg(feature = "sentinel")]
pub(super) struct Sentinels {
    client: tokio::sync::Mutex<redis::sentinel::SentinelClient>,
    /// The name they monitor the primary under.
    master: String,
    /// Each Sentinel, to ask on its own (see [`Primary::named_by_majority`]).
    nodes: Vec<redis::ConnectionInfo>,
    /// How many times the command connection moved to another primary.
    moves: std::sync::atomic::AtomicU64,
    /// Tells the pub/sub task of a move (a permit is kept when it is not listening).
    moved: tokio::sync::Notify,
    /// When a refusal last made the backend ask the Sentinels, and whether that ask is
    /// still going on.
    asked: std::sync::Mutex<Asked>,
}

/// See [`Sentinels::asked`].
#[cfg(feature = "sentinel")]
#[derive(Default)]
struct Asked {
    at: Option<std::time::Instant>,
    asking: bool,
}

/// The one ask of the Sentinels a refusal allowed ([`Primary::may_ask_again`]); the
/// next may start [`ASK_EVERY`] after this one started, once this one is dropped.
pub(super) struct Asking {
    #[cfg(feature = "sentinel")]
    sentinels: std::sync::Arc<Sentinels>,
}

impl Drop for Asking {
    fn drop(&mut self) {
        #[cfg(feature = "sentinel")]
        {
            self.sentinels
                .asked
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .asking = false;
        }
    }
}

#[cfg(feature = "sentinel")]
impl Sentinels {
    pub(super) fn new(
        client: redis::sentinel::SentinelClient,
        master: String,
        nodes: Vec<redis::ConnectionInfo>,
    ) -> Self {
        Sentinels {
            client: tokio::sync::Mutex::new(client),
            master,
            nodes,
            moves: std::sync::atomic::AtomicU64::new(0),
            moved: tokio::sync::Notify::new(),
            asked: std::sync::Mutex::new(Asked::default()),
        }
    }
}

impl Primary {
    /// A client for the primary now.
    pub(super) async fn client(&self) -> RedisResult<Client> {
        match self {
            Primary::Fixed(client) => Ok(client.clone()),
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(sentinels) => sentinels.client.lock().await.async_get_client().await,
        }
    }

    /// How many times the command connection moved to another primary: a connection
    /// made before the last move goes to a server that is no longer the primary.
    pub(super) fn moves(&self) -> u64 {
        match self {
            Primary::Fixed(_) => 0,
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(sentinels) => {
                sentinels.moves.load(std::sync::atomic::Ordering::Acquire)
            }
        }
    }

    /// Records that the command connection moved to another primary, for the
    /// connections that did not see it.
    pub(super) fn note_move(&self) {
        #[cfg(feature = "sentinel")]
        if let Primary::Sentinel(sentinels) = self {
            sentinels
                .moves
                .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            sentinels.moved.notify_one();
        }
    }

    /// Completes when the command connection moved to another primary since the last
    /// time it completed; never for a fixed server.
    pub(super) async fn moved(&self) {
        match self {
            Primary::Fixed(_) => std::future::pending().await,
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(sentinels) => sentinels.moved.notified().await,
        }
    }

    /// Whether a refusal that may mean the primary moved should make the backend ask
    /// the Sentinels now: behind Sentinel, no other such ask going on, and not within
    /// [`ASK_EVERY`] of the last one's start. Held while asking.
    pub(super) fn may_ask_again(&self) -> Option<Asking> {
        match self {
            Primary::Fixed(_) => None,
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(sentinels) => {
                let now = std::time::Instant::now();
                let mut asked = sentinels
                    .asked
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                if asked.asking || asked.at.is_some_and(|at| now < at + ASK_EVERY) {
                    return None;
                }
                *asked = Asked {
                    at: Some(now),
                    asking: true,
                };
                Some(Asking {
                    sentinels: std::sync::Arc::clone(sentinels),
                })
            }
        }
    }

    /// Whether a majority of the Sentinels, each asked on its own within `within`, name
    /// the server at `addr` (`host:port`) the primary now (`GET-MASTER-ADDR-BY-NAME`).
    /// Stricter than the address redis-rs's client settles on: while a failover is
    /// under way, the Sentinel running it may still list the old primary, which answers
    /// `ROLE` as a primary once it is back from a pause; the majority names the
    /// promoted one from the moment it is chosen. Always true for a fixed server.
    pub(super) async fn named_by_majority(&self, addr: &str, within: std::time::Duration) -> bool {
        match self {
            Primary::Fixed(_) => {
                let _ = (addr, within);
                true
            }
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(sentinels) => {
                let ask = |node: &redis::ConnectionInfo| {
                    let node = node.clone();
                    let master = sentinels.master.clone();
                    async move {
                        let asked = async {
                            let client = Client::open(node).ok()?;
                            let mut conn = client.get_multiplexed_async_connection().await.ok()?;
                            let named: Option<(String, u16)> = redis::cmd("SENTINEL")
                                .arg("GET-MASTER-ADDR-BY-NAME")
                                .arg(&master)
                                .query_async(&mut conn)
                                .await
                                .ok()?;
                            named.map(|(host, port)| format!("{host}:{port}"))
                        };
                        tokio::time::timeout(within, asked).await.ok().flatten()
                    }
                };
                let named = futures_util::future::join_all(sentinels.nodes.iter().map(ask)).await;
                let agree = named
                    .iter()
                    .flatten()
                    .filter(|named| *named == addr)
                    .count();
                agree > sentinels.nodes.len() / 2
            }
        }
    }

    /// Behind Sentinel: the master name and every Sentinel, to listen to.
    #[cfg(feature = "sentinel")]
    pub(super) fn sentinels(&self) -> Option<(String, Vec<redis::ConnectionInfo>)> {
        match self {
            Primary::Fixed(_) => None,
            Primary::Sentinel(sentinels) => {
                Some((sentinels.master.clone(), sentinels.nodes.clone()))
            }
        }
    }

    /// Whether the primary can move (behind Sentinel).
    pub(super) fn follows_failovers(&self) -> bool {
        match self {
            Primary::Fixed(_) => false,
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(_) => true,
        }
    }

    /// Whether a command that failed with `error` calls for a new connection, to the
    /// primary as it is now. A timeout always does (a connection that died without a
    /// word answers nothing, ever). Behind Sentinel, so does a connection that is gone
    /// or refused (the primary may have moved) and a write refused as `READONLY` (the
    /// server was demoted); a fixed server's manager reconnects to it by itself.
    pub(super) fn calls_for_new_connection(&self, error: &RedisError) -> bool {
        if error.is_timeout() {
            return true;
        }
        match self {
            Primary::Fixed(_) => false,
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(_) => {
                error.is_connection_dropped()
                    || error.is_connection_refusal()
                    || error.is_io_error()
                    || is_readonly(error)
            }
        }
    }
}

/// A write refused because the server is a replica now.
#[cfg(feature = "sentinel")]
fn is_readonly(error: &RedisError) -> bool {
    error.code() == Some("READONLY")
}
