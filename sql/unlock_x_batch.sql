-- Several exclusive releases at once, each of a name of its own, in one statement and
-- one transaction: $1 the names (distinct), $2 their owners, $3 the leases in ms a
-- remaining hold is extended to, $4 the origin of the notifications. Each release is
-- what `sql/unlock_x.sql` does for its name alone: answered -1 (not held), 0
-- (released), -2 (handed to a waiter) or the holds left, as a row (i, left), `i` its
-- place in the arrays (from 1). The rows are locked in name order first (see
-- `sql/lock_x_batch.sql`). The transaction commits synchronously when a release
-- handed its name to a waiter (that is a grant), else without waiting for the disk;
-- `_unlock_x_batch` runs the same text. Its waits for a lock are bounded as the
-- batched attempts' are (`sql/lock_x_batch.sql`).
WITH req AS (
    -- Read through a subquery kept as it is, to be planned once (see
    -- `sql/lock_x_batch.sql`).
    SELECT r.name, r.owner, r.lease_ms, r.i
      FROM (SELECT $1::text[] AS names, $2::text[] AS owners, $3::bigint[] AS leases
             WHERE __S__.__T___within(__WAIT_MS__)
            OFFSET 0) a,
           unnest(a.names, a.owners, a.leases) WITH ORDINALITY AS r(name, owner, lease_ms, i)
), locked AS (
    SELECT n.name FROM __S__.__T___names n
     WHERE n.name IN (SELECT r.name FROM req r)
     ORDER BY n.name
       FOR UPDATE
), plain AS (
    UPDATE __S__.__T___names n
       SET holds = n.holds - 1,
           owner = CASE WHEN n.holds > 1 THEN n.owner END,
           expires_at = CASE WHEN n.holds > 1
                             THEN greatest(n.expires_at,
                                           clock_timestamp() + r.lease_ms * interval '1 millisecond')
                             ELSE clock_timestamp() END
      FROM req r
     WHERE n.name = r.name AND n.name IN (SELECT l.name FROM locked l)
       AND n.owner = r.owner AND n.expires_at > clock_timestamp()
       AND (n.holds > 1 OR n.wanted_until <= clock_timestamp())
    RETURNING n.name, n.holds
), rest AS (
    -- A release that frees a name someone wants, or finds nothing to release.
    SELECT r.name, __S__.__T___hand_over(r.name, r.owner, r.lease_ms, $4) AS left
      FROM (SELECT q.* FROM req q WHERE q.name NOT IN (SELECT p.name FROM plain p)
             ORDER BY q.name) r
), answers AS (
    SELECT r.i, coalesce(p.holds, h.left) AS left
      FROM req r LEFT JOIN plain p ON p.name = r.name LEFT JOIN rest h ON h.name = r.name
), durable AS (
    -- How the transaction commits, set once after every release ran (the aggregate
    -- reads every answer first): to disk when one handed its name to a waiter.
    SELECT __S__.__T___grant(x.handed, false) AS durable
      FROM (SELECT coalesce(bool_or(a.left = -2), false) AS handed FROM answers a
             OFFSET 0) x -- kept a subquery: `_grant` inlined takes columns
)
SELECT a.i, a.left, d.durable FROM answers a CROSS JOIN durable d
