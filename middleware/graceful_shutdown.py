"""Graceful shutdown: on SIGTERM, stop the relay first, claim nothing more, finish what runs.

The relay of the outbox starts with the worker (every process runs one) and is the
first thing stopped.

Dramatiq's worker stops its worker threads first (each finishes its current job,
for up to ``--worker-shutdown-timeout``), then its consumers, and gives back the
messages it had prefetched. This middleware makes the broker stop claiming the
moment shutdown starts, so no new message is taken while the running ones finish.
Prefetched messages (claimed, not started) go back to their queue the moment shutdown
starts. The shutdown says how many running jobs it waits for, naming them (a few, then
"and N more"). A job still running at the shutdown timeout is named in one line (actor,
id, how long it ran) as it is cut off; the broker's close gives it back without a crash
counted (a deploy is not a crash): it runs again, at least once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from dramatiq import Middleware

from broker import services
from broker.running import SHUTDOWN_MS_ATTRIBUTE, name_jobs, running_jobs

logger = logging.getLogger(f"standmeet.{__name__}")


#: How often idle worker threads look for a shutdown (Dramatiq's default is 1 s).
IDLE_POLL_MS = 100


class GracefulShutdown(Middleware):
    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        # Idle worker threads and consumers notice a shutdown within this, not a second.
        worker.worker_timeout = min(worker.worker_timeout, IDLE_POLL_MS)
        broker.claiming = True  # a worker booting on a broker whose last worker stopped

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        # Every worker process relays the outbox (no leader); the broker owns the thread.
        services.current().start_relay()

    def before_worker_shutdown(self, broker: Any, worker: Any) -> None:
        services.current().stop_relay()
        broker.stop_claiming()
        jobs = running_jobs.now()
        shutdown_ms = getattr(worker, SHUTDOWN_MS_ATTRIBUTE, None)
        within = f" up to {shutdown_ms / 1000:g} s" if shutdown_ms is not None else ""
        if jobs:
            logger.info("shutdown: relay stopped, prefetched messages given back, nothing more claimed; "
                        "waiting%s for %d running job(s): %s", within, len(jobs), name_jobs(jobs))
        else:
            logger.info("shutdown: relay stopped, prefetched messages given back, nothing more claimed; "
                        "no job running")

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        # What still runs was cut off at the shutdown timeout: the broker's close gives it back.
        now = time.monotonic()
        for job in running_jobs.now():
            logger.warning("cut off at the shutdown timeout: %s %s after %.1f s; given back to its queue, it runs "
                           "again (no crash counted)", job.actor, job.message_id, now - job.started)
