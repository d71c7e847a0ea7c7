"""Periodic jobs: the tick that enqueues each once per period, across every scheduler.

Which jobs are periodic is declared by the modules that own them
(``broker.app.periodic(name, actor, interval_s=…)`` or ``cron="0 3 * * *",
timezone="Europe/Berlin"``; the runtime declares its own maintenance jobs). The
scheduler process (``python -m periodic MODULE…``) loads those modules and ticks each
job (:func:`trigger`); a tick enqueues the job's actor under a key for its period
(``standmeet.periodic_runs``, primary key (job, period start)). Two scheduler processes
therefore enqueue it once per period: a unique constraint, not a leader. The period is
the database's, computed from its ``now()``: schedulers whose clocks disagree (by 90 s,
or by hours) still agree on it, so a skewed clock moves when a scheduler ticks, never
how often a job runs. An interval job is ticked on each of its boundaries by the
scheduler's clock and again every :func:`tick_every_s` between them (at most
``CRON_TICK_S``, and at most a quarter of its interval): a tick that came just before the
database's boundary (a clock a millisecond ahead) claimed the period already taken, one
that failed (the database away past its checkout timeout) claimed nothing, and the next
one within the period claims it. A scheduler whose clock steps (back or forward by more
than ``CLOCK_STEP_S``) reschedules its ticks at once (``periodic.__main__``).

A cron job's period starts at each of its fire times (:mod:`broker.cron`: wall-clock
times in its zone, daylight-saving changes included). Its scheduler looks every
``CRON_TICK_S``; a fire time is claimed up to half the gap to the next one (at most
``CRON_GRACE_MOST_S``) after it, so a scheduler started at 14:00 does not run the 03:00
job of that night, and one down over a fire time for longer skips it.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING

import psycopg

from broker.app import PeriodicJob, periodic_jobs
from broker.engine.enqueue import build_message, enqueue_message
from broker.errors import DatabaseError
from broker.pg import db
from broker.services import current_broker

if TYPE_CHECKING:  # APScheduler is imported by the scheduler process only (``trigger``)
    from apscheduler.schedulers.base import BaseScheduler
    from apscheduler.triggers.base import BaseTrigger

logger = logging.getLogger("standmeet.periodic")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


__all__ = ["CLAIM_DATABASE_PERIOD", "CLAIM_FIRE_TIME", "ClockWatch", "PeriodicJob", "cron_period", "periodic_jobs",
           "publish_schedules", "reschedule_if_stepped", "tick", "tick_every_s", "tick_or_say", "trigger", "utcnow"]

#: How often a scheduler looks whether a cron job's fire time has come (by the database's clock).
CRON_TICK_S = 15.0
#: A cron fire time is claimed at most this long after it (or half the gap to the next).
CRON_GRACE_MOST_S = 3600.0
#: A wall clock that moves this much against the monotonic one has been stepped: the
#: scheduler's ticks, timed by the wall clock, are rescheduled from the new time.
CLOCK_STEP_S = 1.0

#: Claim the period the database's clock is in (its start: ``now()`` floored to a
#: multiple of the interval since the epoch); a row back means this scheduler enqueues
#: the job for it, with the period it claimed.
CLAIM_DATABASE_PERIOD = """
INSERT INTO standmeet.periodic_runs (job, period_start, message_id)
SELECT %(job)s,
       to_timestamp(floor(extract(epoch FROM now())::float8 / %(interval_s)s::float8) * %(interval_s)s::float8),
       %(message_id)s::uuid
ON CONFLICT (job, period_start) DO NOTHING
RETURNING message_id, period_start
"""


#: Claim a cron job's fire time (computed from the database's ``now()`` read first in
#: the same transaction); a row back means this scheduler enqueues the job for it.
CLAIM_FIRE_TIME = """
INSERT INTO standmeet.periodic_runs (job, period_start, message_id)
VALUES (%(job)s, %(period_start)s, %(message_id)s::uuid)
ON CONFLICT (job, period_start) DO NOTHING
RETURNING message_id, period_start
"""
DATABASE_NOW = "SELECT now()"
#: A period whose message a unique key folded into a live one names that one (the claim
#: is made before the send, in the same transaction).
RECLAIM_FOR = """
UPDATE standmeet.periodic_runs SET message_id = %(message_id)s::uuid
WHERE job = %(job)s AND period_start = %(period_start)s
"""

#: A scheduler says which jobs it runs and on what schedule (the last one to start wins).
PUBLISH_SCHEDULE = """
INSERT INTO standmeet.periodic_schedules (job, actor, interval_s, cron, timezone, declared_at)
SELECT * FROM unnest(%(job)s::text[], %(actor)s::text[], %(interval_s)s::float8[], %(cron)s::text[],
                     %(timezone)s::text[]) AS s, now()
ON CONFLICT (job) DO UPDATE SET actor = EXCLUDED.actor, interval_s = EXCLUDED.interval_s, cron = EXCLUDED.cron,
    timezone = EXCLUDED.timezone, declared_at = EXCLUDED.declared_at
