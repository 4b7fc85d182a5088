-- Take (or re-enter) one of at most `max` leased permits; with lib.lua.
--
-- Permits are a hash at NAME ('holds:<owner>' -> holds) and a zset of holders (owner ->
-- expires-at, server time in ms). Holders whose lease ended are dropped first, so a
-- crashed holder's permit comes back with its lease. Both keys expire with the longest
-- lease. A hash at NAME without the zset is another kind of lock, which keeps the name
-- busy.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  holders (zset, tower_lock_permits:{NAME})
-- KEYS[3]  fencing counter (redisson_lock_token:{NAME}; fenced requests only)
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner
-- ARGV[3]  most holders at once (max)
-- ARGV[4]  the token retention in ms for a fenced request (see lib.lua's `fence`); '0'
--          not fenced
-- ARGV[5]  deadline: server clock in microseconds after which the attempt is refused
--          ('0': none)
--
-- Returns
--   {1, holds[, token]}  acquired: holds 1 for a fresh permit, more when re-entered; a
--                        fenced request's token
--   {0, ttl}             all permits taken: ttl ms until the first lease ends
--                        (-1: another kind of lock without expiry holds the name)
--   {-1, now}            refused: it arrived after its deadline; nothing changed;
--                        now is the server clock in microseconds
local H, E, FENCE = KEYS[1], KEYS[2], KEYS[3]
local lease, owner, max = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local retention = ARGV[4]
local now_us = clock_us()
if late(ARGV[5], now_us) then
    return {-1, now_us}
end
local now = math.floor(now_us / 1000)
if redis.call('exists', E) == 0 then
    if redis.call('exists', H) == 1 then
        return {0, redis.call('pttl', H)}
    end
else
    prune_permits(H, E, now)
end
local held_until = redis.call('zscore', E, owner)
if held_until then
    local holds = redis.call('hincrby', H, 'holds:' .. owner, '1')
    -- Re-entering never shortens the permit's lease.
    redis.call('zadd', E, math.max(tonumber(held_until), now + lease), owner)
    fit_permits(H, E, now)
    return granted(holds, FENCE, retention)
end
if redis.call('zcard', E) < max then
    redis.call('hset', H, 'holds:' .. owner, '1')
    redis.call('zadd', E, now + lease, owner)
    fit_permits(H, E, now)
    return granted(1, FENCE, retention)
end
local first = redis.call('zrange', E, '0', '0', 'withscores')
fit_permits(H, E, now)
-- Read before fit_permits: a last permit in its final millisecond gets a 1 ms expiry
-- there, which the server's clock may pass before a later read in this script.
if #first == 0 then
    return {0, 0}
end
return {0, math.max(0, tonumber(first[2]) - now + 1)}
