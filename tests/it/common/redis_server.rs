//! A real `redis-server` per test, on a free loopback port, gone when the test ends.
//!
//! `RedisServer::start()` finds `redis-server` on `PATH`, starts it with no persistence in
//! a private temporary directory, and waits until it answers `PING`. Dropping the value
//! kills the process and removes the directory; a parent-death signal kills it too if the
//! test process dies without unwinding. Servers can be stopped, restarted on the same
//! port, and paused with SIGSTOP / resumed with SIGCONT, for fault tests.

use std::net::TcpListener;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use tokio::time::Instant;

static NEXT_DIR: AtomicUsize = AtomicUsize::new(0);

/// Successful calls of `commands` the server has executed so far, from `INFO
/// commandstats` (a call that failed, such as a NOSCRIPT miss before redis-rs loads a
/// script, is left out).
pub async fn command_calls(conn: &mut MultiplexedConnection, commands: &[&str]) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(conn)
        .await
        .unwrap();
    let stat = |line: &str, name: &str| -> u64 {
        line.split(',')
            .find_map(|kv| kv.rsplit_once(&format!("{name}=")).map(|(_, v)| v))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    info.lines()
        .filter(|l| {
            l.strip_prefix("cmdstat_")
                .and_then(|l| l.split_once(':'))
                .is_some_and(|(name, _)| commands.contains(&name))
        })
        .map(|l| stat(l, "calls") - stat(l, "failed_calls"))
        .sum()
}

pub struct RedisServer {
    child: Option<Child>,
    port: u16,
    dir: PathBuf,
    extra: Vec<String>,
    /// Environment variables the server starts with (a clock shim).
    env: Vec<(String, String)>,
    /// PEM of the CA that signed the server's certificate, when it speaks only TLS.
    tls_ca: Option<Vec<u8>>,
}

impl RedisServer {
    /// A fresh server with default settings.
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// A fresh server with extra `redis-server` arguments (e.g. `["--requirepass", "x"]`).
    pub async fn start_with(extra: &[&str]) -> Self {
        Self::start_with_env(extra, Vec::new()).await
    }

    /// A fresh server with extra arguments and environment variables (e.g. a
    /// [`ClockShift`](super::clock::ClockShift)'s), kept across restarts.
    pub async fn start_with_env(extra: &[&str], env: Vec<(String, String)>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-redis-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let mut server = RedisServer {
            child: None,
            port: 0,
            dir,
            extra: extra.iter().map(|s| s.to_string()).collect(),
            env,
            tls_ca: None,
        };
        server.start_on_free_port().await;
        server
    }

