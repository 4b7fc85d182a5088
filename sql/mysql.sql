-- The MySQL/MariaDB backend's schema: tables and procedures, created on first use (or by
-- MySqlBackend::migrate). `__T__` is the table name (a validated identifier); every
-- object is named after it, so two backends with different tables share nothing.
-- Statements are separated by lines holding only `//` (the backend sends them one by
-- one: a procedure body has semicolons of its own).
--
-- Portable between MariaDB >= 10.6 and MySQL >= 8.0: InnoDB, JSON_TABLE, procedures
-- with their own transactions. Names and owners are VARBINARY, compared byte for byte
-- (a case-insensitive or PAD SPACE collation would make `Key` and `key ` one lock).
--
-- Every state change is one procedure call and one transaction, which first locks the
-- name's row in `__T___names`: that row lock serializes everything done to the name.
-- Each transaction runs READ COMMITTED, set for it alone, and bounds its lock waits
-- (innodb_lock_wait_timeout, restored before the call returns). The database's clock
-- (UTC_TIMESTAMP(6), read after the row lock is taken) decides every lease, in
-- microseconds since the epoch; never the client's. Durability is the server's
-- (innodb_flush_log_at_trx_commit), which the backend checks when it is built.
--
-- Every procedure that changes state has the same frame, which the backend fills in
-- (`BEGIN` and `COMMIT` in `src/backend/mysql/statements.rs`, at the placeholders named
-- after them): after the procedure's own declarations, the first bounds the row-lock
-- waits to `p_wait_s` seconds, rolls back and restores the session's bound on any error,
-- and starts the READ COMMITTED transaction; the second commits and restores the bound.
--
-- Modes, as one letter: 'x' exclusive, 'f' fair, 'r' read, 'w' write, 'p' permit.
//
-- What the procedures' versions are: a migration whose version is there already does
-- nothing, so that starting a process never drops a procedure another one is calling.
CREATE TABLE IF NOT EXISTS `__T___schema` (
    id      INT    NOT NULL PRIMARY KEY,
    version BIGINT NOT NULL
) ENGINE=InnoDB
//
-- One row per name: its newest fencing token (tokens must not go backwards: the row
-- outlives its holds for the token retention) and `released`, a counter every release
-- that frees a hold moves on (it starts at the clock in microseconds, so a row swept
-- and made again never repeats a value a waiter has seen).
CREATE TABLE IF NOT EXISTS `__T___names` (
    name     VARBINARY(1280) NOT NULL PRIMARY KEY,
    token    BIGINT          NOT NULL DEFAULT 0,
    released BIGINT          NOT NULL DEFAULT 0,
    idle_at  BIGINT          NOT NULL DEFAULT 0
) ENGINE=InnoDB
//
-- The holds, of every mode: (name, hold identity, mode), how many times held, when
-- the lease ends (microseconds since the epoch, on the database's clock), the token.
CREATE TABLE IF NOT EXISTS `__T__` (
    name       VARBINARY(1280) NOT NULL,
    owner      VARBINARY(128)  NOT NULL,
    mode       CHAR(1)         CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    holds      INT             NOT NULL,
    expires_us BIGINT          NOT NULL,
    token      BIGINT          NULL,
    PRIMARY KEY (name, owner, mode)
) ENGINE=InnoDB
//
-- Waiters of the queued modes (fair, read, write), in arrival order (`seq`); a waiter
-- that stops asking is evicted at `evict_us`.
CREATE TABLE IF NOT EXISTS `__T___queue` (
    name     VARBINARY(1280) NOT NULL,
    owner    VARBINARY(128)  NOT NULL,
    mode     CHAR(1)         CHARACTER SET ascii COLLATE ascii_bin NOT NULL,
    seq      BIGINT          NOT NULL AUTO_INCREMENT,
    evict_us BIGINT          NOT NULL,
    PRIMARY KEY (name, owner, mode),
    UNIQUE KEY (seq)
) ENGINE=InnoDB
//
-- Owners given up for good (LockBackend::abandon), until every attempt of theirs that
-- may still arrive (over another of the pool's connections) could only be late.
CREATE TABLE IF NOT EXISTS `__T___gone` (
    name     VARBINARY(1280) NOT NULL,
    owner    VARBINARY(128)  NOT NULL,
    until_us BIGINT          NOT NULL,
    PRIMARY KEY (name, owner)
) ENGINE=InnoDB
//
-- Client names (LockClientBuilder::name), for inspection from any process.
CREATE TABLE IF NOT EXISTS `__T___clients` (
    id         VARBINARY(128)  NOT NULL PRIMARY KEY,
    name       VARBINARY(1024) NOT NULL,
    expires_us BIGINT          NOT NULL
) ENGINE=InnoDB
//
-- Records kept for replay (ReplayStore): one per lock name, written only by a hold of
-- that name (`_replay_store`), with the fencing token it carried.
CREATE TABLE IF NOT EXISTS `__T___replay` (
    name       VARBINARY(1280) NOT NULL PRIMARY KEY,
    token      BIGINT          NOT NULL,
    record     LONGBLOB        NOT NULL,
    expires_us BIGINT          NOT NULL,
    KEY (expires_us)
) ENGINE=InnoDB
//
DROP PROCEDURE IF EXISTS `__T___lock_name`
//
-- Locks the row of `p_name` (creating it) and returns the database's clock, read
-- after the lock was granted. The caller has started the transaction.
CREATE PROCEDURE `__T___lock_name`(IN p_name VARBINARY(1280), OUT o_now BIGINT)
BEGIN
    INSERT INTO `__T___names` (name, released)
    VALUES (p_name, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)))
    ON DUPLICATE KEY UPDATE name = name;
    SET o_now = TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6));
