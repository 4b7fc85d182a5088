//! A seeded, randomized history checker for the lock client, with an oracle.
//!
//! # What a history is
//!
//! A [`History`] is a list of [`Op`]s generated up front from a seed
//! ([`History::generate`]) over 2–3 [`LockClient`]s on one store, 2–3 keys and 2–3
//! explicit owners per client (plus, sometimes, no owner: a fresh one per acquisition).
//! The ops acquire (every kind: exclusive, fair, read, write, permits, and MultiLocks of
//! two keys; every call: `try_lock`, `try_lock_for`, `lock()` under an outer timeout;
//! watchdog or fixed leases), unlock or drop what was acquired, cancel acquisitions in
//! flight (after a random number of polls, by a timeout, or by aborting the task), let
//! time pass (sometimes more than a lease in one step: a "pause past the lease") and let
//! tasks run. Every acquisition names a numbered *slot* its guard goes to; an op naming
//! an empty slot does nothing, so deleting ops from a history keeps it valid — which is
//! what makes shrinking simple.
//!
//! Acquisitions run in spawned tasks, so a waiting acquisition does not block the
//! driver; a task that acquires puts its guard into its slot in the same poll, so the
//! oracle sees every guard from the moment it exists.
//!
//! # The oracle
//!
//! After every op (step), the checker reads every guard of every slot *synchronously*
//! (no `.await` between the reads, so on a current-thread runtime nothing moves
//! meanwhile). A guard is *believed* when it sits in a slot and `!is_lost()`. Guards that
//! stand for one hold of the store (re-entries of one owner in one mode) count as one
//! *holder*: see [`holder_of`].
//!
//! 1. **Exclusion**, per key, over believed holders: at most one exclusive-or-fair
//!    holder; a writer excludes every other holder except read holds of its own owner
//!    (a writer may read its own lock); holds of different families (exclusive/fair,
//!    read/write, permits) never coexist on one key; at most [`PERMITS`] permit holders.
//!    A breach among the holds of one owner alone (say its exclusive and its fair hold
//!    of one key) is told apart as [`Finding::OneOwnerTwoModes`].
//! 2. **A lost guard stays lost**: once `is_lost()` was seen true for a guard it must
//!    never be false again; and `unlock()` of a guard seen lost (before or at the call)
//!    must return `Err(Error::Lost)`.
//! 3. **No guard was freed by another's release**: every guard believed before the
//!    store's snapshot ([`Fixture::view`]) and still believed after it must be in that
//!    snapshot (same owner, same mode). The snapshot is taken between the two reads of
//!    the guards, so a guard believed on both sides was believed when it was taken (a
//!    guard's belief ends no later than the store's hold: the client counts its lease
//!    from before it sent the request). On a paused clock both reads and the snapshot
//!    happen at one instant.
//! 4. **Nothing is left behind** (at the end): every pending acquisition is aborted,
//!    every guard unlocked, tasks settle; then the store must drain ([`Fixture::drained`]):
//!    on memory no hold may be left at once (every store call completes within its first
//!    poll, so nothing can be in flight), and past every lease and the waiter timeout no
//!    entry, queue entry or waiter either; on Redis nothing but fenced locks' counters may
//!    be left within a deadline after the leases end. Cancellation must leave nothing.
//! 5. **Fencing tokens increase**: a fenced exclusive, fair or write hold's token is
//!    greater than the token of the fenced exclusive-family hold of the key believed
//!    before it (such holds are never believed at once, so that is their grant order),
//!    and guards of one hold share its token.
//!
//! Besides, an acquisition or unlock that fails with anything but `Busy` / `Lost` is a
//! finding ([`Finding::UnexpectedError`]), and so is a task that loops without ever
//! yielding ([`Finding::Livelock`]): on a current-thread runtime it would stall the run
//! for good, so a [`SpinBreaker`] notices it and unwinds that task. A panic out of an
//! acquisition, an unlock or the run is a finding too ([`Finding::Panicked`]).
//!
//! # With a nemesis
//!
//! A [`Timing`] with [`nemesis`](Timing::nemesis) set makes histories with faults in
//! transit and store crashes ([`Op::Fault`]), concurrent re-entries ([`Call::Twin`]),
//! acquisitions on runtimes that end ([`On::ShortLived`]) and relaxed sessions
//! ([`History::relaxed`]), for a fixture whose clients go through a fault proxy
//! ([`Fixture::nemesis`]). What the oracle then allows and adds — failures to reach the
//! store, holds a crashed store lost, a residue check after every step — is in the
//! [`nemesis`](super::nemesis) module's docs.
//!
//! A run does not stop at its first finding: it records the first occurrence of each
//! [`Finding`] and carries on, so one run can show several distinct failures.
//!
//! # Searching and shrinking
//!
//! [`campaign`] runs many seeds (on several worker threads, each run on its own
//! runtime), groups the findings by kind and shrinks each kind ([`shrink`]): first to
//! the shortest failing prefix (the history up to the step where the finding appeared),
//! then by deleting whole slots (an acquisition and every op naming its slot) and single
//! ops while it still fails with the same finding. On a paused clock (the memory
//! backend) replays are exact, so shrinking is too, and the first few failing seeds of
//! each kind are shrunk to keep the shortest; on a real store (Redis) it is best-effort.
//! It then panics with a report: per finding, the seed, the minimized history, the trace
//! of its replay and the finding.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant as StdInstant};

use tokio::task::JoinHandle;
use tokio::time::Instant;
use tower_lock::kinds::{MultiGuard, MultiLock};
use tower_lock::{Error, HoldId, Lease, Lock, LockClient, LockGuard, LockKey, LockMode, Owner};

use super::nemesis::{Crashed, Fault, Nemesis, NemesisTiming};

/// `max` of every permits lock in a history (`get_permits(key, PERMITS)`).
pub const PERMITS: u32 = 2;

// ───────────────────────────── the oracle's notion of a holder ─────────────────────────────

/// A hold as the oracle sees it: its identity in the store ([`LockGuard::holder`]), its
/// mode, and the logical owner that took it (`guard.owner()`).
pub type Holder = (HoldId, LockMode, Owner);

/// Which hold of the store `guard` stands for: guards with equal holders are re-entries of
/// one hold and count as one holder.
pub fn holder_of(guard: &LockGuard) -> Holder {
    (guard.hold_id().clone(), guard.mode(), guard.owner().clone())
}

// ───────────────────────────── timing ─────────────────────────────

/// The durations a history draws from, in milliseconds (pairs are inclusive ranges).
/// Virtual on a paused clock, real on a real store; each history test has its own.
#[derive(Clone, Debug)]
pub struct Timing {
    /// The clients' watchdog lease.
    pub watchdog_lease_ms: u64,
    /// The store's waiter timeout (fair and read-write queues).
    pub waiter_timeout_ms: u64,
    /// Fixed leases for `try_lock_for`.
    pub fixed_leases_ms: &'static [u64],
    /// Waits for `try_lock_for` (short; 0 is one attempt).
    pub waits_ms: &'static [u64],
    /// The outer timeout around `lock()`.
    pub lock_timeout_ms: (u64, u64),
    /// A `tokio::time::timeout` that cancels an acquisition.
    pub cancel_timeout_ms: (u64, u64),
    /// A small step of time.
    pub small_pass_ms: (u64, u64),
    /// A step of time longer than a lease: the store expires holds before anything
    /// renews them.
    pub big_pass_ms: (u64, u64),
    /// How often (in percent) a time step is a big one.
    pub big_pass_percent: u8,
    /// Faults, concurrent re-entries, short-lived runtimes and relaxed sessions (see
    /// [`nemesis`](super::nemesis)); `None` for none of them.
    pub nemesis: Option<NemesisTiming>,
}

impl Timing {
    pub fn watchdog_lease(&self) -> Duration {
        Duration::from_millis(self.watchdog_lease_ms)
    }

    pub fn waiter_timeout(&self) -> Duration {
        Duration::from_millis(self.waiter_timeout_ms)
    }

    /// The longest lease a hold may have: the watchdog's, a fixed one, a twin's.
    pub fn longest_lease(&self) -> Duration {
        let fixed = self.fixed_leases_ms.iter().copied().max().unwrap_or(0);
        let twins = self.nemesis.as_ref().map_or(0, |n| {
            n.twin_leases_ms
                .iter()
                .flatten()
                .copied()
                .max()
                .unwrap_or(0)
        });
        Duration::from_millis(fixed.max(twins).max(self.watchdog_lease_ms))
    }

    /// With a nemesis: how long after a key's last activity the store may still keep
    /// something for it ([`NemesisTiming::residue_bound`]).
    pub fn residue_bound(&self) -> Option<Duration> {
        self.nemesis
            .as_ref()
            .map(|n| n.residue_bound(self.longest_lease(), self.waiter_timeout()))
    }

    /// Longer than every lease and the waiter timeout together.
    pub fn beyond_every_lease(&self) -> Duration {
        let longest = self.fixed_leases_ms.iter().copied().max().unwrap_or(0);
        Duration::from_millis(
            longest.max(self.watchdog_lease_ms) + self.waiter_timeout_ms + self.watchdog_lease_ms,
        )
    }
}

// ───────────────────────────── histories ─────────────────────────────

/// A lock kind, as a client asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Exclusive,
    Fair,
    Read,
    Write,
    Permits,
}

const KINDS: [Kind; 5] = [
    Kind::Exclusive,
    Kind::Fair,
    Kind::Read,
    Kind::Write,
    Kind::Permits,
];

impl Kind {
    fn lock(self, client: &LockClient, key: &LockKey) -> Lock {
        match self {
            Kind::Exclusive => client.get_lock(key).unwrap(),
            Kind::Fair => client.get_fair_lock(key).unwrap(),
            Kind::Read => client.get_read_write_lock(key).unwrap().read_lock(),
            Kind::Write => client.get_read_write_lock(key).unwrap().write_lock(),
            Kind::Permits => client.get_permits(key, PERMITS).unwrap(),
        }
    }

    /// Another kind on the same name that shares the hold's family or is its natural
    /// mix-up: exclusive ↔ fair, read ↔ write, permits → exclusive.
    fn sibling(self) -> Kind {
        match self {
            Kind::Exclusive => Kind::Fair,
            Kind::Fair => Kind::Exclusive,
            Kind::Read => Kind::Write,
            Kind::Write => Kind::Read,
            Kind::Permits => Kind::Exclusive,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Exclusive => "exclusive",
            Kind::Fair => "fair",
            Kind::Read => "read",
            Kind::Write => "write",
            Kind::Permits => return write!(f, "permits({PERMITS})"),
        })
    }
}

/// Who acquires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Who {
    /// No owner: the lock makes a fresh one for this acquisition.
    Fresh,
    /// The client's `idx`-th explicit owner (`client.new_owner()`), given either way.
    Owner { idx: u8, via: Via },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Via {
    /// `Lock::with_owner` / `MultiLock::with_owner`.
    WithOwner,
    /// `Owner::scope` around the acquisition.
    Scope,
}

