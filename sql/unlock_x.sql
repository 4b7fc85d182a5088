-- Releases one exclusive hold of the owner $2 on the name $1 (a remaining hold's lease
-- extended to $3 ms, never shortened): what `_release` does for mode 'x', as one
-- statement on the name's row, which stays, free, for the next hold. `_left`
-- answers 0 (released) or the holds left, and commits without waiting for the disk.
-- A release that would free a name a waiter marked wanted, or that finds nothing to
-- release, is `_hand_over`'s instead: it hands the name to a registered waiter
-- (answering -2), or frees it and notifies the release (origin $4). The backend sends
-- it as is; `_unlock_x` runs the same text. It waits for the row no longer than
-- `__WAIT_MS__` ms (`_within`, evaluated before anything else).
WITH r AS (
    UPDATE __S__.__T___names n
       SET holds = n.holds - 1,
           owner = CASE WHEN n.holds > 1 THEN n.owner END,
           expires_at = CASE WHEN n.holds > 1
                             THEN greatest(n.expires_at,
                                           clock_timestamp() + $3 * interval '1 millisecond')
                             ELSE clock_timestamp() END
     WHERE n.name = $1 AND n.owner = $2 AND n.expires_at > clock_timestamp()
       AND (n.holds > 1 OR n.wanted_until <= clock_timestamp())
    RETURNING n.holds
)
SELECT CASE WHEN EXISTS (SELECT 1 FROM r)
            THEN __S__.__T___left((SELECT r.holds FROM r))
            ELSE __S__.__T___hand_over($1, $2, $3, $4) END
 WHERE __S__.__T___within(__WAIT_MS__)
