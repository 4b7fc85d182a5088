//! tower-lock and Apache Curator on one ZooKeeper, on the same lock paths: tower-lock key
//! K under root R is Curator's path `R/K`, and each side's holds exclude the other's as
//! they exclude their own. Curator runs as real Java processes (`common::curator`),
//! tower-lock as `hammer` processes and as in-test clients, all on this machine's clock,
//! so every hold's (acquired, released) interval can be laid on one time line:
//!
//! - a mutex and a write lock hammered from both sides keep one counter file exact, and
//!   no two exclusive holds (nor a read and a write) overlap;
//! - each side's release wakes the other side's queued waiter (the delays are printed,
//!   not asserted);
//! - `get_permits(K, 2)` and `InterProcessSemaphoreV2(R/K, 2)` admit two holders
//!   together, never three;
//! - a Curator write blocks a tower-lock read, and a tower-lock read (shared with a
//!   Curator read) blocks a Curator write.
//!
//! Each test works under a root of its own and ends by checking that no lock node and no
//! process of its own is left.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;
use tower_lock::{LockClient, LockGuard, ZooKeeperBackend};

use crate::common::curator::{CounterFile, Curator, CuratorProcess, Event, Mode};
use crate::common::zookeeper::{self, ZkServer};
use crate::common::{example_binary, wait_until};

/// Long enough for a client JVM to start, connect and queue on a loaded two-core machine.
const CLIENT_START: Duration = Duration::from_secs(30);
/// Long enough for one step of a started client (a wake-up, a release, an exit).
const STEP: Duration = Duration::from_secs(10);
/// How long a hammer run may take before the test fails (a hang is an outcome too).
const HAMMER_RUN: Duration = Duration::from_secs(45);

/// Microseconds since the Unix epoch: the clock of every event line.
fn epoch_micros() -> u64 {
    let since = SystemTime::now().duration_since(UNIX_EPOCH).unwrap();
    u64::try_from(since.as_micros()).unwrap()
}

/// A test's place on a ZooKeeper server: a root path of its own and the server's
/// four-letter answers.
struct Place<'a> {
    server: &'a ZkServer,
    root: String,
}

impl<'a> Place<'a> {
    fn new(server: &'a ZkServer, test: &str) -> Self {
        Place {
            server,
            root: format!("/interop-{test}-{}", uuid::Uuid::new_v4()),
        }
    }

    /// A backend of its own (a session of its own) under the test's root.
    async fn backend(&self) -> ZooKeeperBackend {
        ZooKeeperBackend::builder(self.server.connect_string())
            .root(self.root.clone())
            .session_timeout(Duration::from_secs(6))
            .build()
            .await
            .expect("a ZooKeeper backend")
    }

    /// Curator's path of tower-lock key `key`.
    fn path(&self, key: &str) -> String {
        format!("{}/{key}", self.root)
    }

    fn curator(&self) -> Curator {
        Curator::new(self.server.connect_string())
    }

    /// A `hammer` process locking `key` (`--kind kind`) with `tasks` tasks of `iters`
    /// iterations each on `counter`, printing its holds.
    fn tower_hammer(
        &self,
        key: &str,
        kind: &str,
        iters: u32,
        tasks: u32,
        counter: &CounterFile,
    ) -> TowerHammer {
        let child = tokio::process::Command::new(example_binary("hammer"))
            .args(["--url", &format!("zk://{}", self.server.connect_string())])
            .args(["--zk-root", &self.root, "--name", key, "--kind", kind])
            .args([
                "--counter-url",
                &format!("file:{}", counter.path().display()),
                "--counter-key",
                "x",
            ])
            .args(["--iters", &iters.to_string(), "--tasks", &tasks.to_string()])
            .arg("--events")
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn hammer");
        TowerHammer {
            name: format!("hammer --kind {kind} --tasks {tasks} --iters {iters}"),
            child,
        }
    }

