-- One row per outbox relay (every worker process, scheduler and `python -m broker.relay`
-- runs one), refreshed by its heartbeat: which topics the live processes route is known
-- here, so an event no live relay routes can be shown as such instead of waiting unseen.
CREATE TABLE IF NOT EXISTS standmeet.relays (
    id            uuid PRIMARY KEY,
    hostname      text NOT NULL,
    pid           integer NOT NULL,
    topics        text[] NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    stopped_at    timestamptz
);

-- Which relay marked an event relayed (NULL: a pass run by hand, or before this column).
ALTER TABLE standmeet.outbox ADD COLUMN IF NOT EXISTS relayed_by uuid;

-- What a relay claims: the pending rows of the topics it routes, oldest first.
CREATE INDEX IF NOT EXISTS outbox_pending_topic_idx ON standmeet.outbox (topic, id)
    WHERE relayed_at IS NULL AND error IS NULL;

-- What operators look at and retry: failed events (few, and never pruned until retried).
CREATE INDEX IF NOT EXISTS outbox_failed_idx ON standmeet.outbox (id)
    WHERE error IS NOT NULL;
