//! The in-process backend: one process, tests, demos.
//!
//! [`MemoryBackend`] keeps lock state in a map behind a mutex that is only ever held for
//! a few map operations, never across an `.await`. It keeps the same semantics as the
//! Redis backend, so code tested against it behaves the same in production:
//!
//! - leases really expire (tokio time, so `tokio::time::pause` works in tests);
//! - reentrant holds are counted, per hold identity and mode;
//! - fenced acquisitions take tokens from one counter for the whole backend, floored by
//!   the wall clock (see [`FencingToken`]), so they are strictly increasing per key
//!   across holders (and across keys);
//! - a release wakes the waiters that can now acquire — one for exclusive locks and
//!   permits, the head of the queue for fair locks, every admitted reader for a write
//!   unlock — not all of them;
//! - a key that nobody holds or waits on has no entry: the map does not grow with the
//!   number of distinct keys ever locked. Entries whose lease expired with nobody
//!   waiting are swept on later operations.
//!
//! Clones share the same state.
//!
//! # Modes
//!
//! Every [`LockMode`] is implemented, with the rules its docs give; a queued waiter
//! must poll again within the [waiter timeout](MemoryBackendBuilder::waiter_timeout).
//!
//! # Example
//!
//! ```
//! use tower_lock::{LockClient, MemoryBackend};
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), tower_lock::Error> {
//! let backend = MemoryBackend::new();
//! let client = LockClient::new(backend.clone());
//! let guard = client.get_lock("k")?.lock().await?;
//! assert_eq!(backend.len(), 1);
//! guard.unlock().await?;
//! assert_eq!(backend.len(), 0);
//!
//! // Two readers at once; a writer would wait.
//! let rw = client.get_read_write_lock("doc")?;
//! let r1 = rw.read_lock().lock().await?;
//! let r2 = rw.read_lock().lock().await?;
//! assert!(rw.write_lock().try_lock().await.unwrap_err().is_busy());
//! r1.unlock().await?;
//! r2.unlock().await?;
//! # Ok(())
//! # }
//! ```
//!
//! # Errors
//!
//! Operations do not fail; [`MemoryBackendBuilder::build`] rejects an out-of-range
//! waiter timeout with [`ConfigError::InvalidSetting`](crate::ConfigError::InvalidSetting).
//!
//! # Cancel safety
//!
//! Every operation completes within its first poll; dropping the returned future before
//! that changes nothing. Dropping a [`Subscription`] unregisters the waiter at once.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::time::Instant;

use bytes::Bytes;

use super::{
    Acquire, BoxFuture, ClientNames, FencingToken, Grant, HoldInfo, LocalStore, LockBackend,
    LockMode, LockRequest, LockState, QUEUED_MODES, Release, ReplayStore, Signal, StoreAdmin,
    StoreProfile, Stored, Subscription, Ticket, WaiterScope, Waiters, Wake, queued,
};
use crate::error::Result;
use crate::hold_id::HoldId;
use crate::key::LockKey;

pub use super::limits::{DEFAULT_WAITER_TIMEOUT, MIN_WAITER_TIMEOUT};

/// An in-process lock store. See the [module docs](self).
#[derive(Clone)]
pub struct MemoryBackend {
    shared: Arc<Shared>,
}

struct Shared {
    table: Mutex<Table>,
    fence: AtomicU64,
    /// `memory:<address of this>`, the watchdog lease, the queued modes.
    profile: StoreProfile,
    waiter_timeout: Duration,
    /// Registered client names: id → (name, until).
    clients: Mutex<HashMap<String, (String, Option<Instant>)>>,
}

impl Shared {
    /// A store whose identity is its own address: one store per backend and its clones,
    /// in this process only.
    fn new(waiter_timeout: Duration) -> Arc<Shared> {
        Arc::new_cyclic(|this| Shared {
            table: Mutex::default(),
            clients: Mutex::default(),
            fence: AtomicU64::new(0),
            profile: StoreProfile::new("memory")
                .with_store_id(format!("memory:{:p}", this.as_ptr()))
                .with_queued_modes(QUEUED_MODES),
            waiter_timeout,
        })
    }
}

impl Default for MemoryBackend {
    fn default() -> Self {
        MemoryBackend {
            shared: Shared::new(DEFAULT_WAITER_TIMEOUT),
        }
    }
}

/// Configures a [`MemoryBackend`].
///
/// ```
/// use std::time::Duration;
/// use tower_lock::MemoryBackend;
///
/// let backend = MemoryBackend::builder()
///     .waiter_timeout(Duration::from_millis(500))
///     .build()?;
/// # let _ = backend;
/// assert!(MemoryBackend::builder().waiter_timeout(Duration::ZERO).build().is_err());
/// # Ok::<(), tower_lock::ConfigError>(())
/// ```
#[derive(Clone, Debug)]
#[must_use]
pub struct MemoryBackendBuilder {
    waiter_timeout: Duration,
}

impl MemoryBackendBuilder {
    /// How long a queued waiter of a fair or read-write lock may go without polling
    /// before it is evicted from the queue (Redisson's `threadWaitTime`). Default
    /// [`DEFAULT_WAITER_TIMEOUT`]; at least [`MIN_WAITER_TIMEOUT`]. Waiters are told to
    /// poll every third of it, so a shorter timeout skips vanished waiters sooner at
    /// the cost of more polls from live ones.
    pub fn waiter_timeout(mut self, timeout: Duration) -> Self {
        self.waiter_timeout = timeout;
        self
    }

    /// Builds the backend.
    ///
    /// # Errors
    ///
    /// [`ConfigError::InvalidSetting`](crate::ConfigError::InvalidSetting) naming
    /// `waiter_timeout` when it is shorter than [`MIN_WAITER_TIMEOUT`] or longer than
    /// [`MAX_LEASE`](crate::MAX_LEASE).
    pub fn build(self) -> std::result::Result<MemoryBackend, crate::ConfigError> {
        super::limits::validate_waiter_timeout(self.waiter_timeout)?;
        Ok(MemoryBackend {
            shared: Shared::new(self.waiter_timeout),
        })
    }
}

#[derive(Default)]
struct Table {
    map: HashMap<LockKey, Entry>,
    /// Map size after the last sweep; the next sweep runs when it has doubled.
    swept_len: usize,
    /// Responses kept for replay ([`ReplayStore`]), by lock key.
    replays: HashMap<LockKey, Replay>,
    /// `replays`' size after its last sweep; swept again when it has doubled.
    replays_swept_len: usize,
}

/// A record kept for replay, until `expires_at`.
struct Replay {
    token: FencingToken,
    record: Bytes,
    expires_at: Option<Instant>,
}

impl Replay {
    fn live(&self, now: Instant) -> bool {
        self.expires_at.is_none_or(|at| at > now)
    }
}

struct Entry {
    holds: Holds,
    queue: Queue,
    /// Wakes waiters of unqueued modes (exclusive, permits), one per release.
    /// Made by the first subscription (most locks are never waited for).
    notify: Option<Arc<Signal>>,
    /// Subscriptions sharing `notify`.
    shared_subs: usize,
    /// One wake-up per queue entry — a hold waiting in a queued mode (fair, read,
    /// write) — so that a release wakes exactly the waiters the queue admits, and an
    /// hold waiting in two modes is not woken in one for the other's turn.
    hold_subs: HashMap<(HoldId, LockMode), HoldSub>,
    /// All subscriptions of the key.
    subscribers: usize,
}

struct HoldSub {
    notify: Arc<Signal>,
    count: usize,
}

/// Who holds a key. Each variant is one family of modes.
#[derive(Default)]
enum Holds {
    #[default]
    Free,
    /// Exclusive or fair: one hold.
    Sole(Hold),
    /// Read-write: at most one writer and any number of readers; readers besides the
    /// writer's own identity only when there is no writer.
    Shared {
        writer: Option<Hold>,
        readers: HashMap<HoldId, Hold>,
    },
    /// Permits: at most `max` holds, each with its own lease.
    Permits(HashMap<HoldId, Hold>),
}

struct Hold {
    hold_id: HoldId,
    mode: LockMode,
    holds: u32,
    /// The last token issued to this hold (fenced acquisitions only).
    token: Option<FencingToken>,
    /// `None`: the lease is too long to represent, i.e. no expiry.
    expires_at: Option<Instant>,
}

impl Hold {
    fn live(&self, now: Instant) -> bool {
        self.expires_at.is_none_or(|at| at > now)
    }

    fn ttl(&self, now: Instant) -> Option<Duration> {
        self.expires_at.map(|at| at.saturating_duration_since(now))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Family {
    Sole,
    Shared,
    Permits,
}

fn family(mode: LockMode) -> Family {
    match mode {
        LockMode::Exclusive | LockMode::Fair => Family::Sole,
        LockMode::Read | LockMode::Write => Family::Shared,
        LockMode::Permits { .. } => Family::Permits,
    }
}

/// Whether `req` must wait, and if so the holder's remaining lease (`None`: no expiry)
/// or, behind a queued waiter, when that waiter would be evicted; `None` when it may
/// take the lock now.
fn blocked(entry: &mut Entry, req: &LockRequest, now: Instant) -> Option<Option<Duration>> {
    if let Some(holder_ttl) = entry.holds.conflict(req.write_hold_id(), req.mode, now) {
        return Some(holder_ttl);
    }
    if !queued(req.mode) {
        return None;
    }
    // The write holder's reads go without queueing (downgrade); anyone else waits for
    // the waiters ahead of it that it cannot share with.
    let bypass = req.mode == LockMode::Read && entry.holds.holds_write(req.write_hold_id(), now);
    let seq = entry.queue.seq_of(&req.hold_id, req.mode);
    match entry.queue.blocker(seq, req.mode, now) {
        Some(_) if bypass => None,
        // Ask again when the blocker would be evicted, if not woken before.
        Some(blocker) => Some(Some(blocker.evict_at.saturating_duration_since(now))),
        None => None,
    }
}

/// The longest of several remaining leases; `None` (no expiry) wins.
fn longest(ttls: impl IntoIterator<Item = Option<Duration>>) -> Option<Duration> {
    let mut max = Some(Duration::ZERO);
    for ttl in ttls {
        max = match (max, ttl) {
            (Some(a), Some(b)) => Some(a.max(b)),
            _ => None,
        };
    }
    max
}

/// The shortest of several remaining leases; `None` (no expiry) loses.
fn shortest(ttls: impl IntoIterator<Item = Option<Duration>>) -> Option<Duration> {
    ttls.into_iter().flatten().min()
}

impl Holds {
    fn family(&self) -> Option<Family> {
        match self {
            Holds::Free => None,
            Holds::Sole(_) => Some(Family::Sole),
            Holds::Shared { .. } => Some(Family::Shared),
            Holds::Permits(_) => Some(Family::Permits),
        }
    }

    /// Drops expired holds that are cheap to find: the sole holder and the writer.
    /// Expired readers and permits are dropped where their count matters.
    fn prune_cheap(&mut self, now: Instant) {
        match self {
            Holds::Free => {}
            Holds::Sole(hold) => {
                if !hold.live(now) {
                    *self = Holds::Free;
                }
            }
            Holds::Shared { writer, readers } => {
                if writer.as_ref().is_some_and(|w| !w.live(now)) {
                    *writer = None;
                }
                if writer.is_none() && readers.is_empty() {
                    *self = Holds::Free;
                }
            }
            Holds::Permits(holders) => {
                if holders.is_empty() {
                    *self = Holds::Free;
                }
            }
        }
    }

    /// Drops every expired hold.
    fn prune(&mut self, now: Instant) {
        match self {
            Holds::Shared { readers, .. } => readers.retain(|_, r| r.live(now)),
            Holds::Permits(holders) => holders.retain(|_, h| h.live(now)),
            Holds::Free | Holds::Sole(_) => {}
        }
        self.prune_cheap(now);
    }

    fn any_live(&self, now: Instant) -> bool {
        match self {
            Holds::Free => false,
            Holds::Sole(hold) => hold.live(now),
            Holds::Shared { writer, readers } => {
                writer.as_ref().is_some_and(|w| w.live(now))
                    || readers.values().any(|r| r.live(now))
            }
            Holds::Permits(holders) => holders.values().any(|h| h.live(now)),
        }
    }

    /// The longest remaining lease of all holds (after [`prune`](Holds::prune)).
    fn longest_ttl(&self, now: Instant) -> Option<Duration> {
        match self {
            Holds::Free => Some(Duration::ZERO),
            Holds::Sole(hold) => hold.ttl(now),
            Holds::Shared { writer, readers } => {
                longest(writer.iter().chain(readers.values()).map(|h| h.ttl(now)))
            }
            Holds::Permits(holders) => longest(holders.values().map(|h| h.ttl(now))),
        }
    }

    /// `hold_id`'s live hold in exactly `mode`.
    fn own_mut(&mut self, hold_id: &HoldId, mode: LockMode, now: Instant) -> Option<&mut Hold> {
        let hold = match (self, mode) {
            (Holds::Sole(hold), _) if hold.hold_id == *hold_id && hold.mode == mode => Some(hold),
            (Holds::Shared { writer, .. }, LockMode::Write) => {
                writer.as_mut().filter(|w| w.hold_id == *hold_id)
            }
            (Holds::Shared { readers, .. }, LockMode::Read) => readers.get_mut(hold_id),
            (Holds::Permits(holders), LockMode::Permits { .. }) => holders.get_mut(hold_id),
            _ => None,
        };
        hold.filter(|h| h.live(now))
    }

    fn holds_write(&self, hold_id: &HoldId, now: Instant) -> bool {
        matches!(self, Holds::Shared { writer: Some(w), .. } if w.hold_id == *hold_id && w.live(now))
    }

    /// Whether the holds let a new hold in `mode` in: `None` if they do, else
    /// `Some(ttl)`, how long until they might. `hold_id` is the write hold a read may go
    /// past (the reader itself, or the writer it belongs with). Own holds in the same
    /// mode are re-entries, handled before this is asked.
    fn conflict(
        &mut self,
        hold_id: &HoldId,
        mode: LockMode,
        now: Instant,
    ) -> Option<Option<Duration>> {
        self.prune_cheap(now);
        match self.family() {
            None => return None,
            Some(f) if f != family(mode) => {
                self.prune(now);
                return self.family().map(|_| self.longest_ttl(now));
            }
            Some(_) => {}
        }
        match (&mut *self, mode) {
            (Holds::Sole(hold), _) => Some(hold.ttl(now)),
            (Holds::Shared { writer, .. }, LockMode::Read) => match writer {
                Some(w) if w.hold_id != *hold_id => Some(w.ttl(now)),
                _ => None,
            },
            (Holds::Shared { .. }, _) => {
                // A writer needs every hold gone, its own read holds included.
                self.prune(now);
                match self {
                    Holds::Free => None,
                    holds => Some(holds.longest_ttl(now)),
                }
            }
            (Holds::Permits(holders), LockMode::Permits { max }) => {
                let max = max.get() as usize;
                if holders.len() < max {
                    return None;
                }
                holders.retain(|_, h| h.live(now));
                if holders.len() < max {
                    None
                } else {
                    Some(shortest(holders.values().map(|h| h.ttl(now))))
                }
            }
            _ => Some(self.longest_ttl(now)),
        }
    }

    /// Records a new hold (the caller checked [`conflict`](Holds::conflict)).
    fn grant(&mut self, hold: Hold) {
        match (&mut *self, hold.mode) {
            (Holds::Shared { writer, .. }, LockMode::Write) => *writer = Some(hold),
            (Holds::Shared { readers, .. }, LockMode::Read) => {
                readers.insert(hold.hold_id.clone(), hold);
            }
            (Holds::Permits(holders), LockMode::Permits { .. }) => {
                holders.insert(hold.hold_id.clone(), hold);
            }
            (_, LockMode::Read) => {
                *self = Holds::Shared {
                    writer: None,
                    readers: HashMap::from([(hold.hold_id.clone(), hold)]),
                }
            }
            (_, LockMode::Write) => {
                *self = Holds::Shared {
                    writer: Some(hold),
                    readers: HashMap::new(),
                }
            }
            (_, LockMode::Permits { .. }) => {
                *self = Holds::Permits(HashMap::from([(hold.hold_id.clone(), hold)]))
            }
            (_, LockMode::Exclusive | LockMode::Fair) => *self = Holds::Sole(hold),
        }
    }

    /// Removes `hold_id`'s hold in `mode`.
    fn remove(&mut self, hold_id: &HoldId, mode: LockMode) {
        match (&mut *self, mode) {
            (Holds::Sole(_), _) => *self = Holds::Free,
            (Holds::Shared { writer, .. }, LockMode::Write) => *writer = None,
            (Holds::Shared { readers, .. }, LockMode::Read)
            | (Holds::Permits(readers), LockMode::Permits { .. }) => {
                readers.remove(hold_id);
            }
            _ => {}
        }
        match self {
            Holds::Shared { writer, readers } if writer.is_none() && readers.is_empty() => {
                *self = Holds::Free
            }
            Holds::Permits(holders) if holders.is_empty() => *self = Holds::Free,
            _ => {}
        }
    }

    /// Removes the holds `mode` may force-release (Redisson's `forceUnlock`): any sole
    /// hold; all readers when no writer holds; the writer and its own reads; all
    /// permits. Returns how many live holds went away.
    fn force_remove(&mut self, mode: LockMode, now: Instant) -> usize {
        self.prune(now);
        let removed = match (&*self, family(mode), mode) {
            (Holds::Sole(_), Family::Sole, _) => 1,
            (
                Holds::Shared {
                    writer: None,
                    readers,
                },
                _,
                LockMode::Read,
            ) => readers.len(),
            (
                Holds::Shared {
                    writer: Some(_),
                    readers,
                },
                _,
                LockMode::Write,
            ) => 1 + readers.len(),
            (Holds::Permits(holders), Family::Permits, _) => holders.len(),
            _ => 0,
        };
        if removed > 0 {
            *self = Holds::Free;
        }
        removed
    }
}

/// Queued waiters of one key, in arrival order.
#[derive(Default)]
struct Queue {
    order: BTreeMap<u64, Waiter>,
    index: HashMap<(HoldId, LockMode), u64>,
    /// The waiters that exclude everyone behind them (fair, write).
    exclusive: BTreeSet<u64>,
    next: u64,
}

struct Waiter {
    hold_id: HoldId,
    mode: LockMode,
    /// Evicted when it has not polled by then.
    evict_at: Instant,
}

impl Queue {
    fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    fn len(&self) -> usize {
        self.order.len()
    }

    fn seq_of(&self, hold_id: &HoldId, mode: LockMode) -> Option<u64> {
        self.index.get(&(hold_id.clone(), mode)).copied()
    }

    /// Puts the hold at the tail, or refreshes its place.
    fn touch(&mut self, hold_id: &HoldId, mode: LockMode, evict_at: Instant) {
        if let Some(seq) = self.seq_of(hold_id, mode) {
            if let Some(waiter) = self.order.get_mut(&seq) {
                waiter.evict_at = evict_at;
            }
            return;
        }
        let seq = self.next;
        self.next += 1;
        self.order.insert(
            seq,
            Waiter {
                hold_id: hold_id.clone(),
                mode,
                evict_at,
            },
        );
        self.index.insert((hold_id.clone(), mode), seq);
        if mode != LockMode::Read {
            self.exclusive.insert(seq);
        }
    }

    fn remove_seq(&mut self, seq: u64) {
        if let Some(waiter) = self.order.remove(&seq) {
            self.index.remove(&(waiter.hold_id, waiter.mode));
            self.exclusive.remove(&seq);
        }
    }

    fn remove(&mut self, hold_id: &HoldId, mode: LockMode) -> bool {
        match self.seq_of(hold_id, mode) {
            Some(seq) => {
                self.remove_seq(seq);
                true
            }
            None => false,
        }
    }

    /// Evicts waiters at the head that stopped polling.
    fn evict_stale_head(&mut self, now: Instant) {
        while let Some((&seq, waiter)) = self.order.first_key_value() {
            if waiter.evict_at > now {
                break;
            }
            self.remove_seq(seq);
        }
    }

    /// The live waiter that keeps a waiter at `seq` (`None`: a newcomer, behind
    /// everyone) in `mode` from going, if any. Stale blockers are evicted on the way.
    fn blocker(&mut self, seq: Option<u64>, mode: LockMode, now: Instant) -> Option<&Waiter> {
        let ahead = |s: u64| seq.is_none_or(|mine| s < mine);
        loop {
            let first = if mode == LockMode::Read {
                self.exclusive.first().copied()
            } else {
                self.order.first_key_value().map(|(&s, _)| s)
            };
            let first = first.filter(|&s| ahead(s))?;
            if self.order.get(&first).is_some_and(|w| w.evict_at > now) {
                return self.order.get(&first);
            }
            self.remove_seq(first);
        }
    }

    fn has_live(&self, now: Instant) -> bool {
        self.order.values().any(|w| w.evict_at > now)
    }
}

impl Entry {
    fn new() -> Self {
        Entry {
            holds: Holds::Free,
            queue: Queue::default(),
            notify: None,
            shared_subs: 0,
            hold_subs: HashMap::new(),
            subscribers: 0,
        }
    }

    fn is_unused(&self, now: Instant) -> bool {
        self.subscribers == 0 && !self.holds.any_live(now) && !self.queue.has_live(now)
    }

    /// Wakes the queued waiters that may acquire now: the head if it is a fair waiter
    /// or a writer and the lock is free; else every reader ahead of the first queued
    /// writer, if no writer holds the lock.
    fn wake_queued(&mut self, now: Instant) {
        self.queue.evict_stale_head(now);
        let mut woken = Vec::new();
        for (i, waiter) in self.queue.order.values().enumerate() {
            let reader = waiter.mode == LockMode::Read;
            if !reader && i > 0 {
                break;
            }
            if self
                .holds
                .conflict(&waiter.hold_id, waiter.mode, now)
                .is_some()
            {
                break;
            }
            woken.push((waiter.hold_id.clone(), waiter.mode));
            if !reader {
                break;
            }
        }
        for entry in woken {
            if let Some(sub) = self.hold_subs.get(&entry) {
                sub.notify.notify_one();
            }
        }
    }

    /// After holds went away: one waiter of the unqueued modes, and whoever the queue
    /// admits now.
    fn wake_after_release(&mut self, now: Instant) {
        if self.shared_subs > 0
            && let Some(notify) = &self.notify
        {
            notify.notify_one();
        }
        if !self.queue.is_empty() {
            self.wake_queued(now);
        }
    }
}

/// The later of two lease ends; `None` is "never".
fn later(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    a.zip(b).map(|(a, b)| a.max(b))
}

impl MemoryBackend {
    /// A new, empty store with the default settings.
    pub fn new() -> Self {
        Self::default()
    }

    /// Configures a store: see [`MemoryBackendBuilder`].
    pub fn builder() -> MemoryBackendBuilder {
        MemoryBackendBuilder {
            waiter_timeout: DEFAULT_WAITER_TIMEOUT,
        }
    }

    /// The configured waiter timeout; see [`MemoryBackendBuilder::waiter_timeout`].
    pub fn waiter_timeout(&self) -> Duration {
        self.shared.waiter_timeout
    }

    /// How many keys have an entry: held, or waited on. Expired, unwatched entries are
    /// swept first, so this is 0 when nothing is held or awaited.
    pub fn len(&self) -> usize {
        let mut table = self.table();
        table.sweep(Instant::now());
        table.map.len()
    }

    /// How many responses are kept for replay ([`ReplayStore`]); expired ones are
    /// dropped first, so this counts only live ones.
    pub fn records(&self) -> usize {
        let mut table = self.table();
        let now = Instant::now();
        table.replays.retain(|_, kept| kept.live(now));
        table.replays_swept_len = table.replays.len();
        table.replays.len()
    }

    /// The keys held or waited on (a diagnostic; expired, unwatched entries are swept
    /// first).
    pub fn keys(&self) -> Vec<LockKey> {
        let mut table = self.table();
        table.sweep(Instant::now());
        table.map.keys().cloned().collect()
    }

    /// Whether no key is held or waited on.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether `key` has an entry: it is held or waited on (expired, unwatched entries
    /// are swept first).
    pub fn contains_key(&self, key: &LockKey) -> bool {
        let now = Instant::now();
        let mut table = self.table();
        table.remove_if_unused(key, now);
        table.map.contains_key(key)
    }

    /// How many subscriptions (waiters) are registered for `key`.
    pub fn waiters(&self, key: &LockKey) -> usize {
        self.table().map.get(key).map_or(0, |e| e.subscribers)
    }

    /// How many holds wait in `key`'s queue (fair, read and write waiters), including
    /// any that stopped polling and are not evicted yet.
    pub fn queue_len(&self, key: &LockKey) -> usize {
        self.table().map.get(key).map_or(0, |e| e.queue.len())
    }

    /// Every live hold of `key`, in no particular order: what the store has right now,
    /// without changing it. For diagnostics and tests; [`StoreAdmin::inspect`] says
    /// more.
    pub fn holders(&self, key: &LockKey) -> Vec<HoldInfo> {
        self.state_of(key, LockMode::Exclusive).holders
    }

    /// What [`inspect`](StoreAdmin::inspect) answers, on the spot.
    fn state_of(&self, key: &LockKey, mode: LockMode) -> LockState {
        let now = Instant::now();
        let table = self.table();
        let Some(entry) = table.map.get(key) else {
            return LockState::new(Vec::new(), Waiters::new(0, WaiterScope::Store));
        };
        let describe = |hold: &Hold| {
            HoldInfo::new(hold.hold_id.clone(), hold.mode, hold.holds, hold.ttl(now))
                .with_token(hold.token)
        };
        let holds: Vec<&Hold> = match &entry.holds {
            Holds::Free => Vec::new(),
            Holds::Sole(hold) => vec![hold],
            Holds::Shared { writer, readers } => writer.iter().chain(readers.values()).collect(),
            Holds::Permits(holders) => holders.values().collect(),
        };
        let holders: Vec<HoldInfo> = holds
            .into_iter()
            .filter(|h| h.live(now))
            .map(describe)
            .collect();
        let newest = holders.iter().filter_map(|h| h.token).max();
        // Queued modes wait in the queue; the others only subscribe. Either way every
        // waiter of this store is in this process.
        let waiting = if queued(mode) {
            entry.queue.len()
        } else {
            entry.subscribers
        };
        LockState::new(holders, Waiters::new(waiting, WaiterScope::Store))
            .with_fencing_token(newest)
    }

    fn client_table(&self) -> MutexGuard<'_, HashMap<String, (String, Option<Instant>)>> {
        self.shared
            .clients
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        // Critical sections never panic, but a poisoned map is still consistent: every
        // change to an entry is completed before anything that could panic.
        self.shared
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The next fencing token: one more than the last, and at least the wall clock in
    /// microseconds, so tokens keep increasing across a restart of the process.
    fn next_token(&self) -> FencingToken {
        let floor = super::clock_floor_us();
        let next = |last: u64| last.saturating_add(1).max(floor);
        let last = self
            .shared
            .fence
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |last| Some(next(last)))
            .unwrap_or_else(|last| last);
        FencingToken::new(next(last))
    }

    fn token_for(&self, req: &LockRequest) -> Option<FencingToken> {
        req.fenced.then(|| self.next_token())
    }

    /// How often queued waiters must poll: a third of the waiter timeout.
    fn poll_interval(&self) -> Duration {
        (self.shared.waiter_timeout / 3).max(Duration::from_millis(1))
    }

    fn apply_acquire(&self, req: &LockRequest) -> Acquire {
        let now = Instant::now();
        let expires_at = now.checked_add(req.lease);
        let mut table = self.table();
        table.maybe_sweep(now);
        let entry = table.map.entry(req.key.clone()).or_insert_with(Entry::new);
        let queued = queued(req.mode);
        if let Some(reentered) = self.reenter(entry, req, now, expires_at) {
            return reentered;
        }
        match blocked(entry, req, now) {
            None => {
                let token = self.token_for(req);
                entry.holds.grant(Hold {
                    hold_id: req.hold_id.clone(),
                    mode: req.mode,
                    holds: 1,
                    token,
                    expires_at,
                });
                if queued {
                    entry.queue.remove(&req.hold_id, req.mode);
                    // A reader admitted may be followed by readers queued behind it.
                    entry.wake_queued(now);
                }
                Acquire::Acquired(Grant::new(1, token))
            }
            Some(ttl) if queued => {
                let timeout = self.shared.waiter_timeout;
                entry.queue.touch(&req.hold_id, req.mode, now + timeout);
                // Someone stale may have been evicted above and the lock be free for
                // the next in line.
                entry.wake_queued(now);
                let poll = self.poll_interval();
                Acquire::Busy {
                    ttl: Some(ttl.map_or(poll, |ttl| ttl.min(poll))),
                }
            }
            Some(ttl) => Acquire::Busy { ttl },
        }
    }

    /// Re-enters the hold `req.hold_id` has in its mode, if any: one hold more.
    fn reenter(
        &self,
        entry: &mut Entry,
        req: &LockRequest,
        now: Instant,
        expires_at: Option<Instant>,
    ) -> Option<Acquire> {
        let hold = entry.holds.own_mut(&req.hold_id, req.mode, now)?;
        hold.holds = hold.holds.saturating_add(1);
        // Re-entering never shortens the lease the hold already has.
        hold.expires_at = later(hold.expires_at, expires_at);
        // A fenced re-entry takes the next token, as Redisson's `RFencedLock` does.
        if req.fenced {
            hold.token = Some(self.next_token());
        }
        let grant = Grant::new(hold.holds, if req.fenced { hold.token } else { None });
        if queued(req.mode) {
            entry.queue.remove(&req.hold_id, req.mode);
        }
        Some(Acquire::Acquired(grant))
    }

    fn renew_now(table: &mut Table, req: &LockRequest, now: Instant) -> bool {
        let Some(entry) = table.map.get_mut(&req.key) else {
            return false;
        };
        match entry.holds.own_mut(&req.hold_id, req.mode, now) {
            Some(hold) => {
                // A renewal extends the lease, never shortens it.
                hold.expires_at = later(hold.expires_at, now.checked_add(req.lease));
                true
            }
            None => {
                table.remove_if_unused(&req.key, now);
                false
            }
        }
    }

    fn apply_release(&self, req: &LockRequest) -> Release {
        Self::release_in(&mut self.table(), req, Instant::now())
    }

    fn release_in(table: &mut Table, req: &LockRequest, now: Instant) -> Release {
        let Some(entry) = table.map.get_mut(&req.key) else {
            return Release::NotHeld;
        };
        let outcome = match entry.holds.own_mut(&req.hold_id, req.mode, now) {
            Some(hold) if hold.holds > 1 => {
                hold.holds -= 1;
                // The holds left keep at least the lease they had.
                hold.expires_at = later(hold.expires_at, now.checked_add(req.lease));
                Release::Decremented { holds: hold.holds }
            }
            Some(_) => {
                entry.holds.remove(&req.hold_id, req.mode);
                entry.wake_after_release(now);
                Release::Released
            }
            None => Release::NotHeld,
        };
        table.remove_if_unused(&req.key, now);
        outcome
    }

    /// [`ReplayStore::store_and_release`], in one critical section.
    fn store_and_release_now(
        &self,
        req: &LockRequest,
        token: FencingToken,
        record: Bytes,
        ttl: Duration,
    ) -> Stored {
        let now = Instant::now();
        let mut table = self.table();
        table.maybe_sweep_replays(now);
        let held = table
            .map
            .get_mut(&req.key)
            .is_some_and(|entry| entry.holds.own_mut(&req.hold_id, req.mode, now).is_some());
        let newer = table
            .replays
            .get(&req.key)
            .is_some_and(|kept| kept.live(now) && kept.token > token);
        let stored = held && !newer;
        if stored {
            let replay = Replay {
                token,
                record,
                expires_at: now.checked_add(ttl),
            };
            table.replays.insert(req.key.clone(), replay);
        }
        Stored::new(stored, Self::release_in(&mut table, req, now))
    }

    fn load_now(&self, key: &LockKey) -> Option<Bytes> {
        let now = Instant::now();
        let mut table = self.table();
        match table.replays.get(key) {
            Some(kept) if kept.live(now) => Some(kept.record.clone()),
            Some(_) => {
                table.replays.remove(key);
                None
            }
            None => None,
        }
    }

    fn cancel_wait_now(&self, req: &LockRequest) {
        let now = Instant::now();
        let mut table = self.table();
        if let Some(entry) = table.map.get_mut(&req.key)
            && entry.queue.remove(&req.hold_id, req.mode)
        {
            entry.wake_queued(now);
        }
        table.remove_if_unused(&req.key, now);
    }
}

impl Table {
    fn remove_if_unused(&mut self, key: &LockKey, now: Instant) {
        // One lookup (the key is hashed once), on every release.
        if let std::collections::hash_map::Entry::Occupied(entry) = self.map.entry(key.clone())
            && entry.get().is_unused(now)
        {
            entry.remove();
        }
    }

    fn sweep(&mut self, now: Instant) {
        self.map.retain(|_, e| !e.is_unused(now));
        self.swept_len = self.map.len();
    }

    /// Sweeps expired, unwatched entries once the map has doubled since the last sweep:
    /// amortized O(1) per operation, and the map stays within twice the live keys.
    fn maybe_sweep(&mut self, now: Instant) {
        if self.map.len() >= 2 * self.swept_len.max(512) {
            self.sweep(now);
        }
    }

    /// Drops expired records once `replays` has doubled since its last sweep, as
    /// [`maybe_sweep`](Self::maybe_sweep) does for locks.
    fn maybe_sweep_replays(&mut self, now: Instant) {
        if self.replays.len() >= 2 * self.replays_swept_len.max(512) {
            self.replays.retain(|_, kept| kept.live(now));
            self.replays_swept_len = self.replays.len();
        }
    }
}

impl LockBackend for MemoryBackend {
    /// `memory`, whose identity is `memory:<address>`: one store per backend and its
    /// clones, in this process only.
    fn profile(&self) -> &StoreProfile {
        &self.shared.profile
    }

    fn acquire<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Acquire>> {
        Box::pin(async move { Ok(self.apply_acquire(req)) })
    }

    fn renew<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move { Ok(Self::renew_now(&mut self.table(), req, Instant::now())) })
    }

    fn renew_many<'a>(&'a self, reqs: &'a [LockRequest]) -> BoxFuture<'a, Vec<Result<bool>>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut table = self.table();
            reqs.iter()
                .map(|req| Ok(Self::renew_now(&mut table, req, now)))
                .collect()
        })
    }

    fn release<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<Release>> {
        Box::pin(async move { Ok(self.apply_release(req)) })
    }

    /// Releases the hold and leaves the queue: an attempt is applied within
    /// its call, so none can arrive late.
    fn abandon<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.apply_release(req);
            if queued(req.mode) {
                self.cancel_wait_now(req);
            }
            Ok(())
        })
    }

    fn has_local_waiters(&self, req: &LockRequest) -> bool {
        !queued(req.mode)
            && self
                .table()
                .map
                .get(&req.key)
                .is_some_and(|e| e.shared_subs > 0)
    }

    fn subscribe<'a>(
        &'a self,
        req: &'a LockRequest,
    ) -> BoxFuture<'a, Result<Box<dyn Subscription>>> {
        Box::pin(async move {
            let mut table = self.table();
            let entry = table.map.entry(req.key.clone()).or_insert_with(Entry::new);
            entry.subscribers += 1;
            let (hold_id, signal) = if queued(req.mode) {
                let sub = entry
                    .hold_subs
                    .entry((req.hold_id.clone(), req.mode))
                    .or_insert_with(|| HoldSub {
                        notify: Arc::new(Signal::new()),
                        count: 0,
                    });
                sub.count += 1;
                (Some(req.hold_id.clone()), Arc::clone(&sub.notify))
            } else {
                entry.shared_subs += 1;
                let notify = entry.notify.get_or_insert_with(|| Arc::new(Signal::new()));
                (None, Arc::clone(notify))
            };
            let sub: Box<dyn Subscription> = Box::new(MemorySubscription {
                backend: self.clone(),
                key: req.key.clone(),
                mode: req.mode,
                hold_id,
                ticket: signal.register(),
            });
            Ok(sub)
        })
    }

    fn cancel_wait<'a>(&'a self, req: &'a LockRequest) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.cancel_wait_now(req);
            Ok(())
        })
    }

    fn local(&self) -> Option<&dyn LocalStore> {
        Some(self)
    }

    fn replays(&self) -> Option<&dyn ReplayStore> {
        Some(self)
    }

    fn admin(&self) -> Option<&dyn StoreAdmin> {
        Some(self)
    }
}

