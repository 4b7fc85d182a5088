-- Remove the read holds (when no writer holds the lock) or the write hold and its
-- owner's read holds (when a writer does), whoever the owners: Redisson's forceUnlock
-- of RReadWriteLock's read and write locks; with lib.lua.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  lease-key prefix P
-- KEYS[3]  queue (list)
-- KEYS[4]  waiter timeouts (zset)
-- KEYS[5]  channel (redisson_rwlock:{NAME})
-- ARGV[1]  'read' or 'write'
--
-- Returns 1 when live holds were removed, 0 when there were none in that mode.
local H, P, Q, Z, CHAN = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local reading = ARGV[1] == 'read'
-- Only a read-write hash (it has a 'mode') is this lock's: the hash of another kind of
-- lock on the name (exclusive, fair, permits) is left alone, never pruned.
if redis.call('hget', H, 'mode') ~= ARGV[1] then
    return 0
end
prune_rw(H, P)
if redis.call('hget', H, 'mode') ~= ARGV[1] then
    return 0
end
local flat = redis.call('hgetall', H)
for i = 1, #flat, 2 do
    local field = flat[i]
    if field ~= 'mode' and not is_write_field(field) then
        drop_leases(P, field, tonumber(flat[i + 1]) or 0)
    end
end
redis.call('del', H)
redis.call('publish', CHAN, reading and '0' or '1')
evict_stale(Q, Z, now_ms())
wake_rw(H, Q, CHAN)
return 1
