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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.middleware import Interrupt

from broker.errors import Deferred, ResultRefused

logger = logging.getLogger("standmeet.broker")

#: A middleware's ``refuse_result`` hook: why it cannot keep a result, or None.
RefuseResult = Callable[[Any, MessageProxy, Any], "str | None"]


def _interruptible() -> None:
    """A Python call does nothing but let the interpreter deliver an asynchronous
    exception set for this thread (it is checked on entering a Python frame)."""


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
