-- Acquire (or re-enter) a read or write lock, Redisson RReadWriteLock-compatible; with
-- lib.lua.
--
-- The lock is RReadWriteLock's hash at NAME: 'mode' -> 'read' | 'write', '<owner>' ->
-- read holds, '<owner>:write' -> write holds; the hash's PEXPIRE covers the longest
-- hold. Each read hold also has Redisson's lease key '<P>:<owner>:rwlock_timeout:<i>'
-- (value 1), so a Redisson client computes leases over our readers as over its own.
--
-- On top of Redisson's rules, a wait queue gives writers their turn: a reader goes only
-- when no writer holds the lock and no writer waits ahead of it; a writer goes when
-- nothing is held and nobody waits ahead of it. A read of the write holder named by
-- ARGV[6] (the reader's own owner, or the writer it belongs with) goes past that
-- writer's hold at once (downgrade). A blocked owner is put at the tail of the queue (or
-- has its place refreshed) and told to poll again within a third of the waiter timeout.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  lease-key prefix P ('{NAME}', or NAME when it has a hash tag)
-- KEYS[3]  queue (list, redisson_lock_queue:{NAME})
-- KEYS[4]  waiter timeouts (zset, redisson_lock_timeout:{NAME})
-- KEYS[5]  fencing counter (redisson_lock_token:{NAME}; fenced requests only)
-- KEYS[6]  channel (redisson_rwlock:{NAME}); a waiter listens on '<channel>:<entry>'
-- ARGV[1]  lease in milliseconds
-- ARGV[2]  owner
-- ARGV[3]  'read' or 'write'
-- ARGV[4]  waiter timeout in milliseconds
-- ARGV[5]  the token retention in ms for a fenced request (see lib.lua's `fence`); '0'
--          not fenced
-- ARGV[6]  the write holder a read may go past (usually ARGV[2])
-- ARGV[7]  deadline: server clock in microseconds after which the attempt is refused
--          ('0': none)
--
-- Returns
--   {1, holds[, token]}  acquired: holds 1 for a fresh hold, more when re-entered; a
--                        fenced request's token
--   {0, ttl}             busy and queued: try again within ttl ms
--   {-1, now}            refused: it arrived after its deadline; nothing changed;
--                        now is the server clock in microseconds
local H, P, Q, Z, FENCE, CHAN = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local lease, owner, timeout = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[4])
local reading = ARGV[3] == 'read'
local retention = ARGV[5]
-- A writer's own field; for a read, the field of the write hold it may go past.
local write_field = (reading and ARGV[6] or owner) .. ':write'
local entry = owner .. (reading and ':read' or ':write')
local now_us = clock_us()
if late(ARGV[7], now_us) then
    return {-1, now_us}
end
local now = math.floor(now_us / 1000)
local evicted = evict_stale(Q, Z, now)
local mode = redis.call('hget', H, 'mode')
local ttl

if not mode and redis.call('exists', H) == 1 then
    -- Another kind of lock (exclusive, fair, permits) holds the name.
    ttl = redis.call('pttl', H)
elseif reading then
    local count = tonumber(redis.call('hget', H, owner) or '0') or 0
    if count > 0 then
        if reader_live(P, owner, count) then
            -- Re-entering never shortens the lease the hold already has.
            local keep = math.max(lease, reader_pttl(P, owner, count))
            count = redis.call('hincrby', H, owner, '1')
            for i = 1, count do
                redis.call('set', lease_key(P, owner, i), '1', 'px', keep)
            end
            extend(H, keep)
            return granted(count, FENCE, retention)
        end
        -- The hold's leases ended: forget it, and ask as a newcomer.
        redis.call('hdel', H, owner)
        drop_leases(P, owner, count)
        if redis.call('hlen', H) <= 1 then
            redis.call('del', H)
            mode = false
        end
    end
    if mode == 'write' and redis.call('hexists', H, write_field) == 0 then
        ttl = redis.call('pttl', H)
    end
elseif mode then
    if redis.call('hexists', H, write_field) == 1 then
        local holds = redis.call('hincrby', H, write_field, '1')
        local own = redis.call('hget', H, owner)
        local ms = lease
        if own then
            ms = math.max(ms, reader_pttl(P, owner, tonumber(own) or 0))
        end
        extend(H, ms)
        return granted(holds, FENCE, retention)
    end
    -- A writer needs every hold gone, its owner's read holds too.
    prune_rw(H, P)
    if redis.call('exists', H) == 1 then
        ttl = redis.call('pttl', H)
    else
        mode = false
    end
end

-- Free of conflicting holds: the queue decides, unless this is the writer's own read.
if ttl == nil and not (reading and mode == 'write') then
    local at
    if reading then
        local more
        at, more = writer_ahead(Q, Z, entry, now)
        evicted = evicted or more
    else
        local head = redis.call('lindex', Q, '0')
        if head and head ~= entry then
            at = tonumber(redis.call('zscore', Z, head) or now)
        end
    end
    if at then
        ttl = at - now
    end
end

if ttl == nil then
    if reading then
        redis.call('hset', H, owner, '1')
        redis.call('set', lease_key(P, owner, 1), '1', 'px', lease)
        if not mode then
            redis.call('hset', H, 'mode', 'read')
            redis.call('pexpire', H, lease)
        else
            extend(H, lease)
        end
    else
        redis.call('hset', H, 'mode', 'write')
        redis.call('hset', H, write_field, '1')
        redis.call('pexpire', H, lease)
    end
    leave(Q, Z, entry)
    if evicted then
        -- A stale writer went: readers queued behind it may go too.
        wake_rw(H, Q, CHAN)
    end
    return granted(1, FENCE, retention)
end

touch(Q, Z, entry, now + timeout, timeout)
if evicted then
    wake_rw(H, Q, CHAN)
end
return {0, poll_cap(ttl, timeout)}