/// The acquire call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Call {
    /// `try_lock()`: one attempt, watchdog.
    TryLock,
    /// `try_lock_for(wait, lease)`; `lease_ms: None` is `Lease::Watchdog`.
    TryLockFor { wait_ms: u64, lease_ms: Option<u64> },
    /// `lock()` under an outer `tokio::time::timeout`.
    Lock { timeout_ms: u64 },
    /// Two `try_lock_for(0, lease)` of one key by one owner at once (`tokio::join!`),
    /// with these leases (`None`: the watchdog); both guards go to the slot. Single
    /// keys and explicit owners only (nemesis).
    Twin {
        first: Option<u64>,
        second: Option<u64>,
    },
}

/// The runtime an acquisition runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum On {
    /// The history's own.
    Main,
    /// A current-thread runtime on a thread of its own, shut down this many ms after
    /// the acquisition started, whether it is still running or its guard lives on
    /// (nemesis).
    ShortLived(u64),
}

/// How an acquisition may be cancelled, besides an [`Op::Abort`] of its task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cancel {
    /// Left to run to its end.
    Never,
    /// Dropped after at most this many polls ([`AtMostPolls`]).
    AfterPolls(u32),
    /// `tokio::time::timeout` of this many ms around it.
    Timeout(u64),
}

/// One acquisition (of one key, or a MultiLock of two keys of one kind).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Acquire {
    /// Where the guard goes.
    pub slot: usize,
    pub client: u8,
    pub who: Who,
    /// One key, or two distinct keys: a MultiLock.
    pub keys: Vec<u8>,
    pub kind: Kind,
    /// A fenced lock (its guards carry fencing tokens).
    pub fenced: bool,
    pub call: Call,
    pub cancel: Cancel,
    /// `yield_now`s after spawning it (0: the next op runs before it is first polled).
    pub yields: u8,
    /// The runtime it runs on.
    pub on: On,
}

/// One step of a history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Spawn an acquisition whose guard goes to a slot.
    Acquire(Acquire),
    /// `guard.unlock().await` of a slot's guard (all of a MultiLock's).
    Unlock(usize),
    /// Drop a slot's guard (its release is spawned).
    Drop(usize),
    /// `JoinHandle::abort` of a slot's acquisition if it is still running.
    Abort(usize),
    /// Let this many ms pass: advance the paused clock, or sleep.
    Pass(u64),
    /// Let tasks run: this many `yield_now`s, then the fixture's settle.
    Settle(u8),
    /// A fault (nemesis).
    Fault(Fault),
}

/// A history: its shape and its ops.
#[derive(Clone, Debug)]
pub struct History {
    pub seed: u64,
    pub clients: u8,
    pub keys: u8,
    /// Explicit owners per client.
    pub owners: u8,
    /// Per client: its sessions trade durability for speed (PostgreSQL:
    /// `synchronous_commit = off`). Drawn with a nemesis only; empty otherwise.
    pub relaxed: Vec<bool>,
    pub ops: Vec<Op>,
}

impl History {
    /// The history of `seed`: `len` ops drawn with `timing`'s durations.
    pub fn generate(seed: u64, len: usize, timing: &Timing) -> History {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut g = Gen {
            clients: rng.u8(2..=3),
            keys: rng.u8(2..=3),
            owners: rng.u8(2..=3),
            rng,
            t: timing,
            ops: Vec::with_capacity(len + 2),
            next_slot: 0,
            singles: Vec::new(),
        };
        // Drawn after the shape, and only with a nemesis: histories without one stay
        // what their seeds always were.
        let relaxed = match &timing.nemesis {
            Some(n) => (0..g.clients)
                .map(|_| g.rng.u8(0..100) < n.relaxed_percent)
                .collect(),
            None => Vec::new(),
        };
        while g.ops.len() < len {
            g.step();
        }
        g.ops.truncate(len);
        History {
            seed,
            clients: g.clients,
            keys: g.keys,
            owners: g.owners,
            relaxed,
            ops: g.ops,
        }
    }

    /// The same history (seed, shape) with other ops.
    fn with_ops(&self, ops: Vec<Op>) -> History {
        History {
            ops,
            ..self.clone()
        }
    }
}

impl fmt::Display for History {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let relaxed: Vec<String> = (0..self.clients)
            .filter(|&c| self.relaxed.get(usize::from(c)) == Some(&true))
            .map(|c| format!("c{c}"))
            .collect();
        writeln!(
            f,
            "history seed={} clients={} keys={} owners/client={}{} ({} ops)",
            self.seed,
            self.clients,
            self.keys,
            self.owners,
            if relaxed.is_empty() {
                String::new()
            } else {
                format!(" relaxed sessions: {}", relaxed.join(","))
            },
            self.ops.len()
        )?;
        for (i, op) in self.ops.iter().enumerate() {
            writeln!(f, "  #{i:<3} {op}")?;
        }
        Ok(())
    }
}

impl Op {
    /// The slot the op acquires into or acts on, if any.
    fn slot(&self) -> Option<usize> {
        match self {
            Op::Acquire(a) => Some(a.slot),
            Op::Unlock(s) | Op::Drop(s) | Op::Abort(s) => Some(*s),
            Op::Pass(_) | Op::Settle(_) | Op::Fault(_) => None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Acquire(a) => write!(f, "{a}"),
            Op::Unlock(s) => write!(f, "unlock s{s}"),
            Op::Drop(s) => write!(f, "drop s{s}"),
            Op::Abort(s) => write!(f, "abort s{s}'s acquisition"),
            Op::Pass(ms) => write!(f, "pass {ms}ms"),
            Op::Settle(n) => write!(f, "settle ({n} yields)"),
            Op::Fault(fault) => write!(f, "{fault}"),
        }
    }
}

impl fmt::Display for Acquire {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = match self.who {
            Who::Fresh => format!("c{}.fresh", self.client),
            Who::Owner { idx, via } => format!(
                "c{}.o{} ({})",
                self.client,
                idx,
                match via {
                    Via::WithOwner => "with_owner",
                    Via::Scope => "scope",
                }
            ),
        };
        let keys: Vec<String> = self.keys.iter().map(|k| format!("k{k}")).collect();
        let what = if self.keys.len() > 1 {
            format!("MultiLock[{}]", keys.join(","))
        } else {
            keys.join(",")
        };
        let call = match self.call {
            Call::TryLock => "try_lock()".to_owned(),
            Call::TryLockFor { wait_ms, lease_ms } => format!(
                "try_lock_for({wait_ms}ms, {})",
                lease_ms.map_or("watchdog".to_owned(), |ms| format!("{ms}ms"))
            ),
            Call::Lock { timeout_ms } => format!("lock() within {timeout_ms}ms"),
            Call::Twin { first, second } => {
                let lease =
                    |ms: Option<u64>| ms.map_or("watchdog".to_owned(), |ms| format!("{ms}ms"));
                format!(
                    "twice at once: try_lock_for(0ms, {}) + try_lock_for(0ms, {})",
                    lease(first),
                    lease(second)
                )
            }
        };
        let cancel = match self.cancel {
            Cancel::Never => String::new(),
            Cancel::AfterPolls(n) => format!(", dropped after {n} polls"),
            Cancel::Timeout(ms) => format!(", timeout {ms}ms"),
        };
        let on = match self.on {
            On::Main => String::new(),
            On::ShortLived(ms) => format!(" on a runtime that ends after {ms}ms"),
        };
        write!(
            f,
            "s{} <- {who} {what} {}{} {call}{cancel}{on}; {} yields",
            self.slot,
            self.kind,
            if self.fenced { " fenced" } else { "" },
            self.yields
        )
    }
}

/// The generator's state: what it has emitted so far, to aim later ops at it.
struct Gen<'t> {
    rng: fastrand::Rng,
    t: &'t Timing,
    clients: u8,
    keys: u8,
    owners: u8,
    ops: Vec<Op>,
    next_slot: usize,
    /// Single-key acquisitions by explicit owners, for re-locks.
    singles: Vec<Acquire>,
}

