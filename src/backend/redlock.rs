//! RedLock: one lock over N independent backends, held by a majority of them (or, as
//! an all-of-N lock, by every one).
//!
//! [`RedLock`] is itself a [`LockBackend`], so it goes wherever a backend goes: a
//! [`LockClient`](crate::LockClient) over it hands out locks of every kind with the whole
//! API — waiting, watchdog, guards, lost signal, tokens — and the middleware can use it
//! like any other store. The nodes are independent stores (separate Redis servers, not
//! replicas of one another), each holding an ordinary lock under the same key and owner.
//!
//! # The algorithm
//!
//! - **Acquire**: ask every node at once, each bounded by the
//!   [node timeout](RedLockBuilder::node_timeout), and measure the time it took. The
//!   lock is held when at least the quorum (N/2+1, or N for
//!   [`Quorum::All`]) granted it **and** some validity is left: validity = lease −
//!   elapsed − drift, with drift = 1% of the lease + 2 ms for clock drift between the
//!   nodes. The guard counts its lease from the end of the acquisition, for that
//!   validity only ([`Grant::with_valid_for`]). Otherwise the attempt is undone on
//!   *every* node — those that failed or timed out too, since they may have taken it
//!   without answering — and:
//!   - fewer than a quorum of nodes answered at all → an [unavailable](crate::StoreErrorKind::Unavailable) store error whose source is [`NoQuorum`] at once
//!     (nodes down is not "busy"; the caller does not sleep out its wait);
//!   - a quorum of nodes is held by someone else → [`Acquire::Busy`] with the time
//!     until enough of them could be free;
//!   - a split vote (nobody won), or an acquisition too slow to leave validity →
//!     `Busy` with a jittered back-off: the attempt's duration plus up to
//!     [`retry_jitter`](RedLockBuilder::retry_jitter). Release notifications arriving
//!     during the back-off do not cut it short, so contenders that split do not retry
//!     in lockstep. The retries happen in the caller's ordinary wait loop, within its
//!     deadline.
//!
//!   Permits need a larger quorum than a majority to keep their bound across nodes; see
//!   [`RedLock::quorum_for`]. Every hold has an identity of its own on every node (a
//!   [`LockClient`](crate::LockClient) re-enters its holds without the store), so undoing
//!   an attempt touches nothing but that attempt.
//! - **Nodes down at start.** Build the nodes so that they connect on first use
//!   ([`RedisBackendBuilder::lazy_connect`](crate::backend::redis::RedisBackendBuilder::lazy_connect)):
//!   a node that is down when the process starts is then a failed vote, not a failed
//!   client, and rejoins when it comes back.
//! - **Renew** (the watchdog): on every node. Renewed when a quorum confirms, and then a
//!   node that no longer holds the lock (it restarted empty, or its lease ran out while
//!   it was unreachable) is *retaken* if it is free, so rolling restarts do not wear a
//!   watched lock below the quorum. Otherwise **lost** at once — whether the other nodes
//!   deny it or do not answer — since the holder can no longer show a quorum; a lock
//!   lost as a whole (force-released, expired everywhere) is never taken back behind
//!   the back of whoever released it. Each renewal counts for lease − drift from when it
//!   was sent ([`StoreProfile::clock_drift`]).
//! - **Release**: on every node. [`Release::Released`] when a quorum still held it,
//!   [`Release::NotHeld`] (the guard reports [`Error::Lost`]) when no quorum can have.
//! - **Waiting**: one subscription per reachable node; the first notification wakes the
//!   waiter.
//!
//! # Fencing tokens
//!
//! Every node issues its own tokens. The token of a RedLock grant is the **highest**
//! token among the nodes that granted it. What you can rely on:
//!
//! - it is the token of a real grant by one node of the quorum (fenced locks only);
//! - while every node keeps its state and every acquisition reaches the same nodes,
//!   tokens increase across holders as on a single store.
//!
//! What you **cannot** rely on: that it increases across holders in general. The nodes'
//! counters drift apart — a node that was down, slow, or outvoted misses increments, and
//! a split vote increments a minority — so a later holder granted by other nodes can get
//! a lower token. Do not use RedLock tokens to fence storage; if you need fencing, take
//! tokens from one store that keeps them (a database sequence, a single primary's fenced
//! lock).
//!
//! # Caveats
//!
//! - Redisson deprecated its `RedissonRedLock` (and pointed users to a plain lock on a
//!   replicated deployment); RedLock is here for compatibility and for the case where a
//!   lock must survive the loss of a whole Redis server.
//! - Its safety rests on timing: a holder paused (GC, SIGSTOP, VM migration) past its
//!   validity, or clocks running at different rates beyond the drift allowance, lets a
//!   second owner in. The [lost signal](crate::LostSignal) tells a holder after the
//!   fact; fencing needs a single store.
//! - A node restarted **empty** forgets the locks it held. With a majority of nodes
//!   still holding a lock that costs nothing, but if enough nodes restart empty while a
//!   lock is held, a second owner gets a quorum. Keep restarted nodes out of service for
//!   longer than the longest lease (Redis' "delayed restarts"), or give them
//!   persistence.
//! - An all-of-N lock ([`Quorum::All`]) is unavailable while any node is down.
//!
//! # Example
//!
//! ```
//! use std::time::Duration;
//! use tower_lock::backend::redlock::RedLock;
//! use tower_lock::{Lease, LockClient, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! // In production: five RedisBackends on five independent servers.
//! let nodes: Vec<MemoryBackend> = (0..5).map(|_| MemoryBackend::new()).collect();
//! let client = LockClient::new(RedLock::new(nodes)?);
//!
//! let guard = client
//!     .get_lock("payout:{7}")?
//!     .try_lock_for(Duration::from_secs(1), Lease::Watchdog)
//!     .await?;
//! assert!(!guard.is_lost());
//! guard.unlock().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! [`RedLock::new`] and [`RedLockBuilder::build`] reject an empty node list and zero
//! timeouts with [`ConfigError::InvalidSetting`]. Acquiring fails with [`NoQuorum`]
//! when too few nodes answer, and with [`ConfigError::InvalidSetting`] for a lease no longer
//! than the drift allowance (it could never leave validity). Renewal and release fail
//! with [`NoQuorum`] when too few nodes answer to tell.
//!
//! # Cancel safety
//!
//! An acquisition dropped while the nodes answer leaves what they granted to the
//! caller's usual compensation ([`Lock`](crate::Lock) releases a fresh owner's
//! in-flight attempt). The undo of a failed attempt runs in a spawned task, so dropping
//! the acquisition during it does not leave partial grants behind. Dropping the
//! subscription drops every node's subscription.

