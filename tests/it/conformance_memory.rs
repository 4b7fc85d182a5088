//! The conformance suite against the in-memory backend, on a paused clock.

use std::time::Duration;

use tower_lock::backend::LockMode;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::testing::Fixture;
use tower_lock::{LockClient, LockKey, MemoryBackend};

struct Memory(MemoryBackend);

impl Fixture for Memory {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        LockClient::builder(self.0.clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn sabotage(&self, key: &LockKey) {
        assert!(
            self.0
                .force_release(key, LockMode::Exclusive)
                .await
                .unwrap()
        );
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.0.waiters(key)
    }

    async fn residue(&self, key: &LockKey) -> bool {
        self.0.contains_key(key)
    }
}

tower_lock::testing::conformance_tests!(paused: async { Memory(MemoryBackend::new()) });

/// The `ReplayStore` cases, on the memory backend's records.
mod replay {
    use super::*;

    tower_lock::testing::replay_conformance_tests!(paused: async { Memory(MemoryBackend::new()) });
}
