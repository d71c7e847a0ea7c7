"""What operators see and steer: the queries behind ``standmeet-jobs status / jobs /
queues / webhooks deliveries`` and the dashboard.

Every function takes a psycopg 3 connection (autocommit is best: the reads then hold
no transaction open) and returns frozen dataclasses; ``.asdict()`` gives plain
Python values and :func:`jsonable` makes them JSON-ready. Ages and "alive" are
judged with the database's clock, never this machine's. Functions that change
something run in one transaction of their own (a savepoint inside the caller's) and
return how many jobs they changed; record who did it with :func:`record_action`.

Job states, as operators name them (``JOB_STATES``): ``queued`` (due now),
``delayed`` (due later: a retry's back-off, a snooze, a delay), ``running`` (claimed
by a worker process), ``done``, ``rejected`` (failed for good, cancelled included),
and ``cancelled`` (an operator cancelled it: rejected before it ran, or running and
not to be retried).

This module imports neither the broker nor the application (``actors``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from broker.app import PeriodicJob
from broker.errors import ConfigError, StandmeetError

#: The states :func:`list_jobs`, :func:`count_jobs` and the bulk actions filter on.
JOB_STATES: tuple[str, ...] = ("queued", "delayed", "running", "done", "rejected", "cancelled")
#: Default silence after which a worker process counts as dead (STANDMEET_RESCUE_AFTER_S).
DEFAULT_RESCUE_AFTER_S = 20.0
#: Longest page :func:`list_jobs` returns.
MAX_LIMIT = 1000
#: Furthest a page of :func:`list_jobs` may start (finite, so that no typed offset overflows).
MAX_OFFSET = 100_000_000
#: Oldest age ``since`` may say (``36500d``: a hundred years, the longest retention).
MAX_SINCE_AGE_S = 36_500 * 86_400.0
#: Fewest hex digits a job id prefix needs to name a job (``status`` prints 8).
MIN_ID_PREFIX_HEX = 8
#: How many of the jobs an ambiguous id prefix matches are named.
AMBIGUOUS_SHOWN = 5
#: Largest id of an outbox event or a webhook endpoint (Postgres bigint).
MAX_BIGINT = 2 ** 63 - 1
#: Longest text the search in errors (``error``) takes. That search reads the error and
#: the last traceback of every job the other filters leave (no index holds them): a scan
#: of ``dramatiq.queue``, as listing does anyway, one case-insensitive match a row.
MAX_ERROR_SEARCH_CHARS = 200


class OpsError(StandmeetError, ValueError):
    """A bad filter or argument, said in one line (the CLI prints it and exits 1)."""


class _Row:
    def asdict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


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


@dataclasses.dataclass(frozen=True)
class JobSummary(_Row):
    id: str
    queue: str
    actor: str
    state: str                          # one of JOB_STATES except "cancelled" (see cancelled_at)
    retries: int
    enqueued_at: datetime
    error: str | None                   # one line: the rejection reason or the last failure
    cancelled_at: datetime | None = None


@dataclasses.dataclass(frozen=True)
class JobDetail(_Row):
    id: str
    queue: str
    actor: str
    state: str
    retries: int
    enqueued_at: datetime
    error: str | None                   # in full
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]             # without the traceback
    traceback: str | None
    claims: int
    crashes: int
    snoozes: int
    worker_id: str | None
    worker_host: str | None
    worker_pid: int | None
    eta: datetime
    started_at: datetime | None         # when the running claim started (where recorded)
    finished_at: datetime | None        # done or rejected
    updated_at: datetime | None
    retried_by: str | None
    retried_at: datetime | None
    cancelled_by: str | None
    cancelled_at: datetime | None

    @property
    def summary(self) -> JobSummary:
        return JobSummary(self.id, self.queue, self.actor, self.state, self.retries, self.enqueued_at,
                          _one_line(self.error or self.traceback), self.cancelled_at)

    @property
    def timeline(self) -> list[tuple[str, datetime]]:
        """What happened when, in order: enqueued, due, started, retried, cancelled, finished."""
        events = [("enqueued", self.enqueued_at), ("due", self.eta), ("started", self.started_at),
                  ("retried", self.retried_at), ("cancelled", self.cancelled_at),
                  (self.state if self.state in ("done", "rejected") else "finished", self.finished_at)]
        return sorted(((name, at) for name, at in events if at is not None), key=lambda e: e[1])


@dataclasses.dataclass(frozen=True)
class DeliveryStatus(_Row):
    id: int
    endpoint_id: int
    event: str                          # the event's type
    state: str                          # pending | succeeded | failed | skipped
    attempts: int
    last_status: int | None             # the last attempt's HTTP status
    last_error: str | None              # the last attempt's error (or its outcome)
    event_id: int
    last_outcome: str | None
    updated_at: datetime
    next_attempt_at: datetime | None


@dataclasses.dataclass(frozen=True)
class EndpointStatus(_Row):
    id: int
    url: str
    event_types: list[str]
    enabled: bool
    disabled_reason: str | None
    failing_since: datetime | None
    last_attempt_at: datetime | None
    last_outcome: str | None
    last_status: int | None
    last_error: str | None
    pending: int
    failed: int

    @property
    def why_failing(self) -> str | None:
        """One line on why it fails, or None while it is healthy."""
        if not self.enabled:
            return f"disabled: {self.disabled_reason or 'by an operator'}"
        if self.failing_since is None:
            return None
        last = self.last_error or self.last_outcome or "unknown"
        if self.last_status is not None:
            last = f"HTTP {self.last_status}" + ("" if self.last_error is None else f": {self.last_error}")
        return f"failing since {self.failing_since.isoformat(timespec='seconds')}: {last}"


@dataclasses.dataclass(frozen=True)
class OperatorAction(_Row):
    id: int
    at: datetime
    action: str
    target: Any
    affected: int | None
    by: str
    source: str


@dataclasses.dataclass(frozen=True)
class RelayStatus(_Row):
    """An outbox relay (one per worker process, scheduler or relay process) and its topics."""

    id: str
    host: str
    pid: int
    topics: list[str]
    started_at: datetime
    last_heartbeat_age_s: float
    alive: bool
    stopped_at: datetime | None


@dataclasses.dataclass(frozen=True)
class UnroutedTopic(_Row):
    """Pending events of a topic that no live relay routes: nothing will relay them."""

    topic: str
    events: int
    oldest_age_s: float


@dataclasses.dataclass(frozen=True)
class OutboxStatus(_Row):
    lag_s: float | None                 # how long the oldest pending event has waited
    failed: int                         # events kept with their error (``outbox retry`` re-relays them)
    unrouted: list[UnroutedTopic]       # pending topics that no live relay routes
    relays: list[RelayStatus]           # live ones first

    @property
    def routed_topics(self) -> list[str]:
        """The topics some live relay routes."""
        return sorted({t for r in self.relays if r.alive for t in r.topics})


#: The states of an event not relayed, as :func:`list_outbox_events` names them.
OUTBOX_STATES: tuple[str, ...] = ("pending", "unrouted", "failed")


@dataclasses.dataclass(frozen=True)
class OutboxEvent(_Row):
    id: int
    topic: str
    state: str                          # pending | unrouted (no live relay routes it) | failed
    created_at: datetime
    age_s: float
    error: str | None                   # why it failed


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
    WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(rescue_after_s)s)
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
       w.stopped_at IS NULL AND w.heartbeat_at > now() - make_interval(secs => %(rescue_after_s)s),
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
ORDER BY (w.stopped_at IS NULL AND w.heartbeat_at > now() - make_interval(secs => %(rescue_after_s)s)) DESC,
         w.started_at DESC, w.id
"""