impl StoreAdmin for MemoryBackend {
    fn force_release<'a>(
        &'a self,
        key: &'a LockKey,
        mode: LockMode,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut table = self.table();
            let Some(entry) = table.map.get_mut(key) else {
                return Ok(false);
            };
            let removed = entry.holds.force_remove(mode, now);
            if removed > 1
                && entry.shared_subs > 0
                && let Some(notify) = &entry.notify
            {
                // Several permits came back at once: let every waiter try.
                notify.notify_all();
            }
            if removed > 0 {
                entry.wake_after_release(now);
            }
            table.remove_if_unused(key, now);
            Ok(removed > 0)
        })
    }

    fn inspect<'a>(&'a self, key: &'a LockKey, mode: LockMode) -> BoxFuture<'a, Result<LockState>> {
        Box::pin(async move { Ok(self.state_of(key, mode)) })
    }

    fn clients(&self) -> Option<&dyn ClientNames> {
        Some(self)
    }
}

/// Records in the same table as the locks, under the same mutex: the check that the
/// hold still holds its lock, the write and the release are one critical section.
impl ReplayStore for MemoryBackend {
    fn load<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Bytes>>> {
        Box::pin(async move { Ok(self.load_now(key)) })
    }

    fn store_and_release<'a>(
        &'a self,
        req: &'a LockRequest,
        token: FencingToken,
        record: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Stored>> {
        Box::pin(async move { Ok(self.store_and_release_now(req, token, record, ttl)) })
    }
}

