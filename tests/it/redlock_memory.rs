//! RedLock's composition logic over five in-memory nodes, each wrapped so a test can
//! take it down (every call fails), stall it (no call answers), or restart it empty.

use crate::common;
use tower_lock::backend::StoreAdmin;
use tower_lock::backend::redlock::NoQuorum;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use common::wait_until;
use tokio::time::Instant;
use tower_lock::backend::{
    Acquire, BoxFuture, LockBackend, LockMode, LockRequest, Release, StoreProfile, Subscription,
};
use tower_lock::kinds::RedLock;
use tower_lock::{
    Error, HoldId, Lease, LockClient, LockKey, MemoryBackend, Result, StoreError, StoreErrorKind,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Up,
    /// Every call fails at once (connection refused).
    Down,
    /// No call ever answers (a network partition, a SIGSTOPped server).
    Stalled,
}

/// One RedLock node: a memory store behind a switch.
#[derive(Clone)]
struct Node {
    store: Arc<Mutex<MemoryBackend>>,
    state: Arc<Mutex<State>>,
    acquires: Arc<AtomicUsize>,
}

impl Node {
    fn new() -> Self {
        Node {
            store: Arc::new(Mutex::new(MemoryBackend::new())),
            state: Arc::new(Mutex::new(State::Up)),
            acquires: Arc::new(AtomicUsize::new(0)),
        }
    }

    fn set(&self, state: State) {
        *self.state.lock().unwrap() = state;
    }

    /// The server restarts without persistence: every lock and counter is gone.
    fn restart_empty(&self) {
        *self.store.lock().unwrap() = MemoryBackend::new();
    }

    fn store(&self) -> MemoryBackend {
        self.store.lock().unwrap().clone()
    }

    /// The store, if the node answers at all.
    async fn reach(&self) -> Result<MemoryBackend> {
        let state = *self.state.lock().unwrap();
        match state {
            State::Up => Ok(self.store()),
            State::Down => Err(StoreError::msg(StoreErrorKind::Unavailable, "node is down").into()),
            State::Stalled => std::future::pending().await,
        }
    }
}

/// A node is a store of its own, not a wrapper: its memory store can be swapped for an
/// empty one (a restart) and it answers only over the "network" (no fast path).
impl LockBackend for Node {
    fn profile(&self) -> &StoreProfile {
        static PROFILE: LazyLock<StoreProfile> = LazyLock::new(|| {
            // Queues waiters where the memory store behind it does.
            StoreProfile::new("node").with_queued_modes([
                LockMode::Fair,
                LockMode::Read,
                LockMode::Write,
            ])
        });
        &PROFILE
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move {
            self.acquires.fetch_add(1, Ordering::SeqCst);
            self.reach().await?.acquire(req).await
        })
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move { self.reach().await?.renew(req).await })
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move { self.reach().await?.release(req).await })
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move { self.reach().await?.subscribe(req).await })
    }

    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        self.store().has_local_waiters(req)
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.reach().await?.cancel_wait(req).await })
    }

    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.reach().await?.abandon(req).await })
    }

    fn admin(&self) -> Option<&dyn StoreAdmin> {
        Some(self)
    }
}

impl StoreAdmin for Node {
    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move { self.reach().await?.force_release(key, mode).await })
    }
    fn inspect<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<tower_lock::LockState>> {
        Box::pin(async move { self.reach().await?.inspect(key, mode).await })
    }
}

/// A node's profile queues waiters exactly where the memory store behind it does.
#[test]
fn a_node_queues_where_its_store_does() {
    let (node, store) = (Node::new(), MemoryBackend::new());
    let permits = LockMode::Permits {
        max: std::num::NonZeroU32::MIN,
    };
    for mode in [
        LockMode::Exclusive,
        LockMode::Fair,
        LockMode::Read,
        LockMode::Write,
        permits,
    ] {
        assert_eq!(
            node.profile().queues_waiters(mode),
            store.profile().queues_waiters(mode),
            "{mode}"
        );
    }
}

fn nodes(n: usize) -> Vec<Node> {
    (0..n).map(|_| Node::new()).collect()
}

