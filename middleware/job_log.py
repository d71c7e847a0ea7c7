"""One INFO line per finished job: actor, message id, queue, duration, outcome, attempt.

    job done: orders orders.confirm 0b5a… in 12.4 ms (attempt 1)

Outcomes: ``done``; ``retry`` (failed, will run again); ``rejected`` (failed for
good); ``snoozed`` (asked to run later: no attempt counted); ``skipped``. The same
fields travel as ``extra`` for the JSON log format. Placed before ``Retries`` in the
middleware list, so its after-hooks run after the retry policy has decided.

It also keeps this process's running jobs (:data:`broker.worker.running_jobs`): what a
shutdown names while it waits for them, and what it cuts off.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

from dramatiq import Middleware

from broker.errors import Deferred
from broker.observability.logs import info_line
from broker.running import running_jobs

logger = logging.getLogger("standmeet.jobs")


def outcome_of(message: Any, exception: BaseException | None, *, skipped: bool = False) -> str:
    """How a run ended, once the retry and snooze policies have acted on it."""
    if getattr(message, "failed", False):
        return "rejected"
    if skipped:
        return "snoozed" if isinstance(getattr(message, "_exception", None), Deferred) else "skipped"
    return "done" if exception is None else "retry"


class JobLog(Middleware):
    """Stamps each run's start on its message proxy (one per run: a retry of the same
    message may start on another thread before this run's after-hooks are done)."""

    def before_process_message(self, broker: Any, message: Any) -> None:
        message.standmeet_log_start = (time.monotonic(), int(message.options.get("retries", 0)) + 1)
        running_jobs.started(message.actor_name, message.message_id)

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        self._finished(message, outcome_of(message, exception))

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self._finished(message, outcome_of(message, None, skipped=True))

    def _finished(self, message: Any, outcome: str) -> None:
        running_jobs.finished()
        started, attempt = getattr(message, "standmeet_log_start", None) or (time.monotonic(), 1)
        duration_ms = (time.monotonic() - started) * 1000
        queue, actor, message_id = message.queue_name, message.actor_name, message.message_id
        info_line(logger, f"job {outcome}: {queue} {actor} {message_id} in {duration_ms:.1f} ms (attempt {attempt})",
                  partial(_fields, actor, message_id, queue, duration_ms, outcome, attempt))


def _fields(actor: str, message_id: str, queue: str, duration_ms: float, outcome: str,
            attempt: int) -> dict[str, Any]:
    """The job log line's fields, for the JSON format (made only when a format shows them)."""
    return {"actor": actor, "message_id": message_id, "queue": queue,
            "duration_ms": round(duration_ms, 3), "outcome": outcome, "attempt": attempt}
