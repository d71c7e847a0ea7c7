"""The runtime's own maintenance jobs: retention (messages, attempts, history), crash
rescue, expired results and limits.

They belong to the runtime, not to any application: ``broker.configure()`` declares
them on the broker it builds (:func:`declare`; importing this module declares nothing),
on the ``maintenance`` queue (one at a time, 10 minutes), and ``broker.app`` declares
their periods, so every scheduler runs them whatever modules it loads.
"""

from __future__ import annotations

import logging

import dramatiq

from broker import deadline
from broker.backends.rate_limits import PRUNE_EXPIRED_RATE_LIMITS
from broker.backends.results import PRUNE_EXPIRED_RESULTS
from broker.engine import sql, sql_history
from broker.outbox import PRUNE_RELAYS
from broker.pg import db
from broker.services import current_broker

logger = logging.getLogger("standmeet.maintenance")


def prune_in_batches(query: str, *, retention_s: float, what: str) -> int:
    """Run a batched DELETE until a batch comes back short, checking the deadline between batches."""
    batch = current_broker().settings.prune_batch
    total = 0
    while True:
        deadline.check()
        with db.connection() as conn:
            deleted = conn.execute(query, {"retention_s": retention_s, "batch": batch}).rowcount
        total += deleted
        if deleted < batch:
            break
    if total:
        logger.info("pruned %d %s", total, what)
    return total


def prune_messages() -> None:
    """Delete finished messages past the retention, the attempts, per-minute history and
    periodic jobs' claimed periods past theirs (STANDMEET_HISTORY_RETENTION_DAYS; each
    job's latest period kept), and the rows of long-gone workers."""
    settings = current_broker().settings
    prune_in_batches(sql.PRUNE_FINISHED, retention_s=settings.retention_days * 86400, what="finished message(s)")
    prune_in_batches(sql_history.PRUNE_ATTEMPTS, retention_s=settings.history_retention_days * 86400, what="attempt(s)")
    prune_in_batches(sql_history.PRUNE_HISTORY, retention_s=settings.history_retention_days * 86400,
                     what="minute(s) of history")
    prune_in_batches(sql_history.PRUNE_PERIODIC_RUNS, retention_s=settings.history_retention_days * 86400,
                     what="claimed period(s) of periodic jobs")
    with db.connection() as conn:
        conn.execute(sql.PRUNE_WORKERS)


def rescue() -> None:
    """Requeue the messages of dead worker processes (workers also do this on heartbeat)."""
    current_broker().rescue_once()


def prune_outbox() -> None:
    """Delete relayed outbox rows older than the retention, batch by batch, and the rows of
    relays stopped or silent for a day (or for the unrouted events' max age, if longer)."""
    settings = current_broker().settings
    prune_in_batches(sql.PRUNE_OUTBOX, retention_s=settings.outbox_retention_hours * 3600,
                     what="relayed outbox row(s)")
    with db.connection() as conn:
        conn.execute(PRUNE_RELAYS, {"orphaned_after_s": settings.outbox_unrouted_max_age_s})


def prune_expired() -> None:
    """Delete expired results and rate-limiter keys, batch by batch."""
    prune_in_batches(PRUNE_EXPIRED_RESULTS, retention_s=0, what="expired result(s)")
    prune_in_batches(PRUNE_EXPIRED_RATE_LIMITS, retention_s=0, what="expired rate-limit key(s)")


#: The queue of the runtime's own jobs.
QUEUE = "maintenance"
#: The runtime's own jobs: actor name -> function.
JOBS = {
    "maintenance.prune_messages": prune_messages,
    "maintenance.rescue": rescue,
    "maintenance.prune_outbox": prune_outbox,
    "maintenance.prune_expired": prune_expired,
}


def declare(broker: dramatiq.Broker) -> list[dramatiq.Actor]:  # type: ignore[type-arg]
    """Declare the runtime's own jobs on ``broker``, those it does not have yet (actors of
    an earlier broker moved over); returns the ones declared."""
    broker.declare_queue(QUEUE)
    return [dramatiq.Actor(fn, broker=broker, actor_name=name, queue_name=QUEUE, priority=0, options={})
            for name, fn in JOBS.items() if name not in broker.actors]
