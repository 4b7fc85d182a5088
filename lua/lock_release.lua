-- Release one hold of a Redisson-compatible reentrant lock.
--
-- At the last hold the lock hash is deleted and the message '0' ("wake one waiter") is
-- published on the lock's channel, exactly as Redisson's unlock does, so Redisson
-- waiters wake too.
--
-- KEYS[1]  lock name (hash). Its release channel is not sent but written here, as
--          Redisson names it: redisson_lock__channel:{NAME}, or
--          redisson_lock__channel:NAME when NAME has a hash tag already (either way in
--          NAME's cluster slot): Redis spends more converting an argument for Lua
--          than Lua spends joining the name.
-- ARGV[1]  lease in milliseconds, extended to when holds remain (never shortened; a
--          hash without expiry keeps none)
-- ARGV[2]  owner field
--
-- Returns
--   -1     not held by this owner; nothing changed
--    0     released: the lock is gone and waiters were told
--    n > 0 one hold released, n remain
local holds = redis.call('hget', KEYS[1], ARGV[2])
if not holds then
    return -1
end
-- The common case, a single hold, in three calls: read it, delete, publish.
if holds ~= '1' then
    holds = redis.call('hincrby', KEYS[1], ARGV[2], '-1')
    if holds > 0 then
        local pttl = redis.call('pttl', KEYS[1])
        if pttl >= 0 and pttl < tonumber(ARGV[1]) then
            redis.call('pexpire', KEYS[1], ARGV[1])
        end
        return holds
    end
end
redis.call('del', KEYS[1])
-- Inline rather than lib.lua's `channel_of`: a helper is a closure made on every call.
local channel = 'redisson_lock__channel:{' .. KEYS[1] .. '}'
if string.find(KEYS[1], '{', 1, true) then
    channel = 'redisson_lock__channel:' .. KEYS[1]
end
redis.call('publish', channel, '0')
return 0
