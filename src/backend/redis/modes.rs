//! The fair, read-write and permit modes of [`RedisBackend`]: their scripts, the keys and
//! channels each operation passes, and their replies.
//!
//! Layouts (every key and channel in `NAME`'s hash slot; see the module docs of
//! [`redis`](super) and `lua/lib.lua`):
//!
//! - **Fair** — Redisson `RFairLock`: the lock is `RLock`'s hash at `NAME`; waiters queue
//!   in the list `redisson_lock_queue:{NAME}` with their eviction time (server clock, ms)
//!   in the sorted set `redisson_lock_timeout:{NAME}`; the head is woken on its own
//!   channel `redisson_lock__channel:{NAME}:<owner>`.
//! - **Read / write** — Redisson `RReadWriteLock`: one hash at `NAME` with `mode`,
//!   `<owner>` → read holds and `<owner>:write` → write holds; one lease key per read
//!   hold, `{NAME}:<owner>:rwlock_timeout:<i>`; Redisson's `0` / `1` on
//!   `redisson_rwlock:{NAME}` when the lock is free. Blocked readers and writers queue
//!   in the fair lock's queue as `<owner>:read` / `<owner>:write` and are woken on
//!   `redisson_rwlock:{NAME}:<entry>`.
//! - **Permits**: a hash at `NAME` (`holds:<owner>`, `token:<owner>`) and the sorted set
//!   `tower_lock_permits:{NAME}` (owner → lease end); releases wake one waiter on the
//!   lock's channel.

use std::sync::LazyLock;

use redis::Script;

use super::{Names, Publish, RedisBackend, fenced_arg, lease_ms};
use crate::backend::{Acquire, LockMode, LockRequest, Release};
use crate::error::Result;
use crate::key::LockKey;

pub(super) const LIB: &str = include_str!("../../../lua/lib.lua");

pub(super) struct ModeScripts {
    pub(super) fair_acquire: Script,
    pub(super) fair_release: Script,
    pub(super) fair_force_release: Script,
    pub(super) queue_cancel: Script,
    pub(super) rw_acquire: Script,
    pub(super) rw_release: Script,
    pub(super) rw_renew: Script,
    pub(super) rw_force_release: Script,
    pub(super) permits_acquire: Script,
    pub(super) permits_release: Script,
    pub(super) permits_renew: Script,
    pub(super) permits_force_release: Script,
    pub(super) renew_many_modes: Script,
}

impl ModeScripts {
    fn new(publish: Publish) -> Self {
        ModeScripts {
            fair_acquire: publish.with_lib(include_str!("../../../lua/fair_acquire.lua")),
            fair_release: publish.with_lib(include_str!("../../../lua/fair_release.lua")),
            fair_force_release: publish
                .with_lib(include_str!("../../../lua/fair_force_release.lua")),
            queue_cancel: publish.with_lib(include_str!("../../../lua/queue_cancel.lua")),
            rw_acquire: publish.with_lib(include_str!("../../../lua/rw_acquire.lua")),
            rw_release: publish.with_lib(include_str!("../../../lua/rw_release.lua")),
            rw_renew: publish.with_lib(include_str!("../../../lua/rw_renew.lua")),
            rw_force_release: publish.with_lib(include_str!("../../../lua/rw_force_release.lua")),
            permits_acquire: publish.with_lib(include_str!("../../../lua/permits_acquire.lua")),
            permits_release: publish.with_lib(include_str!("../../../lua/permits_release.lua")),
            permits_renew: publish.with_lib(include_str!("../../../lua/permits_renew.lua")),
            permits_force_release: publish
                .with_lib(include_str!("../../../lua/permits_force_release.lua")),
            renew_many_modes: publish.with_lib(include_str!("../../../lua/renew_many_modes.lua")),
        }
    }
}

pub(super) static MODE_SCRIPTS: LazyLock<ModeScripts> =
    LazyLock::new(|| ModeScripts::new(Publish::Classic));
pub(super) static SHARDED_MODE_SCRIPTS: LazyLock<ModeScripts> =
    LazyLock::new(|| ModeScripts::new(Publish::Sharded));

/// `'read'` or `'write'`, as the read-write scripts take it.
fn rw_arg(mode: LockMode) -> &'static str {
    if mode == LockMode::Read {
        "read"
    } else {
        "write"
    }
}

/// The mode tag of a hold in a mixed renewal batch (`renew_many_modes.lua`).
pub(super) fn batch_tag(mode: LockMode) -> &'static str {
    match mode {
        LockMode::Read => "r",
        LockMode::Write => "w",
        LockMode::Permits { .. } => "p",
        _ => "x",
    }
}