    /// The lock nodes left in `key`'s directory and its semaphore's `locks`/`leases`.
    async fn lock_nodes(&self, backend: &ZooKeeperBackend, key: &str) -> Vec<String> {
        let client = backend.client();
        let dir = self.path(key);
        let mut left = Vec::new();
        for d in [dir.clone(), format!("{dir}/locks"), format!("{dir}/leases")] {
            if let Ok(children) = client.list_children(&d).await {
                left.extend(
                    children
                        .into_iter()
                        .filter(|c| c.starts_with("_c_"))
                        .map(|c| format!("{d}/{c}")),
                );
            }
        }
        left
    }

    /// Every hold has let go of its node, and no process of this test is left.
    async fn assert_clean(&self, backend: &ZooKeeperBackend, key: &str) {
        let nodes = self.lock_nodes(backend, key).await;
        assert!(nodes.is_empty(), "lock nodes left behind: {nodes:?}");
        let processes = processes_naming(&self.root);
        assert!(
            processes.is_empty(),
            "processes of this test left: {processes:?}"
        );
    }

    /// The node that holds `key`'s lock now (the lowest sequence of its directory).
    async fn head(&self, backend: &ZooKeeperBackend, key: &str) -> Option<String> {
        let dir = self.path(key);
        let children = backend.client().list_children(&dir).await.ok()?;
        children
            .into_iter()
            .filter(|c| c.len() > 10)
            .min_by(|a, b| a[a.len() - 10..].cmp(&b[b.len() - 10..]))
            .map(|c| format!("{dir}/{c}"))
    }

    /// Waits until a session other than `ours` watches `path`: a client queued on it.
    async fn watched_by_other(&self, path: &str, ours: &[i64], what: &str) {
        wait_until(CLIENT_START, what, || async {
            self.server
                .watchers(path)
                .await
                .iter()
                .any(|s| !ours.contains(s))
        })
        .await;
    }

    /// Waits until `session` watches `path`.
    async fn watched_by(&self, path: &str, session: i64, what: &str) {
        wait_until(CLIENT_START, what, || async {
            self.server.watchers(path).await.contains(&session)
        })
        .await;
    }
}

/// Processes other than this one whose command line names `needle` (the test's root:
/// every Curator and hammer process of a test has it in its arguments).
fn processes_naming(needle: &str) -> Vec<(u32, String)> {
    let me = std::process::id();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc").flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push((pid, cmdline));
        }
    }
    found
}

/// A tower-lock `hammer` process; killed on drop.
struct TowerHammer {
    name: String,
    child: tokio::process::Child,
}

impl TowerHammer {
    /// Its event lines, once it has exited successfully within `within`.
    async fn finish(self, within: Duration) -> Vec<Event> {
        let name = self.name;
        let output = tokio::time::timeout(within, self.child.wait_with_output())
            .await
            .unwrap_or_else(|_| panic!("{name}: did not finish within {within:?}"))
            .expect("the hammer's output");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "{name}: exited with {}; stderr:\n{stderr}",
            output.status
        );
        String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| {
                let mut words = line.split_whitespace().map(str::to_owned);
                Event {
                    word: words.next().unwrap_or_default(),
                    args: words.collect(),
                }
            })
            .collect()
    }
}

/// Which side a hold was taken by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Side {
    TowerLock,
    Curator,
}

/// One end of a hold: taken (`enter`) or let go, in microseconds since the epoch.
/// `acquired` is stamped after the acquisition returned and `released` before the
/// release began, so the stamped interval lies inside the real hold: if two stamped
/// intervals overlap, the holds did.
#[derive(Clone, Debug)]
struct Edge {
    at: u64,
    enter: bool,
    /// Exclusive (a mutex, a write, a permit); `false`: a read, shared with reads.
    exclusive: bool,
    side: Side,
    /// Which process or task, for messages.
    who: String,
}

