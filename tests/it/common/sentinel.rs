//! A Redis primary with replicas, watched by Sentinels: real `redis-server` processes
//! (`--replicaof`, `--sentinel`) on free loopback ports, gone when the value is dropped.
//!
//! [`SentinelSet::start`] starts a primary, its replicas and the Sentinels, and returns
//! once every replica is in sync and every Sentinel knows every replica and every other
//! Sentinel, so a failover can be asked for (`SENTINEL FAILOVER`) or provoked (SIGKILL or
//! SIGSTOP of the primary) at once. Sentinels declare a primary down after
//! [`DOWN_AFTER`] without an answer.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use tokio::time::Instant;

use super::proxy::FaultProxy;
use super::redis_server::RedisServer;

/// The name the Sentinels monitor the primary under.
pub const MASTER: &str = "tower-lock-primary";

/// How long a primary may not answer before a Sentinel calls it down.
pub const DOWN_AFTER: Duration = Duration::from_millis(1000);

/// One Sentinel process.
pub struct Sentinel {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
}

impl Sentinel {
    /// A Sentinel monitoring the primary on `primary_port`, answering on a free port.
    async fn start(dir: PathBuf, primary_port: u16, quorum: usize) -> Self {
        Self::start_trying(dir, primary_port, quorum, None).await
    }

