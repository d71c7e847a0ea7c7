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
  down): :class:`RunningJobs` raises it only into threads inside a job's body, under the
  lock a thread takes to leave it, and one raised just before the thread left is
  delivered as it leaves, and dropped; a job that had not started does not start.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.middleware import Interrupt
from dramatiq.middleware.threading import raise_thread_exception

from broker.engine.codec import storable_text
from broker.errors import Deferred, ResultRefused

logger = logging.getLogger("standmeet.broker")

#: A middleware's ``refuse_result`` hook: why it cannot keep a result, or None.
RefuseResult = Callable[[Any, MessageProxy, Any], "str | None"]


def _interruptible() -> None:
    """A Python call does nothing but let the interpreter deliver an asynchronous
    exception set for this thread (it is checked on entering a Python frame)."""


class RunningJobs:
    """The worker threads inside a job's body here, and the one way to interrupt them all
    (a worker stepping down): never a thread whose job has returned, nor one that has not
    started it.

    The body is bracketed by :func:`as_run` (the actor's function, wrapped when the actor
    is declared): a thread enters as the function is called and leaves as it returns or
    raises, before anything reads the run. :meth:`interrupt_all` raises into the threads
    inside under the lock both take, and makes every later :meth:`enter` raise the same
    interruption until :meth:`resume` (a job handed to a thread just before the step-down
    does not start while the process is stepped down). One raised into a thread that
    leaves before it was delivered is delivered as it leaves, and dropped (as
    :func:`disarm` drops a late time limit): the run's outcome is what the job did. One
    delivered as the job's function returns is the job's interruption: it runs again.
    """

    def __init__(self) -> None:
        self._threads: set[int] = set()
        #: the threads inside a job's body that an interruption was raised into, with it
        self._raised: dict[int, type[Interrupt]] = {}
        self._lock = threading.Lock()
        self._cut: type[Interrupt] | None = None

    def __len__(self) -> int:
        return len(self._threads)

    def enter(self) -> None:
        """This thread's job starts, unless the jobs were interrupted and not resumed: then
        the interruption is raised here, before the job."""
        with self._lock:
            if self._cut is not None:
                raise self._cut
            self._threads.add(threading.get_ident())

    def leave(self, disarms: Iterable[Callable[[], None]] = ()) -> Interrupt | None:
        """This thread's job has ended: no interruption is raised into it from now on, one
        raised into it is delivered here (again, if the job took it already) and returned,
        and its time limit is disarmed (``disarms``: the broker's ``disarm`` hooks). One
        delivered on entering this call is raised in the caller's frame: call it inside a
        ``try`` (:func:`as_run`).

        Raised again, because delivery alone is not enough to rely on: before Python 3.13
        the interpreter signals a pending one through a flag all threads share, which the
        first thread to take its own clears, so another thread's can stay pending past
        the point it was meant for. Set again by this thread, which holds the interpreter
        lock until its next check, it is delivered at that check."""
        ident = threading.get_ident()
        with self._lock:
            self._threads.discard(ident)
            raised = self._raised.pop(ident, None)
        late: Interrupt | None = None
        try:
            if raised is not None:
                raise_thread_exception(ident, raised)
            _interruptible()
        except Interrupt as exc:
            late = exc
        return disarm(disarms) or late

    def interrupt_all(self, exception: type[Interrupt]) -> int:
        """Raise ``exception`` into every thread inside a job's body, and into every thread
        that enters one until :meth:`resume`; how many were inside."""
        with self._lock:
            self._cut = exception
            running = list(self._threads)
            for thread_id in running:
                self._raised[thread_id] = exception
                raise_thread_exception(thread_id, exception)
        return len(running)

    def resume(self) -> None:
        """Jobs start again (the process proved it lives again)."""
        with self._lock:
            self._cut = None


class _Run:
    """The run of a message a thread is in (set by the broker for Dramatiq's worker
    threads from ``before_process_message`` to the run's after-hooks): its RunningJobs and
    disarm hooks, whether its job has left its body, and an interruption that arrived
    after its job ended. One per thread, made at its first run and reused: a thread-local
    attribute costs a lookup in the thread's dictionary, a slot of this object none."""

    __slots__ = ("jobs", "disarms", "inside", "left", "late")

    def __init__(self) -> None:
        self.jobs: RunningJobs | None = None
        self.disarms: Iterable[Callable[[], None]] = ()
        #: inside its job's body: an actor's function it calls runs as part of it
        self.inside = False
        self.left = False
        self.late: Interrupt | None = None


_threads = threading.local()


def _this_threads_run() -> _Run:
    try:
        return _threads.run  # type: ignore[no-any-return]
    except AttributeError:
        run = _threads.run = _Run()
        return run


def in_a_run(running: RunningJobs | None,
             disarms: Iterable[Callable[[], None]] = ()) -> tuple[bool, Interrupt | None]:
    """Mark this thread as in a run of ``running`` (None: out of it). Returns whether the
    run's job has left its body (its time limit disarmed then), and the late interruption
    its end dropped, if any."""
    run = _this_threads_run()
    left, late = run.left, run.late
    run.jobs = running
    run.disarms = disarms
    run.inside = False
    run.left = False
    run.late = None
    return left, late


def as_run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an actor's function) bracketed as a job's body when a worker thread of this
    runtime runs it (:class:`RunningJobs`); called anywhere else, ``fn`` alone. Called
    inside a job's body (a job calling another actor's function, as Dramatiq allows: it
    runs there and then), it is part of that job: the job keeps its time limit and its
    place among the running jobs until its own body ends."""
    if getattr(fn, "standmeet_as_run", False):
        return fn

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        this_run = _this_threads_run()
        running = this_run.jobs
        if running is None or this_run.inside:
            return fn(*args, **kwargs)
        disarms = this_run.disarms
        # An interruption is delivered in the job (or as enter() returns: the job is then
        # interrupted before it starts), or in leave(), or as the interpreter enters
        # leave(): each call of it is made inside a try. After one was delivered, only a
        # time limit can still come (the thread is no longer inside a job once leave()
        # has run), so the third call is the last.
        try:
            running.enter()
            this_run.inside = True
            result = fn(*args, **kwargs)
        except BaseException:
            this_run.inside = False
            try:
                running.leave(disarms)
            except Interrupt:
                running.leave(disarms)
            this_run.left = True
            raise
        this_run.inside = False
        try:
            late = running.leave(disarms)
        except Interrupt as exc:
            try:
                late = running.leave(disarms) or exc
            except Interrupt as again:
                late = running.leave(disarms) or again
        this_run.late = late
        this_run.left = True
        return result

    run.standmeet_as_run = True  # type: ignore[attr-defined]
    return run


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


#: Longest text of an error kept on a rejected message.
MAX_ERROR_CHARS = 4000


def rejection_reason(message: MessageProxy) -> str:
    """Why a message is rejected, kept on its row: never the bare word 'failed'."""
    reason = message.options.get("error")
    if not reason:
        exc = getattr(message, "_exception", None)
        traceback_text = message.options.get("traceback")
        if traceback_text:
            reason = traceback_text
        elif exc is not None:
            reason = f"{type(exc).__name__}: {exc}"
    return storable_text(str(reason or "rejected by a middleware, with no reason given")[-MAX_ERROR_CHARS:])