use futures_util::future::join_all;
use std::cmp::Ordering as CmpOrdering;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use crate::backend::{
    Acquire, BoxFuture, ClientNames, ClockDrift, Grant, HoldInfo, LockBackend, LockMode,
    LockRequest, LockState, Release, StoreAdmin, StoreProfile, Subscription, WaiterScope, Waiters,
    Wake, admin_of, clients_of,
};
use crate::error::{ConfigError, Error, Result, StoreError, StoreErrorKind};
use crate::hold_id::HoldId;
use crate::key::LockKey;

/// The source of an [unavailable](crate::StoreErrorKind::Unavailable) store error when
/// fewer than a quorum of RedLock's nodes answered or granted: downcast the error's
/// source to read the counts, `store_error.downcast_ref::<NoQuorum>()`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("no quorum: {acquired} of {total} nodes answered, {needed} needed")]
#[non_exhaustive]
pub struct NoQuorum {
    /// Nodes that granted the lock (or answered).
    pub acquired: usize,
    /// Nodes needed.
    pub needed: usize,
    /// Nodes in all.
    pub total: usize,
}

/// How long one node may take to answer one call before it counts as failed: 250 ms.
/// Far below usual leases, so a dead node costs little validity, and far above a
/// healthy round trip.
pub const DEFAULT_NODE_TIMEOUT: Duration = Duration::from_millis(250);

/// The most random delay added to a back-off after a split vote: 25 ms.
pub const DEFAULT_RETRY_JITTER: Duration = Duration::from_millis(25);

/// Clock drift allowed for, as a fraction of the lease: 1% (as in the RedLock
/// algorithm); [`CLOCK_DRIFT_MIN`] is added to it.
pub const CLOCK_DRIFT_FACTOR: f64 = 0.01;

/// Clock drift allowed for on top of [`CLOCK_DRIFT_FACTOR`]: 2 ms, for timer
/// resolution.
pub const CLOCK_DRIFT_MIN: Duration = Duration::from_millis(2);

/// How many nodes must agree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Quorum {
    /// N/2+1 nodes: RedLock; survives the loss of a minority of nodes.
    Majority,
    /// All N nodes: Redisson's `MultiLock` over independent nodes; any node down makes
    /// the lock unavailable.
    All,
}

/// One lock held by a quorum of independent backends. See the [module docs](self).
///
/// Cheap to clone; clones share the nodes.
#[derive(Clone)]
pub struct RedLock {
    inner: Arc<Inner>,
}

struct Inner {
    nodes: Vec<Arc<dyn LockBackend>>,
    quorum: usize,
    /// `redlock` or `all-of`, identified by its nodes (`redlock(<node>,<node>,...)`, in
    /// the nodes' order); queues waiters where any node does; 1% of the lease plus
    /// 2 ms of clock drift ([`CLOCK_DRIFT_FACTOR`]).
    profile: StoreProfile,
    node_timeout: Duration,
    retry_jitter: Duration,
    backoffs: Mutex<Backoffs>,
}

/// Owners in back-off after a split vote, until when.
#[derive(Default)]
struct Backoffs {
    until: HashMap<WaitKey, Instant>,
    swept_len: usize,
}

type WaitKey = (LockKey, HoldId, LockMode);

fn wait_key(req: &LockRequest) -> WaitKey {
    (req.key.clone(), req.hold_id.clone(), req.mode)
}

/// Configures a [`RedLock`].
///
/// ```
/// use std::time::Duration;
/// use tower_lock::kinds::{Quorum, RedLock};
/// use tower_lock::MemoryBackend;
///
/// let all_of_three = RedLock::builder()
///     .nodes((0..3).map(|_| MemoryBackend::new()))
///     .quorum(Quorum::All)
///     .node_timeout(Duration::from_millis(100))
///     .build()?;
/// assert_eq!(all_of_three.quorum(), 3);
///
/// let err = RedLock::builder().build().unwrap_err();
/// assert!(err.to_string().contains("nodes"));
/// # Ok::<(), tower_lock::Error>(())
/// ```
#[must_use]
pub struct RedLockBuilder {
    nodes: Vec<Arc<dyn LockBackend>>,
    quorum: Quorum,
    node_timeout: Duration,
    retry_jitter: Duration,
}

impl RedLockBuilder {
    /// Adds one node.
    pub fn node(mut self, node: impl LockBackend) -> Self {
        self.nodes.push(Arc::new(node));
        self
    }

