-- Remove a lock whoever holds it (Redisson forceUnlock) and wake a waiter.
--
-- Only an exclusive (or fair: the same hash) lock is removed: a read-write hash (it has a
-- 'mode' field) or a permit hash (its holders' zset exists) on the same name belongs to
-- another kind of lock and is left alone.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  release channel
-- KEYS[3]  permit holders (zset tower_lock_permits:{NAME})
-- ARGV[1]  message to publish ('0')
--
-- Returns 1 when a lock was removed, 0 when there was none.
if redis.call('hexists', KEYS[1], 'mode') == 1 or redis.call('exists', KEYS[3]) == 1 then
    return 0
end
if redis.call('del', KEYS[1]) == 1 then
    redis.call('publish', KEYS[2], ARGV[1])
    return 1
end
return 0
