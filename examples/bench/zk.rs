//! The bench on ZooKeeper (`--url zk://host:port[,host:port][/chroot]`): the run's
//! scratch node, the server's packet counter, and the baseline — a bare lock in
//! Curator's layout written directly on the `zookeeper-client` crate.
//!
//! Every run works under a scratch node of its own, `/tower-lock-bench-<pid>-<random>`
//! below the URL's chroot (which must exist), given to the run as its chroot: tower-lock's
//! locks are under its default root there (`/tower-lock/bench:w1:0`, ...), the
//! baseline's under `/baseline`. The scratch node and everything below it are deleted
//! when the run ends, failed or not (an interrupted run leaves it behind: delete it by
//! that name, or let the server's container reaper take what is below it).
//!
//! Round trips are counted on the server: `zk_packets_received` of the four-letter
//! command `mntr` on every host of the URL, summed, before and after the measured loop
//! (so the sessions' set-up is left out). The server counts every request of every
//! client, pings included: run nothing else against it. Without `mntr` (not in
//! `4lw.commands.whitelist`) the lines carry `null`.

use std::time::Duration;

use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[cfg(feature = "zookeeper")]
pub use with_client::*;

/// Whether `url` is a ZooKeeper URL (`zk://...`).
pub fn is_zk(url: &str) -> bool {
    url.get(..5)
        .is_some_and(|scheme| scheme.eq_ignore_ascii_case("zk://"))
}

/// `url` cut into its hosts (`host:port,host:port`) and its chroot (`/path`, or empty).
fn split(url: &str) -> (&str, &str) {
    let rest = url.get(5..).filter(|_| is_zk(url)).unwrap_or(url);
    match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    }
}

/// What the ZooKeeper servers received per cycle.
#[derive(Serialize)]
pub struct ZkCost {
    /// Requests the servers received per cycle (`mntr`'s `zk_packets_received`, summed
    /// over the URL's hosts); `null` when `mntr` does not answer.
    pub zk_packets_per_cycle: Option<f64>,
}

/// The servers' packet counter at the start of a run.
pub struct Packets {
    hosts: Vec<String>,
    before: Option<u64>,
}

impl Packets {
    /// Reads the counter of every host of `url`.
    pub async fn start(url: &str) -> Self {
        let hosts: Vec<String> = split(url).0.split(',').map(str::to_owned).collect();
        let before = packets_received(&hosts).await;
        Packets { hosts, before }
    }

    /// The packets received per cycle since [`start`](Self::start).
    pub async fn finish(self, cycles: u64) -> ZkCost {
        let after = packets_received(&self.hosts).await;
        let per_cycle = match (self.before, after) {
            (Some(before), Some(after)) => Some(crate::per_cycle(
                after.saturating_sub(before) as f64,
                cycles,
            )),
            _ => None,
        };
        ZkCost {
            zk_packets_per_cycle: per_cycle,
        }
    }
}

/// The sum of `zk_packets_received` over `hosts`, or `None` if one does not answer
/// `mntr` within a second.
async fn packets_received(hosts: &[String]) -> Option<u64> {
    let mut sum = 0;
    for host in hosts {
        let mntr = four_letter(host, "mntr").await?;
        sum += mntr.lines().find_map(|line| {
            let value = line.strip_prefix("zk_packets_received")?;
            value.trim().parse::<u64>().ok()
        })?;
    }
    Some(sum)
}

/// The answer to the four-letter command `cmd` from `host` (`host:port`).
async fn four_letter(host: &str, cmd: &str) -> Option<String> {
    let ask = async {
        let mut conn = tokio::net::TcpStream::connect(host).await.ok()?;
        conn.write_all(cmd.as_bytes()).await.ok()?;
        let mut answer = String::new();
        conn.read_to_string(&mut answer).await.ok()?;
        Some(answer)
    };
    tokio::time::timeout(Duration::from_secs(1), ask)
        .await
        .ok()
        .flatten()
}

