-- Many acquisitions and releases of Redisson-compatible reentrant locks in one call: the
-- group commit of src/backend/redis/batch.rs. The fixed cost of entering a script is
-- paid once per batch instead of once per operation. Each operation does exactly what
-- lock_acquire.lua or lock_release.lua does for it, in the order given; an operation
-- on a key holding another type of data fails alone (its error is its reply), the others
-- go on. With lib.lua (its `fence` takes the fencing tokens, its `release_hold`
-- releases).
--
-- ARGV[1] is the batch's deadline: the server clock in microseconds after which its
-- acquisitions are refused ('0': none); its sender has given up on them by then.
-- ARGV[2] is the token retention in ms, for fenced acquisitions (lib.lua's `fence`).
-- Operation i (1-based) has
--   ARGV[3i]    'a' acquire, 'f' fenced acquire, 'r' release
--   ARGV[3i+1]  lease in milliseconds
--   ARGV[3i+2]  owner field
-- and its keys next in KEYS, in operation order: the lock name (hash), and for a fenced
-- acquisition then its fencing counter (redisson_lock_token:{NAME}). A release's
-- channel is not sent: `release_hold` writes it (an argument costs Redis more to hand to
-- Lua than the name costs to join).
--
-- Returns a flat array, three entries per operation:
--   acquired   1, holds, token (0 when not fenced)
--   busy       0, pttl (-1: no expiry), 0
--   refused    -1, now, 0 (an acquisition that arrived after the deadline; nothing
--              changed; now is the server clock in microseconds)
--   released   2, n (0: the lock is gone and waiters were told; n > 0: holds left;
--              -1: not held by this owner), 0
--   error      3, the error's message, 0
local out = {}

local function push(a, b, c)
    out[#out + 1] = a
    out[#out + 1] = b
    out[#out + 1] = c
end

local function acquire(H, F, lease, owner, fenced)
    local holds
    if redis.call('exists', H) == 0 then
        redis.call('hset', H, owner, '1')
        redis.call('pexpire', H, lease)
        holds = 1
    elseif redis.call('hexists', H, owner) == 1 then
        holds = redis.call('hincrby', H, owner, '1')
        local pttl = redis.call('pttl', H)
        if pttl >= 0 and pttl < tonumber(lease) then
            redis.call('pexpire', H, lease)
        end
    else
        return 0, redis.call('pttl', H), 0
    end
    if not fenced then
        return 1, holds, 0
    end
    return 1, holds, fence(F, ARGV[2])
end

local function release(H, lease, owner)
    return 2, release_hold(H, lease, owner), 0
end

local now_us = clock_us()
local too_late = late(ARGV[1], now_us)
local k = 1 -- the operation's first key
for i = 1, (#ARGV - 2) / 3 do
    local op, lease, owner = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
    local H, F = KEYS[k], nil
    k = k + 1
    if op == 'f' then
        F = KEYS[k]
        k = k + 1
    end
    local ok, a, b, c
    if op ~= 'r' and too_late then
        ok, a, b, c = true, -1, now_us, 0
    elseif op == 'r' then
        ok, a, b, c = pcall(release, H, lease, owner)
    else
        ok, a, b, c = pcall(acquire, H, F, lease, owner, op == 'f')
    end
    if ok then
        push(a, b, c)
    else
        local message = a
        if type(a) == 'table' then
            message = a.err or 'error'
        end
        push(3, tostring(message), 0)
    end
end
return out
