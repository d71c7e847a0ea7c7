"""Periodic jobs (R14): the table, and the tick that enqueues each once per period.

Declaring a periodic job is one entry in :data:`PERIODIC_JOBS`. The scheduler
process (``python -m periodic``) ticks each job on an APScheduler interval trigger;
a tick enqueues the job's actor on the maintenance queue under a key for its
period (``standmeet.periodic_runs``, primary key (job, period start)). Two scheduler
processes therefore enqueue it once per period: a unique constraint, not a leader.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from broker import db, sql
from broker.enqueue import build_message, enqueue_message

logger = logging.getLogger(__name__)

Clock = Callable[[], datetime]


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


@dataclass(frozen=True)
class PeriodicJob:
    """Run ``actor`` every ``interval_s`` seconds, once per period across all schedulers."""

    name: str
    actor: str
    interval_s: float
    kwargs: dict[str, Any] = field(default_factory=dict)

    def period_start(self, now: datetime) -> datetime:
        epoch = now.timestamp()
        start = epoch - (epoch % self.interval_s)
        return datetime.fromtimestamp(start, timezone.utc)


#: The table of periodic jobs. Add one line to declare a new one.
PERIODIC_JOBS: list[PeriodicJob] = [
    PeriodicJob("prune-messages", "maintenance.prune_messages", interval_s=3600),
    PeriodicJob("rescue", "maintenance.rescue", interval_s=30),
    PeriodicJob("prune-outbox", "maintenance.prune_outbox", interval_s=3600),
    PeriodicJob("webhook-health", "maintenance.webhook_health", interval_s=3600),
    PeriodicJob("fetch-new", "jobs.fetch_new", interval_s=900),
]


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
