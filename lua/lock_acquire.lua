-- Acquire (or re-enter) a Redisson-compatible reentrant lock and issue a fencing token.
-- A re-entry extends the lease to ARGV[1] but never shortens it: an outer hold with a
-- longer lease (or the watchdog's) keeps it.
--
-- The lock is a hash at KEYS[1] (Redisson RLock layout): field <client uuid>:<owner id>
-- -> hold count, lease by PEXPIRE in milliseconds. The fencing counter is a separate
-- string key in the same hash slot; it never expires, so tokens never go backwards.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  fencing counter (string, INCR)
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner field
--
-- Returns
--   {1, holds, token}  acquired: holds is 1 for a fresh hold, more when re-entered;
--                      token is the counter value issued when the hold began (should the
--                      counter have vanished meanwhile — evicted, flushed — a re-entry
--                      gets a new one rather than 0)
--   {0, pttl}          busy: the holder's remaining lease in ms (-1: no expiry)
if redis.call('exists', KEYS[1]) == 0 then
    redis.call('hincrby', KEYS[1], ARGV[2], 1)
    redis.call('pexpire', KEYS[1], ARGV[1])
    return {1, 1, redis.call('incr', KEYS[2])}
end
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    local holds = redis.call('hincrby', KEYS[1], ARGV[2], 1)
    -- Re-entering never shortens the lease the hold already has.
    if redis.call('pttl', KEYS[1]) < tonumber(ARGV[1]) then
        redis.call('pexpire', KEYS[1], ARGV[1])
    end
    return {1, holds, tonumber(redis.call('get', KEYS[2]) or redis.call('incr', KEYS[2]))}
end
return {0, redis.call('pttl', KEYS[1])}
