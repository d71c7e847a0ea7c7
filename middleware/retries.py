"""Retries: a failed job (an exception, a time limit) runs again with back-off.

Dramatiq's policy, with our defaults (``STANDMEET_MAX_RETRIES``, ``…_MIN_BACKOFF_MS``,
``…_MAX_BACKOFF_MS``). The back-off delay is written to the database (the message's
``eta``), not held in worker memory. The traceback of the last failure is kept on the
message (``options["traceback"]``), so a failure is recorded where the job lives.
"""

from __future__ import annotations

from dramatiq.middleware.retries import Retries as DramatiqRetries


class Retries(DramatiqRetries):
    def __init__(self, *, max_retries: int, min_backoff_ms: int, max_backoff_ms: int) -> None:
        super().__init__(max_retries=max_retries, min_backoff=min_backoff_ms, max_backoff=max_backoff_ms)
