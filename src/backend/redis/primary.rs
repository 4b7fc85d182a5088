//! Where the primary is: one fixed server, or whichever server the Sentinels name now.
//!
//! A backend on a single server connects to one address for good; redis-rs's
//! `ConnectionManager` reconnects to it after a dropped connection. A backend behind
//! Sentinel (feature `sentinel`) asks the Sentinels for the primary whenever it needs a
//! new connection — at start, and when a command on the current one times out, finds it
//! gone or refused, or is refused as `READONLY` (a primary demoted to a replica) — so
//! the command connection, the batcher and the watchdog that use it, and the pub/sub
//! connection all move to the new primary after a failover, without a restart.

use redis::{Client, RedisError, RedisResult};

/// The server a connection goes to. (Built once per backend and per pub/sub node, so
/// the size of a client does not matter.)
#[derive(Clone)]
#[allow(clippy::large_enum_variant)]
pub(super) enum Primary {
    /// One server, always the same.
    Fixed(Client),
    /// The primary the Sentinels name, asked again for every new connection.
    #[cfg(feature = "sentinel")]
    Sentinel(std::sync::Arc<tokio::sync::Mutex<redis::sentinel::SentinelClient>>),
}

impl Primary {
    /// A client for the primary now.
    pub(super) async fn client(&self) -> RedisResult<Client> {
        match self {
            Primary::Fixed(client) => Ok(client.clone()),
            #[cfg(feature = "sentinel")]
            Primary::Sentinel(sentinels) => sentinels.lock().await.async_get_client().await,
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
