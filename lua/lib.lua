-- Shared helpers of the fair, read-write, permit and mixed-renewal scripts.
--
-- Not a script of its own: src/backend/redis/mod.rs prepends it to every script whose
-- header says "with lib.lua", so each operation stays one EVALSHA. Only what a script
-- needs goes in front of it (src/backend/redis/modes.rs, `lib_for`): everything above
-- the first helper, and each `local function` it calls, directly or through another,
-- with the comment lines just above it. Redis runs the whole text on every call.
--
-- The wait queue (fair and read-write locks) is Redisson RFairLock's pair of keys:
--   Q  list  redisson_lock_queue:{NAME}    waiters in arrival order
--   Z  zset  redisson_lock_timeout:{NAME}  waiter -> evict-at (server time, ms)
-- Unlike Redisson (whose timeouts chain from the waiter ahead and are fixed when the
-- waiter arrives), a waiter's evict-at is "now + waiter timeout", refreshed on every poll,
-- so a live waiter keeps its place however long the holder keeps the lock, and a waiter
-- that stopped polling is evicted one waiter timeout after its last poll.
--
-- Read-write entries carry their mode: '<owner>:read', '<owner>:write'. Any other entry
-- (a fair-lock waiter, a Redisson waiter) excludes whoever is behind it, like a writer.
--
-- Read holds are Redisson RReadWriteLock's: a hash field '<owner>' -> read holds, and one
-- lease key per hold, '<P>:<owner>:rwlock_timeout:<i>' (i = 1..holds, value 1), where P
-- is '{NAME}' (or NAME when it already has a hash tag).
--
-- Permits are a hash at NAME ('holds:<owner>' -> holds) and a zset E
-- (tower_lock_permits:{NAME}, owner -> expires-at in server ms); both expire with the
-- longest lease.
--
-- Fencing tokens (fenced requests only) come from Redisson RFencedLock's counter
-- redisson_lock_token:{NAME}, one for every kind of lock on NAME, which expires a token
-- retention after its last token (see `fence`).
--
-- Every key named here shares NAME's hash slot.

-- Redis 3.2-4.x need this before a write that follows TIME; later versions always
-- replicate scripts by effects.
if redis.replicate_commands then
    redis.replicate_commands()
end

-- The server's clock in microseconds.
local function clock_us()
    local t = redis.call('time')
    return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- The server's clock in milliseconds: one clock for every client's deadlines.
local function now_ms()
    return math.floor(clock_us() / 1000)
end

-- Whether an attempt arrived after its deadline (server clock in microseconds; '0' or
-- absent: none), at `now_us`. Its sender has given up on it by then: it must change
-- nothing (src/backend/clock.rs says how the deadline is set).
local function late(deadline, now_us)
    deadline = tonumber(deadline) or 0
    return deadline > 0 and now_us > deadline
end

-- Drops the waiters at the head of the queue whose evict-at has passed (or that have
-- none). Returns whether any were dropped.
local function evict_stale(Q, Z, now)
    local evicted = false
    while true do
        local head = redis.call('lindex', Q, '0')
        if not head then
            return evicted
        end
        local at = redis.call('zscore', Z, head)
        if at and tonumber(at) > now then
            return evicted
        end
        redis.call('lpop', Q)
        redis.call('zrem', Z, head)
        evicted = true
    end
end

-- Puts `entry` at the tail of the queue, or refreshes its place, with the given
-- evict-at. Both keys expire a waiter timeout after the last poll, so a queue whose
-- waiters all vanished does not stay in Redis.
local function touch(Q, Z, entry, evict_at, timeout)
    if redis.call('zadd', Z, evict_at, entry) == 1 then
        redis.call('rpush', Q, entry)
    end
    if redis.call('pttl', Q) < timeout then
        redis.call('pexpire', Q, timeout)
    end
    if redis.call('pttl', Z) < timeout then
        redis.call('pexpire', Z, timeout)
    end
end

-- Removes `entry` from the queue; returns whether it was there. (An entry left in the
-- list without a timeout counts as stale and is evicted when it reaches the head.)
local function leave(Q, Z, entry)
    if redis.call('zrem', Z, entry) == 1 then
        redis.call('lrem', Q, '0', entry)
        return true
    end
    return false
end

