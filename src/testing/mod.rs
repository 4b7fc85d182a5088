//! The backend conformance suite: the cases every [`LockBackend`](crate::backend::LockBackend)
//! must pass, for the built-in backends and for yours (as tower ships `tower-test`).
//!
//! Behind the `testing` feature, for your tests only:
//!
//! ```toml
//! [dev-dependencies]
//! tower-lock = { git = "https://github.com/tower-lock/tower-lock", features = ["testing"] }
//! ```
//!
//! The cases drive the backend the way an application does — through
//! [`LockClient`]s, several at once as several replicas would be —
//! and check mutual exclusion, reentrancy, leases and the watchdog, the lost signal,
//! fencing tokens, wake-ups, what a dropped waiter or guard leaves behind, MultiLock, the
//! in-process line-up, and inspection. The built-in backends run exactly this
//! (`tests/it/conformance_*.rs` in the repository).
//!
//! # Example
//!
//! A [`Fixture`] says how to reach your store and how to look inside it; one
//! [`conformance_tests!`] call then makes a test of every case. Put it in a test file
//! (or module) of its own: the tests are named after the cases.
//!
//! ```
//! // tests/conformance.rs
//! use std::time::Duration;
//!
//! use tower_lock::backend::StoreAdmin;
//! use tower_lock::testing::Fixture;
//! use tower_lock::{LockClient, LockKey, LockMode, MemoryBackend};
//!
//! /// The store under test; `MemoryBackend` stands in for yours.
//! struct MyStore(MemoryBackend);
//!
//! impl Fixture for MyStore {
//!     fn client(&self, watchdog_lease: Duration) -> LockClient {
//!         LockClient::builder(self.0.clone())
//!             .watchdog_lease(watchdog_lease)
//!             .build()
//!             .unwrap()
//!     }
//!
//!     async fn sabotage(&self, key: &LockKey) {
//!         assert!(self.0.force_release(key, LockMode::Exclusive).await.unwrap());
//!     }
//!
//!     async fn waiters(&self, key: &LockKey) -> usize {
//!         self.0.waiters(key)
//!     }
//!
//!     async fn residue(&self, key: &LockKey) -> bool {
//!         self.0.contains_key(key)
//!     }
//! }
//!
//! // A fresh fixture per test, from an async expression. `paused:` runs each case on
//! // a paused clock (`tokio::time::pause`): right for a store in this process, whose
//! // leases run on tokio time. A store behind a network runs in real time:
//! // `conformance_tests!(MyStore::connect())`.
//! tower_lock::testing::conformance_tests!(paused: async { MyStore(MemoryBackend::new()) });
//! # fn main() {}
//! ```
//!
//! Each case is also an `async fn` in [`cases`], to run by hand; [`run_all`] runs every
//! case in turn against one fixture, for a store too costly to set up per case.
//!
//! A store that keeps records for replay ([`ReplayStore`](crate::backend::ReplayStore),
//! for the `IdempotencyLayer`) has cases of its own in [`replay`], made into tests by
//! [`replay_conformance_tests!`] with the same fixture (or run by
//! [`run_all_replays`]).
//!
//! # Errors
//!
//! A case that finds the backend wrong panics with a message that says what it saw, as
//! a test does.
//!
//! # Cancel safety
//!
//! Not a concern here: each case runs to its end on a runtime of its own.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use crate::{Lease, LockClient, LockGuard, LockKey};

pub mod cases;
pub mod replay;

#[doc(inline)]
pub use crate::__conformance_tests as conformance_tests;
#[doc(inline)]
pub use crate::__replay_conformance_tests as replay_conformance_tests;

/// A backend under test: how the cases reach the store, and look inside it.
///
/// Every case makes its own clients with [`client`](Fixture::client) and locks keys
/// named `conformance:<case>...`, so cases may share one store.
pub trait Fixture: Send + Sync {
    /// A new client — a new identity, as another replica would have — on the shared
    /// store, with this watchdog lease.
    fn client(&self, watchdog_lease: Duration) -> LockClient;

