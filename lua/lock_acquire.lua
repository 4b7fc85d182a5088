-- Acquire (or re-enter) a Redisson-compatible reentrant lock; fenced requests also take
-- a fencing token.
--
-- The lock is a hash at KEYS[1] (Redisson RLock layout): field <client uuid>:<owner id>
-- -> hold count, lease by PEXPIRE in milliseconds. A re-entry extends the lease to
-- ARGV[1] but never shortens it (and a hash without expiry keeps none).
--
-- Fencing (ARGV[3] ~= '0') is Redisson RFencedLock's: the counter KEYS[2]
-- (redisson_lock_token:{NAME}) is INCRed on every acquisition, re-entries included. On
-- top of Redisson, the token is raised to the server clock in microseconds, so tokens
-- keep increasing when the counter is lost (a restart without persistence), and the
-- counter expires ARGV[3] ms (the token retention) after the clock would reach its
-- token: when it is gone the clock is past every token it gave (lib.lua's `fence`
-- says why). An unfenced acquisition sends no KEYS[2] and leaves nothing behind once
-- released.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  fencing counter (string), sent and read by fenced requests only
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner field
-- ARGV[3]  the token retention in ms for a fenced acquisition; '0' not fenced
-- ARGV[4]  deadline: the server clock in microseconds after which this attempt is
--          refused ('0': none). Its sender has given up on it by then (a reply that
--          timed out, a connection it replaced): arriving later, it must take nothing.
--
-- Returns
--   {1, holds}         acquired, unfenced: holds is 1 for a fresh hold, more when
--                      re-entered
--   {1, holds, token}  acquired, fenced
--   {0, pttl}          busy: the holder's remaining lease in ms (-1: no expiry)
--   {-1, now}          refused: it arrived after its deadline; nothing changed. now is
--                      the server clock in microseconds, a sample for the sender's
--                      next deadline (its last one was computed from a clock that
--                      stepped, or from another server's)

-- Effects replication (the default from Redis 5) lets writes follow TIME.
if redis.replicate_commands then
    redis.replicate_commands()
end
if ARGV[4] ~= '0' then
    local t = redis.call('time')
    local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
    if now > tonumber(ARGV[4]) then
        return {-1, now}
    end
end
local holds
if redis.call('exists', KEYS[1]) == 0 then
    redis.call('hset', KEYS[1], ARGV[2], '1')
    redis.call('pexpire', KEYS[1], ARGV[1])
    holds = 1
elseif redis.call('hexists', KEYS[1], ARGV[2]) == 1 then
    holds = redis.call('hincrby', KEYS[1], ARGV[2], '1')
    local pttl = redis.call('pttl', KEYS[1])
    if pttl >= 0 and pttl < tonumber(ARGV[1]) then
        redis.call('pexpire', KEYS[1], ARGV[1])
    end
else
    return {0, redis.call('pttl', KEYS[1])}
end
if ARGV[3] == '0' then
    return {1, holds}
end
local t = redis.call('time')
local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
local token = redis.call('incr', KEYS[2])
if token < floor then
    redis.call('set', KEYS[2], string.format('%.0f', floor))
    token = floor
end
redis.call('pexpire', KEYS[2],
    string.format('%.0f', math.floor((token - floor) / 1000) + tonumber(ARGV[3])))
return {1, holds, token}
