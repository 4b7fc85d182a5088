//! The ZooKeeper backend: locks as ephemeral sequential nodes in Apache Curator's
//! layouts, so a Rust service and a Java service using Curator serialize on one lock
//! (feature `zookeeper`).
//!
//! [`ZooKeeperBackend`] runs on [`zookeeper-client`](https://docs.rs/zookeeper-client),
//! an async ZooKeeper client that speaks the 3.5+ protocol (container nodes, multi
//! reads, `4lw` free), reconnects within the session on its own and is kept up to date.
//! See `docs/zookeeper.md` for the layout, what each fault does and the settings.
//!
//! # How it works
//!
//! - **Curator's layouts.** A lock at key `k` is the directory `<root>/k`. An exclusive
//!   or fair lock is an `InterProcessMutex` there: every acquirer creates an ephemeral
//!   sequential node `_c_<uuid>-lock-<sequence>` (protected mode) and the lowest
//!   sequence holds. A read-write lock is an `InterProcessReadWriteLock`
//!   (`__READ__`/`__WRIT__` nodes); permits are an `InterProcessSemaphoreV2` (`locks/`
//!   and `leases/` below the key). A lock taken by Curator blocks tower-lock and the
//!   reverse.
//! - **Fair by construction, no herd.** A waiter's node keeps its place; the waiter
//!   watches the one node it waits for (its predecessor; for a read, the last write
//!   below it) and is woken when that one goes. Every mode is queued in the store.
//! - **The session is the lease.** A node lives as long as its session: a holder that
//!   dies or is cut off loses its locks when the ensemble expires its session, and the
//!   watchdog's renewals are what keeps a tower-lock lease going besides. When the
//!   session expires, or its connection is not back within a third of its timeout
//!   (before the ensemble could expire it), every hold granted in it is marked lost at
//!   once (its lost signal fires), and the backend makes a new session; a session it
//!   gave up so is closed as soon as the ensemble answers, so that its nodes free their
//!   locks then rather than a session timeout later.
//! - **Leases as well.** tower-lock writes its lease into its nodes; a tower-lock
//!   contender that sees a holder's node unchanged for that long (by its own clock,
//!   from when it first saw that version) deletes it, checked against the version it
//!   saw, so a renewal in between wins. So a fixed lease ends, and a leaked guard frees
//!   its lock, with no shared clock. Curator's nodes carry no lease and end only with
//!   their session.
//! - **Fencing tokens** are zxids, which the ensemble orders: the zxid of the write that
//!   made the grant (the node's `mzxid` after it), so tokens rise per key across
//!   holders, restarts and leader changes.
//!
//! # Example
//!
//! ```no_run
//! use tower_lock::{LockClient, ZooKeeperBackend};
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let backend = ZooKeeperBackend::builder("zk1:2181,zk2:2181,zk3:2181")
//!     .root("/locks")
//!     .build()
//!     .await?;
//! let client = LockClient::new(backend);
//! // The same lock as Curator's `new InterProcessMutex(client, "/locks/order-42")`.
//! let guard = client.get_fenced_lock("order-42")?.lock().await?;
//! guard.unlock().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! Failures surface as [`Error::Store`] with the client's
//! [`zookeeper_client::Error`] as their source. A lost connection, an expired session
//! and no answer within the response timeout are
//! [unavailable](crate::StoreErrorKind::Unavailable); refused credentials or ACLs are
//! [misconfigured](crate::StoreErrorKind::Misconfigured). A key that makes no valid
//! ZooKeeper path (an empty segment, `.` or `..`) is
//! [`ConfigError::InvalidKey`].
//!
//! # Cancel safety
//!
//! A call dropped after it was sent may still create its node; the lock core then
//! abandons the hold, which deletes whatever node carries its protected-mode uuid.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;
use zookeeper_client as zk;

use crate::backend::{
    Acquire, BoxFuture, ClientNames, FencingToken, Grant, HoldInfo, LockBackend, LockMode,
    LockRequest, LockState, Release, Signal, StoreAdmin, StoreLoss, StoreProfile, Subscription,
    Ticket, WaiterScope, Waiters, Wake,
};
use crate::error::{ConfigError, Error, Result, StoreError, StoreErrorKind};
use crate::hold_id::HoldId;
use crate::key::LockKey;

mod builder;
mod layout;
mod session;

pub use builder::ZooKeeperBackendBuilder;
use layout::{Child, NodeKind, State};
use session::{OnNewSession, Session, Sessions};

/// The path under which keys are put when none is configured: `/tower-lock`.
pub const DEFAULT_ROOT: &str = "/tower-lock";
/// The session timeout asked for when none is configured: 10 s. The ensemble bounds it
/// (`minSessionTimeout`, `maxSessionTimeout`: 2 and 20 ticks by default).
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a call waits for the ensemble's answer when none is configured: 2 s.
pub const DEFAULT_RESPONSE_TIMEOUT: Duration = Duration::from_secs(2);

/// Where client names live, under the root (ephemeral nodes, one per named client).
const CLIENTS_DIR: &str = ".clients";
/// How many lease observations are kept before old ones are dropped.
const SEEN_CAP: usize = 10_000;
/// How long after its lease's end a hold nobody renewed or released is ended by its
/// own backend (a margin for a renewal in flight at the end).
const LEASE_END_GRACE: Duration = Duration::from_millis(100);

/// Locks on a ZooKeeper ensemble, shared with Apache Curator. See the [module
/// docs](self).
#[derive(Clone)]
pub struct ZooKeeperBackend {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for ZooKeeperBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ZooKeeperBackend")
            .field("root", &self.inner.root)
            .field(
                "session",
                &self.inner.sessions.current().client.session_id(),
            )
            .finish_non_exhaustive()
    }
}

struct Inner {
    /// This, for tasks that must not keep the backend alive.
    me: std::sync::Weak<Inner>,
    /// The runtime the backend was built on, where its own tasks run: a caller's
    /// runtime may end while what it started still needs finishing.
    runtime: tokio::runtime::Handle,
    profile: StoreProfile,
    /// The root path, without a trailing `/` (empty for `/`).
    root: String,
    response_timeout: Duration,
    waiter_timeout: Duration,
    acls: zk::Acls<'static>,
    sessions: Sessions,
    /// This process's holds and queue places, by key and hold identity.
    holds: Mutex<HashMap<(LockKey, HoldId), Arc<HoldEntry>>>,
    /// Other holders' nodes as this backend saw them: the version, and since when.
    seen: Mutex<HashMap<String, Seen>>,
    /// Subscriptions per key (what a fixture counts as waiters).
    subs: Mutex<HashMap<LockKey, usize>>,
    /// Client names registered through this backend, made again in a new session.
    names: Mutex<HashMap<String, String>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        self.sessions.closed.cancel();
    }
}

/// A holder's node as first seen at a version.
#[derive(Clone, Copy)]
struct Seen {
    version: i32,
    since: Instant,
    /// How long the node lasts unchanged; `None`: it never expires so (Curator's, or a
    /// waiter's).
    lasts: Option<Duration>,
}

