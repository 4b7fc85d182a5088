//! The Redis names of a lock: its hash, and the companions Redisson keeps beside it
//! (channels, fencing counter, wait queue), all in the lock's hash slot.

use std::borrow::Cow;
use std::fmt;

use crate::backend::{LockMode, LockRequest};
use crate::hold_id::HoldId;
use crate::key::LockKey;

/// The Redis names of one lock. Built without `format!`: this is on every operation's
/// path, and with no key prefix the lock's own name is the key itself (no allocation).
pub(super) struct Names;

/// A companion's name ([`Names::companion`]), written where it is needed — into a
/// command's buffer as it is encoded — without a string of its own.
#[derive(Clone, Copy)]
pub(super) struct Companion<'a> {
    kind: &'a str,
    prefix: &'a str,
    key: &'a LockKey,
}

impl Companion<'_> {
    fn tagged(&self) -> bool {
        self.prefix.contains('{') || self.key.as_str().contains('{')
    }

    fn len(&self) -> usize {
        let braces = if self.tagged() { 0 } else { 2 };
        self.kind.len() + 1 + braces + self.prefix.len() + self.key.as_str().len()
    }
}

impl fmt::Display for Companion<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (open, close) = if self.tagged() { ("", "") } else { ("{", "}") };
        write!(
            f,
            "{}:{open}{}{}{close}",
            self.kind,
            self.prefix,
            self.key.as_str()
        )
    }
}

impl redis::ToRedisArgs for Companion<'_> {
    /// Written in pieces, without the formatting machinery (on every release's path).
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        let (open, close): (&[u8], &[u8]) = if self.tagged() {
            (b"", b"")
        } else {
            (b"{", b"}")
        };
        let mut arg = out.writer_for_next_arg();
        // Writing into the command's own buffer cannot fail.
        for piece in [
            self.kind.as_bytes(),
            b":",
            open,
            self.prefix.as_bytes(),
            self.key.as_str().as_bytes(),
            close,
        ] {
            let _ = arg.write_all(piece);
        }
    }
}

/// The lock hash's name ([`Names::lock`]), written into a command as it is encoded:
/// no string of its own, with a key prefix or without.
#[derive(Clone, Copy)]
pub(super) struct LockName<'a> {
    prefix: &'a str,
    key: &'a LockKey,
}

impl fmt::Display for LockName<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.prefix, self.key.as_str())
    }
}

impl redis::ToRedisArgs for LockName<'_> {
    fn write_redis_args<W: ?Sized + redis::RedisWrite>(&self, out: &mut W) {
        use std::io::Write as _;
        if self.prefix.is_empty() {
            out.write_arg(self.key.as_str().as_bytes());
        } else {
            let mut arg = out.writer_for_next_arg();
            // Writing into the command's own buffer cannot fail.
            let _ = arg.write_all(self.prefix.as_bytes());
            let _ = arg.write_all(self.key.as_str().as_bytes());
        }
    }
}

impl Names {
    /// The lock hash's name, as a [`LockName`] written in place.
    pub(super) fn lock_of<'a>(prefix: &'a str, key: &'a LockKey) -> LockName<'a> {
        LockName { prefix, key }
    }

    /// The release channel, as a [`Companion`] written in place.
    pub(super) fn channel_of<'a>(prefix: &'a str, key: &'a LockKey) -> Companion<'a> {
        Companion {
            kind: "redisson_lock__channel",
            prefix,
            key,
        }
    }

    /// The fencing counter, as a [`Companion`] written in place.
    pub(super) fn fence_of<'a>(prefix: &'a str, key: &'a LockKey) -> Companion<'a> {
        Companion {
            kind: "redisson_lock_token",
            prefix,
            key,
        }
    }

