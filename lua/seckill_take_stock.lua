-- The seckill example's stock decrement (examples/seckill/redis_store.rs), not part of
-- the lock: take one unit of a voucher's stock if any is left, in one step, so two
-- processes can never both take the last unit (Redis's `UPDATE ... SET stock = stock - 1
-- WHERE stock > 0`).
--
-- KEYS[1]  the voucher's stock (string holding an integer)
--
-- Returns
--    1  one unit taken
--    0  sold out: the stock is 0 (or below); nothing changed
--   -1  no such voucher: the key does not exist; nothing changed
local stock = redis.call('get', KEYS[1])
if not stock then
    return -1
end
if tonumber(stock) <= 0 then
    return 0
end
redis.call('decr', KEYS[1])
return 1
