//! The ZooKeeper backend under faults, on real servers and real processes: a holder
//! frozen past its session, a session expired under a held guard, a standalone server
//! restarted, an ensemble losing its leader, a client cut off from the ensemble, and a
//! grant answered in a session the backend had given up. Each asserts that two holders
//! never believe they hold one lock (a shared counter that comes out exact and hold
//! intervals that never overlap, or in-test guards checked against their lost signal),
//! and prints what it measured (`--nocapture`). Then what a node needs that a store
//! lease gives the other backends: nothing left behind by a call cut off, a permit
//! dropped mid-creation, or callers on runtimes that end (the history checker's
//! findings, `history_zookeeper.rs`).
//!
//! The backend's fault model (`src/backend/zookeeper/session.rs`): the session is the
//! lease. The client declares its connection dead two fifths of the session timeout
//! after it last heard from the server; the backend gives the session up a third of the
//! session timeout after that, fires its `StoreLoss` (every hold granted in it is lost
//! at once) and makes a new session; the ensemble expires a session a session timeout
//! after it last heard from its client, and only then can another client have the lock.

use crate::common;

use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use common::curator::CounterFile;
use common::proxy::{Direction, FaultProxy, Flow};
use common::wait_until;
use common::zookeeper::{ZkEnsemble, ZkServer, pause_process, resume_process};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::time::Instant;
use tower_lock::{Error, Lease, LockClient, ZooKeeperBackend};
use zookeeper_client as zk;

/// Long enough for a process to start and connect on a loaded two-core machine.
const START: Duration = Duration::from_secs(30);

fn epoch_micros() -> u64 {
    let since = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap();
    u64::try_from(since.as_micros()).unwrap()
}

fn micros(d: u64) -> Duration {
    Duration::from_micros(d)
}

/// A root path of the test's own on a shared server.
fn fresh_root(what: &str) -> String {
    format!("/{what}-{}", uuid::Uuid::new_v4())
}

// ───────────────────────────── hammer processes ─────────────────────────────

/// One line a `hammer --events` printed: its word and its times (µs since the epoch).
#[derive(Clone, Debug)]
struct Event {
    word: String,
    us: Vec<u64>,
}

/// A `hammer` process whose events are collected as they come.
struct Hammer {
    child: tokio::process::Child,
    /// Every event so far, and whether its output has ended.
    events: Arc<Mutex<(Vec<Event>, bool)>>,
    more: Arc<tokio::sync::Notify>,
    stdout: tokio::task::JoinHandle<()>,
    /// What it wrote to stderr so far; the task that reads it.
    stderr: Arc<Mutex<String>>,
    stderr_task: tokio::task::JoinHandle<()>,
}

impl Hammer {
    /// `hammer --url zk://<hosts> --zk-root <root> --name k --counter-url file:<counter>
    /// --counter-key x --iters <iters> --events`, then `extra`.
    fn spawn(hosts: &str, root: &str, counter: &CounterFile, iters: u64, extra: &[&str]) -> Self {
        let mut child = tokio::process::Command::new(common::example_binary("hammer"))
            .args(["--url", &format!("zk://{hosts}"), "--zk-root", root])
            .args(["--name", "k", "--counter-key", "x", "--events"])
            .arg("--counter-url")
            .arg(format!("file:{}", counter.path().display()))
            .args(["--iters", &iters.to_string()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn the hammer");
        let events = Arc::new(Mutex::new((Vec::new(), false)));
        let more = Arc::new(tokio::sync::Notify::new());
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let stdout = tokio::spawn({
            let (events, more) = (Arc::clone(&events), Arc::clone(&more));
            async move {
                while let Ok(Some(line)) = lines.next_line().await {
                    let mut words = line.split(' ');
                    let word = words.next().unwrap_or_default().to_owned();
                    let us = words.filter_map(|w| w.parse().ok()).collect();
                    events.lock().unwrap().0.push(Event { word, us });
                    more.notify_waiters();
                }
                events.lock().unwrap().1 = true;
                more.notify_waiters();
            }
        });
        let mut err = BufReader::new(child.stderr.take().unwrap()).lines();
        let stderr = Arc::new(Mutex::new(String::new()));
        let stderr_task = tokio::spawn({
            let stderr = Arc::clone(&stderr);
            async move {
                while let Ok(Some(line)) = err.next_line().await {
                    let mut text = stderr.lock().unwrap();
                    text.push_str(&line);
                    text.push('\n');
                }
            }
        });
        Hammer {
            child,
            events,
            more,
            stdout,
            stderr,
            stderr_task,
        }
    }

    fn pid(&self) -> u32 {
        self.child.id().expect("the hammer runs")
    }

    fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().0.clone()
    }

    /// Waits until the events so far satisfy `done`; panics after `within`, or if the
    /// process ended first.
    async fn wait_for(&self, within: Duration, what: &str, done: impl Fn(&[Event]) -> bool) {
        let deadline = Instant::now() + within;
        loop {
            let more = self.more.notified();
            let ended = {
                let events = self.events.lock().unwrap();
                if done(&events.0) {
                    return;
                }
                events.1
            };
            if ended {
                tokio::time::sleep(Duration::from_millis(200)).await;
                panic!(
                    "{what}: the hammer ended first; events: {:?}; stderr: {}",
                    self.events(),
                    self.stderr.lock().unwrap()
                );
            }
            if tokio::time::timeout_at(deadline, more).await.is_err() {
                panic!("{what}: not within {within:?}; events: {:?}", self.events());
            }
        }
    }

    /// The first event `word`; panics after `within`.
    async fn expect(&self, word: &str, within: Duration) -> Event {
        self.wait_for(within, &format!("a `{word}` line"), |events| {
            events.iter().any(|e| e.word == word)
        })
        .await;
        self.events().into_iter().find(|e| e.word == word).unwrap()
    }

    /// Waits for the process to exit: its status, every event and its stderr.
    async fn finish(mut self, within: Duration) -> (ExitStatus, Vec<Event>, String) {
        let status = tokio::time::timeout(within, self.child.wait())
            .await
            .unwrap_or_else(|_| panic!("the hammer did not finish within {within:?}"))
            .unwrap();
        let _ = (&mut self.stdout).await;
        let _ = (&mut self.stderr_task).await;
        let stderr = self.stderr.lock().unwrap().clone();
        (status, self.events(), stderr)
    }
}

/// Each completed hold's (`acquired`, `released` before the unlock began) times.
fn holds(events: &[Event]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut since = None;
    for e in events {
        match e.word.as_str() {
            "acquired" => since = Some(e.us[0]),
            "released" => out.push((since.take().expect("released after acquired"), e.us[0])),
            _ => {}
        }
    }
    out
}

/// Panics if two of `holds` overlap in time.
fn assert_no_overlap(mut holds: Vec<(u64, u64)>) {
    holds.sort_unstable();
    for pair in holds.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "two holds overlap: {:?} and {:?}",
            pair[0],
            pair[1]
        );
    }
}