PERIODIC_OVERVIEW = """
SELECT DISTINCT ON (r.job) r.job, r.period_start, r.message_id::text,
       CASE WHEN q."state" = 'queued' AND q.eta > now() THEN 'delayed'
            WHEN q."state" = 'consumed' THEN 'running'
            ELSE q."state"::text END
FROM standmeet.periodic_runs r
LEFT JOIN dramatiq.queue q ON q.message_id = r.message_id
ORDER BY r.job, r.period_start DESC
"""

#: How long the oldest event not yet relayed has waited (NULL: nothing waits).
OUTBOX_LAG = """
SELECT EXTRACT(EPOCH FROM now() - created_at)::float8
FROM standmeet.outbox
WHERE relayed_at IS NULL AND error IS NULL
ORDER BY id
LIMIT 1
"""

DB_NOW = "SELECT now()"


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
        next_due = last_run + timedelta(seconds=job.interval_s) if last_run else job.period_start(now)
    else:
        next_due = job.next_run(now)
    return PeriodicStatus(name, last_run, next_due, job.interval_s, message_id, state, job.every)


def outbox_lag_s(conn: psycopg.Connection[Any]) -> float | None:
    """Seconds the oldest unrelayed event has waited; None when none waits."""
    row = conn.execute(OUTBOX_LAG).fetchone()
    return None if row is None else _float(row[0])


# -- the outbox and its relays -----------------------------------------------------------

#: The topics live relays route (a fresh heartbeat, not stopped).
_ROUTED_TOPICS = """
SELECT DISTINCT t.topic FROM standmeet.relays r, unnest(r.topics) AS t(topic)
WHERE r.stopped_at IS NULL AND r.heartbeat_at > now() - make_interval(secs => %(rescue_after_s)s)
"""

#: Each pending topic that no live relay routes, with its events and the oldest's age.
#: The pending topics are found by skipping from one to the next on the (topic, id)
#: index, not by reading every pending event; only unrouted topics' events are counted.
UNROUTED_TOPICS = """
WITH RECURSIVE topics AS (
    (SELECT topic FROM standmeet.outbox WHERE relayed_at IS NULL AND error IS NULL ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT o.topic FROM standmeet.outbox o
            WHERE o.relayed_at IS NULL AND o.error IS NULL AND o.topic > t.topic
            ORDER BY o.topic LIMIT 1)
    FROM topics t WHERE t.topic IS NOT NULL
), routed AS (""" + _ROUTED_TOPICS + """)
SELECT t.topic, counted.events, counted.oldest_age_s
FROM topics t
CROSS JOIN LATERAL (
    SELECT count(*) AS events, EXTRACT(EPOCH FROM now() - min(o.created_at))::float8 AS oldest_age_s
    FROM standmeet.outbox o
    WHERE o.topic = t.topic AND o.relayed_at IS NULL AND o.error IS NULL
) counted
WHERE t.topic IS NOT NULL AND NOT EXISTS (SELECT 1 FROM routed WHERE routed.topic = t.topic)
ORDER BY t.topic
"""

OUTBOX_FAILED = "SELECT count(*) FROM standmeet.outbox WHERE error IS NOT NULL"

RELAY_OVERVIEW = """
SELECT r.id::text, r.hostname, r.pid, r.topics, r.started_at,
       EXTRACT(EPOCH FROM now() - r.heartbeat_at)::float8,
       r.stopped_at IS NULL AND r.heartbeat_at > now() - make_interval(secs => %(rescue_after_s)s) AS alive,
       r.stopped_at
FROM standmeet.relays r
ORDER BY alive DESC, r.started_at DESC, r.id
"""

#: Events not relayed, oldest first: pending, unrouted (no live relay routes their topic),
#: or failed (with the reason).
LIST_OUTBOX_EVENTS = """
WITH routed AS (""" + _ROUTED_TOPICS + """)
SELECT o.id, o.topic,
       CASE WHEN o.error IS NOT NULL THEN 'failed'
            WHEN NOT EXISTS (SELECT 1 FROM routed WHERE routed.topic = o.topic) THEN 'unrouted'
            ELSE 'pending' END,
       o.created_at, EXTRACT(EPOCH FROM now() - o.created_at)::float8, o.error
FROM standmeet.outbox o
WHERE o.relayed_at IS NULL
  AND (NOT %(failed)s OR o.error IS NOT NULL)
  AND (%(topic)s::text IS NULL OR o.topic = %(topic)s)
  AND (%(ids)s::bigint[] IS NULL OR o.id = ANY(%(ids)s::bigint[]))
ORDER BY o.id
LIMIT %(limit)s
"""

