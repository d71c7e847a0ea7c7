"""The running job's deadline, per worker thread (and the coroutines it runs).

Dramatiq's TimeLimit raises an asynchronous exception, which cannot interrupt a
blocking socket read or a running SQL statement. So the time-limit middleware also
records the deadline here, and the places where a job blocks read it: the database
helper sets ``statement_timeout`` to what remains, HTTP clients cap their timeout to
it, and long actors call :func:`check` between batches.

:func:`check` also stops a job an operator cancelled while it ran: the cancellation
middleware names the thread's running message (:func:`set_message`) and its watcher
marks the ones cancelled in the database (:func:`mark_cancelled`).

Both live in context variables: a worker thread has a context of its own, and an
``async def`` actor's coroutine, run on the event loop thread, starts from a copy of the
context of the worker thread that waits for it, so it sees its job's deadline and
cancellation too (``asyncio.wait_for(…, deadline.remaining_s())``, or the helpers that
read it).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from broker.errors import DeadlineExceeded, JobCancelled

_deadline: ContextVar[float | None] = ContextVar("standmeet_job_deadline", default=None)
_message_id: ContextVar[str | None] = ContextVar("standmeet_job_message_id", default=None)
_cancelled: set[str] = set()
_cancelled_lock = threading.Lock()


def set_deadline(seconds_from_now: float | None) -> None:
    _deadline.set(None if seconds_from_now is None else time.monotonic() + seconds_from_now)


def clear() -> None:
    if _deadline.get() is not None:  # a set costs a context copy; the get that spares it, a third
        _deadline.set(None)


def armed() -> bool:
    """Whether the running job's deadline is set (a run with a time limit, not disarmed)."""
    return _deadline.get() is not None


def remaining_s() -> float | None:
    """Seconds left for the running job, or None outside a job (or with no limit)."""
    deadline = _deadline.get()
    if deadline is None:
        return None
    return deadline - time.monotonic()


def set_message(message_id: str | None) -> None:
    """The message this thread runs now (None: none)."""
    _message_id.set(message_id)


def mark_cancelled(message_ids: Iterable[str]) -> None:
    """These running messages were cancelled: their next :func:`check` stops them."""
    with _cancelled_lock:
        _cancelled.update(message_ids)


def forget(message_id: str) -> None:
    if message_id not in _cancelled:  # the common case, read without the lock: nothing to forget
        return
    with _cancelled_lock:
        _cancelled.discard(message_id)


class WatchedRuns:
    """The running jobs a process watches for an operator's cancel: a count per message id
    (a message may run on two threads for a moment); when its last run ends, its
    cancellation mark is forgotten. The cancellation watchers build on it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: dict[str, int] = {}

    def watch(self, message_id: str) -> None:
        with self._lock:
            running = self._running
            running[message_id] = running.get(message_id, 0) + 1
            self._watched()

    def _watched(self) -> None:
        """Called with the lock held after each watch (a watcher starts its thread here)."""

    def unwatch(self, message_id: str) -> None:
        with self._lock:
            left = self._running.get(message_id, 0) - 1
            if left > 0:
                self._running[message_id] = left
                return
            self._running.pop(message_id, None)
            forget(message_id)

    def mark_cancelled(self, message_ids: Iterable[str]) -> list[str]:
        """Mark those of ``message_ids`` still watched cancelled (their next :func:`check`
        stops them); the ones marked. Under the watch's lock: a run that ended since its
        id was read is not marked, so no mark outlives its run."""
        with self._lock:
            watched = [message_id for message_id in message_ids if message_id in self._running]
            if watched:
                mark_cancelled(watched)
        return watched

    def running(self) -> list[str]:
        """The message ids watched now."""
        with self._lock:
            return list(self._running)


def cancelled() -> bool:
    """Whether an operator cancelled the job this thread runs."""
    message_id = _message_id.get()
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


# -- the wall-clock watchdog ---------------------------------------------------------------
#
# A socket read with a timeout still waits the whole timeout for *each* read: a peer that
# trickles one byte at a time holds a request for as long as it likes. The watchdog runs
# a callback (closing the connection) when a total deadline passes, whatever the thread
# that waits is blocked in. One named thread per process serves every alarm.


@dataclass(order=True)
class _Alarm:
    when: float
    seq: int
    callback: Callable[[], None] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)
    fired: bool = field(default=False, compare=False)


class _Watchdog:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[_Alarm] = []
        self._seq = itertools.count()
        self._thread: Any = None

    def arm(self, seconds: float, callback: Callable[[], None]) -> _Alarm:
        alarm = _Alarm(time.monotonic() + seconds, next(self._seq), callback)
        with self._cond:
            if self._thread is None or not self._thread.alive:
                from broker import detach

                self._thread = detach.go("deadline-watchdog", self._run)
            heapq.heappush(self._heap, alarm)
            if self._heap[0] is alarm:  # earlier than the one it sleeps until: wake it to look
                self._cond.notify()
        return alarm

    def cancel(self, alarm: _Alarm) -> None:
        with self._cond:
            alarm.cancelled = True

    def _run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            due: list[_Alarm] = []
            with self._cond:
                now = time.monotonic()
                while self._heap and (self._heap[0].cancelled or self._heap[0].when <= now):
                    alarm = heapq.heappop(self._heap)
                    if not alarm.cancelled:
                        alarm.fired = True
                        due.append(alarm)
                if not due:
                    self._cond.wait(min(1.0, self._heap[0].when - now) if self._heap else 1.0)
            for alarm in due:
                try:
                    alarm.callback()
                except Exception:  # a failing callback never stops the watchdog
                    logging.getLogger(f"standmeet.{__name__}").exception("watchdog callback failed")


_WATCHDOG = _Watchdog()


@contextmanager
def watchdog(seconds: float, on_expire: Callable[[], None]) -> Iterator[_Alarm]:
    """Call ``on_expire()`` (from the watchdog thread) if the block is still running after
    ``seconds``; the yielded alarm's ``fired`` tells the block whether it did."""
    alarm = _WATCHDOG.arm(seconds, on_expire)
    try:
        yield alarm
    finally:
        _WATCHDOG.cancel(alarm)
