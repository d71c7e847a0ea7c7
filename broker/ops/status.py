"""The overview: queues, worker processes and periodic jobs, as ``status`` and the
dashboard's front page show them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg

from broker.app import PeriodicJob
from broker.errors import ConfigError
from broker.ops.common import DEFAULT_RESCUE_AFTER_S, _db_now, _float, _Row
from broker.pg.liveness import rescue_window


@dataclasses.dataclass(frozen=True)
class QueueStatus(_Row):
    name: str
    queued: int                       # due now
    delayed: int                      # due later
    running: int                      # claimed by a worker process (started, or prefetched)
    rejected: int                     # rejected in the last 24 h
    done_5m: int
    done_1h: int
    oldest_queued_age_s: float | None  # how long the oldest due job has waited
    paused: bool
    paused_at: datetime | None = None
    paused_by: str | None = None
    #: of ``running``, those claimed by a worker process and not yet started
    prefetched: int = 0
    #: live worker processes that serve it (a fresh heartbeat, not stopped)
    live_workers: int = 0
    #: no live worker process serves it
    no_worker: bool = dataclasses.field(init=False)
    #: it has due work that no live worker process serves (and is not paused)
    unserved: bool = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "no_worker", self.live_workers == 0)
        object.__setattr__(self, "unserved", self.live_workers == 0 and self.queued > 0 and not self.paused)


@dataclasses.dataclass(frozen=True)
class WorkerStatus(_Row):
    id: str
    host: str
    pid: int
    queues: list[str]
    started_at: datetime
    last_heartbeat_age_s: float
    alive: bool
    stopped_at: datetime | None
    running: int                                 # messages it holds (claimed, not settled)
    running_jobs: list[tuple[str, str]]          # (message id, actor) of those it has started
    prefetched: int = 0                          # of ``running``, those claimed, not yet started


@dataclasses.dataclass(frozen=True)
class PeriodicStatus(_Row):
    job: str
    last_run: datetime | None           # the start of the latest period it was enqueued for
    next_due: datetime | None           # None when its schedule is not known; a cron job's in its zone
    interval_s: float | None
    last_message_id: str | None
    last_state: str | None              # that run's job state (None once pruned)
    schedule: str | None = None         # "every 900 s", or "0 3 * * * (Europe/Berlin)"


# -- overview ----------------------------------------------------------------------------

QUEUE_OVERVIEW = """
WITH active AS (
    SELECT queue_name,
           count(*) FILTER (WHERE "state" = 'queued' AND eta <= now()) AS queued,
           count(*) FILTER (WHERE "state" = 'queued' AND eta > now()) AS delayed,
           count(*) FILTER (WHERE "state" = 'consumed') AS running,
           count(*) FILTER (WHERE "state" = 'consumed' AND started_at IS NULL) AS prefetched,
           EXTRACT(EPOCH FROM now() - min(eta) FILTER (WHERE "state" = 'queued' AND eta <= now()))::float8
               AS oldest_queued_age_s
    FROM dramatiq.queue
    WHERE "state" IN ('queued', 'consumed')
    GROUP BY queue_name
), finished AS (
    SELECT queue_name,
           count(*) FILTER (WHERE "state" = 'rejected') AS rejected,
           count(*) FILTER (WHERE "state" = 'done' AND mtime > now() - interval '5 minutes') AS done_5m,
           count(*) FILTER (WHERE "state" = 'done' AND mtime > now() - interval '1 hour') AS done_1h
    FROM dramatiq.queue
    WHERE "state" IN ('done', 'rejected') AND mtime > now() - interval '24 hours'
    GROUP BY queue_name
), served AS (
    SELECT served_queue AS queue_name, count(*) AS live_workers
    FROM standmeet.worker_processes, unnest(queues) AS served_queue
    WHERE stopped_at IS NULL AND heartbeat_at > now() - """ + rescue_window("worker_processes", "rescue_after_s") + """
    GROUP BY served_queue
), names AS (
    SELECT queue_name FROM active
    UNION SELECT queue_name FROM finished
    UNION SELECT queue_name FROM standmeet.queue_pauses
    UNION SELECT queue_name FROM served
)
SELECT n.queue_name,
       coalesce(a.queued, 0), coalesce(a.delayed, 0), coalesce(a.running, 0),
       coalesce(f.rejected, 0), coalesce(f.done_5m, 0), coalesce(f.done_1h, 0),
       a.oldest_queued_age_s,
       p.queue_name IS NOT NULL, p.paused_at, p.paused_by, coalesce(a.prefetched, 0),
       coalesce(s.live_workers, 0)
FROM names n
LEFT JOIN active a USING (queue_name)
LEFT JOIN finished f USING (queue_name)
LEFT JOIN served s USING (queue_name)
LEFT JOIN standmeet.queue_pauses p USING (queue_name)
ORDER BY n.queue_name
"""

WORKER_OVERVIEW = """
SELECT w.id::text, w.hostname, w.pid, w.queues, w.started_at,
       EXTRACT(EPOCH FROM now() - w.heartbeat_at)::float8,
       w.stopped_at IS NULL AND w.heartbeat_at > now() - """ + rescue_window("w", "rescue_after_s") + """,
       w.stopped_at,
       coalesce(held.jobs, '[]'::jsonb), coalesce(held.prefetched, 0)
