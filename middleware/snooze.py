"""Snooze: run this job again in N seconds, without counting a retry.

An actor (or a middleware, before the actor runs) raises ``Snooze(seconds)``. The
broker reports the message as skipped, not failed: no retry is counted, no failure
callback fires, nothing is logged as an error. This middleware then re-enqueues it,
due after the delay (the delay lives in the database), and counts the snooze on the
message (``options["snoozes"]``). Past ``max_snoozes`` the message fails with a clear
reason instead of snoozing forever.
"""

from __future__ import annotations

import logging
from typing import Any, NoReturn

from dramatiq import Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from broker.errors import Deferred

logger = logging.getLogger(f"standmeet.{__name__}")

#: A message snoozed more often than this fails (endless snoozes are a bug).
DEFAULT_MAX_SNOOZES = 1000
#: The label of a snooze because the key of a lease was busy (``standmeet_lease_busy_total``).
LEASE_BUSY = "lease_busy"


class Snooze(Deferred):
    """Raise to run the job again after ``seconds``; it does not count as a retry.
    ``label`` says what kind of wait it is, for the metrics (e.g. :data:`LEASE_BUSY`)."""

    def __init__(self, seconds: float, reason: str = "", *, label: str | None = None) -> None:
        if seconds < 0:
            raise ValueError(f"cannot snooze for a negative time ({seconds} s)")
        self.seconds = float(seconds)
        self.reason = reason
        self.label = label
        super().__init__(reason or f"snoozed for {seconds:g} s", delay_ms=int(seconds * 1000))


def snooze_before_start(message: MessageProxy, seconds: float, reason: str = "", *,
                        label: str | None = None) -> NoReturn:
    """Snooze ``message`` from a middleware's ``before_process_message``.

    Dramatiq only lets a :class:`SkipMessage` escape a ``before_*`` hook, so the
    :class:`Snooze` is attached to the message and a ``SkipMessage`` is raised.
    """
    snooze = Snooze(seconds, reason, label=label)
    message.stuff_exception(snooze)
    raise SkipMessage(str(snooze))


class SnoozePolicy(Middleware):
    def __init__(self, *, max_snoozes: int = DEFAULT_MAX_SNOOZES) -> None:
        self.max_snoozes = max_snoozes

    @property
    def actor_options(self) -> set[str]:
        return {"max_snoozes"}

    def after_skip_message(self, broker: Any, message: MessageProxy) -> None:
        snooze = getattr(message, "_exception", None)
        if not isinstance(snooze, Snooze):
            return
        actor = broker.get_actor(message.actor_name)
        cap = message.options.get("max_snoozes", actor.options.get("max_snoozes", self.max_snoozes))
        snoozes = int(message.options.get("snoozes", 0)) + 1
        message.options["snoozes"] = snoozes
        if snoozes > cap:
            message.options["error"] = f"snoozed {snoozes} times, more than its cap of {cap}"
            logger.warning("message %s %s: failing it", message.message_id, message.options["error"])
            message.fail()
            return
        logger.debug("snoozing %s for %.3f s (%s)", message.message_id, snooze.seconds, snooze.reason)
        broker.enqueue(message, delay=int(snooze.seconds * 1000))
