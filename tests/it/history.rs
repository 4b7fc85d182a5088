//! The seeded history checker (`common/history.rs`) against the memory backend, on a
//! paused clock: thousands of random histories, each checked by the oracle after every
//! step, failures shrunk to the shortest history that still fails.
//!
//! # Knobs (environment)
//!
//! | variable | default | meaning |
//! |---|---|---|
//! | `HISTORY_SEED` | – | run exactly this seed (decimal or `0x` hex) |
//! | `HISTORY_COUNT` | 2000 | run seeds `HISTORY_FROM..HISTORY_FROM + HISTORY_COUNT` |
//! | `HISTORY_FROM` | 0 | the first seed (a campaign past the suite's own seeds) |
//! | `HISTORY_LEN` | 40 | ops per history |
//!
//! ```text
//! cargo test --test it history::random_histories
//! HISTORY_SEED=17 cargo test --test it history::random_histories -- --nocapture
//! ```
//!
//! # Output
//!
//! One line on stderr: how many histories of how many ops ran, in how long, and how many
//! broke the oracle. If any did, the test panics with, per kind of finding (see
//! `Finding` in `common/history.rs`; shortest minimized history first):
//!
//! ```text
//! ── <Finding>: <what it means> ── seen in <n> of <count> histories; shortest from seed <seed>
//! rerun that seed: HISTORY_SEED=<seed> cargo test --test it history::random_histories
//! minimized from <len> to <m> ops (<r> replays):
//! history seed=<seed> clients=<c> keys=<k> owners/client=<o> (<m> ops)
//!   #0   s0 <- c1.o0 (scope) k1 exclusive try_lock_for(0ms, 40ms); 0 yields
//!   ...
//! trace of its replay:
//!   #0   <op>
//!       acquired s0 c1.o0 k1 exclusive (token 1, holds 1)
//!       !! <Finding> after #3: <detail>
//!   #4   end: abort, unlock everything, settle
//!       s0 unlock -> Err(Lost)
//! violation after #<step>: <detail>
//! ```
//!
//! Names: `s<n>` is a slot (where an acquisition's guard goes; `s<n>[1]` is a MultiLock's
//! second guard), `c<i>.o<j>` the j-th explicit owner of client i, `c<i>.fresh<n>` an
//! owner the lock made, `k<i>` a key. The first few failing seeds of each kind are
//! shrunk and the shortest result is shown; `HISTORY_SEED` reruns the unshrunk seed.
//! Every run gets a fresh backend, fresh clients and a fresh current-thread runtime with
//! paused time, so a replay is exact: the minimized history is replayed once more and a
//! `NOTE` is printed if it did not do the same.

use crate::common;

use std::time::Duration;

use common::history::{
    Finding, Fixture, History, Knobs, Outcome, StoreHold, StoreMode, StoreView, Timing, campaign,
    run,
};
use tower_lock::{LockClient, LockKey, MemoryBackend};

/// Virtual milliseconds: a 300 ms watchdog lease (renewed every 100 ms), fixed leases of
/// 40–250 ms, and now and then a pause of 310–700 ms, longer than every lease.
const TIMING: Timing = Timing {
    watchdog_lease_ms: 300,
    waiter_timeout_ms: 300,
    fixed_leases_ms: &[40, 100, 250],
    waits_ms: &[0, 5, 30, 120],
    lock_timeout_ms: (20, 400),
    cancel_timeout_ms: (0, 60),
    small_pass_ms: (1, 40),
    big_pass_ms: (310, 700),
    big_pass_percent: 12,
    nemesis: None,
};

/// One history's store: clones of one `MemoryBackend` under 2–3 clients.
struct Memory {
    backend: MemoryBackend,
    clients: Vec<LockClient>,
    keys: Vec<LockKey>,
}

impl Memory {
    fn new(history: &History) -> Self {
        let backend = MemoryBackend::builder()
            .waiter_timeout(TIMING.waiter_timeout())
            .build()
            .unwrap();
        let clients = (0..history.clients)
            .map(|_| {
                LockClient::builder(backend.clone())
                    .watchdog_lease(TIMING.watchdog_lease())
                    .build()
                    .unwrap()
            })
            .collect();
        let keys = (0..history.keys)
            .map(|k| LockKey::new(format!("k{k}")).unwrap())
            .collect();
        Memory {
            backend,
            clients,
            keys,
        }
    }
}

impl Fixture for Memory {
    fn clients(&self) -> &[LockClient] {
        &self.clients
    }

    fn keys(&self) -> &[LockKey] {
        &self.keys
    }

    async fn pass(&self, d: Duration) {
        tokio::time::advance(d).await;
    }

    async fn settle(&self) {
        tokio::time::advance(Duration::ZERO).await;
    }

    async fn view(&self) -> Option<StoreView> {
        let view = self
            .keys
            .iter()
            .map(|k| {
                self.backend
                    .holders(k)
                    .into_iter()
                    .map(|h| StoreHold {
                        owner: h.hold_id.as_str().to_owned(),
                        mode: StoreMode::Exact(h.mode),
                    })
                    .collect()
            })
            .collect();
        Some(view)
    }

    async fn drained(&self) -> Result<(), (Finding, String)> {
        // Every guard was released and the store answers within one poll: nothing may
        // be held any more, even before the leases end.
        let held: Vec<String> = self
            .keys
            .iter()
            .filter_map(|k| {
                let holders = self.backend.holders(k);
                (!holders.is_empty()).then(|| format!("{k}: {holders:?}"))
            })
            .collect();
        if !held.is_empty() {
            return Err((Finding::ResidueAfterRelease, held.join("; ")));
        }
        // Past every lease and the waiter timeout: no hold, no queue entry, no waiter,
        // no entry at all.
        tokio::time::advance(TIMING.beyond_every_lease()).await;
        for _ in 0..5 {
            tokio::task::yield_now().await;
        }
        let left: Vec<String> = self
            .keys
            .iter()
            .filter_map(|k| {
                let (queue, waiters) = (self.backend.queue_len(k), self.backend.waiters(k));
                (queue > 0 || waiters > 0)
                    .then(|| format!("{k}: {queue} queued, {waiters} waiters"))
            })
            .collect();
        if !left.is_empty() || !self.backend.is_empty() {
            return Err((
                Finding::ResidueAfterLeases,
                format!("{} entries left: {}", self.backend.len(), left.join("; ")),
            ));
        }
        Ok(())
    }
}

/// One history on a fresh store, in a fresh current-thread runtime with paused time.
fn run_one(history: &History) -> Outcome {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async {
        let store = Memory::new(history);
        run(&store, history).await
    })
}

#[test]
fn random_histories_keep_the_oracle() {
    let workers = std::thread::available_parallelism().map_or(1, |n| n.get().min(2));
    campaign(
        common::history::Campaign {
            name: "memory",
            knobs: Knobs::from_env(2000, 40),
            timing: TIMING,
            workers,
            exact: true,
            shrink_budget: Duration::from_secs(20),
            rerun: "cargo test --test it history::random_histories",
        },
        || run_one,
    );
}