#: Failed events (the ids given, or every one of a topic, or every one) back to pending,
#: their error cleared: a relay that routes their topic takes them again (woken at
#: commit). A re-relayed event makes the messages it would have made (their ids derive
#: from the event's), so one whose message was written before is never run twice.
RETRY_OUTBOX_EVENTS = """
WITH retried AS (
    UPDATE standmeet.outbox
    SET error = NULL, relayed_at = NULL, relay_txid = NULL, relayed_by = NULL, messages = NULL
    WHERE error IS NOT NULL
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND (%(topic)s::text IS NULL OR topic = %(topic)s)
    RETURNING id
), woken AS (
    SELECT pg_notify(standmeet.outbox_channel(), '') FROM (SELECT 1 FROM retried LIMIT 1) AS any_retried
)
SELECT (SELECT count(*) FROM retried), (SELECT count(*) FROM woken)
"""

#: What became of some events: (id, state), state one of OUTBOX_STATES or ``relayed``.
OUTBOX_EVENT_STATES = """
SELECT o.id, CASE WHEN o.error IS NOT NULL THEN 'failed'
                  WHEN o.relayed_at IS NOT NULL THEN 'relayed'
                  ELSE 'pending' END
FROM standmeet.outbox o WHERE o.id = ANY(%(ids)s::bigint[])
"""