// ───────────────────────────── a: session expiry ─────────────────────────────

/// A `hammer` holding the lock is frozen (SIGSTOP) past its 2 s session: the ensemble
/// expires the session and a second hammer, queued behind it, takes the lock about a
/// session timeout after the freeze. Thawed, the frozen hammer finds its lock lost (the
/// session's loss, not its 30 s watchdog lease) and stops before it writes the counter:
/// the count is exactly the other's, and no two completed holds overlap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hammer_frozen_past_its_session_loses_the_lock_and_writes_nothing() {
    const ITERS: u64 = 40;
    let session = Duration::from_secs(2);
    let server = common::zookeeper::shared().await;
    let root = fresh_root("frozen");
    let counter = CounterFile::new();
    let hosts = server.connect_string();
    let session_ms = session.as_millis().to_string();
    let frozen = Hammer::spawn(
        &hosts,
        &root,
        &counter,
        1,
        &["--session-ms", &session_ms, "--hold-us", "60000000"],
    );
    let acquired = frozen.expect("acquired", START).await;
    let other = Hammer::spawn(
        &hosts,
        &root,
        &counter,
        ITERS,
        &["--session-ms", &session_ms],
    );
    let lock_dir = format!("{root}/k/");
    wait_until(
        START,
        "the other hammer waits on the holder's node",
        || async {
            let watched = server.server().watched_paths().await;
            watched.iter().any(|p| p.starts_with(&lock_dir))
        },
    )
    .await;

    pause_process(frozen.pid());
    let frozen_at = epoch_micros();
    let taken = other.expect("acquired", Duration::from_secs(20)).await;
    let taken_after = micros(taken.us[0].saturating_sub(frozen_at));
    println!(
        "frozen holder: the lock was taken {taken_after:?} after the freeze (session {session:?})"
    );
    // The server last heard from the holder at most a ping interval (3/20 of the
    // session) before the freeze, and expires sessions on its 200 ms tick.
    assert!(
        taken_after >= session * 3 / 4,
        "taken {taken_after:?} after the freeze: before the session could expire"
    );
    assert!(
        taken_after <= session + Duration::from_secs(3),
        "taken {taken_after:?} after the freeze: the expired session's node stayed"
    );
    let (status, other_events, stderr) = other.finish(Duration::from_secs(60)).await;
    assert!(status.success(), "the other hammer failed: {stderr}");

    resume_process(frozen.pid());
    let thawed_at = epoch_micros();
    let lost = frozen.expect("lost", Duration::from_secs(10)).await;
    let lost_after = micros(lost.us[0].saturating_sub(thawed_at));
    println!("frozen holder: lost signal {lost_after:?} after the thaw");
    assert!(
        lost_after < Duration::from_secs(3),
        "the thawed holder heard of its expired session {lost_after:?} after the thaw"
    );
    let (status, frozen_events, stderr) = frozen.finish(Duration::from_secs(10)).await;
    assert_eq!(status.code(), Some(1), "the thawed holder: {stderr}");
    assert!(stderr.contains("lost"), "the thawed holder said: {stderr}");
    assert!(
        !frozen_events.iter().any(|e| e.word == "released"),
        "the thawed holder released a lock it had lost: {frozen_events:?}"
    );
    assert!(acquired.us[0] < frozen_at);

    assert_eq!(counter.read(), ITERS, "an increment was lost or made twice");
    let other_holds = holds(&other_events);
    assert_eq!(other_holds.len() as u64, ITERS);
    assert!(other_holds.iter().all(|&(from, _)| from > frozen_at));
    assert_no_overlap(other_holds);
}

