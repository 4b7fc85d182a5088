    -- The epoch gate, as the exclusive acquisitions read it (the `gate` of
    -- `sql/lock_x.sql` and `sql/lock_x_batch.sql`, filled in by the backend): when it
    -- opens (no row, or NULL: it is open), as `_gate` answers. `_gate` itself runs
    -- only when the epoch is gone, to set it. Scalar lookups, not a join of the two
    -- tables: joined, the planner estimates the statement above `jit_above_cost` on
    -- tables without statistics.
    SELECT CASE WHEN NOT EXISTS (SELECT 1 FROM __S__.__T___fast) THEN NULL::timestamptz
                WHEN NOT EXISTS (SELECT 1 FROM __S__.__T___epoch) THEN __S__.__T___gate()
                ELSE (SELECT CASE WHEN e.ready_at > clock_timestamp() THEN e.ready_at END
                        FROM __S__.__T___epoch e)
           END AS ready_at