-- Fair lock: when the lock is free, the head of the queue is told to try now, on its
-- own channel '<CHAN>:<owner>' (Redisson's).
local function wake_fair(H, Q, CHAN)
    if redis.call('exists', H) == 0 then
        local head = redis.call('lindex', Q, '0')
        if head then
            redis.call('publish', CHAN .. ':' .. head, '0')
        end
    end
end

local function is_reader(entry)
    return string.sub(entry, -5) == ':read'
end

local function is_write_field(field)
    return string.sub(field, -6) == ':write'
end

-- For a reader's entry: the evict-at of the first live exclusive entry (writer, fair
-- waiter) ahead of it in the queue, or nil when none is. Stale exclusive entries met on
-- the way are evicted. Returns that, and whether anything was evicted.
local function writer_ahead(Q, Z, entry, now)
    local start, evicted = 0, false
    while true do
        local chunk = redis.call('lrange', Q, start, start + 63)
        if #chunk == 0 then
            return nil, evicted
        end
        local removed = 0
        for _, e in ipairs(chunk) do
            if e == entry then
                return nil, evicted
            end
            if not is_reader(e) then
                local at = redis.call('zscore', Z, e)
                if at and tonumber(at) > now then
                    return tonumber(at), evicted
                end
                redis.call('lrem', Q, '1', e)
                redis.call('zrem', Z, e)
                removed = removed + 1
                evicted = true
            end
        end
        start = start + #chunk - removed
    end
end

-- The i-th lease key of read-hold field `field`.
local function lease_key(P, field, i)
    return P .. ':' .. field .. ':rwlock_timeout:' .. i
end

-- Whether a read hold of `count` holds still has a lease key alive.
local function reader_live(P, field, count)
    for i = count, 1, -1 do
        if redis.call('exists', lease_key(P, field, i)) == 1 then
            return true
        end
    end
    return false
end

-- The longest remaining lease among the lease keys of a read hold (-2: none alive).
local function reader_pttl(P, field, count)
    local longest = -2
    for i = count, 1, -1 do
        local ttl = redis.call('pttl', lease_key(P, field, i))
        if ttl > longest then
            longest = ttl
        end
    end
    return longest
end

local function drop_leases(P, field, count)
    for i = 1, count do
        redis.call('del', lease_key(P, field, i))
    end
end

-- Sets the existing key's lease to at least `ms`: never shortens it, and a key without
-- expiry keeps none. Every renewal, re-entry and partial release writes leases through
-- this (or its max), so no reordering of them can end a lease early.
local function extend(H, ms)
    local pttl = redis.call('pttl', H)
    if pttl >= 0 and pttl < ms then
        redis.call('pexpire', H, ms)
    end
end

-- The release channel of the Redisson RLock hash H, as Redisson names it (in H's
-- cluster slot): redisson_lock__channel:{H}, or redisson_lock__channel:H when H has a
-- hash tag already.
local function channel_of(H)
    if string.find(H, '{', 1, true) then
        return 'redisson_lock__channel:' .. H
    end
    return 'redisson_lock__channel:{' .. H .. '}'
end

-- Releases one hold of `owner` on the Redisson RLock hash H, exactly as
-- lock_release.lua does (the exclusive batch and the replay store release with this):
-- -1 not held, nothing changed; 0 released: H deleted and '0' ("wake one waiter")
-- published on H's channel (`channel_of`), as Redisson's unlock does; n > 0 holds left,
-- H's lease extended to `lease` ms (never shortened).
local function release_hold(H, lease, owner)
    local holds = redis.call('hget', H, owner)
    if not holds then
        return -1
    end
    if holds ~= '1' then
        holds = redis.call('hincrby', H, owner, '-1')
        if holds > 0 then
            extend(H, tonumber(lease))
            return holds
        end
    end
    redis.call('del', H)
    redis.call('publish', channel_of(H), '0')
    return 0
end

-- The next fencing token of counter F (Redisson RFencedLock's
-- redisson_lock_token:{NAME}): INCR, raised to the server clock in microseconds so that
-- tokens keep increasing when the counter is lost. F expires `keep` ms (the backend's
-- token retention) after its token would be reached by the clock: once it is gone the
-- clock is past every token it gave, so the next counter, starting from the clock, is
-- above them all, unless the clock steps back by more than `keep` meanwhile. So a name
-- locked once leaves nothing behind for longer than that.
local function fence(F, keep)
    local t = redis.call('time')
    local floor = tonumber(t[1]) * 1000000 + tonumber(t[2])
    local token = redis.call('incr', F)
    if token < floor then
        redis.call('set', F, string.format('%.0f', floor))
        token = floor
    end
    redis.call('pexpire', F,
        string.format('%.0f', math.floor((token - floor) / 1000) + tonumber(keep)))
    return token
end

-- An acquisition's reply: {1, holds}, with the next token when fenced (`retention`,
-- the token retention in ms; '0': not fenced).
local function granted(holds, F, retention)
    if retention ~= '0' then
        return {1, holds, fence(F, retention)}
    end
    return {1, holds}
end

