-- One row per periodic job and period: the unique key makes two scheduler processes
-- enqueue a periodic job once per period, without a leader.
CREATE TABLE IF NOT EXISTS standmeet.periodic_runs (
    job           text NOT NULL,
    period_start  timestamptz NOT NULL,
    message_id    uuid NOT NULL,
    enqueued_at   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job, period_start)
);
