"""Retries: a failed job (an exception, a time limit) runs again with back-off.

Dramatiq's policy, with our defaults (``STANDMEET_MAX_RETRIES``, ``…_MIN_BACKOFF_MS``,
``…_MAX_BACKOFF_MS``). The back-off delay is written to the database (the message's
``eta``), not held in worker memory. The traceback of the last failure is kept on the
message (``options["traceback"]``), so a failure is recorded where the job lives.

A run already failed for good before this policy looks (its result was refused: see
``middleware.results``) is not retried; nor is a run an operator cancelled that ended
with an exception (its ``JobCancelled``, or whatever it raised instead): it fails for good,
so every after-hook (the metrics, the job's log line) sees the rejection it is, not a retry.
"""

from __future__ import annotations

import traceback
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.middleware.retries import Retries as DramatiqRetries

from broker import deadline


class Retries(DramatiqRetries):
    def __init__(self, *, max_retries: int, min_backoff_ms: int, max_backoff_ms: int) -> None:
        super().__init__(max_retries=max_retries, min_backoff=min_backoff_ms, max_backoff=max_backoff_ms)

    def after_process_message(self, broker: Any, message: MessageProxy, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        if exception is not None and message.failed:
            return
        if exception is not None and deadline.cancelled():
            # the stack of the run that was stopped, kept where a failure's is (the job's page)
            message.options["traceback"] = "".join(
                traceback.format_exception(type(exception), exception, exception.__traceback__, limit=30))
            message.fail()
            return
        super().after_process_message(broker, message, result=result, exception=exception)
