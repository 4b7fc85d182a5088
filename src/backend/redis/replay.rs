//! Records for replay ([`ReplayStore`]) on Redis: one hash per lock, beside it in its
//! hash slot, written together with the release by one script
//! (`lua/replay_store.lua`).

use std::time::Duration;

use bytes::Bytes;

use super::RedisBackend;
use super::modes::parse_release;
use super::names::Names;
use super::scripts::{lease_ms, unexpected};
use crate::backend::{BoxFuture, FencingToken, LockMode, LockRequest, ReplayStore, Stored};
use crate::error::{Error, Result, StoreErrorKind};
use crate::key::LockKey;

/// A record lives at `tower_lock_replay:{NAME}` (`NAME` as is when it has a hash tag,
/// as every companion of the lock: the lock's cluster slot): a hash `token` → the
/// writer's fencing token, `record` → the bytes, `PEXPIRE`d with the record's TTL, so
/// Redis itself drops it then.
///
/// Exclusive locks only (the `IdempotencyLayer`'s): a request in another mode is
/// refused as [misconfigured](StoreErrorKind::Misconfigured), having changed nothing.
///
/// The check that the hold still has its lock, the write and the release are one
/// script call, sent on the command connection, not group-committed: it comes after
/// its hold's acquisition was answered, so no queued operation of that hold can follow
/// it. With [replica acknowledgement](super::RedisBackendBuilder::synced_replicas),
/// `WAIT` follows the call as it follows a release, and is waited for, not failed: a
/// record that too few replicas acknowledged is reported as stored, and lost only if a
/// failover promotes a replica without it — then a retry runs its request again, as
/// after a response that was never stored.
impl ReplayStore for RedisBackend {
    fn load<'a>(&'a self, key: &'a LockKey) -> BoxFuture<'a, Result<Option<Bytes>>> {
        Box::pin(async move {
            let mut cmd = redis::cmd("HGET");
            cmd.arg(Names::replay(&self.inner.prefix, key))
                .arg("record");
            let record: Option<Vec<u8>> = self.inner.query(&cmd).await?;
            Ok(record.map(Bytes::from))
        })
    }

    fn store_and_release<'a>(
        &'a self,
        req: &'a LockRequest,
        token: FencingToken,
        record: Bytes,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<Stored>> {
        Box::pin(async move {
            if req.mode != LockMode::Exclusive {
                return Err(Error::store(
                    StoreErrorKind::Misconfigured,
                    format!(
                        "the Redis backend keeps records for replay under exclusive locks only (got a {} lock)",
                        req.mode
                    ),
                ));
            }
            let prefix = &self.inner.prefix;
            let reply: Vec<i64> = self
                .inner
                .write_waited(
                    self.inner
                        .publish
                        .scripts()
                        .replay_store
                        .key(Names::lock(prefix, &req.key).as_ref())
                        .key(Names::replay(prefix, &req.key))
                        .arg(lease_ms(req.lease))
                        .arg(req.hold_id.as_str())
                        .arg(token.get())
                        .arg(record.as_ref())
                        .arg(lease_ms(ttl)),
                )
                .await?;
            match reply[..] {
                [stored @ (0 | 1), released] => {
                    Ok(Stored::new(stored == 1, parse_release(released)))
                }
                _ => Err(unexpected("replay_store", &reply)),
            }
        })
    }
}