    /// [`Sentinel::start`], trying `first` as its port before free ones. A port found
    /// free can be taken before the Sentinel binds it (another test's server or proxy):
    /// then the Sentinel exits, or another process answers there, and it is started
    /// again on another port, as [`RedisServer`] does.
    pub async fn start_trying(
        dir: PathBuf,
        primary_port: u16,
        quorum: usize,
        first: Option<u16>,
    ) -> Self {
        std::fs::create_dir_all(&dir).expect("the Sentinel's directory");
        for attempt in 0..10 {
            let port = match first {
                Some(port) if attempt == 0 => port,
                _ => super::redis_server::free_port(),
            };
            let mut child = Self::spawn(&dir, port, primary_port, quorum);
            if wait_answering(port, &mut child).await {
                return Sentinel {
                    child: Some(child),
                    port,
                    dir,
                };
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!(
            "no Sentinel came up in 10 attempts; the last one's log ends:\n{}",
            std::fs::read_to_string(dir.join("sentinel.log")).unwrap_or_default()
        );
    }

    fn spawn(dir: &std::path::Path, port: u16, primary_port: u16, quorum: usize) -> Child {
        let config = format!(
            "port {port}\nbind 127.0.0.1\ndir {dir}\nlogfile {dir}/sentinel.log\n\
             sentinel resolve-hostnames no\n\
             sentinel monitor {MASTER} 127.0.0.1 {primary_port} {quorum}\n\
             sentinel down-after-milliseconds {MASTER} {down}\n\
             sentinel failover-timeout {MASTER} 4000\n\
             sentinel parallel-syncs {MASTER} 2\n",
            dir = dir.display(),
            down = DOWN_AFTER.as_millis(),
        );
        let file = dir.join("sentinel.conf");
        std::fs::write(&file, config).expect("write sentinel.conf");
        let mut cmd = Command::new("redis-server");
        cmd.arg(&file)
            .arg("--sentinel")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl in the child before exec; if the test process dies, so does it.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        cmd.spawn().expect("redis-server on PATH")
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The last `lines` lines of this Sentinel's log.
    pub fn log_tail(&self, lines: usize) -> String {
        let log = std::fs::read_to_string(self.dir.join("sentinel.log")).unwrap_or_default();
        let all: Vec<&str> = log.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// `SENTINEL <args>` on this Sentinel; `None` when it does not answer.
    pub async fn ask<T: redis::FromRedisValue>(&self, args: &[&str]) -> Option<T> {
        ask_on(self.port, args).await
    }
}

async fn conn_on(port: u16) -> Option<redis::aio::MultiplexedConnection> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    tokio::time::timeout(
        Duration::from_millis(500),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()
}

/// `SENTINEL <args>` on the Sentinel on `port`; `None` when it does not answer.
async fn ask_on<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> Option<T> {
    let mut conn = conn_on(port).await?;
    redis::cmd("SENTINEL")
        .arg(args)
        .query_async(&mut conn)
        .await
        .ok()
}

/// Whether the Sentinel just spawned as `child` answers on `port` as a Sentinel of
/// [`MASTER`]: `false` once it exited (its port was taken), or after 10 s.
async fn wait_answering(port: u16, child: &mut Child) -> bool {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if child.try_wait().ok().flatten().is_some() {
            return false;
        }
        let master: Option<redis::Value> = ask_on(port, &["MASTER", MASTER]).await;
        if master.is_some() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

impl Drop for Sentinel {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
        // The set's directory, once its last Sentinel is gone (fails while not empty).
        if let Some(set_dir) = self.dir.parent() {
            let _ = std::fs::remove_dir(set_dir);
        }
    }
}

/// A primary, its replicas and the Sentinels that watch them.
pub struct SentinelSet {
    /// Every data node; `nodes[0]` was the primary at the start.
    pub nodes: Vec<RedisServer>,
    pub sentinels: Vec<Sentinel>,
    /// With [`SentinelSet::start_behind_proxies`]: the proxy each replica replicates
    /// through (in the order of `nodes[1..]`), so a test can hold back or drop the
    /// replication stream (`Direction::Down` carries it to the replica).
    pub replication: Vec<FaultProxy>,
}

impl SentinelSet {
    /// A primary with `replicas` replicas and `sentinels` Sentinels (quorum: a
    /// majority of them), all in sync and known to each other.
    pub async fn start(replicas: usize, sentinels: usize) -> Self {
        Self::start_inner(replicas, sentinels, false, &[], &[]).await
    }

    /// The same, data node `i` (0: the first primary) started with `env[i]` (a
    /// [`ClockShift`](super::clock::ClockShift)'s environment), if given.
    pub async fn start_with_env(
        replicas: usize,
        sentinels: usize,
        env: &[Vec<(String, String)>],
    ) -> Self {
        Self::start_inner(replicas, sentinels, false, &[], env).await
    }

    /// The same, with extra `redis-server` arguments for the first primary only.
    pub async fn start_with_primary_args(
        replicas: usize,
        sentinels: usize,
        primary_args: &[&str],
    ) -> Self {
        Self::start_inner(replicas, sentinels, false, primary_args, &[]).await
    }

    /// The same, with each replica replicating from the primary through a
    /// [`FaultProxy`] of its own ([`SentinelSet::replication`]). Once the Sentinels
    /// promote a replica, the others follow it directly.
    pub async fn start_behind_proxies(replicas: usize, sentinels: usize) -> Self {
        Self::start_inner(replicas, sentinels, true, &[], &[]).await
    }

    async fn start_inner(
        replicas: usize,
        sentinels: usize,
        proxied: bool,
        primary_args: &[&str],
        env: &[Vec<(String, String)>],
    ) -> Self {
        let env_of = |i: usize| env.get(i).cloned().unwrap_or_default();
        let fast_sync = [
            "--repl-diskless-sync",
            "yes",
            "--repl-diskless-sync-delay",
            "0",
        ];
        let primary =
            RedisServer::start_with_env(&[&fast_sync[..], primary_args].concat(), env_of(0)).await;
        let mut nodes = vec![primary];
        let mut replication = Vec::new();
        for _ in 0..replicas {
            let upstream = if proxied {
                let proxy = FaultProxy::start(([127, 0, 0, 1], nodes[0].port()).into()).await;
                let port = proxy.port();
                replication.push(proxy);
                port
            } else {
                nodes[0].port()
            };
            let upstream = upstream.to_string();
            let mut args = fast_sync.to_vec();
            args.extend(["--replicaof", "127.0.0.1", upstream.as_str()]);
            nodes.push(RedisServer::start_with_env(&args, env_of(nodes.len())).await);
        }
        let base = std::env::temp_dir().join(format!(
            "tower-lock-sentinel-{}-{}",
            std::process::id(),
            nodes[0].port()
        ));
        let quorum = sentinels / 2 + 1;
        let mut started = Vec::new();
        for i in 0..sentinels {
            started.push(Sentinel::start(base.join(i.to_string()), nodes[0].port(), quorum).await);
        }
        let sentinels = started;
        let set = SentinelSet {
            nodes,
            sentinels,
            replication,
        };
        set.wait_until_ready(replicas, Duration::from_secs(30))
            .await;
        set
    }

    /// The Sentinels' addresses, as `redis://` URLs.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(Sentinel::url).collect()
    }

    /// The primary's port, as a majority of the Sentinels name it, once it accepts
    /// writes: right after a failover, the first Sentinel to answer may still name the
    /// old one.
    pub async fn primary_port(&self) -> u16 {
        self.wait_for_agreed_primary(None, Duration::from_secs(30))
            .await
    }

    /// Restarts the node on `port` as a replica of the primary a majority of the
    /// Sentinels name, as a restarted node rejoins a set in production; a killed
    /// primary's node only once another replaced it.
    pub async fn restart_as_replica(&mut self, port: u16) {
        let primary = self
            .wait_for_agreed_primary(Some(port), Duration::from_secs(30))
            .await;
        self.node(port).restart_replicating(primary).await;
    }

    /// The data node listening on `port`.
    pub fn node(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("a node on that port")
    }

    /// Asks a Sentinel for a failover and waits until the Sentinels name another primary
    /// and it accepts writes; returns its port.
    pub async fn failover(&self) -> u16 {
        let old = self.primary_port().await;
        let asked: Option<String> = self.sentinels[0].ask(&["FAILOVER", MASTER]).await;
        assert_eq!(asked.as_deref(), Some("OK"), "SENTINEL FAILOVER refused");
        self.wait_for_new_primary(old, Duration::from_secs(30))
            .await
    }

    /// Waits until a majority of the Sentinels name a primary other than `old`, and that
    /// primary accepts writes; returns its port.
    pub async fn wait_for_new_primary(&self, old: u16, within: Duration) -> u16 {
        self.wait_for_agreed_primary(Some(old), within).await
    }

    /// Waits until a majority of the Sentinels name one primary (not `not`) that accepts
    /// writes; returns its port. Right after a failover the first Sentinel to answer
    /// may still name the old one.
    async fn wait_for_agreed_primary(&self, not: Option<u16>, within: Duration) -> u16 {
        let deadline = Instant::now() + within;
        loop {
            let mut named = Vec::new();
            for sentinel in &self.sentinels {
                if let Some((_, port)) = sentinel
                    .ask::<(String, u16)>(&["GET-MASTER-ADDR-BY-NAME", MASTER])
                    .await
                {
                    named.push(port);
                }
            }
            // A majority agrees (a Sentinel that missed the news catches up from the
            // others' hello messages, in its own time) on a primary that is one now.
            let majority = self.sentinels.len() / 2 + 1;
            for &port in &named {
                if Some(port) != not
                    && named.iter().filter(|&&p| p == port).count() >= majority
                    && accepts_writes(port).await
                {
                    return port;
                }
            }
            assert!(
                Instant::now() < deadline,
                "no agreed primary within {within:?} (Sentinels name {named:?}, not {not:?}); the first Sentinel's log ends:\n{}",
                self.sentinels[0].log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the primary the Sentinels name has at least one replica online, so a
    /// write it takes can be acknowledged (what replica-acknowledged locks need to be
    /// granted at all); returns its port. After a failover, the replicas left are
    /// reconfigured and resynchronised first, and a restarted node syncs in full.
    pub async fn wait_until_replicated(&self, within: Duration) -> u16 {
        let deadline = Instant::now() + within;
        loop {
            let primary = self.primary_port().await;
            if replication_links(primary).await.is_some_and(|n| n >= 1) {
                return primary;
            }
            if Instant::now() >= deadline {
                // What each node says of its replication, for the next time this fails.
                let mut nodes = String::new();
                for node in &self.nodes {
                    let info = info_replication(node.port()).await.unwrap_or_default();
                    let state: Vec<&str> = info
                        .lines()
                        .filter(|l| {
                            l.starts_with("role:")
                                || l.starts_with("master_port:")
                                || l.starts_with("master_link_status:")
                                || l.starts_with("master_sync_in_progress:")
                                || l.starts_with("slave")
                        })
                        .collect();
                    nodes.push_str(&format!("\n  {}: {}", node.port(), state.join(" ")));
                }
                panic!(
                    "the primary {primary} had no replica online within {within:?}; the nodes:{nodes}\nthe first Sentinel's log ends:\n{}",
                    self.sentinels[0].log_tail(30)
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every replica is linked to the primary and every Sentinel knows all
    /// replicas and all other Sentinels.
    async fn wait_until_ready(&self, replicas: usize, within: Duration) {
        let deadline = Instant::now() + within;
        let others = self.sentinels.len() - 1;
        loop {
            let mut ready = replication_links(self.nodes[0].port()).await == Some(replicas);
            for sentinel in &self.sentinels {
                let known_replicas: Option<Vec<redis::Value>> =
                    sentinel.ask(&["REPLICAS", MASTER]).await;
                let known_sentinels: Option<Vec<redis::Value>> =
                    sentinel.ask(&["SENTINELS", MASTER]).await;
                ready &= known_replicas.map(|r| r.len()) == Some(replicas)
                    && known_sentinels.map(|s| s.len()) == Some(others);
            }
            if ready {
                return;
            }
            if Instant::now() >= deadline {
                self.explain_not_ready(within).await;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl SentinelSet {
    /// Panics with what each part of the set says, for a set not ready `within`.
    async fn explain_not_ready(&self, within: Duration) -> ! {
        let mut parts = format!(
            "the primary {} has {:?} replicas online",
            self.nodes[0].port(),
            replication_links(self.nodes[0].port()).await
        );
        for sentinel in &self.sentinels {
            let replicas: Option<Vec<redis::Value>> = sentinel.ask(&["REPLICAS", MASTER]).await;
            let others: Option<Vec<redis::Value>> = sentinel.ask(&["SENTINELS", MASTER]).await;
            parts.push_str(&format!(
                "\n  Sentinel {}: knows {:?} replicas and {:?} other Sentinels; its log ends:\n{}",
                sentinel.port(),
                replicas.map(|r| r.len()),
                others.map(|s| s.len()),
                sentinel.log_tail(10)
            ));
        }
        panic!("the Sentinel set was not ready within {within:?}: {parts}");
    }
}

/// How many replicas are linked to the node on `port` and online, from `INFO
/// replication`; `None` when it does not answer or is not a primary.
pub async fn replication_links(port: u16) -> Option<usize> {
    let info = info_replication(port).await?;
    if !info.contains("role:master") {
        return None;
    }
    Some(
        info.lines()
            .filter(|l| l.starts_with("slave") && l.contains("state=online"))
            .count(),
    )
}

/// `INFO replication` of the node on `port`.
pub async fn info_replication(port: u16) -> Option<String> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let mut conn = tokio::time::timeout(
        Duration::from_millis(500),
        client.get_multiplexed_async_connection(),
    )
    .await
    .ok()?
    .ok()?;
    redis::cmd("INFO")
        .arg("replication")
        .query_async(&mut conn)
        .await
        .ok()
}

/// Whether the node on `port` answers as a primary (a promoted replica takes writes from
/// then on).
async fn accepts_writes(port: u16) -> bool {
    info_replication(port)
        .await
        .is_some_and(|info| info.contains("role:master"))
}