/// A guard whose session the server expires is lost at once: its lost signal fires
/// within a second of its client hearing of the expiry, not at the watchdog's next
/// renewal (10 s later, with a 30 s lease) nor a third of the session (4 s) after its
/// connection dropped; its unlock says `Lost`; another session takes the lock at once;
/// and the backend goes on in a new session.
///
/// The session is expired as Curator's tests kill one: a second client takes it over
/// and closes it. The holder's connections go through a proxy that refuses them
/// meanwhile: a client that reconnects takes its session back from the other (the
/// server closes the other's connection), so they would take turns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_whose_session_expired_is_lost_at_once() {
    let session = Duration::from_secs(12);
    let server = common::zookeeper::shared().await;
    let root = fresh_root("expired");
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.server().port()).into()).await;
    let backend = |hosts: String| {
        ZooKeeperBackend::builder(hosts)
            .root(root.clone())
            .session_timeout(session)
            .build()
    };
    let holder = backend(format!("127.0.0.1:{}", proxy.port()))
        .await
        .unwrap();
    let client = LockClient::builder(holder.clone())
        .watchdog_lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let other = LockClient::new(backend(server.connect_string()).await.unwrap());
    let guard = client.get_lock("k").unwrap().lock().await.unwrap();
    let lost = guard.lost();
    let lost_at = tokio::spawn(async move {
        lost.wait().await;
        Instant::now()
    });
    let old_session = holder.session_id();

    proxy.refuse(true);
    proxy.cut();
    let cut = Instant::now();
    let twin = zk::Client::connector()
        .with_session(holder.client().session().clone())
        .with_session_timeout(session)
        .connect(&server.connect_string())
        .await
        .expect("a second client on the holder's session");
    let mut twin_state = twin.state_watcher();
    drop(twin);
    tokio::time::timeout(Duration::from_secs(10), async {
        while twin_state.changed().await != zk::SessionState::Closed {}
    })
    .await
    .expect("the session closed");
    let expired_at = Instant::now();
    proxy.refuse(false);

    let lost_at = tokio::time::timeout(Duration::from_secs(10), lost_at)
        .await
        .expect("the lost signal fired")
        .unwrap();
    let after = lost_at.saturating_duration_since(expired_at);
    println!(
        "expired session: closed on the server {:?} after the holder's connection was cut; \
         the lost signal fired {after:?} after that",
        expired_at - cut
    );
    assert!(
        after < Duration::from_secs(1),
        "lost {after:?} after the expiry"
    );
    assert!(
        lost_at - cut < session / 3,
        "lost {:?} after the cut: the backend gave the session up, it did not hear it expired",
        lost_at - cut
    );
    assert!(guard.is_lost());

    let taken = other.get_lock("k").unwrap().try_lock().await;
    assert!(taken.is_ok(), "the expired session's lock: {taken:?}");
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
    taken.unwrap().unlock().await.unwrap();
    let again = client
        .get_lock("k")
        .unwrap()
        .try_lock_for(Duration::from_secs(5), Lease::Watchdog)
        .await;
    assert!(again.is_ok(), "the backend locks again: {again:?}");
    assert_ne!(holder.session_id(), old_session, "a new session");
    again.unwrap().unlock().await.unwrap();
}

// ───────────────────────────── b: a standalone server restarts ─────────────────────────────

/// Two backends on a server of their own, a holder and a waiter queued behind it.
struct Pair {
    holder: ZooKeeperBackend,
    waiter: ZooKeeperBackend,
    holder_client: LockClient,
    waiter_client: LockClient,
}

impl Pair {
    async fn on(server: &ZkServer, session: Duration) -> Self {
        let backend = || {
            ZooKeeperBackend::builder(server.connect_string())
                .root("/restart")
                .session_timeout(session)
                .build()
        };
        let (holder, waiter) = (backend().await.unwrap(), backend().await.unwrap());
        let client = |b: &ZooKeeperBackend| {
            LockClient::builder(b.clone())
                .watchdog_lease(Duration::from_secs(30))
                .build()
                .unwrap()
        };
        Pair {
            holder_client: client(&holder),
            waiter_client: client(&waiter),
            holder,
            waiter,
        }
    }

    /// A `lock()` of `k` by the waiter, queued once this returns: when it got the lock.
    async fn queue(&self) -> tokio::task::JoinHandle<(Instant, tower_lock::LockGuard)> {
        let lock = self.waiter_client.get_lock("k").unwrap();
        let task = tokio::spawn(async move {
            let guard = lock.lock().await.expect("the waiter's lock");
            (Instant::now(), guard)
        });
        let key = tower_lock::LockKey::new("k").unwrap();
        wait_until(START, "the waiter is queued", || async {
            self.waiter.local_waiters(&key) == 1
        })
        .await;
        task
    }
}

/// Kills the server (SIGKILL) and starts it again on its port and data: when it was
/// killed and when it served again.
async fn restart(server: &mut ZkServer, down: Duration) -> (Instant, Instant) {
    server.stop();
    let killed = Instant::now();
    tokio::time::sleep(down).await;
    server.start_again().await;
    (killed, Instant::now())
}

/// A restart well within a third of the 20 s session: the holder's session survives it,
/// so its guard is never lost and its unlock succeeds, the waiter is granted only after
/// that unlock, and the grant comes once the clients have reconnected. They reconnect
/// on their own, within their sessions, backing off (100 ms, doubled after each try:
/// zookeeper-client's schedule, which nothing can hurry), so the wait after the server
/// answers is up to about as long as the outage was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holders_keep_their_locks_across_a_quick_server_restart() {
    let session = Duration::from_secs(20);
    let mut server = ZkServer::start().await;
    let pair = Pair::on(&server, session).await;
    let guard = pair
        .holder_client
        .get_lock("k")
        .unwrap()
        .lock()
        .await
        .unwrap();
    let waiter = pair.queue().await;

    let (killed, serving) = restart(&mut server, Duration::ZERO).await;
    println!(
        "quick restart: the server served again {:?} after the kill",
        serving - killed
    );
    assert!(
        serving - killed < session / 3,
        "the restart took {:?}: not a quick one",
        serving - killed
    );
    assert!(
        !guard.is_lost(),
        "the holder's guard was lost across the restart"
    );
    let unlocked = Instant::now();
    guard
        .unlock()
        .await
        .expect("the holder still held its lock after the restart");
    let unlocked_after = unlocked.elapsed();
    let (granted, second) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter got the lock")
        .unwrap();
    println!(
        "quick restart: the holder's unlock took {unlocked_after:?}; the waiter was granted {:?} after the server answered",
        granted - serving
    );
    assert!(
        granted >= unlocked,
        "the waiter was granted before the holder unlocked"
    );
    assert!(
        granted - serving < (serving - killed) + Duration::from_secs(1),
        "the first grant came {:?} after the server answered, {:?} after the kill",
        granted - serving,
        granted - killed
    );
    second.unlock().await.unwrap();
}