END
//
DROP PROCEDURE IF EXISTS `__T___freed`
//
-- A hold of `p_name` was freed (its row is locked): moves the release counter on,
-- which the listeners of processes with waiters read.
CREATE PROCEDURE `__T___freed`(IN p_name VARBINARY(1280), IN p_now BIGINT)
BEGIN
    UPDATE `__T___names` SET released = released + 1, idle_at = p_now WHERE name = p_name;
END
//
DROP PROCEDURE IF EXISTS `__T___acquire`
//
-- One attempt to take `p_name` for `p_owner` in `p_mode`. Answers one row (acquired,
-- holds, token, ttl_ms, released): the hold count and token of a grant, or the
-- remaining lease of what blocks (ttl_ms -1: none to tell; -2: refused, the attempt
-- ran after `p_deadline_us`, the database clock in microseconds after which its sender
-- gave up on it (0: none)), and the name's release counter, from which the process's
-- listener tells a later release.
--
-- Kept short: each statement of a procedure costs the server tens of microseconds, the
-- most of a lock's cost here (see docs/performance.md). The name's row is locked by
-- the first statement; one statement then reads everything the attempt decides on.
-- Expired holds count as absent wherever they are read (the sweep deletes them); a
-- grant overwrites an expired row of its own hold.
CREATE PROCEDURE `__T___acquire`(
    IN p_name VARBINARY(1280), IN p_owner VARBINARY(128), IN p_mode CHAR(1), IN p_max INT,
    IN p_lease_ms BIGINT, IN p_fenced BOOLEAN, IN p_writer VARBINARY(128),
    IN p_waiter_ms BIGINT, IN p_deadline_us BIGINT, IN p_wait_s INT)