/// The edges of the holds in `events` (`acquired`, `released`) of one process, which
/// must be `holds` holds with nothing lost on the way.
fn edges_of(events: &[Event], holds: usize, exclusive: bool, side: Side, who: &str) -> Vec<Edge> {
    let lost: Vec<&Event> = events.iter().filter(|e| e.word == "lost").collect();
    assert!(lost.is_empty(), "{who}: its connection was lost: {lost:?}");
    let edges: Vec<Edge> = events
        .iter()
        .filter(|e| e.word == "acquired" || e.word == "released")
        .map(|e| Edge {
            at: e.micros(),
            enter: e.word == "acquired",
            exclusive,
            side,
            who: who.to_owned(),
        })
        .collect();
    let taken = edges.iter().filter(|e| e.enter).count();
    assert_eq!(
        (taken, edges.len() - taken),
        (holds, holds),
        "{who}: acquisitions and releases"
    );
    edges
}

/// The edges of one hold.
fn hold(from: u64, to: u64, exclusive: bool, side: Side, who: &str) -> [Edge; 2] {
    assert!(
        from <= to,
        "{who}: released at {to} before acquired at {from}"
    );
    let edge = |at, enter| Edge {
        at,
        enter,
        exclusive,
        side,
        who: who.to_owned(),
    };
    [edge(from, true), edge(to, false)]
}

/// What a time line of holds showed.
#[derive(Debug, Default)]
struct Sweep {
    holds: usize,
    /// The most exclusive holds at once.
    most_exclusive: usize,
    /// The most reads at once.
    most_reads: usize,
    /// Exclusive holds taken right after one of the other side's.
    handoffs: usize,
}

/// Lays every hold on one time line and panics at the first moment when more than
/// `permits` exclusive holds, or a read and an exclusive hold, were held at once. At
/// equal stamps a release counts first (the stamps are microseconds apart at best).
fn sweep(mut edges: Vec<Edge>, permits: usize) -> Sweep {
    edges.sort_by_key(|e| (e.at, e.enter));
    let mut out = Sweep::default();
    let (mut exclusive, mut reads) = (0usize, 0usize);
    let mut inside: Vec<usize> = Vec::new();
    let mut last_side = None;
    for (i, e) in edges.iter().enumerate() {
        let count = if e.exclusive {
            &mut exclusive
        } else {
            &mut reads
        };
        if e.enter {
            *count += 1;
            inside.push(i);
            out.holds += 1;
            if e.exclusive {
                if last_side.is_some_and(|s| s != e.side) {
                    out.handoffs += 1;
                }
                last_side = Some(e.side);
            }
        } else {
            *count = count
                .checked_sub(1)
                .unwrap_or_else(|| panic!("a release without a hold: {e:?}"));
            if let Some(at) = inside
                .iter()
                .position(|&j| edges[j].who == e.who && edges[j].exclusive == e.exclusive)
            {
                inside.remove(at);
            }
        }
        out.most_exclusive = out.most_exclusive.max(exclusive);
        out.most_reads = out.most_reads.max(reads);
        let together: Vec<&Edge> = inside.iter().map(|&j| &edges[j]).collect();
        assert!(
            exclusive <= permits && (exclusive == 0 || reads == 0),
            "{exclusive} exclusive holds (of {permits}) and {reads} reads at once at {}: \
             {together:#?}",
            e.at
        );
    }
    out
}

/// The median and the largest of `delays`.
fn p50_max(delays: &[Duration]) -> (Duration, Duration) {
    let mut sorted = delays.to_vec();
    sorted.sort_unstable();
    (sorted[sorted.len() / 2], sorted[sorted.len() - 1])
}

/// A Curator hammer that has taken its lock once already: its events from the first
/// `acquired` on (once it ran, a hammer started after it contends with it).
async fn started(mut hammer: CuratorProcess) -> (CuratorProcess, Event) {
    let first = hammer.expect("acquired", CLIENT_START).await;
    (hammer, first)
}