impl Gen<'_> {
    fn pick_ms(&mut self, (lo, hi): (u64, u64)) -> u64 {
        self.rng.u64(lo..=hi)
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.rng.usize(0..from.len())]
    }

    /// One of the last few slots (recent ones are likelier to hold something).
    fn recent_slot(&mut self) -> Option<usize> {
        if self.next_slot == 0 {
            return None;
        }
        let back = self.rng.usize(0..self.next_slot.min(6));
        Some(self.next_slot - 1 - back)
    }

    fn slot(&mut self) -> usize {
        self.next_slot += 1;
        self.next_slot - 1
    }

    fn who(&mut self) -> Who {
        if self.rng.u8(0..100) < 20 {
            Who::Fresh
        } else {
            Who::Owner {
                idx: self.rng.u8(0..self.owners),
                via: if self.rng.bool() {
                    Via::WithOwner
                } else {
                    Via::Scope
                },
            }
        }
    }

    fn call(&mut self) -> Call {
        match self.rng.u8(0..100) {
            0..35 => Call::TryLock,
            35..75 => {
                let wait_ms = self.pick(self.t.waits_ms);
                let lease_ms = if self.rng.bool() {
                    None
                } else {
                    Some(self.pick(self.t.fixed_leases_ms))
                };
                Call::TryLockFor { wait_ms, lease_ms }
            }
            _ => Call::Lock {
                timeout_ms: self.pick_ms(self.t.lock_timeout_ms),
            },
        }
    }

    fn cancel(&mut self) -> Cancel {
        match self.rng.u8(0..100) {
            0..65 => Cancel::Never,
            65..85 => Cancel::AfterPolls(self.rng.u32(1..=6)),
            _ => Cancel::Timeout(self.pick_ms(self.t.cancel_timeout_ms)),
        }
    }

    fn fresh_acquire(&mut self, keys: usize) -> Acquire {
        let mut ks = vec![self.rng.u8(0..self.keys)];
        if keys > 1 {
            let other = (ks[0] + self.rng.u8(1..self.keys)) % self.keys;
            ks.push(other);
        }
        Acquire {
            slot: self.slot(),
            client: self.rng.u8(0..self.clients),
            who: self.who(),
            keys: ks,
            kind: self.pick(&KINDS),
            fenced: self.rng.u8(0..100) < 30,
            call: self.call(),
            cancel: self.cancel(),
            yields: self.rng.u8(0..=3),
            on: On::Main,
        }
    }

    /// With a nemesis: perhaps runs `a` on a short-lived runtime, and (for a single key
    /// of an explicit owner, `twin_percent` of the time) as two concurrent re-entries.
    fn nemesis_acquire(&mut self, a: &mut Acquire, twin_percent: u8) {
        let Some(n) = self.t.nemesis.as_ref() else {
            return;
        };
        if a.keys.len() == 1
            && matches!(a.who, Who::Owner { .. })
            && self.rng.u8(0..100) < twin_percent
        {
            a.call = Call::Twin {
                first: self.pick(n.twin_leases_ms),
                second: self.pick(n.twin_leases_ms),
            };
        }
        if self.rng.u8(0..100) < n.short_lived_percent {
            a.on = On::ShortLived(self.pick_ms(n.short_lived_ms));
        }
    }

    /// The same owner acquires a key it holds or just held again: in the same kind or
    /// its sibling, right after (or right before) the old guard is dropped or unlocked.
    fn relock(&mut self) {
        let back = self.rng.usize(0..self.singles.len().min(6));
        let prev = self.singles[self.singles.len() - 1 - back].clone();
        let Who::Owner { idx, .. } = prev.who else {
            unreachable!("only explicit owners are kept for re-locks")
        };
        let via = if self.rng.bool() {
            Via::WithOwner
        } else {
            Via::Scope
        };
        let kind = match self.rng.u8(0..100) {
            0..70 => prev.kind,
            70..90 => prev.kind.sibling(),
            _ => self.pick(&KINDS),
        };
        let mut again = Acquire {
            slot: self.slot(),
            who: Who::Owner { idx, via },
            kind,
            call: self.call(),
            cancel: if self.rng.u8(0..100) < 80 {
                Cancel::Never
            } else {
                self.cancel()
            },
            yields: if self.rng.bool() {
                0
            } else {
                self.rng.u8(1..=3)
            },
            on: On::Main,
            ..prev.clone()
        };
        let twins = self.t.nemesis.as_ref().map_or(0, |n| n.twin_percent);
        self.nemesis_acquire(&mut again, twins);
        let release = if self.rng.bool() {
            Op::Drop(prev.slot)
        } else {
            Op::Unlock(prev.slot)
        };
        match self.rng.u8(0..100) {
            // Release, then acquire again.
            0..40 => {
                self.ops.push(release);
                self.ops.push(Op::Acquire(again.clone()));
            }
            // Acquire again (spawned, not run yet), then release the old guard.
            40..70 => {
                self.ops.push(Op::Acquire(again.clone()));
                self.ops.push(release);
            }
            // Re-enter while holding.
            _ => self.ops.push(Op::Acquire(again.clone())),
        }
        self.singles.push(again);
    }

    /// One or two ops, drawn with these odds: 34% an acquisition of one key (40% of
    /// them a re-lock by an owner of a recent one, when there is one), 5% a MultiLock,
    /// 12% an unlock, 11% a drop, 3% an abort (of a recent slot), 19% a time step, 16% a
    /// settle.
    ///
    /// With a nemesis, `fault_percent` of the steps are a [`Fault`] instead, and
    /// acquisitions may be twins or run on short-lived runtimes (see
    /// [`Gen::nemesis_acquire`]).
    fn step(&mut self) {
        if let Some(n) = self.t.nemesis.as_ref()
            && self.rng.u8(0..100) < n.fault_percent
        {
            let fault = Fault::draw(&mut self.rng, n, self.keys);
            self.ops.push(Op::Fault(fault));
            return;
        }
        match self.rng.u8(0..100) {
            0..34 => {
                if !self.singles.is_empty() && self.rng.u8(0..100) < 40 {
                    self.relock();
                } else {
                    let mut a = self.fresh_acquire(1);
                    // A first acquisition as twins races the owner's two tasks for it.
                    self.nemesis_acquire(&mut a, 8);
                    if matches!(a.who, Who::Owner { .. }) {
                        self.singles.push(a.clone());
                    }
                    self.ops.push(Op::Acquire(a));
                }
            }
            34..39 => {
                let mut a = self.fresh_acquire(2);
                self.nemesis_acquire(&mut a, 0);
                self.ops.push(Op::Acquire(a));
            }
            39..51 => match self.recent_slot() {
                Some(s) => self.ops.push(Op::Unlock(s)),
                None => self.ops.push(Op::Settle(1)),
            },
            51..62 => match self.recent_slot() {
                Some(s) => self.ops.push(Op::Drop(s)),
                None => self.ops.push(Op::Settle(1)),
            },
            62..65 => match self.recent_slot() {
                Some(s) => self.ops.push(Op::Abort(s)),
                None => self.ops.push(Op::Settle(1)),
            },
            65..84 => {
                let ms = if self.rng.u8(0..100) < self.t.big_pass_percent {
                    self.pick_ms(self.t.big_pass_ms)
                } else {
                    self.pick_ms(self.t.small_pass_ms)
                };
                self.ops.push(Op::Pass(ms));
            }
            _ => {
                let n = self.rng.u8(1..=4);
                self.ops.push(Op::Settle(n));
            }
        }
    }
}

// ───────────────────────────── fixtures ─────────────────────────────

/// How a store records a hold's mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreMode {
    /// Exactly this mode.
    Exact(LockMode),
    /// Exclusive or fair: the store does not say which (Redis keeps both as one hash).
    Sole,
}

impl StoreMode {
    fn covers(self, mode: LockMode) -> bool {
        match self {
            StoreMode::Exact(m) => m == mode,
            StoreMode::Sole => matches!(mode, LockMode::Exclusive | LockMode::Fair),
        }
    }
}

/// One live hold as the store has it.
#[derive(Clone, Debug)]
pub struct StoreHold {
    pub owner: String,
    pub mode: StoreMode,
}

/// Every live hold of each of the history's keys (indexed like [`Fixture::keys`]).
pub type StoreView = Vec<Vec<StoreHold>>;

/// One backend under test, set up for one history.
pub trait Fixture {
    /// The history's clients, all on one store.
    fn clients(&self) -> &[LockClient];
    /// The history's keys: `k0`, `k1`, ... in the printed history.
    fn keys(&self) -> &[LockKey];
    /// Lets `d` pass: advances a paused clock, or sleeps.
    fn pass(&self, d: Duration) -> impl Future<Output = ()>;
    /// Lets spawned tasks run (after the driver's own `yield_now`s).
    fn settle(&self) -> impl Future<Output = ()>;
    /// What the store holds right now (check 3); `None` when it cannot be read right
    /// now (a nemesis took it down).
    fn view(&self) -> impl Future<Output = Option<StoreView>>;
    /// Called when every guard is released and tasks have settled: `Ok` once the store
    /// is empty, else the finding and what is left (check 4).
    fn drained(&self) -> impl Future<Output = Result<(), (Finding, String)>>;

    /// The faults of the proxy between the clients and the store, with a nemesis.
    fn nemesis(&self) -> Option<&Nemesis> {
        None
    }

    /// Kills the store (SIGKILL), leaves it down for `down`, restarts it; says which
    /// holds it lost (with a nemesis).
    fn crash(&self, down: Duration) -> impl Future<Output = Crashed> {
        async move { panic!("this store cannot crash (asked to stay down {down:?})") }
    }

    /// Makes the store refuse every write for `for_` (with a nemesis whose timing
    /// draws such faults).
    fn refuse_writes(&self, for_: Duration) -> impl Future<Output = ()> {
        async move { panic!("this store cannot refuse writes (asked for {for_:?})") }
    }

    /// Ends a refusal of writes in force, if any.
    fn accept_writes(&self) -> impl Future<Output = ()> {
        async {}
    }

    /// What the store keeps for each key (holds, queue entries; not fencing counters),
    /// described; `None` when it cannot be read right now (a nemesis's residue check).
    fn residue(&self) -> impl Future<Output = Option<Vec<Vec<String>>>> {
        async { None }
    }

    /// Whether the store keeps a key's permits apart from its other families: holds of
    /// permits and of exclusive/fair or read/write on one key do not exclude each other
    /// there (ZooKeeper in Curator's layouts: a semaphore's nodes live below its key,
    /// apart from the mutex's and the read-write lock's), against [`LockMode`]'s rule
    /// that another family makes the key busy. Check 1 then judges a key's permits apart
    /// from its other holders; everything else stays. `false` for every other store.
    fn permits_apart(&self) -> bool {
        false
    }
}

// ───────────────────────────── findings ─────────────────────────────

/// A kind of oracle violation. Shrinking keeps the kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Finding {
    /// Check 1: two exclusive-or-fair holders of one key.
    TwoSoleHolders,
    /// Check 1: holds of two families (exclusive/fair, read/write, permits) on one key.
    FamiliesMixed,
    /// Check 1: a writer next to another writer, or a holder other than its own reads.
    WriterNotAlone,
    /// Check 1: more permit holders than permits.
    TooManyPermits,
    /// Check 1, with one owner: it holds one key in two modes that exclude each other
    /// (exclusive and fair, a sole mode and a read or write, ...), so one hold was let in
    /// as a re-entry of the other.
    OneOwnerTwoModes,
    /// Check 2: a guard seen lost became not lost.
    LostRevived,
    /// Check 2: unlock of a guard seen lost did not return `Err(Lost)`.
    LostUnlockNotLost,
    /// Check 3: a believed guard's hold is not in the store.
    MissingFromStore,
    /// Check 5: a fenced exclusive, fair or write hold's token is not greater than the
    /// token of the exclusive hold of the key believed before it (or guards of one hold
    /// disagree on its token).
    TokensNotIncreasing,
    /// Check 4 (memory): holds left in the store right after every guard was released.
    ResidueAfterRelease,
    /// Check 4: state left in the store (or local waiters) after every lease ended.
    ResidueAfterLeases,
    /// Nemesis: the store keeps something for a key that nothing has touched for
    /// [`NemesisTiming::residue_bound`] (no acquisition running, no guard believed).
    ResidueAfterLastGuard,
    /// Nemesis: a guard of a hold the store lost in a crash is still believed one
    /// longest lease after the crash.
    BelievedAfterStoreLost,
    /// An acquire or unlock failed with an error the oracle does not allow.
    UnexpectedError,
    /// A task looped without ever returning `Pending`: the runtime stalled (on a paused
    /// clock, time stands still and nothing else runs). See [`SpinBreaker`].
    Livelock,
    /// An acquisition or unlock panicked (or the run did).
    Panicked,
}

