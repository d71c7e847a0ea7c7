"""The connection budget (R7), checked when a worker process boots.

A worker refuses to start when the sum of the max workers of the queues it serves,
plus the relay, exceeds half the application pool; the error names every term.
"""

from __future__ import annotations

import logging
from typing import Any

from dramatiq import Middleware

from broker.budget import check_budget
from middleware.queue_concurrency import served_queues

logger = logging.getLogger(__name__)


class ConnectionBudget(Middleware):
    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        served = served_queues(broker, worker)
        known = [q for q in served if q in broker.settings.queues]
        budget = check_budget(broker.settings, known)  # BudgetError escapes: refuse to start
        logger.info("connection budget: %s", budget.describe())