/// Curator's mutex hammered from both sides on one counter file: 2 Curator processes,
/// 2 `hammer` processes of 2 tasks each. Every increment counts, and the holds of all
/// six contenders lie end to end on one time line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutex_hammers_of_both_sides_keep_one_counter_exact() {
    const CURATOR_ITERS: u32 = 150;
    const TOWER_ITERS: u32 = 50;
    const TOWER_TASKS: u32 = 2;
    let began = Instant::now();
    let shared = zookeeper::shared().await;
    let place = Place::new(shared.server(), "mutex");
    let backend = place.backend().await;
    let counter = CounterFile::new();
    let curator = place.curator();
    let key = "counter";

    // The JVMs first: they take a second to start, the hammers a few milliseconds.
    let curators: Vec<CuratorProcess> = (0..2)
        .map(|_| curator.hammer(&place.path(key), Mode::Mutex, CURATOR_ITERS, counter.path()))
        .collect();
    let curators = futures_util::future::join_all(curators.into_iter().map(started)).await;
    let towers: Vec<TowerHammer> = (0..2)
        .map(|_| place.tower_hammer(key, "lock", TOWER_ITERS, TOWER_TASKS, &counter))
        .collect();

    let mut edges = Vec::new();
    for (i, tower) in towers.into_iter().enumerate() {
        let events = tower.finish(HAMMER_RUN).await;
        let holds = (TOWER_ITERS * TOWER_TASKS) as usize;
        edges.extend(edges_of(
            &events,
            holds,
            true,
            Side::TowerLock,
            &format!("hammer#{i}"),
        ));
    }
    for (i, (mut hammer, first)) in curators.into_iter().enumerate() {
        let mut events = vec![first];
        events.extend(hammer.finish(HAMMER_RUN).await);
        assert_eq!(events.last().map(|e| e.word.as_str()), Some("done"));
        let who = format!("curator#{i}");
        edges.extend(edges_of(
            &events,
            CURATOR_ITERS as usize,
            true,
            Side::Curator,
            &who,
        ));
    }

    let expected = u64::from(2 * CURATOR_ITERS + 2 * TOWER_ITERS * TOWER_TASKS);
    let counted = counter.read();
    let seen = sweep(edges, 1);
    eprintln!(
        "interop counts (mutex): counter {counted} of {expected} (Curator 2 x {CURATOR_ITERS}, \
         tower-lock 2 x {TOWER_TASKS} x {TOWER_ITERS}), {} holds, at most {} at once, {} \
         handoffs between the sides, {:.2?}",
        seen.holds,
        seen.most_exclusive,
        seen.handoffs,
        began.elapsed()
    );
    assert_eq!(counted, expected, "an increment was lost");
    assert_eq!(seen.most_exclusive, 1);
    assert!(
        seen.handoffs > 0,
        "the two sides never took turns: {seen:?}"
    );
    place.assert_clean(&backend, key).await;
}

