-- Give back one hold of a permit; with lib.lua.
--
-- At the last hold the permit is free: the owner leaves the holders and one waiter is
-- woken ('0' on the lock's channel).
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  holders (zset, tower_lock_permits:{NAME})
-- KEYS[3]  release channel (redisson_lock__channel:{NAME})
-- ARGV[1]  lease in milliseconds, extended to when holds remain (never shortened)
-- ARGV[2]  owner
--
-- Returns
--   -1     the owner holds no permit (never did, or its lease ended); nothing held
--          changed
--    0     the permit is free; a waiter was woken
--    n > 0 one hold released, n remain; lease extended (never shortened)
local H, E, CHAN = KEYS[1], KEYS[2], KEYS[3]
local lease, owner = tonumber(ARGV[1]), ARGV[2]
if redis.call('exists', E) == 0 then
    return -1
end
local now = now_ms()
prune_permits(H, E, now)
if not redis.call('zscore', E, owner) then
    fit_permits(H, E, now)
    return -1
end
local holds = redis.call('hincrby', H, 'holds:' .. owner, '-1')
if holds > 0 then
    -- The holds left keep at least the lease they had.
    local held_until = tonumber(redis.call('zscore', E, owner) or '0')
    redis.call('zadd', E, math.max(held_until, now + lease), owner)
    fit_permits(H, E, now)
    return holds
end
redis.call('hdel', H, 'holds:' .. owner)
redis.call('zrem', E, owner)
fit_permits(H, E, now)
redis.call('publish', CHAN, '0')
return 0
