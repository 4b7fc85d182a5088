-- The PostgreSQL backend's schema: tables and functions, created on first use (or by
-- PostgresBackend::migrate). `__S__` is the schema and `__T__` the table name
-- (validated identifiers); every object is named after the table, so two backends with
-- different tables share nothing.
--
-- Every state change is one function call: one statement, one transaction. Every name
-- ever locked has one row in `__T___names`, whose row lock serializes the operations on
-- the name: the exclusive mode lives in that row, updated in place (one statement, no
-- advisory lock, no new row per hold); the other modes keep a row per hold in `__T__`
-- and also take a transaction-scoped advisory lock on (hash of the table, hash of the
-- name), then the name's row. The database's clock decides every lease
-- (clock_timestamp()), never the client's. Grants, renewals, abandonments and stored
-- records commit synchronously whatever the session's `synchronous_commit`; releases
-- and busy attempts do not.
--
-- Modes, as one letter: 'x' exclusive, 'f' fair, 'r' read, 'w' write, 'p' permit.

-- One row per name: its exclusive hold (owner NULL or expires_at past: none), its
-- newest fencing token (every mode's; tokens must not go backwards), and
-- `others_until`, the latest lease end of the name's holds in other modes (rows of
-- `__T__`), which an exclusive attempt must wait out without reading `__T__`. `gen`
-- counts the changes an exclusive attempt cannot see in the row itself (an owner given
-- up for good): an attempt whose snapshot saw another `gen` takes nothing.
-- `wanted_until`: until when a waiter may still count on a notification of the release
-- (set by busy attempts; a release nobody waits for notifies nobody). Updated in
-- place; only `name` is indexed, so updates are HOT. A free row idle for an hour is
-- swept (by client registration, as the other expired rows).
CREATE TABLE IF NOT EXISTS __S__.__T___names (
    name         text        PRIMARY KEY,
    owner        text,
    holds        integer     NOT NULL DEFAULT 0,
    expires_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    fenced       boolean     NOT NULL DEFAULT false,
    token        bigint,
    others_until timestamptz NOT NULL DEFAULT '-infinity',
    gen          bigint      NOT NULL DEFAULT 0,
    wanted_until timestamptz NOT NULL DEFAULT '-infinity'
) WITH (fillfactor = 50);

ALTER TABLE __S__.__T___names SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

CREATE TABLE IF NOT EXISTS __S__.__T__ (
    name       text        NOT NULL,
    owner      text        NOT NULL,
    mode       "char"      NOT NULL,
    holds      integer     NOT NULL,
    expires_at timestamptz NOT NULL,
    token      bigint,
    PRIMARY KEY (name, owner, mode)
);

-- Waiters of the queued modes (fair, read, write), in arrival order; a waiter that
-- stops polling is evicted at evict_at.
CREATE TABLE IF NOT EXISTS __S__.__T___queue (
    name     text        NOT NULL,
    owner    text        NOT NULL,
    mode     "char"      NOT NULL,
    seq      bigserial   NOT NULL,
    evict_at timestamptz NOT NULL,
    PRIMARY KEY (name, owner, mode)
);

-- Before the names table (kept, emptied below): the newest fencing token of
-- every name ever locked fenced, and a sequence. Tokens now live in `__T___names`.
CREATE TABLE IF NOT EXISTS __S__.__T___fence (
    name  text   PRIMARY KEY,
    token bigint NOT NULL
);

CREATE SEQUENCE IF NOT EXISTS __S__.__T___token;

-- Every hold leaves a dead row: vacuum these small, hot tables often.
ALTER TABLE __S__.__T__ SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);
ALTER TABLE __S__.__T___queue SET (autovacuum_vacuum_scale_factor = 0, autovacuum_vacuum_threshold = 1000);

-- Owners given up for good (LockBackend::abandon), until every attempt of theirs that
-- may still arrive (over another of the pool's connections) could only be late.
CREATE TABLE IF NOT EXISTS __S__.__T___gone (
    name  text        NOT NULL,
    owner text        NOT NULL,
    until timestamptz NOT NULL,
    PRIMARY KEY (name, owner)
);

-- Waiters of exclusive locks, which a release hands the lock to (`_hand_over`), oldest
-- first (`since`). A waiter's attempt that finds the name busy registers it (or
-- refreshes it: `asked_at`, when that attempt ran) until a while after what blocks it
-- (`until`, when it comes back by itself); its attempt that takes the name, or its
-- leaving (`_unwait`, `_abandon`), removes it. `live` is the key of the advisory lock
-- its process's listening session holds: a waiter whose session is gone (its process
-- died) is never handed a lock. `gives_up_us`: the database clock in microseconds
-- when the waiter stops waiting (0: never), past which it is not handed the lock
-- either (it may be gone before its leaving removes it).
CREATE TABLE IF NOT EXISTS __S__.__T___waiters (
    name     text        NOT NULL,
    owner    text        NOT NULL,
    since    timestamptz NOT NULL,
    asked_at timestamptz NOT NULL,
    until    timestamptz NOT NULL,
    gives_up_us bigint   NOT NULL,
    lease_ms bigint      NOT NULL,
    fenced   boolean     NOT NULL,
    fast     boolean     NOT NULL,
    live     integer     NOT NULL,
    PRIMARY KEY (name, owner)
);

-- Fast grants (PostgresBackendBuilder::fast_grants): a row here says that exclusive
-- grants of this table may commit without waiting for the disk, with leases up to
-- `max_lease_ms`. Logged, so it outlives a crash.
CREATE TABLE IF NOT EXISTS __S__.__T___fast (
    id           integer PRIMARY KEY CHECK (id = 1),
    max_lease_ms bigint  NOT NULL
);

