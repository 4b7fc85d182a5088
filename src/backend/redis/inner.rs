//! What the clones of a [`RedisBackend`](super::RedisBackend) share, and how commands go
//! over its connection: sent once more when they may be, followed by `WAIT` with
//! replica acknowledgement, and attempts given deadlines on the server's clock.

use std::time::Duration;

use redis::{FromRedisValue, RedisError, RedisResult};
use tokio_util::sync::DropGuard;

use super::conn::Conn;
#[cfg(feature = "cluster")]
use super::conn::cluster_invoke_then;
use super::errors::map_error;
#[cfg(feature = "cluster")]
use super::names::Names;
use super::scripts::{Publish, parse_acquire};
use super::synced::{Replicated, Synced, replicas_of_role};
use super::{batch, pubsub};
use crate::backend::clock::{ArrivedLate, StoreClock};
use crate::backend::{Acquire, LockRequest, StoreProfile};
use crate::error::{Error, Result};
use crate::key::LockKey;

/// Which server a clock sample is of: the one server, or on a cluster the master
/// serving a slot.
#[cfg(feature = "cluster")]
pub(super) type Node = Option<redis::cluster_routing::Slot>;
#[cfg(not(feature = "cluster"))]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub(super) struct Node;

pub(super) struct Inner {
    pub(super) conn: Conn,
    pub(super) prefix: String,
    /// `redis`; its identity is the server (or cluster) and key prefix, the same in
    /// every process: `redis:<host>:<port>/<db>:<key prefix>`
    /// (`redis-cluster:<nodes>:<prefix>`).
    pub(super) profile: StoreProfile,
    pub(super) hub: pubsub::Hub,
    pub(super) waiter_timeout: Duration,
    /// Group commit of exclusive acquisitions and releases (per hash slot on a cluster).
    pub(super) batcher: batch::Batcher,
    /// The server's clock (each master's, on a cluster), for the deadlines of attempts.
    pub(super) clock: StoreClock<Node>,
    /// An attempt's deadline is this long after it is sent: the response timeout, so
    /// that a reply that timed out leaves no attempt that could still take a lock.
    pub(super) attempt_window: Duration,
    /// Replica acknowledgement of writes, when configured.
    pub(super) synced: Option<Synced>,
    /// How the scripts publish releases (sharded on a Redis 7 cluster).
    pub(super) publish: Publish,
    /// How long a fencing counter outlives its last token, in milliseconds, as the
    /// scripts take it
    /// ([`RedisBackendBuilder::token_retention`](super::RedisBackendBuilder::token_retention)).
    pub(super) token_retention: String,
    pub(super) _stop_hub: DropGuard,
}

impl Inner {
    pub(super) async fn invoke<T: FromRedisValue>(
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
    pub(super) async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> Result<T> {
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
    pub(super) async fn read<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T> {
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
    /// (see [`RedisBackendBuilder::synced_replicas`](super::RedisBackendBuilder::synced_replicas)).
    pub(super) async fn write<T: FromRedisValue>(
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
    /// has (see
    /// [`SingleConn::confirmed_primary`](super::conn::SingleConn::confirmed_primary)).
    /// On a cluster, never: a master that comes back after its replica was promoted in
    /// its place cannot be told from one whose replicas are down, and the count stays
    /// the configured one.
    async fn deployment_has(&self, replicas: u32) -> bool {
        match &self.conn {
            Conn::Single(single) => single.confirmed_primary(replicas).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => false,
        }
    }

    /// A write that must reach the replicas (a renewal): an outage when it did not.
    pub(super) async fn write_strict<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<T> {
        let (value, replicated) = self.write(invocation).await?;
        replicated.check()?;
        Ok(value)
    }

    /// A write waited for but not failed (a release: one lost in a failover leaves the
    /// hold until its lease ends, never a second holder).
    pub(super) async fn write_waited<T: FromRedisValue>(
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
    pub(super) async fn write_grant(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> Result<Acquire> {
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
    pub(super) fn checked<T>(&self, result: RedisResult<T>) -> Result<T> {
        result.map_err(|error| self.failed(error))
    }

    /// A command's error as this crate's (see [`checked`](Self::checked)).
    pub(super) fn failed(&self, error: RedisError) -> Error {
        if error.is_timeout() {
            self.clock.forget();
        }
        map_error(error)
    }

    /// How many times the command connection moved to another primary (behind
    /// Sentinel; 0 otherwise).
    pub(super) fn primary_moves(&self) -> u64 {
        self.conn
            .single()
            .map_or(0, |single| single.primary.moves())
    }

    /// Whether exclusive batches may be pipelined: on a single server without replica
    /// acknowledgement (see `batch::pipeline`).
    pub(super) fn pipelines(&self) -> bool {
        self.conn.single().is_some() && self.synced.is_none()
    }

    /// The scripts' argument for whether `req` is fenced: the token retention in
    /// milliseconds, or `0` for an unfenced request.
    pub(super) fn fenced_arg(&self, req: &LockRequest) -> &str {
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
                #[cfg(feature = "cluster")]
                let node = None;
                #[cfg(not(feature = "cluster"))]
                let node = Node;
                node
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
    pub(super) async fn attempt_deadline(&self, key: &LockKey) -> Result<u64> {
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
    pub(super) fn sample_refusal(&self, key: &LockKey, error: &Error) {
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
    pub(super) fn deadline_now(&self, key: &LockKey) -> Option<u64> {
        self.clock.deadline(
            &self.node_of(key),
            self.attempt_window,
            self.primary_moves(),
        )
    }
}