/// One hold or queue place of this process.
struct HoldEntry {
    state: tokio::sync::Mutex<Entry>,
    /// The loss signal of the session the hold was granted in.
    loss: Mutex<Option<StoreLoss>>,
    /// Woken when the node this one waits for changes, or the session was replaced.
    signal: Arc<Signal>,
}

/// See [`Entry::quiet`].
struct Quiet {
    /// Set when the watch fired.
    fired: Arc<std::sync::atomic::AtomicBool>,
    /// When to look again anyway: the waiter timeout at the latest.
    recheck: Instant,
    /// When the holder's lease could end, as the last look found it (`None`: it has
    /// none).
    ends: Option<Instant>,
}

struct Entry {
    /// The protected-mode uuid of this hold's nodes.
    uuid: String,
    /// The session the nodes were made in (0: none yet).
    generation: u64,
    /// The hold's node: its mutex or read-write node, or its permit's lease node.
    node: Option<String>,
    /// Permits: the node in `<key>/locks` held while the lease node is made and waits.
    gate: Option<String>,
    granted: bool,
    holds: u32,
    /// The end of the longest lease the store was asked for: never shortened.
    lease_end: Option<Instant>,
    /// The watch task of the node waited for.
    watch: Option<tokio::task::AbortHandle>,
    /// The task that ends the hold when its lease runs out unrenewed (see
    /// [`Inner::end_at_lease`]).
    lease_task: Option<tokio::task::AbortHandle>,
    /// Busy, with a watch set that has not fired: until the watch fires or the recheck
    /// time comes, nothing this hold waits for changed, and an attempt answers busy
    /// without asking the ensemble (the lock core attempts once more right after it
    /// subscribes, and after a spurious wake-up).
    quiet: Option<Quiet>,
    /// When an attempt last came for this hold: a waiter woken that does not come
    /// back within the waiter timeout vanished, and its nodes are deleted.
    last_attempt: Instant,
}

impl Entry {
    fn new(uuid: String) -> Self {
        Entry {
            uuid,
            generation: 0,
            node: None,
            gate: None,
            granted: false,
            holds: 0,
            lease_end: None,
            watch: None,
            lease_task: None,
            last_attempt: Instant::now(),
            quiet: None,
        }
    }

    fn forget_nodes(&mut self) {
        self.quiet = None;
        self.node = None;
        self.gate = None;
        self.granted = false;
        self.holds = 0;
        self.lease_end = None;
        self.stop_tasks();
    }

    fn stop_tasks(&mut self) {
        for task in [self.watch.take(), self.lease_task.take()]
            .into_iter()
            .flatten()
        {
            task.abort();
        }
    }
}

impl Drop for Entry {
    fn drop(&mut self) {
        self.stop_tasks();
    }
}

impl OnNewSession for Inner {
    fn sessions(&self) -> &Sessions {
        &self.sessions
    }

    fn new_session(&self, session: &Session) {
        // Every waiter queues again in the new session.
        let holds: Vec<_> = lock(&self.holds).values().cloned().collect();
        for entry in holds {
            entry.signal.notify_all();
        }
        let names: Vec<_> = lock(&self.names)
            .iter()
            .map(|(id, name)| (id.clone(), name.clone()))
            .collect();
        if names.is_empty() {
            return;
        }
        let client = session.client.clone();
        let dir = self.path_of(CLIENTS_DIR);
        let acls = self.acls;
        tokio::spawn(async move {
            for (id, name) in names {
                let _ = register_in(&client, &dir, acls, &id, &name).await;
            }
        });
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Whether `error` is the connection's, not the call's: the request may or may not
/// have been applied. The client fails the calls in flight with the error that ended
/// the connection: `ConnectionLoss` for an end of stream, the I/O error itself (a
/// reset: "connection reset by peer") or "no response from connection" otherwise.
fn lost_in_transit(error: &zk::Error) -> bool {
    matches!(error, zk::Error::ConnectionLoss | zk::Error::Custom(_))
}

/// Takes back, on the backend's runtime, the hold of a first acquisition dropped before
/// its answer (its future cancelled, or its runtime shut down), or answered with an
/// error that may have left a node (a call unanswered in time). The lock core does the
/// same from a task on the caller's runtime, which may run no more; a node whose
/// creation was on the wire would then stay as long as the session, as no store lease
/// ends it. So it is tried again, with backoff, until the ensemble answers (or the
/// session is replaced: its nodes end with it). Taken back twice is no harm: the second
/// finds nothing.
struct Dropped<'a> {
    inner: &'a Inner,
    req: &'a LockRequest,
    armed: bool,
}

impl Drop for Dropped<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let me = self.inner.me.clone();
        let req = self.req.clone();
        self.inner.runtime.spawn(async move {
            let mut backoff = Duration::from_millis(50);
            loop {
                let Some(inner) = me.upgrade() else {
                    return;
                };
                match inner.abandon(&req).await {
                    Err(error) if error.is_unavailable() => {}
                    _ => return,
                }
                drop(inner);
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
        });
    }
}

