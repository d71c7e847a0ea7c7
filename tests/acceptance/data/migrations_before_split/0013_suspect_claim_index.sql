-- The claim looks for queued suspects first (messages of a crashed process, re-run one at
-- a time). Through the claim index it had to walk every queued message of the queue to
-- find none: 3 ms per claim at 15,000 queued, growing with the backlog. Queued suspects
-- are few and have an index of their own, in the order the claim takes them.
CREATE INDEX IF NOT EXISTS queue_suspect_queued_idx
    ON dramatiq.queue (queue_name, eta) WHERE "state" = 'queued' AND suspect_of IS NOT NULL;