impl Finding {
    pub fn describe(self) -> &'static str {
        match self {
            Finding::TwoSoleHolders => {
                "exclusion: two exclusive/fair holders of one key believe they hold it"
            }
            Finding::FamiliesMixed => {
                "exclusion: holds of different families (exclusive/fair, read/write, permits) on one key"
            }
            Finding::WriterNotAlone => {
                "exclusion: a writer next to a holder other than its own owner's reads"
            }
            Finding::TooManyPermits => "exclusion: more permit holders than permits",
            Finding::OneOwnerTwoModes => {
                "exclusion: one owner believes it holds one key in two modes that exclude each other"
            }
            Finding::LostRevived => "a guard seen lost is no longer lost",
            Finding::LostUnlockNotLost => "unlock of a guard seen lost did not report Err(Lost)",
            Finding::MissingFromStore => {
                "a believed guard's hold is gone from the store (freed by someone else's release)"
            }
            Finding::TokensNotIncreasing => {
                "fencing: an exclusive holder's token is not above the previous exclusive holder's"
            }
            Finding::ResidueAfterRelease => {
                "holds left in the store after every guard was released"
            }
            Finding::ResidueAfterLeases => {
                "store state or waiters left after every lease and the waiter timeout ended"
            }
            Finding::ResidueAfterLastGuard => {
                "the store keeps a hold or queue entry of a key one lease after its last guard ended"
            }
            Finding::BelievedAfterStoreLost => {
                "a guard of a hold the store lost in a crash is believed past its lease"
            }
            Finding::UnexpectedError => "an acquire or unlock failed unexpectedly",
            Finding::Livelock => {
                "livelock: an acquisition looped without yielding and stalled the runtime"
            }
            Finding::Panicked => "an acquisition, an unlock or the run panicked",
        }
    }
}

/// One finding of one run: the first occurrence of its kind.
#[derive(Clone, Debug)]
pub struct Violation {
    pub finding: Finding,
    /// The op after which it was seen; `ops.len()` for the end check.
    pub step: usize,
    pub detail: String,
}

/// What one run of a history did.
#[derive(Clone, Debug, Default)]
pub struct Outcome {
    /// The first violation of each kind, in the order seen.
    pub violations: Vec<Violation>,
    /// A line per op and per event (acquisitions completing, unlock results, findings).
    pub trace: Vec<String>,
}

impl Outcome {
    pub fn find(&self, finding: Finding) -> Option<&Violation> {
        self.violations.iter().find(|v| v.finding == finding)
    }
}

// ───────────────────────────── cancellation ─────────────────────────────

/// Polls a future at most `left` times, then drops it (before returning `None`): a
/// cancellation at a random await point.
pub struct AtMostPolls<F> {
    inner: Option<Pin<Box<F>>>,
    left: u32,
}

impl<F: Future> AtMostPolls<F> {
    pub fn new(inner: F, polls: u32) -> Self {
        AtMostPolls {
            inner: Some(Box::pin(inner)),
            left: polls,
        }
    }
}

impl<F: Future> Future for AtMostPolls<F> {
    type Output = Option<F::Output>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(inner) = self.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if let Poll::Ready(out) = inner.as_mut().poll(cx) {
            self.inner = None;
            return Poll::Ready(Some(out));
        }
        self.left = self.left.saturating_sub(1);
        if self.left == 0 {
            // Dropped here, mid-acquisition, while this task is still being polled.
            self.inner = None;
            return Poll::Ready(None);
        }
        Poll::Pending
    }
}

/// Polls a future, catching a panic out of it as `Err(message)` — except the
/// [`SpinBreaker`]'s, which goes on unwinding the task it broke.
pub struct CatchPanic<F> {
    inner: Pin<Box<F>>,
}

impl<F: Future> CatchPanic<F> {
    pub fn new(inner: F) -> Self {
        CatchPanic {
            inner: Box::pin(inner),
        }
    }
}

impl<F: Future> Future for CatchPanic<F> {
    type Output = Result<F::Output, String>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let inner = self.inner.as_mut();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.poll(cx))) {
            Ok(Poll::Ready(out)) => Poll::Ready(Ok(out)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(payload) if payload.downcast_ref::<&str>() == Some(&SPIN_PANIC) => {
                std::panic::resume_unwind(payload)
            }
            Err(payload) => Poll::Ready(Err(panic_message(payload.as_ref()))),
        }
    }
}

/// A panic's message, as far as it has one.
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(a panic without a message)".to_owned())
}

// ───────────────────────────── livelock detection ─────────────────────────────

/// How many library trace events may be emitted between two ops of the driver. A legit
/// step emits tens (an attempt, a wait, a renewal each emit one or two); a task that
/// loops without returning `Pending` emits one or two per turn and never lets the driver
/// run again.
const SPIN_LIMIT: u64 = 20_000;

/// The panic payload [`SpinBreaker`] unwinds a looping task with.
pub const SPIN_PANIC: &str = "history checker: breaking a livelocked task";

/// A `tracing` subscriber, the thread's default for one run, that counts the library's
/// trace events between two ops of the driver and, past [`SPIN_LIMIT`], panics inside
/// the event: that unwinds the task that is looping (tokio catches the panic and drops
/// the task), so the runtime runs again and the run can report the livelock instead of
/// hanging. The count does not depend on wall time, so the detection replays exactly.
#[derive(Clone, Default)]
pub struct SpinBreaker {
    state: Arc<SpinState>,
}

#[derive(Default)]
struct SpinState {
    events: std::sync::atomic::AtomicU64,
    /// The task that was broken (if it was a task) and the event it was looping on.
    tripped: Mutex<Option<(Option<tokio::task::Id>, String)>>,
}

impl SpinBreaker {
    /// The driver moves on to its next op.
    fn step(&self) {
        self.state.events.store(0, Ordering::Relaxed);
    }

    fn take_trip(&self) -> Option<(Option<tokio::task::Id>, String)> {
        self.state.tripped.lock().unwrap().take()
    }

    /// Silences the default panic message for [`SPIN_PANIC`] (the run reports it).
    pub fn quiet_panics() {
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            let previous = std::panic::take_hook();
            std::panic::set_hook(Box::new(move |info| {
                if info.payload().downcast_ref::<&str>() != Some(&SPIN_PANIC) {
                    previous(info);
                }
            }));
        });
    }
}

/// Captures an event's message, for the report.
struct Message(String);

impl tracing::field::Visit for Message {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn fmt::Debug) {
        if self.0.is_empty() || field.name() == "message" {
            let _ = write!(self.0, "{value:?}");
        }
    }
}

impl tracing::Subscriber for SpinBreaker {
    fn register_callsite(
        &self,
        metadata: &'static tracing::Metadata<'static>,
    ) -> tracing::subscriber::Interest {
        if metadata.is_event() {
            tracing::subscriber::Interest::always()
        } else {
            tracing::subscriber::Interest::never()
        }
    }

    fn enabled(&self, metadata: &tracing::Metadata<'_>) -> bool {
        metadata.is_event()
    }

    fn max_level_hint(&self) -> Option<tracing::level_filters::LevelFilter> {
        Some(tracing::level_filters::LevelFilter::TRACE)
    }

    fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
        tracing::span::Id::from_u64(1)
    }

    fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}

    fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}

    fn event(&self, event: &tracing::Event<'_>) {
        let n = self.state.events.fetch_add(1, Ordering::Relaxed) + 1;
        if n > SPIN_LIMIT {
            let mut message = Message(String::new());
            event.record(&mut message);
            *self.state.tripped.lock().unwrap() = Some((
                tokio::task::try_id(),
                format!(
                    "{n} trace events without the driver running (last: {} \"{}\")",
                    event.metadata().target(),
                    message.0
                ),
            ));
            self.state.events.store(0, Ordering::Relaxed);
            std::panic::panic_any(SPIN_PANIC);
        }
    }

    fn enter(&self, _: &tracing::span::Id) {}

    fn exit(&self, _: &tracing::span::Id) {}
}

// ───────────────────────────── the driver ─────────────────────────────

/// A guard's place: its slot and its index among the slot's guards (a MultiLock and a
/// pair of twins have two). Slots are used once per history, so this names one guard for
/// the whole run.
type GuardId = (usize, usize);

/// What a slot holds.
enum Holding {
    One(LockGuard),
    Multi(MultiGuard),
    /// What a pair of concurrent re-entries got (one guard or two).
    Twin(Vec<LockGuard>),
}

impl Holding {
    fn guards(&self) -> &[LockGuard] {
        match self {
            Holding::One(g) => std::slice::from_ref(g),
            Holding::Multi(m) => m.guards(),
            Holding::Twin(gs) => gs,
        }
    }
}

struct Held {
    holding: Holding,
    /// Per guard: `is_lost()` was seen true.
    seen_lost: Vec<bool>,
}

/// State shared by the driver and the acquisition tasks (behind one mutex, never held
/// across an `.await`).
struct Shared {
    held: BTreeMap<usize, Held>,
    trace: Vec<String>,
    violations: Vec<Violation>,
    /// The op being run, for findings reported by tasks.
    step: usize,
    /// What was reported, by step (each once).
    reported: HashSet<(usize, String)>,
    /// Names for owners and keys in the trace.
    names: Names,
    /// Per key: the last fenced exclusive-family hold believed, and its token (check 5).
    last_token: HashMap<LockKey, (Holder, u64)>,
    /// A nemesis is at work: failures to reach the store are not findings.
    nemesis: bool,
    /// Hold identities a crashed store lost, and when it was killed.
    lost_in_crash: HashMap<String, Instant>,
    /// The longest lease any hold may have.
    longest_lease: Duration,
    /// Acquisitions that began as re-entries of a held guard's hold: the re-entry renews
    /// that lease first, and may find it run out (`Lost`) even when the guard was
    /// unlocked meanwhile. A watched hold's too: on a loaded machine its watchdog's
    /// renewal can come late (seed 50 under the whole suite, on both stores). `Lost`
    /// fails closed; it never lets a second holder in.
    reentries: HashSet<usize>,
}

impl Shared {
    fn report(&mut self, finding: Finding, detail: String) {
        let step = self.step;
        // A check reads the guards twice per step: say each thing once.
        if !self.reported.insert((step, detail.clone())) {
            return;
        }
        self.trace
            .push(format!("    !! {finding:?} after #{step}: {detail}"));
        if !self.violations.iter().any(|v| v.finding == finding) {
            self.violations.push(Violation {
                finding,
                step,
                detail,
            });
        }
    }

    /// Whether an acquisition or unlock may fail with `e` without a finding: under a
    /// nemesis, when the store could not answer, and (an acquisition) when a re-entry
    /// found its hold gone.
    fn allows(&self, e: &Error, acquiring: bool) -> bool {
        self.nemesis && (e.is_unavailable() || (acquiring && matches!(e, Error::Lost)))
    }
}

/// Labels owners (`c1.o0`, `c1.fresh7`) and keys (`k2`) for the trace.
struct Names {
    owners: HashMap<Owner, String>,
    client_ids: Vec<String>,
    keys: HashMap<LockKey, String>,
}

impl Names {
    fn owner(&self, owner: &str) -> String {
        if let Ok(o) = Owner::from_raw(owner)
            && let Some(name) = self.owners.get(&o)
        {
            return name.clone();
        }
        for (c, id) in self.client_ids.iter().enumerate() {
            if let Some(n) = owner
                .strip_prefix(id.as_str())
                .and_then(|r| r.strip_prefix(':'))
            {
                return format!("c{c}.fresh{n}");
            }
        }
        owner.to_owned()
    }

