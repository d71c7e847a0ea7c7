"""Cancellation of running jobs: an operator's ``jobs cancel`` (``cancelled_at`` on the
row) stops a running job at its next ``broker.deadline.check()``, which raises
:class:`broker.errors.JobCancelled`.

Before each run its watcher hands out a record of the run (``broker.deadline.Run``),
named for ``broker.deadline`` as the thread's run; a per-process watcher
(``broker.engine.cancel_watch``) asks the database, once a second while jobs run, which
of them were cancelled, and marks their records. The broker's retry settle must then reject the job
rather than retry it (it honours ``cancelled_at``).

The watcher is the middleware's ``watcher`` (a :class:`Watcher`): by default the one that
asks Postgres; the memory broker of ``broker.testing`` gives its own, which asks nothing.
"""

from __future__ import annotations

from typing import Any, Protocol

from dramatiq import Middleware

from broker import deadline


class Watcher(Protocol):
    """What learns which running jobs were cancelled, and marks their runs."""

    def watch(self, message_id: str) -> deadline.Run: ...

    def unwatch(self, run: deadline.Run) -> None: ...

    def stop(self) -> None: ...


class Cancellation(Middleware):
    def __init__(self, *, poll_s: float | None = None, watcher: Watcher | None = None) -> None:
        """``poll_s``: how often the default watcher asks Postgres (its default when None)."""
        if watcher is None:
            # here, not at the top: a memory broker's watcher needs no database
            from broker.engine.cancel_watch import DEFAULT_POLL_S, CancellationWatcher

            watcher = CancellationWatcher(poll_s=DEFAULT_POLL_S if poll_s is None else poll_s)
        self.watcher: Watcher = watcher

    def after_worker_boot(self, broker: Any, worker: Any) -> None:
        # a job cancelled while it waits prefetched is given back before it starts
        watch_prefetched = getattr(self.watcher, "watch_prefetched", None)
        if watch_prefetched is not None:
            watch_prefetched(broker)

    def before_process_message(self, broker: Any, message: Any) -> None:
        run = message.standmeet_cancel_run = self.watcher.watch(message.message_id)
        deadline.set_run(run)

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        self._ended(message)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        self._ended(message)

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        self.watcher.stop()

    def _ended(self, message: Any) -> None:
        run = getattr(message, "standmeet_cancel_run", None)
        if run is not None:  # None: its before-hook never ran (skipped by an earlier middleware)
            message.standmeet_cancel_run = None
            deadline.set_run(None)
            self.watcher.unwatch(run)
