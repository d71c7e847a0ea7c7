"""The running job's deadline, per worker thread.

Dramatiq's TimeLimit raises an asynchronous exception, which cannot interrupt a
blocking socket read or a running SQL statement. So the time-limit middleware also
records the deadline here, and the places where a job blocks read it: the database
helper sets ``statement_timeout`` to what remains, HTTP clients cap their timeout to
it, and long actors call :func:`check` between batches.
"""

from __future__ import annotations

import threading
import time

from broker.errors import DeadlineExceeded

_local = threading.local()


def set_deadline(seconds_from_now: float | None) -> None:
    _local.deadline = None if seconds_from_now is None else time.monotonic() + seconds_from_now


def clear() -> None:
    _local.deadline = None


def remaining_s() -> float | None:
    """Seconds left for the running job, or None outside a job (or with no limit)."""
    deadline = getattr(_local, "deadline", None)
    if deadline is None:
        return None
    return deadline - time.monotonic()


def check() -> None:
    """Raise :class:`DeadlineExceeded` if the running job has passed its time limit."""
    left = remaining_s()
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"the job's time limit passed {-left:.3f} s ago")


def cap_timeout(timeout_s: float) -> float:
    """``timeout_s``, shortened to what remains of the job (never below 1 ms)."""
    left = remaining_s()
    if left is None:
        return timeout_s
    return max(0.001, min(timeout_s, left))
