-- Remove a fair lock whoever holds it (Redisson forceUnlock) and tell the head of the
-- queue; with lib.lua.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  queue (list)
-- KEYS[3]  waiter timeouts (zset)
-- KEYS[4]  wake-up channel prefix (redisson_lock__channel:{NAME})
--
-- Returns 1 when a lock was removed, 0 when there was none.
local H, Q, Z, CHAN = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
evict_stale(Q, Z, now_ms())
if redis.call('del', H) == 1 then
    wake_fair(H, Q, CHAN)
    return 1
end
return 0