/// Answers every call on the spot: memory is the store the fast path is for.
impl LocalStore for MemoryBackend {
    fn acquire_now(&self, req: &LockRequest) -> Option<Result<Acquire>> {
        Some(Ok(self.apply_acquire(req)))
    }

    fn release_now(&self, req: &LockRequest) -> Option<Result<Release>> {
        Some(Ok(self.apply_release(req)))
    }
}

impl ClientNames for MemoryBackend {
    fn register<'a>(
        &'a self,
        id: &'a str,
        name: &'a str,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let now = Instant::now();
            let mut clients = self.client_table();
            clients.retain(|_, (_, until)| until.is_none_or(|at| at > now));
            clients.insert(id.to_owned(), (name.to_owned(), now.checked_add(ttl)));
            Ok(())
        })
    }

    fn names<'a>(&'a self, ids: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<Option<String>>>> {
        Box::pin(async move {
            let now = Instant::now();
            let clients = self.client_table();
            Ok(ids
                .iter()
                .map(|id| {
                    clients
                        .get(*id)
                        .filter(|(_, until)| until.is_none_or(|at| at > now))
                        .map(|(name, _)| name.clone())
                })
                .collect())
        })
    }

    fn unregister<'a>(&'a self, id: &'a str) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            self.client_table().remove(id);
            Ok(())
        })
    }
}