/// A restart that outlasts a third of the 6 s session: each backend gives its session
/// up a third of the session timeout after its connection dropped, so the holder's guard
/// is lost (its lost signal fires) before the server is even back. Once the server
/// answers, both backends are in new sessions within about a second, and the waiter is
/// granted the lock as soon: the holder's old session, which the server restored from
/// its data, must not keep the lock for a session timeout more (its holder knows it
/// lost it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_past_a_third_of_the_session_reports_the_holds_lost() {
    let session = Duration::from_secs(6);
    let mut server = ZkServer::start().await;
    let pair = Pair::on(&server, session).await;
    let guard = pair
        .holder_client
        .get_lock("k")
        .unwrap()
        .lock()
        .await
        .unwrap();
    let lost = guard.lost();
    let lost_at = tokio::spawn(async move {
        lost.wait().await;
        Instant::now()
    });
    let waiter = pair.queue().await;
    let old_session = pair.holder.session_id();

    let (killed, serving) = restart(&mut server, session / 2).await;
    let lost_at = tokio::time::timeout(Duration::from_secs(10), lost_at)
        .await
        .expect("the holder's guard is lost")
        .unwrap();
    println!(
        "long restart: down {:?}; the holder's lost signal fired {:?} after the kill",
        serving - killed,
        lost_at - killed
    );
    assert!(lost_at < serving, "lost only after the server was back");
    assert!(
        lost_at - killed < session / 3 + Duration::from_secs(1),
        "lost {:?} after the kill",
        lost_at - killed
    );

    let first = tokio::spawn({
        let lock = pair.holder_client.get_lock("fresh").unwrap();
        async move {
            let guard = lock
                .try_lock_for(Duration::from_secs(20), Lease::Watchdog)
                .await
                .expect("a lock in the new session");
            (Instant::now(), guard)
        }
    });
    let (granted, second) = tokio::time::timeout(Duration::from_secs(20), waiter)
        .await
        .expect("the waiter got the lock")
        .unwrap();
    let (fresh_at, fresh) = first.await.unwrap();
    println!(
        "long restart: after the server answered, a fresh lock was granted in {:?}, the waiter in {:?}",
        fresh_at - serving,
        granted - serving
    );
    assert!(
        granted > lost_at,
        "the waiter was granted while the holder believed"
    );
    assert_ne!(pair.holder.session_id(), old_session, "a new session");
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
    for (what, at) in [("a fresh lock", fresh_at), ("the waiter's lock", granted)] {
        assert!(
            at - serving < Duration::from_secs(2),
            "{what} was granted {:?} after the server answered (session {session:?})",
            at - serving
        );
    }
    second.unlock().await.unwrap();
    fresh.unlock().await.unwrap();
}

// ───────────────────────────── c: an ensemble loses its leader ─────────────────────────────

/// Two hammers on a three-node ensemble; its leader is killed (SIGKILL) while they run.
/// The sessions (20 s) outlive the election, so no hold is lost; the counter comes out
/// exact, no two holds overlap, and locks are granted again after the election.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hammers_ride_out_the_loss_of_the_ensembles_leader() {
    const ITERS: u64 = 300;
    let mut ensemble = ZkEnsemble::start(3).await;
    let counter = CounterFile::new();
    let hosts = ensemble.connect_string();
    let extra = ["--session-ms", "20000", "--outage-ok"];
    let hammers: Vec<Hammer> = (0..2)
        .map(|_| Hammer::spawn(&hosts, "/leader", &counter, ITERS, &extra))
        .collect();
    for hammer in &hammers {
        hammer
            .wait_for(START, "a few holds before the kill", |events| {
                events.iter().filter(|e| e.word == "released").count() >= 20
            })
            .await;
    }

    let leader = ensemble.leader().await;
    ensemble.kill(leader);
    let killed_at = epoch_micros();
    let killed = Instant::now();
    let new_leader = ensemble.leader().await;
    println!(
        "leader loss: node {new_leader} leads {:?} after node {leader} was killed",
        killed.elapsed()
    );

    let mut all_holds = Vec::new();
    let mut after_kill = Vec::new();
    for hammer in hammers {
        let (status, events, stderr) = hammer.finish(Duration::from_secs(120)).await;
        assert!(status.success(), "a hammer failed: {stderr}");
        if !stderr.is_empty() {
            println!("leader loss: a hammer said: {}", stderr.trim());
        }
        after_kill.extend(
            events
                .iter()
                .filter(|e| e.word == "acquired" && e.us[0] > killed_at)
                .map(|e| e.us[0]),
        );
        all_holds.extend(holds(&events));
    }
    assert_eq!(
        counter.read(),
        2 * ITERS,
        "an increment was lost or made twice"
    );
    assert_eq!(all_holds.len() as u64, 2 * ITERS);
    assert_no_overlap(all_holds);
    let next = after_kill
        .iter()
        .min()
        .expect("locks granted after the kill");
    println!(
        "leader loss: the next grant came {:?} after the kill; {} grants after it",
        micros(next - killed_at),
        after_kill.len()
    );
}

// ───────────────────────────── d: a client cut off ─────────────────────────────

/// A holder behind a fault proxy and a waiter straight on the server; the waiter is
/// queued on the holder's node. Returns the backends' clients and the holder's guard.
struct CutOff {
    proxy: FaultProxy,
    guard: tower_lock::LockGuard,
    waiter: tokio::task::JoinHandle<(Instant, tower_lock::LockGuard)>,
    /// When the holder's client next left `SyncConnected`.
    disconnected: tokio::task::JoinHandle<Instant>,
    /// When the holder's guard was lost.
    lost: tokio::task::JoinHandle<Instant>,
    _backends: (ZooKeeperBackend, ZooKeeperBackend),
    _server: common::zookeeper::ZkLease,
}

