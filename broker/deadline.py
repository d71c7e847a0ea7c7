"""The running job's deadline, per worker thread.

Dramatiq's TimeLimit raises an asynchronous exception, which cannot interrupt a
blocking socket read or a running SQL statement. So the time-limit middleware also
records the deadline here, and the places where a job blocks read it: the database
helper sets ``statement_timeout`` to what remains, HTTP clients cap their timeout to
it, and long actors call :func:`check` between batches.

:func:`check` also stops a job an operator cancelled while it ran: the cancellation
middleware names the thread's running message (:func:`set_message`) and its watcher
marks the ones cancelled in the database (:func:`mark_cancelled`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from broker.errors import DeadlineExceeded, JobCancelled

_local = threading.local()
_cancelled: set[str] = set()
_cancelled_lock = threading.Lock()


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


def set_message(message_id: str | None) -> None:
    """The message this thread runs now (None: none)."""
    _local.message_id = message_id


def mark_cancelled(message_ids: Iterable[str]) -> None:
    """These running messages were cancelled: their next :func:`check` stops them."""
    with _cancelled_lock:
        _cancelled.update(message_ids)


def forget(message_id: str) -> None:
    with _cancelled_lock:
        _cancelled.discard(message_id)


def cancelled() -> bool:
    """Whether an operator cancelled the job this thread runs."""
    message_id = getattr(_local, "message_id", None)
    if message_id is None:
        return False
    with _cancelled_lock:
        return message_id in _cancelled


def check() -> None:
    """Raise :class:`JobCancelled` if an operator cancelled the running job, and
    :class:`DeadlineExceeded` if it has passed its time limit."""
    if cancelled():
        raise JobCancelled("cancelled by an operator while it ran")
    left = remaining_s()
    if left is not None and left <= 0:
        raise DeadlineExceeded(f"the job's time limit passed {-left:.3f} s ago")


def cap_timeout(timeout_s: float) -> float:
    """``timeout_s``, shortened to what remains of the job (never below 1 ms)."""
    left = remaining_s()
    if left is None:
        return timeout_s
    return max(0.001, min(timeout_s, left))
