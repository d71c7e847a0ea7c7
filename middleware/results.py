"""Results: Dramatiq's result storage, never for a run that is going to run again.

Dramatiq's ``Results`` stores ``None`` for every skipped message that was not failed.
Here a snoozed job is reported as skipped (so no retry is counted), yet it runs again
later: storing ``None`` would hand a waiter a result that does not exist yet. This
policy stores nothing for a message the snooze policy has put back in its queue.
"""

from __future__ import annotations

from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.results import Results as DramatiqResults


def requeued(message: MessageProxy) -> bool:
    """Whether this run's after-hooks put the message back in its queue (a snooze)."""
    context = getattr(message, "standmeet_settle", None)
    return context is not None and context.requeue_delay_ms is not None


class Results(DramatiqResults):
    def after_skip_message(self, broker: Any, message: MessageProxy) -> None:
        if not requeued(message):
            super().after_skip_message(broker, message)
