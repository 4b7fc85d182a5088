//! The history checker's nemesis: faults in transit and in the store, drawn into a
//! history as ops ([`Fault`]) and applied while the history runs.
//!
//! # What it does
//!
//! A history with a nemesis ([`Timing::nemesis`](super::history::Timing) set) runs its
//! clients' connections through a [`FaultProxy`] to a store of its own, and its
//! generator adds, besides the usual ops:
//!
//! - **[`Fault`] ops**: every write in one direction delivered late for a while (some
//!   delays longer than the backends' response timeout); the next write that names a key
//!   (or the next answer of any kind) held, then delivered after more than a response
//!   timeout, when its client has given up on it and replaced the connection (a resent
//!   packet); every connection cut; new connections refused for a while; the store
//!   killed (SIGKILL) and restarted.
//! - **Concurrent re-entries** ([`Call::Twin`](super::history::Call)): one owner runs two
//!   `try_lock_for(0, lease)` of one key at once, with different leases (fixed or the
//!   watchdog), into one slot.
//! - **Runtimes that end** ([`On::ShortLived`](super::history::On)): an acquisition (a
//!   first one, or a re-entry) runs on a current-thread runtime of its own thread, which
//!   shuts down after a while, with the acquisition still running or its guard still
//!   alive in its slot.
//! - **Relaxed sessions**: some clients' sessions trade durability for speed (PostgreSQL:
//!   `synchronous_commit = off`), as many pools are set up.
//!
//! # What the oracle promises under it
//!
//! The checks of the [history checker](super::history) stay, with these changes:
//!
//! - An acquisition or unlock that fails because the store did not answer
//!   ([`Error::is_unavailable`](tower_lock::Error::is_unavailable)), and a re-entry that
//!   finds its hold gone ([`Error::Lost`](tower_lock::Error::Lost)), is not a finding:
//!   the caller was told. An unlock of a guard seen lost must still say `Lost`.
//! - A store that loses its holds in a crash (Redis without persistence) loses them for
//!   the guards too: what the crate promises then (README, "Safety") is that a guard of
//!   a lost hold stops being believed within its lease — the lost signal fires when the
//!   watchdog finds the hold gone, or when the lease it was last confirmed for ends.
//!   Holds the store had when it was killed (read while every write is paused, just
//!   before the SIGKILL) are *lost with the store*: their guards are left out of
//!   exclusion, fencing and the store's snapshot, and each must be lost one longest
//!   lease after the kill ([`Finding::BelievedAfterStoreLost`](super::history::Finding)).
//!   A store that keeps its holds (PostgreSQL) gets no such allowance.
//! - **No residue one lease after the last guard**: once nothing has touched a key for
//!   [`NemesisTiming::residue_bound`] — no acquisition running, no guard believed — the
//!   store must keep nothing for it (no hold, no queue entry), checked after every step,
//!   not only at the end.
//!
//! # Cleanup
//!
//! [`Nemesis::calm`] ends every fault in force (flows pass, refusals stop, held writes go
//! on); the history's end calls it before it unlocks everything and waits for the store
//! to drain.

use std::fmt;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;

use super::history::Timing;
use super::proxy::{Direction, FaultProxy, Flow};

/// The nemesis's durations and odds (real milliseconds; pairs are inclusive ranges).
#[derive(Clone, Debug)]
pub struct NemesisTiming {
    /// The backends' response timeout: a call unanswered this long fails.
    pub response_timeout_ms: u64,
    /// How late a delayed write is delivered.
    pub delay_ms: (u64, u64),
    /// How long a direction stays delayed.
    pub delay_for_ms: (u64, u64),
    /// How long a trapped write is held, from when it was caught.
    pub trap_hold_ms: (u64, u64),
    /// How long a trap waits for a write to catch before it is disarmed.
    pub trap_armed_ms: u64,
    /// How long new connections are refused.
    pub refuse_for_ms: (u64, u64),
    /// How long a killed store stays down before it restarts.
    pub down_ms: (u64, u64),
    /// How long a short-lived runtime lives.
    pub short_lived_ms: (u64, u64),
    /// Leases of concurrent re-entries (`None`: the watchdog).
    pub twin_leases_ms: &'static [Option<u64>],
    /// How often (percent of steps) a step is a fault.
    pub fault_percent: u8,
    /// How often (percent of acquisitions) one runs on a short-lived runtime.
    pub short_lived_percent: u8,
    /// How often (percent of re-locks) a re-lock is a pair of concurrent re-entries.
    pub twin_percent: u8,
    /// How often (percent per client) a client's sessions are relaxed.
    pub relaxed_percent: u8,
    /// How often (percent of faults) a fault is a store crash.
    pub crash_percent: u8,
    /// How often (percent of the other faults) the store refuses writes for a while
    /// (as long as new connections are refused: `refuse_for_ms`); 0 for a store that
    /// cannot.
    pub refuse_writes_percent: u8,
}

impl NemesisTiming {
    pub fn response_timeout(&self) -> Duration {
        Duration::from_millis(self.response_timeout_ms)
    }