/// The write lock hammered from both sides (2 Curator write hammers, 2 `hammer --kind
/// write` processes of 2 tasks), with a Curator read hammer and two tower-lock read
/// tasks reading the counter meanwhile: the writes keep the counter exact, and no read
/// overlaps a write.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_hammers_of_both_sides_keep_one_counter_exact_beside_readers() {
    const CURATOR_ITERS: u32 = 80;
    const TOWER_ITERS: u32 = 30;
    const TOWER_TASKS: u32 = 2;
    const READS: u32 = 40;
    let began = Instant::now();
    let shared = zookeeper::shared().await;
    let place = Place::new(shared.server(), "write");
    let backend = place.backend().await;
    let client = LockClient::new(backend.clone());
    let counter = CounterFile::new();
    let curator = place.curator();
    let key = "counter";
    let path = place.path(key);

    let mut curators: Vec<(CuratorProcess, bool)> = (0..2)
        .map(|_| {
            (
                curator.hammer(&path, Mode::Write, CURATOR_ITERS, counter.path()),
                true,
            )
        })
        .collect();
    curators.push((
        curator.hammer(&path, Mode::Read, CURATOR_ITERS, counter.path()),
        false,
    ));
    let curators = futures_util::future::join_all(
        curators
            .into_iter()
            .map(|(p, write)| async move { (started(p).await, write) }),
    )
    .await;
    let towers: Vec<TowerHammer> = (0..2)
        .map(|_| place.tower_hammer(key, "write", TOWER_ITERS, TOWER_TASKS, &counter))
        .collect();
    let read_lock = client.get_read_write_lock(key).unwrap().read_lock();
    let readers: Vec<_> = (0..2)
        .map(|_| {
            let (lock, file) = (read_lock.clone(), counter.path().to_owned());
            tokio::spawn(async move {
                let mut holds = Vec::new();
                for _ in 0..READS {
                    let guard = lock.lock().await.expect("a read");
                    let from = epoch_micros();
                    let text = tokio::fs::read_to_string(&file).await.unwrap();
                    assert!(text.trim().parse::<u64>().is_ok(), "read {text:?}");
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    let to = epoch_micros();
                    guard.unlock().await.expect("a read's release");
                    holds.push((from, to));
                }
                holds
            })
        })
        .collect();

    let mut edges = Vec::new();
    for (i, tower) in towers.into_iter().enumerate() {
        let events = tower.finish(HAMMER_RUN).await;
        let holds = (TOWER_ITERS * TOWER_TASKS) as usize;
        edges.extend(edges_of(
            &events,
            holds,
            true,
            Side::TowerLock,
            &format!("hammer#{i}"),
        ));
    }
    for (i, reader) in readers.into_iter().enumerate() {
        let holds = tokio::time::timeout(HAMMER_RUN, reader)
            .await
            .expect("the tower-lock reads end")
            .expect("the tower-lock reads");
        for (from, to) in holds {
            edges.extend(hold(
                from,
                to,
                false,
                Side::TowerLock,
                &format!("reader#{i}"),
            ));
        }
    }
    for (i, ((mut hammer, first), write)) in curators.into_iter().enumerate() {
        let mut events = vec![first];
        events.extend(hammer.finish(HAMMER_RUN).await);
        assert_eq!(events.last().map(|e| e.word.as_str()), Some("done"));
        let who = format!("curator#{i}{}", if write { "" } else { " read" });
        edges.extend(edges_of(
            &events,
            CURATOR_ITERS as usize,
            write,
            Side::Curator,
            &who,
        ));
    }

    let expected = u64::from(2 * CURATOR_ITERS + 2 * TOWER_ITERS * TOWER_TASKS);
    let counted = counter.read();
    let seen = sweep(edges, 1);
    eprintln!(
        "interop counts (write lock): counter {counted} of {expected} (Curator 2 x \
         {CURATOR_ITERS} writes + {CURATOR_ITERS} reads, tower-lock 2 x {TOWER_TASKS} x \
         {TOWER_ITERS} writes + 2 x {READS} reads), {} holds, at most {} writes and {} reads \
         at once, {} write handoffs between the sides, {:.2?}",
        seen.holds,
        seen.most_exclusive,
        seen.most_reads,
        seen.handoffs,
        began.elapsed()
    );
    assert_eq!(counted, expected, "an increment was lost");
    assert_eq!(seen.most_exclusive, 1);
    assert!(
        seen.handoffs > 0,
        "the two sides never took turns: {seen:?}"
    );
    place.assert_clean(&backend, key).await;
}

/// A tower-lock acquisition of `lock` in a task of its own: when it returned (epoch
/// micros), and its guard.
fn spawn_lock(lock: &tower_lock::Lock) -> tokio::task::JoinHandle<(u64, LockGuard)> {
    let lock = lock.clone();
    tokio::spawn(async move {
        let guard = lock.lock().await.expect("the lock");
        (epoch_micros(), guard)
    })
}

/// The acquisition `task` made, within `STEP`.
async fn acquired(task: tokio::task::JoinHandle<(u64, LockGuard)>) -> (u64, LockGuard) {
    tokio::time::timeout(STEP, task)
        .await
        .expect("the waiter was woken")
        .expect("the waiter's task")
}

/// Lets `guard` go; when it began to (epoch micros).
async fn let_go(guard: LockGuard) -> u64 {
    let at = epoch_micros();
    guard.unlock().await.expect("the release");
    at
}