struct MemorySubscription {
    backend: MemoryBackend,
    key: LockKey,
    mode: LockMode,
    /// Set for queued modes, whose waiters are woken one hold at a time.
    hold_id: Option<HoldId>,
    /// Its place among the waiters woken one per release (of the key, or of its hold's
    /// queue entry).
    ticket: Ticket,
}

impl Subscription for MemorySubscription {
    fn wait(&mut self, deadline: Instant) -> BoxFuture<'_, Wake> {
        self.ticket.wait(deadline)
    }

    fn pass_on(&mut self) {
        match &self.hold_id {
            None => self.ticket.pass_on(),
            Some(hold_id) => {
                // The wake-up was for this hold's turn in the queue. It is leaving:
                // give up the place so the next in line is woken now, not after the
                // waiter timeout.
                let now = Instant::now();
                let mut table = self.backend.table();
                if let Some(entry) = table.map.get_mut(&self.key) {
                    entry.queue.remove(hold_id, self.mode);
                    entry.wake_queued(now);
                }
            }
        }
    }
    fn skip_signalled(&mut self) {
        self.ticket.skip();
    }
}

impl Drop for MemorySubscription {
    fn drop(&mut self) {
        let now = Instant::now();
        let mut table = self.backend.table();
        if let Some(entry) = table.map.get_mut(&self.key) {
            entry.subscribers = entry.subscribers.saturating_sub(1);
            match &self.hold_id {
                None => entry.shared_subs = entry.shared_subs.saturating_sub(1),
                Some(hold_id) => {
                    let queued = (hold_id.clone(), self.mode);
                    if let Some(sub) = entry.hold_subs.get_mut(&queued) {
                        sub.count -= 1;
                        if sub.count == 0 {
                            entry.hold_subs.remove(&queued);
                        }
                    }
                }
            }
        }
        table.remove_if_unused(&self.key, now);
    }
}

impl std::fmt::Debug for MemoryBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryBackend")
            .field("keys", &self.table().map.len())
            .field("waiter_timeout", &self.shared.waiter_timeout)
            .finish()
    }
}

#[cfg(test)]
mod tests;
