-- The server's clock, from the master serving KEYS[1]: on a Redis Cluster `TIME` names
-- no key and may go to any node, and an attempt's deadline must be on the clock of the
-- master that will run it (src/backend/clock.rs).
--
-- KEYS[1]  a lock name: the script runs on the master serving its slot
--
-- Returns {seconds, microseconds}, as TIME does.
return redis.call('time')