/// One mutex handed back and forth, ten times each way: tower-lock holds while a Curator
/// `hold` queues, and lets go (tower-lock → Curator); then a tower-lock waiter queues
/// behind that Curator holder, which lets go (Curator → tower-lock). Each waiter is
/// queued (its watch on the holder's node is on the server) before the release, so the
/// delay is the wake-up's alone. On a server of its own, so other tests' load on the
/// shared one stays out of the numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_wake_the_other_sides_waiter_both_ways() {
    const ROUNDS: usize = 10;
    let began = Instant::now();
    let server = ZkServer::start().await;
    let place = Place::new(&server, "wake");
    let backend = place.backend().await;
    let ours = backend.session_id();
    let client = LockClient::new(backend.clone());
    let key = "wake";
    let lock = client.get_lock(key).unwrap();
    let curator = place.curator();

    let mut guard = lock.lock().await.unwrap();
    let (mut to_curator, mut to_tower) = (Vec::new(), Vec::new());
    for round in 0..ROUNDS {
        // tower-lock → Curator.
        let mut holder = curator.hold(&place.path(key), Mode::Mutex);
        let head = place.head(&backend, key).await.expect("tower-lock's node");
        place
            .watched_by_other(
                &head,
                &[ours],
                "the Curator waiter watches tower-lock's node",
            )
            .await;
        let released = let_go(guard).await;
        let taken = holder.expect("acquired", STEP).await.micros();
        assert!(
            taken >= released,
            "round {round}: Curator acquired at {taken}, before tower-lock let go at {released}"
        );
        to_curator.push(Duration::from_micros(taken - released));

        // Curator → tower-lock.
        let waiter = spawn_lock(&lock);
        let head = place.head(&backend, key).await.expect("Curator's node");
        place
            .watched_by(&head, ours, "the tower-lock waiter watches Curator's node")
            .await;
        assert!(
            !waiter.is_finished(),
            "round {round}: taken while Curator holds"
        );
        holder.release();
        let released = holder.expect("released", STEP).await.micros();
        let (taken, next) = acquired(waiter).await;
        assert!(
            taken >= released,
            "round {round}: tower-lock acquired at {taken}, before Curator let go at {released}"
        );
        to_tower.push(Duration::from_micros(taken - released));
        assert!(holder.wait_exit(STEP).await.success());
        guard = next;
    }
    let_go(guard).await;

    let (p50, max) = p50_max(&to_curator);
    let (back_p50, back_max) = p50_max(&to_tower);
    eprintln!(
        "interop wake-ups over {ROUNDS} rounds: tower-lock release -> Curator acquired p50 \
         {p50:?} max {max:?}; Curator release -> tower-lock acquired p50 {back_p50:?} max \
         {back_max:?}; {:.2?}",
        began.elapsed()
    );
    place.assert_clean(&backend, key).await;
}

/// The data of every lease node in `leases`.
async fn leases_data(backend: &ZooKeeperBackend, leases: &str) -> Vec<Vec<u8>> {
    let client = backend.client();
    let mut data = Vec::new();
    for name in client.list_children(leases).await.unwrap_or_default() {
        if let Ok((bytes, _)) = client.get_data(&format!("{leases}/{name}")).await {
            data.push(bytes);
        }
    }
    data
}

