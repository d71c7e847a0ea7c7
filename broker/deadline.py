"""The running job's deadline, per worker thread (and the coroutines it runs).

Dramatiq's TimeLimit raises an asynchronous exception, which cannot interrupt a
blocking socket read or a running SQL statement. So the time-limit middleware also
records the deadline here, and the places where a job blocks read it: the database
helper sets ``statement_timeout`` to what remains, HTTP clients cap their timeout to
it, and long actors call :func:`check` between batches.

:func:`check` also stops a job an operator cancelled while it ran: the cancellation
middleware names the thread's run (:func:`set_run`, a :class:`Run` its watcher handed
out), and the watcher marks the runs of the messages cancelled in the database
(:meth:`WatchedRuns.mark_cancelled`).

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
_run: ContextVar[Run | None] = ContextVar("standmeet_job_run", default=None)


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


def set_run(run: Run | None) -> None:
    """The run this thread is in now, as its cancellation watcher knows it (None: none)."""
    _run.set(run)


class Run:
    """One run of a message in this process, as the cancellation watcher knows it. An
    operator's cancel marks the run itself, not its message id: a mark goes with its run,
    so a later run of the same message here starts unmarked, whenever the watcher read the
    ids it asked the database about."""

    __slots__ = ("message_id", "cancelled")

    def __init__(self, message_id: str) -> None:
        self.message_id = message_id
        #: set by the watcher; read by :func:`check` in the run's own thread
        self.cancelled = False


class WatchedRuns:
    """The runs a process watches for an operator's cancel, each a :class:`Run` (a message
    may run on two threads for a moment: two runs). Watching and unwatching a run is one
    dictionary operation, which the interpreter makes whole, and a reader copies the
    dictionary in one: no run waits for a lock, nor for the watcher. A watcher marks the
    runs it read before it asked the database: one that has ended since is marked in
    vain (nothing reads it any more), one started since is not marked by that answer.
    The cancellation watchers build on it."""

    def __init__(self) -> None:
        #: taken only to start or stop a watcher's thread
        self._lock = threading.Lock()
        self._runs: dict[Run, None] = {}

    def watch(self, message_id: str) -> Run:
        """A run of ``message_id`` starts: watched until :meth:`unwatch`."""
        run = Run(message_id)
        self._runs[run] = None
        self._watched()
        return run

    def _watched(self) -> None:
        """Called after each watch (a watcher starts its thread here)."""

    def unwatch(self, run: Run) -> None:
        """``run`` has ended: no longer watched, and its mark, if any, goes with it."""
        self._runs.pop(run, None)

    def mark_cancelled(self, message_ids: Iterable[str], *, among: Iterable[Run] | None = None) -> list[str]:
        """Mark the runs of ``message_ids`` cancelled (their next :func:`check` stops
        them): ``among`` those (the runs a watcher read before it asked which of their
        messages were cancelled: a run started since, of a message whose cancel an
        operator may have taken back meanwhile, is not marked by that answer), or those
        watched now. The message ids of the runs marked."""
        wanted = set(message_ids)
        marked = []
        for run in self._runs.copy() if among is None else among:
            if run.message_id in wanted:
                run.cancelled = True
                marked.append(run.message_id)
        return marked

    def runs(self) -> list[Run]:
        """The runs watched now."""
        return list(self._runs.copy())

    def running(self) -> list[str]:
        """The message ids of the runs watched now, each once."""
        return message_ids(self.runs())


def message_ids(runs: Iterable[Run]) -> list[str]:
    """The message ids of ``runs``, each once, in their order."""
    return list(dict.fromkeys(run.message_id for run in runs))


def cancelled() -> bool:
    """Whether an operator cancelled the job this thread runs."""
    run = _run.get()
    return run is not None and run.cancelled


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
