-- One attempt to take the name $1 exclusively for the owner $2 (lease $3 ms, fenced $4,
-- deadline $5: the database clock in microseconds after which its sender has given up
-- on it, 0: none; $6: a fast grant, committed without waiting for the disk), as one
-- statement on the name's row in `__T___names`: taken when the
-- row has no live hold of another owner and no hold of another mode lives
-- (`others_until`), re-entered by its owner, inserted for a name never seen. The row
-- lock serializes it with every other operation on the name. Answers (acquired, holds,
-- token, ttl_ms) as `_acquire` does. The backend sends it as is; `_lock_x` (and
-- `_acquire` for mode 'x') runs the same text.
--
-- What the row cannot tell, an owner given up for good (`__T___gone`), is read in the
-- statement's snapshot, and `gen` covers what the snapshot missed: `_abandon` bumps it,
-- so an attempt that read the old value and reached the row after the abandonment
-- takes nothing.
--
-- A busy attempt marks the row wanted (`wanted_until`) until a while after what blocks
-- it ends (when the waiter comes back by itself): a release notifies only a wanted
-- name. Marked under the row lock, after the release if any: it answers 0 (try again
-- now) when it finds the row free.
--
-- A waiter's attempt is this statement with the lines marked `--W:` in it, and two
-- more parameters: $7, its process's liveness key, and $8, when it stops waiting (the
-- database clock in microseconds, 0: never). One that finds the name busy
-- registers the waiter in `__T___waiters`, for a release to hand it the name
-- (`_hand_over`), and answers `holds` 1 when it did; one that takes it leaves. One
-- that finds the name already handed to it (its owner, live) takes it as it is: the
-- hold count stays 1, and no new token is taken. Everyone else's attempts leave that
-- table alone.
--
-- While the epoch gate is closed (`_gate`: after a crash of a server where fast grants
-- were made), nothing is granted.
--
-- The backend fills in two parts this shares with `sql/lock_x_batch.sql`: the gate's
-- reading (`sql/gate.sql`) and the grant's change of the row (`sql/take_x.sql`).
--
-- The parts that write (`up`, `busy`; a waiter's follow from theirs) wait for a row no
-- longer than `__WAIT_MS__` ms (`_within`: the backend's response timeout; 0 in the
-- body of `_lock_x`, whose caller has bounded its transaction already).
--
-- `_grant` commits a grant synchronously (a fast one, and anything else, without
-- waiting for the disk), and refuses a session not in READ COMMITTED.
WITH seen AS (
    SELECT n.gen FROM __S__.__T___names n WHERE n.name = $1
), gate AS (
__GATE__
), up AS (
    INSERT INTO __S__.__T___names AS n (name, owner, holds, expires_at, fenced, token)
    SELECT $1, $2, 1, clock_timestamp() + $3 * interval '1 millisecond', $4,
           CASE WHEN $4 THEN __S__.__T___now_us() END
     WHERE ($5 = 0 OR __S__.__T___now_us() <= $5)
       AND NOT EXISTS (SELECT 1 FROM __S__.__T___gone g
                        WHERE g.name = $1 AND g.owner = $2 AND g.until > clock_timestamp())
       AND coalesce((SELECT gt.ready_at FROM gate gt) <= clock_timestamp(), true)
       AND __S__.__T___within(__WAIT_MS__)
    ON CONFLICT (name) DO UPDATE
__TAKE__
       AND n.gen IS NOT DISTINCT FROM (SELECT s.gen FROM seen s)
       AND ($5 = 0 OR __S__.__T___now_us() <= $5)
       AND coalesce((SELECT gt.ready_at FROM gate gt) <= clock_timestamp(), true)
    RETURNING n.holds, n.token
--W: ), taken AS (
--W:     -- A waiter that took the name waits no more.
--W:     DELETE FROM __S__.__T___waiters w
--W:      WHERE w.name = $1 AND w.owner = $2 AND EXISTS (SELECT 1 FROM up)
), busy AS (
    UPDATE __S__.__T___names n
       SET wanted_until = greatest(n.wanted_until,
                                   greatest(n.others_until,
                                            CASE WHEN n.owner IS NOT NULL THEN n.expires_at END)
                                   + interval '2 seconds')
     WHERE n.name = $1 AND NOT EXISTS (SELECT 1 FROM up)
       AND ($5 = 0 OR __S__.__T___now_us() <= $5)
       AND NOT EXISTS (SELECT 1 FROM __S__.__T___gone g
                        WHERE g.name = $1 AND g.owner = $2 AND g.until > clock_timestamp())
       AND __S__.__T___within(__WAIT_MS__)
    RETURNING ceil(extract(epoch FROM
                   greatest(clock_timestamp(), n.others_until,
                            CASE WHEN n.owner IS NOT NULL THEN n.expires_at END,
                            (SELECT gt.ready_at FROM gate gt))
                   - clock_timestamp()) * 1000)::bigint AS ttl_ms,
              n.wanted_until, n.gen
--W: ), waits AS (
--W:     -- Registered (or refreshed) as long as the name is marked wanted; not when an
--W:     -- abandonment of the owner overtook this attempt's snapshot (`gen`).
--W:     INSERT INTO __S__.__T___waiters AS w
--W:            (name, owner, since, asked_at, until, gives_up_us, lease_ms, fenced, fast, live)
--W:     SELECT $1, $2, clock_timestamp(), clock_timestamp(), b.wanted_until, $8, $3, $4, $6, $7
--W:       FROM busy b
--W:      WHERE b.gen IS NOT DISTINCT FROM (SELECT s.gen FROM seen s)
--W:     ON CONFLICT (name, owner) DO UPDATE
--W:        SET asked_at = excluded.asked_at, until = excluded.until,
--W:            gives_up_us = excluded.gives_up_us,
--W:            lease_ms = excluded.lease_ms, fenced = excluded.fenced, fast = excluded.fast,
--W:            live = excluded.live
--W:     RETURNING 1
)
SELECT __S__.__T___grant(true, $6), u.holds, CASE WHEN $4 THEN u.token END, NULL::bigint
  FROM up u
UNION ALL
SELECT __S__.__T___grant(false, $6),
       0
--W:    + (SELECT count(*) FROM waits)::integer
       , NULL::bigint, b.ttl_ms
  FROM busy b
UNION ALL
-- Refused (-2: after its deadline; -1: an owner given up), the gate closed (until it
-- opens), or the row was not there to mark (0: try again).
SELECT __S__.__T___grant(false, $6), 0, NULL::bigint,
       CASE WHEN $5 <> 0 AND __S__.__T___now_us() > $5 THEN -2::bigint
            WHEN EXISTS (SELECT 1 FROM __S__.__T___gone g
                          WHERE g.name = $1 AND g.owner = $2 AND g.until > clock_timestamp())
            THEN -1::bigint
            ELSE coalesce((SELECT ceil(extract(epoch FROM gt.ready_at - clock_timestamp())
                                       * 1000)::bigint
                             FROM gate gt WHERE gt.ready_at > clock_timestamp()), 0)
       END
 WHERE NOT EXISTS (SELECT 1 FROM up) AND NOT EXISTS (SELECT 1 FROM busy)
