-- Release one hold of a Redisson-compatible reentrant lock.
--
-- At the last hold the lock hash is deleted and the message '0' ("wake one waiter") is
-- published on the lock's channel, exactly as Redisson's unlock does, so Redisson
-- waiters wake too.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  release channel (redisson_lock__channel:{NAME})
-- ARGV[1]  message to publish on the last release ('0')
-- ARGV[2]  lease in milliseconds, extended to when holds remain (never shortened; a
--          hash without expiry keeps none)
-- ARGV[3]  owner field
--
-- Returns
--   -1     not held by this owner; nothing changed
--    0     released: the lock is gone and waiters were told
--    n > 0 one hold released, n remain
local holds = redis.call('hget', KEYS[1], ARGV[3])
if not holds then
    return -1
end
-- The common case, a single hold, in three calls: read it, delete, publish.
if holds ~= '1' then
    holds = redis.call('hincrby', KEYS[1], ARGV[3], '-1')
    if holds > 0 then
        local pttl = redis.call('pttl', KEYS[1])
        if pttl >= 0 and pttl < tonumber(ARGV[2]) then
            redis.call('pexpire', KEYS[1], ARGV[2])
        end
        return holds
    end
end
redis.call('del', KEYS[1])
redis.call('publish', KEYS[2], ARGV[1])
return 0