    fn key(&self, key: &LockKey) -> String {
        self.keys
            .get(key)
            .cloned()
            .unwrap_or_else(|| key.to_string())
    }

    fn guard(&self, id: GuardId, g: &LockGuard) -> String {
        format!(
            "s{}{} {} {} {} (token {:?}, holds {})",
            id.0,
            if id.1 > 0 {
                format!("[{}]", id.1)
            } else {
                String::new()
            },
            self.owner(g.owner().as_str()),
            self.key(g.key()),
            g.mode(),
            g.fencing_token().map(|t| t.get()),
            g.hold_count()
        )
    }
}

/// How an acquisition ended.
enum Attempt {
    Got(Holding),
    Failed(Error),
    /// What each of a pair of concurrent re-entries got.
    Twins(Vec<LockGuard>, Vec<Error>),
    /// `lock()`'s outer timeout ran out.
    GaveUp,
    /// Cancelled by its [`Cancel`].
    Cancelled,
    /// Panicked, with this message.
    Panicked(String),
}

/// Runs `history` against `fx` and checks the oracle after every op and at the end.
pub async fn run<F: Fixture>(fx: &F, history: &History) -> Outcome {
    let clients = fx.clients();
    assert_eq!(clients.len(), usize::from(history.clients));
    assert_eq!(fx.keys().len(), usize::from(history.keys));
    // The explicit owners, made once per client.
    let owners: Vec<Vec<Owner>> = clients
        .iter()
        .map(|c| (0..history.owners).map(|_| c.new_owner()).collect())
        .collect();
    let names = Names {
        owners: owners
            .iter()
            .enumerate()
            .flat_map(|(c, os)| {
                os.iter()
                    .enumerate()
                    .map(move |(i, o)| (o.clone(), format!("c{c}.o{i}")))
            })
            .collect(),
        client_ids: clients.iter().map(|c| c.id().to_owned()).collect(),
        keys: fx
            .keys()
            .iter()
            .enumerate()
            .map(|(i, k)| (k.clone(), format!("k{i}")))
            .collect(),
    };
    SpinBreaker::quiet_panics();
    let spin = SpinBreaker::default();
    // This thread runs the runtime (current-thread): every task's events come here.
    super::log_capture_sees_every_callsite();
    let _default = tracing::subscriber::set_default(spin.clone());
    let activity = fx.nemesis().map(|n| Activity {
        bound: n.residue_bound(),
        last: vec![Instant::now(); fx.keys().len()],
        running: HashSet::new(),
        believed: HashSet::new(),
        touched: HashSet::new(),
    });
    let mut driver = Driver {
        fx,
        owners,
        spin,
        pending: BTreeMap::new(),
        task_slots: HashMap::new(),
        slot_keys: HashMap::new(),
        threads: Vec::new(),
        activity,
        shared: Arc::new(Mutex::new(Shared {
            held: BTreeMap::new(),
            reentries: HashSet::new(),
            trace: Vec::new(),
            violations: Vec::new(),
            step: 0,
            reported: HashSet::new(),
            names,
            last_token: HashMap::new(),
            nemesis: fx.nemesis().is_some(),
            lost_in_crash: HashMap::new(),
            longest_lease: fx.nemesis().map_or(Duration::ZERO, Nemesis::longest_lease),
        })),
    };
    for (i, op) in history.ops.iter().enumerate() {
        {
            let mut sh = driver.shared.lock().unwrap();
            sh.step = i;
            sh.trace.push(format!("#{i:<3} {op}"));
        }
        driver.spin.step();
        driver.apply(op).await;
        driver.check().await;
    }
    driver.finish(history.ops.len()).await;
    let sh = driver.shared.lock().unwrap();
    Outcome {
        violations: sh.violations.clone(),
        trace: sh.trace.clone(),
    }
}

/// When each key was last touched, for the nemesis's residue check: an acquisition of
/// it running, a guard of it believed, an op on one of its slots.
struct Activity {
    /// How long after its last activity a key must have nothing left in the store.
    bound: Duration,
    /// Per key: the last check that saw it active (or the one right after).
    last: Vec<Instant>,
    /// Slots whose acquisition ran at the last check.
    running: HashSet<usize>,
    /// Keys with a believed guard at the last check.
    believed: HashSet<usize>,
    /// Keys the op being run touched.
    touched: HashSet<usize>,
}

struct Driver<'f, F> {
    fx: &'f F,
    owners: Vec<Vec<Owner>>,
    spin: SpinBreaker,
    /// Acquisition tasks by slot (finished ones too, until the end).
    pending: BTreeMap<usize, JoinHandle<()>>,
    /// Which slot each acquisition task serves.
    task_slots: HashMap<tokio::task::Id, usize>,
    /// The keys (indices) of each slot's acquisition.
    slot_keys: HashMap<usize, Vec<usize>>,
    /// The threads of short-lived runtimes, waited for at the end.
    threads: Vec<std::thread::JoinHandle<()>>,
    /// With a nemesis: when each key was last touched.
    activity: Option<Activity>,
    shared: Arc<Mutex<Shared>>,
}

