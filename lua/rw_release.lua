-- Release one read or write hold, Redisson RReadWriteLock-compatible; with
-- lib.lua.
--
-- A read release deletes the hold's top lease key; a write release at the last hold
-- hands the lock to the owner's remaining read holds (mode 'read'), as Redisson does.
-- When no hold is left the hash is deleted and Redisson's message is published on the
-- shared channel ('0' after a read unlock, '1' after a write unlock) for Redisson
-- waiters; then the queued waiters the lock now admits are told on their own channels.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  lease-key prefix P
-- KEYS[3]  queue (list)
-- KEYS[4]  waiter timeouts (zset)
-- KEYS[5]  channel (redisson_rwlock:{NAME})
-- ARGV[1]  lease in milliseconds, extended to when holds remain (never shortened)
-- ARGV[2]  owner
-- ARGV[3]  'read' or 'write'
--
-- Returns
--   -1     not held by this owner in this mode (or its lease ended); nothing held
--          changed
--    0     released; waiters were told
--    n > 0 one hold released, n remain; lease extended (never shortened)
local H, P, Q, Z, CHAN = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local lease, owner = tonumber(ARGV[1]), ARGV[2]
local reading = ARGV[3] == 'read'
local field = reading and owner or (owner .. ':write')
local mode = redis.call('hget', H, 'mode')
local count = mode and tonumber(redis.call('hget', H, field) or '0') or 0
if count and count > 0 and reading and not reader_live(P, owner, count) then
    count = 0
end
if not count or count <= 0 then
    return -1
end

if count > 1 then
    redis.call('hincrby', H, field, '-1')
    -- The holds left keep at least the lease they had.
    if reading then
        local keep = math.max(lease, reader_pttl(P, owner, count))
        redis.call('del', lease_key(P, owner, count))
        for i = 1, count - 1 do
            redis.call('pexpire', lease_key(P, owner, i), keep)
        end
        extend(H, keep)
    else
        local own = redis.call('hget', H, owner)
        local ms = lease
        if own then
            ms = math.max(ms, reader_pttl(P, owner, tonumber(own) or 0))
        end
        extend(H, ms)
    end
    return count - 1
end

redis.call('hdel', H, field)
if reading then
    redis.call('del', lease_key(P, owner, 1))
end
local writer, longest = prune_rw(H, P)
if redis.call('exists', H) == 0 then
    redis.call('publish', CHAN, reading and '0' or '1')
elseif not writer then
    -- Readers are left (after a write unlock: the writer's own): the lease is theirs.
    redis.call('hset', H, 'mode', 'read')
    if longest > 0 then
        redis.call('pexpire', H, longest)
    end
end
evict_stale(Q, Z, now_ms())
wake_rw(H, Q, CHAN)
return 0
