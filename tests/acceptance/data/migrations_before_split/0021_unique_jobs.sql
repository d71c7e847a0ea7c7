-- Unique jobs: at most one live message per key, held by the database, not by a read
-- before the write (River's and Oban's semantics).
--   unique_key     the message's key (sha256 of its actor and arguments, or of the key
--                  its sender named; with a period, also of the period's start by the
--                  database's clock); NULL for a message without one
--   unique_states  the states in which the message holds its key, a bit mask:
--                  1 queued (also delayed: a queued row whose eta is later),
--                  2 running (consumed), 4 done, 8 rejected
-- A second message with a key that a message holds in a covered state is not written
-- (INSERT … ON CONFLICT DO NOTHING against the partial unique index below), however
-- many processes send it at once. Constant defaults: no table rewrite.
ALTER TABLE dramatiq.queue
    ADD COLUMN IF NOT EXISTS unique_key bytea,
    ADD COLUMN IF NOT EXISTS unique_states smallint;

-- Whether a message in state s holds its key, given its mask. IMMUTABLE: it reads only
-- its arguments, so it may stand in an index predicate (River's river_job_state_in_bitmask).
CREATE OR REPLACE FUNCTION standmeet.unique_live(mask smallint, s dramatiq.state) RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE s WHEN 'queued' THEN mask & 1 <> 0
                  WHEN 'consumed' THEN mask & 2 <> 0
                  WHEN 'done' THEN mask & 4 <> 0
                  ELSE mask & 8 <> 0 END
$$;

-- The key a send writes: the sender's key, or, with a period, the sender's key and the
-- start of the period now falls in (epoch seconds, by the database's clock), hashed.
CREATE OR REPLACE FUNCTION standmeet.unique_key_at(key bytea, period_s float8) RETURNS bytea
LANGUAGE sql STABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN period_s IS NULL THEN key
                ELSE sha256(key || convert_to(
                    (floor(extract(epoch FROM now()) / period_s) * period_s)::text, 'UTF8')) END
$$;

-- The one live message of each key. A message without a key is not in it: it costs
-- nothing on send.
CREATE UNIQUE INDEX IF NOT EXISTS queue_unique_key_idx ON dramatiq.queue (unique_key)
    WHERE unique_key IS NOT NULL AND standmeet.unique_live(unique_states, "state");

-- Sends skipped because their key was live, per queue and actor: how many, and when the
-- last was (written by the sending process, on its own connection, at each skip).
CREATE TABLE IF NOT EXISTS standmeet.unique_skips (
    queue_name       text NOT NULL,
    actor_name       text NOT NULL,
    skipped          bigint NOT NULL DEFAULT 0,
    last_skipped_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (queue_name, actor_name)
);