    /// A fresh server that speaks only TLS, with a certificate for 127.0.0.1 signed by a
    /// throwaway CA (made with `openssl`); see [`RedisServer::client`].
    pub async fn start_tls() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tower-lock-redis-{}-{}",
            std::process::id(),
            NEXT_DIR.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).expect("create the server's directory");
        let sh = |script: &str| {
            let status = Command::new("sh")
                .arg("-c")
                .arg(script)
                .current_dir(&dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .expect("sh");
            assert!(status.success(), "openssl failed: {script}");
        };
        sh(
            "openssl req -x509 -newkey rsa:2048 -nodes -keyout ca.key -out ca.crt -days 1 -subj /CN=tower-lock-test-ca",
        );
        sh(
            "openssl req -newkey rsa:2048 -nodes -keyout server.key -out server.csr -subj /CN=127.0.0.1",
        );
        sh(
            "printf 'subjectAltName=IP:127.0.0.1' > san.ext && openssl x509 -req -in server.csr -CA ca.crt -CAkey ca.key -CAcreateserial -out server.crt -days 1 -extfile san.ext",
        );
        let file = |name: &str| dir.join(name).to_string_lossy().into_owned();
        let extra = vec![
            "--tls-cert-file".to_owned(),
            file("server.crt"),
            "--tls-key-file".to_owned(),
            file("server.key"),
            "--tls-ca-cert-file".to_owned(),
            file("ca.crt"),
            "--tls-auth-clients".to_owned(),
            "no".to_owned(),
        ];
        let mut server = RedisServer {
            child: None,
            port: 0,
            tls_ca: Some(std::fs::read(dir.join("ca.crt")).expect("the CA certificate")),
            dir,
            extra,
            env: Vec::new(),
        };
        server.start_on_free_port().await;
        server
    }

    async fn start_on_free_port(&mut self) {
        let server = self;
        for _attempt in 0..10 {
            // A port can be taken between our probe and the server's bind: then try another.
            server.port = free_port();
            if server.spawn_and_wait().await {
                return;
            }
        }
        let log = std::fs::read_to_string(server.dir.join("redis.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        panic!(
            "could not start redis-server (is it installed? .ci/run installs it); its log ends: {tail:#?}"
        );
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        let scheme = if self.tls_ca.is_some() {
            "rediss"
        } else {
            "redis"
        };
        match self.password() {
            Some(password) => format!("{scheme}://:{password}@127.0.0.1:{}", self.port),
            None => format!("{scheme}://127.0.0.1:{}", self.port),
        }
    }

    /// A redis-rs client for this server (trusting its CA when it speaks TLS).
    pub fn client(&self) -> redis::Client {
        client_for(&self.url(), self.tls_ca.as_deref())
    }

    fn password(&self) -> Option<&str> {
        let at = self.extra.iter().position(|a| a == "--requirepass")?;
        self.extra.get(at + 1).map(String::as_str)
    }

    /// Whether the server process is up (not killed).
    pub fn is_running(&self) -> bool {
        self.child.is_some()
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server is running").id()
    }

    /// A raw connection for test assertions (plays other clients, reads keys).
    pub async fn conn(&self) -> MultiplexedConnection {
        self.client()
            .get_multiplexed_async_connection()
            .await
            .expect("connect to the test server")
    }

    /// Every key matching `pattern` (`SCAN MATCH`), sorted.
    pub async fn keys(&self, pattern: &str) -> Vec<String> {
        let mut conn = self.conn().await;
        let mut keys = Vec::new();
        let mut cursor = 0u64;
        loop {
            let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(&mut conn)
                .await
                .expect("SCAN");
            keys.extend(batch);
            if next == 0 {
                break;
            }
            cursor = next;
        }
        keys.sort();
        keys.dedup();
        keys
    }

    /// The channels any client is subscribed to (`PUBSUB CHANNELS`), sorted.
    pub async fn active_channels(&self) -> Vec<String> {
        let mut conn = self.conn().await;
        let mut channels: Vec<String> = redis::cmd("PUBSUB")
            .arg("CHANNELS")
            .query_async(&mut conn)
            .await
            .expect("PUBSUB CHANNELS");
        channels.sort();
        channels
    }

    /// Subscribers of each of `channels` (`PUBSUB NUMSUB`), in order.
    pub async fn subscribers(&self, channels: &[String]) -> Vec<u64> {
        let mut conn = self.conn().await;
        let counts: std::collections::HashMap<String, u64> = redis::cmd("PUBSUB")
            .arg("NUMSUB")
            .arg(channels)
            .query_async(&mut conn)
            .await
            .expect("PUBSUB NUMSUB");
        channels
            .iter()
            .map(|c| {
                *counts
                    .get(c)
                    .expect("NUMSUB answers for every channel asked")
            })
            .collect()
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port, empty.
    pub async fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if self.spawn_and_wait().await {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("could not restart redis-server on port {}", self.port);
    }

    /// Restarts the server as a replica of the server on `primary`, whatever it was
    /// started as: an old primary restarted as it was started would come back an empty
    /// primary of its own, which the Sentinels may not have reconfigured yet (a failover
    /// still under way) and which then wins over the one they promoted.
    pub async fn restart_replicating(&mut self, primary: u16) {
        let at = self.extra.iter().position(|a| a == "--replicaof");
        if let Some(at) = at {
            self.extra.drain(at..(at + 3).min(self.extra.len()));
        }
        self.extra.extend([
            "--replicaof".to_owned(),
            "127.0.0.1".to_owned(),
            primary.to_string(),
        ]);
        self.restart().await;
    }

    /// Freezes the server (SIGSTOP): connections stay open, nothing is answered.
    pub fn pause(&self) {
        signal(self.pid(), "-STOP");
    }

    /// Thaws a paused server (SIGCONT).
    pub fn resume(&self) {
        signal(self.pid(), "-CONT");
    }

    /// Spawns on `self.port`; true once it answers PING, false if it exited (port taken).
    async fn spawn_and_wait(&mut self) -> bool {
        let port = self.port.to_string();
        let (plain_port, tls_port) = match self.tls_ca {
            Some(_) => ("0", port.as_str()),
            None => (port.as_str(), "0"),
        };
        let dir = self.dir.to_string_lossy().into_owned();
        let log = self.dir.join("redis.log").to_string_lossy().into_owned();
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", plain_port, "--tls-port", tls_port])
            .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--dir", &dir, "--logfile", &log, "--daemonize", "no"])
            .args(&self.extra)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // If this test process dies without unwinding, take the server with it.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = cmd.spawn().expect("redis-server on PATH");
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        let client = self.client();
        loop {
            if let Some(_exited) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                self.child = None;
                return false;
            }
            if ping(&client).await {
                return true;
            }
            if Instant::now() >= deadline {
                self.kill();
                return false;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn client_for(url: &str, tls_ca: Option<&[u8]>) -> redis::Client {
    match tls_ca {
        #[cfg(feature = "tls")]
        Some(ca) => redis::Client::build_with_tls(
            url,
            redis::TlsCertificates {
                client_tls: None,
                root_cert: Some(ca.to_vec()),
            },
        )
        .expect("a TLS client"),
        #[cfg(not(feature = "tls"))]
        Some(_) => panic!("TLS servers need the `tls` feature"),
        None => redis::Client::open(url).expect("a client"),
    }
}

/// Whether the server answers; a password-protected one answers PING with NOAUTH, and
/// one reading its data back after a restart with LOADING, which both count.
async fn ping(client: &redis::Client) -> bool {
    let connecting = tokio::time::timeout(
        Duration::from_millis(500),
        client.get_multiplexed_async_connection(),
    );
    let Ok(Ok(mut conn)) = connecting.await else {
        return false;
    };
    let pong: redis::RedisResult<String> = redis::cmd("PING").query_async(&mut conn).await;
    match pong {
        Ok(_) => true,
        Err(e) => matches!(e.code(), Some("NOAUTH" | "LOADING")),
    }
}

/// A loopback port free when asked (another process may take it before it is used).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Sends signal `sig` (as `kill` takes it: `-STOP`, `-CONT`, `-KILL`) to process `pid`.
pub fn signal(pid: u32, sig: &str) {
    let status = Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(status.success(), "kill {sig} {pid} failed");
}

/// A local Redis Cluster of `masters` fresh servers, made with `redis-cli --cluster
/// create`, ready when every node reports `cluster_state:ok`.
/// [`RedisCluster::start_with_replicas`] gives each master replicas, which take over
/// (cluster failover) when it dies.
pub struct RedisCluster {
    pub nodes: Vec<RedisServer>,
}

/// The cluster node timeout of [`RedisCluster::start_with_replicas`]: a master that
/// does not answer for this long is failed over (a second or two later).
pub const FAILOVER_NODE_TIMEOUT: Duration = Duration::from_millis(1500);

/// One line of `CLUSTER NODES`: a node as the node asked sees it.
#[derive(Clone, Debug)]
pub struct ClusterNode {
    pub port: u16,
    /// `master`, `slave`, `myself`, `fail`, `fail?`, `handshake`, ...
    pub flags: Vec<String>,
    /// The slot ranges it serves (inclusive); empty for a replica.
    pub slots: Vec<(u16, u16)>,
}

impl ClusterNode {
    pub fn is_master(&self) -> bool {
        self.flags.iter().any(|f| f == "master")
    }

    /// Declared failed by the cluster (not merely suspected, `fail?`).
    pub fn is_failed(&self) -> bool {
        self.flags.iter().any(|f| f == "fail")
    }

    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|&(lo, hi)| lo <= slot && slot <= hi)
    }

    fn parse(line: &str) -> Option<Self> {
        let fields: Vec<&str> = line.split_whitespace().collect();
        let addr = fields.get(1)?.split(['@', ',']).next()?;
        let port = addr.rsplit_once(':')?.1.parse().ok()?;
        let flags = fields.get(2)?.split(',').map(str::to_owned).collect();
        let slots = fields
            .iter()
            .skip(8)
            .filter(|r| !r.starts_with('['))
            .filter_map(|r| match r.split_once('-') {
                Some((lo, hi)) => Some((lo.parse().ok()?, hi.parse().ok()?)),
                None => r.parse().ok().map(|s| (s, s)),
            })
            .collect();
        Some(ClusterNode { port, flags, slots })
    }
}

impl RedisCluster {
    /// `masters` masters and no replicas.
    pub async fn start(masters: usize) -> Self {
        Self::start_inner(masters, 0, Duration::from_millis(5000), &[]).await
    }

    /// `masters` masters and no replicas, node `i` started with `env[i]` (a
    /// [`ClockShift`](super::clock::ClockShift)'s environment), if given.
    pub async fn start_with_env(masters: usize, env: &[Vec<(String, String)>]) -> Self {
        Self::start_inner(masters, 0, Duration::from_millis(5000), env).await
    }

    /// `masters` masters with `replicas` replicas each (`--cluster-replicas`), all in
    /// sync and known to every node, with a short node timeout
    /// ([`FAILOVER_NODE_TIMEOUT`]) so a dead master's replica takes over quickly.
    pub async fn start_with_replicas(masters: usize, replicas: usize) -> Self {
        Self::start_inner(masters, replicas, FAILOVER_NODE_TIMEOUT, &[]).await
    }

    async fn start_inner(
        masters: usize,
        replicas: usize,
        node_timeout: Duration,
        env: &[Vec<(String, String)>],
    ) -> Self {
        let node_timeout = node_timeout.as_millis().to_string();
        let mut nodes = Vec::new();
        for i in 0..masters * (1 + replicas) {
            nodes.push(
                RedisServer::start_with_env(
                    &[
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        "nodes.conf",
                        "--cluster-node-timeout",
                        &node_timeout,
                        "--repl-diskless-sync",
                        "yes",
                        "--repl-diskless-sync-delay",
                        "0",
                    ],
                    env.get(i).cloned().unwrap_or_default(),
                )
                .await,
            );
        }
        let addrs: Vec<String> = nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.port()))
            .collect();
        let output = tokio::process::Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(&addrs)
            .args(["--cluster-replicas", &replicas.to_string(), "--cluster-yes"])
            .output()
            .await
            .expect("redis-cli on PATH");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed: {}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let cluster = RedisCluster { nodes };
        let total = masters * (1 + replicas);
        super::wait_until(Duration::from_secs(30), "the cluster is ready", || {
            cluster.is_ready(masters, total)
        })
        .await;
        cluster
    }

    /// Waits until the cluster is whole again: every node up, known to every other,
    /// `masters` masters, each with all its replicas in sync.
    pub async fn wait_whole(&self, masters: usize, within: Duration) {
        let total = self.nodes.len();
        super::wait_until(within, "the cluster is whole again", || {
            self.is_ready(masters, total)
        })
        .await;
    }

    /// Every node reports `cluster_state:ok` and sees all `total` nodes (no handshake
    /// left), `masters` of them masters, each with all its replicas online.
    async fn is_ready(&self, masters: usize, total: usize) -> bool {
        if !self.is_ok().await {
            return false;
        }
        for node in &self.nodes {
            let Some(view) = cluster_nodes(node.port()).await else {
                return false;
            };
            let settled = view.len() == total
                && view
                    .iter()
                    .all(|n| !n.flags.iter().any(|f| f == "handshake"))
                && view.iter().filter(|n| n.is_master()).count() == masters;
            if !settled {
                return false;
            }
        }
        let replicas = total / masters - 1;
        for node in self.topology().await.unwrap_or_default() {
            if node.is_master()
                && super::sentinel::replication_links(node.port).await != Some(replicas)
            {
                return false;
            }
        }
        true
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(RedisServer::url).collect()
    }

    /// The node listening on `port`.
    pub fn node(&mut self, port: u16) -> &mut RedisServer {
        self.nodes
            .iter_mut()
            .find(|n| n.port() == port)
            .expect("a node on that port")
    }

    /// Whether every running node reports `cluster_state:ok`.
    pub async fn is_ok(&self) -> bool {
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            let info: Option<String> = cluster_query(node.port(), &["INFO"]).await;
            if !info.is_some_and(|i| i.contains("cluster_state:ok")) {
                return false;
            }
        }
        true
    }

    /// `CLUSTER NODES` as the first running node that answers sees it.
    pub async fn topology(&self) -> Option<Vec<ClusterNode>> {
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            if let Some(view) = cluster_nodes(node.port()).await {
                return Some(view);
            }
        }
        None
    }

    /// The hash slot of `key`, as the server computes it.
    pub async fn slot_of(&self, key: &str) -> u16 {
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            if let Some(slot) = cluster_query(node.port(), &["KEYSLOT", key]).await {
                return slot;
            }
        }
        panic!("no node answered CLUSTER KEYSLOT");
    }

    /// The port of the master serving `slot` now (as the first node that answers sees it).
    pub async fn master_of(&self, slot: u16) -> u16 {
        self.topology()
            .await
            .and_then(|view| {
                view.into_iter()
                    .find(|n| n.is_master() && !n.is_failed() && n.serves(slot))
            })
            .map(|n| n.port)
            .expect("a master serves the slot")
    }

    /// The port of a master other than the one on `than`, as the first node that
    /// answers sees the cluster.
    pub async fn another_master(&self, than: u16) -> u16 {
        self.topology()
            .await
            .and_then(|view| {
                view.into_iter()
                    .find(|n| n.is_master() && !n.is_failed() && n.port != than)
            })
            .map(|n| n.port)
            .expect("another master")
    }

    /// Moves `slot` to the master on `to`, as `redis-cli --cluster reshard` does: the
    /// slot is marked importing and migrating, its keys move with `MIGRATE` (TTLs kept)
    /// in batches of `batch`, `pause` apart, while clients go on using it (they get
    /// `ASK` or `TRYAGAIN` meanwhile), then every master learns the new owner. Returns
    /// when every node agrees.
    pub async fn migrate_slot(&self, slot: u16, to: u16, batch: usize, pause: Duration) {
        let migration = self.open_migration(slot, to).await;
        self.move_keys(&migration, batch, pause).await;
        self.close_migration(migration).await;
    }

    /// The first step of [`migrate_slot`](Self::migrate_slot): `slot` is marked
    /// importing on the master on `to` and migrating on its master now. Its keys stay
    /// where they are until [`move_keys`](Self::move_keys).
    pub async fn open_migration(&self, slot: u16, to: u16) -> Migration {
        let from = self.master_of(slot).await;
        assert_ne!(from, to, "slot {slot} is already on {to}");
        let from_id: String = cluster_query(from, &["MYID"]).await.expect("source id");
        let to_id: String = cluster_query(to, &["MYID"]).await.expect("target id");
        let migration = Migration {
            slot,
            from,
            to,
            to_id,
        };
        migration.set_slot(to, "IMPORTING", &from_id).await;
        migration
            .set_slot(from, "MIGRATING", &migration.to_id)
            .await;
        migration
    }

    /// Moves the keys of an open migration with `MIGRATE` (TTLs kept), `batch` at a
    /// time and `pause` apart, until the source has none left.
    pub async fn move_keys(&self, migration: &Migration, batch: usize, pause: Duration) {
        let mut source = redis::Client::open(format!("redis://127.0.0.1:{}", migration.from))
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        loop {
            let keys: Vec<String> = redis::cmd("CLUSTER")
                .arg("GETKEYSINSLOT")
                .arg(migration.slot)
                .arg(batch)
                .query_async(&mut source)
                .await
                .unwrap();
            if keys.is_empty() {
                break;
            }
            // A key deleted meanwhile is skipped (NOKEY when none is left).
            let _: redis::RedisResult<redis::Value> = redis::cmd("MIGRATE")
                .arg("127.0.0.1")
                .arg(migration.to)
                .arg("")
                .arg(0)
                .arg(5000)
                .arg("REPLACE")
                .arg("KEYS")
                .arg(&keys)
                .query_async(&mut source)
                .await;
            tokio::time::sleep(pause).await;
        }
    }

    /// The last step of [`migrate_slot`](Self::migrate_slot), once the source has no
    /// key of the slot left: every master learns the new owner. Returns when every
    /// node agrees.
    pub async fn close_migration(&self, migration: Migration) {
        let Migration { slot, from, to, .. } = migration;
        migration.set_slot(to, "NODE", &migration.to_id).await;
        migration.set_slot(from, "NODE", &migration.to_id).await;
        for node in self.topology().await.unwrap_or_default() {
            if node.is_master() && node.port != from && node.port != to {
                migration
                    .set_slot(node.port, "NODE", &migration.to_id)
                    .await;
            }
        }
        super::wait_until(
            Duration::from_secs(10),
            "every node sees the slot moved",
            || async {
                for node in self.nodes.iter().filter(|n| n.is_running()) {
                    let Some(view) = cluster_nodes(node.port()).await else {
                        return false;
                    };
                    if !view
                        .iter()
                        .any(|n| n.port == to && n.is_master() && n.serves(slot))
                    {
                        return false;
                    }
                }
                true
            },
        )
        .await;
    }

    /// Waits until a replica of the master on `old` (killed or frozen) took over its
    /// slots, as every running node sees it, and every running node reports
    /// `cluster_state:ok`; returns the new master's port.
    pub async fn wait_for_failover(&self, old: u16, slot: u16, within: Duration) -> u16 {
        let deadline = Instant::now() + within;
        loop {
            if let Some(new) = self.failed_over(old, slot).await {
                return new;
            }
            assert!(
                Instant::now() < deadline,
                "no failover of {old} within {within:?}; the cluster sees {:?}",
                self.topology().await
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn failed_over(&self, old: u16, slot: u16) -> Option<u16> {
        let mut new = None;
        for node in self.nodes.iter().filter(|n| n.is_running()) {
            let view = cluster_nodes(node.port()).await?;
            let master = view
                .iter()
                .find(|n| n.is_master() && n.serves(slot) && !n.is_failed())?;
            if master.port == old || new.is_some_and(|p| p != master.port) {
                return None;
            }
            new = Some(master.port);
        }
        if self.is_ok().await { new } else { None }
    }
}

/// `CLUSTER <args>` on the node on `port`; `None` when it does not answer.
async fn cluster_query<T: redis::FromRedisValue>(port: u16, args: &[&str]) -> Option<T> {
    let client = redis::Client::open(format!("redis://127.0.0.1:{port}")).ok()?;
    let ask = async {
        let mut conn = client.get_multiplexed_async_connection().await.ok()?;
        redis::cmd("CLUSTER")
            .arg(args)
            .query_async(&mut conn)
            .await
            .ok()
    };
    tokio::time::timeout(Duration::from_millis(500), ask)
        .await
        .ok()
        .flatten()
}

/// `CLUSTER NODES` of the node on `port`, parsed.
async fn cluster_nodes(port: u16) -> Option<Vec<ClusterNode>> {
    let text: String = cluster_query(port, &["NODES"]).await?;
    text.lines().map(ClusterNode::parse).collect()
}

/// A TCP proxy in front of a server whose current connections can be frozen: bytes stop
/// flowing both ways but nothing is closed, as when a network partition or a NAT silently
/// drops a connection. Connections made after a freeze work normally.
pub struct FreezableProxy {
    pub port: u16,
    next_id: std::sync::Arc<std::sync::atomic::AtomicU64>,
    frozen_below: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// Connections whose client-to-server bytes are held back this long.
    slowed: Slowed,
    task: tokio::task::JoinHandle<()>,
}

type Slowed = std::sync::Arc<std::sync::Mutex<std::collections::HashMap<u64, Duration>>>;

impl FreezableProxy {
    pub async fn start(upstream_port: u16) -> Self {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let next_id = Arc::new(AtomicU64::new(0));
        let frozen_below = Arc::new(AtomicU64::new(0));
        let slowed = Slowed::default();
        let (ids, frozen, slow) = (next_id.clone(), frozen_below.clone(), slowed.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let id = ids.fetch_add(1, Ordering::SeqCst);
                let Ok(server) = tokio::net::TcpStream::connect(("127.0.0.1", upstream_port)).await
                else {
                    continue;
                };
                let (client_read, client_write) = client.into_split();
                let (server_read, server_write) = server.into_split();
                let up = Some(slow.clone());
                tokio::spawn(pump(client_read, server_write, id, frozen.clone(), up));
                tokio::spawn(pump(server_read, client_write, id, frozen.clone(), None));
            }
        });
        FreezableProxy {
            port,
            next_id,
            frozen_below,
            slowed,
            task,
        }
    }

    /// How many connections have been made through the proxy; they are numbered from 0
    /// in the order they were accepted.
    pub fn connections(&self) -> u64 {
        self.next_id.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Holds back every byte connection `id` sends to the server by `delay` (a slow
    /// link one way: requests arrive late, replies on time).
    pub fn slow_requests_of(&self, id: u64, delay: Duration) {
        self.slowed.lock().unwrap().insert(id, delay);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Freezes every connection made so far.
    pub fn freeze_existing(&self) {
        use std::sync::atomic::Ordering;
        self.frozen_below
            .store(self.next_id.load(Ordering::SeqCst), Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    id: u64,
    frozen_below: std::sync::Arc<std::sync::atomic::AtomicU64>,
    slowed: Option<Slowed>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let Ok(n) = from.read(&mut buf).await else {
            return;
        };
        if n == 0 {
            return;
        }
        if id < frozen_below.load(std::sync::atomic::Ordering::SeqCst) {
            // Swallow everything from now on, with both sockets kept open.
            std::future::pending::<()>().await;
        }
        let delay = slowed
            .as_ref()
            .and_then(|s| s.lock().unwrap().get(&id).copied());
        if let Some(delay) = delay {
            tokio::time::sleep(delay).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

impl Drop for FreezableProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A slot migration opened by [`RedisCluster::open_migration`].
pub struct Migration {
    pub slot: u16,
    /// The master the slot is moving from.
    pub from: u16,
    /// The master the slot is moving to.
    pub to: u16,
    to_id: String,
}

impl Migration {
    /// `CLUSTER SETSLOT <slot> <state> <id>` on the node on `port`.
    async fn set_slot(&self, port: u16, state: &str, id: &str) {
        let slot = self.slot.to_string();
        let args = ["SETSLOT", slot.as_str(), state, id];
        let ok: Option<String> = cluster_query(port, &args).await;
        assert_eq!(ok.as_deref(), Some("OK"), "CLUSTER {args:?} on {port}");
    }
}
