-- Acquire (or re-enter) a fair lock, Redisson RFairLock-compatible; with lib.lua.
--
-- The lock is RLock's hash at NAME (field <owner> -> holds, lease by PEXPIRE). A newcomer
-- takes a free lock only when nobody waits, a waiter only from the head of the queue;
-- everyone else is put at the tail of the queue (or has its place refreshed) and told
-- to poll again within a third of the waiter timeout.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  queue (list, redisson_lock_queue:{NAME})
-- KEYS[3]  waiter timeouts (zset, redisson_lock_timeout:{NAME})
-- KEYS[4]  fencing counter (redisson_lock_token:{NAME}; fenced requests only)
-- KEYS[5]  wake-up channel prefix (redisson_lock__channel:{NAME}; a waiter listens on
--          '<prefix>:<owner>')
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner
-- ARGV[3]  waiter timeout in milliseconds
-- ARGV[4]  the token retention in ms for a fenced request (see lib.lua's `fence`); '0'
--          not fenced
-- ARGV[5]  deadline: server clock in microseconds after which the attempt is refused
--          ('0': none)
--
-- Returns
--   {1, holds[, token]}  acquired: holds 1 for a fresh hold, more when re-entered; a
--                        fenced request's token
--   {0, ttl}             busy and queued: try again within ttl ms (the holder's lease or
--                        the waiter ahead's eviction, at most a third of the timeout)
--   {-1, now}            refused: it arrived after its deadline; nothing changed;
--                        now is the server clock in microseconds
local H, Q, Z, FENCE, CHAN = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease, owner, timeout = ARGV[1], ARGV[2], tonumber(ARGV[3])
local retention = ARGV[4]
local now_us = clock_us()
if late(ARGV[5], now_us) then
    return {-1, now_us}
end
local now = math.floor(now_us / 1000)
local evicted = evict_stale(Q, Z, now)
local ttl
if redis.call('exists', H) == 0 then
    local head = redis.call('lindex', Q, '0')
    if not head or head == owner then
        if head then
            redis.call('lpop', Q)
            redis.call('zrem', Z, owner)
        end
        redis.call('hset', H, owner, '1')
        redis.call('pexpire', H, lease)
        return granted(1, FENCE, retention)
    end
    -- The head is alive (stale heads were evicted): it goes first.
    ttl = tonumber(redis.call('zscore', Z, head) or now) - now
    if evicted then
        redis.call('publish', CHAN .. ':' .. head, '0')
    end
else
    if redis.call('hexists', H, owner) == 1 then
        local holds = redis.call('hincrby', H, owner, '1')
        extend(H, tonumber(lease))
        return granted(holds, FENCE, retention)
    end
    ttl = redis.call('pttl', H)
end
touch(Q, Z, owner, now + timeout, timeout)
return {0, poll_cap(ttl, timeout)}