    /// The lock hash: the prefix followed by the key.
    pub(super) fn lock<'a>(prefix: &str, key: &'a LockKey) -> Cow<'a, str> {
        if prefix.is_empty() {
            Cow::Borrowed(key.as_str())
        } else {
            Cow::Owned([prefix, key.as_str()].concat())
        }
    }

    /// A companion of the lock (its channel, its fencing counter): `<kind>:{NAME}`, or
    /// `<kind>:NAME` when NAME already has a hash tag — Redisson's naming, which keeps
    /// companions in the lock's cluster slot.
    fn companion(kind: &str, prefix: &str, key: &LockKey) -> String {
        let name = Companion { kind, prefix, key };
        let mut text = String::with_capacity(name.len());
        // Writing to a String cannot fail.
        let _ = fmt::Write::write_fmt(&mut text, format_args!("{name}"));
        text
    }

    pub(super) fn channel(prefix: &str, key: &LockKey) -> String {
        Self::channel_of(prefix, key).to_string()
    }

    /// Where a client's name is registered: `tower_lock_client:<client uuid>`.
    pub(super) fn client(prefix: &str, id: &str) -> String {
        [prefix, "tower_lock_client:", id].concat()
    }

    /// The fencing counter: Redisson `RFencedLock`'s.
    pub(super) fn fence(prefix: &str, key: &LockKey) -> String {
        Self::fence_of(prefix, key).to_string()
    }

    /// The wait queue of fair and read-write locks (Redisson `RFairLock`'s list).
    pub(super) fn queue(prefix: &str, key: &LockKey) -> String {
        Self::companion("redisson_lock_queue", prefix, key)
    }

    /// The waiters' eviction times (Redisson `RFairLock`'s sorted set).
    pub(super) fn queue_timeouts(prefix: &str, key: &LockKey) -> String {
        Self::companion("redisson_lock_timeout", prefix, key)
    }

    /// The read-write lock's channel (Redisson `RReadWriteLock`'s); queued waiters
    /// listen on `<it>:<queue entry>`.
    pub(super) fn rw_channel(prefix: &str, key: &LockKey) -> String {
        Self::companion("redisson_rwlock", prefix, key)
    }

    /// The holders of permits (owner → end of lease).
    pub(super) fn permits(prefix: &str, key: &LockKey) -> String {
        Self::companion("tower_lock_permits", prefix, key)
    }

    /// The record kept for replay under the lock ([`ReplayStore`](crate::backend::ReplayStore)).
    pub(super) fn replay(prefix: &str, key: &LockKey) -> String {
        Self::companion("tower_lock_replay", prefix, key)
    }

    /// The prefix of read holds' lease keys, `<it>:<owner>:rwlock_timeout:<i>`: Redisson's
    /// `suffixName` rule, `{NAME}` or NAME itself when it has a hash tag.
    pub(super) fn lease_prefix(prefix: &str, key: &LockKey) -> String {
        let name = Self::lock(prefix, key);
        if name.contains('{') {
            name.into_owned()
        } else {
            ["{", name.as_ref(), "}"].concat()
        }
    }

    /// A read-write waiter's place in the queue: `<hold id>:read` or `<hold id>:write`.
    pub(super) fn queue_entry(hold_id: &HoldId, mode: LockMode) -> String {
        let suffix = if mode == LockMode::Read {
            ":read"
        } else {
            ":write"
        };
        [hold_id.as_str(), suffix].concat()
    }

    /// The channel a waiter of `req` listens on: the lock's channel for exclusive locks
    /// and permits (a release wakes one waiter), the owner's own channel for queued
    /// modes (a release wakes exactly the waiters the queue lets go).
    pub(super) fn wait_channel(prefix: &str, req: &LockRequest) -> String {
        match req.mode {
            LockMode::Fair => [
                Self::channel(prefix, &req.key).as_str(),
                ":",
                req.hold_id.as_str(),
            ]
            .concat(),
            LockMode::Read | LockMode::Write => [
                Self::rw_channel(prefix, &req.key).as_str(),
                ":",
                Self::queue_entry(&req.hold_id, req.mode).as_str(),
            ]
            .concat(),
            _ => Self::channel(prefix, &req.key),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Issue 49: no lock key can be another lock's companion key. Every companion the
    /// backend names begins with one of the reserved prefixes, and no key or
    /// namespace may.
    #[test]
    fn every_companion_name_is_reserved() {
        let key = LockKey::new("anyLock").unwrap();
        let companions = [
            Names::channel("", &key),
            Names::fence("", &key),
            Names::replay("", &key),
            Names::queue("", &key),
            Names::queue_timeouts("", &key),
            Names::rw_channel("", &key),
            Names::permits("", &key),
            Names::client("", "id"),
        ];
        for name in &companions {
            assert!(
                crate::RESERVED_PREFIXES.iter().any(|p| name.starts_with(p)),
                "{name}"
            );
            assert!(LockKey::new(name).is_err(), "{name} taken as a lock key");
        }
        for prefix in crate::RESERVED_PREFIXES {
            let namespace = prefix.trim_end_matches(':');
            assert!(LockKey::namespaced(namespace, "x").is_err(), "{namespace}");
            assert!(crate::Namespace::new(namespace).is_err(), "{namespace}");
        }
        assert!(
            LockKey::new("redisson_lock").is_ok(),
            "only the companions' forms"
        );
        assert!(LockKey::new(crate::backend::PING_KEY).is_ok());
    }

    #[test]
    fn names_follow_redisson() {
        let key = LockKey::new("anyLock").unwrap();
        assert_eq!(Names::lock("", &key), "anyLock");
        assert_eq!(Names::channel("", &key), "redisson_lock__channel:{anyLock}");
        assert_eq!(Names::fence("", &key), "redisson_lock_token:{anyLock}");
        assert_eq!(Names::replay("", &key), "tower_lock_replay:{anyLock}");

        assert_eq!(Names::queue("", &key), "redisson_lock_queue:{anyLock}");
        assert_eq!(
            Names::queue_timeouts("", &key),
            "redisson_lock_timeout:{anyLock}"
        );
        assert_eq!(Names::rw_channel("", &key), "redisson_rwlock:{anyLock}");
        assert_eq!(Names::lease_prefix("", &key), "{anyLock}");
        let owner = HoldId::from_raw("uuid:1").unwrap();
        let wait = |mode| {
            Names::wait_channel(
                "",
                &LockRequest::new(key.clone(), owner.clone(), mode, Duration::from_secs(1)),
            )
        };
        assert_eq!(
            wait(LockMode::Exclusive),
            "redisson_lock__channel:{anyLock}"
        );
        assert_eq!(
            wait(LockMode::Fair),
            "redisson_lock__channel:{anyLock}:uuid:1"
        );
        assert_eq!(
            wait(LockMode::Read),
            "redisson_rwlock:{anyLock}:uuid:1:read"
        );
        assert_eq!(
            wait(LockMode::Write),
            "redisson_rwlock:{anyLock}:uuid:1:write"
        );

        let key = LockKey::namespaced("lock:order", "42").unwrap();
        assert_eq!(Names::lock("app:", &key), "app:lock:order:{42}");
        assert_eq!(Names::lease_prefix("app:", &key), "app:lock:order:{42}");
        assert_eq!(
            Names::channel("app:", &key),
            "redisson_lock__channel:app:lock:order:{42}"
        );
        assert_eq!(
            Names::fence("app:", &key),
            "redisson_lock_token:app:lock:order:{42}"
        );
        assert_eq!(
            Names::replay("app:", &key),
            "tower_lock_replay:app:lock:order:{42}"
        );
    }

    #[test]
    fn names_written_in_place_are_the_names() {
        let packed = |arg: &dyn Fn(&mut redis::Cmd)| {
            let mut cmd = redis::cmd("X");
            arg(&mut cmd);
            cmd.get_packed_command()
        };
        for key in ["anyLock", "lock:order:{42}", "é:{ü}"] {
            for prefix in ["", "app:", "a{b}:"] {
                let key = LockKey::new(key).unwrap();
                assert_eq!(
                    packed(&|c| {
                        c.arg(Names::lock_of(prefix, &key));
                    }),
                    packed(&|c| {
                        c.arg(Names::lock(prefix, &key).as_ref());
                    }),
                    "{prefix}{key} lock"
                );
                assert_eq!(
                    packed(&|c| {
                        c.arg(Names::channel_of(prefix, &key));
                    }),
                    packed(&|c| {
                        c.arg(Names::channel(prefix, &key));
                    }),
                    "{prefix}{key} channel"
                );
                assert_eq!(
                    packed(&|c| {
                        c.arg(Names::fence_of(prefix, &key));
                    }),
                    packed(&|c| {
                        c.arg(Names::fence(prefix, &key));
                    }),
                    "{prefix}{key} fence"
                );
            }
        }
    }

    #[cfg(feature = "cluster")]
    #[test]
    fn companion_keys_share_the_lock_slot() {
        use redis::cluster_routing::Slot;
        for key in ["anyLock", "lock:order:{42}", "a{b}c", "x", "é:{ü}"] {
            for prefix in ["", "app:"] {
                let key = LockKey::new(key).unwrap();
                let slot = Slot::for_key(Names::lock(prefix, &key).as_bytes());
                assert_eq!(
                    Slot::for_key(Names::channel(prefix, &key)),
                    slot,
                    "{key} channel"
                );
                assert_eq!(
                    Slot::for_key(Names::fence(prefix, &key)),
                    slot,
                    "{key} fence"
                );
                let owner = HoldId::from_raw("5f0e7c8a-uuid:7").unwrap();
                let lease_key = [
                    Names::lease_prefix(prefix, &key).as_str(),
                    ":",
                    owner.as_str(),
                    ":rwlock_timeout:1",
                ]
                .concat();
                let mut companions = vec![
                    ("queue", Names::queue(prefix, &key)),
                    ("queue timeouts", Names::queue_timeouts(prefix, &key)),
                    ("rw channel", Names::rw_channel(prefix, &key)),
                    ("permits", Names::permits(prefix, &key)),
                    ("record for replay", Names::replay(prefix, &key)),
                    ("read lease key", lease_key),
                ];
                for mode in [
                    LockMode::Exclusive,
                    LockMode::Fair,
                    LockMode::Read,
                    LockMode::Write,
                ] {
                    let req =
                        LockRequest::new(key.clone(), owner.clone(), mode, Duration::from_secs(1));
                    companions.push(("wait channel", Names::wait_channel(prefix, &req)));
                }
                for (what, name) in companions {
                    assert_eq!(Slot::for_key(name.as_bytes()), slot, "{key} {what}: {name}");
                }
            }
        }
    }
}
