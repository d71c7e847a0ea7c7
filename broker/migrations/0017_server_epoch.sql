-- The server's identity as the processes last saw it, and since when. Rescue judges
-- nobody within a rescue window of a change: after a restart, or after a standby was
-- promoted in the primary's place, every process lost its connection and needs that
-- long to prove it lives. The identity is the server's start time, which a promoted
-- standby does not share with the primary it replaces (its own start came earlier, so
-- the start time alone cannot say that the server has only just become this database).
CREATE TABLE IF NOT EXISTS standmeet.server_epoch (
    singleton  boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    identity   text NOT NULL,
    since      timestamptz NOT NULL
);

INSERT INTO standmeet.server_epoch (identity, since)
VALUES (pg_postmaster_start_time()::text, pg_postmaster_start_time())
ON CONFLICT (singleton) DO NOTHING;

-- Since when the server answering now has been this database's: the time this function
-- first saw it (a changed identity is recorded at once, by whichever process asks first).
CREATE OR REPLACE FUNCTION standmeet.server_epoch_since() RETURNS timestamptz
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    seen text := pg_postmaster_start_time()::text;
    known_identity text;
    known_since timestamptz;
BEGIN
    SELECT identity, since INTO known_identity, known_since FROM standmeet.server_epoch;
    IF known_identity IS NOT DISTINCT FROM seen THEN
        RETURN known_since;
    END IF;
    INSERT INTO standmeet.server_epoch AS e (singleton, identity, since) VALUES (true, seen, now())
    ON CONFLICT (singleton) DO UPDATE SET identity = EXCLUDED.identity, since = EXCLUDED.since
        WHERE e.identity IS DISTINCT FROM EXCLUDED.identity
    RETURNING e.since INTO known_since;
    IF known_since IS NULL THEN  -- another process recorded it first
        SELECT since INTO known_since FROM standmeet.server_epoch;
    END IF;
    RETURN known_since;
END $$;