fn redlock(nodes: &[Node], node_timeout: Duration) -> RedLock {
    RedLock::builder()
        .nodes(nodes.iter().cloned())
        .node_timeout(node_timeout)
        .build()
        .unwrap()
}

fn client(nodes: &[Node], node_timeout: Duration, watchdog_lease: Duration) -> LockClient {
    LockClient::builder(redlock(nodes, node_timeout))
        .watchdog_lease(watchdog_lease)
        .build()
        .unwrap()
}

fn key(name: &str) -> LockKey {
    LockKey::new(format!("redlock:{name}")).unwrap()
}

/// Whether any node still keeps state for `key`.
fn residue(nodes: &[Node], key: &LockKey) -> bool {
    nodes.iter().any(|n| n.store().contains_key(key))
}

const FAST: Duration = Duration::from_millis(250);
const LONG: Duration = Duration::from_secs(30);

/// "Three processes" (three clients, each its own RedLock over the same nodes) hammer a
/// read-yield-write counter; the exact total proves exclusion.
async fn hammer(nodes: &[Node], node_timeout: Duration, tasks_per_client: u64, iters: u64) {
    let k = key("hammer");
    let counter = Arc::new(AtomicU64::new(0));
    let inside = Arc::new(AtomicUsize::new(0));
    let overlaps = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..3 {
        let client = client(nodes, node_timeout, LONG);
        for _ in 0..tasks_per_client {
            let lock = client.get_lock(&k).unwrap();
            let (counter, inside, overlaps) = (counter.clone(), inside.clone(), overlaps.clone());
            tasks.push(tokio::spawn(async move {
                for _ in 0..iters {
                    let guard = lock.lock().await.unwrap();
                    if inside.fetch_add(1, Ordering::SeqCst) != 0 {
                        overlaps.fetch_add(1, Ordering::SeqCst);
                    }
                    let v = counter.load(Ordering::SeqCst);
                    tokio::task::yield_now().await;
                    counter.store(v + 1, Ordering::SeqCst);
                    inside.fetch_sub(1, Ordering::SeqCst);
                    guard.unlock().await.unwrap();
                }
            }));
        }
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert_eq!(overlaps.load(Ordering::SeqCst), 0, "two holders at once");
    assert_eq!(
        counter.load(Ordering::SeqCst),
        3 * tasks_per_client * iters,
        "lost updates"
    );
    assert!(!residue(nodes, &k), "state left behind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_down_still_acquires_and_excludes() {
    let nodes = nodes(5);
    nodes[1].set(State::Down);
    nodes[3].set(State::Down);
    hammer(&nodes, FAST, 2, 100).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_nodes_stalled_still_acquires_and_excludes() {
    let nodes = nodes(5);
    nodes[0].set(State::Stalled);
    nodes[4].set(State::Stalled);
    // Every call waits out the stalled nodes' timeout: keep it short, and the run small.
    hammer(&nodes, Duration::from_millis(30), 1, 4).await;
}

/// Too few nodes to make a quorum is an outage: a call with time to wait rides it out
/// (the nodes may come back) and fails with the quorum error when its wait ends, neither
/// sooner nor hanging past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_nodes_down_is_a_clean_quorum_error_when_the_wait_ends() {
    for fault in [State::Down, State::Stalled] {
        let nodes = nodes(5);
        for n in &nodes[..3] {
            n.set(fault);
        }
        let node_timeout = Duration::from_millis(100);
        let client = client(&nodes, node_timeout, LONG);
        let k = key("no-quorum");
        let lock = client.get_lock(&k).unwrap();
        let wait = Duration::from_secs(3);
        let started = Instant::now();
        let err = lock.try_lock_for(wait, Lease::Watchdog).await.unwrap_err();
        let took = started.elapsed();
        match err.store_source::<NoQuorum>() {
            Some(NoQuorum {
                acquired: 2,
                needed: 3,
                total: 5,
                ..
            }) => {}
            other => {
                panic!("{fault:?}: expected no quorum (2 of 3 needed, 5 nodes), got {other:?}")
            }
        }
        assert!(
            took >= wait && took < wait + Duration::from_secs(1),
            "{fault:?}: a wait of {wait:?} without a quorum took {took:?}"
        );
        assert!(
            !residue(&nodes, &k),
            "{fault:?}: the 2 grants were not undone"
        );

        // Waiting forever does not hang either.
        let err = tokio::time::timeout(Duration::from_secs(5), lock.lock())
            .await
            .expect("lock() hung without a quorum")
            .unwrap_err();
        assert!(err.store_source::<NoQuorum>().is_some(), "{err:?}");
        assert!(err.is_retryable());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_restarted_empty_does_not_let_a_second_owner_in() {
    let nodes = nodes(5);
    let k = key("restart");
    let holder_client = client(&nodes, FAST, Duration::from_millis(300));
    let holder = holder_client.get_lock(&k).unwrap().lock().await.unwrap();

    nodes[0].restart_empty();
    let other = client(&nodes, FAST, LONG).get_lock(&k).unwrap();
    let err = other
        .try_lock_for(Duration::from_millis(500), Lease::Watchdog)
        .await
        .unwrap_err();
    assert!(err.is_busy(), "a second owner got in: {err:?}");
    nodes[1].restart_empty();
    let err = other
        .try_lock_for(Duration::from_millis(500), Lease::Watchdog)
        .await
        .unwrap_err();
    assert!(err.is_busy(), "a second owner got in: {err:?}");
    // The watchdog kept renewing on the three nodes that still hold it.
    assert!(!holder.is_lost());

    holder
        .unlock()
        .await
        .expect("three of five nodes still held it");
    let guard = other
        .try_lock_for(Duration::from_secs(2), Lease::Watchdog)
        .await
        .unwrap();
    guard.unlock().await.unwrap();
    assert!(!residue(&nodes, &k));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn losing_the_quorum_fires_the_lost_signal() {
    // Removed from three nodes: renewal says "not held" by a majority → lost at once.
    let nodes = nodes(5);
    let k = key("lost");
    let client = client(&nodes, FAST, Duration::from_millis(300));
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    for n in &nodes[2..] {
        assert!(
            n.store()
                .force_release(&k, LockMode::Exclusive)
                .await
                .unwrap()
        );
    }
    tokio::time::timeout(Duration::from_secs(2), guard.lost().wait())
        .await
        .expect("the lost signal fired");
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));

    // Three nodes unreachable: the next renewal cannot show a quorum → lost then, well
    // before the 300 ms lease would have run out.
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    let cut_at = Instant::now();
    for n in &nodes[..3] {
        n.set(State::Down);
    }
    tokio::time::timeout(Duration::from_secs(3), guard.lost().wait())
        .await
        .expect("the lost signal fired");
    assert!(
        cut_at.elapsed() < Duration::from_millis(250),
        "told only when the lease had run out: {:?}",
        cut_at.elapsed()
    );
    drop(guard);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_that_lost_the_lock_is_retaken_while_a_quorum_holds_it() {
    let nodes = nodes(5);
    let k = key("retake");
    let client = client(&nodes, FAST, Duration::from_millis(300));
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    // Two nodes forget it (restarted empty): the next renewals take them back.
    for n in &nodes[..2] {
        assert!(
            n.store()
                .force_release(&k, LockMode::Exclusive)
                .await
                .unwrap()
        );
    }
    wait_until(Duration::from_secs(2), "both nodes retaken", || async {
        nodes.iter().all(|n| n.store().contains_key(&k))
    })
    .await;
    assert!(!guard.is_lost());
    // Forced off every node (an operator's force_unlock): lost, never taken back.
    assert!(
        RedLock::new(nodes.iter().cloned())
            .unwrap()
            .force_release(&k, LockMode::Exclusive)
            .await
            .unwrap()
    );
    tokio::time::timeout(Duration::from_secs(2), guard.lost().wait())
        .await
        .expect("the lost signal fired");
    assert!(!residue(&nodes, &k), "a force-released lock was taken back");
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
}

#[tokio::test(start_paused = true)]
async fn fixed_lease_counts_only_the_validity() {
    // Two stalled nodes make the acquisition take exactly the node timeout (the clock
    // is paused). The guard's lease is the validity, lease − elapsed − drift, counted
    // from the end of the acquisition: 1000 − 200 − 12 ms, so it ends 988 ms after the
    // start, not 1000 ms after.
    let nodes = nodes(5);
    nodes[0].set(State::Stalled);
    nodes[1].set(State::Stalled);
    let node_timeout = Duration::from_millis(200);
    let client = client(&nodes, node_timeout, LONG);
    let lease = Duration::from_secs(1);
    let started = Instant::now();
    let guard = client
        .get_lock(key("validity"))
        .unwrap()
        .try_lock_for(Duration::from_secs(2), lease)
        .await
        .unwrap();
    assert_eq!(started.elapsed(), node_timeout);
    tokio::time::sleep_until(started + Duration::from_millis(987)).await;
    assert!(!guard.is_lost(), "lost before its validity ended");
    tokio::time::sleep_until(started + Duration::from_millis(988)).await;
    assert!(guard.is_lost(), "still valid past lease − elapsed − drift");
    assert!(matches!(guard.unlock().await, Err(Error::Lost)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn split_vote_is_undone_and_backs_off_then_resolves_in_the_wait() {
    let nodes = nodes(5);
    let k = key("split");
    // Nodes 0 and 1 are held by someone else, node 2 is down: a new owner can win only
    // nodes 3 and 4 — no quorum, and no quorum of busy nodes either.
    let other = LockRequest::new(
        k.clone(),
        HoldId::from_raw("other:1").unwrap(),
        LockMode::Exclusive,
        LONG,
    );
    for n in &nodes[..2] {
        assert!(matches!(
            n.acquire(&other).await.unwrap(),
            Acquire::Acquired(_)
        ));
    }
    nodes[2].set(State::Down);

    let backend = RedLock::builder()
        .nodes(nodes.iter().cloned())
        .retry_jitter(Duration::from_millis(40))
        .build()
        .unwrap();
    let me = LockRequest::new(
        k.clone(),
        HoldId::from_raw("me:1").unwrap(),
        LockMode::Exclusive,
        LONG,
    );
    let ttl = match backend.acquire(&me).await.unwrap() {
        Acquire::Busy { ttl: Some(ttl) } => ttl,
        other => panic!("expected a back-off, got {other:?}"),
    };
    assert!(ttl <= Duration::from_millis(100), "back-off {ttl:?}");
    assert!(
        !nodes[3].store().contains_key(&k) && !nodes[4].store().contains_key(&k),
        "the two grants were not undone"
    );
    // Within the back-off, another attempt does not even reach the nodes.
    let calls = nodes[3].acquires.load(Ordering::SeqCst);
    assert!(matches!(
        backend.acquire(&me).await.unwrap(),
        Acquire::Busy { .. }
    ));
    assert_eq!(nodes[3].acquires.load(Ordering::SeqCst), calls);

    // Through the client: it keeps retrying within its wait, and gets in once the
    // other owner lets go of one node.
    let client = LockClient::new(backend);
    let lock = client.get_lock(&k).unwrap();
    let waiter = tokio::spawn(async move {
        lock.try_lock_for(Duration::from_secs(5), Lease::Watchdog)
            .await
            .map(|g| g.fencing_token())
    });
    wait_until(Duration::from_secs(5), "the waiter retried", || async {
        nodes[3].acquires.load(Ordering::SeqCst) > calls + 1
    })
    .await;
    assert_eq!(nodes[0].release(&other).await.unwrap(), Release::Released);
    waiter.await.unwrap().expect("acquired within the wait");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn all_of_needs_every_node() {
    let nodes = nodes(3);
    let client = LockClient::new(
        RedLock::builder()
            .nodes(nodes.iter().cloned())
            .quorum(tower_lock::kinds::Quorum::All)
            .build()
            .unwrap(),
    );
    let k = key("all-of");
    let guard = client.get_lock(&k).unwrap().lock().await.unwrap();
    assert!(nodes.iter().all(|n| n.store().contains_key(&k)));
    guard.unlock().await.unwrap();

    nodes[2].set(State::Down);
    let err = client.get_lock(&k).unwrap().try_lock().await.unwrap_err();
    assert!(
        matches!(
            err.store_source::<NoQuorum>(),
            Some(NoQuorum {
                acquired: 2,
                needed: 3,
                total: 3,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(!residue(&nodes, &k));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn read_write_and_permits_work_over_redlock() {
    let nodes = nodes(5);
    nodes[4].set(State::Down);
    let client = client(&nodes, FAST, LONG);
    let rw = client.get_read_write_lock(key("rw")).unwrap();
    let r1 = rw.read_lock().lock().await.unwrap();
    let r2 = rw.read_lock().lock().await.unwrap();
    assert!(rw.write_lock().try_lock().await.unwrap_err().is_busy());
    r1.unlock().await.unwrap();
    r2.unlock().await.unwrap();
    rw.write_lock()
        .try_lock()
        .await
        .unwrap()
        .unlock()
        .await
        .unwrap();

    let permits = client.get_permits(key("permits"), 2).unwrap();
    let p1 = permits.lock().await.unwrap();
    let p2 = permits.lock().await.unwrap();
    assert!(permits.try_lock().await.unwrap_err().is_busy());
    p1.unlock().await.unwrap();
    p2.unlock().await.unwrap();
    assert!(!residue(&nodes, &key("rw")) && !residue(&nodes, &key("permits")));

    // Two permits need 4 of 5 nodes (a majority would let 3 holders in): with a second
    // node down they are unavailable, while an exclusive lock still works.
    nodes[3].set(State::Down);
    let err = permits.try_lock().await.unwrap_err();
    assert!(
        matches!(
            err.store_source::<NoQuorum>(),
            Some(NoQuorum {
                acquired: 3,
                needed: 4,
                total: 5,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(!residue(&nodes, &key("permits")));
    let exclusive = client.get_lock(key("exclusive")).unwrap().try_lock().await;
    exclusive.unwrap().unlock().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_win_leaves_the_queues_of_nodes_that_were_busy() {
    let nodes = nodes(5);
    let k = key("fair-queues");
    // Node 0 is held by someone else: a fair acquisition queues there, wins the other
    // four, and must not stay in node 0's queue (it would block that node's next owner
    // until evicted).
    let other = LockRequest::new(
        k.clone(),
        HoldId::from_raw("other:1").unwrap(),
        LockMode::Fair,
        LONG,
    );
    assert!(matches!(
        nodes[0].acquire(&other).await.unwrap(),
        Acquire::Acquired(_)
    ));
    let client = client(&nodes, FAST, LONG);
    let guard = client.get_fair_lock(&k).unwrap().try_lock().await.unwrap();
    assert_eq!(
        nodes[0].store().queue_len(&k),
        0,
        "still queued on the busy node"
    );
    assert_eq!(nodes[0].release(&other).await.unwrap(), Release::Released);
    guard.unlock().await.unwrap();
    assert!(!residue(&nodes, &k));
}

/// `ping` answers while a quorum of nodes answers (the default ping, an inspection, on
/// each node), and is a no-quorum error, unavailable, once too many are down or stalled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ping_needs_a_quorum_of_nodes() {
    for fault in [State::Down, State::Stalled] {
        let nodes = nodes(5);
        let client = client(&nodes, Duration::from_millis(100), LONG);
        client.ping().await.unwrap();
        for n in &nodes[..2] {
            n.set(fault);
        }
        client.ping().await.expect("3 of 5 answer");
        nodes[2].set(fault);
        match client.ping().await {
            Err(err)
                if matches!(
                    err.store_source::<NoQuorum>(),
                    Some(NoQuorum {
                        acquired: 2,
                        needed: 3,
                        total: 5,
                        ..
                    })
                ) =>
            {
                assert!(err.is_unavailable())
            }
            other => panic!("{fault:?}: expected no quorum, got {other:?}"),
        }
    }
}