impl<F: Fixture> Driver<'_, F> {
    fn log(&self, line: String) {
        self.shared.lock().unwrap().trace.push(line);
    }

    /// The op being run touches `slot`'s keys.
    fn touch(&mut self, slot: usize) {
        if let (Some(activity), Some(keys)) = (self.activity.as_mut(), self.slot_keys.get(&slot)) {
            activity.touched.extend(keys.iter().copied());
        }
    }

    async fn apply(&mut self, op: &Op) {
        if let Some(slot) = op.slot() {
            self.touch(slot);
        }
        match op {
            Op::Acquire(a) => {
                self.slot_keys
                    .insert(a.slot, a.keys.iter().map(|&k| usize::from(k)).collect());
                self.touch(a.slot);
                let task = self.spawn_acquire(a);
                self.task_slots.insert(task.id(), a.slot);
                self.pending.insert(a.slot, task);
                for _ in 0..a.yields {
                    tokio::task::yield_now().await;
                }
            }
            Op::Unlock(slot) => self.unlock(*slot).await,
            Op::Drop(slot) => {
                let held = self.shared.lock().unwrap().held.remove(slot);
                if let Some(held) = held {
                    drop(held);
                    self.log(format!("    s{slot} dropped"));
                }
            }
            Op::Abort(slot) => {
                if let Some(task) = self.pending.get(slot)
                    && !task.is_finished()
                {
                    task.abort();
                    self.log(format!("    s{slot}'s acquisition aborted"));
                }
            }
            Op::Pass(ms) => self.fx.pass(Duration::from_millis(*ms)).await,
            Op::Settle(n) => {
                for _ in 0..*n {
                    tokio::task::yield_now().await;
                }
                self.fx.settle().await;
            }
            Op::Fault(Fault::Crash { down_ms }) => {
                let crashed = self.fx.crash(Duration::from_millis(*down_ms)).await;
                let mut sh = self.shared.lock().unwrap();
                let lost: Vec<String> = crashed.lost.iter().map(|h| sh.names.owner(h)).collect();
                sh.trace.push(format!(
                    "    store restarted; it lost {}",
                    if lost.is_empty() {
                        "nothing".to_owned()
                    } else {
                        lost.join(", ")
                    }
                ));
                for holder in crashed.lost {
                    sh.lost_in_crash.insert(holder, crashed.killed_at);
                }
            }
            Op::Fault(Fault::RefuseWrites { for_ms }) => {
                self.fx.refuse_writes(Duration::from_millis(*for_ms)).await;
            }
            Op::Fault(fault) => self
                .fx
                .nemesis()
                .expect("a fault op needs a fixture with a nemesis")
                .apply(fault),
        }
    }

    /// Unlocks a slot's guard(s) and checks the result against what was seen (check 2).
    async fn unlock(&mut self, slot: usize) {
        let Some(held) = self.shared.lock().unwrap().held.remove(&slot) else {
            return;
        };
        match held.holding {
            Holding::Twin(guards) => {
                // Each twin is a guard of its own: unlocked, and judged, one by one.
                for (i, (g, seen)) in guards.into_iter().zip(held.seen_lost).enumerate() {
                    let seen_lost = seen || g.is_lost();
                    let result = CatchPanic::new(g.unlock()).await;
                    self.judge_unlock(&format!("s{slot}[{i}]"), seen_lost, result);
                }
            }
            holding => {
                // Seen lost before, or lost right now (read just before the call).
                let seen_lost = holding
                    .guards()
                    .iter()
                    .zip(&held.seen_lost)
                    .any(|(g, seen)| *seen || g.is_lost());
                let result = match holding {
                    Holding::One(g) => CatchPanic::new(g.unlock()).await,
                    Holding::Multi(m) => CatchPanic::new(m.unlock()).await,
                    Holding::Twin(_) => unreachable!("handled above"),
                };
                self.judge_unlock(&format!("s{slot}"), seen_lost, result);
            }
        }
    }

    /// Check 2 for one unlock: a guard seen lost must be told `Lost`, whatever else
    /// went wrong with the release.
    fn judge_unlock(&self, what: &str, seen_lost: bool, result: Result<Result<(), Error>, String>) {
        let mut sh = self.shared.lock().unwrap();
        let result = match result {
            Ok(result) => result,
            Err(message) => {
                sh.trace
                    .push(format!("    {what} unlock panicked: {message}"));
                sh.report(
                    Finding::Panicked,
                    format!("unlock of {what} panicked: {message}"),
                );
                return;
            }
        };
        sh.trace.push(format!(
            "    {what} unlock -> {result:?}{}",
            if seen_lost { " (seen lost)" } else { "" }
        ));
        match result {
            Err(Error::Lost) => {}
            Ok(()) if seen_lost => sh.report(
                Finding::LostUnlockNotLost,
                format!("unlock of {what}, seen lost, returned Ok(())"),
            ),
            Ok(()) => {}
            Err(e) if seen_lost => sh.report(
                Finding::LostUnlockNotLost,
                format!("unlock of {what}, seen lost, failed with {e} instead of Lost"),
            ),
            Err(e) if sh.allows(&e, false) => {}
            Err(e) => sh.report(
                Finding::UnexpectedError,
                format!("unlock of {what} failed: {e}"),
            ),
        }
    }

    fn spawn_acquire(&mut self, a: &Acquire) -> JoinHandle<()> {
        let client = self.fx.clients()[usize::from(a.client)].clone();
        let locks: Vec<Lock> = a
            .keys
            .iter()
            .map(|&k| {
                let lock = a.kind.lock(&client, &self.fx.keys()[usize::from(k)]);
                if a.fenced { lock.fenced() } else { lock }
            })
            .collect();
        let owner = match a.who {
            Who::Fresh => None,
            Who::Owner { idx, via } => Some((
                self.owners[usize::from(a.client)][usize::from(idx)].clone(),
                via,
            )),
        };
        let (slot, call, cancel) = (a.slot, a.call, a.cancel);
        if let Some((owner, _)) = &owner {
            let mut sh = self.shared.lock().unwrap();
            let reenters = sh.held.values().any(|held| {
                held.holding
                    .guards()
                    .iter()
                    .any(|g| g.owner() == owner && locks.iter().any(|lock| lock.key() == g.key()))
            });
            if reenters {
                sh.reentries.insert(slot);
            }
        }
        let shared = Arc::clone(&self.shared);
        let body = async move {
            let acquire = CatchPanic::new(acquire(locks, owner, call));
            let attempt = match cancel {
                Cancel::Never => acquire.await,
                Cancel::AfterPolls(n) => AtMostPolls::new(acquire, n)
                    .await
                    .unwrap_or(Ok(Attempt::Cancelled)),
                Cancel::Timeout(ms) => tokio::time::timeout(Duration::from_millis(ms), acquire)
                    .await
                    .unwrap_or(Ok(Attempt::Cancelled)),
            };
            let attempt = attempt.unwrap_or_else(Attempt::Panicked);
            // In the same poll as the acquisition's return: the guard is in its slot
            // before anything else runs.
            let mut sh = shared.lock().unwrap();
            settle_attempt(&mut sh, slot, attempt);
        };
        match a.on {
            On::Main => tokio::spawn(body),
            On::ShortLived(ms) => {
                let (task, thread) = spawn_short_lived(body, Duration::from_millis(ms));
                self.threads.push(thread);
                task
            }
        }
    }

    /// Checks 1–3 after a step: read the guards, take the store's snapshot, read them
    /// again; a guard believed both times must be in the snapshot. With a nemesis, then
    /// the residue check.
    async fn check(&mut self) {
        self.livelock();
        let before = self.observe(None);
        let after = match self.fx.view().await {
            Some(view) => self.observe(Some((&before, &view))),
            None => {
                self.log("    (the store cannot be read now: no snapshot)".to_owned());
                self.observe(None)
            }
        };
        self.residue(&before, &after).await;
    }

    /// Reports a task the [`SpinBreaker`] had to break, with its slot.
    fn livelock(&self) {
        if let Some((task, detail)) = self.spin.take_trip() {
            let slot = task
                .and_then(|id| self.task_slots.get(&id))
                .map_or("a library task (no acquisition)".to_owned(), |s| {
                    format!("s{s}'s acquisition")
                });
            self.shared
                .lock()
                .unwrap()
                .report(Finding::Livelock, format!("{slot} looped: {detail}"));
        }
    }

    /// One synchronous pass over every guard: check 2 (lost stays lost), check 1
    /// (exclusion among believed holders), and with a snapshot check 3. Returns the
    /// believed guards.
    ///
    /// Guards of holds a crashed store lost are left out of checks 1, 3 and 5; each
    /// must be lost one longest lease after the crash.
    fn observe(&self, store: Option<(&HashSet<GuardId>, &StoreView)>) -> HashSet<GuardId> {
        let mut sh = self.shared.lock().unwrap();
        let sh = &mut *sh;
        let now = Instant::now();
        let mut believed = HashSet::new();
        // Per key: the believed holders and, for messages, their guards.
        let mut holders: BTreeMap<LockKey, Vec<(Holder, String)>> = BTreeMap::new();
        let mut reports = Vec::new();
        for (&slot, held) in sh.held.iter_mut() {
            for (i, g) in held.holding.guards().iter().enumerate() {
                let id = (slot, i);
                let lost = g.is_lost();
                if held.seen_lost[i] && !lost {
                    reports.push((
                        Finding::LostRevived,
                        format!(
                            "{} was seen lost, now is_lost() is false",
                            sh.names.guard(id, g)
                        ),
                    ));
                }
                if lost {
                    held.seen_lost[i] = true;
                    continue;
                }
                believed.insert(id);
                if let Some(&killed_at) = sh.lost_in_crash.get(g.hold_id().as_str()) {
                    // The store lost this hold: the guard may go on believing only as
                    // long as the lease it was last confirmed for.
                    let limit = sh.longest_lease + Duration::from_millis(100);
                    if now.saturating_duration_since(killed_at) > limit {
                        reports.push((
                            Finding::BelievedAfterStoreLost,
                            format!(
                                "{} is believed {:?} after the store that held it was killed \
                                 (longest lease {:?})",
                                sh.names.guard(id, g),
                                now - killed_at,
                                sh.longest_lease
                            ),
                        ));
                    }
                    continue;
                }
                let holder = holder_of(g);
                // Check 5: exclusive-family holds of one key are never believed at once
                // (check 1), so the order they are believed in is the order they were
                // granted in, and their tokens must increase in it.
                if let (LockMode::Exclusive | LockMode::Fair | LockMode::Write, Some(token)) =
                    (g.mode(), g.fencing_token())
                {
                    let token = token.get();
                    match sh.last_token.get(g.key()) {
                        Some((last, t)) if *last == holder && *t != token => reports.push((
                            Finding::TokensNotIncreasing,
                            format!("{} has token {token}, its hold had {t}", sh.names.guard(id, g)),
                        )),
                        Some((last, t)) if *last != holder && token <= *t => reports.push((
                            Finding::TokensNotIncreasing,
                            format!(
                                "{} has token {token}, not above the previous exclusive holder's {t}",
                                sh.names.guard(id, g)
                            ),
                        )),
                        _ => {}
                    }
                    sh.last_token
                        .insert(g.key().clone(), (holder.clone(), token));
                }
                holders
                    .entry(g.key().clone())
                    .or_default()
                    .push((holder, sh.names.guard(id, g)));
                if let Some((before, view)) = store
                    && before.contains(&id)
                {
                    let k = self.fx.keys().iter().position(|k| k == g.key()).unwrap();
                    let in_store = view[k]
                        .iter()
                        .any(|h| h.owner == g.hold_id().as_str() && h.mode.covers(g.mode()));
                    if !in_store {
                        let there: Vec<String> = view[k]
                            .iter()
                            .map(|h| format!("{} {:?}", sh.names.owner(&h.owner), h.mode))
                            .collect();
                        reports.push((
                            Finding::MissingFromStore,
                            format!(
                                "{} is believed but the store has {}",
                                sh.names.guard(id, g),
                                if there.is_empty() {
                                    "nothing".to_owned()
                                } else {
                                    there.join(", ")
                                }
                            ),
                        ));
                    }
                }
            }
        }
        let permits_apart = self.fx.permits_apart();
        for (key, holders) in &holders {
            reports.extend(exclusion(&sh.names.key(key), holders, permits_apart));
        }
        for (finding, detail) in reports {
            sh.report(finding, detail);
        }
        believed
    }

    /// The nemesis's residue check: a key nothing has touched for the residue bound (no
    /// acquisition of it running, no guard of it believed, no op on its slots, at this
    /// check or the one before) must have nothing left in the store.
    async fn residue(&mut self, before: &HashSet<GuardId>, after: &HashSet<GuardId>) {
        let Some(activity) = self.activity.as_mut() else {
            return;
        };
        let now = Instant::now();
        let running: HashSet<usize> = self
            .pending
            .iter()
            .filter(|(_, task)| !task.is_finished())
            .map(|(&slot, _)| slot)
            .collect();
        let believed: HashSet<usize> = {
            let sh = self.shared.lock().unwrap();
            before
                .union(after)
                .filter_map(|&(slot, i)| {
                    let g = sh.held.get(&slot)?.holding.guards().get(i)?;
                    self.fx.keys().iter().position(|k| k == g.key())
                })
                .collect()
        };
        let mut active = std::mem::take(&mut activity.touched);
        for slot in running.union(&activity.running) {
            active.extend(self.slot_keys.get(slot).into_iter().flatten().copied());
        }
        active.extend(believed.union(&activity.believed).copied());
        for &k in &active {
            activity.last[k] = now;
        }
        activity.running = running;
        activity.believed = believed;
        let overdue: Vec<usize> = (0..self.fx.keys().len())
            .filter(|&k| now.saturating_duration_since(activity.last[k]) > activity.bound)
            .collect();
        if overdue.is_empty() {
            return;
        }
        let (bound, last) = (activity.bound, activity.last.clone());
        let Some(left) = self.fx.residue().await else {
            return;
        };
        let mut sh = self.shared.lock().unwrap();
        for k in overdue {
            if !left[k].is_empty() {
                let detail = format!(
                    "k{k}: nothing touched it for {:?} (bound {bound:?}), and the store keeps {}",
                    now - last[k],
                    left[k]
                        .iter()
                        .map(|l| name_owners(&sh.names, l))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                sh.report(Finding::ResidueAfterLastGuard, detail);
            }
        }
    }

    /// Check 4: abort what is pending, unlock everything, settle, then the store must
    /// drain.
    async fn finish(&mut self, step: usize) {
        {
            let mut sh = self.shared.lock().unwrap();
            sh.step = step;
            sh.trace
                .push(format!("#{step:<3} end: abort, unlock everything, settle"));
        }
        self.spin.step();
        if let Some(nemesis) = self.fx.nemesis() {
            nemesis.calm();
        }
        self.fx.accept_writes().await;
        for task in self.pending.values() {
            task.abort();
        }
        for (slot, task) in std::mem::take(&mut self.pending) {
            if let Err(e) = task.await
                && e.is_panic()
            {
                self.log(format!("    s{slot}'s task panicked"));
            }
        }
        let slots: Vec<usize> = self.shared.lock().unwrap().held.keys().copied().collect();
        for slot in slots {
            self.unlock(slot).await;
        }
        // Short-lived runtimes end by themselves, soon.
        for thread in std::mem::take(&mut self.threads) {
            while !thread.is_finished() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            if thread.join().is_err() {
                self.log("    a short-lived runtime's thread panicked".to_owned());
            }
        }
        for _ in 0..3 {
            for _ in 0..5 {
                tokio::task::yield_now().await;
            }
            self.fx.settle().await;
        }
        self.spin.step();
        let drained = self.fx.drained().await;
        self.livelock();
        if let Err((finding, detail)) = drained {
            self.shared.lock().unwrap().report(finding, detail);
        }
    }
}

