//! The lock-kind suite (fair, read-write, permits) against the in-memory backend.

use crate::{common, kind_tests};

use std::time::Duration;

use common::kinds::KindFixture;
use tower_lock::backend::LockMode;
use tower_lock::backend::StoreAdmin as _;
use tower_lock::{LockClient, LockKey, MemoryBackend};

struct Memory(MemoryBackend);

/// A waiter timeout far above every handoff bound in the suite, so a test that passes
/// cannot have been rescued by queued waiters' polling.
const WAITER_TIMEOUT: Duration = Duration::from_secs(30);

async fn fixture() -> Memory {
    Memory(
        MemoryBackend::builder()
            .waiter_timeout(WAITER_TIMEOUT)
            .build()
            .unwrap(),
    )
}

impl KindFixture for Memory {
    fn client(&self, watchdog_lease: Duration) -> LockClient {
        LockClient::builder(self.0.clone())
            .watchdog_lease(watchdog_lease)
            .build()
            .unwrap()
    }

    async fn with_waiter_timeout(&self, timeout: Duration) -> Self {
        // A memory store cannot be shared between two configurations; a fresh one
        // serves the cases that need a short timeout.
        Memory(
            MemoryBackend::builder()
                .waiter_timeout(timeout)
                .build()
                .unwrap(),
        )
    }

    fn waiter_timeout(&self) -> Duration {
        self.0.waiter_timeout()
    }

    async fn sabotage(&self, key: &LockKey, mode: LockMode) {
        assert!(self.0.force_release(key, mode).await.unwrap());
    }

    async fn waiters(&self, key: &LockKey) -> usize {
        self.0.waiters(key)
    }

    async fn queued(&self, key: &LockKey) -> usize {
        self.0.queue_len(key)
    }

    async fn residue(&self, key: &LockKey) -> bool {
        self.0.contains_key(key)
    }
}

kind_tests!(paused: fixture);