    /// Adds several nodes.
    pub fn nodes<B: LockBackend>(mut self, nodes: impl IntoIterator<Item = B>) -> Self {
        self.nodes.extend(
            nodes
                .into_iter()
                .map(|n| Arc::new(n) as Arc<dyn LockBackend>),
        );
        self
    }

    /// How many nodes must agree. Default [`Quorum::Majority`].
    pub fn quorum(mut self, quorum: Quorum) -> Self {
        self.quorum = quorum;
        self
    }

    /// How long one node may take to answer one call. Default
    /// [`DEFAULT_NODE_TIMEOUT`]. Keep it well below the lease: a node that times out
    /// costs that much validity.
    pub fn node_timeout(mut self, timeout: Duration) -> Self {
        self.node_timeout = timeout;
        self
    }

    /// The most random delay added to the back-off after a split vote. Default
    /// [`DEFAULT_RETRY_JITTER`]; zero disables the jitter (the back-off is then the
    /// attempt's duration).
    pub fn retry_jitter(mut self, jitter: Duration) -> Self {
        self.retry_jitter = jitter;
        self
    }

    /// Builds the backend.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`] naming `nodes` when there are none, `node_timeout` when
    /// it is zero.
    pub fn build(self) -> Result<RedLock, ConfigError> {
        let total = self.nodes.len();
        if total == 0 {
            return Err(ConfigError::invalid_setting(
                "nodes",
                "must name at least one backend (got none)",
            ));
        }
        if self.node_timeout.is_zero() {
            return Err(ConfigError::invalid_setting(
                "node_timeout",
                "must be greater than zero (got 0 ns)",
            ));
        }
        let (quorum, name) = match self.quorum {
            Quorum::Majority => (total / 2 + 1, "redlock"),
            Quorum::All => (total, "all-of"),
        };
        let ids: Vec<&str> = self.nodes.iter().map(|n| n.profile().store_id()).collect();
        let profile = self.nodes.iter().fold(
            StoreProfile::new(name)
                .with_store_id(format!("{name}({})", ids.join(",")))
                .with_clock_drift(DRIFT),
            |profile, node| profile.queueing_as_well_as(node.profile()),
        );
        Ok(RedLock {
            inner: Arc::new(Inner {
                nodes: self.nodes,
                quorum,
                profile,
                node_timeout: self.node_timeout,
                retry_jitter: self.retry_jitter,
                backoffs: Mutex::default(),
            }),
        })
    }
}

impl RedLock {
    /// A RedLock over `nodes` with quorum N/2+1 and default settings.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`] when `nodes` is empty.
    pub fn new<B: LockBackend>(nodes: impl IntoIterator<Item = B>) -> Result<Self, ConfigError> {
        Self::builder().nodes(nodes).build()
    }

    /// A lock held on **all** of `nodes` or none (Redisson's `MultiLock` over
    /// independent nodes), with default settings.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`] when `nodes` is empty.
    pub fn all_of<B: LockBackend>(nodes: impl IntoIterator<Item = B>) -> Result<Self, ConfigError> {
        Self::builder().nodes(nodes).quorum(Quorum::All).build()
    }

    /// Configures a RedLock: see [`RedLockBuilder`].
    pub fn builder() -> RedLockBuilder {
        RedLockBuilder {
            nodes: Vec::new(),
            quorum: Quorum::Majority,
            node_timeout: DEFAULT_NODE_TIMEOUT,
            retry_jitter: DEFAULT_RETRY_JITTER,
        }
    }

    /// How many nodes must agree on an exclusive, fair, read or write hold: N/2+1, or N
    /// for [`Quorum::All`].
    pub fn quorum(&self) -> usize {
        self.inner.quorum
    }

    /// How many nodes must agree on a hold in `mode`.
    ///
    /// For exclusive, fair, read and write holds it is [`quorum`](Self::quorum): any
    /// two majorities share a node, and on that node the two holds conflict. For
    /// [`LockMode::Permits`] with `max = k` that is not enough — k+1 majorities need not
    /// share a node (four owners can each win 3 of 5 nodes that admit 3 each) — so the
    /// quorum grows to ⌊N·k/(k+1)⌋+1: then k+1 holders would need more grants than the
    /// nodes can give out. With 5 nodes: 3 for one permit, 4 for 2 or 3 permits, 5 for
    /// more. The price is availability: fewer nodes may be down.
    pub fn quorum_for(&self, mode: LockMode) -> usize {
        self.inner.quorum_for(mode)
    }

    /// The nodes.
    pub fn nodes(&self) -> &[Arc<dyn LockBackend>] {
        &self.inner.nodes
    }
}

/// [`CLOCK_DRIFT_FACTOR`] (in millionths) plus [`CLOCK_DRIFT_MIN`].
const DRIFT: ClockDrift = ClockDrift::new(10_000, CLOCK_DRIFT_MIN);

/// The clock drift allowed for over `lease`.
fn drift(lease: Duration) -> Duration {
    DRIFT.allowance(lease)
}

/// One node's answer.
enum Vote<T> {
    Answer(T),
    /// An error or no answer within the node timeout.
    Failed,
}

/// The nodes' answers to one acquisition.
struct Tally {
    granted: Vec<Grant>,
    /// The busy nodes' holders' remaining leases.
    busy: Vec<Option<Duration>>,
    /// The nodes that answered busy, and those that failed, by index.
    busy_nodes: Vec<usize>,
    failed_nodes: Vec<usize>,
}

