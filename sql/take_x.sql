       -- How an exclusive grant changes the name's row, and when the row lets one be
       -- made (free, expired, or held by the same owner; no other mode's hold alive):
       -- the same for one attempt and for a batch (filled into `sql/lock_x.sql` and
       -- `sql/lock_x_batch.sql` by the backend). A waiter's attempt takes the lines
       -- marked for it: its hold count stays 1, and a hand-over's token is kept.
       SET owner = excluded.owner,
           holds = CASE WHEN n.owner = excluded.owner AND n.expires_at > clock_timestamp()
                        THEN n.holds + 1
--W:                         - 1
                        ELSE 1 END,
           expires_at = CASE WHEN n.owner = excluded.owner AND n.expires_at > clock_timestamp()
                             THEN greatest(n.expires_at, excluded.expires_at)
                             ELSE excluded.expires_at END,
           fenced = excluded.fenced
                    OR coalesce(n.owner = excluded.owner AND n.expires_at > clock_timestamp()
                                AND n.fenced, false),
           token = CASE WHEN excluded.fenced
--W:                         AND NOT (n.owner = excluded.owner AND n.expires_at > clock_timestamp())
                        THEN greatest(coalesce(n.token, 0) + 1, excluded.token)
                        ELSE n.token END
     WHERE (n.owner IS NULL OR n.owner = excluded.owner OR n.expires_at <= clock_timestamp())
       AND n.others_until <= clock_timestamp()
