-- Release one hold of a fair lock, Redisson RFairLock-compatible; with lib.lua.
--
-- At the last hold the lock hash is deleted and the head of the queue (after evicting
-- waiters that stopped polling) is told on its own channel, with Redisson's '0', as
-- Redisson's fair unlock does.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  queue (list)
-- KEYS[3]  waiter timeouts (zset)
-- KEYS[4]  wake-up channel prefix (redisson_lock__channel:{NAME})
-- ARGV[1]  lease in milliseconds, extended to when holds remain (never shortened)
-- ARGV[2]  owner
--
-- Returns
--   -1     not held by this owner; the lock is unchanged
--    0     released; the next waiter was told
--    n > 0 one hold released, n remain; lease extended (never shortened)
local H, Q, Z, CHAN = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local lease, owner = ARGV[1], ARGV[2]
evict_stale(Q, Z, now_ms())
if redis.call('hexists', H, owner) == 0 then
    -- The hold may have expired with nobody told: the head can go now.
    wake_fair(H, Q, CHAN)
    return -1
end
local holds = redis.call('hincrby', H, owner, '-1')
if holds > 0 then
    extend(H, tonumber(lease))
    return holds
end
redis.call('del', H)
wake_fair(H, Q, CHAN)
return 0