impl Tally {
    fn of(votes: Vec<Vote<Acquire>>) -> Self {
        let mut tally = Tally {
            granted: Vec::new(),
            busy: Vec::new(),
            busy_nodes: Vec::new(),
            failed_nodes: Vec::new(),
        };
        for (i, vote) in votes.into_iter().enumerate() {
            match vote {
                Vote::Answer(Acquire::Acquired(grant)) => tally.granted.push(grant),
                Vote::Answer(Acquire::Busy { ttl }) => {
                    tally.busy.push(ttl);
                    tally.busy_nodes.push(i);
                }
                Vote::Failed => tally.failed_nodes.push(i),
            }
        }
        tally
    }

    /// The grant of a won acquisition, valid for `valid_for`: the most holds any node
    /// counts, and the highest token (see the module docs on tokens).
    fn grant(&self, valid_for: Duration) -> Grant {
        let holds = self.granted.iter().map(Grant::holds).max().unwrap_or(1);
        let token = self.granted.iter().filter_map(Grant::token).max();
        Grant::new(holds, token).with_valid_for(valid_for)
    }
}

/// The drift allowance for `req`'s lease, which must be longer: a lease within it
/// could never leave validity.
fn checked_drift(req: &LockRequest) -> Result<Duration> {
    let drift = drift(req.lease);
    if req.lease <= drift {
        return Err(Error::invalid_config(
            "lease",
            format!(
                "must be longer than the RedLock clock-drift allowance of {drift:?} (got {:?})",
                req.lease
            ),
        ));
    }
    Ok(drift)
}