BEGIN
    DECLARE v_now BIGINT;
    DECLARE v_acquired BOOLEAN DEFAULT FALSE;
    DECLARE v_holds INT DEFAULT 0;
    DECLARE v_token BIGINT DEFAULT NULL;
    DECLARE v_last BIGINT;
    DECLARE v_ttl BIGINT DEFAULT -1;
    DECLARE v_block BIGINT DEFAULT NULL;
    DECLARE v_seq BIGINT DEFAULT NULL;
    DECLARE v_gone BOOLEAN;
    DECLARE v_blocked BOOLEAN;
    DECLARE v_released BIGINT DEFAULT 0;
    DECLARE v_queued BOOLEAN DEFAULT p_mode IN ('f', 'r', 'w');
    __BEGIN__
    INSERT INTO `__T___names` (name, released) VALUES (p_name, TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)))
    ON DUPLICATE KEY UPDATE name = name;
    SET v_now = TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6));
    attempt: BEGIN
        -- Past its deadline (its sender gave up), or of an owner given up for good: a
        -- late attempt takes nothing and queues nowhere.
        IF p_deadline_us > 0 AND v_now > p_deadline_us THEN
            SET v_ttl = -2;
            LEAVE attempt;
        END IF;
        -- What the attempt decides on: the name's counter and last token, whether the
        -- owner was given up, its own hold in this mode (re-entry), and until when the
        -- other holds block it.
        SELECT n.released, n.token,
               EXISTS (SELECT 1 FROM `__T___gone` g
                        WHERE g.name = p_name AND g.owner = p_owner AND g.until_us > v_now),
               COALESCE((SELECT t.holds FROM `__T__` t
                          WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode
                            AND t.expires_us > v_now), 0),
               CASE p_mode
               WHEN 'r' THEN
                   (SELECT MAX(t.expires_us) FROM `__T__` t
                     WHERE t.name = p_name AND t.expires_us > v_now AND t.mode <> 'r'
                       AND NOT (t.mode = 'w' AND t.owner = COALESCE(p_writer, p_owner)))
               WHEN 'p' THEN
                   COALESCE(
                       (SELECT MAX(t.expires_us) FROM `__T__` t
                         WHERE t.name = p_name AND t.expires_us > v_now AND t.mode <> 'p'),
                       (SELECT IF(COUNT(*) >= p_max, MIN(t.expires_us), NULL) FROM `__T__` t
                         WHERE t.name = p_name AND t.expires_us > v_now))
               ELSE
                   (SELECT MAX(t.expires_us) FROM `__T__` t
                     WHERE t.name = p_name AND t.expires_us > v_now)
               END
          INTO v_released, v_last, v_gone, v_holds, v_block
          FROM `__T___names` n WHERE n.name = p_name;
        IF v_gone THEN
            SET v_holds = 0;
            LEAVE attempt;
        END IF;
        IF p_fenced THEN
            SET v_token = GREATEST(v_last + 1, v_now);
        END IF;

        IF v_holds > 0 THEN
            -- Re-entry: the owner already holds it in this mode.
            UPDATE `__T__` t
               SET t.holds = t.holds + 1,
                   t.expires_us = GREATEST(t.expires_us, v_now + p_lease_ms * 1000),
                   t.token = IF(p_fenced, v_token, t.token)
             WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode;
            SET v_holds = v_holds + 1;
        ELSE
            SET v_blocked = v_block IS NOT NULL;
            IF v_queued THEN
                DELETE FROM `__T___queue` WHERE name = p_name AND evict_us <= v_now;
            END IF;
            -- What the queue allows: nobody ahead (for readers: no writer or fair
            -- waiter ahead). A reader let in past its own owner's write hold
            -- (downgrade) skips it.
            IF v_queued AND NOT v_blocked THEN
                IF NOT (p_mode = 'r' AND EXISTS (
                       SELECT 1 FROM `__T__` t
                        WHERE t.name = p_name AND t.mode = 'w' AND t.expires_us > v_now
                          AND t.owner = COALESCE(p_writer, p_owner))) THEN
                    SELECT q.seq INTO v_seq FROM `__T___queue` q
                     WHERE q.name = p_name AND q.owner = p_owner AND q.mode = p_mode;
                    SET v_blocked = EXISTS (
                        SELECT 1 FROM `__T___queue` q
                         WHERE q.name = p_name
                           AND (v_seq IS NULL OR q.seq < v_seq)
                           AND (p_mode <> 'r' OR q.mode <> 'r'));
                END IF;
            END IF;
            IF v_blocked THEN
                SET v_ttl = IF(v_block IS NULL, -1, GREATEST(0, CEIL((v_block - v_now) / 1000)));
                IF v_queued THEN
                    -- In line (or still in line), for another waiter timeout; come back
                    -- within a third of it.
                    INSERT INTO `__T___queue` (name, owner, mode, evict_us)
                    VALUES (p_name, p_owner, p_mode, v_now + p_waiter_ms * 1000)
                    ON DUPLICATE KEY UPDATE evict_us = VALUES(evict_us);
                    IF v_ttl < 0 OR v_ttl > p_waiter_ms DIV 3 THEN
                        SET v_ttl = GREATEST(1, p_waiter_ms DIV 3);
                    END IF;
                END IF;
                LEAVE attempt;
            END IF;
            INSERT INTO `__T__` (name, owner, mode, holds, expires_us, token)
            VALUES (p_name, p_owner, p_mode, 1, v_now + p_lease_ms * 1000, v_token)
            ON DUPLICATE KEY UPDATE holds = 1, expires_us = VALUES(expires_us),
                                    token = VALUES(token);
            SET v_holds = 1;
        END IF;
        SET v_acquired = TRUE;
        IF p_fenced THEN
            UPDATE `__T___names` SET token = v_token WHERE name = p_name;
        END IF;
        IF v_queued THEN
            DELETE FROM `__T___queue` WHERE name = p_name AND owner = p_owner AND mode = p_mode;
        END IF;
    END attempt;
    __COMMIT__
    SELECT CAST(v_acquired AS SIGNED) AS acquired, CAST(v_holds AS SIGNED) AS holds,
           CAST(IF(p_fenced AND v_acquired, v_token, NULL) AS SIGNED) AS token,
           CAST(v_ttl AS SIGNED) AS ttl_ms, CAST(v_released AS SIGNED) AS released;
