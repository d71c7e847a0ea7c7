"""How a finished run is read, the same in every broker of this runtime (the Postgres
one and the memory one): which signal its after-hooks see. No database code.

* A run that asked to run later (a ``Snooze``: any :class:`broker.errors.Deferred`), or
  one cut off through no fault of its own (the broker says which), is a skip, not a
  failure: no retry is counted, no failure callback fires, and every middleware releases
  what it acquired in ``after_skip_message``.
* A result a results middleware refuses (its ``refuse_result(broker, message, result)``
  hook says why) fails the run for good, with the reason, before any after-hook sees it.
* The timers that interrupt a running job (the time limit) are disarmed before anything
  else reads the run (:func:`disarm`). An interruption already on its way when the job
  ended (its timer fired between the job's last line and the disarm) is delivered there
  and dropped: the run's outcome is what the job did, and every after-hook still runs.
* The same holds for an interruption of every running job at once (a worker stepping
  down): :class:`RunningJobs` raises it only into threads still in their run, under the
  lock a thread takes to leave its run, and one raised just before the thread left is
  delivered as it leaves, and dropped.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.middleware import Interrupt
from dramatiq.middleware.threading import raise_thread_exception

from broker.errors import Deferred, ResultRefused

logger = logging.getLogger("standmeet.broker")

#: A middleware's ``refuse_result`` hook: why it cannot keep a result, or None.
RefuseResult = Callable[[Any, MessageProxy, Any], "str | None"]


def _interruptible() -> None:
    """A Python call does nothing but let the interpreter deliver an asynchronous
    exception set for this thread (it is checked on entering a Python frame)."""


class RunningJobs:
    """The worker threads running a job here (thread id -> message), and the one way to
    interrupt them all: never a thread whose run has ended.

    A thread enters when its run starts and leaves before anything reads the run's
    outcome. :meth:`interrupt_all` raises into the threads still in their run under the
    lock :meth:`leave` takes, so a thread that has left is never interrupted (an
    interruption landing in its settle would drop an outcome the job produced, or keep
    its slot counted as running); one raised just before the thread left is delivered in
    :meth:`leave` and returned, as :func:`disarm` returns a late time limit.
    """

    def __init__(self) -> None:
        self._threads: dict[int, MessageProxy] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._threads)

    def enter(self, proxy: MessageProxy) -> None:
        """This thread's run starts (lock-free: an interruption raised before it counts)."""
        self._threads[threading.get_ident()] = proxy

    def leave(self) -> Interrupt | None:
        """This thread's run has ended: no interruption is raised into it from now on; one
        already on its way is delivered here and returned instead of raised."""
        ident = threading.get_ident()
        try:
            with self._lock:
                self._threads.pop(ident, None)
            _interruptible()
        except Interrupt as exc:
            with self._lock:  # it may have landed before the thread left
                self._threads.pop(ident, None)
            return exc
        return None

    def interrupt_all(self, exception: type[Interrupt]) -> int:
        """Raise ``exception`` into every thread still in its run; how many."""
        with self._lock:
            running = list(self._threads)
            for thread_id in running:
                raise_thread_exception(thread_id, exception)
        return len(running)


def disarm(hooks: Iterable[Callable[[], None]]) -> Interrupt | None:
    """Run every ``disarm`` hook (stopping the timers that could interrupt this thread),
    and return, instead of raising, an interruption that was already on its way."""
    late: Interrupt | None = None
    for hook in hooks:
        try:
            hook()
            _interruptible()
        except Interrupt as exc:  # its timer fired as the job ended: too late to stop it
            late = exc
    return late


def refused_result(broker: Any, proxy: MessageProxy, result: Any,
                   hooks: Iterable[RefuseResult]) -> ResultRefused | None:
    """The first refusal of ``result`` by ``hooks``, with the run failed for it (None: kept)."""
    for refuse in hooks:
        reason = refuse(broker, proxy, result)
        if reason:
            refused = ResultRefused(reason)
            logger.error("message %s failed: %s", proxy.message_id, reason)
            proxy.stuff_exception(refused)
            proxy.options["error"] = f"ResultRefused: {reason}"
            proxy.fail()
            return refused
    return None


def run_signal(broker: Any, signal: str, proxy: MessageProxy, kwargs: dict[str, Any], *,
               refuse_hooks: Iterable[RefuseResult],
               not_at_fault: tuple[type[BaseException], ...] = ()) -> tuple[str, dict[str, Any], BaseException | None]:
    """``(signal, kwargs, exception)`` the after-hooks of a finished run see, from the
    ``process_message`` or ``skip_message`` signal Dramatiq's worker emitted."""
    exception: BaseException | None = kwargs.get("exception")
    if signal == "process_message" and isinstance(exception, (Deferred, *not_at_fault)):
        return "skip_message", {}, exception
    if signal == "process_message" and exception is None and kwargs.get("result") is not None:
        refused = refused_result(broker, proxy, kwargs["result"], refuse_hooks)
        if refused is not None:
            return signal, {"exception": refused}, refused
    return signal, kwargs, exception