/// What needs the client crate (feature `zookeeper`).
#[cfg(feature = "zookeeper")]
mod with_client {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    use tower_lock::ZooKeeperBackend;
    use zookeeper_client as zk;

    use super::split;
    use crate::{Args, W1Line, join_samples, latencies, micros, shown, w1_line};

    /// The session timeout of every session of the bench, tower-lock's and the
    /// baseline's: tower-lock's default.
    const SESSION_TIMEOUT: Duration = tower_lock::backend::zookeeper::DEFAULT_SESSION_TIMEOUT;

    /// Where the baseline's lock directories are, below the run's chroot.
    const BASELINE_DIR: &str = "/baseline";

    /// A session on the ensemble of `url` (its chroot included).
    pub async fn client(url: &str) -> Result<zk::Client, String> {
        let (hosts, chroot) = split(url);
        zk::Client::connector()
            .with_session_timeout(SESSION_TIMEOUT)
            .connect(&format!("{hosts}{chroot}"))
            .await
            .map_err(|e| format!("connecting to {}: {e}", shown(url)))
    }

    /// A `ZooKeeperBackend` on `url`, with its default settings.
    pub async fn backend(url: &str) -> Result<ZooKeeperBackend, String> {
        ZooKeeperBackend::connect(url)
            .await
            .map_err(|e| format!("ZooKeeper locks at {}: {e}", shown(url)))
    }

    /// A scratch node for one run: its path below the URL's chroot, and the URL that
    /// makes it the run's chroot.
    pub async fn make_scratch(url: &str) -> Result<(String, String), String> {
        let name = format!(
            "/tower-lock-bench-{}-{:08x}",
            std::process::id(),
            fastrand::u32(..)
        );
        let admin = client(url).await?;
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        admin
            .create(&name, b"", &persistent)
            .await
            .map_err(|e| format!("creating the scratch node {name}: {e}"))?;
        let (hosts, chroot) = split(url);
        Ok((name.clone(), format!("zk://{hosts}{chroot}{name}")))
    }

    /// Deletes the scratch node `name` and everything below it.
    pub async fn remove_scratch(url: &str, name: &str) -> Result<(), String> {
        let admin = client(url).await?;
        remove_tree(&admin, name)
            .await
            .map_err(|e| format!("deleting the scratch node {name}: {e}"))
    }

    /// Deletes `root` and its descendants: lists them level by level, then deletes
    /// them deepest first, many calls in flight at once.
    async fn remove_tree(client: &zk::Client, root: &str) -> Result<(), zk::Error> {
        const IN_FLIGHT: usize = 256;
        let mut levels = vec![vec![root.to_owned()]];
        loop {
            let mut below = Vec::new();
            for chunk in levels[levels.len() - 1].chunks(IN_FLIGHT) {
                let lists =
                    futures_util::future::join_all(chunk.iter().map(|p| client.list_children(p)))
                        .await;
                for (parent, list) in chunk.iter().zip(lists) {
                    match list {
                        Ok(children) => {
                            below.extend(children.into_iter().map(|c| format!("{parent}/{c}")));
                        }
                        Err(zk::Error::NoNode) => {}
                        Err(error) => return Err(error),
                    }
                }
            }
            if below.is_empty() {
                break;
            }
            levels.push(below);
        }
        for level in levels.iter().rev() {
            for chunk in level.chunks(IN_FLIGHT) {
                let deleted =
                    futures_util::future::join_all(chunk.iter().map(|p| client.delete(p, None)))
                        .await;
                for outcome in deleted {
                    match outcome {
                        Ok(()) | Err(zk::Error::NoNode) => {}
                        Err(error) => return Err(error),
                    }
                }
            }
        }
        Ok(())
    }

    /// The baseline's sessions for `workers` workers: one they share, or
    /// (`--backend-per-worker`) one each.
    pub async fn sessions(args: &Args, workers: usize) -> Result<Vec<zk::Client>, String> {
        let n = if args.backend_per_worker { workers } else { 1 };
        let mut sessions = Vec::with_capacity(n);
        for _ in 0..n {
            sessions.push(client(&args.url).await?);
        }
        Ok(sessions)
    }

