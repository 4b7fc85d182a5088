-- Inspect one lock name without changing anything (for operators and Lock::inspect);
-- with lib.lua.
--
-- KEYS[1]  lock name (hash): RLock / RFairLock, RReadWriteLock, or permits
-- KEYS[2]  fencing counter (redisson_lock_token:{NAME})
-- KEYS[3]  wait queue (redisson_lock_queue:{NAME})
-- KEYS[4]  permit holders (zset, tower_lock_permits:{NAME})
-- KEYS[5]  lease-key prefix P of read holds
--
-- Returns { fence, queue length, then per holder: owner, mode, holds, ttl ms, token }
-- as strings: fence '' when there is none; mode 'x' (exclusive or fair), 'r', 'w' or
-- 'p'; ttl '-1' for no expiry; token '' when the store keeps none for the hold.
local lock, fence, queue, permits, prefix = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local out = { redis.call('get', fence) or '', tostring(redis.call('llen', queue)) }
local fields = redis.call('hgetall', lock)
if #fields == 0 then
    return out
end
local pttl = redis.call('pttl', lock)
local function push(owner, mode, holds, ttl, token)
    out[#out + 1] = owner
    out[#out + 1] = mode
    out[#out + 1] = tostring(holds)
    out[#out + 1] = tostring(ttl)
    out[#out + 1] = token or ''
end
local shape = redis.call('hget', lock, 'mode')
if shape then
    -- RReadWriteLock: 'mode', '<owner>' -> read holds, '<owner>:write' -> write holds.
    for i = 1, #fields, 2 do
        local field, holds = fields[i], tonumber(fields[i + 1])
        if field ~= 'mode' and holds then
            local writer = string.match(field, '^(.*):write$')
            if writer then
                push(writer, 'w', holds, pttl)
            else
                -- A read hold lives as long as its longest lease key.
                local ttl = -2
                for n = 1, holds do
                    local t = redis.call('pttl', prefix .. ':' .. field .. ':rwlock_timeout:' .. n)
                    if t == -1 or (ttl ~= -1 and t > ttl) then
                        ttl = t
                    end
                end
                if ttl ~= -2 then
                    push(field, 'r', holds, ttl)
                end
            end
        end
    end
    return out
end
local now = nil
for i = 1, #fields, 2 do
    local field, value = fields[i], fields[i + 1]
    local owner = string.match(field, '^holds:(.*)$')
    if owner then
        now = now or now_ms()
        local at = redis.call('zscore', permits, owner)
        if at and tonumber(at) > now then
            push(owner, 'p', value, tonumber(at) - now, redis.call('hget', lock, 'token:' .. owner))
        end
    elseif not string.match(field, '^token:') then
        push(field, 'x', value, pttl)
    end
end
return out