    /// Removes the exclusive lock at `key` behind its holder's back, the way an operator
    /// or an expired-then-retaken lease would, without going through the holder's
    /// client (`force_release(key, LockMode::Exclusive)` on a backend of its own does).
    fn sabotage(&self, key: &LockKey) -> impl Future<Output = ()> + Send;

    /// Waiters (subscriptions) this process has registered for `key`, over every
    /// backend instance the fixture's clients use.
    fn waiters(&self, key: &LockKey) -> impl Future<Output = usize> + Send;

    /// Whether the store still keeps any state for `key`: a hold, a queue entry, a
    /// waiter (apart from durable fencing counters, which must outlive holders).
    fn residue(&self, key: &LockKey) -> impl Future<Output = bool> + Send;

    /// Whether a waiter in this process is always served before a new local acquirer.
    /// True for single stores (the default). A quorum of stores can't promise it: a
    /// waiter woken by the first node's release may meet a split vote and back off
    /// while the others are still being released.
    fn local_order_is_strict(&self) -> bool {
        true
    }

    /// Iterations per task in [`cases::mutual_exclusion`]: 500 (the default), fewer
    /// for a store where every contended cycle costs many round trips (RedLock over
    /// real servers), whose exclusion is also checked elsewhere.
    fn contention_iters(&self) -> u64 {
        500
    }
}

/// Calls `$callback!($($args)* case, case, ...)` with every conformance case: the one
/// list of cases.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_cases {
    ([$($callback:tt)*] ($($args:tt)*)) => {
        $($callback)*!($($args)*
            mutual_exclusion,
            reentrancy,
            foreign_owner_cannot_release_or_renew,
            lease_expiry_frees_leaked_guard,
            watchdog_keeps_lock,
            lost_signal_fires,
            try_lock_for_gives_up_on_time,
            fencing_tokens_increase,
            release_wakes_waiter,
            dropped_waiter_leaves_nothing,
            dropped_guard_releases,
            bad_input_is_rejected,
            multi_lock_all_or_nothing,
            multi_lock_orders_keys,
            multi_lock_unlock_reports_loss,
            no_barging_past_local_waiters,
            leaving_waiter_passes_its_turn,
            multi_lock_fixed_lease_outlasts_the_wait,
            reentry_never_shortens_the_lease,
            a_shorter_renewal_never_shortens_the_lease,
            concurrent_acquisitions_by_one_owner_share_one_hold,
            inspection_shows_holders_tokens_and_waiters,
            shutdown_leaves_nothing,
        );
    };
}

/// Makes a test of every conformance case, each on a fresh fixture from an async
/// expression: `conformance_tests!(paused: <fixture>)` on a paused clock (a store in
/// this process), `conformance_tests!(<fixture>)` in real time on a four-thread
/// runtime (a store behind a network). See the [module docs](crate::testing).
///
/// The tests are named after the [`cases`](crate::testing::cases), so call it once per
/// test file or module.
#[doc(hidden)]
#[macro_export]
macro_rules! __conformance_tests {
    (paused: $fixture:expr) => {
        $crate::__conformance_cases!([$crate::__conformance_tests] (@tests cases, true, $fixture;));
    };
    ($fixture:expr) => {
        $crate::__conformance_cases!([$crate::__conformance_tests] (@tests cases, false, $fixture;));
    };
    (@tests $module:ident, $paused:literal, $fixture:expr; $($case:ident),* $(,)?) => {
        $(
            #[test]
            fn $case() {
                $crate::testing::__run($paused, async {
                    let fixture = $fixture.await;
                    $crate::testing::$module::$case(&fixture).await;
                });
            }
        )*
    };
}

