-- Operations: what operators (the command line, the dashboard) see and change.
-- (Named 0010_operations before the application's tables left these migrations, when it
-- also indexed two of them: a database that has that name recorded ran both parts; the
-- application's migration that replaces 0010_operations is then recorded as applied.)
--   cancelled_at / cancelled_by  an operator cancelled the job: a queued one was rejected
--                                at once; a running one is not retried and stops at its
--                                next deadline check
--   retried_at / retried_by      an operator sent a rejected job back to its queue
ALTER TABLE dramatiq.queue
    ADD COLUMN IF NOT EXISTS cancelled_at timestamptz,
    ADD COLUMN IF NOT EXISTS cancelled_by text,
    ADD COLUMN IF NOT EXISTS retried_at timestamptz,
    ADD COLUMN IF NOT EXISTS retried_by text;

-- No index for the job lists' order (enqueued_at DESC): every enqueue, claim and ack
-- would pay for it, and hold one more lock; a page of jobs sorts the rows it filters.

-- A paused queue: no process claims from it until the row is deleted (resume).
CREATE TABLE IF NOT EXISTS standmeet.queue_pauses (
    queue_name  text PRIMARY KEY,
    paused_at   timestamptz NOT NULL DEFAULT now(),
    paused_by   text
);

-- Every operator action: what, on which jobs or queue, by whom, when, from where.
CREATE TABLE IF NOT EXISTS standmeet.operator_actions (
    id        bigserial PRIMARY KEY,
    at        timestamptz NOT NULL DEFAULT now(),
    action    text NOT NULL,
    target    jsonb NOT NULL DEFAULT 'null',
    affected  integer,
    by_whom   text NOT NULL,
    source    text NOT NULL
);
CREATE INDEX IF NOT EXISTS operator_actions_at_idx ON standmeet.operator_actions (at DESC);