    /// The longest a write can spend in the proxy: a delay, or a trap's hold.
    pub fn longest_in_transit(&self) -> Duration {
        Duration::from_millis(self.delay_ms.1.max(self.trap_hold_ms.1))
    }

    /// How long after a key's last activity (an acquisition running, a guard believed)
    /// the store may still keep something for it: a write of it still in transit, then
    /// a response timeout (an attempt's deadline), then the longest lease it may have
    /// taken or been renewed for and a queue entry's waiter timeout, and a margin for
    /// the store's own expiry.
    pub fn residue_bound(&self, longest_lease: Duration, waiter_timeout: Duration) -> Duration {
        self.longest_in_transit()
            + self.response_timeout()
            + longest_lease
            + waiter_timeout
            + Duration::from_millis(500)
    }
}

/// One fault, as a history op.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every write in `dir`, on every connection, is delivered `by_ms` late, for
    /// `for_ms`.
    Delay {
        dir: Direction,
        by_ms: u64,
        for_ms: u64,
    },
    /// The next write in `dir` that names key `key` (any write when `None`) is held for
    /// `hold_ms`, with what follows it on its connection, then delivered.
    Trap {
        dir: Direction,
        key: Option<u8>,
        hold_ms: u64,
    },
    /// Every connection is reset.
    Cut,
    /// New connections are reset at once, for `for_ms`.
    Refuse { for_ms: u64 },
    /// The store is killed (SIGKILL), stays down `down_ms`, and restarts on its port.
    Crash { down_ms: u64 },
    /// The store answers and refuses every write, for `for_ms`, as a server does that
    /// is short of replicas (`NOREPLICAS`), full (`OOM`) or reading its data back.
    RefuseWrites { for_ms: u64 },
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let dir = |d: Direction| match d {
            Direction::Up => "requests",
            Direction::Down => "answers",
        };
        match *self {
            Fault::Delay {
                dir: d,
                by_ms,
                for_ms,
            } => {
                write!(f, "nemesis: {} {by_ms}ms late for {for_ms}ms", dir(d))
            }
            Fault::Trap {
                dir: d,
                key,
                hold_ms,
            } => write!(
                f,
                "nemesis: hold the next of the {} naming {} for {hold_ms}ms",
                dir(d),
                key.map_or("anything".to_owned(), |k| format!("k{k}"))
            ),
            Fault::Cut => f.write_str("nemesis: cut every connection"),
            Fault::Refuse { for_ms } => write!(f, "nemesis: refuse connections for {for_ms}ms"),
            Fault::Crash { down_ms } => {
                write!(f, "nemesis: kill the store, restart it {down_ms}ms later")
            }
            Fault::RefuseWrites { for_ms } => {
                write!(f, "nemesis: the store refuses writes for {for_ms}ms")
            }
        }
    }
}

impl Fault {
    /// One fault drawn with `t`'s odds and durations, over `keys` keys.
    pub fn draw(rng: &mut fastrand::Rng, t: &NemesisTiming, keys: u8) -> Fault {
        let ms = |rng: &mut fastrand::Rng, (lo, hi): (u64, u64)| rng.u64(lo..=hi);
        let dir = |rng: &mut fastrand::Rng| {
            if rng.bool() {
                Direction::Up
            } else {
                Direction::Down
            }
        };
        if rng.u8(0..100) < t.crash_percent {
            return Fault::Crash {
                down_ms: ms(rng, t.down_ms),
            };
        }
        // Drawn only where the store can (not to change other stores' histories).
        if t.refuse_writes_percent > 0 && rng.u8(0..100) < t.refuse_writes_percent {
            return Fault::RefuseWrites {
                for_ms: ms(rng, t.refuse_for_ms),
            };
        }
        match rng.u8(0..100) {
            0..35 => Fault::Delay {
                dir: dir(rng),
                by_ms: ms(rng, t.delay_ms),
                for_ms: ms(rng, t.delay_for_ms),
            },
            35..75 => {
                let dir = dir(rng);
                // A request names its key; an answer mostly does not (a release
                // message does), so answers are also caught whatever they are.
                let key = if dir == Direction::Up || rng.bool() {
                    Some(rng.u8(0..keys))
                } else {
                    None
                };
                Fault::Trap {
                    dir,
                    key,
                    hold_ms: ms(rng, t.trap_hold_ms),
                }
            }
            75..88 => Fault::Cut,
            _ => Fault::Refuse {
                for_ms: ms(rng, t.refuse_for_ms),
            },
        }
    }
}

/// What a store crash did: when the store was killed, and the hold identities it lost
/// (those it had then; empty for a store that keeps its holds).
#[derive(Clone, Debug)]
pub struct Crashed {
    pub killed_at: tokio::time::Instant,
    pub lost: Vec<String>,
}

/// The proxy of one history and the faults in force on it.
pub struct Nemesis {
    proxy: Arc<FaultProxy>,
    timing: NemesisTiming,
    longest_lease: Duration,
    residue_bound: Duration,
    /// Per key: the bytes that name it on the wire (a trap's pattern).
    patterns: Vec<Vec<u8>>,
    state: Arc<Mutex<InForce>>,
}