/// Calls `$callback!($($args)* case, case, ...)` with every [`ReplayStore`] conformance
/// case (see [`replay`]): the one list of them.
///
/// [`ReplayStore`]: crate::backend::ReplayStore
#[doc(hidden)]
#[macro_export]
macro_rules! __replay_cases {
    ([$($callback:tt)*] ($($args:tt)*)) => {
        $($callback)*!($($args)*
            stored_only_while_held,
            nothing_stored_without_the_lock,
            a_greater_token_is_never_overwritten,
            a_greater_token_replaces_the_record,
            records_expire_with_their_ttl,
            store_and_release_releases_as_release_does,
            records_round_trip_exactly,
            records_live_beside_their_locks,
            other_modes_are_kept_or_refused,
        );
    };
}

/// Makes a test of every [`ReplayStore`] conformance case (see [`replay`]), for a
/// backend that keeps records for replay, as [`conformance_tests!`] does for the lock
/// cases and with the same [`Fixture`]: `replay_conformance_tests!(paused: <fixture>)`
/// on a paused clock, `replay_conformance_tests!(<fixture>)` in real time.
///
/// The tests are named after the cases, which differ from the lock cases' names: one
/// call of each macro fits in one test file or module.
///
/// [`ReplayStore`]: crate::backend::ReplayStore
/// [`replay`]: crate::testing::replay
/// [`conformance_tests!`]: crate::testing::conformance_tests
/// [`Fixture`]: crate::testing::Fixture
#[doc(hidden)]
#[macro_export]
macro_rules! __replay_conformance_tests {
    (paused: $fixture:expr) => {
        $crate::__replay_cases!([$crate::__conformance_tests] (@tests replay, true, $fixture;));
    };
    ($fixture:expr) => {
        $crate::__replay_cases!([$crate::__conformance_tests] (@tests replay, false, $fixture;));
    };
}

macro_rules! define_run_all {
    ($($case:ident),* $(,)?) => {
        /// Runs every conformance case in turn against one fixture, naming each on
        /// stderr as it starts: for a store too costly to set up per case (a cluster).
        /// The cases use keys of their own, so they do not interfere.
        pub async fn run_all(fixture: &impl Fixture) {
            $(
                eprintln!("conformance case {}", stringify!($case));
                cases::$case(fixture).await;
            )*
        }
    };
}

__conformance_cases!([define_run_all]());

macro_rules! define_run_all_replays {
    ($($case:ident),* $(,)?) => {
        /// Runs every [`replay`] case in turn against one fixture, naming each on stderr
        /// as it starts, as [`run_all`] does for the lock cases.
        pub async fn run_all_replays(fixture: &impl Fixture) {
            $(
                eprintln!("replay conformance case {}", stringify!($case));
                replay::$case(fixture).await;
            )*
        }
    };
}

__replay_cases!([define_run_all_replays]());

/// Runs one case as `#[tokio::test]` would: on a current-thread runtime with a paused
/// clock, or on a four-thread one in real time.
#[doc(hidden)]
pub fn __run(paused: bool, case: impl Future<Output = ()>) {
    let runtime = if paused {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
    };
    runtime
        .expect("a tokio runtime for the conformance case")
        .block_on(Box::pin(case));
}

/// Polls `cond` every few milliseconds until it holds or `within` has passed; panics
/// with `what` on timeout. The way to wait for an outcome without sleeping and hoping.
async fn wait_until<F, Fut>(within: Duration, what: &str, mut cond: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if cond().await {
            return;
        }
        if Instant::now() >= deadline {
            panic!("timed out after {within:?} waiting for: {what}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Spawns a waiter for `lock`: `try_lock_for(wait, Lease::Watchdog)`, yielding the
/// moment it acquired and its guard, so a case can bound the wake-up latency.
fn spawn_acquire(
    lock: crate::Lock,
    wait: Duration,
) -> tokio::task::JoinHandle<crate::Result<(Instant, LockGuard)>> {
    tokio::spawn(async move {
        let guard = lock.try_lock_for(wait, Lease::Watchdog).await?;
        Ok((Instant::now(), guard))
    })
}
