-- The rebuilt core's columns and tables (all additive: a dramatiq-pg database and an
-- earlier standmeet database both migrate in place).
--   started_at    when the claim started running (NULL: claimed but not started, i.e.
--                 prefetched); only a started message can be blamed for its worker's death
--   suspect_of    the worker process that died running this message beside others: it is
--                 re-run with no other message of that set beside it before it can be blamed
--   priority      lower runs first among the due messages of a queue (Dramatiq's convention)
--   cancelled_at  an operator cancelled it: it is not retried (a queued one never runs)
ALTER TABLE dramatiq.queue
    ADD COLUMN IF NOT EXISTS started_at timestamptz,
    ADD COLUMN IF NOT EXISTS suspect_of uuid,
    ADD COLUMN IF NOT EXISTS priority integer NOT NULL DEFAULT 0,
    ADD COLUMN IF NOT EXISTS cancelled_at timestamptz;

-- What consumers claim: due messages of one queue, by priority, then due time.
DROP INDEX IF EXISTS dramatiq.queue_claim_idx;
CREATE INDEX IF NOT EXISTS queue_claim_priority_idx
    ON dramatiq.queue (queue_name, priority, eta) WHERE "state" = 'queued';
-- Suspects are few: the claim looks them up by their set.
CREATE INDEX IF NOT EXISTS queue_suspect_idx
    ON dramatiq.queue (suspect_of) WHERE suspect_of IS NOT NULL;

-- Paused queues: no process claims from them until resumed.
CREATE TABLE IF NOT EXISTS standmeet.queue_pauses (
    queue_name  text PRIMARY KEY,
    paused_at   timestamptz NOT NULL DEFAULT now(),
    paused_by   text
);
