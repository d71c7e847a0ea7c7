"""The connection budget and the served queues, checked when a worker process boots.

A worker refuses to start when the sum of the max workers of the queues it serves,
plus the relay, exceeds half the application pool (the error names every term), and
when it is asked to serve a queue no module declared (a typo in ``--queues`` would
otherwise run a worker that consumes nothing).
"""

from __future__ import annotations

import logging
from typing import Any

from dramatiq import Middleware

from broker.budget import check_budget
from broker.errors import StartupRefused
from middleware.queue_concurrency import served_queues

logger = logging.getLogger("standmeet.middleware")


def unknown_queues(broker: Any, requested: Any) -> list[str]:
    """The names in ``requested`` that no module declared."""
    return sorted(q for q in (requested or ()) if q not in broker.queues)


class ConnectionBudget(Middleware):
    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        unknown = unknown_queues(broker, getattr(worker, "consumer_whitelist", None))
        if unknown:
            raise StartupRefused(
                f"refusing to start: unknown queue(s) {', '.join(unknown)}; "
                f"the known queues are {', '.join(sorted(broker.queues))}"
            )
        budget = check_budget(broker.settings, served_queues(broker, worker))  # refuse to start
        logger.debug("connection budget: %s", budget.describe())  # `run` and `check` say it once
