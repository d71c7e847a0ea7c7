"""The maintenance queue's actors (limit 1, 10 min). The scheduler enqueues them."""

from __future__ import annotations

import logging

import dramatiq

from broker import db, deadline, sql
from broker.pgbroker import current_broker

logger = logging.getLogger(__name__)


def prune_finished_once(*, retention_s: float, batch: int) -> int:
    """Delete one batch of finished messages past the retention; returns how many."""
    with db.connection() as conn:
        return conn.execute(sql.PRUNE_FINISHED, {"retention_s": retention_s, "batch": batch}).rowcount


@dramatiq.actor(actor_name="maintenance.prune_messages", queue_name="maintenance")
def prune_messages() -> None:
    """Delete finished messages past the retention, batch by batch, within the time limit."""
    settings = current_broker().settings
    total = 0
    while True:
        deadline.check()
        deleted = prune_finished_once(retention_s=settings.retention_days * 86400, batch=settings.prune_batch)
        total += deleted
        if deleted < settings.prune_batch:
            break
    with db.connection() as conn:  # and the rows of worker processes long gone
        conn.execute(sql.PRUNE_WORKERS)
    if total:
        logger.info("pruned %d finished message(s)", total)


@dramatiq.actor(actor_name="maintenance.rescue", queue_name="maintenance")
def rescue() -> None:
    """Requeue the messages of dead worker processes (workers also do this on heartbeat)."""
    current_broker().rescue_once()


@dramatiq.actor(actor_name="maintenance.prune_outbox", queue_name="maintenance")
def prune_outbox() -> None:
    """Delete relayed outbox rows older than the retention, batch by batch."""
    settings = current_broker().settings
    params = {"retention_s": settings.outbox_retention_hours * 3600, "batch": settings.prune_batch}
    total = 0
    while True:
        deadline.check()
        with db.connection() as conn:
            deleted = conn.execute(sql.PRUNE_OUTBOX, params).rowcount
        total += deleted
        if deleted < settings.prune_batch:
            break
    if total:
        logger.info("pruned %d relayed outbox row(s)", total)
