//! Replica acknowledgement: how many replicas a write waits for, and whether enough
//! acknowledged it.

use std::time::Duration;

use super::scripts::lease_ms;
use crate::error::{Error, Result, StoreErrorKind};

/// Replica acknowledgement in force.
#[derive(Debug)]
pub(super) struct Synced {
    /// The most replicas a write waits for (all of them, when strict).
    pub(super) replicas: u32,
    pub(super) timeout: Duration,
    /// Wait for `replicas` whatever the primary has, not for the ones it has.
    strict: bool,
    /// The replicas the primary had at the last write's `ROLE`, and the connection's
    /// epoch (its moves to another primary) then: `epoch << 32 | replicas`, `u64::MAX`
    /// before the first.
    connected: std::sync::atomic::AtomicU64,
}

impl Synced {
    pub(super) fn new(replicas: u32, timeout: Duration, strict: bool) -> Self {
        Synced {
            replicas,
            timeout,
            strict,
            connected: std::sync::atomic::AtomicU64::new(u64::MAX),
        }
    }

    /// How many replicas the next write, on the connection of `epoch`, asks for: the
    /// configured count; or when it follows the deployment, no more than the primary
    /// had at the last write, and none on a primary not yet asked (the write's `ROLE`
    /// says, and it waits again for what it needed): a primary just moved to waits for
    /// no replica it may not have.
    pub(super) fn asked(&self, epoch: u64) -> u32 {
        if self.strict {
            return self.replicas;
        }
        let connected = self.connected.load(std::sync::atomic::Ordering::Relaxed);
        if connected == u64::MAX || connected >> 32 != epoch & 0xffff_ffff {
            return 0;
        }
        self.replicas.min((connected & 0xffff_ffff) as u32)
    }

    /// A write on the connection of `epoch` found, by its `ROLE`, `connected` replicas:
    /// the count that write needed.
    pub(super) fn now_connected(&self, epoch: u64, connected: u32) -> u32 {
        let packed = (epoch & 0xffff_ffff) << 32 | u64::from(connected);
        self.connected
            .store(packed, std::sync::atomic::Ordering::Relaxed);
        if self.strict {
            self.replicas
        } else {
            self.replicas.min(connected)
        }
    }

    pub(super) fn wait(&self, replicas: u32) -> redis::Cmd {
        let mut wait = redis::cmd("WAIT");
        wait.arg(replicas).arg(lease_ms(self.timeout));
        wait
    }
}

/// The replicas that `ROLE`, asked of a primary, lists: the ones online (a replica
/// still taking its first copy is not). `None` for another reply (not a primary).
pub(super) fn replicas_of_role(role: &redis::Value) -> Option<u32> {
    let redis::Value::Array(fields) = role else {
        return None;
    };
    match (fields.first(), fields.get(2)) {
        (Some(redis::Value::BulkString(kind)), Some(redis::Value::Array(replicas)))
            if kind == b"master" =>
        {
            u32::try_from(replicas.len()).ok()
        }
        _ => None,
    }
}

/// Whether enough replicas acknowledged a write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Replicated {
    /// As many as configured (or acknowledgement is off).
    Enough,
    /// Fewer: `acked` of `wanted` within `timeout`.
    Short {
        acked: i64,
        wanted: u32,
        timeout: Duration,
    },
}

impl Replicated {
    /// An outage when too few replicas acknowledged.
    pub(super) fn check(self) -> Result<()> {
        match self {
            Replicated::Enough => Ok(()),
            Replicated::Short {
                acked,
                wanted,
                timeout,
            } => Err(Error::store(
                StoreErrorKind::Unavailable,
                format!(
                    "only {acked} of {wanted} Redis replicas acknowledged the lock's write within {timeout:?}"
                ),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The replicas `ROLE` lists, asked of a primary; nothing for a replica's answer.
    #[test]
    fn a_primarys_role_lists_its_replicas() {
        use redis::Value;
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let replica = Value::Array(vec![bulk("127.0.0.1"), bulk("6380"), bulk("42")]);
        let primary = |replicas: Vec<Value>| {
            Value::Array(vec![bulk("master"), Value::Int(42), Value::Array(replicas)])
        };
        assert_eq!(replicas_of_role(&primary(vec![])), Some(0));
        assert_eq!(
            replicas_of_role(&primary(vec![replica.clone(), replica])),
            Some(2)
        );
        let of_a_replica = Value::Array(vec![
            bulk("slave"),
            bulk("127.0.0.1"),
            Value::Int(6379),
            bulk("connected"),
            Value::Int(42),
        ]);
        assert_eq!(replicas_of_role(&of_a_replica), None);
    }
}
