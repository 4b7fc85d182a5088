-- Take back every permit whoever holds it and wake every waiter ('1'); with lib.lua.
--
-- KEYS[1]  lock name (hash)
-- KEYS[2]  holders (zset, tower_lock_permits:{NAME})
-- KEYS[3]  release channel (redisson_lock__channel:{NAME})
--
-- Returns 1 when live permits were taken back, 0 when there were none.
local H, E, CHAN = KEYS[1], KEYS[2], KEYS[3]
if redis.call('exists', E) == 0 then
    return 0
end
prune_permits(H, E, now_ms())
local held = redis.call('zcard', E)
redis.call('del', H, E)
if held > 0 then
    redis.call('publish', CHAN, '1')
    return 1
end
return 0
