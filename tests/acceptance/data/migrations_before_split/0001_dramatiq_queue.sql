-- The dramatiq-pg message table, with the columns our broker needs to fix its defects:
--   eta        when the message is due; delays and snoozes live here, not in worker memory
--   worker_id  the process that claimed it (its heartbeat decides whether it is alive)
--   claims     how many times it was claimed; acks match on it, so a stale ack is a no-op
--   crashes    how many times its worker died while running it (crash rescue)
--   error      why it was rejected by the broker itself (too many crashes, unknown actor…)
CREATE SCHEMA IF NOT EXISTS dramatiq;

DO $$ BEGIN
    CREATE TYPE dramatiq.state AS ENUM ('queued', 'consumed', 'rejected', 'done');
EXCEPTION WHEN duplicate_object THEN NULL;
END $$;

CREATE TABLE IF NOT EXISTS dramatiq.queue (
    message_id  uuid PRIMARY KEY,
    queue_name  text NOT NULL DEFAULT 'default',
    "state"     dramatiq.state,
    mtime       timestamptz DEFAULT now(),
    message     jsonb,
    "result"    jsonb,
    result_ttl  timestamptz
);

ALTER TABLE dramatiq.queue
    ADD COLUMN IF NOT EXISTS eta timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS enqueued_at timestamptz NOT NULL DEFAULT now(),
    ADD COLUMN IF NOT EXISTS worker_id uuid,
    ADD COLUMN IF NOT EXISTS claims integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS crashes integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS error text;

ALTER TABLE dramatiq.queue ALTER COLUMN mtime SET DEFAULT now();

-- What consumers claim: due messages of one queue, oldest due first.
CREATE INDEX IF NOT EXISTS queue_claim_idx
    ON dramatiq.queue (queue_name, eta) WHERE "state" = 'queued';
-- What crash rescue scans: messages held by some process.
CREATE INDEX IF NOT EXISTS queue_consumed_idx
    ON dramatiq.queue (worker_id) WHERE "state" = 'consumed';
-- What retention prunes.
CREATE INDEX IF NOT EXISTS queue_finished_idx
    ON dramatiq.queue (mtime) WHERE "state" IN ('done', 'rejected');