/// The second key of a hold in a mixed renewal batch.
pub(super) fn batch_companion(prefix: &str, req: &LockRequest) -> String {
    match req.mode {
        LockMode::Read | LockMode::Write => Names::lease_prefix(prefix, &req.key),
        LockMode::Permits { .. } => Names::permits(prefix, &req.key),
        _ => Names::lock(prefix, &req.key).into_owned(),
    }
}

/// `-1` / `0` / holds left → the outcome.
pub(super) fn parse_release(reply: i64) -> Release {
    match reply {
        -1 => Release::NotHeld,
        0 => Release::Released,
        holds => Release::Decremented {
            holds: u32::try_from(holds).unwrap_or(u32::MAX),
        },
    }
}

impl RedisBackend {
    fn prefix(&self) -> &str {
        &self.inner.prefix
    }

    fn waiter_timeout_ms(&self) -> u64 {
        lease_ms(self.inner.waiter_timeout)
    }

    pub(super) async fn acquire_mode(&self, req: &LockRequest) -> Result<Acquire> {
        if req.mode == LockMode::Exclusive {
            return self.acquire_exclusive(req).await;
        }
        let deadline = self.inner.attempt_deadline().await?;
        let Some(invocation) = self.acquire_script(req, deadline) else {
            return self.acquire_exclusive(req).await;
        };
        self.inner.write_grant(&invocation).await
    }

