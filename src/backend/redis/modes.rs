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

use super::RedisBackend;
use super::names::Names;
use super::scripts::{Publish, lease_ms};
use crate::backend::{Acquire, LockMode, LockRequest, Release};
use crate::error::Result;
use crate::key::LockKey;

const LIB: &str = include_str!("../../../lua/lib.lua");

/// `lib.lua` as a script whose body is `body` needs it: its prelude (the header and the
/// statements before the first helper) and the helpers `body` calls, directly or
/// through another helper, in `lib.lua`'s order. Redis runs a script's whole text on
/// every call, and defining the ~25 helpers cost each call about as much as an empty
/// script (1.9 µs on a 2-core machine); most scripts call two to five of them.
pub(super) fn lib_for(body: &str) -> String {
    let helpers = helpers();
    let prelude_end = helpers.first().map_or(LIB.len(), |h| h.start);
    let mut wanted = vec![false; helpers.len()];
    let mut callers = vec![body];
    while let Some(text) = callers.pop() {
        for (i, helper) in helpers.iter().enumerate() {
            if !wanted[i] && calls(text, helper.name) {
                wanted[i] = true;
                callers.push(&LIB[helper.start..helper.end]);
            }
        }
    }
    let mut lib = String::with_capacity(LIB.len() + body.len());
    lib.push_str(&LIB[..prelude_end]);
    for (helper, _) in helpers.iter().zip(&wanted).filter(|(_, wanted)| **wanted) {
        lib.push_str(&LIB[helper.start..helper.end]);
    }
    lib.push_str(body);
    lib
}

/// One `local function` of `lib.lua`: its name, and its text with the comment lines
/// just above it (byte offsets into [`LIB`]).
struct Helper {
    name: &'static str,
    start: usize,
    end: usize,
}

/// `lib.lua`'s helpers, in order. Each starts a line with `local function <name>(`;
/// one ends where the next one's comment lines start (or the file does).
fn helpers() -> Vec<Helper> {
    let mut helpers: Vec<Helper> = Vec::new();
    let mut offset = 0;
    // Where the run of comment lines just above the current line starts.
    let mut comments_from = None;
    for line in LIB.split_inclusive('\n') {
        if let Some(rest) = line.strip_prefix("local function ")
            && let Some(name) = rest.split('(').next()
        {
            let start = comments_from.unwrap_or(offset);
            if let Some(last) = helpers.last_mut() {
                last.end = start;
            }
            helpers.push(Helper {
                name,
                start,
                end: LIB.len(),
            });
        }
        comments_from = if line.starts_with("--") {
            comments_from.or(Some(offset))
        } else {
            None
        };
        offset += line.len();
    }
    helpers
}

/// Whether `text` calls `name(...)`: the name, not part of a longer one or a field,
/// right before a `(`.
fn calls(text: &str, name: &str) -> bool {
    let call = format!("{name}(");
    text.match_indices(&call).any(|(at, _)| {
        !text[..at]
            .chars()
            .next_back()
            .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.' || c == ':')
    })
}

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
        let deadline = self.inner.attempt_deadline(&req.key).await?;
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
                    .arg(self.inner.fenced_arg(req))
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
                    .arg(self.inner.fenced_arg(req))
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
                    .arg(self.inner.fenced_arg(req))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Every script of `lua/` but `lib.lua` itself, by file name.
    fn bodies() -> Vec<(String, String)> {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/lua");
        let mut bodies: Vec<(String, String)> = std::fs::read_dir(dir)
            .unwrap()
            .map(|entry| entry.unwrap().path())
            .filter(|path| path.file_name().is_some_and(|name| name != "lib.lua"))
            .map(|path| {
                let name = path.file_name().unwrap().to_string_lossy().into_owned();
                (name, std::fs::read_to_string(&path).unwrap())
            })
            .collect();
        bodies.sort();
        bodies
    }

    #[test]
    fn a_script_defines_exactly_the_helpers_it_calls() {
        let names: Vec<&str> = helpers().iter().map(|h| h.name).collect();
        assert!(names.len() >= 20, "{names:?}");
        let bodies = bodies();
        assert!(bodies.len() >= 20, "{} scripts", bodies.len());
        for (file, body) in bodies {
            let script = lib_for(&body);
            for name in &names {
                let called = script
                    .lines()
                    .filter(|line| !line.starts_with("local function "))
                    .any(|line| calls(line, name));
                let defined = script.contains(&format!("local function {name}("));
                assert_eq!(called, defined, "{file}: {name} called / defined");
            }
        }
    }

    #[test]
    fn the_batch_script_carries_the_prelude_and_its_own_helpers_only() {
        let script = lib_for(include_str!("../../../lua/lock_batch.lua"));
        assert!(script.contains("redis.replicate_commands()"));
        let at = |name: &str| script.find(&format!("local function {name}("));
        for name in ["clock_us", "late", "extend", "release_hold", "fence"] {
            assert!(at(name).is_some(), "{name} missing");
        }
        for name in ["prune_permits", "wake_rw", "evict_stale", "granted"] {
            assert!(at(name).is_none(), "{name} carried along");
        }
        // lib.lua's order: a helper is defined before the helpers that call it.
        assert!(at("extend") < at("release_hold"));
        let body = include_str!("../../../lua/lock_batch.lua");
        assert!(script.ends_with(body));
        let lib = script.len() - body.len();
        assert!(
            lib < LIB.len() / 2,
            "{lib} of lib.lua's {} bytes",
            LIB.len()
        );
    }

    #[test]
    fn a_call_is_a_name_before_a_parenthesis_not_part_of_another() {
        assert!(calls("return late(ARGV[1], now)", "late"));
        assert!(calls("x = fence(F)", "fence"));
        assert!(!calls("return too_late(x)", "late"));
        assert!(!calls("redis.call('x')", "call"));
        assert!(!calls("obj:fence(F)", "fence"));
        assert!(!calls("local late = 1", "late"));
    }
}
