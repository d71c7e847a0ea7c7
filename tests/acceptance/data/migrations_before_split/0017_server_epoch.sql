-- The server's identity as the processes last saw it, and since when it has been this
-- database's. Rescue judges nobody within a rescue window of that moment: after a
-- restart, or after a standby was promoted in the primary's place, every process lost
-- its connection and needs that long to prove it lives.
--
-- The identity is the server's start time and its timeline ('<start>/<timeline>'). A
-- restart changes the start time only: the server has been this database's since it
-- started. A promotion changes the timeline; the promoted standby's start time came
-- before the promotion, so it cannot say when the server became this database's: the
-- moment a process first sees the new timeline stands for it.
CREATE TABLE IF NOT EXISTS standmeet.server_epoch (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    identity   text NOT NULL,
    since      timestamptz NOT NULL
);

-- This server's identity: its start time and the timeline it writes on.
CREATE OR REPLACE FUNCTION standmeet.server_identity() RETURNS text
LANGUAGE sql VOLATILE AS $$
    SELECT pg_postmaster_start_time()::text || '/' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8)
$$;

INSERT INTO standmeet.server_epoch (identity, since)
VALUES (standmeet.server_identity(), pg_postmaster_start_time())
ON CONFLICT (singleton) DO NOTHING;

-- Since when the server answering now has been this database's: its start after a
-- restart, the moment this function first saw it after a promotion (a changed identity
-- is recorded at once, by whichever process asks first).
CREATE OR REPLACE FUNCTION standmeet.server_epoch_since() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    seen text := standmeet.server_identity();
    known_identity text;
    known_since timestamptz;
    became timestamptz;
BEGIN
    SELECT identity, since INTO known_identity, known_since FROM standmeet.server_epoch;
    IF known_identity IS NOT DISTINCT FROM seen THEN
        RETURN known_since;
    END IF;
    became := CASE WHEN split_part(known_identity, '/', 2) = split_part(seen, '/', 2)
                   THEN pg_postmaster_start_time()  -- the same timeline: restarted
                   ELSE now() END;                  -- another timeline: promoted
    INSERT INTO standmeet.server_epoch AS e (singleton, identity, since) VALUES (true, seen, became)
    ON CONFLICT (singleton) DO UPDATE SET identity = EXCLUDED.identity, since = EXCLUDED.since
        WHERE e.identity IS DISTINCT FROM EXCLUDED.identity
    RETURNING e.since INTO known_since;
    IF known_since IS NULL THEN  -- another process recorded it first
        SELECT since INTO known_since FROM standmeet.server_epoch;
    END IF;
    RETURN known_since;
END $$;