-- The epoch gate of fast grants. UNLOGGED: crash recovery (and a standby's promotion)
-- empties it. With a row in `__T___fast` and none here, a crash may have lost grants
-- their clients were told about: nothing is granted, in any mode, until `ready_at`,
-- one max lease after the first attempt that found the gate gone (and set it), when
-- every lost grant's lease has ended.
CREATE UNLOGGED TABLE IF NOT EXISTS __S__.__T___epoch (
    id       integer     PRIMARY KEY CHECK (id = 1),
    ready_at timestamptz NOT NULL
);

-- Client names (LockClientBuilder::name), for inspection from any process.
CREATE TABLE IF NOT EXISTS __S__.__T___clients (
    id         text        PRIMARY KEY,
    name       text        NOT NULL,
    expires_at timestamptz NOT NULL
);

-- Records kept for replay (ReplayStore, for the Idempotency-Key layer): one per lock
-- name, written only by a hold of that name (`_replay_store`), with the fencing token
-- it carried; absent once expired, and deleted soon after (see `_replay_store`).
CREATE TABLE IF NOT EXISTS __S__.__T___replay (
    name       text        PRIMARY KEY,
    token      bigint      NOT NULL,
    record     bytea       NOT NULL,
    expires_at timestamptz NOT NULL
);

CREATE INDEX IF NOT EXISTS __T___replay_expires_at ON __S__.__T___replay (expires_at);

-- From the version before the names table: its fencing tokens and exclusive holds move
-- into `__T___names`, and the names of its other holds learn `others_until`. (Each
-- migration runs this; once moved, there is nothing left to move.)
INSERT INTO __S__.__T___names AS n (name, token)
SELECT f.name, f.token FROM __S__.__T___fence f
ON CONFLICT (name) DO UPDATE SET token = greatest(n.token, excluded.token);
DELETE FROM __S__.__T___fence;
INSERT INTO __S__.__T___names AS n (name, owner, holds, expires_at, fenced, token)
SELECT t.name, t.owner, t.holds, t.expires_at, t.token IS NOT NULL, t.token
  FROM __S__.__T__ t WHERE t.mode = 'x' AND t.expires_at > clock_timestamp()
ON CONFLICT (name) DO UPDATE
   SET owner = excluded.owner, holds = excluded.holds, expires_at = excluded.expires_at,
       fenced = excluded.fenced, token = greatest(n.token, excluded.token);
DELETE FROM __S__.__T__ WHERE mode = 'x';
INSERT INTO __S__.__T___names AS n (name, others_until)
SELECT t.name, max(t.expires_at) FROM __S__.__T__ t
 WHERE t.expires_at > clock_timestamp() GROUP BY t.name
ON CONFLICT (name) DO UPDATE SET others_until = greatest(n.others_until, excluded.others_until);

-- Refuses a session that does not run READ COMMITTED: the functions wait for the
-- name's advisory lock and must then see what the holder before them committed, which
-- a REPEATABLE READ or SERIALIZABLE snapshot (taken before the wait) would not.
CREATE OR REPLACE FUNCTION __S__.__T___read_committed() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        RAISE EXCEPTION 'tower-lock needs transactions in read committed isolation, this session runs %',
            current_setting('transaction_isolation')
            USING ERRCODE = '0A000',
                  HINT = 'reset default_transaction_isolation for the lock pool''s connections';
    END IF;
END $$;

-- Makes this transaction commit synchronously whatever the session says: a grant, a
-- renewal or an abandonment the client is told about must survive a crash of the
-- server, or a failover to a synchronous standby, or afterwards a second owner is
-- granted a lock the first still believes it holds. A session with
-- `synchronous_commit = off` (a common pool setting for speed) would otherwise hear
-- "acquired" before the grant is on disk, and one with `local` before the synchronous
-- standbys (`synchronous_standby_names`) have it: both are raised to `on`, which
-- waits for the local flush and for those standbys. The stronger settings are kept.
-- Local to the transaction, i.e. the one statement that called the function: it holds
-- at that statement's commit, and the session keeps its setting.
CREATE OR REPLACE FUNCTION __S__.__T___durable() RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('synchronous_commit') IN ('off', 'local') THEN
        PERFORM set_config('synchronous_commit', 'on', true);
    END IF;
END $$;

-- The database's clock in microseconds since the epoch.
CREATE OR REPLACE FUNCTION __S__.__T___now_us() RETURNS bigint
LANGUAGE sql VOLATILE AS $$
    SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
$$;

-- Bounds every lock wait left in the caller's transaction (a row's, a name's advisory
-- lock, `NOTIFY`'s) to `p_ms` milliseconds, when positive: the backend's response
-- timeout, after which the statement's sender no longer waits for its answer. A
-- statement stalled behind a lock would otherwise go on waiting in the server after
-- its sender gave up, and keep its pool connection (the pool takes a connection back
-- only once its statement has answered) for as long as the stall lasted. True; plain
-- SQL, which PostgreSQL inlines. Every statement the backend sends evaluates it before
-- anything it could wait for: as a filter of each part that locks rows, as an
-- argument of the functions it calls.
CREATE OR REPLACE FUNCTION __S__.__T___within(p_ms bigint) RETURNS boolean
LANGUAGE sql AS $$
    SELECT p_ms <= 0 OR set_config('lock_timeout', p_ms::text, true) IS NOT NULL
$$;

-- `p_value` once `_within(p_ms)` has run: an argument of a function the backend calls,
-- evaluated before the function runs.
CREATE OR REPLACE FUNCTION __S__.__T___within(p_value anyelement, p_ms bigint)
RETURNS anyelement
LANGUAGE sql AS $$
    SELECT CASE WHEN __S__.__T___within(p_ms) THEN p_value END
$$;

-- Locks the row of `p_name` in `__T___names` (creating it), for the modes kept in
-- `__T__`, and returns when its exclusive hold ends (NULL: none), which blocks them.
-- Every function takes the advisory lock of the name first, then this row, then rows
-- of `__T__`; the exclusive statements take the row alone.
CREATE OR REPLACE FUNCTION __S__.__T___lock_name(p_name text) RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    x_owner text;
    x_until timestamptz;
BEGIN
    LOOP
        SELECT n.owner, n.expires_at INTO x_owner, x_until
          FROM __S__.__T___names n WHERE n.name = p_name FOR UPDATE;
        IF FOUND THEN
            RETURN CASE WHEN x_owner IS NOT NULL AND x_until > clock_timestamp() THEN x_until END;
        END IF;
        INSERT INTO __S__.__T___names (name) VALUES (p_name) ON CONFLICT (name) DO NOTHING;
    END LOOP;
END $$;

-- Sets `others_until` of `p_name`, whose row the caller has locked, to the end of the
-- latest unexpired hold of the name in `__T__` (after a release, which may lower it).
CREATE OR REPLACE FUNCTION __S__.__T___others(p_name text) RETURNS void
LANGUAGE sql AS $$
    UPDATE __S__.__T___names n
       SET others_until = coalesce((SELECT max(t.expires_at) FROM __S__.__T__ t
                                     WHERE t.name = p_name AND t.expires_at > clock_timestamp()),
                                   '-infinity')
     WHERE n.name = p_name
$$;

-- The next fencing token of `p_name`, whose row the caller has locked: at least the
-- clock in microseconds (as every backend promises) and above the name's last token.
CREATE OR REPLACE FUNCTION __S__.__T___next_token(p_name text) RETURNS bigint
LANGUAGE sql AS $$
    UPDATE __S__.__T___names n
       SET token = greatest(coalesce(n.token, 0) + 1, __S__.__T___now_us())
     WHERE n.name = p_name
    RETURNING n.token
$$;

-- When the epoch gate opens (NULL: it is open), setting it one max lease ahead when a
-- crash emptied it. See `__T___epoch`. Every grant of every mode asks it first.
CREATE OR REPLACE FUNCTION __S__.__T___gate() RETURNS timestamptz
LANGUAGE plpgsql AS $$
DECLARE
    max_ms bigint;
    ready timestamptz;
BEGIN
    SELECT f.max_lease_ms INTO max_ms FROM __S__.__T___fast f;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    SELECT e.ready_at INTO ready FROM __S__.__T___epoch e;
    IF NOT FOUND THEN
        INSERT INTO __S__.__T___epoch (id, ready_at)
        VALUES (1, clock_timestamp() + max_ms * interval '1 millisecond')
        ON CONFLICT (id) DO NOTHING;
        SELECT e.ready_at INTO ready FROM __S__.__T___epoch e;
    END IF;
    -- Not readable (never expected): closed, for a moment.
    ready := coalesce(ready, clock_timestamp() + interval '100 milliseconds');
    RETURN CASE WHEN ready > clock_timestamp() THEN ready END;
END $$;

-- Lets this table's exclusive grants be fast, with leases up to `p_max_lease_ms`: the
-- mark (raised, never lowered) commits synchronously before any fast grant is made.
-- The first time, the gate opens at once: no fast grant can have been lost before.
CREATE OR REPLACE FUNCTION __S__.__T___enable_fast(p_max_lease_ms bigint) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    first boolean := NOT EXISTS (SELECT 1 FROM __S__.__T___fast);
BEGIN
    PERFORM __S__.__T___durable();
    INSERT INTO __S__.__T___fast (id, max_lease_ms) VALUES (1, p_max_lease_ms)
    ON CONFLICT (id) DO UPDATE
       SET max_lease_ms = greatest(__S__.__T___fast.max_lease_ms, excluded.max_lease_ms);
    IF first THEN
        INSERT INTO __S__.__T___epoch (id, ready_at) VALUES (1, clock_timestamp())
        ON CONFLICT (id) DO NOTHING;
    END IF;
END $$;

-- What a lock attempt's transaction commits as: a grant synchronously (`_durable`)
-- unless `p_fast`; anything else (a busy or refused attempt, which changed at most a
-- mark) without waiting for the disk. Refuses a session not in READ COMMITTED. Returns
-- `p_acquired`. Plain SQL, one expression, so that PostgreSQL inlines it into the
-- statement that calls it instead of running a function (the lock statements call it
-- on every attempt): keep it so, and its arguments simple (a column, a constant or a
-- parameter; one with a subquery in it is used once).
DROP FUNCTION IF EXISTS __S__.__T___lock_x(text, text, bigint, boolean, bigint);
DROP FUNCTION IF EXISTS __S__.__T___grant(boolean);

CREATE OR REPLACE FUNCTION __S__.__T___grant(p_acquired boolean, p_fast boolean) RETURNS boolean
LANGUAGE sql AS $$
    SELECT CASE WHEN current_setting('transaction_isolation') <> 'read committed'
                THEN __S__.__T___read_committed() IS NULL -- raises
                WHEN set_config('synchronous_commit',
                                CASE WHEN NOT p_acquired OR p_fast THEN 'off'
                                     WHEN current_setting('synchronous_commit') IN ('off', 'local')
                                     THEN 'on'
                                     ELSE current_setting('synchronous_commit') END,
                                true) IS NULL
                THEN NULL
                ELSE p_acquired END
$$;

-- What a release that freed no name a waiter wants, or kept holds, commits as: without
-- waiting for the disk (lost in a crash, the hold ends with its lease). Refuses a
-- session not in READ COMMITTED. Returns `p_left`, -1 for none (not held): `_released`
-- without a notification, in plain SQL that PostgreSQL inlines (see `_grant`).
CREATE OR REPLACE FUNCTION __S__.__T___left(p_left integer) RETURNS integer
LANGUAGE sql AS $$
    SELECT CASE WHEN current_setting('transaction_isolation') <> 'read committed'
                THEN CASE WHEN __S__.__T___read_committed() IS NULL THEN -1 END -- raises
                WHEN set_config('synchronous_commit', 'off', true) IS NULL THEN NULL
                ELSE coalesce(p_left, -1) END
$$;

-- What an exclusive release's transaction commits as (without waiting for the disk: lost
-- in a crash, the hold ends with its lease), and its notification: when the release
-- freed the name (`p_left` 0) and a waiter marked it wanted. Refuses a session not in
-- READ COMMITTED. Returns `p_left`, -1 for none (not held).
CREATE OR REPLACE FUNCTION __S__.__T___released(
    p_left integer, p_wanted boolean, p_name text, p_origin text) RETURNS integer
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('transaction_isolation') <> 'read committed' THEN
        PERFORM __S__.__T___read_committed();
    END IF;
    PERFORM set_config('synchronous_commit', 'off', true);
    IF p_left = 0 AND p_wanted THEN
        PERFORM pg_notify('__T__', '0' || p_origin || '|' || p_name);
    END IF;
    RETURN coalesce(p_left, -1);