impl Inner {
    /// Calls `op` on every node at once, each bounded by the node timeout.
    async fn on_all<'a, T: Send + 'a>(
        &'a self,
        what: &'static str,
        op: impl Fn(&'a dyn LockBackend) -> BoxFuture<'a, Result<T>>,
    ) -> Vec<Vote<T>> {
        let timeout = self.node_timeout;
        let calls: Vec<BoxFuture<'_, Vote<T>>> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, node)| {
                let call = op(node.as_ref());
                let fut: BoxFuture<'a, Vote<T>> = Box::pin(async move {
                    match tokio::time::timeout(timeout, call).await {
                        Ok(Ok(answer)) => Vote::Answer(answer),
                        Ok(Err(error)) => {
                            tracing::debug!(node = i, %error, "redlock node failed to {what}");
                            Vote::Failed
                        }
                        Err(_) => {
                            tracing::debug!(
                                node = i,
                                ?timeout,
                                "redlock node did not {what} in time"
                            );
                            Vote::Failed
                        }
                    }
                });
                fut
            })
            .collect();
        join_all(calls).await
    }

    /// How many nodes must agree on a hold in `mode`. See [`RedLock::quorum_for`].
    fn quorum_for(&self, mode: LockMode) -> usize {
        let total = self.nodes.len();
        match mode {
            LockMode::Permits { max } => {
                // k+1 holders would need (k+1)·q grants; more than the N·k the nodes
                // can give out, so some node would have admitted k+1.
                let k = max.get() as usize;
                let bound = total.saturating_mul(k) / k.saturating_add(1) + 1;
                self.quorum.max(bound).min(total)
            }
            _ => self.quorum,
        }
    }

    fn no_quorum(&self, acquired: usize, needed: usize) -> Error {
        let no_quorum = NoQuorum {
            acquired,
            needed,
            total: self.nodes.len(),
        };
        Error::Store(StoreError::new(StoreErrorKind::Unavailable, no_quorum))
    }

    /// Whether `trues` answers confirm a hold in `mode`, given `falses` denials.
    fn confirmed(&self, mode: LockMode, trues: usize, falses: usize) -> Result<bool> {
        let quorum = self.quorum_for(mode);
        if trues >= quorum {
            Ok(true)
        } else if falses > self.nodes.len() - quorum {
            // Even if every silent node agreed, no quorum could confirm.
            Ok(false)
        } else {
            Err(self.no_quorum(trues, quorum))
        }
    }

    /// A random delay in `0..=retry_jitter` (zero when the jitter is disabled). The
    /// thread's `fastrand` generator is seeded per process, so replicas that split a
    /// vote back off by different amounts.
    fn jitter(&self) -> Duration {
        let max = u64::try_from(self.retry_jitter.as_nanos()).unwrap_or(u64::MAX);
        if max == 0 {
            return Duration::ZERO;
        }
        Duration::from_nanos(fastrand::u64(0..=max))
    }

    fn backoffs(&self) -> MutexGuard<'_, Backoffs> {
        self.backoffs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn backoff_until(&self, key: &WaitKey) -> Option<Instant> {
        self.backoffs().until.get(key).copied()
    }

    fn set_backoff(&self, key: WaitKey, until: Instant) {
        let mut backoffs = self.backoffs();
        backoffs.until.insert(key, until);
        // Entries of owners that never came back (a `try_lock` that split) are swept
        // once the map has doubled: amortized O(1), bounded by the live back-offs.
        if backoffs.until.len() >= 2 * backoffs.swept_len.max(64) {
            let now = Instant::now();
            backoffs.until.retain(|_, until| *until > now);
            backoffs.swept_len = backoffs.until.len();
        }
    }

    fn clear_backoff(&self, key: &WaitKey) {
        let mut backoffs = self.backoffs();
        if !backoffs.until.is_empty() {
            backoffs.until.remove(key);
        }
    }

    /// Undoes an attempt on every node, in a task of its own so that dropping the
    /// caller does not leave partial grants behind.
    async fn undo(self: &Arc<Self>, req: &LockRequest) {
        let inner = Arc::clone(self);
        let req = req.clone();
        let undo = tokio::spawn(async move {
            inner.on_all("release", |node| node.release(&req)).await;
        });
        if let Err(error) = undo.await {
            tracing::debug!(%error, "undoing a failed redlock attempt was interrupted");
        }
    }

    /// Takes `req` again on node `node`, which said it no longer holds it (restarted
    /// empty, or its lease ran out while unreachable), while a quorum still holds it:
    /// whether the node holds it now. A node held by someone else is left alone (and its
    /// queue, if it queued the owner).
    fn retake<'a>(&'a self, node: usize, req: &'a LockRequest) -> BoxFuture<'a, bool> {
        Box::pin(async move {
            let Some(node) = self.nodes.get(node) else {
                return false;
            };
            let taken = tokio::time::timeout(self.node_timeout, node.acquire(req)).await;
            match taken {
                Ok(Ok(Acquire::Acquired(_))) => {
                    tracing::debug!("redlock: retook a node that had lost the lock");
                    true
                }
                Ok(Ok(Acquire::Busy { .. })) => {
                    if node.profile().queues_waiters(req.mode) {
                        let _ =
                            tokio::time::timeout(self.node_timeout, node.cancel_wait(req)).await;
                    }
                    false
                }
                // Unanswered: it may have taken it; the hold's release covers every node.
                _ => false,
            }
        })
    }

    /// After a win, the nodes that did not grant may still keep the owner in their
    /// wait queue (fair, read-write), where it would block others until evicted: leave
    /// them. Nodes that answered busy are reachable and are waited for; nodes that
    /// failed are left in the background, so a stalled node does not delay the grant.
    async fn leave_queues(self: &Arc<Self>, req: &LockRequest, busy: &[usize], failed: &[usize]) {
        let queued = |nodes: &[usize]| -> Vec<Arc<dyn LockBackend>> {
            nodes
                .iter()
                .filter_map(|&i| self.nodes.get(i))
                .filter(|node| node.profile().queues_waiters(req.mode))
                .cloned()
                .collect()
        };
        let timeout = self.node_timeout;
        let leave = |nodes: Vec<Arc<dyn LockBackend>>, req: LockRequest| async move {
            let calls: Vec<BoxFuture<'_, _>> = nodes
                .iter()
                .map(|node| {
                    let fut: BoxFuture<'_, ()> = Box::pin(async {
                        let _ = tokio::time::timeout(timeout, node.cancel_wait(&req)).await;
                    });
                    fut
                })
                .collect();
            join_all(calls).await;
        };
        let failed = queued(failed);
        if !failed.is_empty() {
            tokio::spawn(leave(failed, req.clone()));
        }
        let busy = queued(busy);
        if !busy.is_empty() {
            leave(busy, req.clone()).await;
        }
    }

    async fn acquire(self: &Arc<Self>, req: &LockRequest) -> Result<Acquire> {
        let drift = checked_drift(req)?;
        let key = wait_key(req);
        if let Some(until) = self.backoff_until(&key) {
            let now = Instant::now();
            if until > now {
                return Ok(Acquire::Busy {
                    ttl: Some(until - now),
                });
            }
        }

        let started = Instant::now();
        let votes = self.on_all("acquire", |node| node.acquire(req)).await;
        let tally = Tally::of(votes);
        let quorum = self.quorum_for(req.mode);
        let won = tally.granted.len() >= quorum;
        if won {
            self.leave_queues(req, &tally.busy_nodes, &tally.failed_nodes)
                .await;
        }
        // Validity counts from the start of the attempt to now, when the grant is
        // handed over.
        let elapsed = started.elapsed();
        if won
            && let Some(valid_for) = req
                .lease
                .checked_sub(elapsed + drift)
                .filter(|v| !v.is_zero())
        {
            self.clear_backoff(&key);
            return Ok(Acquire::Acquired(tally.grant(valid_for)));
        }

        self.undo(req).await;
        self.not_won(key, tally, quorum, elapsed)
    }

    /// What an attempt that did not win (and was undone) answers, `elapsed` after it
    /// started: no quorum answered, held elsewhere, or a split vote to back off from.
    fn not_won(
        &self,
        key: WaitKey,
        mut tally: Tally,
        quorum: usize,
        elapsed: Duration,
    ) -> Result<Acquire> {
        let total = self.nodes.len();
        let (granted, busy) = (tally.granted.len(), tally.busy.len());
        if granted + busy < quorum {
            self.clear_backoff(&key);
            tracing::debug!(granted, busy, total, "redlock: too few nodes answered");
            return Err(self.no_quorum(granted, quorum));
        }
        if busy >= quorum {
            self.clear_backoff(&key);
            // Held elsewhere: come back when enough busy nodes could be free for a
            // quorum (if every other node granted).
            tally.busy.sort_by(|a, b| match (a, b) {
                (Some(a), Some(b)) => a.cmp(b),
                (None, None) => CmpOrdering::Equal,
                (None, Some(_)) => CmpOrdering::Greater,
                (Some(_), None) => CmpOrdering::Less,
            });
            let need = quorum.saturating_sub(total - busy).max(1);
            let ttl = tally.busy.get(need - 1).copied().flatten();
            return Ok(Acquire::Busy { ttl });
        }
        // A split vote (or too slow to leave validity): back off for a random while so
        // contenders do not retry in lockstep.
        let backoff = elapsed + self.jitter();
        self.set_backoff(key, Instant::now() + backoff);
        tracing::debug!(granted, busy, ?backoff, "redlock: no winner; backing off");
        Ok(Acquire::Busy {
            ttl: Some(backoff.max(Duration::from_millis(1))),
        })
    }

    async fn release(&self, req: &LockRequest) -> Result<Release> {
        let votes = self.on_all("release", |node| node.release(req)).await;
        let (mut held, mut not_held, mut released) = (0, 0, 0);
        let mut left = 0u32;
        for vote in votes {
            match vote {
                Vote::Answer(Release::Released) => {
                    held += 1;
                    released += 1;
                }
                Vote::Answer(Release::Decremented { holds }) => {
                    held += 1;
                    left = left.max(holds);
                }
                Vote::Answer(Release::NotHeld) => not_held += 1,
                Vote::Failed => {}
            }
        }
        match self.confirmed(req.mode, held, not_held)? {
            // Some node still counts holds (the nodes' counts diverged): report the
            // lock as still held rather than free.
            true if released < held => Ok(Release::Decremented { holds: left.max(1) }),
            true => Ok(Release::Released),
            false => Ok(Release::NotHeld),
        }
    }
}