impl CutOff {
    async fn start(session: Duration) -> Self {
        let server = common::zookeeper::shared().await;
        let root = fresh_root("cut-off");
        let proxy = FaultProxy::start(([127, 0, 0, 1], server.server().port()).into()).await;
        let backend = |hosts: String| {
            ZooKeeperBackend::builder(hosts)
                .root(root.clone())
                .session_timeout(session)
                .build()
        };
        let holder = backend(format!("127.0.0.1:{}", proxy.port()))
            .await
            .unwrap();
        let waiter_backend = backend(server.connect_string()).await.unwrap();
        // A lease far past the test: only the session can end the hold.
        let client = |b: &ZooKeeperBackend| {
            LockClient::builder(b.clone())
                .watchdog_lease(Duration::from_secs(120))
                .build()
                .unwrap()
        };
        let guard = client(&holder).get_lock("k").unwrap().lock().await.unwrap();
        let lock = client(&waiter_backend).get_lock("k").unwrap();
        let waiter = tokio::spawn(async move {
            let guard = lock.lock().await.expect("the waiter's lock");
            (Instant::now(), guard)
        });
        let key = tower_lock::LockKey::new("k").unwrap();
        wait_until(START, "the waiter is queued", || async {
            waiter_backend.local_waiters(&key) == 1
        })
        .await;
        let mut states = holder.client().state_watcher();
        let disconnected = tokio::spawn(async move {
            while states.changed().await == zk::SessionState::SyncConnected {}
            Instant::now()
        });
        let lost = guard.lost();
        let lost = tokio::spawn(async move {
            lost.wait().await;
            Instant::now()
        });
        CutOff {
            proxy,
            guard,
            waiter,
            disconnected,
            lost,
            _backends: (holder, waiter_backend),
            _server: server,
        }
    }

    /// Waits for the lost signal and the waiter's grant after the cut at `cut`: the
    /// signal must come a third of `session` after the connection dropped, and before
    /// the waiter's grant, which needs the ensemble to expire the session.
    async fn check(self, cut: Instant, session: Duration, what: &str) {
        let disconnected = tokio::time::timeout(session * 2, self.disconnected)
            .await
            .expect("the holder's connection dropped")
            .unwrap();
        let lost = tokio::time::timeout(session * 2, self.lost)
            .await
            .expect("the holder's guard is lost")
            .unwrap();
        let (granted, second) = tokio::time::timeout(session * 3, self.waiter)
            .await
            .expect("the waiter got the lock")
            .unwrap();
        println!(
            "{what}: session {session:?}; the client saw its connection drop {:?} after the cut, \
             the lost signal {:?} after that ({:?} after the cut), the other client's grant {:?} \
             after the cut ({:?} after the lost signal)",
            disconnected - cut,
            lost - disconnected,
            lost - cut,
            granted - cut,
            granted - lost
        );
        let grace = session / 3;
        assert!(
            lost - disconnected >= grace.saturating_sub(Duration::from_millis(50)),
            "given up {:?} after the connection dropped: before a third of the session",
            lost - disconnected
        );
        assert!(
            lost - disconnected < grace + Duration::from_secs(1),
            "given up {:?} after the connection dropped",
            lost - disconnected
        );
        assert!(
            granted > lost + Duration::from_secs(1),
            "the other client was granted {:?} after the holder's loss, not a second later",
            granted.saturating_duration_since(lost)
        );
        assert!(matches!(self.guard.unlock().await, Err(Error::Lost)));
        second.unlock().await.unwrap();
        drop(self.proxy);
    }
}

/// The holder's connections are reset and new ones refused: its client sees the drop at
/// once, the backend gives the session up a third of the 6 s session later (its lost
/// signal fires), and the ensemble expires the session, so the other client takes the
/// lock, a session timeout after the cut: seconds after the holder knew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_cut_off_gives_its_session_up_before_the_ensemble_expires_it() {
    let session = Duration::from_secs(6);
    let cut_off = CutOff::start(session).await;
    cut_off.proxy.refuse(true);
    cut_off.proxy.cut();
    let cut = Instant::now();
    cut_off.check(cut, session, "cut off").await;
}

/// The holder's traffic is thrown away, both ways, on its connection and any new one
/// (a blackhole): its client notices only when two fifths of the 9 s session pass
/// without an answer; the backend gives the session up a third of the session after
/// that, still before the ensemble expires it and the other client takes the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_blackholed_gives_its_session_up_before_the_ensemble_expires_it() {
    let session = Duration::from_secs(9);
    let cut_off = CutOff::start(session).await;
    cut_off.proxy.set_flow(Direction::Up, Flow::Discard);
    cut_off.proxy.set_flow(Direction::Down, Flow::Discard);
    let cut = Instant::now();
    cut_off.check(cut, session, "blackholed").await;
}

// ───────────────────────────── e: a grant from a session given up ─────────────────────────────

