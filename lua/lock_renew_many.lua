-- Renew many holds in one call: the watchdog's batch for one period.
--
-- Used only when every key lives on one node (standalone Redis, or one cluster slot).
-- A key holding another type counts as not held (pcall), so one bad key cannot fail the
-- whole batch. Each lease is extended, never shortened, as lock_renew.lua does.
--
-- KEYS[i]      lock name of hold i (hash)
-- ARGV[2i-1]   lease in milliseconds for hold i
-- ARGV[2i]     owner field of hold i
--
-- Returns an array: element i is 1 when hold i was renewed, 0 when it is no longer held.
local renewed = {}
for i = 1, #KEYS do
    local held = redis.pcall('hexists', KEYS[i], ARGV[2 * i])
    if held == 1 then
        local pttl = redis.call('pttl', KEYS[i])
        if pttl >= 0 and pttl < tonumber(ARGV[2 * i - 1]) then
            redis.call('pexpire', KEYS[i], ARGV[2 * i - 1])
        end
        renewed[i] = 1
    else
        renewed[i] = 0
    end
end
return renewed
