-- A queued waiter gives up (deadline, cancellation): leave the queue of a fair or
-- read-write lock, and tell whoever that lets go next; with lib.lua.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  queue (list)
-- KEYS[3]  waiter timeouts (zset)
-- KEYS[4]  wake-up channel prefix (fair: redisson_lock__channel:{NAME}; read-write:
--          redisson_rwlock:{NAME})
-- ARGV[1]  queue entry ('<owner>' for fair, '<owner>:read' / '<owner>:write')
-- ARGV[2]  'fair' or 'rw'
--
-- Returns 1 when the entry was queued, 0 when it was not.
local H, Q, Z, CHAN = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local entry, family = ARGV[1], ARGV[2]
local removed = leave(Q, Z, entry)
local evicted = evict_stale(Q, Z, now_ms())
if removed or evicted then
    if family == 'fair' then
        wake_fair(H, Q, CHAN)
    else
        wake_rw(H, Q, CHAN)
    end
end
if removed then
    return 1
end
return 0
