-- Several exclusive attempts at once, each on a name of its own, in one statement and
-- one transaction (group commit): $1 the names (distinct), $2 their owners, $3 the
-- leases in ms, $4 whether each is fenced, $5 each one's deadline and $6 whether each
-- may be granted fast, as the parameters of `sql/lock_x.sql`, whose rules this applies
-- to each name alone: every name is taken, marked wanted or refused exactly as that
-- statement would (a waiter's attempt is never batched). Answers a row (i, acquired,
-- holds, token, ttl_ms) per attempt, `i` its place in the arrays (from 1). The rows
-- are locked in name order, so two batches (or a batch and a batched release) never
-- wait for each other in a cycle. The transaction commits synchronously when it
-- granted an attempt that may not be granted fast, and otherwise without waiting for
-- the disk; `_lock_x_batch` runs the same text. Every row it locks comes from `req`,
-- read first, which bounds the transaction's waits for a lock to `__WAIT_MS__` ms
-- (`_within`, as in `sql/lock_x.sql`).
WITH req AS (
    -- The arrays are read through a subquery kept as it is (`OFFSET 0`), so that the
    -- planner estimates every call alike, whatever its arrays hold: as constants, the
    -- few names of a typical call made a plan of their own look cheaper every time,
    -- and the statement was planned afresh on each call (as long as running it).
    SELECT r.name, r.owner, r.lease_ms, r.fenced, r.deadline, r.fast, r.i
      FROM (SELECT $1::text[] AS names, $2::text[] AS owners, $3::bigint[] AS leases,
                   $4::boolean[] AS fenced, $5::bigint[] AS deadlines,
                   $6::boolean[] AS fast
             WHERE __S__.__T___within(__WAIT_MS__)
            OFFSET 0) a,
           unnest(a.names, a.owners, a.leases, a.fenced, a.deadlines, a.fast)
           WITH ORDINALITY AS r(name, owner, lease_ms, fenced, deadline, fast, i)
), seen AS (
    -- What each attempt's snapshot saw of its name (`gen`), and its deadline.
    SELECT r.name, n.gen, r.deadline
      FROM req r LEFT JOIN __S__.__T___names n ON n.name = r.name
), gate AS (
__GATE__
), up AS (
    INSERT INTO __S__.__T___names AS n (name, owner, holds, expires_at, fenced, token)
    SELECT r.name, r.owner, 1, clock_timestamp() + r.lease_ms * interval '1 millisecond',
           r.fenced, CASE WHEN r.fenced THEN __S__.__T___now_us() END
      FROM req r
     WHERE (r.deadline = 0 OR __S__.__T___now_us() <= r.deadline)
       AND NOT EXISTS (SELECT 1 FROM __S__.__T___gone g
                        WHERE g.name = r.name AND g.owner = r.owner AND g.until > clock_timestamp())
       AND coalesce((SELECT gt.ready_at FROM gate gt) <= clock_timestamp(), true)
     ORDER BY r.name
    ON CONFLICT (name) DO UPDATE
__TAKE__
       -- Checked under the row lock: the snapshot's `gen` still the row's, and the
       -- deadline not passed.
       AND (SELECT s.gen IS NOT DISTINCT FROM n.gen
                   AND (s.deadline = 0 OR __S__.__T___now_us() <= s.deadline)
              FROM seen s WHERE s.name = excluded.name)
       AND coalesce((SELECT gt.ready_at FROM gate gt) <= clock_timestamp(), true)
    RETURNING n.name, n.holds, n.token
), busy AS (
    UPDATE __S__.__T___names n
       SET wanted_until = greatest(n.wanted_until,
                                   greatest(n.others_until,
                                            CASE WHEN n.owner IS NOT NULL THEN n.expires_at END)
                                   + interval '2 seconds')
      FROM req r
     WHERE n.name = r.name AND r.name NOT IN (SELECT u.name FROM up u)
       AND (r.deadline = 0 OR __S__.__T___now_us() <= r.deadline)
       AND NOT EXISTS (SELECT 1 FROM __S__.__T___gone g
                        WHERE g.name = r.name AND g.owner = r.owner AND g.until > clock_timestamp())
    RETURNING n.name,
              ceil(extract(epoch FROM
                   greatest(clock_timestamp(), n.others_until,
                            CASE WHEN n.owner IS NOT NULL THEN n.expires_at END,
                            (SELECT gt.ready_at FROM gate gt))
                   - clock_timestamp()) * 1000)::bigint AS ttl_ms
), granted AS (
    -- How the transaction commits; evaluated once, for every answer.
    SELECT __S__.__T___grant(x.acquired, x.fast) AS any
      FROM (SELECT EXISTS (SELECT 1 FROM up) AS acquired,
                   NOT EXISTS (SELECT 1 FROM up u JOIN req r ON r.name = u.name
                                WHERE NOT r.fast) AS fast
             OFFSET 0) x -- kept a subquery: `_grant` inlined takes columns
)
SELECT r.i, u.name IS NOT NULL AND g.any, coalesce(u.holds, 0),
       CASE WHEN r.fenced THEN u.token END,
       CASE WHEN u.name IS NOT NULL THEN NULL::bigint
            WHEN b.name IS NOT NULL THEN b.ttl_ms
            -- Refused (-2: after its deadline; -1: an owner given up), the gate closed
            -- (until it opens), or the row was not there to mark (0: try again).
            WHEN r.deadline <> 0 AND __S__.__T___now_us() > r.deadline THEN -2::bigint
            WHEN EXISTS (SELECT 1 FROM __S__.__T___gone x
                          WHERE x.name = r.name AND x.owner = r.owner AND x.until > clock_timestamp())
            THEN -1::bigint
            ELSE coalesce((SELECT ceil(extract(epoch FROM gt.ready_at - clock_timestamp())
                                       * 1000)::bigint
                             FROM gate gt WHERE gt.ready_at > clock_timestamp()), 0)
       END
  FROM req r CROSS JOIN granted g
  LEFT JOIN up u ON u.name = r.name
  LEFT JOIN busy b ON b.name = r.name
 ORDER BY r.i