END $$;

-- `_acquire` for mode 'x': the statement of `sql/lock_x.sql`, which the backend also
-- sends as is.
CREATE OR REPLACE FUNCTION __S__.__T___lock_x(
    p_name text, p_owner text, p_lease_ms bigint, p_fenced boolean, p_deadline_us bigint,
    p_fast boolean, OUT acquired boolean, OUT holds integer, OUT token bigint, OUT ttl_ms bigint)
LANGUAGE sql AS $$
__LOCK_X__
$$;

-- Releases one exclusive hold of `p_owner` on `p_name` (a remaining hold's lease
-- extended to `p_lease_ms`, never shortened), as `sql/unlock_x.sql` does, which calls
-- this when the release frees a name a waiter marked wanted. Freed, the name goes to
-- its oldest registered waiter (`__T___waiters`) still there and waiting, not given
-- up for good (`__T___gone`) and whose process lives (the advisory lock of `live` is
-- held), in the same transaction: the waiter's lease, a token if it asked for one. The
-- grant commits as the waiter's own would (`_grant`), and the notification
-- `g<origin>|<token>|<valid_us>|<owner length>|<owner>|<name>` tells the waiter's
-- process, which then needs no statement of its own: `valid_us` is the lease's end
-- counted from when the waiter last asked (`asked_at`), which the waiter measures
-- from the send of that attempt. Without such a waiter, the name is freed and the
-- release notified as `_released` does. Returns -1 (not held), 0 (released), -2
-- (released and handed to a waiter: the waiter's process wakes it) or the holds left.
CREATE OR REPLACE FUNCTION __S__.__T___hand_over(
    p_name text, p_owner text, p_lease_ms bigint, p_origin text) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n record;
    w record;
    now_ts timestamptz;
    next_token bigint;
BEGIN
    SELECT * INTO n FROM __S__.__T___names x WHERE x.name = p_name FOR UPDATE;
    now_ts := clock_timestamp();
    IF NOT FOUND OR n.owner IS DISTINCT FROM p_owner OR n.expires_at <= now_ts THEN
        RETURN __S__.__T___released(NULL, false, p_name, p_origin);
    END IF;
    IF n.holds > 1 THEN
        UPDATE __S__.__T___names x
           SET holds = x.holds - 1,
               expires_at = greatest(x.expires_at, now_ts + p_lease_ms * interval '1 millisecond')
         WHERE x.name = p_name;
        RETURN __S__.__T___released(n.holds - 1, false, p_name, p_origin);
    END IF;
    IF n.others_until <= now_ts AND __S__.__T___gate() IS NULL THEN
        FOR w IN SELECT * FROM __S__.__T___waiters q
                  WHERE q.name = p_name AND q.until > now_ts
                    AND (q.gives_up_us = 0 OR q.gives_up_us > __S__.__T___now_us())
                  ORDER BY q.since, q.owner FOR UPDATE
        LOOP
            IF EXISTS (SELECT 1 FROM __S__.__T___gone g
                        WHERE g.name = p_name AND g.owner = w.owner AND g.until > now_ts)
               OR pg_try_advisory_xact_lock(hashtext('__S__.__T__ waiters'), w.live) THEN
                -- Given up, or its process is gone (nobody holds its session's lock).
                DELETE FROM __S__.__T___waiters q WHERE q.name = p_name AND q.owner = w.owner;
                CONTINUE;
            END IF;
            next_token := CASE WHEN w.fenced
                               THEN greatest(coalesce(n.token, 0) + 1, __S__.__T___now_us())
                               ELSE n.token END;
            UPDATE __S__.__T___names x
               SET owner = w.owner, holds = 1,
                   expires_at = now_ts + w.lease_ms * interval '1 millisecond',
                   fenced = w.fenced, token = next_token
             WHERE x.name = p_name;
            DELETE FROM __S__.__T___waiters q WHERE q.name = p_name AND q.owner = w.owner;
            PERFORM __S__.__T___grant(true, w.fast);
            PERFORM pg_notify('__T__',
                'g' || p_origin
                || '|' || CASE WHEN w.fenced THEN next_token ELSE 0 END
                || '|' || greatest(0, (extract(epoch FROM now_ts - w.asked_at) * 1000000)::bigint
                                      + w.lease_ms * 1000)
                || '|' || octet_length(w.owner) || '|' || w.owner || '|' || p_name);
            RETURN -2;
        END LOOP;
    END IF;
    UPDATE __S__.__T___names x SET owner = NULL, holds = 0, expires_at = now_ts
     WHERE x.name = p_name;
    RETURN __S__.__T___released(0, n.wanted_until > now_ts, p_name, p_origin);
END $$;

-- An exclusive waiter leaves (it gave up, or acquired some other way): out of
-- `__T___waiters`, and a lock a release handed it meanwhile goes on to the next
-- waiter (`_hand_over`). Commits as that hand-over does, else without waiting for the
-- disk: a registration that comes back after a crash is never handed anything, since
-- the crash ended the session whose liveness lock it names (a listener that
-- reconnects takes a lock of a new key).
CREATE OR REPLACE FUNCTION __S__.__T___unwait(p_name text, p_owner text, p_origin text)
RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM __S__.__T___read_committed();
    PERFORM 1 FROM __S__.__T___names n WHERE n.name = p_name FOR UPDATE;
    DELETE FROM __S__.__T___waiters q WHERE q.name = p_name AND q.owner = p_owner;
    IF EXISTS (SELECT 1 FROM __S__.__T___names n
                WHERE n.name = p_name AND n.owner = p_owner AND n.expires_at > clock_timestamp()) THEN
        PERFORM __S__.__T___hand_over(p_name, p_owner, 0, p_origin);
    ELSE
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
END $$;

-- `_release` for mode 'x': the statement of `sql/unlock_x.sql`, which the backend also
-- sends as is.
CREATE OR REPLACE FUNCTION __S__.__T___unlock_x(
    p_name text, p_owner text, p_lease_ms bigint, p_origin text) RETURNS integer
LANGUAGE sql AS $$
__UNLOCK_X__
$$;

-- `_lock_x` for several names at once: the statement of `sql/lock_x_batch.sql`, which
-- the backend also sends as is, to group the commits of exclusive attempts that arrive
-- together.
CREATE OR REPLACE FUNCTION __S__.__T___lock_x_batch(
    p_names text[], p_owners text[], p_leases_ms bigint[], p_fenced boolean[],
    p_deadlines_us bigint[], p_fast boolean[])
RETURNS TABLE (i bigint, acquired boolean, holds integer, token bigint, ttl_ms bigint)
LANGUAGE sql AS $$
__LOCK_X_BATCH__
$$;

-- `_unlock_x` for several names at once: the statement of `sql/unlock_x_batch.sql`,
-- which the backend also sends as is.
CREATE OR REPLACE FUNCTION __S__.__T___unlock_x_batch(
    p_names text[], p_owners text[], p_leases_ms bigint[], p_origin text)
RETURNS TABLE (i bigint, holds_left integer, durable boolean)
LANGUAGE sql AS $$
__UNLOCK_X_BATCH__
$$;

-- One attempt to take `p_name` for `p_owner` in `p_mode`.
-- Returns (acquired, holds, token, ttl_ms): holds and token of the grant, or the
-- remaining lease of what blocks (ttl_ms -1: none to tell; -2: refused, the attempt
-- ran after `p_deadline_us`, the database clock in microseconds since the epoch after
-- which its sender has given up on it (0: none) — a statement delayed on its way, or
-- kept waiting for the name's advisory lock, takes nothing then). A grant commits
-- synchronously (`_durable`); a busy attempt keeps the session's setting (a queue
-- place lost in a crash is taken again at the next poll).
CREATE OR REPLACE FUNCTION __S__.__T___acquire(
    p_name text, p_owner text, p_mode "char", p_max integer, p_lease_ms bigint,
    p_fenced boolean, p_writer text, p_waiter_ms bigint, p_deadline_us bigint,
    OUT acquired boolean, OUT holds integer, OUT token bigint, OUT ttl_ms bigint)
LANGUAGE plpgsql
-- Index scans, not bitmap scans: they mark the dead entries every acquisition leaves
-- (each hold is a new owner, so a new index key) as they pass, so later lookups of a
-- hot name skip them instead of rereading every one until the next VACUUM.
SET enable_bitmapscan = off
AS $$
DECLARE
    now_ts timestamptz;
    lease interval := p_lease_ms * interval '1 millisecond';
    queued boolean := p_mode IN ('f', 'r', 'w');
    blocked boolean;
    my_seq bigint;
    block_until timestamptz;
    x_until timestamptz;
BEGIN
    IF p_mode = 'x' THEN
        SELECT x.acquired, x.holds, x.token, x.ttl_ms INTO acquired, holds, token, ttl_ms
          FROM __S__.__T___lock_x(p_name, p_owner, p_lease_ms, p_fenced, p_deadline_us,
                                  false) x;
        RETURN;
    END IF;
    PERFORM __S__.__T___read_committed();
    -- Nothing is granted while the epoch gate is closed (a waiter comes back then).
    block_until := __S__.__T___gate();
    IF block_until IS NOT NULL THEN
        acquired := false;
        holds := 0;
        ttl_ms := greatest(1, ceil(extract(epoch FROM block_until - clock_timestamp()) * 1000))::bigint;
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtext('__S__.__T__'), hashtext(p_name));
    x_until := __S__.__T___lock_name(p_name);
    now_ts := clock_timestamp();
    DELETE FROM __S__.__T__ t WHERE t.name = p_name AND t.expires_at <= now_ts;
    IF queued THEN
        DELETE FROM __S__.__T___queue q WHERE q.name = p_name AND q.evict_at <= now_ts;
    END IF;

    -- Past its deadline (its sender gave up), or of an owner given up for good: a late
    -- attempt takes nothing and queues nowhere.
    IF p_deadline_us > 0 AND (extract(epoch FROM now_ts) * 1000000)::bigint > p_deadline_us THEN
        acquired := false;
        holds := 0;
        ttl_ms := -2;
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM __S__.__T___gone g
                WHERE g.name = p_name AND g.owner = p_owner AND g.until > now_ts) THEN
        acquired := false;
        holds := 0;
        ttl_ms := -1;
        RETURN;
    END IF;

    -- Re-entry: the owner already holds it in this mode.
    UPDATE __S__.__T__ t
       SET holds = t.holds + 1,
           expires_at = greatest(t.expires_at, now_ts + lease),
           token = CASE WHEN p_fenced THEN __S__.__T___next_token(p_name) ELSE t.token END
     WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode
    RETURNING t.holds, CASE WHEN p_fenced THEN t.token END INTO holds, token;
    IF FOUND THEN
        PERFORM __S__.__T___durable();
        UPDATE __S__.__T___names n SET others_until = greatest(n.others_until, now_ts + lease)
         WHERE n.name = p_name;
        IF queued THEN
            DELETE FROM __S__.__T___queue q
             WHERE q.name = p_name AND q.owner = p_owner AND q.mode = p_mode;
        END IF;
        acquired := true;
        RETURN;
    END IF;

    -- What the holds allow.
    IF p_mode = 'r' THEN
        SELECT max(t.expires_at) INTO block_until FROM __S__.__T__ t
         WHERE t.name = p_name AND t.mode <> 'r'
           AND NOT (t.mode = 'w' AND t.owner = coalesce(p_writer, p_owner));
    ELSIF p_mode = 'p' THEN
        SELECT max(t.expires_at) INTO block_until FROM __S__.__T__ t
         WHERE t.name = p_name AND t.mode <> 'p';
        IF block_until IS NULL
           AND (SELECT count(*) FROM __S__.__T__ t WHERE t.name = p_name) >= p_max THEN
            SELECT min(t.expires_at) INTO block_until FROM __S__.__T__ t
             WHERE t.name = p_name;
        END IF;
    ELSE
        SELECT max(t.expires_at) INTO block_until FROM __S__.__T__ t WHERE t.name = p_name;
    END IF;
    -- An exclusive hold (in the name's row) blocks every mode; its release must then
    -- notify (see `sql/lock_x.sql`).
    IF x_until IS NOT NULL THEN
        block_until := greatest(block_until, x_until);
        UPDATE __S__.__T___names n
           SET wanted_until = greatest(n.wanted_until, x_until + interval '2 seconds')
         WHERE n.name = p_name;
    END IF;
    blocked := block_until IS NOT NULL;

    -- What the queue allows: nobody ahead (for readers: no writer or fair waiter
    -- ahead). A reader let in past its own owner's write hold (downgrade) skips it.
    IF queued AND NOT blocked
       AND NOT (p_mode = 'r' AND EXISTS (
           SELECT 1 FROM __S__.__T__ t
            WHERE t.name = p_name AND t.mode = 'w' AND t.owner = coalesce(p_writer, p_owner))) THEN
        SELECT q.seq INTO my_seq FROM __S__.__T___queue q
         WHERE q.name = p_name AND q.owner = p_owner AND q.mode = p_mode;
        blocked := EXISTS (
            SELECT 1 FROM __S__.__T___queue q
             WHERE q.name = p_name
               AND (my_seq IS NULL OR q.seq < my_seq)
               AND (p_mode <> 'r' OR q.mode <> 'r'));
    END IF;

    IF NOT blocked THEN
        PERFORM __S__.__T___durable();
        holds := 1;
        token := CASE WHEN p_fenced THEN __S__.__T___next_token(p_name) END;
        INSERT INTO __S__.__T__ (name, owner, mode, holds, expires_at, token)
        VALUES (p_name, p_owner, p_mode, 1, now_ts + lease, token);
        UPDATE __S__.__T___names n SET others_until = greatest(n.others_until, now_ts + lease)
         WHERE n.name = p_name;
        IF queued THEN
            DELETE FROM __S__.__T___queue q
             WHERE q.name = p_name AND q.owner = p_owner AND q.mode = p_mode;
        END IF;
        acquired := true;
        RETURN;
    END IF;

    acquired := false;
    holds := 0;
    ttl_ms := CASE WHEN block_until IS NULL THEN -1
                   ELSE greatest(0, ceil(extract(epoch FROM block_until - now_ts) * 1000))::bigint
              END;
    IF queued THEN
        -- In line (or still in line), for another waiter timeout; come back within a
        -- third of it.
        INSERT INTO __S__.__T___queue (name, owner, mode, evict_at)
        VALUES (p_name, p_owner, p_mode, now_ts + p_waiter_ms * interval '1 millisecond')
        ON CONFLICT (name, owner, mode) DO UPDATE SET evict_at = excluded.evict_at;
        IF ttl_ms < 0 OR ttl_ms > p_waiter_ms / 3 THEN
            ttl_ms := greatest(1, p_waiter_ms / 3);
        END IF;
    END IF;
END $$;

-- Releases one hold of `p_owner` in `p_mode`: -1 not held, 0 released, n holds left.
-- A release that frees the lock notifies the channel: '0<origin>|<name>' wakes one
-- waiter per process (exclusive, permit), '1<origin>|<name>' all of them (queued
-- modes); the releasing backend (`p_origin`) has woken its own waiters already.
DROP FUNCTION IF EXISTS __S__.__T___release(text, text, "char", bigint);

CREATE OR REPLACE FUNCTION __S__.__T___release(
    p_name text, p_owner text, p_mode "char", p_lease_ms bigint, p_origin text) RETURNS integer
LANGUAGE plpgsql
-- Index scans, not bitmap scans: they mark the dead entries every acquisition leaves
-- (each hold is a new owner, so a new index key) as they pass, so later lookups of a
-- hot name skip them instead of rereading every one until the next VACUUM.
SET enable_bitmapscan = off
AS $$
DECLARE
    now_ts timestamptz;
    left_holds integer;
BEGIN
    IF p_mode = 'x' THEN
        -- Handed to a waiter (-2) is released, as far as the releaser is concerned.
        left_holds := __S__.__T___unlock_x(p_name, p_owner, p_lease_ms, p_origin);
        RETURN CASE WHEN left_holds = -2 THEN 0 ELSE left_holds END;
    END IF;
    PERFORM __S__.__T___read_committed();
    -- A release need not wait for its commit to reach disk: lost in a crash, the hold
    -- ends with its lease (the holder is told nothing it could count on), and the next
    -- durable commit (a grant, a renewal) flushes it.
    PERFORM set_config('synchronous_commit', 'off', true);
    PERFORM pg_advisory_xact_lock(hashtext('__S__.__T__'), hashtext(p_name));
    PERFORM __S__.__T___lock_name(p_name);
    now_ts := clock_timestamp();
    UPDATE __S__.__T__ t
       SET holds = t.holds - 1,
           expires_at = greatest(t.expires_at, now_ts + p_lease_ms * interval '1 millisecond')
     WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode
       AND t.expires_at > now_ts AND t.holds > 1
    RETURNING t.holds INTO left_holds;
    IF FOUND THEN
        PERFORM __S__.__T___others(p_name);
        RETURN left_holds;
    END IF;
    DELETE FROM __S__.__T__ t
     WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode
       AND t.expires_at > now_ts;
    IF NOT FOUND THEN
        -- Not held (any more): an expired row of it goes too.
        DELETE FROM __S__.__T__ t
         WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode;
        RETURN -1;
    END IF;
    PERFORM __S__.__T___others(p_name);
    PERFORM pg_notify('__T__',
        CASE WHEN p_mode IN ('f', 'r', 'w') THEN '1' ELSE '0' END || p_origin || '|' || p_name);
    RETURN 0;
END $$;

-- Releases one hold of `p_owner` exactly as `_release` does (it is called, and its
-- outcome returned as `released`), and in the same transaction keeps `p_record` for
-- `p_ttl_ms` under `p_name` when the hold was still there (the release found it
-- unexpired on the database clock) and no unexpired record with a greater token than
-- `p_token` is kept: `stored`. The lock of the name's row, taken by `_release`, is
-- held to the commit, so nothing of the name moves in between.
--
-- A stored record commits synchronously (`_durable`, over the session's own setting,
-- which `_release` turned off for its transaction): a response a retry is to replay
-- must survive a crash as a grant does, or the retry runs its request again. Without
-- a record, the release's asynchronous commit stands.
--
-- Each call also deletes up to 8 expired records of any name, skipping rows another
-- transaction has locked (so it never waits), after its own writes: records whose
-- names are never written again do not pile up.
CREATE OR REPLACE FUNCTION __S__.__T___replay_store(
    p_name text, p_owner text, p_mode "char", p_lease_ms bigint, p_origin text,
    p_token bigint, p_record bytea, p_ttl_ms bigint,
    OUT stored boolean, OUT released integer)
LANGUAGE plpgsql
SET enable_bitmapscan = off
AS $$
DECLARE
    session_commit text := current_setting('synchronous_commit');
    now_ts timestamptz;
BEGIN
    released := __S__.__T___release(p_name, p_owner, p_mode, p_lease_ms, p_origin);
    now_ts := clock_timestamp();
    stored := released >= 0 AND NOT EXISTS (
        SELECT 1 FROM __S__.__T___replay r
         WHERE r.name = p_name AND r.token > p_token AND r.expires_at > now_ts);
    IF stored THEN
        INSERT INTO __S__.__T___replay (name, token, record, expires_at)
        VALUES (p_name, p_token, p_record, now_ts + p_ttl_ms * interval '1 millisecond')
        ON CONFLICT (name) DO UPDATE
           SET token = excluded.token, record = excluded.record,
               expires_at = excluded.expires_at;
        PERFORM set_config('synchronous_commit', session_commit, true);
        PERFORM __S__.__T___durable();
    END IF;
    DELETE FROM __S__.__T___replay r
     WHERE r.name IN (SELECT x.name FROM __S__.__T___replay x
                       WHERE x.expires_at <= now_ts
                       ORDER BY x.expires_at
                       LIMIT 8
                       FOR UPDATE SKIP LOCKED)
       AND r.expires_at <= now_ts;
END $$;

-- `_acquire` for several names at once (group commit of the modes other than the
-- exclusive one, whose batches are `sql/lock_x_batch.sql`): one attempt a row, each on
-- a name of its own, called in name order in one transaction, so the names' advisory
-- locks and rows are taken in one order by every batch. Each attempt is exactly the
-- single call's (its deadline, its queue place, its grant); the transaction commits
-- to disk if any of them granted (`_durable` stays set). Answers (i, acquired, holds,
-- token, ttl_ms) per attempt, `i` its place in the arrays (from 1).
CREATE OR REPLACE FUNCTION __S__.__T___acquire_batch(
    p_names text[], p_owners text[], p_modes "char"[], p_max integer[],
    p_leases_ms bigint[], p_fenced boolean[], p_writers text[], p_waiter_ms bigint,
    p_deadlines_us bigint[])
RETURNS TABLE (i bigint, acquired boolean, holds integer, token bigint, ttl_ms bigint)
LANGUAGE sql AS $$
    SELECT q.i, a.acquired, a.holds, a.token, a.ttl_ms
      FROM (SELECT u.*
              FROM unnest(p_names, p_owners, p_modes, p_max, p_leases_ms, p_fenced,
                          p_writers, p_deadlines_us)
                   WITH ORDINALITY AS u(name, owner, mode, max, lease_ms, fenced, writer,
                                        deadline, i)
             ORDER BY u.name) q
     CROSS JOIN LATERAL __S__.__T___acquire(q.name, q.owner, q.mode, q.max, q.lease_ms,
                                            q.fenced, q.writer, p_waiter_ms, q.deadline) a
$$;

-- `_release` for several names at once, each of a name of its own, in name order, in
-- one transaction (which commits without waiting for the disk, as each release
-- does). Answers (i, left) per release.
CREATE OR REPLACE FUNCTION __S__.__T___release_batch(
    p_names text[], p_owners text[], p_modes "char"[], p_leases_ms bigint[], p_origin text)
RETURNS TABLE (i bigint, holds_left integer)
LANGUAGE sql AS $$
    SELECT q.i, __S__.__T___release(q.name, q.owner, q.mode, q.lease_ms, p_origin)
      FROM (SELECT u.*
              FROM unnest(p_names, p_owners, p_modes, p_leases_ms)
                   WITH ORDINALITY AS u(name, owner, mode, lease_ms, i)
             ORDER BY u.name) q
$$;

-- The previous version's signature, for its processes during a rolling upgrade: an
-- attempt without a deadline.
CREATE OR REPLACE FUNCTION __S__.__T___acquire(
    p_name text, p_owner text, p_mode "char", p_max integer, p_lease_ms bigint,
    p_fenced boolean, p_writer text, p_waiter_ms bigint,
    OUT acquired boolean, OUT holds integer, OUT token bigint, OUT ttl_ms bigint)
LANGUAGE sql AS $$
    SELECT * FROM __S__.__T___acquire(p_name, p_owner, p_mode, p_max, p_lease_ms,
                                      p_fenced, p_writer, p_waiter_ms, 0)
$$;

-- Renews many holds at once (the watchdog): which of them are still held. A lease is
-- extended, never shortened, so renewals that arrive out of order (over different
-- connections of a pool) never end a hold before a longer lease already granted. It
-- commits synchronously (`_durable`).
--
-- Holds of the modes kept in `__T__` also raise their names' `others_until`, which a
-- release may lower: the rows of every name are locked first, in name order, so that
-- no release of theirs runs between the renewal and the raise (and so that a batch of
-- attempts, which locks its rows in name order too, never waits for a renewal in a
-- cycle).
CREATE OR REPLACE FUNCTION __S__.__T___renew(
    p_names text[], p_owners text[], p_modes "char"[], p_lease_ms bigint[])
RETURNS SETOF integer
LANGUAGE plpgsql AS $$
DECLARE
    others text[];
BEGIN
    PERFORM __S__.__T___durable();
    SELECT array_agg(DISTINCT r.name ORDER BY r.name) INTO others
      FROM unnest(p_names, p_modes) AS r(name, mode) WHERE r.mode <> 'x';
    -- Every name's row, in name order, before any update: a batch of attempts locks
    -- its rows in name order too, so the two never wait for each other in a cycle.
    PERFORM 1 FROM __S__.__T___names n WHERE n.name = ANY (p_names)
      ORDER BY n.name FOR UPDATE;
    RETURN QUERY
    WITH x AS (
        UPDATE __S__.__T___names n
           SET expires_at = greatest(n.expires_at,
                                     clock_timestamp() + r.ms * interval '1 millisecond')
          FROM unnest(p_names, p_owners, p_modes, p_lease_ms) WITH ORDINALITY
               AS r(name, owner, mode, ms, i)
         WHERE r.mode = 'x' AND n.name = r.name AND n.owner = r.owner
           AND n.expires_at > clock_timestamp()
        RETURNING r.i
    ), o AS (
        UPDATE __S__.__T__ t
           SET expires_at = greatest(t.expires_at,
                                     clock_timestamp() + r.ms * interval '1 millisecond')
          FROM unnest(p_names, p_owners, p_modes, p_lease_ms) WITH ORDINALITY
               AS r(name, owner, mode, ms, i)
         WHERE r.mode <> 'x' AND t.name = r.name AND t.owner = r.owner AND t.mode = r.mode
           AND t.expires_at > clock_timestamp()
        RETURNING r.i
    )
    SELECT x.i::integer FROM x UNION ALL SELECT o.i::integer FROM o;
    IF others IS NOT NULL THEN
        UPDATE __S__.__T___names n
           SET others_until = greatest(n.others_until,
                                       (SELECT max(t.expires_at) FROM __S__.__T__ t
                                         WHERE t.name = n.name))
         WHERE n.name = ANY (others);
    END IF;
END $$;

-- Gives `p_owner` up for good: releases its hold (all of it) and its place in the
-- queue, and refuses its late attempts for `p_keep_ms`. It commits synchronously
-- (`_durable`): the record must outlive a crash as long as a late attempt could come.
CREATE OR REPLACE FUNCTION __S__.__T___abandon(
    p_name text, p_owner text, p_mode "char", p_keep_ms bigint) RETURNS void
LANGUAGE plpgsql
SET enable_bitmapscan = off
AS $$
DECLARE
    now_ts timestamptz;
BEGIN
    PERFORM __S__.__T___read_committed();
    PERFORM __S__.__T___durable();
    PERFORM pg_advisory_xact_lock(hashtext('__S__.__T__'), hashtext(p_name));
    PERFORM __S__.__T___lock_name(p_name);
    now_ts := clock_timestamp();
    INSERT INTO __S__.__T___gone (name, owner, until)
    VALUES (p_name, p_owner, now_ts + p_keep_ms * interval '1 millisecond')
    ON CONFLICT (name, owner) DO UPDATE SET until = greatest(__S__.__T___gone.until, excluded.until);
    -- An exclusive attempt of the owner still on its way, which read the old `gen`,
    -- takes nothing (see `_lock_x`); one that had already taken the row is released
    -- here.
    UPDATE __S__.__T___names n SET gen = n.gen + 1 WHERE n.name = p_name;
    IF p_mode = 'x' THEN
        DELETE FROM __S__.__T___waiters q WHERE q.name = p_name AND q.owner = p_owner;
        UPDATE __S__.__T___names n SET owner = NULL, holds = 0, expires_at = now_ts
         WHERE n.name = p_name AND n.owner = p_owner AND n.expires_at > now_ts;
        IF FOUND THEN
            PERFORM pg_notify('__T__', '1|' || p_name);
        END IF;
        RETURN;
    END IF;
    DELETE FROM __S__.__T__ t
     WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode AND t.expires_at > now_ts;
    IF FOUND THEN
        PERFORM __S__.__T___others(p_name);
        PERFORM pg_notify('__T__', '1|' || p_name);
    END IF;
    DELETE FROM __S__.__T___queue q
     WHERE q.name = p_name AND q.owner = p_owner AND q.mode = p_mode;
    IF FOUND THEN
        PERFORM pg_notify('__T__', '1|' || p_name);
    END IF;
END $$;

-- Leaves the queue (a waiter that gave up), and lets whoever is next try.
CREATE OR REPLACE FUNCTION __S__.__T___cancel(p_name text, p_owner text, p_mode "char")
RETURNS void
LANGUAGE plpgsql
-- Index scans, not bitmap scans: they mark the dead entries every acquisition leaves
-- (each hold is a new owner, so a new index key) as they pass, so later lookups of a
-- hot name skip them instead of rereading every one until the next VACUUM.
SET enable_bitmapscan = off
AS $$
BEGIN
    PERFORM __S__.__T___read_committed();
    PERFORM pg_advisory_xact_lock(hashtext('__S__.__T__'), hashtext(p_name));
    DELETE FROM __S__.__T___queue q
     WHERE q.name = p_name AND q.owner = p_owner AND q.mode = p_mode;
    IF FOUND THEN
        PERFORM pg_notify('__T__', '1|' || p_name);
    END IF;
END $$;

DROP FUNCTION IF EXISTS __S__.__T___force(text, "char"[]);

-- Removes the holds of `p_name` of the kind `p_mode` names, whoever holds them, as the
-- other backends do: 'x'/'f' the exclusive or fair hold; 'r' the read holds, only when
-- no writer holds the name; 'w' the write hold and the reads with it, only when a
-- writer holds it; 'p' every permit.
CREATE OR REPLACE FUNCTION __S__.__T___force(p_name text, p_mode "char")
RETURNS boolean
LANGUAGE plpgsql
-- Index scans, not bitmap scans: they mark the dead entries every acquisition leaves
-- (each hold is a new owner, so a new index key) as they pass, so later lookups of a
-- hot name skip them instead of rereading every one until the next VACUUM.
SET enable_bitmapscan = off
AS $$
DECLARE
    now_ts timestamptz;
    writer boolean;
    freed boolean;
BEGIN
    PERFORM __S__.__T___read_committed();
    PERFORM pg_advisory_xact_lock(hashtext('__S__.__T__'), hashtext(p_name));
    PERFORM __S__.__T___lock_name(p_name);
    now_ts := clock_timestamp();
    writer := EXISTS (SELECT 1 FROM __S__.__T__ t
                       WHERE t.name = p_name AND t.mode = 'w' AND t.expires_at > now_ts);
    IF p_mode IN ('x', 'f') THEN
        UPDATE __S__.__T___names n SET owner = NULL, holds = 0, expires_at = now_ts
         WHERE n.name = p_name AND n.owner IS NOT NULL AND n.expires_at > now_ts;
        freed := FOUND;
        DELETE FROM __S__.__T__ t
         WHERE t.name = p_name AND t.mode = 'f' AND t.expires_at > now_ts;
        freed := freed OR FOUND;
    ELSIF p_mode = 'r' AND NOT writer THEN
        DELETE FROM __S__.__T__ t
         WHERE t.name = p_name AND t.mode = 'r' AND t.expires_at > now_ts;
    ELSIF p_mode = 'w' AND writer THEN
        DELETE FROM __S__.__T__ t
         WHERE t.name = p_name AND t.mode IN ('r', 'w') AND t.expires_at > now_ts;
    ELSIF p_mode = 'p' THEN
        DELETE FROM __S__.__T__ t
         WHERE t.name = p_name AND t.mode = 'p' AND t.expires_at > now_ts;
    ELSE
        RETURN false;
    END IF;
    freed := coalesce(freed, FOUND);
    IF freed THEN
        PERFORM __S__.__T___others(p_name);
        PERFORM pg_notify('__T__', '1|' || p_name);
        RETURN true;
    END IF;
    RETURN false;
END $$;