/// The faults in force, so that one ending never ends another that came later.
#[derive(Default)]
struct InForce {
    /// Per direction: the number of the last flow set.
    flow_set: [u64; 2],
    /// Refusal windows open.
    refusing: u32,
    /// Tasks that end faults (and hold trapped writes).
    tasks: Vec<JoinHandle<()>>,
}

impl Nemesis {
    /// A nemesis over `proxy` with `timing`'s faults (which must have some);
    /// `patterns[k]` names key `k` on the wire.
    pub fn new(proxy: FaultProxy, timing: &Timing, patterns: Vec<Vec<u8>>) -> Self {
        let nemesis = timing
            .nemesis
            .clone()
            .expect("a nemesis needs its timing (Timing::nemesis)");
        Nemesis {
            proxy: Arc::new(proxy),
            timing: nemesis,
            longest_lease: timing.longest_lease(),
            residue_bound: timing.residue_bound().expect("a nemesis timing"),
            patterns,
            state: Arc::default(),
        }
    }

    /// The longest lease a hold of the history may have.
    pub fn longest_lease(&self) -> Duration {
        self.longest_lease
    }

    /// How long after its last activity a key may still have something in the store.
    pub fn residue_bound(&self) -> Duration {
        self.residue_bound
    }

    pub fn proxy(&self) -> &FaultProxy {
        &self.proxy
    }

    pub fn timing(&self) -> &NemesisTiming {
        &self.timing
    }

    /// Puts a fault of the proxy in force (and schedules its end). A crash is the
    /// store's: see [`Fixture::crash`](super::history::Fixture::crash).
    pub fn apply(&self, fault: &Fault) {
        match *fault {
            Fault::Delay { dir, by_ms, for_ms } => self.delay(dir, by_ms, for_ms),
            Fault::Trap { dir, key, hold_ms } => self.trap(dir, key, hold_ms),
            Fault::Cut => self.proxy.cut(),
            Fault::Refuse { for_ms } => self.refuse(for_ms),
            Fault::Crash { .. } | Fault::RefuseWrites { .. } => {
                unreachable!("the store's faults are the fixture's")
            }
        }
    }

    fn delay(&self, dir: Direction, by_ms: u64, for_ms: u64) {
        let d = dir as usize;
        let mine = {
            let mut state = self.state.lock().unwrap();
            state.flow_set[d] += 1;
            state.flow_set[d]
        };
        self.proxy
            .set_flow(dir, Flow::Delay(Duration::from_millis(by_ms)));
        let proxy = Arc::clone(&self.proxy);
        let state = Arc::clone(&self.state);
        self.spawn(async move {
            tokio::time::sleep(Duration::from_millis(for_ms)).await;
            // Unless a later delay took over the direction.
            if state.lock().unwrap().flow_set[d] == mine {
                proxy.set_flow(dir, Flow::Pass);
            }
        });
    }

    fn trap(&self, dir: Direction, key: Option<u8>, hold_ms: u64) {
        let pattern: &[u8] = match key {
            Some(k) => &self.patterns[usize::from(k)],
            None => b"",
        };
        let trap = self.proxy.trap(dir, pattern);
        let armed = Duration::from_millis(self.timing.trap_armed_ms);
        self.spawn(async move {
            // Nothing caught in time: disarmed (dropped). Caught: held, then released.
            if tokio::time::timeout(armed, trap.caught()).await.is_ok() {
                tokio::time::sleep(Duration::from_millis(hold_ms)).await;
                trap.release();
            }
        });
    }

    fn refuse(&self, for_ms: u64) {
        self.state.lock().unwrap().refusing += 1;
        self.proxy.refuse(true);
        let proxy = Arc::clone(&self.proxy);
        let state = Arc::clone(&self.state);
        self.spawn(async move {
            tokio::time::sleep(Duration::from_millis(for_ms)).await;
            let mut state = state.lock().unwrap();
            state.refusing = state.refusing.saturating_sub(1);
            if state.refusing == 0 {
                proxy.refuse(false);
            }
        });
    }

    /// Ends every fault in force: flows pass, connections are accepted, held writes are
    /// delivered.
    pub fn calm(&self) {
        let mut state = self.state.lock().unwrap();
        for task in state.tasks.drain(..) {
            // A trap's task owns the trap: aborting it releases what it holds.
            task.abort();
        }
        state.flow_set[0] += 1;
        state.flow_set[1] += 1;
        state.refusing = 0;
        self.proxy.set_flow(Direction::Up, Flow::Pass);
        self.proxy.set_flow(Direction::Down, Flow::Pass);
        self.proxy.refuse(false);
    }

    fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut state = self.state.lock().unwrap();
        state.tasks.retain(|t| !t.is_finished());
        state.tasks.push(tokio::spawn(task));
    }
}

impl Drop for Nemesis {
    fn drop(&mut self) {
        self.calm();
    }
}
