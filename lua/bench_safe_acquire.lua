-- The benchmark's hand-rolled reference with a deadline (examples/bench.rs, `--impl
-- safe-baseline`), not used by the crate: `SET key owner NX PX lease`, refused when it
-- arrives after its deadline on the server's clock, as every tower-lock acquisition is
-- (src/backend/clock.rs). A bare `SET NX PX` delayed past its sender's timeout still
-- takes the lock, for a lease nobody stands for; this is the least a lock needs to
-- refuse it.
--   KEYS[1]  the lock's key
--   ARGV[1]  owner
--   ARGV[2]  lease in milliseconds
--   ARGV[3]  deadline: the server clock in microseconds after which nothing is taken
-- Returns 1 acquired, 0 busy, -1 refused (arrived after the deadline).
local t = redis.call('time')
if tonumber(t[1]) * 1000000 + tonumber(t[2]) > tonumber(ARGV[3]) then
    return -1
end
if redis.call('set', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
    return 1
end
return 0
