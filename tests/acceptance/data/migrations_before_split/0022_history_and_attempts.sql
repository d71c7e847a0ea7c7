-- History, written by the workers as they settle (never by scanning dramatiq.queue).
--
-- standmeet.queue_history: one row per minute, queue, actor and writer shard (a worker
-- process writes its own shard, from its id: processes settling the same actor in the same
-- minute do not queue up behind one row's lock). A reader adds the shards together.
--   done             runs whose actor returned
--   failed           runs that failed and were retried (a time limit included)
--   rejected         runs that failed for good (a time limit included)
--   cancelled        runs of cancelled jobs (never run again)
--   snoozed          runs that asked to run later (no retry counted)
--   timed_out        of failed + rejected, the runs cut by their time limit
--   crashed          started runs whose process died or fell silent (rescued)
--   given_back       started runs cut at a graceful shutdown, or interrupted by a
--                    worker that stepped down (they run again, unblamed)
--   wait_*           from the time the job became due (its enqueue, or its delay's end)
--                    to its start; run_* from its start to its end (settled runs only)
--   *_hist           counts per bucket of milliseconds: element i counts the values in
--                    [bound i-1, bound i) of broker.sql.HISTORY_BOUNDS_MS, the last one
--                    everything from the last bound up
CREATE TABLE IF NOT EXISTS standmeet.queue_history (
    minute       timestamptz NOT NULL,
    queue_name   text NOT NULL,
    actor_name   text NOT NULL,
    shard        smallint NOT NULL,
    done         bigint NOT NULL DEFAULT 0,
    failed       bigint NOT NULL DEFAULT 0,
    rejected     bigint NOT NULL DEFAULT 0,
    cancelled    bigint NOT NULL DEFAULT 0,
    snoozed      bigint NOT NULL DEFAULT 0,
    timed_out    bigint NOT NULL DEFAULT 0,
    crashed      bigint NOT NULL DEFAULT 0,
    given_back   bigint NOT NULL DEFAULT 0,
    wait_count   bigint NOT NULL DEFAULT 0,
    wait_sum_ms  float8 NOT NULL DEFAULT 0,
    wait_hist    bigint[] NOT NULL,
    run_count    bigint NOT NULL DEFAULT 0,
    run_sum_ms   float8 NOT NULL DEFAULT 0,
    run_hist     bigint[] NOT NULL,
    PRIMARY KEY (minute, queue_name, actor_name, shard)
);

-- standmeet.job_attempts: every run of every job, one row each, written in the statement
-- that settles it (or rescues it, or gives it back at a stop). No foreign key and no
-- unique index: the settle path never waits on, nor fails for, this table.
--   attempt   the claim number of the run (a message's claims count every time it was
--             taken, so numbers of runs given back unstarted are missing)
--   outcome   done | failed (retried) | rejected | cancelled | snoozed | timeout (its time
--             limit; retried or not, the message says) | crashed (its process died; rescued)
--             | cut_at_shutdown (a graceful stop gave it back) | interrupted (its worker
--             stepped down, cut off from the database)
CREATE TABLE IF NOT EXISTS standmeet.job_attempts (
    message_id   uuid NOT NULL,
    attempt      integer NOT NULL,
    queue_name   text NOT NULL,
    actor_name   text NOT NULL,
    worker_id    uuid,
    started_at   timestamptz,
    ended_at     timestamptz NOT NULL,
    outcome      text NOT NULL,
    error        text
);
CREATE INDEX IF NOT EXISTS job_attempts_message_idx ON standmeet.job_attempts (message_id);
-- Rows arrive in ended_at order: a block range index finds the old ones for pruning at
-- next to no cost per insert.
CREATE INDEX IF NOT EXISTS job_attempts_ended_brin ON standmeet.job_attempts USING brin (ended_at);