/// The holder's backend gives its session up while an acquisition of it waits, in that
/// session's client, for the connection to come back; the old client reconnects (its
/// session is still alive on the server) after the backend has made a new session, and
/// its answers grant the lock in the old session. That grant must not be believed: the
/// old session is the backend's no more, and it ends (closed, or expired) while the
/// guard would hold. Sequence: the old client's reconnection is held in the proxy (a
/// trap on its session id, which only its connect request carries) past the backend's
/// grace; the backend's new session connects; the old client's next reconnection goes
/// through, a connection timeout (4 s) after the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_answered_in_a_session_given_up_is_never_believed() {
    let session = Duration::from_secs(10);
    let server = common::zookeeper::shared().await;
    let root = fresh_root("given-up");
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.server().port()).into()).await;
    let holder = ZooKeeperBackend::builder(format!("127.0.0.1:{}", proxy.port()))
        .root(root.clone())
        .session_timeout(session)
        .response_timeout(Duration::from_secs(8))
        .build()
        .await
        .unwrap();
    let other = LockClient::new(
        ZooKeeperBackend::builder(server.connect_string())
            .root(root.clone())
            .build()
            .await
            .unwrap(),
    );
    let client = LockClient::new(holder.clone());
    let old = holder.session_id();

    let trap = proxy.trap(Direction::Up, &old.to_be_bytes());
    proxy.cut();
    let lock = client.get_lock("k").unwrap();
    let attempt = tokio::spawn(async move {
        lock.try_lock_for(
            Duration::from_secs(20),
            Lease::Fixed(Duration::from_secs(60)),
        )
        .await
    });
    tokio::time::timeout(Duration::from_secs(10), trap.caught())
        .await
        .expect("the old client's reconnection was caught");
    wait_until(
        Duration::from_secs(10),
        "the backend made a new session",
        || async { holder.session_id() != old },
    )
    .await;
    trap.discard();

    let guard = match tokio::time::timeout(Duration::from_secs(30), attempt)
        .await
        .expect("the attempt ended")
        .unwrap()
    {
        Ok(guard) => guard,
        Err(e) => {
            println!("given-up session: the attempt failed ({e}), which is safe");
            return;
        }
    };
    // For two seconds: whenever the guard is believed, nobody else gets the lock.
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        if !guard.is_lost() {
            let taken = other.get_lock("k").unwrap().try_lock().await;
            if let Ok(taken) = taken {
                let believed = !guard.is_lost();
                taken.unlock().await.unwrap();
                assert!(
                    !believed,
                    "two holders: the guard granted in session {old:#x} is believed while \
                     another client holds its lock (the backend is in session {:#x})",
                    holder.session_id()
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    println!(
        "given-up session: the grant was {}",
        if guard.is_lost() {
            "lost"
        } else {
            "kept, in the new session"
        }
    );
    let _ = guard.unlock().await;
}

// ───────────────────────────── f: a connection reset under a call ─────────────────────────────

/// A connection reset while a call is in flight is an outage, as any connection lost:
/// the acquisition whose request was on the wire goes on (the lock core takes back
/// what that request may have done and tries again once the client has reconnected)
/// and gets the lock, rather than failing as an unexpected answer of the store. The
/// request is held in the proxy (a trap on the lock's path), then every connection is
/// reset: the client's read fails with "connection reset by peer".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_reset_under_a_call_is_an_outage() {
    let server = common::zookeeper::shared().await;
    let root = fresh_root("reset");
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.server().port()).into()).await;
    let backend = ZooKeeperBackend::builder(format!("127.0.0.1:{}", proxy.port()))
        .root(root.clone())
        .session_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let lock_dir = backend.path_of(&tower_lock::LockKey::new("k").unwrap());

    let trap = proxy.trap(Direction::Up, lock_dir.as_bytes());
    let lock = client.get_lock("k").unwrap();
    let attempt = tokio::spawn(async move {
        lock.try_lock_for(Duration::from_secs(10), Lease::Watchdog)
            .await
    });
    tokio::time::timeout(Duration::from_secs(10), trap.caught())
        .await
        .expect("the acquisition's request was caught");
    proxy.cut();
    let cut = Instant::now();
    trap.discard();
    let guard = tokio::time::timeout(Duration::from_secs(15), attempt)
        .await
        .expect("the attempt ended")
        .unwrap()
        .expect("the lock, once the client had reconnected");
    println!(
        "reset under a call: the lock was granted {:?} after the reset",
        cut.elapsed()
    );
    assert!(!guard.is_lost());
    guard.unlock().await.unwrap();
}

// ───────────────────────────── g: a permit given up while its lease node is made ─────────────────────────────

/// A permit acquisition dropped while the creation of its lease node is on the wire
/// leaves no lease behind: the lock core abandons the hold, and the abandon finds the
/// node by its protected uuid (the session answers in order, so the creation is done
/// when the search is), besides deleting the semaphore's gate node it knows. The
/// creation is held in the proxy (a trap on the leases' path) until the acquisition has
/// been dropped. Found by the history checker (seed 37): a lease node left for as long as
/// its session, a permit taken for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_permit_dropped_while_its_lease_is_made_leaves_no_lease() {
    let server = common::zookeeper::shared().await;
    let root = fresh_root("permit-dropped");
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.server().port()).into()).await;
    let backend = ZooKeeperBackend::builder(format!("127.0.0.1:{}", proxy.port()))
        .root(root.clone())
        .session_timeout(Duration::from_secs(10))
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let key = tower_lock::LockKey::new("k").unwrap();
    let leases = format!("{}/leases", backend.path_of(&key));

    // A permit taken and returned first: the semaphore's directories exist, so the
    // caught creation is the one that makes the lease node.
    let permit = client.get_permits("k", 2).unwrap();
    permit.try_lock().await.unwrap().unlock().await.unwrap();
    let trap = proxy.trap(Direction::Up, format!("{leases}/").as_bytes());
    let attempt = tokio::spawn(async move {
        permit
            .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
            .await
    });
    tokio::time::timeout(Duration::from_secs(10), trap.caught())
        .await
        .expect("the lease node's creation was caught");
    attempt.abort();
    assert!(attempt.await.unwrap_err().is_cancelled());
    // The abandon's requests queue behind the held creation, on the same connection.
    tokio::time::sleep(Duration::from_millis(300)).await;
    trap.release();

    let direct = ZooKeeperBackend::builder(server.connect_string())
        .root(root.clone())
        .build()
        .await
        .unwrap();
    let reader = direct.client();
    let gates = format!("{}/locks", backend.path_of(&key));
    wait_until(
        Duration::from_secs(5),
        "no lease or mutex node is left",
        || async {
            reader
                .list_children(&leases)
                .await
                .unwrap_or_default()
                .is_empty()
                && reader
                    .list_children(&gates)
                    .await
                    .unwrap_or_default()
                    .is_empty()
        },
    )
    .await;
    // Both permits are free.
    let other = LockClient::new(direct.clone());
    let first = other.get_permits("k", 2).unwrap().try_lock().await.unwrap();
    let second = other.get_permits("k", 2).unwrap().try_lock().await.unwrap();
    first.unlock().await.unwrap();
    second.unlock().await.unwrap();
}