END
//
DROP PROCEDURE IF EXISTS `__T___release_in`
//
-- Releases one hold of `p_owner` in `p_mode` inside the caller's transaction: -1 not
-- held, 0 released, n holds left (a remaining hold's lease extended to `p_lease_ms`,
-- never shortened). A release that frees a hold moves the name's counter on.
CREATE PROCEDURE `__T___release_in`(
    IN p_name VARBINARY(1280), IN p_owner VARBINARY(128), IN p_mode CHAR(1),
    IN p_lease_ms BIGINT, OUT o_left INT)
BEGIN
    DECLARE v_now BIGINT;
    DECLARE v_holds INT DEFAULT 0;
    DECLARE v_locked INT DEFAULT 0;
    SET o_left = -1;
    -- No row for the name: nothing of it is held.
    SELECT 1 INTO v_locked FROM `__T___names` WHERE name = p_name FOR UPDATE;
    SET v_now = TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6));
    SELECT COALESCE((SELECT t.holds FROM `__T__` t
                      WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode
                        AND t.expires_us > v_now), 0)
      INTO v_holds;
    IF v_holds > 1 THEN
        UPDATE `__T__` t
           SET t.holds = t.holds - 1,
               t.expires_us = GREATEST(t.expires_us, v_now + p_lease_ms * 1000)
         WHERE t.name = p_name AND t.owner = p_owner AND t.mode = p_mode;
        SET o_left = v_holds - 1;
    ELSEIF v_locked = 1 THEN
        -- Held once, or not (any more): an expired row of it goes too.
        DELETE FROM `__T__` WHERE name = p_name AND owner = p_owner AND mode = p_mode;
        IF v_holds = 1 THEN
            SET o_left = 0;
            UPDATE `__T___names` SET released = released + 1, idle_at = v_now
             WHERE name = p_name;
        END IF;
    END IF;
END
//
DROP PROCEDURE IF EXISTS `__T___release`
//
-- Releases one hold (see `_release_in`) and commits. Answers one row (left).
CREATE PROCEDURE `__T___release`(
    IN p_name VARBINARY(1280), IN p_owner VARBINARY(128), IN p_mode CHAR(1),
    IN p_lease_ms BIGINT, IN p_wait_s INT)
BEGIN
    DECLARE v_left INT;
    __BEGIN__
    CALL `__T___release_in`(p_name, p_owner, p_mode, p_lease_ms, v_left);
    __COMMIT__
    SELECT CAST(v_left AS SIGNED) AS holds_left;
END
//
DROP PROCEDURE IF EXISTS `__T___replay_store`
//
-- Releases one hold exactly as `_release` does, and in the same transaction keeps
-- `p_record` for `p_ttl_ms` under `p_name` when the hold was still there and no
-- unexpired record with a greater token than `p_token` is kept. The name's row stays
-- locked to the commit, so nothing of the name moves in between. Each call also
-- deletes up to 8 expired records of any name. Answers one row (stored, left).
CREATE PROCEDURE `__T___replay_store`(
    IN p_name VARBINARY(1280), IN p_owner VARBINARY(128), IN p_mode CHAR(1),
    IN p_lease_ms BIGINT, IN p_token BIGINT, IN p_record LONGBLOB,
    IN p_ttl_ms BIGINT, IN p_wait_s INT)
