"""Periodic jobs: the tick that enqueues each once per period, across every scheduler.

Which jobs are periodic is declared by the modules that own them
(``broker.app.periodic(name, actor, interval_s=…)``; the runtime declares its own
maintenance jobs). The scheduler process (``python -m periodic MODULE…``) loads those
modules and ticks each job on an APScheduler interval trigger; a tick enqueues the
job's actor under a key for its period (``standmeet.periodic_runs``, primary key (job,
period start)). Two scheduler processes therefore enqueue it once per period: a unique
constraint, not a leader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime, timezone

from broker import db, sql
from broker.app import PeriodicJob, periodic_jobs
from broker.enqueue import build_message, enqueue_message

logger = logging.getLogger("standmeet.periodic")

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


__all__ = ["PeriodicJob", "periodic_jobs", "tick", "utcnow"]


def tick(job: PeriodicJob, *, clock: Clock = utcnow) -> str | None:
    """Enqueue ``job`` for the current period unless some scheduler already did.

    Returns the message id when this call enqueued it, None when it was already done.
    """
    period = job.period_start(clock())
    message = build_message(job.actor, kwargs=job.kwargs)
    with db.connection() as conn, conn.transaction():
        row = conn.execute(
            sql.CLAIM_PERIOD,
            {"job": job.name, "period_start": period, "message_id": message.message_id},
        ).fetchone()
        if row is None:
            return None
        enqueue_message(conn, message)
    logger.info("periodic %s: enqueued %s for the period starting %s", job.name, job.actor, period.isoformat())
    return message.message_id