impl LockBackend for RedLock {
    fn profile(&self) -> &StoreProfile {
        &self.inner.profile
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(self.inner.acquire(req))
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let votes = self.inner.on_all("renew", |node| node.renew(req)).await;
            let held = votes
                .iter()
                .filter(|v| matches!(v, Vote::Answer(true)))
                .count();
            if held < self.inner.quorum_for(req.mode) {
                return Ok(false);
            }
            // Still held by a quorum: heal the nodes that lost it.
            let retakes = votes
                .iter()
                .enumerate()
                .filter(|(_, v)| matches!(v, Vote::Answer(false)))
                .map(|(i, _)| self.inner.retake(i, req));
            join_all(retakes).await;
            Ok(true)
        })
    }

    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            let inner = &self.inner;
            let timeout = inner.node_timeout;
            let calls: Vec<BoxFuture<'_, Option<Vec<Result<bool>>>>> = inner
                .nodes
                .iter()
                .map(|node| {
                    let fut: BoxFuture<'_, Option<Vec<Result<bool>>>> = Box::pin(async move {
                        tokio::time::timeout(timeout, node.renew_many(reqs))
                            .await
                            .ok()
                    });
                    fut
                })
                .collect();
            let per_node = join_all(calls).await;
            let answer = |node: usize, i: usize| {
                per_node[node]
                    .as_ref()
                    .and_then(|answers| answers.get(i)?.as_ref().ok().copied())
            };
            let renewed: Vec<bool> = reqs
                .iter()
                .enumerate()
                .map(|(i, req)| {
                    let held = (0..per_node.len())
                        .filter(|&node| answer(node, i) == Some(true))
                        .count();
                    held >= inner.quorum_for(req.mode)
                })
                .collect();
            // Holds still held by a quorum: heal the nodes that lost them, all at once.
            let retakes = (0..per_node.len()).flat_map(|node| {
                let renewed = &renewed;
                let answer = &answer;
                (0..reqs.len())
                    .filter(move |&i| renewed[i] && answer(node, i) == Some(false))
                    .map(move |i| inner.retake(node, &reqs[i]))
            });
            join_all(retakes).await;
            renewed.into_iter().map(Ok).collect()
        })
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.inner.release(req))
    }

    /// Every node gives the owner up as its own backend does (a Redis node also takes
    /// back an attempt that lands after the node timeout), without the node timeout:
    /// a node's abandon may wait for its attempt's deadline.
    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let all = join_all(self.inner.nodes.iter().map(|node| node.abandon(req))).await;
            // Nodes that could not be reached keep what they hold until its lease.
            all.into_iter().find(Result::is_err).unwrap_or(Ok(()))
        })
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            let votes = self
                .inner
                .on_all("subscribe", |node| node.subscribe(req))
                .await;
            let subs: Vec<Box<dyn Subscription>> = votes
                .into_iter()
                .filter_map(|vote| match vote {
                    Vote::Answer(sub) => Some(sub),
                    Vote::Failed => None,
                })
                .collect();
            let sub: Box<dyn Subscription> = Box::new(QuorumSubscription {
                subs,
                fired: Vec::new(),
                inner: Arc::clone(&self.inner),
                key: wait_key(req),
            });
            Ok(sub)
        })
    }

    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        // A RedLock waiter subscribes on every reachable node, so any node sees it.
        self.inner
            .nodes
            .iter()
            .any(|node| node.has_local_waiters(req))
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.inner
                .on_all("leave the queue", |node| node.cancel_wait(req))
                .await;
            Ok(())
        })
    }

    fn admin(&self) -> Option<&dyn StoreAdmin> {
        Some(self)
    }
}

impl StoreAdmin for RedLock {
    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let votes = self
                .inner
                .on_all("force-release", |node| {
                    Box::pin(async move { admin_of(node)?.force_release(key, mode).await })
                })
                .await;
            let answered = votes
                .iter()
                .filter(|v| matches!(v, Vote::Answer(_)))
                .count();
            if answered == 0 {
                return Err(self.inner.no_quorum(0, self.inner.quorum_for(mode)));
            }
            Ok(votes.iter().any(|v| matches!(v, Vote::Answer(true))))
        })
    }

    /// Every node's state, merged: a holder is reported when a quorum of the nodes
    /// that answered has it (its ttl is the time until fewer than a quorum still do),
    /// the fencing token is the newest any node has, and waiters are the most any node
    /// counts. Fewer answers than a quorum: [`NoQuorum`].
    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(async move {
            let quorum = self.inner.quorum_for(mode);
            let states: Vec<LockState> = self
                .inner
                .on_all("inspect", |node| {
                    Box::pin(async move { admin_of(node)?.inspect(key, mode).await })
                })
                .await
                .into_iter()
                .filter_map(|vote| match vote {
                    Vote::Answer(state) => Some(state),
                    Vote::Failed => None,
                })
                .collect();
            if states.len() < quorum {
                return Err(self.inner.no_quorum(states.len(), quorum));
            }
            Ok(merge_states(&states, |mode| self.inner.quorum_for(mode)))
        })
    }

    fn clients(&self) -> Option<&dyn ClientNames> {
        Some(self)
    }

    /// Every node's ping; `Ok` when a quorum ([`quorum`](RedLock::quorum)) answered,
    /// else [`NoQuorum`].
    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let answered = self
                .inner
                .on_all("ping", |node| {
                    Box::pin(async move { admin_of(node)?.ping().await })
                })
                .await
                .iter()
                .filter(|vote| matches!(vote, Vote::Answer(())))
                .count();
            if answered < self.inner.quorum {
                return Err(self.inner.no_quorum(answered, self.inner.quorum));
            }
            Ok(())
        })
    }
}

