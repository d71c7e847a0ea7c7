-- One row per live worker process, refreshed by its heartbeat. A message whose
-- worker_id has no fresh row here belongs to a dead process and is rescued.
CREATE TABLE IF NOT EXISTS standmeet.worker_processes (
    id            uuid PRIMARY KEY,
    hostname      text NOT NULL,
    pid           integer NOT NULL,
    queues        text[] NOT NULL,
    started_at    timestamptz NOT NULL DEFAULT now(),
    heartbeat_at  timestamptz NOT NULL DEFAULT now(),
    stopped_at    timestamptz
);