FROM standmeet.worker_processes w
LEFT JOIN LATERAL (
    SELECT jsonb_agg(jsonb_build_array(q.message_id::text, q.message->>'actor_name') ORDER BY q.mtime, q.message_id)
               FILTER (WHERE q.started_at IS NOT NULL) AS jobs,
           count(*) FILTER (WHERE q.started_at IS NULL) AS prefetched
    FROM dramatiq.queue q
    WHERE q.worker_id = w.id AND q."state" = 'consumed'
) held ON true
ORDER BY (w.stopped_at IS NULL AND w.heartbeat_at > now() - """ + rescue_window("w", "rescue_after_s") + """) DESC,
         w.started_at DESC, w.id
"""

PERIODIC_OVERVIEW = """
WITH RECURSIVE jobs AS (  -- each job once, skipping along the primary key (job, period_start)
    (SELECT job FROM standmeet.periodic_runs ORDER BY job LIMIT 1)
    UNION ALL
    SELECT (SELECT r.job FROM standmeet.periodic_runs r WHERE r.job > jobs.job ORDER BY r.job LIMIT 1)
    FROM jobs WHERE jobs.job IS NOT NULL
)
SELECT j.job, r.period_start, r.message_id::text,
       CASE WHEN q."state" = 'queued' AND q.eta > now() THEN 'delayed'
            WHEN q."state" = 'consumed' THEN 'running'
            ELSE q."state"::text END
FROM jobs j
CROSS JOIN LATERAL (SELECT period_start, message_id FROM standmeet.periodic_runs
                    WHERE job = j.job ORDER BY period_start DESC LIMIT 1) r
LEFT JOIN dramatiq.queue q ON q.message_id = r.message_id
WHERE j.job IS NOT NULL
ORDER BY j.job
"""


def queue_overview(conn: psycopg.Connection[Any], *,
                   rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[QueueStatus]:
    """Every queue with jobs not finished or finished in the last 24 h, paused, or served
    by a live worker (older finished rows alone would cost a scan of the whole table),
    with how many live worker processes serve it."""
    rows = conn.execute(QUEUE_OVERVIEW, {"rescue_after_s": rescue_after_s}).fetchall()
    return [QueueStatus(r[0], int(r[1]), int(r[2]), int(r[3]), int(r[4]), int(r[5]), int(r[6]),
                        _float(r[7]), bool(r[8]), r[9], r[10], prefetched=int(r[11]), live_workers=int(r[12]))
            for r in rows]


def worker_overview(conn: psycopg.Connection[Any], *,
                    rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[WorkerStatus]:
    """Worker processes, live ones first; "alive" is judged with the database's clock."""
    rows = conn.execute(WORKER_OVERVIEW, {"rescue_after_s": rescue_after_s}).fetchall()
    out = []
    for r in rows:
        jobs = [(str(j[0]), str(j[1])) for j in (r[8] or [])]
        prefetched = int(r[9])
        out.append(WorkerStatus(r[0], r[1], int(r[2]), list(r[3]), r[4], float(r[5]), bool(r[6]), r[7],
                                len(jobs) + prefetched, jobs, prefetched=prefetched))
    return out


#: Every schedule a scheduler recorded when it started (``periodic.publish_schedules``).
PERIODIC_SCHEDULES = "SELECT job, actor, interval_s, cron, timezone FROM standmeet.periodic_schedules"


def periodic_overview(conn: psycopg.Connection[Any], declared: Sequence[PeriodicJob] = ()) -> list[PeriodicStatus]:
    """Each periodic job's schedule, last run and next due time: the jobs ``declared`` in
    this process and those any scheduler recorded (so a process that does not load the
    application's modules shows them too), and any job that ran.

    A job that never ran is due at the start of its current period (an interval), or at
    its next fire time (cron, in its zone); ``next_due`` is None when its schedule is not
    known (a job that ran, whose scheduler this version cannot read).
    """
    jobs: dict[str, PeriodicJob] = {}
    for name, actor, interval_s, cron, zone in conn.execute(PERIODIC_SCHEDULES).fetchall():
        try:
            jobs[name] = PeriodicJob(name, actor, interval_s, cron=cron, timezone=zone)
        except ConfigError:  # recorded by another version, in a form this one refuses
            continue
    jobs.update({job.name: job for job in declared})
    now = _db_now(conn)
    seen = {job: _periodic_status(job, jobs.get(job), now, last_run, message_id, state)
            for job, last_run, message_id, state in conn.execute(PERIODIC_OVERVIEW).fetchall()}
    for name, job in jobs.items():
        seen.setdefault(name, _periodic_status(name, job, now, None, None, None))
    return [seen[job] for job in sorted(seen)]


def _periodic_status(name: str, job: PeriodicJob | None, now: datetime, last_run: datetime | None,
                     message_id: str | None, state: str | None) -> PeriodicStatus:
    if job is None:
        return PeriodicStatus(name, last_run, None, None, message_id, state)
    next_due: datetime | None
    if job.interval_s is not None:
        # the current period when it has not run (overdue, after a downtime: a scheduler's
        # next tick claims it), else the next one; never the period after a run long past
        current = job.period_start(now)
        next_due = current if last_run is None or last_run < current else job.next_run(now)
    else:
        next_due = job.next_run(now)
    return PeriodicStatus(name, last_run, next_due, job.interval_s, message_id, state, job.every)
