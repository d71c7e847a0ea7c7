"""Periodic jobs: the tick that enqueues each once per period, across every scheduler.

Which jobs are periodic is declared by the modules that own them
(``broker.app.periodic(name, actor, interval_s=…)``; the runtime declares its own
maintenance jobs). The scheduler process (``python -m periodic MODULE…``) loads those
modules and ticks each job on an APScheduler interval trigger; a tick enqueues the
job's actor under a key for its period (``standmeet.periodic_runs``, primary key (job,
period start)). Two scheduler processes therefore enqueue it once per period: a unique
constraint, not a leader. The period is the database's, computed in the claim from
``now()``: schedulers whose clocks disagree (by 90 s, or by hours) still agree on it, so
a skewed clock moves when a scheduler ticks, never how often a job runs.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone

import psycopg

from broker import db
from broker.app import PeriodicJob, periodic_jobs
from broker.enqueue import build_message, enqueue_message
from broker.errors import DatabaseError
from broker.pgbroker import current_broker

logger = logging.getLogger("standmeet.periodic")


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


__all__ = ["CLAIM_DATABASE_PERIOD", "PeriodicJob", "periodic_jobs", "tick", "tick_or_say", "utcnow"]

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


def tick(job: PeriodicJob) -> str | None:
    """Enqueue ``job`` for the database's current period unless some scheduler already did.

    Returns the message id when this call enqueued it, None when it was already done.
    This process's clock plays no part.
    """
    message = build_message(job.actor, kwargs=job.kwargs)
    with db.connection() as conn, conn.transaction():
        row = conn.execute(
            CLAIM_DATABASE_PERIOD,
            {"job": job.name, "interval_s": job.interval_s, "message_id": message.message_id},
        ).fetchone()
        if row is None:
            return None
        enqueue_message(conn, message)
    period: datetime = row[1]
    logger.info("periodic %s: enqueued %s for the period starting %s", job.name, job.actor, period.isoformat())
    return message.message_id


def tick_or_say(job: PeriodicJob) -> str | None:
    """:func:`tick`, with a database that went away said once for the process (its
    outage: one line when it goes, one when it is back), never as a traceback. The
    period's claim went with the failed transaction: the next tick claims it again."""
    outage = current_broker().outage
    try:
        enqueued = tick(job)
    except (psycopg.Error, DatabaseError) as exc:
        outage.failed(f"periodic {job.name}", exc)
        return None
    outage.ok()
    return enqueued
