//! The scripts of the exclusive locks and how they publish releases (classic or
//! sharded), the arguments they take and the replies they give.

use std::sync::LazyLock;
use std::time::Duration;

use redis::Script;

use super::modes;
use super::names::Names;
use crate::backend::clock::ArrivedLate;
use crate::backend::{
    Acquire, FencingToken, Grant, HoldInfo, LockMode, LockRequest, LockState, WaiterScope, Waiters,
};
use crate::error::{Error, Result, StoreErrorKind};
use crate::hold_id::HoldId;

pub(super) struct Scripts {
    pub(super) acquire: Script,
    pub(super) batch: Script,
    pub(super) release: Script,
    pub(super) renew: Script,
    renew_many: Script,
    pub(super) force_release: Script,
    pub(super) inspect: Script,
    pub(super) replay_store: Script,
    #[cfg(feature = "cluster")]
    pub(super) time: Script,
}

impl Scripts {
    fn new(publish: Publish) -> Self {
        Scripts {
            acquire: publish.script(include_str!("../../../lua/lock_acquire.lua")),
            batch: publish.with_lib(include_str!("../../../lua/lock_batch.lua")),
            release: publish.script(include_str!("../../../lua/lock_release.lua")),
            renew: publish.script(include_str!("../../../lua/lock_renew.lua")),
            renew_many: publish.script(include_str!("../../../lua/lock_renew_many.lua")),
            force_release: publish.script(include_str!("../../../lua/lock_force_release.lua")),
            inspect: publish.with_lib(include_str!("../../../lua/inspect.lua")),
            replay_store: publish.with_lib(include_str!("../../../lua/replay_store.lua")),
            #[cfg(feature = "cluster")]
            time: publish.script(include_str!("../../../lua/time.lua")),
        }
    }
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts::new(Publish::Classic));
static SHARDED_SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts::new(Publish::Sharded));

/// How the scripts publish releases: with classic `PUBLISH`, which a cluster forwards to
/// every node, or with sharded `SPUBLISH` (Redis 7), which stays on the key's shard and
/// reaches `SSUBSCRIBE`rs only — Redisson's choice on a cluster that supports it. The
/// `lua/` files say `redis.call('publish', ...)`; the sharded variant of each script is
/// the same text with that call renamed, so one file serves both.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Publish {
    Classic,
    Sharded,
}

/// How every script in `lua/` calls `PUBLISH` (checked by a test), and its sharded form.
const PUBLISH_CALL: &str = "redis.call('publish', ";
const SPUBLISH_CALL: &str = "redis.call('spublish', ";

impl Publish {
    /// `source` as a script that publishes this way.
    fn script(self, source: &str) -> Script {
        Script::new(&self.text(source))
    }

    /// `body` after the helpers of `lua/lib.lua` it calls ([`modes::lib_for`]), as one
    /// script that publishes this way.
    pub(super) fn with_lib(self, body: &str) -> Script {
        self.script(&modes::lib_for(body))
    }

    fn text(self, source: &str) -> String {
        match self {
            Publish::Classic => source.to_owned(),
            Publish::Sharded => source.replace(PUBLISH_CALL, SPUBLISH_CALL),
        }
    }

    pub(super) fn scripts(self) -> &'static Scripts {
        match self {
            Publish::Classic => &SCRIPTS,
            Publish::Sharded => &SHARDED_SCRIPTS,
        }
    }

    pub(super) fn mode_scripts(self) -> &'static modes::ModeScripts {
        match self {
            Publish::Classic => &modes::MODE_SCRIPTS,
            Publish::Sharded => &modes::SHARDED_MODE_SCRIPTS,
        }
    }
}