"""


def publish_schedules(jobs: list[PeriodicJob]) -> None:
    """Record the schedules of ``jobs`` in the database, so that any process shows them."""
    if not jobs:
        return
    with db.connection() as conn:  # (an interval given as 60 or 60.0: one type for the array)
        conn.execute(PUBLISH_SCHEDULE, {
            "job": [j.name for j in jobs], "actor": [j.actor for j in jobs],
            "interval_s": [None if j.interval_s is None else float(j.interval_s) for j in jobs],
            "cron": [j.cron for j in jobs],
            "timezone": [j.timezone for j in jobs]})


def cron_period(job: PeriodicJob, now: datetime) -> datetime | None:
    """The fire time of cron ``job`` a tick at ``now`` claims: its latest one at or before
    ``now``, if no older than its grace (half the gap to the next fire time, at most
    ``CRON_GRACE_MOST_S``); None when there is none to claim."""
    assert job.schedule is not None
    fired = job.schedule.previous(now)
    if fired is None:
        return None
    following = job.schedule.next(fired)
    gap_s = (following - fired).total_seconds() if following is not None else CRON_GRACE_MOST_S * 2
    grace_s = min(CRON_GRACE_MOST_S, gap_s / 2)
    return fired if (now - fired).total_seconds() <= grace_s else None


def tick_every_s(job: PeriodicJob) -> float:
    """How often a scheduler ticks ``job``: every ``CRON_TICK_S`` for cron; for an
    interval, its interval divided into equal parts of at most ``CRON_TICK_S``, at least
    four (so each boundary is ticked, and the period again three times before it ends: a
    tick held up by an outage, for up to the pool's checkout timeout, leaves others)."""
    if job.schedule is not None or job.interval_s is None:
        return CRON_TICK_S
    return job.interval_s / max(4, math.ceil(job.interval_s / CRON_TICK_S))


def trigger(job: PeriodicJob, now: datetime) -> BaseTrigger:
    """When a scheduler ticks ``job`` (:func:`tick_every_s`): from its interval's
    boundary (aligned with the database's periods), or from ``CRON_TICK_S`` on for cron."""
    from apscheduler.triggers.interval import IntervalTrigger

    if job.schedule is not None:
        return IntervalTrigger(seconds=CRON_TICK_S, start_date=now + timedelta(seconds=CRON_TICK_S))
    return IntervalTrigger(seconds=tick_every_s(job), start_date=job.period_start(now))


class ClockWatch:
    """Notices a stepped wall clock (NTP's step, a restored virtual machine): the wall
    clock's offset from the monotonic one changed by more than ``CLOCK_STEP_S``."""

    def __init__(self, *, wall: Callable[[], float] = time.time, monotonic: Callable[[], float] = time.monotonic) -> None:
        self._wall, self._monotonic = wall, monotonic
        self._offset = wall() - monotonic()

    def stepped_s(self) -> float | None:
        """The step since the last call (seconds; negative: back), or None when none."""
        offset = self._wall() - self._monotonic()
        step, self._offset = offset - self._offset, offset
        return step if abs(step) > CLOCK_STEP_S else None


def reschedule_if_stepped(scheduler: BaseScheduler, jobs: list[PeriodicJob], clock: ClockWatch) -> float | None:
    """After a step of the wall clock, which times the ticks (back: none would come for as
    long), reschedule each job's ticks from the new time (the periods stay the
    database's); returns the step, or None when there was none."""
    stepped_s = clock.stepped_s()
    if stepped_s is None:
        return None
    now = utcnow()
    logger.warning("the clock stepped %+.0f s: periodic ticks rescheduled from %s", stepped_s,
                   now.isoformat(timespec="seconds"))
    for job in jobs:
        scheduler.reschedule_job(job.name, trigger=trigger(job, now))
    return stepped_s


def tick(job: PeriodicJob) -> str | None:
    """Enqueue ``job`` for the database's current period unless some scheduler already did.

    Returns the message id when this call enqueued it (for a unique actor whose key a
    live message holds, that message's: the period names it), None when it was already
    done (or, for cron, when no fire time is due). This process's clock plays no part.
    """
    message = build_message(job.actor, kwargs=job.kwargs)
    with db.connection() as conn, conn.transaction():
        if job.schedule is not None:
            clock = conn.execute(DATABASE_NOW).fetchone()
            fired = cron_period(job, clock[0]) if clock is not None else None
            if fired is None:
                return None
            row = conn.execute(
                CLAIM_FIRE_TIME, {"job": job.name, "period_start": fired, "message_id": message.message_id},
            ).fetchone()
        else:
            row = conn.execute(
                CLAIM_DATABASE_PERIOD,
                {"job": job.name, "interval_s": job.interval_s, "message_id": message.message_id},
            ).fetchone()
        if row is None:
            return None
        written = enqueue_message(conn, message)
        period: datetime = row[1]
        if written.message_id != message.message_id:  # a unique actor's key is held: the period is its
            conn.execute(RECLAIM_FOR, {"job": job.name, "period_start": period, "message_id": written.message_id})
            logger.info("periodic %s: %s not enqueued for the period starting %s: its unique key is held by "
                        "message %s", job.name, job.actor, period.isoformat(), written.message_id)
            return written.message_id
    logger.info("periodic %s: enqueued %s for the period starting %s", job.name, job.actor, period.isoformat())
    return message.message_id


def tick_or_say(job: PeriodicJob) -> str | None:
    """:func:`tick`, with a database that went away said once for the process (its
    outage: one line when it goes, one when it is back), never as a traceback. The
    period's claim went with the failed transaction: the next tick, within the period
    (:func:`tick_every_s`), claims it again."""
    outage = current_broker().outage
    try:
        enqueued = tick(job)
    except (psycopg.Error, DatabaseError) as exc:
        outage.failed(f"periodic {job.name}", exc)
        return None
    outage.ok()
    return enqueued
