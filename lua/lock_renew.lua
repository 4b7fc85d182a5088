-- Renew (watchdog) the lease of one hold, only if the owner still holds the lock.
--
-- KEYS[1]  lock name (hash)
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner field
--
-- Returns 1 when renewed, 0 when the owner no longer holds the lock.
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    redis.call('pexpire', KEYS[1], ARGV[1])
    return 1
end
return 0
