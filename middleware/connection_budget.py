"""The connection budget and the served queues, checked when a worker process boots.

A worker refuses to start when the sum of the max workers of the queues it serves,
plus the relay, exceeds half the application pool (the error names every term), and
when it is asked to serve a queue no module declared (a typo in ``--queues`` would
otherwise run a worker that consumes nothing): the refusal names the unknown queue and
the nearest known one.

Under Dramatiq's CLI (``dramatiq actors --queues indx``) a refusal is one line on
stderr and the worker process exits :data:`broker.exits.CONFIG_REFUSED_EXIT` (Dramatiq
then stops and exits with that status), not a traceback per process. Anywhere else it
is raised (:class:`broker.errors.StartupRefused`), for the caller to report.
"""

from __future__ import annotations

import difflib
import logging
import sys
from collections.abc import Iterable
from typing import Any

from dramatiq import Middleware

from broker.errors import StartupRefused
from broker.exits import CONFIG_REFUSED_EXIT
from broker.pg.budget import check_budget
from middleware.queue_concurrency import served_queues

logger = logging.getLogger("standmeet.middleware")


def unknown_queues(broker: Any, requested: Any) -> list[str]:
    """The names in ``requested`` that no module declared."""
    return sorted(q for q in (requested or ()) if q not in broker.queues)


def unknown_queue_refusal(unknown: Iterable[str], known: Iterable[str]) -> str:
    """``refusing to start: unknown queue(s) indx (did you mean index?); the known queues
    are …: fix --queues``."""
    known = sorted(known)
    unknown = list(unknown)
    nearest = [match for name in unknown for match in difflib.get_close_matches(name, known, n=1, cutoff=0.5)]
    hint = f" (did you mean {', '.join(dict.fromkeys(nearest))}?)" if nearest else ""
    return (f"refusing to start: unknown queue(s) {', '.join(unknown)}{hint}; the known queues are "
            f"{', '.join(known)}: fix --queues")


def _in_dramatiq_cli_worker() -> bool:
    """Whether this hook runs in a worker process of Dramatiq's CLI (its ``worker_process``
    is on the stack), which would print an exception as a traceback."""
    cli = sys.modules.get("dramatiq.cli")
    target = getattr(getattr(cli, "worker_process", None), "__code__", None)
    if target is None:
        return False
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is target:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


class ConnectionBudget(Middleware):
    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        try:
            unknown = unknown_queues(broker, getattr(worker, "consumer_whitelist", None))
            if unknown:
                raise StartupRefused(unknown_queue_refusal(unknown, broker.queues))
            budget = check_budget(broker.settings, served_queues(broker, worker))  # refuse to start
        except StartupRefused as exc:
            if not _in_dramatiq_cli_worker():
                raise
            for handler in logging.getLogger().handlers:  # what was logged before comes first
                handler.flush()
            print(f"dramatiq worker: {exc}", file=sys.stderr, flush=True)
            raise SystemExit(CONFIG_REFUSED_EXIT) from None
        logger.debug("connection budget: %s", budget.describe())  # `run` and `check` say it once