/// Puts what an acquisition got into its slot, in the trace, and judges its errors.
fn settle_attempt(sh: &mut Shared, slot: usize, attempt: Attempt) {
    let line = match attempt {
        Attempt::Got(holding) => {
            let guards: Vec<String> = holding
                .guards()
                .iter()
                .enumerate()
                .map(|(i, g)| sh.names.guard((slot, i), g))
                .collect();
            let n = holding.guards().len();
            sh.held.insert(
                slot,
                Held {
                    holding,
                    seen_lost: vec![false; n],
                },
            );
            format!("    acquired {}", guards.join(" + "))
        }
        Attempt::Twins(guards, errors) => {
            let mut parts: Vec<String> = guards
                .iter()
                .enumerate()
                .map(|(i, g)| format!("acquired {}", sh.names.guard((slot, i), g)))
                .collect();
            for e in &errors {
                parts.push(judge_acquire_error(sh, slot, e));
            }
            if !guards.is_empty() {
                let n = guards.len();
                sh.held.insert(
                    slot,
                    Held {
                        holding: Holding::Twin(guards),
                        seen_lost: vec![false; n],
                    },
                );
            }
            format!("    twins: {}", parts.join("; "))
        }
        Attempt::Failed(e) => format!("    {}", judge_acquire_error(sh, slot, &e)),
        Attempt::GaveUp => format!("    s{slot} lock() timed out"),
        Attempt::Cancelled => format!("    s{slot} cancelled"),
        Attempt::Panicked(message) => {
            sh.report(
                Finding::Panicked,
                format!("acquisition of s{slot} panicked: {message}"),
            );
            format!("    s{slot} panicked: {message}")
        }
    };
    sh.trace.push(line);
}

/// Describes a failed acquisition and reports it unless it is allowed.
fn judge_acquire_error(sh: &mut Shared, slot: usize, e: &Error) -> String {
    if let Error::Busy { .. } = e {
        return format!("s{slot} busy");
    }
    if sh.allows(e, true) {
        return format!("s{slot} failed (allowed under the nemesis): {e}");
    }
    // A re-entry of a hold with a fixed lease renews it first; a renewal that reaches
    // the store after that lease ran out (a slow round trip on a loaded machine) finds
    // the hold gone, and the re-entry reports `Lost`, the held guard now lost with it.
    if matches!(e, Error::Lost) && (a_fixed_lease_guard_is_lost(sh) || sh.reentries.contains(&slot))
    {
        return format!("s{slot} lost: it re-entered a hold whose lease ran out");
    }
    sh.report(
        Finding::UnexpectedError,
        format!("acquisition of s{slot}: {e}"),
    );
    format!("s{slot} failed: {e}")
}

/// Whether a held guard with a fixed lease (not renewed by the watchdog) is lost.
fn a_fixed_lease_guard_is_lost(sh: &Shared) -> bool {
    sh.held
        .values()
        .flat_map(|held| held.holding.guards())
        .any(|g| !g.is_watched() && g.is_lost())
}

/// `line` with every hold identity in it named as the trace names owners.
fn name_owners(names: &Names, line: &str) -> String {
    line.split(' ')
        .map(|word| names.owner(word))
        .collect::<Vec<_>>()
        .join(" ")
}

/// Runs `body` on a current-thread runtime of its own thread, which shuts down `lives`
/// after it started (dropping `body` if it is still running). Returns a task of the
/// calling runtime that ends when that runtime has (aborting it aborts `body`), and the
/// thread.
fn spawn_short_lived(
    body: impl Future<Output = ()> + Send + 'static,
    lives: Duration,
) -> (JoinHandle<()>, std::thread::JoinHandle<()>) {
    /// Aborts the task on the short-lived runtime when the calling runtime's task goes.
    struct AbortOnDrop(Option<tokio::task::AbortHandle>);
    impl Drop for AbortOnDrop {
        fn drop(&mut self) {
            if let Some(handle) = &self.0 {
                handle.abort();
            }
        }
    }
    let (started, started_rx) = tokio::sync::oneshot::channel();
    let (ended, ended_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::spawn(move || {
        let Ok(runtime) = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        else {
            return;
        };
        runtime.block_on(async move {
            let task = tokio::spawn(body);
            let _ = started.send(task.abort_handle());
            tokio::time::sleep(lives).await;
        });
        // Shuts down: the acquisition, if still running, is dropped here, and the tasks
        // this runtime runs for its guards (releases, renewals) with it.
        drop(runtime);
        let _ = ended.send(());
    });
    let task = tokio::spawn(async move {
        let _abort = AbortOnDrop(started_rx.await.ok());
        let _ = ended_rx.await;
    });
    (task, thread)
}

/// Builds the acquisition future: one lock or a MultiLock, as `owner` (if any), with
/// `call`.
fn acquire(
    mut locks: Vec<Lock>,
    owner: Option<(Owner, Via)>,
    call: Call,
) -> Pin<Box<dyn Future<Output = Attempt> + Send>> {
    let scope = match &owner {
        Some((o, Via::Scope)) => Some(o.clone()),
        _ => None,
    };
    let explicit = match owner {
        Some((o, Via::WithOwner)) => Some(o),
        _ => None,
    };
    let fut: Pin<Box<dyn Future<Output = Attempt> + Send>> = if locks.len() == 1 {
        let mut lock = locks.pop().unwrap();
        if let Some(o) = explicit {
            lock = lock.with_owner(o);
        }
        Box::pin(async move {
            let result = match call {
                Call::TryLock => lock.try_lock().await,
                Call::TryLockFor { wait_ms, lease_ms } => {
                    lock.try_lock_for(Duration::from_millis(wait_ms), lease(lease_ms))
                        .await
                }
                Call::Lock { timeout_ms } => {
                    match tokio::time::timeout(Duration::from_millis(timeout_ms), lock.lock()).await
                    {
                        Ok(r) => r,
                        Err(_) => return Attempt::GaveUp,
                    }
                }
                Call::Twin { first, second } => {
                    let (a, b) = tokio::join!(
                        lock.try_lock_for(Duration::ZERO, lease(first)),
                        lock.try_lock_for(Duration::ZERO, lease(second))
                    );
                    let (mut guards, mut errors) = (Vec::new(), Vec::new());
                    for r in [a, b] {
                        match r {
                            Ok(g) => guards.push(g),
                            Err(e) => errors.push(e),
                        }
                    }
                    return Attempt::Twins(guards, errors);
                }
            };
            match result {
                Ok(g) => Attempt::Got(Holding::One(g)),
                Err(e) => Attempt::Failed(e),
            }
        })
    } else {
        let mut multi = MultiLock::new(locks);
        if let Some(o) = explicit {
            multi = multi.with_owner(o);
        }
        Box::pin(async move {
            let result = match call {
                Call::TryLock => multi.try_lock().await,
                Call::TryLockFor { wait_ms, lease_ms } => {
                    multi
                        .try_lock_for(Duration::from_millis(wait_ms), lease(lease_ms))
                        .await
                }
                Call::Lock { timeout_ms } => {
                    match tokio::time::timeout(Duration::from_millis(timeout_ms), multi.lock())
                        .await
                    {
                        Ok(r) => r,
                        Err(_) => return Attempt::GaveUp,
                    }
                }
                Call::Twin { .. } => unreachable!("twins are drawn for single keys only"),
            };
            match result {
                Ok(m) => Attempt::Got(Holding::Multi(m)),
                Err(e) => Attempt::Failed(e),
            }
        })
    };
    match scope {
        Some(o) => Box::pin(o.scope(fut)),
        None => fut,
    }
}

fn lease(ms: Option<u64>) -> Lease {
    ms.map_or(Lease::Watchdog, |ms| {
        Lease::Fixed(Duration::from_millis(ms))
    })
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Family {
    Sole,
    ReadWrite,
    Permits,
}

fn family(mode: LockMode) -> Family {
    match mode {
        LockMode::Exclusive | LockMode::Fair => Family::Sole,
        LockMode::Read | LockMode::Write => Family::ReadWrite,
        _ => Family::Permits,
    }
}

/// Check 1 for one key: the rules over its believed holders (`guards` may name one
/// holder several times: re-entries). A breach among holds of one owner only (an owner
/// let in again in an incompatible mode) is [`Finding::OneOwnerTwoModes`]. With
/// `permits_apart` ([`Fixture::permits_apart`]), the key's permits are judged apart from
/// its other holders.
fn exclusion(
    key: &str,
    guards: &[(Holder, String)],
    permits_apart: bool,
) -> Vec<(Finding, String)> {
    if permits_apart {
        let (permits, others): (Vec<_>, Vec<_>) = guards
            .iter()
            .cloned()
            .partition(|((_, m, _), _)| family(*m) == Family::Permits);
        let mut breaches = exclusion(key, &permits, false);
        breaches.extend(exclusion(key, &others, false));
        return breaches;
    }
    let mut holders: Vec<&Holder> = Vec::new();
    for (h, _) in guards {
        if !holders.contains(&h) {
            holders.push(h);
        }
    }
    // Each breach: the rule, the holders involved, what is wrong.
    let mut breaches: Vec<(Finding, Vec<&Holder>, String)> = Vec::new();
    let sole: Vec<&Holder> = holders
        .iter()
        .copied()
        .filter(|(_, m, _)| family(*m) == Family::Sole)
        .collect();
    if sole.len() > 1 {
        let what = format!("{} exclusive/fair holders", sole.len());
        breaches.push((Finding::TwoSoleHolders, sole, what));
    }
    let mut families: Vec<Family> = holders.iter().map(|(_, m, _)| family(*m)).collect();
    families.sort_by_key(|f| *f as u8);
    families.dedup();
    if families.len() > 1 {
        let what = format!("families {families:?} at once");
        breaches.push((Finding::FamiliesMixed, holders.clone(), what));
    }
    // A writer tolerates only its own (logical) owner's reads.
    for &writer in holders.iter().filter(|(_, m, _)| *m == LockMode::Write) {
        let others: Vec<&Holder> = holders
            .iter()
            .copied()
            .filter(|h| *h != writer && !(h.1 == LockMode::Read && h.2 == writer.2))
            .collect();
        if !others.is_empty() {
            let involved = std::iter::once(writer).chain(others).collect();
            breaches.push((
                Finding::WriterNotAlone,
                involved,
                "a writer with other holders".to_owned(),
            ));
            break;
        }
    }
    let permits: Vec<&Holder> = holders
        .iter()
        .copied()
        .filter(|(_, m, _)| family(*m) == Family::Permits)
        .collect();
    if permits.len() > PERMITS as usize {
        let what = format!("{} permit holders of {PERMITS}", permits.len());
        breaches.push((Finding::TooManyPermits, permits, what));
    }
    breaches
        .into_iter()
        .map(|(finding, involved, what)| {
            let one_owner = involved.iter().all(|h| h.2 == involved[0].2);
            let finding = if one_owner {
                Finding::OneOwnerTwoModes
            } else {
                finding
            };
            let shown: Vec<&str> = guards
                .iter()
                .filter(|(h, _)| involved.contains(&h))
                .map(|(_, g)| g.as_str())
                .collect();
            (finding, format!("{key}: {what}: {}", shown.join("; ")))
        })
        .collect()
}

// ───────────────────────────── the campaign: search, shrink, report ─────────────────────────────

/// The environment knobs: `HISTORY_SEED` (run exactly that seed), `HISTORY_COUNT`
/// (how many seeds), `HISTORY_FROM` (the first of them, default 0: seeds
/// `from..from + count`, so a campaign can go past the suite's own), `HISTORY_LEN` (ops per history), `HISTORY_TRACE` (set: print
/// every run's history and trace, failing or not).
#[derive(Clone, Debug)]
pub struct Knobs {
    pub seed: Option<u64>,
    pub from: u64,
    pub count: u64,
    pub len: usize,
    pub trace: bool,
}

impl Knobs {
    pub fn from_env(default_count: u64, default_len: usize) -> Knobs {
        fn var<T: std::str::FromStr>(name: &str) -> Option<T> {
            let raw = std::env::var(name).ok()?;
            let raw = raw.trim();
            let parsed = match raw.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok().map(|v| v.to_string()),
                None => Some(raw.to_owned()),
            };
            Some(
                parsed
                    .and_then(|s| s.parse().ok())
                    .unwrap_or_else(|| panic!("{name}={raw} is not a number")),
            )
        }
        Knobs {
            seed: var("HISTORY_SEED"),
            from: var("HISTORY_FROM").unwrap_or(0),
            count: var("HISTORY_COUNT").unwrap_or(default_count),
            len: var("HISTORY_LEN").unwrap_or(default_len),
            trace: std::env::var_os("HISTORY_TRACE").is_some(),
        }
    }

    fn seeds(&self) -> Vec<u64> {
        match self.seed {
            Some(seed) => vec![seed],
            None => (self.from..self.from.saturating_add(self.count)).collect(),
        }
    }
}

/// How many failing seeds of each finding are shrunk (exact replays), or tried until one
/// fails again (a real store).
const SHRINK_SEEDS: usize = 5;

/// How a history test runs its histories.
pub struct Campaign {
    /// The backend's name, for the report.
    pub name: &'static str,
    pub knobs: Knobs,
    pub timing: Timing,
    /// Worker threads; each runs one history at a time.
    pub workers: usize,
    /// Replays are exact (paused clock): shrink fully, and check the replay.
    pub exact: bool,
    /// Time allowed for shrinking, all findings together (shared out evenly).
    pub shrink_budget: Duration,
    /// The command that reruns one seed, for the report (`HISTORY_SEED=<seed>` is put in
    /// front).
    pub rerun: &'static str,
}

/// Runs every seed, then shrinks and reports each kind of finding; panics if there are
/// any. `worker` makes a runner per thread: a function that runs one history on a fresh
/// store (and its own runtime) and returns what happened.
pub fn campaign<W, M>(c: Campaign, worker: M)
where
    M: Fn() -> W + Sync,
    W: FnMut(&History) -> Outcome,
{
    let started = StdInstant::now();
    let seeds = c.knobs.seeds();
    let next = AtomicUsize::new(0);
    let failures: Mutex<Vec<(u64, Outcome)>> = Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..c.workers.max(1) {
            s.spawn(|| {
                let mut run = worker();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(&seed) = seeds.get(i) else { break };
                    let history = History::generate(seed, c.knobs.len, &c.timing);
                    let outcome = run_caught(&mut run, &history);
                    if c.knobs.trace {
                        eprintln!("{history}trace:\n  {}\n", outcome.trace.join("\n  "));
                    }
                    if !outcome.violations.is_empty() {
                        failures.lock().unwrap().push((seed, outcome));
                    }
                }
            });
        }
    });
    let searched = started.elapsed();
    let mut failures = failures.into_inner().unwrap();
    failures.sort_by_key(|(seed, _)| *seed);
    eprintln!(
        "history checker ({}): {} histories of {} ops in {:.1?}; {} broke the oracle",
        c.name,
        seeds.len(),
        c.knobs.len,
        searched,
        failures.len()
    );
    if failures.is_empty() {
        return;
    }

    // Per kind of finding: the seeds that showed it.
    let mut by_finding: BTreeMap<Finding, Vec<u64>> = BTreeMap::new();
    for (seed, outcome) in &failures {
        for v in &outcome.violations {
            by_finding.entry(v.finding).or_default().push(*seed);
        }
    }
    let mut run = worker();
    let mut reports: Vec<(usize, String)> = Vec::new();
    let shrinking = StdInstant::now();
    for (done, (finding, seeds_with)) in by_finding.iter().enumerate() {
        // An even share of the budget left. With exact replays, shrink the first few
        // seeds that showed it and keep the shortest result; on a real store, go through
        // them until one fails again on replay.
        let left = c.shrink_budget.saturating_sub(shrinking.elapsed());
        let share_ends = StdInstant::now() + left / (by_finding.len() - done) as u32;
        let tries = SHRINK_SEEDS.min(seeds_with.len());
        let mut best: Option<(u64, History, History, Option<Outcome>, usize)> = None;
        for (i, &seed) in seeds_with.iter().take(tries).enumerate() {
            let share_left = share_ends.saturating_duration_since(StdInstant::now());
            let budget = if c.exact {
                share_left / (tries - i) as u32
            } else {
                share_left
            };
            let original = History::generate(seed, c.knobs.len, &c.timing);
            let (small, outcome, replays) = shrink(&mut run, &original, *finding, budget);
            let reproduced = outcome.is_some();
            let better = match &best {
                None => true,
                Some((_, _, b, b_outcome, _)) => {
                    reproduced && (b_outcome.is_none() || small.ops.len() < b.ops.len())
                }
            };
            if better {
                best = Some((seed, original, small, outcome, replays));
            }
            if !c.exact && reproduced || StdInstant::now() >= share_ends {
                break;
            }
        }
        let (seed, original, small, outcome, replays) = best.unwrap();
        let mut text = String::new();
        let _ = writeln!(
            text,
            "── {finding:?}: {} ── seen in {} of {} histories; shortest from seed {seed}",
            finding.describe(),
            seeds_with.len(),
            seeds.len()
        );
        let _ = writeln!(text, "rerun that seed: HISTORY_SEED={seed} {}", c.rerun);
        if !c.exact {
            let _ = writeln!(text, "the full failing history:\n{original}");
        }
        match &outcome {
            Some(outcome) => {
                let v = outcome.find(*finding).unwrap();
                let _ = writeln!(
                    text,
                    "minimized from {} to {} ops ({replays} replays):\n{small}",
                    original.ops.len(),
                    small.ops.len()
                );
                let _ = writeln!(text, "trace of its replay:");
                for line in &outcome.trace {
                    let _ = writeln!(text, "  {line}");
                }
                let _ = writeln!(text, "violation after #{}: {}", v.step, v.detail);
                if c.exact {
                    // A second replay must do exactly the same (one runtime per run,
                    // paused clock).
                    let again = run_caught(&mut run, &small);
                    if again.trace != outcome.trace {
                        let _ =
                            writeln!(text, "NOTE: a second replay differed (not deterministic)");
                    }
                }
                reports.push((small.ops.len(), text));
            }
            None => {
                let first = failures.iter().find(|(s, _)| *s == seed).unwrap();
                let v = first.1.find(*finding).unwrap();
                let _ = writeln!(
                    text,
                    "(did not fail again on replay: not shrunk)\nviolation after #{}: {}",
                    v.step, v.detail
                );
                reports.push((original.ops.len(), text));
            }
        }
    }
    reports.sort_by_key(|(len, _)| *len);
    let mut message = format!(
        "history checker ({}): {} of {} histories broke the oracle; {} kinds of finding \
         (shortest minimized history first)\n\n",
        c.name,
        failures.len(),
        seeds.len(),
        reports.len()
    );
    for (_, text) in &reports {
        message.push_str(text);
        message.push('\n');
    }
    panic!("{message}");
}