/// Names go to every node and are read from the first that has one.
impl ClientNames for RedLock {
    fn register<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let votes = self
                .inner
                .on_all("register the client", |node| {
                    node_names(node).register(id, name, ttl)
                })
                .await;
            if votes.iter().any(|v| matches!(v, Vote::Answer(()))) {
                Ok(())
            } else {
                Err(self.inner.no_quorum(0, 1))
            }
        })
    }

    /// The first name any node has for each client.
    fn names<'a>(&'a self, ids: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<Option<String>>>> {
        Box::pin(async move {
            let votes = self
                .inner
                .on_all("read client names", |node| node_names(node).names(ids))
                .await;
            let mut names = vec![None; ids.len()];
            for vote in votes {
                if let Vote::Answer(answer) = vote {
                    for (slot, name) in names.iter_mut().zip(answer) {
                        if slot.is_none() {
                            *slot = name;
                        }
                    }
                }
            }
            Ok(names)
        })
    }

    /// From every node that answers; the others' records end with their TTL.
    fn unregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.inner
                .on_all("unregister the client", |node| {
                    node_names(node).unregister(id)
                })
                .await;
            Ok(())
        })
    }
}

/// A node's record of client names; a node without one records nothing and knows none.
fn node_names(node: &dyn LockBackend) -> &dyn ClientNames {
    clients_of(node).unwrap_or(&NoNames)
}

/// The record of a store that keeps no client names.
struct NoNames;

impl ClientNames for NoNames {
    fn register<'a>(&'a self, _: &'a str, _: &'a str, _: Duration) -> BoxFuture<'a, Result<()>> {
        Box::pin(async { Ok(()) })
    }

    fn names<'a>(&'a self, ids: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<Option<String>>>> {
        Box::pin(async move { Ok(vec![None; ids.len()]) })
    }
}

impl std::fmt::Debug for RedLock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedLock")
            .field(
                "nodes",
                &self
                    .inner
                    .nodes
                    .iter()
                    .map(|n| n.profile().name())
                    .collect::<Vec<_>>(),
            )
            .field("quorum", &self.inner.quorum)
            .field("node_timeout", &self.inner.node_timeout)
            .finish()
    }
}

/// Merges the nodes' states (see [`RedLock`]'s `inspect`): `quorum` says how many nodes
/// must have a holder in a mode.
fn merge_states(states: &[LockState], quorum: impl Fn(LockMode) -> usize) -> LockState {
    // (hold id, mode) → each node's copy of the hold.
    let mut seen: Vec<((HoldId, LockMode), Vec<&HoldInfo>)> = Vec::new();
    for state in states {
        for holder in &state.holders {
            let id = (holder.hold_id.clone(), holder.mode);
            match seen.iter_mut().find(|(k, _)| *k == id) {
                Some((_, copies)) => copies.push(holder),
                None => seen.push((id, vec![holder])),
            }
        }
    }
    let holders = seen
        .into_iter()
        .filter_map(|((hold_id, mode), mut copies)| {
            let q = quorum(mode).max(1);
            if copies.len() < q {
                return None;
            }
            // Longest lease first (`None`, no expiry, is longest): the q-th copy's lease is
            // how long a quorum still has the hold.
            copies.sort_by_key(|h| std::cmp::Reverse(h.ttl.unwrap_or(Duration::MAX)));
            let ttl = copies[q - 1].ttl;
            let holds = copies.iter().map(|h| h.holds).min().unwrap_or(1);
            let token = copies.iter().filter_map(|h| h.token).max();
            Some(HoldInfo::new(hold_id, mode, holds, ttl).with_token(token))
        })
        .collect();
    let token = states.iter().filter_map(|s| s.fencing_token).max();
    let store_counts = states
        .iter()
        .filter(|s| s.waiters.scope == WaiterScope::Store)
        .map(|s| s.waiters.count)
        .max();
    let waiters = match store_counts {
        Some(count) => Waiters::new(count, WaiterScope::Store),
        None => Waiters::new(
            states.iter().map(|s| s.waiters.count).max().unwrap_or(0),
            WaiterScope::Process,
        ),
    };
    LockState::new(holders, waiters).with_fencing_token(token)
}

/// Every reachable node's subscription; the first notification wins.
struct QuorumSubscription {
    subs: Vec<Box<dyn Subscription>>,
    /// The node subscriptions whose notification ended the last wait.
    fired: Vec<usize>,
    inner: Arc<Inner>,
    key: WaitKey,
}