BEGIN
    DECLARE v_left INT;
    DECLARE v_now BIGINT;
    DECLARE v_stored BOOLEAN DEFAULT FALSE;
    __BEGIN__
    CALL `__T___release_in`(p_name, p_owner, p_mode, p_lease_ms, v_left);
    SET v_now = TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6));
    IF v_left >= 0 AND NOT EXISTS (
        SELECT 1 FROM `__T___replay` r
         WHERE r.name = p_name AND r.token > p_token AND r.expires_us > v_now) THEN
        INSERT INTO `__T___replay` (name, token, record, expires_us)
        VALUES (p_name, p_token, p_record, v_now + p_ttl_ms * 1000)
        ON DUPLICATE KEY UPDATE token = VALUES(token), record = VALUES(record),
                                expires_us = VALUES(expires_us);
        SET v_stored = TRUE;
    END IF;
    __COMMIT__
    -- Expired records of any name, a few per store, never waiting for a row another
    -- transaction holds.
    DELETE FROM `__T___replay` WHERE expires_us <= v_now ORDER BY expires_us LIMIT 8;
    SELECT CAST(v_stored AS SIGNED) AS stored, CAST(v_left AS SIGNED) AS holds_left;
END
//
DROP PROCEDURE IF EXISTS `__T___renew`
//
-- Renews many holds at once (the watchdog), given as a JSON array of
-- [name, owner, mode, lease_ms]: answers the places (from 1) of those still held, whose
-- leases now end no earlier than lease_ms from now (never shortened).
CREATE PROCEDURE `__T___renew`(IN p_holds LONGTEXT, IN p_wait_s INT)
BEGIN
    DECLARE v_now BIGINT;
    __BEGIN__
    SET v_now = TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6));
    UPDATE `__T__` t
      JOIN JSON_TABLE(p_holds, '$[*]' COLUMNS (
               name VARCHAR(1280) CHARACTER SET utf8mb4 PATH '$[0]',
               owner VARCHAR(128) CHARACTER SET utf8mb4 PATH '$[1]',
               mode VARCHAR(1) CHARACTER SET utf8mb4 PATH '$[2]',
               ms BIGINT PATH '$[3]')) r
        ON t.name = r.name AND t.owner = r.owner AND t.mode = r.mode
       SET t.expires_us = GREATEST(t.expires_us, v_now + r.ms * 1000)
     WHERE t.expires_us > v_now;
    SELECT CAST(r.i AS SIGNED) AS i FROM JSON_TABLE(p_holds, '$[*]' COLUMNS (
               i FOR ORDINALITY,
               name VARCHAR(1280) CHARACTER SET utf8mb4 PATH '$[0]',
               owner VARCHAR(128) CHARACTER SET utf8mb4 PATH '$[1]',
               mode VARCHAR(1) CHARACTER SET utf8mb4 PATH '$[2]')) r
      JOIN `__T__` t ON t.name = r.name AND t.owner = r.owner AND t.mode = r.mode
     WHERE t.expires_us > v_now;
    __COMMIT__
END
//
DROP PROCEDURE IF EXISTS `__T___abandon`
//
-- Gives `p_owner` up for good: releases its hold (all of it) and its place in the
-- queue, and refuses its late attempts for `p_keep_ms`.
CREATE PROCEDURE `__T___abandon`(
    IN p_name VARBINARY(1280), IN p_owner VARBINARY(128), IN p_mode CHAR(1),
    IN p_keep_ms BIGINT, IN p_wait_s INT)
BEGIN
    DECLARE v_now BIGINT;
    DECLARE v_freed INT DEFAULT 0;
    __BEGIN__
    CALL `__T___lock_name`(p_name, v_now);
    INSERT INTO `__T___gone` (name, owner, until_us)
    VALUES (p_name, p_owner, v_now + p_keep_ms * 1000)
    ON DUPLICATE KEY UPDATE until_us = GREATEST(until_us, VALUES(until_us));
    DELETE FROM `__T__`
     WHERE name = p_name AND owner = p_owner AND mode = p_mode AND expires_us > v_now;
    SET v_freed = ROW_COUNT();
    DELETE FROM `__T___queue` WHERE name = p_name AND owner = p_owner AND mode = p_mode;
    SET v_freed = v_freed + ROW_COUNT();
    IF v_freed > 0 THEN
        CALL `__T___freed`(p_name, v_now);
    END IF;
    __COMMIT__
END
//
DROP PROCEDURE IF EXISTS `__T___cancel`
//
-- Leaves the queue (a waiter that gave up), and lets whoever is next try.
CREATE PROCEDURE `__T___cancel`(
    IN p_name VARBINARY(1280), IN p_owner VARBINARY(128), IN p_mode CHAR(1), IN p_wait_s INT)
BEGIN
    DECLARE v_now BIGINT;
    __BEGIN__
    CALL `__T___lock_name`(p_name, v_now);
    DELETE FROM `__T___queue` WHERE name = p_name AND owner = p_owner AND mode = p_mode;
    IF ROW_COUNT() > 0 THEN
        CALL `__T___freed`(p_name, v_now);
    END IF;
    __COMMIT__