    /// The script call that acquires `req` in its (queued or permits) mode, refused by
    /// the server after `deadline`; `None` for a mode acquired as an exclusive lock.
    fn acquire_script(
        &self,
        req: &LockRequest,
        deadline: u64,
    ) -> Option<redis::ScriptInvocation<'static>> {
        let p = self.prefix();
        let key = &req.key;
        let lock = Names::lock(p, key);
        let invocation = match req.mode {
            LockMode::Fair => {
                let mut invocation = self
                    .inner
                    .publish
                    .mode_scripts()
                    .fair_acquire
                    .prepare_invoke();
                invocation
                    .key(lock.as_ref())
                    .key(Names::queue(p, key))
                    .key(Names::queue_timeouts(p, key))
                    .key(Names::fence(p, key))
                    .key(Names::channel(p, key))
                    .arg(lease_ms(req.lease))
                    .arg(req.hold_id.as_str())
                    .arg(self.waiter_timeout_ms())
                    .arg(fenced_arg(req))
                    .arg(deadline);
                invocation
            }
            LockMode::Read | LockMode::Write => {
                let mut invocation = self
                    .inner
                    .publish
                    .mode_scripts()
                    .rw_acquire
                    .prepare_invoke();
                invocation
                    .key(lock.as_ref())
                    .key(Names::lease_prefix(p, key))
                    .key(Names::queue(p, key))
                    .key(Names::queue_timeouts(p, key))
                    .key(Names::fence(p, key))
                    .key(Names::rw_channel(p, key))
                    .arg(lease_ms(req.lease))
                    .arg(req.hold_id.as_str())
                    .arg(rw_arg(req.mode))
                    .arg(self.waiter_timeout_ms())
                    .arg(fenced_arg(req))
                    .arg(req.write_hold_id().as_str())
                    .arg(deadline);
                invocation
            }
            LockMode::Permits { max } => {
                let mut invocation = self
                    .inner
                    .publish
                    .mode_scripts()
                    .permits_acquire
                    .prepare_invoke();
                invocation
                    .key(lock.as_ref())
                    .key(Names::permits(p, key))
                    .key(Names::fence(p, key))
                    .arg(lease_ms(req.lease))
                    .arg(req.hold_id.as_str())
                    .arg(max.get())
                    .arg(fenced_arg(req))
                    .arg(deadline);
                invocation
            }
            _ => return None,
        };
        Some(invocation)
    }

    pub(super) async fn release_mode(&self, req: &LockRequest) -> Result<Release> {
        let p = self.prefix();
        let key = &req.key;
        let lock = Names::lock(p, key);
        let reply: i64 = match req.mode {
            LockMode::Fair => {
                self.inner
                    .write_waited(
                        self.inner
                            .publish
                            .mode_scripts()
                            .fair_release
                            .key(lock.as_ref())
                            .key(Names::queue(p, key))
                            .key(Names::queue_timeouts(p, key))
                            .key(Names::channel(p, key))
                            .arg(lease_ms(req.lease))
                            .arg(req.hold_id.as_str()),
                    )
                    .await?
            }
            LockMode::Read | LockMode::Write => {
                self.inner
                    .write_waited(
                        self.inner
                            .publish
                            .mode_scripts()
                            .rw_release
                            .key(lock.as_ref())
                            .key(Names::lease_prefix(p, key))
                            .key(Names::queue(p, key))
                            .key(Names::queue_timeouts(p, key))
                            .key(Names::rw_channel(p, key))
                            .arg(lease_ms(req.lease))
                            .arg(req.hold_id.as_str())
                            .arg(rw_arg(req.mode)),
                    )
                    .await?
            }
            LockMode::Permits { .. } => {
                self.inner
                    .write_waited(
                        self.inner
                            .publish
                            .mode_scripts()
                            .permits_release
                            .key(lock.as_ref())
                            .key(Names::permits(p, key))
                            .key(Names::channel(p, key))
                            .arg(lease_ms(req.lease))
                            .arg(req.hold_id.as_str()),
                    )
                    .await?
            }
            _ => return self.release_exclusive(req).await,
        };
        Ok(parse_release(reply))
    }

    /// Renews a read, write or permit hold (exclusive and fair holds use the plain
    /// lock's script).
    pub(super) async fn renew_mode(&self, req: &LockRequest) -> Result<bool> {
        let p = self.prefix();
        let key = &req.key;
        let lock = Names::lock(p, key);
        let renewed: i64 = match req.mode {
            LockMode::Permits { .. } => {
                self.inner
                    .write_strict(
                        self.inner
                            .publish
                            .mode_scripts()
                            .permits_renew
                            .key(lock.as_ref())
                            .key(Names::permits(p, key))
                            .arg(lease_ms(req.lease))
                            .arg(req.hold_id.as_str()),
                    )
                    .await?
            }
            _ => {
                self.inner
                    .write_strict(
                        self.inner
                            .publish
                            .mode_scripts()
                            .rw_renew
                            .key(lock.as_ref())
                            .key(Names::lease_prefix(p, key))
                            .arg(lease_ms(req.lease))
                            .arg(req.hold_id.as_str())
                            .arg(rw_arg(req.mode)),
                    )
                    .await?
            }
        };
        Ok(renewed == 1)
    }

    /// Leaves the wait queue of a fair or read-write lock.
    pub(super) async fn cancel_wait_mode(&self, req: &LockRequest) -> Result<()> {
        let p = self.prefix();
        let key = &req.key;
        let (entry, family, channel) = match req.mode {
            LockMode::Fair => (
                req.hold_id.as_str().to_owned(),
                "fair",
                Names::channel(p, key),
            ),
            LockMode::Read | LockMode::Write => (
                Names::queue_entry(&req.hold_id, req.mode),
                "rw",
                Names::rw_channel(p, key),
            ),
            _ => return Ok(()),
        };
        let _removed: i64 = self
            .invoke(
                self.inner
                    .publish
                    .mode_scripts()
                    .queue_cancel
                    .key(Names::lock(p, key).as_ref())
                    .key(Names::queue(p, key))
                    .key(Names::queue_timeouts(p, key))
                    .key(channel)
                    .arg(entry)
                    .arg(family),
            )
            .await?;
        Ok(())
    }

    pub(super) async fn force_release_mode(&self, key: &LockKey, mode: LockMode) -> Result<bool> {
        let p = self.prefix();
        let lock = Names::lock(p, key);
        let removed: i64 = match mode {
            LockMode::Fair => {
                self.invoke(
                    self.inner
                        .publish
                        .mode_scripts()
                        .fair_force_release
                        .key(lock.as_ref())
                        .key(Names::queue(p, key))
                        .key(Names::queue_timeouts(p, key))
                        .key(Names::channel(p, key))
                        .key(Names::permits(p, key)),
                )
                .await?
            }
            LockMode::Read | LockMode::Write => {
                self.invoke(
                    self.inner
                        .publish
                        .mode_scripts()
                        .rw_force_release
                        .key(lock.as_ref())
                        .key(Names::lease_prefix(p, key))
                        .key(Names::queue(p, key))
                        .key(Names::queue_timeouts(p, key))
                        .key(Names::rw_channel(p, key))
                        .arg(rw_arg(mode)),
                )
                .await?
            }
            LockMode::Permits { .. } => {
                self.invoke(
                    self.inner
                        .publish
                        .mode_scripts()
                        .permits_force_release
                        .key(lock.as_ref())
                        .key(Names::permits(p, key))
                        .key(Names::channel(p, key)),
                )
                .await?
            }
            _ => return self.force_release_exclusive(key).await,
        };
        Ok(removed == 1)
    }
}