    /// The baseline's lock on `dir`: `Client::lock` with Curator's prefix (an
    /// ephemeral sequential `_c_<uuid>-lock-<n>`, the lowest holds, a waiter watches the
    /// node before its own), the directory made as a container node if missing.
    async fn lock<'c>(client: &'c zk::Client, dir: &str) -> Result<zk::LockClient<'c>, zk::Error> {
        let options = zk::LockOptions::new(zk::Acls::anyone_all())
            .with_ancestor_options(zk::CreateMode::Container.with_acls(zk::Acls::anyone_all()))?;
        client
            .lock(zk::LockPrefix::new_curator(dir, "lock-")?, b"", options)
            .await
    }

    /// Releases a baseline lock: its node deleted by `LockClient::delete` (one multi:
    /// "the lock node is there" and its delete), awaited, as tower-lock's unlock is. The
    /// `LockClient` is dropped after, and its drop sends a delete of its own in the
    /// background, which finds nothing (`NoNode`): one more request the server counts.
    async fn unlock(lock: zk::LockClient<'_>) -> Result<(), zk::Error> {
        let path = lock.lock_path().to_owned();
        lock.delete(&path, None).await
    }

    /// w1 for the baseline: each worker locks and unlocks a directory of its own (a new
    /// one every cycle with `--fresh-keys`).
    pub async fn w1_baseline(args: &Args) -> Result<W1Line, String> {
        let sessions = sessions(args, args.workers).await?;
        let meter = super::Packets::start(&args.url).await;
        // Fresh directories carry the run's own tag, as tower-lock's fresh keys do.
        let run_tag = fastrand::u32(..);
        let deadline = Instant::now() + Duration::from_secs_f64(args.seconds);
        let failures = Arc::new(AtomicU64::new(0));
        let started = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..args.workers {
            let client = sessions[w % sessions.len()].clone();
            let failures = failures.clone();
            let fresh = args.fresh_keys;
            let mut samples = latencies()?;
            tasks.push(tokio::spawn(async move {
                let own = format!("{BASELINE_DIR}/w1:{w}");
                let fresh_prefix = format!("{own}:{run_tag:08x}");
                let mut n = 0u64;
                while Instant::now() < deadline {
                    let t0 = Instant::now();
                    let fresh_dir;
                    let dir = if fresh {
                        n += 1;
                        fresh_dir = format!("{fresh_prefix}:{n}");
                        &fresh_dir
                    } else {
                        &own
                    };
                    let Ok(held) = lock(&client, dir).await else {
                        failures.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    if unlock(held).await.is_err() {
                        failures.fetch_add(1, Ordering::Relaxed);
                    }
                    samples.saturating_record(micros(t0.elapsed()));
                }
                samples
            }));
        }
        let samples = join_samples(tasks).await?;
        let elapsed = started.elapsed().as_secs_f64();
        let cost = meter.finish(samples.len()).await;
        let mut line = w1_line(
            args,
            elapsed,
            samples,
            failures.load(Ordering::Relaxed),
            None,
        );
        line.zk = Some(cost);
        Ok(line)
    }

    /// A w2 worker's baseline lock on the one key, on its session.
    pub struct CuratorLock {
        client: zk::Client,
        dir: String,
    }

    /// A held [`CuratorLock`].
    pub struct CuratorHeld(zk::OwnedLockClient);

    impl CuratorLock {
        pub fn new(client: zk::Client) -> Self {
            CuratorLock {
                client,
                dir: format!("{BASELINE_DIR}/w2"),
            }
        }

        pub async fn lock(&self) -> Result<CuratorHeld, ()> {
            let held = lock(&self.client, &self.dir).await.map_err(drop)?;
            Ok(CuratorHeld(held.into_owned()))
        }

        pub async fn unlock(&self, held: CuratorHeld) -> Result<(), ()> {
            let path = held.0.lock_path().to_owned();
            held.0.delete(&path, None).await.map_err(drop)
        }
    }
}