impl Subscription for QuorumSubscription {
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        Box::pin(async move {
            self.fired.clear();
            let wake = if self.subs.is_empty() {
                // No node can notify: the caller's re-check interval bounds the sleep.
                tokio::time::sleep_until(deadline).await;
                Wake::Deadline
            } else {
                let mut waits: Vec<Option<BoxFuture<'_, Wake>>> = self
                    .subs
                    .iter_mut()
                    .map(|sub| Some(sub.wait(deadline)))
                    .collect();
                let fired = std::future::poll_fn(|cx| {
                    let mut pending = false;
                    for (i, slot) in waits.iter_mut().enumerate() {
                        if let Some(wait) = slot {
                            match wait.as_mut().poll(cx) {
                                Poll::Ready(Wake::Notified) => return Poll::Ready(Some(i)),
                                Poll::Ready(Wake::Deadline) => *slot = None,
                                Poll::Pending => pending = true,
                            }
                        }
                    }
                    if pending {
                        Poll::Pending
                    } else {
                        Poll::Ready(None)
                    }
                })
                .await;
                drop(waits);
                match fired {
                    Some(i) => {
                        self.fired.push(i);
                        Wake::Notified
                    }
                    None => Wake::Deadline,
                }
            };
            if wake == Wake::Notified
                && let Some(until) = self.inner.backoff_until(&self.key)
            {
                // After a split vote, a release (often the other contender undoing its
                // own attempt) does not cut the back-off short.
                tokio::time::sleep_until(until.min(deadline)).await;
            }
            wake
        })
    }

    fn pass_on(&mut self) {
        if self.fired.is_empty() {
            // Leaving a place in line: one node's wake-up reaches every other local
            // waiter, since each listens on every reachable node.
            if let Some(sub) = self.subs.first_mut() {
                sub.pass_on();
            }
        }
        for &i in &self.fired {
            if let Some(sub) = self.subs.get_mut(i) {
                sub.pass_on();
            }
        }
    }

    fn skip_signalled(&mut self) {
        for sub in &mut self.subs {
            sub.skip_signalled();
        }
    }
}

impl Drop for QuorumSubscription {
    fn drop(&mut self) {
        self.inner.clear_backoff(&self.key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quorum_and_validation() {
        let nodes = |n| (0..n).map(|_| crate::MemoryBackend::new());
        assert_eq!(RedLock::new(nodes(1)).unwrap().quorum(), 1);
        assert_eq!(RedLock::new(nodes(2)).unwrap().quorum(), 2);
        assert_eq!(RedLock::new(nodes(5)).unwrap().quorum(), 3);
        assert_eq!(RedLock::new(nodes(6)).unwrap().quorum(), 4);
        assert_eq!(RedLock::all_of(nodes(5)).unwrap().quorum(), 5);
        assert!(matches!(
            RedLock::new(nodes(0)),
            Err(ConfigError::InvalidSetting { name: "nodes", .. })
        ));
        assert!(matches!(
            RedLock::builder()
                .nodes(nodes(3))
                .node_timeout(Duration::ZERO)
                .build(),
            Err(ConfigError::InvalidSetting {
                name: "node_timeout",
                ..
            })
        ));
    }

    #[test]
    fn permits_need_a_larger_quorum() {
        let permits = |max| LockMode::Permits {
            max: std::num::NonZeroU32::new(max).unwrap(),
        };
        let five = RedLock::new((0..5).map(|_| crate::MemoryBackend::new())).unwrap();
        assert_eq!(five.quorum_for(LockMode::Write), 3);
        assert_eq!(five.quorum_for(permits(1)), 3);
        assert_eq!(five.quorum_for(permits(2)), 4);
        assert_eq!(five.quorum_for(permits(3)), 4);
        assert_eq!(five.quorum_for(permits(4)), 5);
        assert_eq!(five.quorum_for(permits(5)), 5);
        assert_eq!(five.quorum_for(permits(u32::MAX)), 5);
        // The bound: k+1 holders need more grants than N nodes of k slots give out.
        for n in 1..=9usize {
            let lock = RedLock::new((0..n).map(|_| crate::MemoryBackend::new())).unwrap();
            for k in 1..=12u32 {
                let q = lock.quorum_for(permits(k));
                assert!((k as usize + 1) * q > n * k as usize, "n={n} k={k} q={q}");
                assert!(q <= n);
            }
        }
    }

    #[test]
    fn drift_is_one_percent_plus_two_ms() {
        assert_eq!(drift(Duration::from_secs(10)), Duration::from_millis(102));
        assert_eq!(drift(Duration::from_millis(100)), Duration::from_millis(3));
    }

    #[test]
    fn jitter_stays_in_range_and_varies() {
        let lock = RedLock::builder()
            .node(crate::MemoryBackend::new())
            .retry_jitter(Duration::from_millis(10))
            .build()
            .unwrap();
        let samples: Vec<Duration> = (0..200).map(|_| lock.inner.jitter()).collect();
        assert!(samples.iter().all(|d| *d <= Duration::from_millis(10)));
        let distinct: std::collections::HashSet<_> = samples.iter().collect();
        assert!(distinct.len() > 100, "{} distinct of 200", distinct.len());
    }

    #[tokio::test]
    async fn lease_within_the_drift_is_rejected() {
        let lock = RedLock::new([crate::MemoryBackend::new()]).unwrap();
        let req = LockRequest::new(
            LockKey::new("k").unwrap(),
            HoldId::from_raw("a:1").unwrap(),
            LockMode::Exclusive,
            Duration::from_millis(2),
        );
        assert!(matches!(
            lock.acquire(&req).await,
            Err(Error::Config(ConfigError::InvalidSetting {
                name: "lease",
                ..
            }))
        ));
    }
}
