//! The one writer of the batcher's script calls: which script runs what is sent, and
//! the keys and values it takes, whether the call goes through [`Inner`] (a
//! [`ScriptInvocation`], with `WAIT` behind it under replica acknowledgement) or on
//! the pipelined batches' own connection (a bare `EVALSHA`, see
//! [`pipeline`](super::pipeline)).
//!
//! One operation goes alone, with its single-key script (`lua/lock_acquire.lua`,
//! `lua/lock_release.lua`); several go in one call of `lua/lock_batch.lua`.

use redis::{Cmd, ScriptInvocation, ToRedisArgs};

use super::{Job, Op, Queued};
use crate::backend::redis::inner::Inner;
use crate::backend::redis::names::{Companion, LockName, Names};
use crate::backend::redis::scripts::Scripts;

/// Where a script call's keys and values are written.
trait CallArgs {
    /// Adds `key` to the call's `KEYS`.
    fn key(&mut self, key: impl ToRedisArgs);
    /// Adds `value` to the call's `ARGV`.
    fn arg(&mut self, value: impl ToRedisArgs);
}

impl CallArgs for ScriptInvocation<'_> {
    fn key(&mut self, key: impl ToRedisArgs) {
        ScriptInvocation::key(self, key);
    }

    fn arg(&mut self, value: impl ToRedisArgs) {
        ScriptInvocation::arg(self, value);
    }
}

/// A bare `EVALSHA` whose hash and key count are written: keys and values alike are its
/// next arguments (every key is written before the first value).
impl CallArgs for Cmd {
    fn key(&mut self, key: impl ToRedisArgs) {
        Cmd::arg(self, key);
    }

    fn arg(&mut self, value: impl ToRedisArgs) {
        Cmd::arg(self, value);
    }
}

/// The writer of one send's script calls, with what they carry besides the operations:
/// the scripts, the key prefix, the token retention and the deadline.
pub(super) struct Encoder<'a> {
    scripts: &'static Scripts,
    prefix: &'a str,
    /// The token retention in milliseconds, as the scripts take it.
    token_retention: &'a str,
    /// The deadline of the call's acquisitions on the server's clock (0 when it
    /// carries none).
    deadline: u64,
}

impl<'a> Encoder<'a> {
    /// For a call of `inner`'s with the acquisitions' `deadline`.
    pub(super) fn new(inner: &'a Inner, deadline: u64) -> Self {
        Encoder {
            scripts: inner.publish.scripts(),
            prefix: &inner.prefix,
            token_retention: &inner.token_retention,
            deadline,
        }
    }

