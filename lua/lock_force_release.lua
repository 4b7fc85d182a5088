-- Remove a lock whoever holds it (Redisson forceUnlock) and wake a waiter.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  release channel
-- ARGV[1]  message to publish ('0')
--
-- Returns 1 when a lock was removed, 0 when there was none.
if redis.call('del', KEYS[1]) == 1 then
    redis.call('publish', KEYS[2], ARGV[1])
    return 1
end
return 0