/// `get_permits(K, 2)` and Curator's `InterProcessSemaphoreV2(R/K, 2)` are one semaphore:
/// a Curator holder and a tower-lock holder fill it; a third from tower-lock waits for a
/// lease to go, holding the semaphore's mutex (`locks`), with a Curator contender queued
/// on that mutex behind it; then that Curator contender waits for a lease, holding the
/// mutex, with a tower-lock contender queued behind it. Each gets its permit only once
/// a holder let go, and never are three permits held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn permits_of_both_sides_admit_two_holders_never_three() {
    let began = Instant::now();
    let shared = zookeeper::shared().await;
    let place = Place::new(shared.server(), "permits");
    let (first, second) = (place.backend().await, place.backend().await);
    let (a, b) = (
        LockClient::new(first.clone()),
        LockClient::new(second.clone()),
    );
    let key = "pool";
    let gates = format!("{key}/locks");
    let leases = format!("{}/leases", place.path(key));
    let curator = place.curator();
    let mut edges = Vec::new();

    // Curator takes one permit, tower-lock the other.
    let mut c1 = curator.hold(&place.path(key), Mode::Semaphore(2));
    let c1_from = c1.expect("acquired", CLIENT_START).await.micros();
    let (a_from, a_guard) = acquired(spawn_lock(&a.get_permits(key, 2).unwrap())).await;

    // A third from tower-lock waits, holding the mutex: it has subscribed once an
    // attempt answered busy, and that attempt's listing set its watch on the leases (a
    // children watch is in no four-letter report, so the subscription is the sign).
    let w = spawn_lock(&b.get_permits(key, 2).unwrap());
    let pool = tower_lock::LockKey::new(key).unwrap();
    wait_until(CLIENT_START, "the tower-lock waiter queues", || async {
        second.local_waiters(&pool) == 1 && leases_data(&first, &leases).await.len() == 3
    })
    .await;
    assert_eq!(
        leases_data(&first, &leases).await.len(),
        3,
        "two holders and the waiter"
    );
    // A Curator contender queues on the mutex behind it (watching its mutex node).
    let mut c2 = curator.wait(&place.path(key), Mode::Semaphore(2));
    let w_gate = place
        .head(&first, &gates)
        .await
        .expect("the waiter's mutex node");
    place
        .watched_by_other(
            &w_gate,
            &[first.session_id(), second.session_id()],
            "Curator queues on the mutex",
        )
        .await;
    assert!(!w.is_finished(), "a third permit was granted");

    // Curator lets go: the tower-lock waiter has its permit and lets go of the mutex, and
    // the Curator contender takes the mutex, makes its lease and waits for one to go.
    c1.release();
    let c1_to = c1.expect("released", STEP).await.micros();
    let (w_from, w_guard) = acquired(w).await;
    assert!(
        w_from >= c1_to,
        "tower-lock's third permit at {w_from}, before Curator let go at {c1_to}"
    );
    assert!(c1.wait_exit(STEP).await.success());
    wait_until(
        CLIENT_START,
        "the Curator contender waits for a lease",
        || async { leases_data(&first, &leases).await.len() == 3 },
    )
    .await;
    // A tower-lock contender queues on the mutex behind it.
    let x = spawn_lock(&a.get_permits(key, 2).unwrap());
    let c2_gate = place
        .head(&first, &gates)
        .await
        .expect("Curator's mutex node");
    place
        .watched_by(
            &c2_gate,
            first.session_id(),
            "tower-lock queues on the mutex",
        )
        .await;

    // tower-lock lets go: the Curator contender has its permit (and gives it back at
    // once), then the tower-lock contender has one.
    let a_to = let_go(a_guard).await;
    let c2_from = c2.expect("acquired", STEP).await.micros();
    assert!(
        c2_from >= a_to,
        "Curator's third permit at {c2_from}, before tower-lock let go at {a_to}"
    );
    let c2_to = c2.expect("released", STEP).await.micros();
    assert!(c2.wait_exit(STEP).await.success());
    let (x_from, x_guard) = acquired(x).await;
    assert!(
        x_from >= c2_to,
        "tower-lock's permit at {x_from}, before Curator let go at {c2_to}"
    );
    let w_to = let_go(w_guard).await;
    let x_to = let_go(x_guard).await;
    edges.extend(hold(c1_from, c1_to, true, Side::Curator, "curator#1"));
    edges.extend(hold(a_from, a_to, true, Side::TowerLock, "tower-lock a"));
    edges.extend(hold(w_from, w_to, true, Side::TowerLock, "tower-lock w"));
    edges.extend(hold(c2_from, c2_to, true, Side::Curator, "curator#2"));
    edges.extend(hold(x_from, x_to, true, Side::TowerLock, "tower-lock x"));

    let seen = sweep(edges, 2);
    eprintln!(
        "interop permits: {} holds, at most {} at once; {:.2?}",
        seen.holds,
        seen.most_exclusive,
        began.elapsed()
    );
    assert_eq!(seen.most_exclusive, 2, "both permits were in use at once");
    place.assert_clean(&first, key).await;
}