/// Deletes `e`'s nodes, made in session `generation`, trying again with backoff while
/// the ensemble does not answer (a delete cut off on the wire applied nothing): a node
/// forgotten so would stay for as long as its session. Ends once they are gone, the
/// session was replaced (its nodes end with it), or the backend is gone.
async fn delete_until_answered(me: &std::sync::Weak<Inner>, e: &mut Entry, generation: u64) {
    let mut backoff = Duration::from_millis(50);
    loop {
        let Some(inner) = me.upgrade() else {
            return;
        };
        let session = inner.sessions.current();
        if session.generation != generation {
            return;
        }
        match inner.delete_known(&session.client, e).await {
            Err(error) if error.is_unavailable() => {}
            _ => return,
        }
        drop(inner);
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// A ZooKeeper error as the lock core needs it.
fn store_error(error: zk::Error) -> Error {
    if lost_in_transit(&error) {
        return StoreError::connection_lost(error).into();
    }
    let kind = match error {
        zk::Error::NoHosts | zk::Error::ClientClosed => {
            return StoreError::not_applied(error).into();
        }
        zk::Error::SessionExpired
        | zk::Error::Timeout
        | zk::Error::Throttled
        | zk::Error::SessionMoved
        | zk::Error::NotReadOnly => StoreErrorKind::Unavailable,
        zk::Error::NoAuth | zk::Error::AuthFailed | zk::Error::InvalidAcl => {
            StoreErrorKind::Misconfigured
        }
        _ => StoreErrorKind::Unexpected,
    };
    StoreError::new(kind, error).into()
}

/// The sequence-free result type of one ZooKeeper call under the response timeout.
type Zk<T> = std::result::Result<T, zk::Error>;

impl Inner {
    /// `call`, bounded by the response timeout: no answer is an unanswered outage.
    async fn call<T>(&self, call: impl std::future::Future<Output = Zk<T>>) -> Result<Zk<T>> {
        match tokio::time::timeout(self.response_timeout, call).await {
            Ok(result) => Ok(result),
            Err(_) => Err(StoreError::msg(
                StoreErrorKind::Unavailable,
                format!(
                    "ZooKeeper did not answer within {:?}",
                    self.response_timeout
                ),
            )
            .and_unanswered()
            .into()),
        }
    }

    /// `call`'s answer, any ZooKeeper error made a store error.
    async fn ok<T>(&self, call: impl std::future::Future<Output = Zk<T>>) -> Result<T> {
        self.call(call).await?.map_err(store_error)
    }

    fn path_of(&self, key: &str) -> String {
        format!("{}/{key}", self.root)
    }

    /// The directory of `key`'s lock, or why the key makes no path.
    fn dir_of(&self, key: &LockKey) -> Result<String> {
        layout::check_key(key.as_str())
            .map_err(|reason| Error::Config(ConfigError::InvalidKey { reason }))?;
        Ok(self.path_of(key.as_str()))
    }

    fn entry(&self, req: &LockRequest) -> Arc<HoldEntry> {
        let mut holds = lock(&self.holds);
        let entry = holds
            .entry((req.key.clone(), req.hold_id.clone()))
            .or_insert_with(|| {
                Arc::new(HoldEntry {
                    state: tokio::sync::Mutex::new(Entry::new(uuid::Uuid::new_v4().to_string())),
                    loss: Mutex::new(None),
                    signal: Arc::new(Signal::new()),
                })
            });
        Arc::clone(entry)
    }

    fn existing(&self, req: &LockRequest) -> Option<Arc<HoldEntry>> {
        lock(&self.holds)
            .get(&(req.key.clone(), req.hold_id.clone()))
            .cloned()
    }

    fn forget(&self, req: &LockRequest, entry: &Arc<HoldEntry>) {
        let mut holds = lock(&self.holds);
        let k = (req.key.clone(), req.hold_id.clone());
        if holds.get(&k).is_some_and(|e| Arc::ptr_eq(e, entry)) {
            holds.remove(&k);
        }
    }

    /// Creates an ephemeral sequential node (protected) of `kind` in `dir`, making the
    /// directory (container nodes, as Curator does) if need be. A creation whose answer
    /// was lost is found again by its uuid.
    async fn create_node(
        &self,
        client: &zk::Client,
        dir: &str,
        uuid: &str,
        kind: NodeKind,
        data: &[u8],
    ) -> Result<String> {
        let prefix = layout::node_prefix(dir, uuid, kind);
        let options = zk::CreateMode::EphemeralSequential.with_acls(self.acls);
        for _ in 0..3 {
            match self.call(client.create(&prefix, data, &options)).await? {
                Ok((_, sequence)) => return Ok(format!("{prefix}{sequence}")),
                Err(zk::Error::NoNode) => {
                    let parents = zk::CreateMode::Container.with_acls(self.acls);
                    match self.call(client.mkdir(dir, &parents)).await? {
                        Ok(()) | Err(zk::Error::NodeExists) => continue,
                        Err(error) => return Err(store_error(error)),
                    }
                }
                Err(error) if lost_in_transit(&error) => {
                    if let Some(found) = self.find_node(client, dir, uuid).await? {
                        return Ok(found);
                    }
                    return Err(store_error(error));
                }
                Err(error) => return Err(store_error(error)),
            }
        }
        Err(StoreError::msg(
            StoreErrorKind::Unexpected,
            format!("the lock directory {dir} kept vanishing"),
        )
        .into())
    }

    /// The node of `dir` created with `uuid`, if any.
    async fn find_node(
        &self,
        client: &zk::Client,
        dir: &str,
        uuid: &str,
    ) -> Result<Option<String>> {
        let children = match self.call(client.list_children(dir)).await? {
            Ok(children) => children,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(error) => return Err(store_error(error)),
        };
        Ok(children
            .into_iter()
            .find(|c| layout::protected_of(c) == Some(uuid))
            .map(|c| format!("{dir}/{c}")))
    }

    /// Deletes `path` if it is there.
    async fn delete_node(&self, client: &zk::Client, path: &str) -> Result<bool> {
        match self.call(client.delete(path, None)).await? {
            Ok(()) => Ok(true),
            Err(zk::Error::NoNode) => Ok(false),
            Err(error) => Err(store_error(error)),
        }
    }

    /// The lock nodes of `dir`, by sequence (none when it does not exist).
    async fn children(&self, client: &zk::Client, dir: &str) -> Result<Vec<Child>> {
        match self.call(client.list_children(dir)).await? {
            Ok(names) => Ok(layout::sorted(names)),
            Err(zk::Error::NoNode) => Ok(Vec::new()),
            Err(error) => Err(store_error(error)),
        }
    }

    /// Looks at the nodes that hold `dir` now (`others`, not this hold's own): deletes
    /// any tower-lock holder seen unchanged for its whole lease, and answers whether one
    /// was deleted and how long until the next of them could be (`None` when a holder
    /// has no lease: Curator's, or a waiter's).
    ///
    /// A node is read only when this backend has not seen it yet or its lease, as last
    /// seen, could have run out: a renewal since only moves its end later, and the
    /// deletion is always checked against the version just read.
    async fn expire(
        &self,
        client: &zk::Client,
        dir: &str,
        others: &[&Child],
    ) -> Result<(bool, Option<Duration>)> {
        let now = Instant::now();
        let mut ttl: Option<Duration> = Some(Duration::MAX);
        let mut to_read = Vec::new();
        {
            let seen = lock(&self.seen);
            for c in others {
                let path = format!("{dir}/{}", c.name);
                match seen.get(&path) {
                    Some(Seen { lasts: None, .. }) => ttl = None,
                    Some(Seen {
                        since,
                        lasts: Some(lease),
                        ..
                    }) if *since + *lease > now => {
                        let left = *since + *lease - now;
                        ttl = ttl.map(|t| t.min(left));
                    }
                    _ => to_read.push(path),
                }
            }
        }
        let mut deleted = false;
        if !to_read.is_empty() {
            let mut reader = client.new_multi_reader();
            for path in &to_read {
                reader.add_get_data(path).map_err(store_error)?;
            }
            let results = self.ok(reader.commit()).await?;
            let now = Instant::now();
            for (path, result) in to_read.iter().zip(results) {
                let zk::MultiReadResult::Data { data, stat } = result else {
                    // Gone already.
                    deleted = true;
                    continue;
                };
                let lasts = match layout::decode(&data) {
                    Some((State::Holding, lease, _)) => Some(lease),
                    // A waiter at the head claims it within a round trip, or its own
                    // backend deletes it (see `spawn_watch`); Curator's nodes end with
                    // their session.
                    _ => None,
                };
                let seen = self.observe(path, stat.version, lasts, now);
                let Some(lease) = seen.lasts else {
                    ttl = None;
                    continue;
                };
                let ends = seen.since + lease;
                if ends > now {
                    ttl = ttl.map(|t| t.min(ends - now));
                    continue;
                }
                match self.call(client.delete(path, Some(stat.version))).await? {
                    Ok(()) => {
                        tracing::debug!(node = %path, "ZooKeeper: deleted a holder's node whose lease ran out");
                        deleted = true;
                    }
                    // Gone, or renewed meanwhile (it lives on): look again.
                    Err(zk::Error::NoNode | zk::Error::BadVersion) => deleted = true,
                    Err(error) => return Err(store_error(error)),
                }
                lock(&self.seen).remove(path);
            }
        }
        Ok((deleted, ttl.filter(|t| *t != Duration::MAX)))
    }

    /// Since when `path` has been seen at `version` (which lasts `lasts` unchanged).
    fn observe(&self, path: &str, version: i32, lasts: Option<Duration>, now: Instant) -> Seen {
        let mut seen = lock(&self.seen);
        if seen.len() >= SEEN_CAP && !seen.contains_key(path) {
            // Old observations of nodes nobody looked at for long: forget them (a
            // node seen again starts its clock anew, which only makes it last longer).
            let horizon = now.checked_sub(Duration::from_secs(3600)).unwrap_or(now);
            seen.retain(|_, s| s.since > horizon);
            if seen.len() >= SEEN_CAP {
                seen.clear();
            }
        }
        let fresh = Seen {
            version,
            since: now,
            lasts,
        };
        let entry = seen.entry(path.to_owned()).or_insert(fresh);
        if entry.version != version {
            *entry = fresh;
        }
        *entry
    }

    /// Watches `path` for this hold: its change or deletion wakes the hold's waiters.
    /// `false` if it is gone already.
    async fn watch(
        &self,
        client: &zk::Client,
        entry: &Arc<HoldEntry>,
        e: &mut Entry,
        req: &LockRequest,
        path: &str,
    ) -> Result<bool> {
        let watcher = match self.call(client.check_and_watch_stat(path)).await? {
            Ok((Some(_), watcher)) => watcher,
            Ok((None, _)) => return Ok(false),
            Err(error) => return Err(store_error(error)),
        };
        // A change of the node's data (a renewal, its owner claiming it) leaves this
        // waiter where it is: the watch is set again, and only the node's deletion (or
        // the session's end) wakes the waiter.
        let client = client.clone();
        let path = path.to_owned();
        self.spawn_watch(entry, e, req, async move {
            let mut watcher = watcher;
            loop {
                let event = watcher.changed().await;
                if event.event_type != zk::EventType::NodeDataChanged {
                    return;
                }
                match client.check_and_watch_stat(&path).await {
                    Ok((Some(_), again)) => watcher = again,
                    _ => return,
                }
            }
        });
        Ok(true)
    }

    /// Runs `fired` for this hold: once it fires, the hold's waiters are woken; if no
    /// attempt comes within the waiter timeout after that (the waiter vanished: its
    /// acquisition was leaked, its process lives on), its nodes are deleted, so they
    /// block nobody. An attempt replaces the task, and ends the wait for it.
    fn spawn_watch(
        &self,
        entry: &Arc<HoldEntry>,
        e: &mut Entry,
        req: &LockRequest,
        fired: impl std::future::Future<Output = ()> + Send + 'static,
    ) {
        let signal = Arc::clone(&entry.signal);
        let weak_entry = Arc::downgrade(entry);
        let me = self.me.clone();
        let key = (req.key.clone(), req.hold_id.clone());
        let timeout = self.waiter_timeout;
        let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // On the backend's runtime: the waiter's may end, and with it whatever waits
        // there, while its node stays queued.
        e.quiet = Some(Quiet {
            fired: Arc::clone(&flag),
            recheck: Instant::now() + timeout,
            ends: None,
        });
        let task = self.runtime.spawn(async move {
            fired.await;
            flag.store(true, std::sync::atomic::Ordering::Release);
            signal.notify_all();
            let woken_at = Instant::now();
            tokio::time::sleep(timeout).await;
            let (Some(entry), Some(inner)) = (weak_entry.upgrade(), me.upgrade()) else {
                return;
            };
            let mut e = entry.state.lock().await;
            if e.granted || e.last_attempt >= woken_at {
                return;
            }
            tracing::debug!(key = %key.0, hold_id = %key.1, "ZooKeeper: a woken waiter never came back; leaving its queue place");
            drop(inner);
            let generation = e.generation;
            delete_until_answered(&me, &mut e, generation).await;
            // Not `forget_nodes`: that would abort this task.
            e.node = None;
            e.gate = None;
            e.granted = false;
            drop(e);
            let Some(inner) = me.upgrade() else {
                return;
            };
            let mut holds = lock(&inner.holds);
            if holds.get(&key).is_some_and(|x| Arc::ptr_eq(x, &entry)) {
                holds.remove(&key);
            }
        });
        if let Some(old) = e.watch.replace(task.abort_handle()) {
            old.abort();
        }
    }

    /// The grant of `e`'s node: a write that starts its lease where everyone sees it
    /// and whose zxid is the fencing token. Skipped for an unfenced grant in the call
    /// that made the node (no other client can have seen it before this call began).
    async fn grant(
        &self,
        session: &Session,
        entry: &HoldEntry,
        e: &mut Entry,
        req: &LockRequest,
        made_now: bool,
    ) -> Result<Option<Acquire>> {
        let client = &session.client;
        let Some(node) = e.node.clone() else {
            return Ok(None);
        };
        if session.lost.is_fired() {
            // Given up here (its connection was not back in time) though the
            // ensemble still answered: a hold in it would be lost at once.
            return Err(StoreError::msg(
                StoreErrorKind::Unavailable,
                "the ZooKeeper session was given up; waiting for a new one",
            )
            .into());
        }
        let mut token = None;
        if req.fenced || !made_now {
            let data = layout::encode(State::Holding, req.lease, req.hold_id.as_str());
            match self.call(client.set_data(&node, &data, None)).await? {
                Ok(stat) => token = Some(FencingToken::new(zxid(stat.mzxid))),
                Err(zk::Error::NoNode) => {
                    e.forget_nodes();
                    return Ok(None);
                }
                Err(error) => return Err(store_error(error)),
            }
        }
        if let Some(gate) = e.gate.take() {
            self.delete_node(client, &gate).await?;
        }
        if let Some(watch) = e.watch.take() {
            watch.abort();
        }
        e.granted = true;
        e.holds = 1;
        *lock(&entry.loss) = Some(session.lost.clone());
        e.lease_end = Instant::now().checked_add(req.lease);
        Ok(Some(Acquire::Acquired(Grant::new(
            1,
            token.filter(|_| req.fenced),
        ))))
    }

    async fn acquire(&self, req: &LockRequest) -> Result<Acquire> {
        let dir = self.dir_of(&req.key)?;
        let Some(session) = self.sessions.live(self.response_timeout).await else {
            return Err(StoreError::not_applied(
                "the ZooKeeper session was given up and no new one could be made yet",
            )
            .into());
        };
        let entry = self.entry(req);
        let mut e = entry.state.lock().await;
        // A first acquisition dropped from here on, or failed in a way that may have
        // left a node, is taken back; a re-entry's hold is its guards'.
        let mut dropped = Dropped {
            inner: self,
            req,
            armed: !e.granted,
        };
        let answer = self.attempt(req, &dir, &session, &entry, &mut e).await;
        dropped.armed &= matches!(&answer, Err(error) if !error.is_not_applied());
        drop(dropped);
        let answer = answer?;
        if let Acquire::Acquired(_) = answer
            && (session.lost.is_fired() || self.sessions.current().generation != session.generation)
        {
            // Answered by a session this backend has given up (its client came back
            // after the grace, while the backend made a new one): its nodes end with
            // it, so this grant is nobody's. The caller tries again in the new one.
            e.forget_nodes();
            return Err(StoreError::msg(
                StoreErrorKind::Unavailable,
                "the ZooKeeper session ended during the attempt",
            )
            .into());
        }
        if let Acquire::Acquired(_) = answer {
            self.end_at_lease(&entry, &mut e, req);
        }
        Ok(answer)
    }

    /// Ends `e`'s hold when its lease runs out with nobody renewing or releasing it, as
    /// a store's lease would: its node goes, on the backend's runtime. A guard whose
    /// runtime ended can neither renew its hold nor release it (its release is spawned
    /// there), a guard may be leaked, and a node has no lease the server ends;
    /// tower-lock contenders delete such a node a lease after they first see it,
    /// Curator's never do. The lock core counts the lease from before it sent the
    /// request, so its guard is lost by then. Armed at each grant and renewal; a later
    /// one replaces it.
    fn end_at_lease(&self, entry: &Arc<HoldEntry>, e: &mut Entry, req: &LockRequest) {
        let Some(end) = e.lease_end else {
            return;
        };
        let weak_entry = Arc::downgrade(entry);
        let me = self.me.clone();
        let key = (req.key.clone(), req.hold_id.clone());
        let generation = e.generation;
        let task = self.runtime.spawn(async move {
            tokio::time::sleep_until(end + LEASE_END_GRACE).await;
            let Some(entry) = weak_entry.upgrade() else {
                return;
            };
            let mut e = entry.state.lock().await;
            let renewed = e.lease_end.is_some_and(|later| later > end);
            if !e.granted || e.generation != generation || renewed {
                return;
            }
            tracing::debug!(key = %key.0, hold_id = %key.1, "ZooKeeper: a hold's lease ran out unrenewed and unreleased; deleting its node");
            // Holding the entry: the lease is over, so no renewal can be due, and a
            // release finds nothing left to do.
            delete_until_answered(&me, &mut e, generation).await;
            // Not `forget_nodes`: that would abort this task.
            e.node = None;
            e.gate = None;
            e.granted = false;
            e.holds = 0;
            e.lease_end = None;
            e.quiet = None;
            drop(e);
            if let Some(inner) = me.upgrade() {
                let mut holds = lock(&inner.holds);
                if holds.get(&key).is_some_and(|x| Arc::ptr_eq(x, &entry)) {
                    holds.remove(&key);
                }
            }
        });
        if let Some(old) = e.lease_task.replace(task.abort_handle()) {
            old.abort();
        }
    }

    /// Deletes `e`'s nodes, each forgotten once it is gone.
    async fn delete_known(&self, client: &zk::Client, e: &mut Entry) -> Result<()> {
        for slot in [&mut e.node, &mut e.gate] {
            if let Some(path) = slot.clone() {
                self.delete_node(client, &path).await?;
                *slot = None;
            }
        }
        Ok(())
    }

    /// One attempt of `req` in `session`, on its hold's entry `e`.
    async fn attempt(
        &self,
        req: &LockRequest,
        dir: &str,
        session: &Session,
        entry: &Arc<HoldEntry>,
        e: &mut Entry,
    ) -> Result<Acquire> {
        let client = &session.client;
        e.last_attempt = Instant::now();
        if e.generation != session.generation {
            // Nodes of an ended session are gone with it.
            e.forget_nodes();
            e.generation = session.generation;
        }
        if e.granted {
            return self.reenter(client, e, req).await;
        }
        if let Some(quiet) = &e.quiet {
            let now = Instant::now();
            if !quiet.fired.load(std::sync::atomic::Ordering::Acquire) && quiet.recheck > now {
                let ttl = quiet.ends.map(|at| at.saturating_duration_since(now));
                return Ok(self.busy(ttl));
            }
        }
        e.quiet = None;
        let kind = NodeKind::of(req.mode);
        let data = layout::encode(State::Holding, req.lease, req.hold_id.as_str());
        let mut made_now = false;
        for _ in 0..8 {
            if let LockMode::Permits { max } = req.mode {
                if let Some(answer) = self
                    .permit(session, entry, e, req, dir, max, &data, &mut made_now)
                    .await?
                {
                    return Ok(answer);
                }
                continue;
            }
            if e.node.is_none() {
                let uuid = e.uuid.clone();
                e.node = Some(self.create_node(client, dir, &uuid, kind, &data).await?);
                made_now = true;
            }
            let children = self.children(client, dir).await?;
            if e.node.is_none() {
                continue;
            }
            let mine = last_segment(e.node.as_deref());
            let Some(index) = children.iter().position(|c| c.name == mine) else {
                // Deleted behind this hold's back (its lease ran out unseen): queue again.
                e.node = None;
                continue;
            };
            let writer_node = match (&req.writer, req.mode) {
                (Some(writer), LockMode::Read) => self.writer_node(req, writer).await,
                _ => None,
            };
            match layout::blocker(&children, index, writer_node.as_deref()) {
                None => match self.grant(session, entry, e, req, made_now).await? {
                    Some(answer) => return Ok(answer),
                    None => continue,
                },
                Some(blocker) => {
                    let blocker_path = format!("{dir}/{}", blocker.name);
                    let holders: Vec<&Child> = layout::holders(&children)
                        .iter()
                        .filter(|c| {
                            c.name != mine && Some(format!("{dir}/{}", c.name)) != writer_node
                        })
                        .collect();
                    let (deleted, ttl) = self.expire(client, dir, &holders).await?;
                    if deleted {
                        continue;
                    }
                    if !self.watch(client, entry, e, req, &blocker_path).await? {
                        continue;
                    }
                    return Ok(self.quiet_busy(e, ttl));
                }
            }
        }
        // The queue kept changing under this attempt: busy, and woken to look again.
        entry.signal.notify_all();
        Ok(self.busy(None))
    }

    /// A busy answer: the waiter comes back when the holder's lease could end (or is
    /// woken by its watch before).
    fn busy(&self, ttl: Option<Duration>) -> Acquire {
        Acquire::Busy { ttl }
    }

    /// A busy answer with the watch `spawn_watch` just set: attempts answer it again
    /// without the ensemble until the watch fires, or `ttl` (a holder's lease that
    /// could run out), or the waiter timeout at the latest, passes.
    fn quiet_busy(&self, e: &mut Entry, ttl: Option<Duration>) -> Acquire {
        let now = Instant::now();
        if let Some(quiet) = e.quiet.as_mut() {
            quiet.recheck = now + ttl.unwrap_or(self.waiter_timeout).min(self.waiter_timeout);
            quiet.ends = ttl.and_then(|t| now.checked_add(t));
        }
        Acquire::Busy { ttl }
    }

    /// The node of this process's write hold `writer` of `req.key`, for a read let in
    /// past it.
    async fn writer_node(&self, req: &LockRequest, writer: &HoldId) -> Option<String> {
        let entry = lock(&self.holds)
            .get(&(req.key.clone(), writer.clone()))
            .cloned()?;
        let e = entry.state.lock().await;
        e.granted.then(|| e.node.clone()).flatten()
    }

    /// One step of a permit's acquisition, as `InterProcessSemaphoreV2` takes one: hold
    /// the mutex at `<dir>/locks`, make a lease node in `<dir>/leases`, and have the
    /// permit once at most `max` lease nodes are there. `None`: look again.
    #[allow(clippy::too_many_arguments)]
    async fn permit(
        &self,
        session: &Session,
        entry: &Arc<HoldEntry>,
        e: &mut Entry,
        req: &LockRequest,
        dir: &str,
        max: NonZeroU32,
        data: &[u8],
        made_now: &mut bool,
    ) -> Result<Option<Acquire>> {
        let client = &session.client;
        let gates = format!("{dir}/locks");
        let leases = format!("{dir}/leases");
        let uuid = e.uuid.clone();
        let waiting = layout::encode(State::Waiting, self.waiter_timeout, req.hold_id.as_str());
        if e.node.is_none() {
            // First the semaphore's mutex.
            if e.gate.is_none() {
                e.gate = Some(
                    self.create_node(client, &gates, &uuid, NodeKind::Mutex, &waiting)
                        .await?,
                );
            }
            let children = self.children(client, &gates).await?;
            let mine = last_segment(e.gate.as_deref());
            let Some(index) = children.iter().position(|c| c.name == mine) else {
                e.gate = None;
                return Ok(None);
            };
            if let Some(blocker) = layout::blocker(&children, index, None) {
                let holder: Vec<&Child> = children.first().into_iter().collect();
                let (deleted, ttl) = self.expire(client, &gates, &holder).await?;
                if deleted {
                    return Ok(None);
                }
                let path = format!("{gates}/{}", blocker.name);
                if !self.watch(client, entry, e, req, &path).await? {
                    return Ok(None);
                }
                return Ok(Some(self.quiet_busy(e, ttl)));
            }
            e.node = Some(
                self.create_node(client, &leases, &uuid, NodeKind::Lease, data)
                    .await?,
            );
            *made_now = true;
        }
        let (names, watcher) = match self.call(client.list_and_watch_children(&leases)).await? {
            Ok(answer) => answer,
            Err(zk::Error::NoNode) => {
                e.node = None;
                return Ok(None);
            }
            Err(error) => return Err(store_error(error)),
        };
        let children = layout::sorted(names);
        let mine = last_segment(e.node.as_deref());
        if !children.iter().any(|c| c.name == mine) {
            e.node = None;
            return Ok(None);
        }
        if children.len() <= max.get() as usize {
            return self.grant(session, entry, e, req, *made_now).await;
        }
        let others: Vec<&Child> = children.iter().filter(|c| c.name != mine).collect();
        let (deleted, ttl) = self.expire(client, &leases, &others).await?;
        if deleted {
            return Ok(None);
        }
        self.spawn_watch(entry, e, req, async move {
            watcher.changed().await;
        });
        Ok(Some(self.quiet_busy(e, ttl)))
    }

    /// The hold `e` is granted already: one more count, its lease extended (never
    /// shortened), a new token for a fenced request.
    async fn reenter(
        &self,
        client: &zk::Client,
        e: &mut Entry,
        req: &LockRequest,
    ) -> Result<Acquire> {
        let token = match self.extend(client, e, req, req.fenced).await? {
            Some(token) => token,
            None => {
                e.forget_nodes();
                return Err(Error::Lost);
            }
        };
        e.holds = e.holds.saturating_add(1);
        Ok(Acquire::Acquired(Grant::new(
            e.holds,
            token.filter(|_| req.fenced),
        )))
    }

    /// Writes `e`'s lease anew, to the later of its current end and `req.lease` from
    /// now, when that is later or `always`. `None`: the node is gone; else the zxid of
    /// the write, if one was made.
    async fn extend(
        &self,
        client: &zk::Client,
        e: &mut Entry,
        req: &LockRequest,
        always: bool,
    ) -> Result<Option<Option<FencingToken>>> {
        let Some(node) = e.node.clone() else {
            return Ok(None);
        };
        let now = Instant::now();
        let wanted = now.checked_add(req.lease);
        let end = match (e.lease_end, wanted) {
            (Some(current), Some(wanted)) => Some(current.max(wanted)),
            _ => None,
        };
        let lengthens = match (e.lease_end, wanted) {
            (Some(current), Some(wanted)) => wanted > current,
            _ => false,
        };
        if !always && !lengthens {
            // Still confirm the node is there.
            return match self.call(client.check_stat(&node)).await? {
                Ok(Some(_)) => Ok(Some(None)),
                Ok(None) => Ok(None),
                Err(error) => Err(store_error(error)),
            };
        }
        let lease = end.map_or(req.lease, |end| {
            let left = end.saturating_duration_since(now);
            Duration::from_millis(
                u64::try_from(left.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX),
            )
        });
        let data = layout::encode(State::Holding, lease, req.hold_id.as_str());
        match self.call(client.set_data(&node, &data, None)).await? {
            Ok(stat) => {
                e.lease_end = end;
                Ok(Some(Some(FencingToken::new(zxid(stat.mzxid)))))
            }
            Err(zk::Error::NoNode) => Ok(None),
            Err(error) => Err(store_error(error)),
        }
    }

    async fn renew(&self, req: &LockRequest) -> Result<bool> {
        let Some(entry) = self.existing(req) else {
            return Ok(false);
        };
        let session = self.sessions.current();
        let mut e = entry.state.lock().await;
        if !e.granted || e.generation != session.generation || session.lost.is_fired() {
            return Ok(false);
        }
        let renewed = self.extend(&session.client, &mut e, req, true).await?;
        if renewed.is_none() {
            e.forget_nodes();
        } else {
            self.end_at_lease(&entry, &mut e, req);
        }
        Ok(renewed.is_some())
    }

    async fn release(&self, req: &LockRequest) -> Result<Release> {
        let Some(entry) = self.existing(req) else {
            return Ok(Release::NotHeld);
        };
        let session = self.sessions.current();
        let client = &session.client;
        let mut e = entry.state.lock().await;
        if !e.granted || e.generation != session.generation {
            return Ok(Release::NotHeld);
        }
        if e.holds > 1 {
            if self.extend(client, &mut e, req, false).await?.is_none() {
                e.forget_nodes();
                drop(e);
                self.forget(req, &entry);
                return Ok(Release::NotHeld);
            }
            e.holds -= 1;
            self.end_at_lease(&entry, &mut e, req);
            return Ok(Release::Decremented { holds: e.holds });
        }
        let Some(node) = e.node.clone() else {
            return Ok(Release::NotHeld);
        };
        let deleted = self.delete_node(client, &node).await?;
        e.forget_nodes();
        drop(e);
        self.forget(req, &entry);
        lock(&self.seen).remove(&node);
        Ok(if deleted {
            Release::Released
        } else {
            Release::NotHeld
        })
    }

    /// Leaves the queue or gives the hold up: deletes every node of the hold (found by
    /// its uuid where its path is not known: a creation whose answer was lost).
    async fn abandon(&self, req: &LockRequest) -> Result<()> {
        let Some(entry) = self.existing(req) else {
            return Ok(());
        };
        let session = self.sessions.current();
        let client = &session.client;
        let mut e = entry.state.lock().await;
        if e.generation == session.generation {
            // Known nodes: one delete each, in the session's order (before anything
            // this process sends after). A node whose creation's answer never came has
            // the hold's uuid, and is looked for: the session answers in order, so that
            // creation is done by the time the search is. A permit's lease node is made
            // only once its gate's creation was answered: with the lease node known,
            // there is no gate to look for.
            let dir = self.dir_of(&req.key)?;
            let places: Vec<(Option<String>, Option<String>)> = match req.mode {
                LockMode::Permits { .. } => vec![
                    (e.node.clone(), Some(format!("{dir}/leases"))),
                    (
                        e.gate.clone(),
                        e.node.is_none().then(|| format!("{dir}/locks")),
                    ),
                ],
                _ => vec![(e.node.clone(), Some(dir))],
            };
            for (known, parent) in places {
                let path = match (known, parent) {
                    (Some(path), _) => Some(path),
                    (None, Some(parent)) => self.find_node(client, &parent, &e.uuid).await?,
                    (None, None) => None,
                };
                if let Some(path) = path {
                    self.delete_node(client, &path).await?;
                }
            }
        }
        e.forget_nodes();
        drop(e);
        self.forget(req, &entry);
        Ok(())
    }

    async fn cancel_wait(&self, req: &LockRequest) -> Result<()> {
        let Some(entry) = self.existing(req) else {
            return Ok(());
        };
        {
            let e = entry.state.lock().await;
            if e.granted {
                // Granted meanwhile: the hold is the caller's to release.
                return Ok(());
            }
        }
        self.abandon(req).await
    }

    async fn inspect(&self, key: &LockKey, mode: LockMode) -> Result<LockState> {
        let dir = self.dir_of(key)?;
        let client = self.sessions.current().client.clone();
        let (dir, children) = match mode {
            LockMode::Permits { .. } => {
                let leases = format!("{dir}/leases");
                let children = self.children(&client, &leases).await?;
                (leases, children)
            }
            _ => {
                let children = self.children(&client, &dir).await?;
                (dir, children)
            }
        };
        let holding: Vec<&Child> = match mode {
            LockMode::Permits { max } => children.iter().take(max.get() as usize).collect(),
            _ => layout::holders(&children).iter().collect(),
        };
        let waiting = children.len() - holding.len();
        let mut reader = client.new_multi_reader();
        for c in &holding {
            reader
                .add_get_data(&format!("{dir}/{}", c.name))
                .map_err(store_error)?;
        }
        let results = if holding.is_empty() {
            Vec::new()
        } else {
            self.ok(reader.commit()).await?
        };
        let wall_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        let mut holders = Vec::new();
        let mut newest: Option<u64> = None;
        for (c, result) in holding.iter().zip(results) {
            let zk::MultiReadResult::Data { data, stat } = result else {
                continue;
            };
            let shown_mode = match (c.kind, mode) {
                (NodeKind::Mutex, LockMode::Fair) => LockMode::Fair,
                (NodeKind::Mutex, _) => LockMode::Exclusive,
                (NodeKind::Write, _) => LockMode::Write,
                (NodeKind::Read, _) => LockMode::Read,
                (NodeKind::Lease, LockMode::Permits { max }) => LockMode::Permits { max },
                (NodeKind::Lease, _) => LockMode::Permits {
                    max: NonZeroU32::MAX,
                },
            };
            let (hold_id, ttl) = match layout::decode(&data) {
                Some((_, lease, hold_id)) => {
                    // By the ensemble's clock (the node's last change), as far as this
                    // machine's clock agrees with it: for inspection only.
                    let ends = stat
                        .mtime
                        .saturating_add(i64::try_from(lease.as_millis()).unwrap_or(i64::MAX));
                    let left = u64::try_from(ends.saturating_sub(wall_ms).max(0)).unwrap_or(0);
                    (
                        hold_id.to_owned(),
                        Some(Duration::from_millis(left).min(lease)),
                    )
                }
                // Curator's: no lease, named by its node.
                None => (c.name.clone(), None),
            };
            let Ok(hold_id) = HoldId::from_raw(&hold_id) else {
                continue;
            };
            let token = FencingToken::new(zxid(stat.mzxid));
            newest = newest.max(Some(token.get()));
            holders.push(HoldInfo::new(hold_id, shown_mode, 1, ttl).with_token(Some(token)));
        }
        Ok(
            LockState::new(holders, Waiters::new(waiting, WaiterScope::Store))
                .with_fencing_token(newest.map(FencingToken::new)),
        )
    }

    async fn force_release(&self, key: &LockKey, mode: LockMode) -> Result<bool> {
        let dir = self.dir_of(key)?;
        let client = self.sessions.current().client.clone();
        let dir = match mode {
            LockMode::Permits { .. } => format!("{dir}/leases"),
            _ => dir,
        };
        let children = self.children(&client, &dir).await?;
        let mut any = false;
        let holding: Vec<Child> = match mode {
            LockMode::Permits { .. } => children.clone(),
            _ => layout::holders(&children).to_vec(),
        };
        for c in holding {
            any |= self
                .delete_node(&client, &format!("{dir}/{}", c.name))
                .await?;
        }
        Ok(any)
    }
}

/// A client id names a node: one path segment.
fn check_client_id(id: &str) -> Result<()> {
    if id.contains('/') {
        return Err(ConfigError::invalid_setting("client id", format!("{id:?} has a `/`")).into());
    }
    layout::check_key(id).map_err(|reason| ConfigError::invalid_setting("client id", reason).into())
}

/// The last segment of a node's path (its name in its directory).
fn last_segment(path: Option<&str>) -> String {
    path.and_then(|p| p.rsplit('/').next())
        .unwrap_or_default()
        .to_owned()
}

/// A zxid as a token: zxids are positive.
fn zxid(zxid: i64) -> u64 {
    u64::try_from(zxid).unwrap_or(0)
}

async fn register_in(
    client: &zk::Client,
    dir: &str,
    acls: zk::Acls<'static>,
    id: &str,
    name: &str,
) -> Zk<()> {
    let path = format!("{dir}/{id}");
    let options = zk::CreateMode::Ephemeral.with_acls(acls);
    for _ in 0..3 {
        match client.create(&path, name.as_bytes(), &options).await {
            Ok(_) => return Ok(()),
            Err(zk::Error::NodeExists) => {
                client.set_data(&path, name.as_bytes(), None).await?;
                return Ok(());
            }
            Err(zk::Error::NoNode) => {
                let parents = zk::CreateMode::Container.with_acls(acls);
                match client.mkdir(dir, &parents).await {
                    Ok(()) | Err(zk::Error::NodeExists) => continue,
                    Err(error) => return Err(error),
                }
            }
            Err(error) => return Err(error),
        }
    }
    Err(zk::Error::NoNode)
}

impl ZooKeeperBackend {
    /// A builder for a backend on the ensemble at `hosts` (`host:port,host:port`,
    /// optionally followed by a chroot path, as ZooKeeper's own clients take it).
    pub fn builder(hosts: impl Into<String>) -> ZooKeeperBackendBuilder {
        ZooKeeperBackendBuilder::new(hosts.into())
    }

    /// A backend on `url` with the default settings: `zk://host:port[,host:port]/chroot`
    /// or a bare connect string.
    ///
    /// # Errors
    ///
    /// As [`ZooKeeperBackendBuilder::build`].
    pub async fn connect(url: &str) -> std::result::Result<Self, crate::SetupError> {
        Self::builder(url.strip_prefix("zk://").unwrap_or(url))
            .build()
            .await
    }

    /// The path keys are put under.
    pub fn root(&self) -> &str {
        if self.inner.root.is_empty() {
            "/"
        } else {
            &self.inner.root
        }
    }

    /// The path of `key`'s lock directory: where Curator's recipes meet it.
    pub fn path_of(&self, key: &LockKey) -> String {
        self.inner.path_of(key.as_str())
    }

    /// The current session's id.
    pub fn session_id(&self) -> i64 {
        self.inner.sessions.current().client.session_id().0
    }

    /// How long a waiter at the head of a queue may leave it unclaimed before other
    /// clients skip it (see [`ZooKeeperBackendBuilder::waiter_timeout`]).
    pub fn waiter_timeout(&self) -> Duration {
        self.inner.waiter_timeout
    }

    /// The session timeout the ensemble granted.
    pub fn session_timeout(&self) -> Duration {
        self.inner.sessions.current().client.session_timeout()
    }

    /// The ZooKeeper client of the current session, for what this crate does not do.
    pub fn client(&self) -> zk::Client {
        self.inner.sessions.current().client.clone()
    }

    /// Waiters (subscriptions) registered through this backend for `key` right now.
    pub fn local_waiters(&self, key: &LockKey) -> usize {
        lock(&self.inner.subs).get(key).copied().unwrap_or(0)
    }
}

impl LockBackend for ZooKeeperBackend {
    fn profile(&self) -> &StoreProfile {
        &self.inner.profile
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(self.inner.acquire(req))
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.inner.renew(req))
    }

    /// All at once: the client pipelines them on its connection.
    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(futures_util::future::join_all(
            reqs.iter().map(|r| self.inner.renew(r)),
        ))
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        Box::pin(self.inner.release(req))
    }

    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.inner.abandon(req))
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            let entry = self.inner.entry(req);
            let ticket = entry.signal.register();
            *lock(&self.inner.subs).entry(req.key.clone()).or_insert(0) += 1;
            let sub: Box<dyn Subscription> = Box::new(ZkSubscription {
                inner: Arc::clone(&self.inner),
                key: req.key.clone(),
                ticket,
            });
            Ok(sub)
        })
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.inner.cancel_wait(req))
    }

    fn admin(&self) -> Option<&dyn StoreAdmin> {
        Some(self)
    }

    /// The loss of the session that granted the hold, not the current one: a grant
    /// answered in a session replaced meanwhile is lost with it.
    fn loss_signal(&self, req: &LockRequest) -> Option<StoreLoss> {
        let entry = self.inner.existing(req)?;
        let loss = lock(&entry.loss).clone();
        Some(loss.unwrap_or_else(|| self.inner.sessions.current().lost.clone()))
    }
}