    /// `job` alone, as a call of its single-key script.
    pub(super) fn one(&self, job: &Job) -> ScriptInvocation<'static> {
        let mut invocation = self.script_of(job).prepare_invoke();
        self.write_one(job, &mut invocation);
        invocation
    }

    /// `batch` (two operations or more) as one call of `lua/lock_batch.lua`.
    pub(super) fn many(&self, batch: &[Queued]) -> ScriptInvocation<'static> {
        let mut invocation = self.scripts.batch.prepare_invoke();
        self.write_many(batch, &mut invocation);
        invocation
    }

    /// `job` alone, as the bare `EVALSHA` of its single-key script, written into
    /// buffers sized for it up front (grown argument by argument, they cost a few
    /// reallocations a call).
    pub(super) fn evalsha_one(&self, job: &Job) -> Cmd {
        // EVALSHA, the hash, the key count, one or two names, two to four values.
        let size =
            192 + 2 * (self.prefix.len() + job.key.as_str().len()) + job.hold_id.as_str().len();
        let mut cmd = Cmd::with_capacity(9, size);
        cmd.arg("EVALSHA")
            .arg(self.script_of(job).get_hash())
            .arg(1 + usize::from(self.fence(job).is_some()));
        self.write_one(job, &mut cmd);
        cmd
    }

    /// `batch` as a bare `EVALSHA`: the single-key script for one operation,
    /// `lua/lock_batch.lua` for more.
    pub(super) fn evalsha(&self, batch: &[Queued]) -> Cmd {
        if let [q] = batch {
            return self.evalsha_one(q);
        }
        let fenced = batch.iter().filter(|q| self.fence(q).is_some()).count();
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(self.scripts.batch.get_hash())
            .arg(batch.len() + fenced);
        self.write_many(batch, &mut cmd);
        cmd
    }

    /// The single-key script of `job`.
    fn script_of(&self, job: &Job) -> &'static redis::Script {
        match job.op {
            Op::Acquire => &self.scripts.acquire,
            Op::Release => &self.scripts.release,
        }
    }

    /// The keys and values of `job`'s single-key script: the lock (and a fenced
    /// acquisition's counter); the lease, the owner, and for an acquisition whether it
    /// is fenced (the token retention, or `0`) and its deadline.
    fn write_one(&self, job: &Job, out: &mut impl CallArgs) {
        out.key(self.lock(job));
        if let Some(fence) = self.fence(job) {
            out.key(fence);
        }
        out.arg(job.lease_ms);
        out.arg(job.hold_id.as_str());
        if job.op == Op::Acquire {
            out.arg(if job.fenced {
                self.token_retention
            } else {
                "0"
            });
            out.arg(self.deadline);
        }
    }

    /// The keys and values of `lua/lock_batch.lua` for `batch`: each operation's lock
    /// (and a fenced acquisition's counter), in queue order; the deadline and the token
    /// retention, then three values per operation: what it is (`a` an acquisition, `f`
    /// a fenced one, `r` a release), its lease and its owner.
    fn write_many(&self, batch: &[Queued], out: &mut impl CallArgs) {
        for q in batch {
            out.key(self.lock(q));
            if let Some(fence) = self.fence(q) {
                out.key(fence);
            }
        }
        out.arg(self.deadline);
        out.arg(self.token_retention);
        for q in batch {
            let tag = match (q.op, q.fenced) {
                (Op::Release, _) => "r",
                (Op::Acquire, true) => "f",
                (Op::Acquire, false) => "a",
            };
            out.arg(tag);
            out.arg(q.lease_ms);
            out.arg(q.hold_id.as_str());
        }
    }

    /// The lock hash's name.
    fn lock<'j>(&self, job: &'j Job) -> LockName<'j>
    where
        'a: 'j,
    {
        Names::lock_of(self.prefix, &job.key)
    }

    /// The operation's second key, a fenced acquisition's only: its fencing counter.
    /// Nothing else sends one (a release's script writes its channel's name itself).
    fn fence<'j>(&self, job: &'j Job) -> Option<Companion<'j>>
    where
        'a: 'j,
    {
        (job.op == Op::Acquire && job.fenced).then(|| Names::fence_of(self.prefix, &job.key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What an invocation sent through [`Inner`] writes: its `EVALSHA` (the one
    /// command of a pipeline).
    fn through_inner(invocation: ScriptInvocation<'_>) -> Vec<u8> {
        let mut pipe = redis::pipe();
        pipe.invoke_script(&invocation);
        pipe.get_packed_pipeline()
    }

    /// What the batcher writes on the wire, pinned: the keys, then the deadline and the
    /// token retention, then three values per operation for `lua/lock_batch.lua`; the
    /// lock (and a fenced acquisition's counter) and the lease, owner, fencing and
    /// deadline for the single-key scripts.
    #[tokio::test]
    async fn calls_are_written_as_the_scripts_read_them() {
        use crate::hold_id::HoldId;
        use crate::key::LockKey;
        use tokio::sync::oneshot;

        let backend = crate::RedisBackend::builder("redis://127.0.0.1:1")
            .key_prefix("app")
            .lazy_connect(true)
            .build()
            .await
            .unwrap();
        let inner = &backend.inner;
        let job = |op, fenced, key: &str, owner: &str| Job {
            op,
            fenced,
            key: LockKey::new(key).unwrap(),
            lease_ms: 30_000,
            hold_id: HoldId::from_raw(owner).unwrap(),
        };
        let queued = |job| Queued {
            job,
            reply: oneshot::channel().0,
            resent: 0,
        };
        let expected = |args: &[&str]| {
            let mut cmd = redis::cmd("EVALSHA");
            for arg in args {
                cmd.arg(*arg);
            }
            cmd.get_packed_command()
        };
        let scripts = inner.publish.scripts();
        let (batch, acquire, release) = (
            scripts.batch.get_hash(),
            scripts.acquire.get_hash(),
            scripts.release.get_hash(),
        );
        let deadline = 1_700_000_000_123_456_u64;

        let many = [
            queued(job(Op::Acquire, true, "k1", "u:1")),
            queued(job(Op::Release, true, "k2", "u:2")),
            queued(job(Op::Acquire, false, "{k}3", "u:3")),
        ];
        let many_expected = expected(&[
            batch,
            "4",
            "app:k1",
            "redisson_lock_token:{app:k1}",
            "app:k2",
            "app:{k}3",
            "1700000000123456",
            "3600000",
            "f",
            "30000",
            "u:1",
            "r",
            "30000",
            "u:2",
            "a",
            "30000",
            "u:3",
        ]);
        let cases = [
            (
                job(Op::Acquire, true, "k1", "u:1"),
                expected(&[
                    acquire,
                    "2",
                    "app:k1",
                    "redisson_lock_token:{app:k1}",
                    "30000",
                    "u:1",
                    "3600000",
                    "1700000000123456",
                ]),
            ),
            (
                job(Op::Acquire, false, "k1", "u:1"),
                expected(&[
                    acquire,
                    "1",
                    "app:k1",
                    "30000",
                    "u:1",
                    "0",
                    "1700000000123456",
                ]),
            ),
            (
                job(Op::Release, true, "k1", "u:1"),
                expected(&[release, "1", "app:k1", "30000", "u:1"]),
            ),
        ];
        let encoder = Encoder::new(inner, deadline);
        assert_eq!(encoder.evalsha(&many).get_packed_command(), many_expected);
        assert_eq!(through_inner(encoder.many(&many)), many_expected);
        for (job, expected) in cases {
            assert_eq!(encoder.evalsha_one(&job).get_packed_command(), expected);
            assert_eq!(through_inner(encoder.one(&job)), expected);
            assert_eq!(
                encoder.evalsha(&[queued(job)]).get_packed_command(),
                expected
            );
        }
    }
}