def relay_overview(conn: psycopg.Connection[Any], *,
                   rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[RelayStatus]:
    """The outbox relays, live ones first; "alive" is judged with the database's clock."""
    return [RelayStatus(r[0], r[1], int(r[2]), list(r[3]), r[4], float(r[5]), bool(r[6]), r[7])
            for r in conn.execute(RELAY_OVERVIEW, {"rescue_after_s": rescue_after_s}).fetchall()]


def unrouted_topics(conn: psycopg.Connection[Any], *,
                    rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[UnroutedTopic]:
    """Pending topics that no live relay routes: their events wait for a process that does."""
    return [UnroutedTopic(r[0], int(r[1]), float(r[2]))
            for r in conn.execute(UNROUTED_TOPICS, {"rescue_after_s": rescue_after_s}).fetchall()]


def outbox_overview(conn: psycopg.Connection[Any], *,
                    rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> OutboxStatus:
    """The outbox at a glance: its lag, its failed events, the topics nobody routes, the relays."""
    row = conn.execute(OUTBOX_FAILED).fetchone()
    return OutboxStatus(outbox_lag_s(conn), int(row[0]) if row else 0,
                        unrouted_topics(conn, rescue_after_s=rescue_after_s),
                        relay_overview(conn, rescue_after_s=rescue_after_s))


def list_outbox_events(conn: psycopg.Connection[Any], *, failed: bool = False, topic: str | None = None,
                       ids: Sequence[int] | None = None, limit: int = 50,
                       rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[OutboxEvent]:
    """Events not relayed, oldest first (``failed``: only those kept with an error)."""
    if not 0 < limit <= MAX_LIMIT:
        raise OpsError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    rows = conn.execute(LIST_OUTBOX_EVENTS, {
        "failed": failed, "topic": topic or None, "ids": None if ids is None else list(ids), "limit": limit,
        "rescue_after_s": rescue_after_s}).fetchall()
    return [OutboxEvent(int(r[0]), r[1], r[2], r[3], float(r[4]), r[5]) for r in rows]


def retry_outbox_events(conn: psycopg.Connection[Any], *, ids: Sequence[int] | None = None,
                        topic: str | None = None) -> int:
    """Give failed events (the ids given, else every one, of ``topic`` if given) back to
    the relays; return how many. Events pending or relayed are left alone."""
    with conn.transaction():
        row = conn.execute(RETRY_OUTBOX_EVENTS, {"ids": None if ids is None else list(ids),
                                                 "topic": topic or None}).fetchone()
    return int(row[0]) if row else 0


def outbox_event_states(conn: psycopg.Connection[Any], ids: Sequence[int]) -> dict[int, str]:
    """id → pending | failed | relayed, for those of ``ids`` that exist."""
    return {int(r[0]): r[1] for r in conn.execute(OUTBOX_EVENT_STATES, {"ids": list(ids)}).fetchall()}


def parse_event_id(value: str) -> int:
    """An outbox event id; a clear error when it is not one."""
    try:
        number = int(str(value).strip())
    except ValueError:
        raise OpsError(f"{value!r} is not an outbox event id (a number)") from None
    if not 0 < number <= MAX_BIGINT:
        raise OpsError(f"{value!r} is not an outbox event id (a number from 1 to {MAX_BIGINT})")
    return number


# -- jobs --------------------------------------------------------------------------------

#: The job state as operators name it (see JOB_STATES), from a row ``q`` of dramatiq.queue.
JOB_STATE_EXPR = """
CASE WHEN q."state" = 'queued' AND q.eta > now() THEN 'delayed'
     WHEN q."state" = 'consumed' THEN 'running'
     ELSE q."state"::text END
"""

#: The filters shared by the job list, its count and the bulk actions; every one is
#: optional (NULL: no filter). ``search`` is an ILIKE pattern over the arguments,
#: ``error`` one over the error (the rejection reason) and the last failure's traceback.
JOB_FILTERS = """
    (%(state)s::text IS NULL
     OR (%(state)s = 'queued' AND q."state" = 'queued' AND q.eta <= now())
     OR (%(state)s = 'delayed' AND q."state" = 'queued' AND q.eta > now())
     OR (%(state)s = 'running' AND q."state" = 'consumed')
     OR (%(state)s = 'done' AND q."state" = 'done')
     OR (%(state)s = 'rejected' AND q."state" = 'rejected')
     OR (%(state)s = 'cancelled' AND q.cancelled_at IS NOT NULL))
AND (%(queue)s::text IS NULL OR q.queue_name = %(queue)s)
AND (%(actor)s::text IS NULL OR q.message->>'actor_name' = %(actor)s)
AND (%(since)s::timestamptz IS NULL OR q.enqueued_at >= %(since)s)
AND (%(id_low)s::uuid IS NULL OR q.message_id BETWEEN %(id_low)s::uuid AND %(id_high)s::uuid)
AND (%(message_ids)s::uuid[] IS NULL OR q.message_id = ANY(%(message_ids)s::uuid[]))
AND (%(search)s::text IS NULL
     OR (q.message->'args')::text ILIKE %(search)s
     OR (q.message->'kwargs')::text ILIKE %(search)s)
AND (%(error)s::text IS NULL
     OR q.error ILIKE %(error)s
     OR q.message->'options'->>'traceback' ILIKE %(error)s
     OR q.message->'options'->>'error' ILIKE %(error)s)
"""

#: One line of a failure: the rejection reason, else the last line of the last traceback.
JOB_ERROR_EXPR = """
nullif(substring(rtrim(coalesce(q.error, q.message->'options'->>'traceback'), E' \\n') from '[^\\n]*$'), '')
"""

LIST_JOBS = (
    "SELECT q.message_id::text, q.queue_name, q.message->>'actor_name', " + JOB_STATE_EXPR + ",\n"
    "       coalesce((q.message->'options'->>'retries')::int, 0), q.enqueued_at, " + JOB_ERROR_EXPR + ",\n"
    "       q.cancelled_at\n"
    "FROM dramatiq.queue q\nWHERE " + JOB_FILTERS +
    "ORDER BY q.enqueued_at DESC, q.message_id\nLIMIT %(limit)s OFFSET %(offset)s\n"
)

COUNT_JOBS = "SELECT count(*) FROM dramatiq.queue q\nWHERE " + JOB_FILTERS

#: One job in full. ``started_at`` is read from the row as JSON, so this works with and
#: without that column (the broker records it where it can).
SHOW_JOB = (
    "SELECT q.message_id::text, q.queue_name, q.message->>'actor_name', " + JOB_STATE_EXPR + ",\n"
    "       coalesce((q.message->'options'->>'retries')::int, 0), q.enqueued_at,\n"
    "       coalesce(q.error, q.message->'options'->>'error'),\n"
    "       coalesce(q.message->'args', '[]'::jsonb), coalesce(q.message->'kwargs', '{}'::jsonb),\n"
    "       coalesce(q.message->'options', '{}'::jsonb) - 'traceback',\n"
    "       q.message->'options'->>'traceback',\n"
    "       q.claims, q.crashes, coalesce((q.message->'options'->>'snoozes')::int, 0),\n"
    "       q.worker_id::text, w.hostname, w.pid, q.eta,\n"
    "       (to_jsonb(q)->>'started_at')::timestamptz,\n"
    "       CASE WHEN q.\"state\" IN ('done', 'rejected') THEN q.mtime END, q.mtime,\n"
    "       coalesce(q.retried_by, q.message->'options'->>'retried_by'), q.retried_at,\n"
    "       q.cancelled_by, q.cancelled_at\n"
    "FROM dramatiq.queue q\n"
    "LEFT JOIN standmeet.worker_processes w ON w.id = q.worker_id\n"
    "WHERE q.message_id = %(message_id)s\n"
)


def list_jobs(conn: psycopg.Connection[Any], *, state: str | None = None, queue: str | None = None,
              actor: str | None = None, since: datetime | str | None = None, search: str | None = None,
              message_id: str | None = None, error: str | None = None, limit: int = 50,
              offset: int = 0) -> list[JobSummary]:
    """Jobs matching every given filter, newest first (enqueued_at DESC, then id: stable).

    ``since``: enqueued at or after (a datetime, an ISO time, or an age like ``15m``,
    ``2h``, ``1d``); ``search``: text in the arguments (case-insensitive);
    ``message_id``: a whole id or the start of one; ``error``: text in the job's error or
    its last traceback (case-insensitive, at most :data:`MAX_ERROR_SEARCH_CHARS`).
    """
    if not 0 < limit <= MAX_LIMIT:
        raise OpsError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    if not 0 <= offset <= MAX_OFFSET:
        raise OpsError(f"offset must be between 0 and {MAX_OFFSET}, not {offset}")
    params = job_filters(state=state, queue=queue, actor=actor, since=since, search=search, message_id=message_id,
                         error=error)
    rows = conn.execute(LIST_JOBS, {**params, "limit": limit, "offset": offset}).fetchall()
    return [JobSummary(r[0], r[1], r[2] or "", r[3], int(r[4]), r[5], r[6], r[7]) for r in rows]


def count_jobs(conn: psycopg.Connection[Any], *, state: str | None = None, queue: str | None = None,
               actor: str | None = None, since: datetime | str | None = None, search: str | None = None,
               message_id: str | None = None, error: str | None = None) -> int:
    """How many jobs :func:`list_jobs` would page through with the same filters."""
    params = job_filters(state=state, queue=queue, actor=actor, since=since, search=search, message_id=message_id,
                         error=error)
    row = conn.execute(COUNT_JOBS, params).fetchone()
    return int(row[0]) if row else 0


def show_job(conn: psycopg.Connection[Any], message_id: str) -> JobDetail | None:
    """One job in full, or None when there is no such job (pruned, or never was)."""
    row = conn.execute(SHOW_JOB, {"message_id": parse_message_id(message_id)}).fetchone()
    if row is None:
        return None
    return JobDetail(
        id=row[0], queue=row[1], actor=row[2] or "", state=row[3], retries=int(row[4]), enqueued_at=row[5],
        error=row[6], args=list(row[7]) if isinstance(row[7], list) else [row[7]],
        kwargs=dict(row[8]) if isinstance(row[8], dict) else {}, options=dict(row[9] or {}),
        traceback=row[10], claims=int(row[11]), crashes=int(row[12]), snoozes=int(row[13]),
        worker_id=row[14], worker_host=row[15], worker_pid=row[16], eta=row[17], started_at=row[18],
        finished_at=row[19], updated_at=row[20], retried_by=row[21], retried_at=row[22],
        cancelled_by=row[23], cancelled_at=row[24],
    )


# -- retry and cancel --------------------------------------------------------------------

#: Rejected jobs matching the filters back to their queue, due now: retries and crashes
#: reset, error and traceback cleared, who and when recorded (columns and options), a
#: cancellation lifted; each queue's consumers are woken once. A cancelled job among them
#: is retried only with ``include_cancelled``; otherwise it is left as it is, and counted.
RETRY_JOBS = (
    "WITH matched AS (\n"
    "    SELECT q.message_id, q.cancelled_at IS NOT NULL AS cancelled, q.unique_key FROM dramatiq.queue q\n"
    "    WHERE q.\"state\" = 'rejected' AND " + JOB_FILTERS +
    "    ORDER BY q.message_id\n"
    "    FOR UPDATE\n"
    "), eligible AS (\n"
    "    SELECT message_id, cancelled, unique_key FROM matched WHERE %(include_cancelled)s OR NOT cancelled\n"
    # a unique job goes back only if no live message holds its key (and one per key)
    "), picked AS (\n"
    "    SELECT DISTINCT ON (coalesce(e.unique_key, uuid_send(e.message_id))) e.message_id, e.cancelled\n"
    "    FROM eligible e\n"
    "    WHERE e.unique_key IS NULL OR NOT EXISTS (\n"
    "        SELECT 1 FROM dramatiq.queue l WHERE l.unique_key = e.unique_key\n"
    "        AND standmeet.unique_live(l.unique_states, l.\"state\"))\n"
    "    ORDER BY coalesce(e.unique_key, uuid_send(e.message_id)), e.message_id\n"
    "), retried AS (\n"
    "    UPDATE dramatiq.queue q\n"
    "    SET \"state\" = 'queued', eta = now(), mtime = now(), worker_id = NULL, error = NULL, crashes = 0,\n"
    "        runs_without_outcome = 0,\n"
    "        cancelled_at = NULL, cancelled_by = NULL, retried_at = now(), retried_by = %(by)s,\n"
    "        message = jsonb_set(q.message, '{options}',\n"
    "            (coalesce(q.message->'options', '{}'::jsonb) - 'traceback' - 'error')\n"
    "            || jsonb_build_object('retries', 0, 'retried_by', %(by)s::text,\n"
    "                                  'retried_at', to_jsonb(now())))\n"
    "    FROM picked\n"
    "    WHERE q.message_id = picked.message_id\n"
    "    RETURNING q.queue_name, q.message_id::text AS message_id, picked.cancelled\n"
    "), woken AS (\n"
    "    SELECT pg_notify(standmeet.enqueue_channel(queue_name), '')\n"
    "    FROM (SELECT DISTINCT queue_name FROM retried) AS queues\n"
    ")\n"
    "SELECT (SELECT count(*) FROM retried),\n"
    "       (SELECT count(*) FROM matched WHERE cancelled AND NOT %(include_cancelled)s),\n"
    "       (SELECT coalesce(array_agg(message_id ORDER BY message_id), '{}') FROM retried WHERE cancelled),\n"
    "       (SELECT count(*) FROM woken),\n"
    "       (SELECT count(*) FROM eligible) - (SELECT count(*) FROM picked)\n"
)

#: Cancel the queued, delayed or running jobs matching the filters. One not running is
#: rejected at once (it never runs), with the reason, and its awaited receipt is sent;
#: a running one is marked, so the broker does not retry it and its deadline check
#: stops it.
CANCEL_JOBS = (
    "WITH picked AS (\n"
    "    SELECT q.message_id FROM dramatiq.queue q\n"
    "    WHERE q.\"state\" IN ('queued', 'consumed') AND q.cancelled_at IS NULL AND " + JOB_FILTERS +
    "    ORDER BY q.message_id\n"
    "    FOR UPDATE\n"
    "), cancelled AS (\n"
    "    UPDATE dramatiq.queue q\n"
    "    SET cancelled_at = now(), cancelled_by = %(by)s,\n"
    "        \"state\" = CASE WHEN q.\"state\" = 'queued' THEN 'rejected'::dramatiq.state ELSE q.\"state\" END,\n"
    "        error = CASE WHEN q.\"state\" = 'queued'\n"
    "                     THEN 'cancelled by ' || %(by)s || ' at ' || to_char(now() AT TIME ZONE 'UTC',\n"
    "                          'YYYY-MM-DD\"T\"HH24:MI:SS\"Z\"')\n"
    "                     ELSE q.error END,\n"
    "        mtime = CASE WHEN q.\"state\" = 'queued' THEN now() ELSE q.mtime END\n"
    "    FROM picked\n"
    "    WHERE q.message_id = picked.message_id\n"
    "    RETURNING q.queue_name, q.message_id, q.\"state\"\n"
    "), receipts AS (\n"
    "    SELECT pg_notify(standmeet.receipt_channel(queue_name), message_id::text || ':rejected')\n"
    "    FROM cancelled WHERE \"state\" = 'rejected'\n"
    ")\n"
    "SELECT (SELECT count(*) FROM cancelled), (SELECT count(*) FROM receipts)\n"
)


@dataclasses.dataclass(frozen=True)
class RetryOutcome(_Row):
    """What :func:`retry_jobs_outcome` did."""

    retried: int                        # jobs sent back to their queue
    skipped_cancelled: int              # cancelled jobs that matched and were left alone (cancel is final)
    retried_cancelled: list[str]        # ids of cancelled jobs retried all the same (named, or included)
    skipped_unique: int = 0             # unique jobs left alone: a live message holds their key


def retry_jobs_outcome(conn: psycopg.Connection[Any], *, message_ids: Sequence[str] | None = None,
                       state: str | None = None, queue: str | None = None, actor: str | None = None,
                       since: datetime | str | None = None, search: str | None = None,
                       error: str | None = None, include_cancelled: bool | None = None,
                       by: str) -> RetryOutcome:
    """Send rejected jobs (the ids given, or every one matching the filters) back to
    their queue, due now, with their retries reset; say how many, and how many cancelled
    ones it left alone.

    Only rejected jobs are retried (``state`` may narrow to ``rejected`` or ``cancelled``);
    a job queued, running or done is left alone. Cancel is final: a cancelled job is
    retried only when ``include_cancelled`` says so, which by default (None) it does for
    ``state="cancelled"`` and for ids given without a state (an operator naming the job),
    and for no filter otherwise.
    """
    if state not in (None, "rejected", "cancelled"):
        raise OpsError(f"only rejected or cancelled jobs can be retried, not {state!r} ones")
    if include_cancelled is None:
        include_cancelled = state == "cancelled" or (message_ids is not None and state is None)
    params = job_filters(state=state, queue=queue, actor=actor, since=since, search=search,
                         message_ids=message_ids, error=error)
    with conn.transaction():
        row = conn.execute(RETRY_JOBS, {**params, "by": _by(by), "include_cancelled": include_cancelled}).fetchone()
    if row is None:
        return RetryOutcome(0, 0, [])
    return RetryOutcome(int(row[0]), int(row[1]), [str(i) for i in row[2]], int(row[4]))


def retry_jobs(conn: psycopg.Connection[Any], *, message_ids: Sequence[str] | None = None,
               state: str | None = None, queue: str | None = None, actor: str | None = None,
               since: datetime | str | None = None, search: str | None = None,
               error: str | None = None, include_cancelled: bool | None = None, by: str) -> int:
    """:func:`retry_jobs_outcome`, returning how many jobs were retried."""
    return retry_jobs_outcome(conn, message_ids=message_ids, state=state, queue=queue, actor=actor, since=since,
                              search=search, error=error, include_cancelled=include_cancelled, by=by).retried


def cancel_jobs(conn: psycopg.Connection[Any], *, message_ids: Sequence[str] | None = None,
                state: str | None = None, queue: str | None = None, actor: str | None = None,
                since: datetime | str | None = None, search: str | None = None, error: str | None = None,
                by: str) -> int:
    """Cancel jobs (the ids given, or every queued, delayed or running one matching the
    filters); return how many. A job not running never runs; a running one is not
    retried and stops at its next deadline check. Finished jobs are left alone.
    """
    if state not in (None, "queued", "delayed", "running"):
        raise OpsError(f"only queued, delayed or running jobs can be cancelled, not {state!r} ones")
    params = job_filters(state=state, queue=queue, actor=actor, since=since, search=search,
                         message_ids=message_ids, error=error)
    with conn.transaction():
        row = conn.execute(CANCEL_JOBS, {**params, "by": _by(by)}).fetchone()
    return int(row[0]) if row else 0


# -- queues ------------------------------------------------------------------------------

#: Pause a queue and wake its consumers (their claim skips a paused queue).
PAUSE_QUEUE = """
WITH paused AS (
    INSERT INTO standmeet.queue_pauses (queue_name, paused_by) VALUES (%(queue)s, %(by)s)
    ON CONFLICT (queue_name) DO NOTHING
    RETURNING queue_name
)
SELECT count(*), pg_notify(standmeet.enqueue_channel(%(queue)s), '') FROM paused
"""

#: Resume a queue and wake its consumers at once (not at their next poll).
RESUME_QUEUE = """
WITH resumed AS (
    DELETE FROM standmeet.queue_pauses WHERE queue_name = %(queue)s RETURNING queue_name
)
SELECT count(*), pg_notify(standmeet.enqueue_channel(%(queue)s), '') FROM resumed
"""

PAUSED_QUEUES = "SELECT queue_name, paused_at, paused_by FROM standmeet.queue_pauses ORDER BY queue_name"

#: Whether any job (of any age) names the queue.
QUEUE_HAS_JOBS = "SELECT EXISTS (SELECT 1 FROM dramatiq.queue WHERE queue_name = %(queue)s)"


def pause_queue(conn: psycopg.Connection[Any], name: str, *, by: str) -> bool:
    """Stop every process claiming from ``name``; False when it was paused already.

    Jobs already running finish; nothing more starts until :func:`resume_queue`.
    """
    with conn.transaction():
        row = conn.execute(PAUSE_QUEUE, {"queue": _queue_name(name), "by": _by(by)}).fetchone()
    return bool(row and row[0])


def resume_queue(conn: psycopg.Connection[Any], name: str) -> bool:
    """Let every process claim from ``name`` again; False when it was not paused."""
    with conn.transaction():
        row = conn.execute(RESUME_QUEUE, {"queue": _queue_name(name)}).fetchone()
    return bool(row and row[0])


def queue_has_jobs(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether any job, finished long ago included, is of queue ``name``."""
    row = conn.execute(QUEUE_HAS_JOBS, {"queue": _queue_name(name)}).fetchone()
    return bool(row and row[0])


def paused_queues(conn: psycopg.Connection[Any]) -> dict[str, tuple[datetime, str | None]]:
    """Paused queues: name → (since when, by whom)."""
    return {r[0]: (r[1], r[2]) for r in conn.execute(PAUSED_QUEUES).fetchall()}


# -- webhooks ----------------------------------------------------------------------------

WEBHOOK_DELIVERIES = """
SELECT d.id, d.endpoint_id, ev.type, d.state, d.attempts, a.status_code,
       coalesce(a.error, CASE WHEN a.outcome <> 'ok' THEN a.outcome END),
       d.event_id, coalesce(a.outcome, d.last_outcome), d.updated_at, d.next_attempt_at
FROM standmeet.webhook_deliveries d
JOIN standmeet.webhook_events ev ON ev.id = d.event_id
LEFT JOIN LATERAL (
    SELECT status_code, outcome, error FROM standmeet.webhook_attempts
    WHERE delivery_id = d.id ORDER BY attempt DESC, id DESC LIMIT 1
) a ON true
WHERE (%(endpoint_id)s::bigint IS NULL OR d.endpoint_id = %(endpoint_id)s)
ORDER BY d.id DESC
LIMIT %(limit)s
"""

WEBHOOK_ENDPOINTS = """
SELECT e.id, e.url, e.event_types, e.enabled, e.disabled_reason, e.failing_since,
       a.started_at, a.outcome, a.status_code, a.error,
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'pending'),
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'failed')
FROM standmeet.webhook_endpoints e
LEFT JOIN LATERAL (
    SELECT last.started_at, last.outcome, last.status_code, last.error
    FROM standmeet.webhook_deliveries d
    CROSS JOIN LATERAL (
        SELECT started_at, outcome, status_code, error FROM standmeet.webhook_attempts
        WHERE delivery_id = d.id ORDER BY attempt DESC, id DESC LIMIT 1
    ) last
    WHERE d.endpoint_id = e.id AND d.attempts > 0
    ORDER BY d.updated_at DESC, d.id DESC
    LIMIT 1
) a ON true
ORDER BY e.id
"""


def webhook_deliveries(conn: psycopg.Connection[Any], endpoint_id: int | None = None, *,
                       limit: int = 100) -> list[DeliveryStatus]:
    """Deliveries, newest first, with their last attempt's HTTP status and error."""
    if not 0 < limit <= MAX_LIMIT:
        raise OpsError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    rows = conn.execute(WEBHOOK_DELIVERIES, {"endpoint_id": endpoint_id, "limit": limit}).fetchall()
    return [DeliveryStatus(int(r[0]), int(r[1]), r[2], r[3], int(r[4]), r[5], r[6], int(r[7]), r[8], r[9], r[10])
            for r in rows]


def webhook_endpoints(conn: psycopg.Connection[Any]) -> list[EndpointStatus]:
    """Endpoints with their health: the last attempt, and deliveries pending or failed."""
    return [EndpointStatus(int(r[0]), r[1], list(r[2]), bool(r[3]), r[4], r[5], r[6], r[7], r[8], r[9],
                           int(r[10]), int(r[11]))
            for r in conn.execute(WEBHOOK_ENDPOINTS).fetchall()]


#: Turn an endpoint on (its failure streak forgotten) or off (with the reason).
SET_ENDPOINT_ENABLED = """
UPDATE standmeet.webhook_endpoints
SET enabled = %(enabled)s,
    disabled_reason = CASE WHEN %(enabled)s THEN NULL ELSE %(reason)s END,
    failing_since = CASE WHEN %(enabled)s THEN NULL ELSE failing_since END
WHERE id = %(id)s
RETURNING id
"""

#: Deliveries back to pending; the caller then enqueues one ``webhook.deliver`` each.
REPLAY_DELIVERIES = """
UPDATE standmeet.webhook_deliveries SET state = 'pending', updated_at = now()
WHERE id = ANY(%(ids)s::bigint[])
RETURNING id
"""

#: The actor and queue of a webhook delivery job (declared by the application).
DELIVER_ACTOR = "webhook.deliver"
DELIVER_QUEUE = "webhook"
#: Each delivery names the message that carries it: a job that makes the delivery as part
#: of its endpoint's batch marks that message done while it is still queued.
NAME_DELIVERY_MESSAGES = """
UPDATE standmeet.webhook_deliveries d SET message_id = m.message_id
FROM unnest(%(ids)s::bigint[], %(messages)b::uuid[]) AS m(id, message_id) WHERE d.id = m.id
"""


def record_delivery_messages(conn: psycopg.Connection[Any], delivery_ids: Sequence[int],
                             message_ids: Sequence[str]) -> None:
    """Record on each delivery the id of the message just enqueued for it (same order)."""
    if delivery_ids:
        conn.execute(NAME_DELIVERY_MESSAGES, {"ids": list(delivery_ids), "messages": list(message_ids)})


def set_endpoint_enabled(conn: psycopg.Connection[Any], endpoint_id: int, enabled: bool, *,
                         reason: str | None = None) -> bool:
    """Enable or disable a webhook endpoint; False when there is no such endpoint."""
    with conn.transaction():
        row = conn.execute(SET_ENDPOINT_ENABLED, {
            "id": endpoint_id, "enabled": enabled, "reason": reason or "disabled by an operator"}).fetchone()
    return row is not None


def replay_deliveries(conn: psycopg.Connection[Any], delivery_ids: Sequence[int]) -> int:
    """Deliver again (any state): each back to pending with a ``webhook.deliver`` job
    enqueued in the same transaction; returns how many exist. Needs no actor import."""
    from dramatiq.message import Message

    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    with conn.transaction():
        found = [int(r[0]) for r in conn.execute(REPLAY_DELIVERIES, {"ids": list(delivery_ids)}).fetchall()]
        if found:
            messages: list[Message] = [
                Message(queue_name=DELIVER_QUEUE, actor_name=DELIVER_ACTOR, args=(i,), kwargs={}, options={})
                for i in found
            ]
            conn.execute(sql_enqueue.ENQUEUE, enqueue_params(messages))
            record_delivery_messages(conn, found, [m.message_id for m in messages])
    return len(found)


# -- the audit trail ---------------------------------------------------------------------

RECORD_ACTION = """
INSERT INTO standmeet.operator_actions (action, target, affected, by_whom, source)
VALUES (%(action)s, %(target)s::jsonb, %(affected)s, %(by)s, %(source)s)
RETURNING id
"""

LIST_ACTIONS = """
SELECT id, at, action, target, affected, by_whom, source
FROM standmeet.operator_actions
ORDER BY at DESC, id DESC
LIMIT %(limit)s
"""


def record_action(conn: psycopg.Connection[Any], *, action: str, target: Any, by: str, source: str,
                  affected: int | None = None) -> int:
    """Record what an operator did (``action``: e.g. ``jobs.retry``), to what (``target``:
    JSON, e.g. ``{"message_ids": [...]}`` or a filter), who (``by``) and from where
    (``source``: ``cli``, or the dashboard's client address); returns the record's id."""
    row = conn.execute(RECORD_ACTION, {
        "action": action, "target": json.dumps(jsonable(target)), "affected": affected,
        "by": _by(by), "source": source,
    }).fetchone()
    assert row is not None
    return int(row[0])


@dataclasses.dataclass(frozen=True)
class UniqueSkips(_Row):
    """Sends of a unique actor skipped because a live message held their key."""

    queue: str
    actor: str
    skipped: int
    last_skipped_at: datetime


#: Every actor's count of skipped unique sends, the most recent first.
UNIQUE_SKIPS = """
SELECT queue_name, actor_name, skipped, last_skipped_at FROM standmeet.unique_skips
ORDER BY last_skipped_at DESC LIMIT %(limit)s
"""


def unique_skips(conn: psycopg.Connection[Any], *, limit: int = 50) -> list[UniqueSkips]:
    """How many sends of each unique actor were skipped (a live message held the key)."""
    return [UniqueSkips(q, a, int(n), at) for q, a, n, at in conn.execute(UNIQUE_SKIPS, {"limit": limit}).fetchall()]


def recent_actions(conn: psycopg.Connection[Any], *, limit: int = 50) -> list[OperatorAction]:
    return [OperatorAction(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6])
            for r in conn.execute(LIST_ACTIONS, {"limit": limit}).fetchall()]


# -- arguments ---------------------------------------------------------------------------

_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_since(value: datetime | str | None, *, now: datetime | None = None) -> datetime | None:
    """A point in time from a datetime, an ISO time (UTC when it has no zone) or an age
    (``90s``, ``15m``, ``2h``, ``7d``: that long ago)."""
    if value is None or isinstance(value, datetime):
        if isinstance(value, datetime) and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value
    match = _AGE.match(value)
    if match:
        seconds = float(match.group(1)) * _AGE_UNITS[match.group(2)]
        if not seconds <= MAX_SINCE_AGE_S:  # also refuses an age too long to be a number
            raise OpsError(f"since {value.strip()!r} is too long ago: give an age from 0s to "
                           f"{MAX_SINCE_AGE_S / 86_400:.0f}d, or an ISO time")
        return (now or datetime.now(timezone.utc)) - timedelta(seconds=seconds)
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise OpsError(f"since {value!r} is neither an ISO time nor an age like 15m, 2h or 1d") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def parse_message_id(value: str) -> str:
    """A job id, normalised; a clear error when it is not a UUID."""
    try:
        return str(uuid.UUID(str(value).strip()))
    except ValueError:
        raise OpsError(f"{value!r} is not a job id (a UUID like 0b5a…-…)") from None


_HEX = frozenset("0123456789abcdef")
_UUID_SHAPE = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"


def id_range(prefix: str, *, min_hex: int = 1) -> tuple[str, str]:
    """The lowest and highest job id that start with ``prefix`` (hex digits, with or
    without the dashes where a UUID has them): a range the primary key's index answers.
    Refused in one line when it is not the start of a job id or has fewer than
    ``min_hex`` hex digits."""
    text = str(prefix).strip().lower()
    if "-" in text:
        shaped = len(text) <= len(_UUID_SHAPE) and all(
            (c == "-") == (shape == "-") and (c == "-" or c in _HEX) for c, shape in zip(text, _UUID_SHAPE, strict=False))
    else:
        shaped = len(text) <= 32 and all(c in _HEX for c in text)
    digits = text.replace("-", "")
    if not shaped or not digits:
        raise OpsError(f"{prefix!r} is not a job id or the start of one (hex digits, as in 0b5a1c2d)")
    if len(digits) < min_hex:
        raise OpsError(f"{prefix!r} is not a job id: a prefix needs at least {min_hex} hex digits "
                       f"(status prints {MIN_ID_PREFIX_HEX}), or give the whole id")
    return str(uuid.UUID(digits.ljust(32, "0"))), str(uuid.UUID(digits.ljust(32, "f")))


#: The first few job ids in a range of ids (an index range scan of the primary key).
JOB_IDS_IN_RANGE = """
SELECT q.message_id::text FROM dramatiq.queue q
WHERE q.message_id BETWEEN %(low)s::uuid AND %(high)s::uuid
ORDER BY q.message_id
LIMIT %(limit)s
"""


def resolve_job_id(conn: psycopg.Connection[Any], value: str) -> str:
    """The job id ``value`` names: a whole id (returned as it is, whether or not the job
    exists), or a prefix of at least :data:`MIN_ID_PREFIX_HEX` hex digits that exactly one
    job's id starts with. A shorter prefix, one no job's id starts with, or one several
    do (the first :data:`AMBIGUOUS_SHOWN` are named) is refused in one line."""
    text = str(value).strip()
    if len(text.replace("-", "")) >= 32:
        return parse_message_id(text)
    low, high = id_range(text, min_hex=MIN_ID_PREFIX_HEX)
    found = [r[0] for r in conn.execute(JOB_IDS_IN_RANGE, {"low": low, "high": high,
                                                           "limit": AMBIGUOUS_SHOWN + 1}).fetchall()]
    if not found:
        raise OpsError(f"no job id starts with {text!r} (never enqueued, or pruned after the retention)")
    if len(found) > 1:
        more = " and more" if len(found) > AMBIGUOUS_SHOWN else ""
        raise OpsError(f"job id prefix {text!r} is ambiguous: it matches {', '.join(found[:AMBIGUOUS_SHOWN])}{more}; "
                       "give more of the id")
    return found[0]


def resolve_job_ids(conn: psycopg.Connection[Any], values: Iterable[str]) -> list[str]:
    """:func:`resolve_job_id` of each value, in order, each id once."""
    return list(dict.fromkeys(resolve_job_id(conn, v) for v in values))


def job_filters(*, state: str | None = None, queue: str | None = None, actor: str | None = None,
                since: datetime | str | None = None, search: str | None = None,
                message_id: str | None = None, message_ids: Iterable[str] | None = None,
                error: str | None = None) -> dict[str, Any]:
    """The parameters of :data:`JOB_FILTERS`, checked (``error``: at most
    :data:`MAX_ERROR_SEARCH_CHARS`, no control characters)."""
    if state is not None and state not in JOB_STATES:
        raise OpsError(f"unknown job state {state!r}; one of {', '.join(JOB_STATES)}")
    id_low = id_high = None
    if message_id:
        id_low, id_high = id_range(message_id)
    ids = None if message_ids is None else [parse_message_id(m) for m in message_ids]
    if error:
        if len(error) > MAX_ERROR_SEARCH_CHARS:
            raise OpsError(f"error: the text to search errors for must be at most {MAX_ERROR_SEARCH_CHARS} "
                           f"characters, not {len(error)}")
        if any(ord(c) < 32 or ord(c) == 127 for c in error):
            raise OpsError(f"error: the text to search errors for must not contain control characters: {error!r}")
    return {
        "state": state, "queue": queue or None, "actor": actor or None, "since": parse_since(since),
        "id_low": id_low, "id_high": id_high, "message_ids": ids, "search": _contains(search),
        "error": _contains(error),
    }


def _contains(text: str | None) -> str | None:
    """An ILIKE pattern matching ``text`` anywhere, its wildcards taken literally (None: no filter)."""
    if not text:
        return None
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def jsonable(value: Any) -> Any:
    """``value`` (a dataclass of this module, a list of them, …) with datetimes as ISO
    strings and tuples as lists: ready for ``json.dumps``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _by(by: str) -> str:
    if not by or not by.strip():
        raise OpsError("say who does it (by=…)")
    return by.strip()


def _queue_name(name: str) -> str:
    if not name or not name.strip():
        raise OpsError("a queue name is required")
    return name.strip()


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _one_line(text: str | None) -> str | None:
    if not text:
        return None
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    """The database's clock: what every age and window of this module is judged by."""
    return _db_now(conn)


def _db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute(DB_NOW).fetchone()
    assert row is not None
    return row[0]