/// Runs one history; a panic out of the run (the driver, the fixture) is a
/// [`Finding::Panicked`] of its own, not the end of the campaign.
fn run_caught<W: FnMut(&History) -> Outcome>(run: &mut W, history: &History) -> Outcome {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(history))).unwrap_or_else(
        |payload| {
            let detail = format!("the run panicked: {}", panic_message(payload.as_ref()));
            Outcome {
                violations: vec![Violation {
                    finding: Finding::Panicked,
                    step: history.ops.len(),
                    detail: detail.clone(),
                }],
                trace: vec![detail],
            }
        },
    )
}

/// Shrinks `original` (which showed `finding`): the shortest failing prefix first, then
/// deletions while it still shows `finding` — whole slots (an acquisition and every op
/// naming its slot), then single ops — repeated until none works or `budget` is spent.
/// Every accepted deletion also cuts the history after the step that showed the finding.
/// Returns the smallest history that failed, its outcome (`None` if even the original
/// did not fail again) and the number of replays.
fn shrink<W: FnMut(&History) -> Outcome>(
    run: &mut W,
    original: &History,
    finding: Finding,
    budget: Duration,
) -> (History, Option<Outcome>, usize) {
    let started = StdInstant::now();
    let mut replays = 0;
    let mut fails = |h: &History, replays: &mut usize| -> Option<Outcome> {
        *replays += 1;
        let outcome = run_caught(run, h);
        outcome.find(finding).is_some().then_some(outcome)
    };
    // The prefix up to the step that showed it (the end check: the whole history).
    let cut = |h: &History, o: &Outcome| -> History {
        let step = o.find(finding).unwrap().step;
        h.with_ops(h.ops[..(step + 1).min(h.ops.len())].to_vec())
    };
    let Some(mut outcome) = fails(original, &mut replays) else {
        return (original.clone(), None, replays);
    };
    let mut best = cut(original, &outcome);
    if best.ops.len() < original.ops.len() {
        match fails(&best, &mut replays) {
            Some(o) => outcome = o,
            None => best = original.clone(),
        }
    }
    // Until nothing more can be deleted, or the budget is spent.
    loop {
        let mut changed = false;
        // Whole slots first: an acquisition with every op that names its slot.
        let mut slots: Vec<usize> = best.ops.iter().filter_map(Op::slot).collect();
        slots.sort_unstable();
        slots.dedup();
        for slot in slots.into_iter().rev() {
            if started.elapsed() > budget {
                return (best, Some(outcome), replays);
            }
            let ops: Vec<Op> = best
                .ops
                .iter()
                .filter(|op| op.slot() != Some(slot))
                .cloned()
                .collect();
            if ops.len() == best.ops.len() {
                continue;
            }
            let candidate = best.with_ops(ops);
            if let Some(o) = fails(&candidate, &mut replays) {
                best = cut(&candidate, &o);
                outcome = o;
                changed = true;
            }
        }
        // Then single ops.
        let mut i = best.ops.len();
        while i > 0 {
            i -= 1;
            if started.elapsed() > budget {
                return (best, Some(outcome), replays);
            }
            let mut ops = best.ops.clone();
            ops.remove(i);
            let candidate = best.with_ops(ops);
            if let Some(o) = fails(&candidate, &mut replays) {
                best = cut(&candidate, &o);
                outcome = o;
                changed = true;
                i = i.min(best.ops.len());
            }
        }
        if !changed {
            break;
        }
    }
    // The trace of the smallest must be of the smallest (a cut may have shortened it).
    if let Some(o) = fails(&best, &mut replays) {
        outcome = o;
    }
    (best, Some(outcome), replays)
}
