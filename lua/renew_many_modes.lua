-- Renew many holds of any modes in one call: the watchdog's batch for one period when
-- it holds more than exclusive and fair locks; with lib.lua.
--
-- Used only when every key lives on one node (standalone Redis, or one cluster slot).
-- A key holding another type than its mode expects counts as not held, so one bad key
-- cannot fail the whole batch. Each lease is extended, never shortened.
--
-- KEYS[2i-1]   lock name of hold i (hash)
-- KEYS[2i]     its companion: the lease-key prefix (read, write), the holders zset
--              (permits), the lock name again (exclusive, fair)
-- ARGV[3i-2]   mode of hold i: 'x' (exclusive or fair), 'r', 'w', 'p' (permits)
-- ARGV[3i-1]   lease in milliseconds for hold i
-- ARGV[3i]     owner of hold i
--
-- Returns an array: element i is 1 when hold i was renewed, 0 when it is no longer held.
local now = now_ms()
local renewed = {}
for i = 1, #KEYS / 2 do
    local H, C = KEYS[2 * i - 1], KEYS[2 * i]
    local mode, lease, owner = ARGV[3 * i - 2], tonumber(ARGV[3 * i - 1]), ARGV[3 * i]
    local ok = 0
    if redis.call('type', H).ok == 'hash' then
        if mode == 'x' then
            if redis.call('hexists', H, owner) == 1 then
                extend(H, lease)
                ok = 1
            end
        elseif mode == 'p' then
            if redis.call('type', C).ok == 'zset' then
                ok = renew_permit(H, C, lease, owner, now)
            end
        else
            ok = renew_rw(H, C, lease, owner, mode == 'r')
        end
    end
    renewed[i] = ok
end
return renewed
