-- The benchmark's hand-rolled reference lock (examples/bench.rs, `--impl baseline` and
-- `--impl safe-baseline`), not used by the crate: release by compare-and-delete.
--   KEYS[1]  the lock's key (a string holding its owner)
--   ARGV[1]  owner
-- Returns 1 when the key held ARGV[1] and is deleted, 0 otherwise.
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