-- Walks the read-write hash: drops read holds whose leases all ended (a reader that
-- crashed), deletes the hash when no hold is left. Returns whether a writer holds it,
-- and the longest remaining read lease (-2: no reader).
local function prune_rw(H, P)
    local flat = redis.call('hgetall', H)
    local writer = false
    local longest = -2
    local holds = 0
    for i = 1, #flat, 2 do
        local field, value = flat[i], flat[i + 1]
        if field ~= 'mode' then
            if is_write_field(field) then
                writer = true
                holds = holds + 1
            else
                local count = tonumber(value) or 0
                local ttl = -2
                if count > 0 then
                    ttl = reader_pttl(P, field, count)
                end
                if ttl == -2 then
                    redis.call('hdel', H, field)
                    drop_leases(P, field, count)
                else
                    holds = holds + 1
                    if ttl == -1 or (longest ~= -1 and ttl > longest) then
                        longest = ttl
                    end
                end
            end
        end
    end
    if holds == 0 and #flat > 0 then
        redis.call('del', H)
    end
    return writer, longest
end

-- Read-write lock: tells the queued waiters the holds now admit. Readers before the
-- first exclusive entry go when no writer holds the lock (or the writer is their own
-- owner); an exclusive entry goes when it is at the head and the lock is free. Each is
-- told on its own channel '<CHAN>:<entry>'.
local function wake_rw(H, Q, CHAN)
    local exists = redis.call('exists', H) == 1
    local mode = redis.call('hget', H, 'mode')
    if exists and not mode then
        return -- another kind of lock holds the name
    end
    local start = 0
    while true do
        local chunk = redis.call('lrange', Q, start, start + 63)
        if #chunk == 0 then
            return
        end
        for n, entry in ipairs(chunk) do
            if is_reader(entry) then
                local owner = string.sub(entry, 1, -6)
                if mode == 'write' and redis.call('hexists', H, owner .. ':write') == 0 then
                    return
                end
                redis.call('publish', CHAN .. ':' .. entry, '0')
            else
                if start + n == 1 and not exists then
                    redis.call('publish', CHAN .. ':' .. entry, '0')
                end
                return
            end
        end
        start = start + 64
    end
end

-- The poll interval of queued waiters: a third of the waiter timeout.
local function poll_cap(ttl, timeout)
    local poll = math.max(1, math.floor(timeout / 3))
    if ttl == nil or ttl < 0 or ttl > poll then
        return poll
    end
    return ttl
end


-- Renews one read or write hold if the owner still holds it: 1, else 0. A read hold's
-- lease keys are extended to the lease; a write hold's lease is the hash's (never
-- shorter than the owner's own read holds). Nothing is shortened.
local function renew_rw(H, P, lease, owner, reading)
    if reading then
        local count = tonumber(redis.call('hget', H, owner) or '0') or 0
        if count <= 0 or not reader_live(P, owner, count) then
            return 0
        end
        for i = 1, count do
            extend(lease_key(P, owner, i), lease)
        end
        extend(H, lease)
        return 1
    end
    if redis.call('hexists', H, owner .. ':write') == 0 then
        return 0
    end
    local own = redis.call('hget', H, owner)
    local ms = lease
    if own then
        ms = math.max(ms, reader_pttl(P, owner, tonumber(own) or 0))
    end
    extend(H, ms)
    return 1
end

-- Permits: drops the holders whose lease ended; returns how many.
--
-- A permit's end is "now + lease" on the server's clock in whole milliseconds, rounded
-- down, so it may be up to a millisecond short of the lease counted from the moment the
-- script ran. Like Redis' own key expiry, a permit therefore ends only once the clock
-- has passed its end (score < now), which makes it last at least its whole lease: its
-- holder, which counts the lease from before it sent the request, never believes in a
-- permit the store has already handed to someone else.
local function prune_permits(H, E, now)
    local gone = redis.call('zrangebyscore', E, '-inf', '(' .. now)
    for _, owner in ipairs(gone) do
        redis.call('hdel', H, 'holds:' .. owner)
    end
    if #gone > 0 then
        redis.call('zremrangebyscore', E, '-inf', '(' .. now)
    end
    return #gone
end

-- Permits: both keys expire with the longest lease, and go when nobody holds a permit.
local function fit_permits(H, E, now)
    local last = redis.call('zrange', E, '-1', '-1', 'withscores')
    if #last == 0 then
        redis.call('del', H, E)
        return
    end
    -- Through the last permit's end (which is still live at score == now).
    local ms = math.max(1, tonumber(last[2]) - now + 1)
    redis.call('pexpire', H, ms)
    redis.call('pexpire', E, ms)
end

-- Permits: renews the owner's permit if it still holds one: 1, else 0. Its end moves
-- later, never earlier.
local function renew_permit(H, E, lease, owner, now)
    local at = redis.call('zscore', E, owner)
    if not at or tonumber(at) < now then
        return 0
    end
    redis.call('zadd', E, math.max(tonumber(at), now + lease), owner)
    fit_permits(H, E, now)
    return 1
end
