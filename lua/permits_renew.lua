-- Renew (watchdog) one permit, only if the owner still holds it; with lib.lua. Its
-- lease is extended, never shortened.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  holders (zset, tower_lock_permits:{NAME})
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner
--
-- Returns 1 when renewed, 0 when the owner no longer holds a permit.
if redis.call('exists', KEYS[2]) == 0 then
    return 0
end
return renew_permit(KEYS[1], KEYS[2], tonumber(ARGV[1]), ARGV[2], now_ms())