// ───────────────────────────── h: callers on runtimes that end ─────────────────────────────

/// Runs `body` on a current-thread runtime of a thread of its own, which is shut down
/// as soon as `body` returns: whatever it spawned and left never runs.
fn on_a_runtime_that_ends(body: impl std::future::Future<Output = ()> + Send + 'static) {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(body);
    })
    .join()
    .unwrap();
}

/// The response timeout of [`behind_a_proxy`]'s backend.
const RESPONSE_TIMEOUT: Duration = Duration::from_millis(300);

/// A backend through a proxy, its client, and the lock directory of key `k`, made.
async fn behind_a_proxy(
    server: &common::zookeeper::ZkLease,
    root: &str,
) -> (FaultProxy, ZooKeeperBackend, LockClient, String) {
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.server().port()).into()).await;
    let backend = ZooKeeperBackend::builder(format!("127.0.0.1:{}", proxy.port()))
        .root(root)
        .session_timeout(Duration::from_secs(10))
        .waiter_timeout(Duration::from_millis(500))
        .response_timeout(RESPONSE_TIMEOUT)
        .build()
        .await
        .unwrap();
    let client = LockClient::new(backend.clone());
    let dir = backend.path_of(&tower_lock::LockKey::new("k").unwrap());
    client
        .get_lock("k")
        .unwrap()
        .try_lock()
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();
    (proxy, backend, client, dir)
}

/// The lock nodes of `dir`, read straight from the server.
async fn lock_nodes(reader: &zk::Client, dir: &str) -> Vec<String> {
    let mut names = reader.list_children(dir).await.unwrap_or_default();
    names.retain(|n| n.starts_with("_c_"));
    names
}

/// An acquisition whose node creation is on the wire when its runtime shuts down leaves
/// no node behind. The lock core takes such an attempt back in a task on the caller's
/// runtime, which runs no more; a ZooKeeper node has no lease the server ends, so the
/// node would stay for as long as the backend's session (tower-lock contenders delete
/// it a lease after they first see it; Curator's never do). The creation is held in
/// the proxy until the runtime is gone, and past the response timeout: the first tries
/// to take the attempt back get no answer (the history checker's seed 19 with a
/// nemesis: answers late).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_acquisition_on_a_runtime_that_ends_leaves_no_node() {
    let server = common::zookeeper::shared().await;
    let root = fresh_root("runtime-ends");
    let (proxy, _backend, client, dir) = behind_a_proxy(&server, &root).await;
    let reader = ZooKeeperBackend::builder(server.connect_string())
        .build()
        .await
        .unwrap()
        .client();

    let trap = proxy.trap(Direction::Up, format!("{dir}/_c_").as_bytes());
    let lock = client.get_lock("k").unwrap();
    let caught = tokio::spawn(async move {
        trap.caught().await;
        trap
    });
    on_a_runtime_that_ends(async move {
        // Given up while the creation is held: the runtime ends right after.
        let _ = tokio::time::timeout(Duration::from_millis(300), lock.try_lock()).await;
    });
    let trap = tokio::time::timeout(Duration::from_secs(5), caught)
        .await
        .expect("the creation was caught")
        .unwrap();
    tokio::time::sleep(RESPONSE_TIMEOUT * 3).await;
    trap.release();
    wait_until(Duration::from_secs(5), "no lock node is left", || async {
        lock_nodes(&reader, &dir).await.is_empty()
    })
    .await;
}

/// A waiter queued from a runtime that then shuts down does not block the queue: its
/// node reaches the head when the holder releases, and with nobody to claim it, the
/// backend deletes it a waiter timeout later (from a task of its own, not the caller's
/// runtime), so the next waiter gets the lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_on_a_runtime_that_ends_does_not_block_the_queue() {
    vanished_waiter_is_skipped(false).await;
}

/// As above, with the connection cut while the backend's delete of the vanished
/// waiter's node is on the wire: the delete is tried again once the client has
/// reconnected, rather than the node forgotten and left at the head of the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_waiter_is_skipped_though_its_delete_is_cut_off() {
    vanished_waiter_is_skipped(true).await;
}

/// A waiter queued from a runtime that then ends; the holder releases; the next
/// acquisition must get the lock past the vanished waiter's node. With `cut`, the
/// backend's delete of that node is held in the proxy and every connection reset.
async fn vanished_waiter_is_skipped(cut: bool) {
    let server = common::zookeeper::shared().await;
    let root = fresh_root("waiter-runtime-ends");
    let (proxy, backend, client, dir) = behind_a_proxy(&server, &root).await;
    let reader = ZooKeeperBackend::builder(server.connect_string())
        .build()
        .await
        .unwrap()
        .client();
    let holder = client.get_fair_lock("k").unwrap().lock().await.unwrap();

    let lock = client.get_fair_lock("k").unwrap();
    let queued = Arc::new(tokio::sync::Notify::new());
    let leave = Arc::new(tokio::sync::Notify::new());
    let (queued_tx, leave_rx) = (Arc::clone(&queued), Arc::clone(&leave));
    let thread = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let waiting = tokio::spawn(async move { lock.lock().await.map(drop) });
            queued_tx.notify_one();
            leave_rx.notified().await;
            drop(waiting);
        });
    });
    queued.notified().await;
    let key = tower_lock::LockKey::new("k").unwrap();
    wait_until(START, "the waiter is queued behind the holder", || async {
        lock_nodes(&reader, &dir).await.len() == 2 && backend.local_waiters(&key) == 1
    })
    .await;
    // Its attempt after subscribing ends within a few round trips; then it sleeps
    // between attempts, where the runtime is shut down. (Shut down during an attempt,
    // the acquisition's own take-back frees the node at once, which passes too.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    leave.notify_one();
    thread.join().unwrap();

    holder.unlock().await.unwrap();
    let released = Instant::now();
    if cut {
        let trap = proxy.trap(Direction::Up, format!("{dir}/_c_").as_bytes());
        tokio::time::timeout(Duration::from_secs(5), trap.caught())
            .await
            .expect("the backend's delete of the vanished waiter's node");
        proxy.cut();
        trap.discard();
    }
    let next = client
        .get_fair_lock("k")
        .unwrap()
        .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
        .await;
    println!(
        "a waiter on a runtime that ended: the next waiter got the lock {:?} after the release",
        released.elapsed()
    );
    next.expect("the lock, past the vanished waiter")
        .unlock()
        .await
        .unwrap();
}