END
//
DROP PROCEDURE IF EXISTS `__T___force`
//
-- Removes the holds of `p_name` of the kind `p_mode` names, whoever holds them, as the
-- other backends do: 'x'/'f' the exclusive or fair hold; 'r' the read holds, only when
-- no writer holds the name; 'w' the write hold and the reads with it, only when a
-- writer holds it; 'p' every permit. Answers one row (freed).
CREATE PROCEDURE `__T___force`(IN p_name VARBINARY(1280), IN p_mode CHAR(1), IN p_wait_s INT)
BEGIN
    DECLARE v_now BIGINT;
    DECLARE v_writer BOOLEAN;
    DECLARE v_freed INT DEFAULT 0;
    __BEGIN__
    CALL `__T___lock_name`(p_name, v_now);
    SET v_writer = EXISTS (SELECT 1 FROM `__T__` t
                            WHERE t.name = p_name AND t.mode = 'w' AND t.expires_us > v_now);
    IF p_mode IN ('x', 'f') THEN
        DELETE FROM `__T__` WHERE name = p_name AND mode IN ('x', 'f') AND expires_us > v_now;
        SET v_freed = ROW_COUNT();
    ELSEIF p_mode = 'r' AND NOT v_writer THEN
        DELETE FROM `__T__` WHERE name = p_name AND mode = 'r' AND expires_us > v_now;
        SET v_freed = ROW_COUNT();
    ELSEIF p_mode = 'w' AND v_writer THEN
        DELETE FROM `__T__` WHERE name = p_name AND mode IN ('r', 'w') AND expires_us > v_now;
        SET v_freed = ROW_COUNT();
    ELSEIF p_mode = 'p' THEN
        DELETE FROM `__T__` WHERE name = p_name AND mode = 'p' AND expires_us > v_now;
        SET v_freed = ROW_COUNT();
    END IF;
    IF v_freed > 0 THEN
        CALL `__T___freed`(p_name, v_now);
    END IF;
    __COMMIT__
    SELECT CAST(v_freed > 0 AS SIGNED) AS freed;
END
//
DROP PROCEDURE IF EXISTS `__T___sweep`
//
-- Deletes up to `p_batch` rows of each table that nobody needs any more: expired
-- holds, queue places, given-up owners, client names and records, and
-- the rows of names free for `p_retention_ms` whose last token is that far behind the
-- clock. Answers the most rows one table lost (a full batch: more to sweep).
CREATE PROCEDURE `__T___sweep`(IN p_retention_ms BIGINT, IN p_batch INT)
BEGIN
    DECLARE v_now BIGINT DEFAULT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6));
    DECLARE v_most INT DEFAULT 0;
    DECLARE v_old BIGINT DEFAULT v_now - p_retention_ms * 1000;
    DELETE FROM `__T__` WHERE expires_us <= v_now LIMIT p_batch;
    SET v_most = GREATEST(v_most, ROW_COUNT());
    DELETE FROM `__T___queue` WHERE evict_us <= v_now LIMIT p_batch;
    SET v_most = GREATEST(v_most, ROW_COUNT());
    DELETE FROM `__T___gone` WHERE until_us <= v_now LIMIT p_batch;
    SET v_most = GREATEST(v_most, ROW_COUNT());
    DELETE FROM `__T___clients` WHERE expires_us <= v_now LIMIT p_batch;
    SET v_most = GREATEST(v_most, ROW_COUNT());
    DELETE FROM `__T___replay` WHERE expires_us <= v_now LIMIT p_batch;
    SET v_most = GREATEST(v_most, ROW_COUNT());
    DELETE FROM `__T___names`
     WHERE idle_at < v_old AND token < v_old
       AND NOT EXISTS (SELECT 1 FROM `__T__` t WHERE t.name = `__T___names`.name)
       AND NOT EXISTS (SELECT 1 FROM `__T___queue` q WHERE q.name = `__T___names`.name)
     LIMIT p_batch;
    SET v_most = GREATEST(v_most, ROW_COUNT());
    SELECT CAST(v_most AS SIGNED) AS most;
END
//
INSERT INTO `__T___schema` (id, version) VALUES (1, __VERSION__)
ON DUPLICATE KEY UPDATE version = VALUES(version)
