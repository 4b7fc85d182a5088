-- Keep a record for replay and release one hold of a Redisson-compatible reentrant
-- lock, in one step: ReplayStore::store_and_release of the Idempotency-Key layer. With
-- lib.lua (its `release_hold` releases).
--
-- The record is written only when the owner still holds the lock (its field is in the
-- lock hash, which ends with the lease) and no record with a greater fencing token is
-- kept; an expired record is gone, and counts as none. Then, whether it was written or
-- not, one hold is released exactly as lock_release.lua does it.
--
-- The record is a hash 'token' -> the fencing token of the hold that wrote it (decimal),
-- 'record' -> its bytes; PEXPIREd after its TTL, so Redis drops it then.
--
-- KEYS[1]  lock name (hash); its release channel is written by `release_hold`
-- KEYS[2]  record (hash, tower_lock_replay:{NAME}: the lock's hash slot)
-- ARGV[1]  lease in milliseconds, extended to when holds remain (never shortened; a
--          hash without expiry keeps none)
-- ARGV[2]  owner field
-- ARGV[3]  the hold's fencing token, decimal without leading zeros
-- ARGV[4]  the record (any bytes)
-- ARGV[5]  the record's TTL in milliseconds
--
-- Returns {stored, released}
--   stored    1: the record was written; 0: not (the owner does not hold the lock, or a
--             record with a greater token is kept)
--   released  as lock_release.lua: -1 not held by this owner, nothing changed; 0
--             released: the lock is gone and waiters were told; n > 0 one hold
--             released, n remain

-- Whether the decimal token `a` is greater than `b`, compared as digit strings: exact
-- for every token (Lua numbers are doubles, exact only up to 2^53).
local function token_greater(a, b)
    if #a ~= #b then
        return #a > #b
    end
    return a > b
end

local stored = 0
if redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    local kept = redis.call('hget', KEYS[2], 'token')
    if not kept or not token_greater(kept, ARGV[3]) then
        redis.call('hset', KEYS[2], 'token', ARGV[3])
        redis.call('hset', KEYS[2], 'record', ARGV[4])
        redis.call('pexpire', KEYS[2], ARGV[5])
        stored = 1
    end
end
return {stored, release_hold(KEYS[1], ARGV[1], ARGV[2])}
