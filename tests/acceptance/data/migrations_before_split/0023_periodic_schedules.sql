-- Each periodic job's schedule, as the schedulers that run it declared it: any process
-- (the dashboard, `status`) shows every job's schedule and next run, including jobs of
-- modules it does not load. Upserted by each scheduler when it starts.
CREATE TABLE IF NOT EXISTS standmeet.periodic_schedules (
    job          text PRIMARY KEY,
    actor        text NOT NULL,
    interval_s   float8,
    cron         text,
    timezone     text NOT NULL DEFAULT 'UTC',
    declared_at  timestamptz NOT NULL DEFAULT now(),
    CHECK ((interval_s IS NULL) <> (cron IS NULL))
);
