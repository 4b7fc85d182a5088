//! The command connection: one server's, which is replaced when it cannot serve any
//! more (and follows the primary behind Sentinel), or a cluster's.

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{Client, FromRedisValue, RedisError, RedisResult};

use super::errors::{PRIMARY_IN_DOUBT, refused_with};
use super::primary::Primary;

/// The command connection: one server, or a cluster (feature `cluster`).
pub(super) enum Conn {
    Single(Box<SingleConn>),
    #[cfg(feature = "cluster")]
    Cluster(Box<redis::cluster_async::ClusterConnection>),
}

impl Conn {
    /// The single server's connection; `None` on a cluster.
    pub(super) fn single(&self) -> Option<&SingleConn> {
        match self {
            Conn::Single(single) => Some(single),
            #[cfg(feature = "cluster")]
            Conn::Cluster(_) => None,
        }
    }

    pub(super) async fn invoke<T: FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        match self {
            Conn::Single(single) => single.invoke(invocation).await,
            #[cfg(feature = "cluster")]
            Conn::Cluster(conn) => invocation.invoke_async(&mut (**conn).clone()).await,
        }
    }

    pub(super) async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
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
pub(super) struct SingleConn {
    pub(super) primary: Primary,
    config: ConnectionManagerConfig,
    /// How long asking the Sentinels for the primary may take.
    pub(super) connection_timeout: Duration,
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
    pub(super) fn new(
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
    pub(super) async fn confirmed_primary(&self, replicas: u32) -> bool {
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
        let (generation, here) = self.serving();
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
    pub(super) fn note_replicas(&self, replicas: u32) {
        let mut confirmed = self
            .confirmed
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if confirmed.is_some_and(|(_, n, _)| n != replicas) {
            *confirmed = None;
        }
    }

    /// The current connection's generation and the server (`host:port`) it is to.
    fn serving(&self) -> (u64, String) {
        let current = self
            .current
            .read()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (current.0, current.2.clone())
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

    pub(super) async fn query<T: FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        let (generation, mut conn) = self.current();
        let sent = Unpoisoned::new(cmd.query_async(&mut conn));
        let result = self.unless_moved(sent).await;
        self.after(generation, result).await
    }

    /// `invocation` followed by `then` in one write on one connection, the replies as
    /// `R` (a tuple, the script's first): `then` (a `WAIT`) covers the script's writes,
    /// also when the connection is replaced right after. A script the server does not
    /// have yet is loaded, and the whole sent again.
    pub(super) async fn invoke_then<R: FromRedisValue>(
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
    /// most every [`ASK_EVERY`](super::primary::ASK_EVERY), and moves if they name another
    /// primary. The others go on at once; the one asking waits for the answer, within
    /// the connection timeout.
    pub(super) async fn after_refusal(&self, error: &RedisError) {
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
    pub(super) async fn follow_primary(&self) {
        if !self.primary.follows_failovers() {
            return;
        }
        let (generation, here) = self.serving();
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

/// `invocation` followed by `then` (a `WAIT`) in one pipeline on a cluster: it goes to
/// the master of the script's slot (`WAIT` itself names no key), and a redirection moves
/// both. A script the node does not have yet is loaded, and the pair sent again.
#[cfg(feature = "cluster")]
pub(super) async fn cluster_invoke_then<R: FromRedisValue>(
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
