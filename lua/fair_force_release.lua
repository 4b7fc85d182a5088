-- Remove a fair lock whoever holds it (Redisson forceUnlock) and tell the head of the
-- queue; with lib.lua.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  queue (list)
-- KEYS[3]  waiter timeouts (zset)
-- KEYS[4]  wake-up channel prefix (redisson_lock__channel:{NAME})
-- KEYS[5]  permit holders (zset tower_lock_permits:{NAME})
--
-- As lock_force_release.lua, a read-write or permit hash on the name is left alone.
--
-- Returns 1 when a lock was removed, 0 when there was none.
local H, Q, Z, CHAN, E = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
evict_stale(Q, Z, now_ms())
if redis.call('hexists', H, 'mode') == 1 or redis.call('exists', E) == 1 then
    return 0
end
if redis.call('del', H) == 1 then
    wake_fair(H, Q, CHAN)
    return 1
end
return 0