/// The script call that renews the holds `batch` picks out of `reqs`: the one for every
/// mode when `mixed`, else the lighter one for plain (exclusive and fair) holds.
pub(super) fn renewal_script(
    publish: Publish,
    prefix: &str,
    reqs: &[LockRequest],
    batch: &[usize],
    mixed: bool,
) -> redis::ScriptInvocation<'static> {
    if mixed {
        let mut invocation = publish.mode_scripts().renew_many_modes.prepare_invoke();
        for &i in batch {
            invocation
                .key(Names::lock(prefix, &reqs[i].key).as_ref())
                .key(modes::batch_companion(prefix, &reqs[i]));
        }
        for &i in batch {
            invocation.arg(modes::batch_tag(reqs[i].mode));
            invocation
                .arg(lease_ms(reqs[i].lease))
                .arg(reqs[i].hold_id.as_str());
        }
        invocation
    } else {
        let mut invocation = publish.scripts().renew_many.prepare_invoke();
        for &i in batch {
            invocation.key(Names::lock(prefix, &reqs[i].key).as_ref());
        }
        for &i in batch {
            invocation
                .arg(lease_ms(reqs[i].lease))
                .arg(reqs[i].hold_id.as_str());
        }
        invocation
    }
}

pub(super) fn lease_ms(lease: Duration) -> u64 {
    u64::try_from(lease.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// `PTTL` → remaining lease: -1 (no expiry) → `None`; -2 (gone) → zero.
pub(super) fn ttl_of(pttl: i64) -> Option<Duration> {
    match pttl {
        -1 => None,
        ms => Some(Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
    }
}

/// The error of an attempt the server refused because it arrived after its deadline
/// (`now_us`: the server's clock at the refusal, when the script said it).
pub(super) fn arrived_late(now_us: Option<i64>) -> Error {
    let now_us = now_us
        .and_then(|t| u64::try_from(t).ok())
        .filter(|&t| t > 0);
    ArrivedLate::error("Redis", now_us)
}

/// `{1, holds}`, `{1, holds, token}`, `{0, ttl}` or `{-1, now}` (arrived late) → the
/// outcome.
pub(super) fn parse_acquire(op: &str, reply: &[i64]) -> Result<Acquire> {
    let holds = |h: i64| u32::try_from(h).unwrap_or(u32::MAX);
    match reply {
        [-1] => Err(arrived_late(None)),
        [-1, now] => Err(arrived_late(Some(*now))),
        [1, h] => Ok(Acquire::Acquired(Grant::new(holds(*h), None))),
        [1, h, token] if *token > 0 => Ok(Acquire::Acquired(Grant::new(
            holds(*h),
            Some(FencingToken::new(token.unsigned_abs())),
        ))),
        [0, ttl] => Ok(Acquire::Busy { ttl: ttl_of(*ttl) }),
        other => Err(unexpected(op, other)),
    }
}

/// `inspect.lua`'s reply → the state. `waiters` is this process's count for modes the
/// store does not queue; for queued modes the queue's length replaces it.
pub(super) fn parse_inspect(
    reply: &[String],
    mode: LockMode,
    mut waiters: Waiters,
) -> Result<LockState> {
    let bad = || {
        Error::store(
            StoreErrorKind::Unexpected,
            format!("inspect script answered {reply:?}"),
        )
    };
    let [fence, queued, rest @ ..] = reply else {
        return Err(bad());
    };
    if rest.len() % 5 != 0 {
        return Err(bad());
    }
    let fencing_token = match fence.as_str() {
        "" => None,
        n => Some(FencingToken::new(n.parse().map_err(|_| bad())?)),
    };
    if waiters.scope == WaiterScope::Store {
        waiters.count = queued.parse().map_err(|_| bad())?;
    }
    let mut holders = Vec::with_capacity(rest.len() / 5);
    for h in rest.chunks_exact(5) {
        let hold_id = HoldId::from_raw(&h[0]).map_err(|_| bad())?;
        let held = match h[1].as_str() {
            "r" => LockMode::Read,
            "w" => LockMode::Write,
            "p" => match mode {
                LockMode::Permits { .. } => mode,
                _ => LockMode::Permits {
                    max: std::num::NonZeroU32::MAX,
                },
            },
            _ if mode == LockMode::Fair => LockMode::Fair,
            _ => LockMode::Exclusive,
        };
        let holds: u32 = h[2].parse().map_err(|_| bad())?;
        let ttl = ttl_of(h[3].parse().map_err(|_| bad())?);
        let token = match h[4].as_str() {
            "" => None,
            n => Some(FencingToken::new(n.parse().map_err(|_| bad())?)),
        };
        holders.push(HoldInfo::new(hold_id, held, holds, ttl).with_token(token));
    }
    Ok(LockState::new(holders, waiters).with_fencing_token(fencing_token))
}

pub(super) fn unexpected(op: &str, reply: &[i64]) -> Error {
    Error::store(
        StoreErrorKind::Unexpected,
        format!("{op} script answered {reply:?}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ttl_and_lease_conversions() {
        assert_eq!(ttl_of(-1), None);
        assert_eq!(ttl_of(-2), Some(Duration::ZERO));
        assert_eq!(ttl_of(1500), Some(Duration::from_millis(1500)));
        assert_eq!(lease_ms(Duration::from_micros(10)), 1);
        assert_eq!(lease_ms(Duration::from_secs(30)), 30_000);
    }

    #[test]
    fn scripts_are_the_lua_files() {
        assert!(SCRIPTS.acquire.get_hash().len() == 40);
        assert_ne!(SCRIPTS.acquire.get_hash(), SCRIPTS.release.get_hash());
    }

    /// Every file in `lua/`, with its text.
    fn lua_files() -> Vec<(std::path::PathBuf, String)> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("lua");
        std::fs::read_dir(&dir)
            .unwrap()
            .map(|entry| {
                let path = entry.unwrap().path();
                let source = std::fs::read_to_string(&path).unwrap();
                (path, source)
            })
            .collect()
    }

    /// Redis 7.0 turns a Lua number passed to `redis.call` into text with `snprintf`
    /// (`%.17g`): about 2,000 instructions an argument, as much as the command it goes
    /// to. A constant argument is written as a string (`'1'`, not `1`), so no script
    /// pays that for a literal.
    #[test]
    fn no_script_passes_a_number_literal_to_redis() {
        let mut calls = 0;
        for (path, source) in lua_files() {
            for line in source.lines().filter(|l| !l.trim_start().starts_with("--")) {
                for (at, _) in line.match_indices("redis.call(") {
                    calls += 1;
                    let rest = &line[at + "redis.call(".len()..];
                    // The call's arguments: up to its closing parenthesis, split at
                    // the commas outside nested calls.
                    let (mut depth, mut args, mut arg) = (0, Vec::new(), String::new());
                    for c in rest.chars() {
                        match c {
                            '(' => depth += 1,
                            ')' if depth == 0 => break,
                            ')' => depth -= 1,
                            ',' if depth == 0 => {
                                args.push(std::mem::take(&mut arg));
                                continue;
                            }
                            _ => {}
                        }
                        arg.push(c);
                    }
                    args.push(arg);
                    for arg in &args {
                        assert!(
                            arg.trim().parse::<f64>().is_err(),
                            "{}: `{}` passes the number {} to Redis",
                            path.display(),
                            line.trim(),
                            arg.trim()
                        );
                    }
                }
            }
        }
        assert!(calls >= 100, "found only {calls} calls");
    }

    /// The sharded scripts are the files with `PUBLISH` renamed: every publish in
    /// `lua/` must be spelled as [`PUBLISH_CALL`], or the rename would miss it and a
    /// cluster's waiters would sleep through that release.
    #[test]
    fn every_publish_in_the_scripts_is_renamed_for_sharded_pubsub() {
        let mut publishes = 0;
        for (path, source) in lua_files() {
            let code: String = source
                .lines()
                .filter(|l| !l.trim_start().starts_with("--"))
                .map(|l| format!("{}\n", l.to_lowercase()))
                .collect();
            let calls = code.matches("publish").count();
            let spelled = code.matches(PUBLISH_CALL).count();
            assert_eq!(
                calls,
                spelled,
                "{} publishes in another spelling",
                path.display()
            );
            let sharded = Publish::Sharded.text(&source);
            assert!(!sharded.contains(PUBLISH_CALL), "{}", path.display());
            assert_eq!(sharded.matches(SPUBLISH_CALL).count(), spelled);
            publishes += spelled;
        }
        assert!(publishes >= 10, "found only {publishes} publishes");
        assert_ne!(
            SCRIPTS.release.get_hash(),
            SHARDED_SCRIPTS.release.get_hash()
        );
        // The replay store releases with lib.lua's `release_hold`: renamed there too.
        assert_ne!(
            SCRIPTS.replay_store.get_hash(),
            SHARDED_SCRIPTS.replay_store.get_hash()
        );
    }
}
