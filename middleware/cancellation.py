"""Cancellation of running jobs: an operator's ``jobs cancel`` (``cancelled_at`` on the
row) stops a running job at its next ``broker.deadline.check()``, which raises
:class:`broker.errors.JobCancelled`.

Before each run the thread's message is named for ``broker.deadline``; a per-process
watcher (``broker.engine.cancel_watch``) asks the database, once a second while jobs run,
which of them were cancelled. The broker's retry settle must then reject the job
rather than retry it (it honours ``cancelled_at``).
"""

from __future__ import annotations

from typing import Any

from dramatiq import Middleware

from broker import deadline
from broker.engine.cancel_watch import DEFAULT_POLL_S, CancellationWatcher


class Cancellation(Middleware):
    def __init__(self, *, poll_s: float = DEFAULT_POLL_S) -> None:
        self.watcher = CancellationWatcher(poll_s=poll_s)

    def before_process_message(self, broker: Any, message: Any) -> None:
        deadline.set_message(message.message_id)
        self.watcher.watch(message.message_id)
        message.standmeet_cancel_watched = True

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        self._ended(message)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self._ended(message)

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        self.watcher.stop()

    def _ended(self, message: Any) -> None:
        deadline.set_message(None)
        if getattr(message, "standmeet_cancel_watched", False):
            message.standmeet_cancel_watched = False
            self.watcher.unwatch(message.message_id)
