-- Renew (watchdog) the lease of one hold, only if the owner still holds the lock.
--
-- The lease is extended to ARGV[1] if it had less left, never shortened (and a hash
-- without expiry keeps none): renewals that arrive out of order, or a shorter lease
-- asked by another guard of the hold, never end it before a longer one. PTTL is
-- compared here rather than PEXPIRE's GT flag, which needs Redis 7.
--
-- KEYS[1]  lock name (hash)
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner field
--
-- Returns 1 when renewed, 0 when the owner no longer holds the lock.
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    local pttl = redis.call('pttl', KEYS[1])
    if pttl >= 0 and pttl < tonumber(ARGV[1]) then
        redis.call('pexpire', KEYS[1], ARGV[1])
    end
    return 1
end
return 0