/// A waiter's wake-ups: from the watch on the node it waits for, or a new session.
struct ZkSubscription {
    inner: Arc<Inner>,
    key: LockKey,
    ticket: Ticket,
}

impl Subscription for ZkSubscription {
    fn wait(&mut self, deadline: tokio::time::Instant) -> BoxFuture<'_, Wake> {
        self.ticket.wait(deadline)
    }

    /// Nothing to hand on: each waiter watches its own predecessor, and leaving the
    /// queue (deleting its node) wakes the one behind it through its watch.
    fn pass_on(&mut self) {}

    fn skip_signalled(&mut self) {
        self.ticket.skip();
    }
}

impl Drop for ZkSubscription {
    fn drop(&mut self) {
        let mut subs = lock(&self.inner.subs);
        if let Some(n) = subs.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                subs.remove(&self.key);
            }
        }
    }
}

impl StoreAdmin for ZooKeeperBackend {
    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(self.inner.inspect(key, mode))
    }

    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.inner.force_release(key, mode))
    }

    fn ping(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let client = self.inner.sessions.current().client.clone();
            self.inner.ok(client.check_stat("/")).await.map(drop)
        })
    }

    fn clients(&self) -> Option<&dyn ClientNames> {
        Some(self)
    }
}

/// Client names as ephemeral nodes `<root>/.clients/<client id>`, made again in each
/// new session: they never outlive their process.
impl ClientNames for ZooKeeperBackend {
    /// The name lives as long as the session (made again in a new one), whatever `ttl`.
    fn register<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = ttl;
        Box::pin(async move {
            check_client_id(id)?;
            lock(&self.inner.names).insert(id.to_owned(), name.to_owned());
            let client = self.inner.sessions.current().client.clone();
            let dir = self.inner.path_of(CLIENTS_DIR);
            self.inner
                .ok(register_in(&client, &dir, self.inner.acls, id, name))
                .await
        })
    }

    fn names<'a>(&'a self, ids: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<Option<String>>>> {
        Box::pin(async move {
            let client = self.inner.sessions.current().client.clone();
            let dir = self.inner.path_of(CLIENTS_DIR);
            let mut out = Vec::with_capacity(ids.len());
            for id in ids {
                if check_client_id(id).is_err() {
                    out.push(None);
                    continue;
                }
                match self
                    .inner
                    .call(client.get_data(&format!("{dir}/{id}")))
                    .await?
                {
                    Ok((data, _)) => out.push(String::from_utf8(data).ok()),
                    Err(zk::Error::NoNode) => out.push(None),
                    Err(error) => return Err(store_error(error)),
                }
            }
            Ok(out)
        })
    }

    fn unregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            lock(&self.inner.names).remove(id);
            let client = self.inner.sessions.current().client.clone();
            let dir = self.inner.path_of(CLIENTS_DIR);
            if check_client_id(id).is_ok() {
                self.inner
                    .delete_node(&client, &format!("{dir}/{id}"))
                    .await?;
            }
            Ok(())
        })
    }
}