/// A guard taken on a runtime that then ends, and dropped afterwards, frees its lock at
/// its lease's end, contender or not: its release is spawned on that runtime and never
/// runs, its watchdog ran there too, and a ZooKeeper node has no lease the server ends;
/// the backend ends it itself (the history checker's seed 30 with a nemesis).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_from_a_runtime_that_ended_frees_its_lock_at_its_lease() {
    let lease = Duration::from_millis(600);
    let server = common::zookeeper::shared().await;
    let root = fresh_root("guard-runtime-ends");
    let backend = ZooKeeperBackend::builder(server.connect_string())
        .root(root.as_str())
        .build()
        .await
        .unwrap();
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let dir = backend.path_of(&tower_lock::LockKey::new("k").unwrap());
    let reader = backend.client();

    let lock = client.get_lock("k").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    on_a_runtime_that_ends(async move {
        tx.send(lock.lock().await.unwrap()).unwrap();
    });
    let guard = rx.recv().unwrap();
    let taken = Instant::now();
    drop(guard);
    assert_eq!(lock_nodes(&reader, &dir).await.len(), 1, "the hold's node");
    wait_until(
        lease * 3 + Duration::from_secs(2),
        "the node is gone",
        || async { lock_nodes(&reader, &dir).await.is_empty() },
    )
    .await;
    println!(
        "a guard from a runtime that ended: its node went {:?} after the grant (lease {lease:?})",
        taken.elapsed()
    );
    assert!(taken.elapsed() >= lease, "gone before its lease ended");
}

/// As above, with the connection cut while the backend's delete of the node is on the
/// wire: the delete fails (connection reset, nothing applied), and is tried again once
/// the client has reconnected, rather than the node forgotten and left for as long as
/// the session (the history checker's seed 1007 with a nemesis: a server restart just
/// as a lease ran out). The delete is held in the proxy, then every connection reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_ends_in_an_outage_still_frees_the_lock() {
    let lease = Duration::from_millis(600);
    let server = common::zookeeper::shared().await;
    let root = fresh_root("lease-ends-in-outage");
    let (proxy, backend, _, dir) = behind_a_proxy(&server, &root).await;
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(lease)
        .build()
        .unwrap();
    let reader = ZooKeeperBackend::builder(server.connect_string())
        .build()
        .await
        .unwrap()
        .client();

    let lock = client.get_lock("k").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    on_a_runtime_that_ends(async move {
        tx.send(lock.lock().await.unwrap()).unwrap();
    });
    let trap = proxy.trap(Direction::Up, format!("{dir}/_c_").as_bytes());
    drop(rx.recv().unwrap());
    tokio::time::timeout(lease * 5, trap.caught())
        .await
        .expect("the backend's delete of the node at its lease's end");
    proxy.cut();
    let cut = Instant::now();
    trap.discard();
    assert_eq!(lock_nodes(&reader, &dir).await.len(), 1, "the hold's node");
    wait_until(Duration::from_secs(8), "the node is gone", || async {
        lock_nodes(&reader, &dir).await.is_empty()
    })
    .await;
    println!(
        "a lease that ended in an outage: the node went {:?} after the cut",
        cut.elapsed()
    );
}

/// A guard taken on a runtime that then ends is still lost at once when its session is
/// given up. The lock core waits for the store's loss signal in a task on the runtime
/// that took the hold; that runtime is gone, so the guard would go on being believed
/// until its lease ends (30 s here), while its node ends with its session: the backend
/// closes the session it gave up as soon as the ensemble answers, and another client
/// takes the lock.
///
/// Failed before the lock core kept each hold's `StoreLoss` (`Hold::store_loss`) and
/// `is_lost` and the lost signal read it directly, with no task in between.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guard_from_a_runtime_that_ended_is_lost_with_its_session() {
    let session = Duration::from_secs(6);
    let server = common::zookeeper::shared().await;
    let root = fresh_root("guard-session-lost");
    let proxy = FaultProxy::start(([127, 0, 0, 1], server.server().port()).into()).await;
    let backend = ZooKeeperBackend::builder(format!("127.0.0.1:{}", proxy.port()))
        .root(root.as_str())
        .session_timeout(session)
        .build()
        .await
        .unwrap();
    let client = LockClient::builder(backend.clone())
        .watchdog_lease(Duration::from_secs(30))
        .build()
        .unwrap();
    let other = LockClient::new(
        ZooKeeperBackend::builder(server.connect_string())
            .root(root.as_str())
            .build()
            .await
            .unwrap(),
    );

    let lock = client.get_lock("k").unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    on_a_runtime_that_ends(async move {
        tx.send(lock.lock().await.unwrap()).unwrap();
    });
    let guard = rx.recv().unwrap();
    proxy.refuse(true);
    proxy.cut();
    let cut = Instant::now();
    wait_until(session, "the guard is lost with its session", || async {
        guard.is_lost()
    })
    .await;
    println!(
        "a guard from a runtime that ended: lost {:?} after the cut",
        cut.elapsed()
    );
    proxy.refuse(false);
    let taken = other
        .get_lock("k")
        .unwrap()
        .try_lock_for(Duration::from_secs(10), Lease::Watchdog)
        .await
        .expect("the lock, once the given-up session is closed");
    assert!(guard.is_lost(), "two holders");
    taken.unlock().await.unwrap();
}