/// Curator's `InterProcessReadWriteLock` and tower-lock's read-write lock are one lock:
/// a Curator write holds a tower-lock read off until it lets go; a tower-lock read and a
/// Curator read hold together, and a Curator write waits for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_writes_of_both_sides_exclude_each_other() {
    let began = Instant::now();
    let shared = zookeeper::shared().await;
    let place = Place::new(shared.server(), "rw");
    let backend = place.backend().await;
    let ours = backend.session_id();
    let client = LockClient::new(backend.clone());
    let key = "doc";
    let path = place.path(key);
    let read = client.get_read_write_lock(key).unwrap().read_lock();
    let curator = place.curator();
    let mut edges = Vec::new();

    // A Curator write holds a tower-lock read off.
    let mut writer = curator.hold(&path, Mode::Write);
    let w_from = writer.expect("acquired", CLIENT_START).await.micros();
    let reader = spawn_lock(&read);
    let head = place
        .head(&backend, key)
        .await
        .expect("Curator's write node");
    place
        .watched_by(&head, ours, "the tower-lock read watches Curator's write")
        .await;
    assert!(!reader.is_finished(), "a read was granted under a write");
    writer.release();
    let w_to = writer.expect("released", STEP).await.micros();
    let (r_from, r_guard) = acquired(reader).await;
    assert!(
        r_from >= w_to,
        "tower-lock read at {r_from}, before Curator's write let go at {w_to}"
    );
    assert!(writer.wait_exit(STEP).await.success());
    edges.extend(hold(w_from, w_to, true, Side::Curator, "curator write"));

    // A Curator read joins the tower-lock read; a Curator write queues behind both.
    let mut shared_read = curator.hold(&path, Mode::Read);
    let s_from = shared_read.expect("acquired", CLIENT_START).await.micros();
    let mut next_writer = curator.wait(&path, Mode::Write);
    // It watches the node before its own: the Curator read's.
    let tower_read = place
        .head(&backend, key)
        .await
        .expect("tower-lock's read node");
    wait_until(CLIENT_START, "the Curator write queues", || async {
        let children = backend.client().list_children(&path).await.unwrap();
        children.iter().filter(|c| c.contains("__WRIT__")).count() == 1
    })
    .await;
    let nodes = place.lock_nodes(&backend, key).await;
    let curator_read = nodes
        .iter()
        .find(|n| n.contains("__READ__") && **n != tower_read)
        .expect("Curator's read node")
        .clone();
    place
        .watched_by_other(
            &curator_read,
            &[ours],
            "the Curator write watches the Curator read",
        )
        .await;
    shared_read.release();
    let s_to = shared_read.expect("released", STEP).await.micros();
    assert!(shared_read.wait_exit(STEP).await.success());
    // Now it waits for the tower-lock read alone.
    place
        .watched_by_other(
            &tower_read,
            &[ours],
            "the Curator write watches tower-lock's read",
        )
        .await;
    let r_to = let_go(r_guard).await;
    let nw_from = next_writer.expect("acquired", STEP).await.micros();
    assert!(
        nw_from >= r_to && nw_from >= s_to,
        "Curator's write at {nw_from}, before the reads let go at {r_to} and {s_to}"
    );
    let nw_to = next_writer.expect("released", STEP).await.micros();
    assert!(next_writer.wait_exit(STEP).await.success());
    edges.extend(hold(
        r_from,
        r_to,
        false,
        Side::TowerLock,
        "tower-lock read",
    ));
    edges.extend(hold(s_from, s_to, false, Side::Curator, "curator read"));
    edges.extend(hold(nw_from, nw_to, true, Side::Curator, "curator write 2"));

    let seen = sweep(edges, 1);
    eprintln!(
        "interop read-write: {} holds, at most {} reads at once; {:.2?}",
        seen.holds,
        seen.most_reads,
        began.elapsed()
    );
    assert_eq!(seen.most_reads, 2, "the two sides' reads held together");
    place.assert_clean(&backend, key).await;
}
