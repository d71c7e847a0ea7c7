"""Which of this process's running jobs an operator cancelled (``cancelled_at``).

One watcher per process, on a detached thread: while jobs run, it asks the database
every ``poll_s`` which of them were cancelled, in one indexed query, and marks their
runs (:class:`broker.deadline.Run`, those it read before asking), which
``broker.deadline.check()`` then stops. Idle, it asks nothing.

Told of the broker (:meth:`CancellationWatcher.watch_prefetched`), it also asks about
the claims the process holds prefetched, not started: one cancelled is taken out of its
buffer and given back, rejected, before it starts. (One handed to a thread between the
look and the answer is a run: the next look marks it.)
"""

from __future__ import annotations

import logging
from typing import Any

from broker import deadline, detach
from broker.pg import db

logger = logging.getLogger(f"standmeet.{__name__}")

#: How often a process looks for cancelled running jobs (only while some run).
DEFAULT_POLL_S = 1.0

CANCELLED_AMONG = """
SELECT message_id::text FROM dramatiq.queue
WHERE message_id = ANY(%(ids)s::uuid[]) AND cancelled_at IS NOT NULL
"""


class CancellationWatcher(deadline.WatchedRuns):
    """Asks the database which watched jobs were cancelled, every ``poll_s``, on a thread
    started with the first watch."""

    def __init__(self, *, poll_s: float = DEFAULT_POLL_S) -> None:
        super().__init__()
        self.poll_s = poll_s
        self._thread: detach.Detached | None = None
        #: what holds prefetched claims (the broker), when told
        self._prefetched_by: Any = None

    def watch_prefetched(self, broker: Any) -> None:
        """Also look at what ``broker`` holds prefetched (its ``prefetched_message_ids``),
        and give back, through it, the claims cancelled before they started
        (``give_back_cancelled``)."""
        if callable(getattr(broker, "prefetched_message_ids", None)):
            self._prefetched_by = broker

    def _watched(self) -> None:
        if self._thread is None:  # read without the lock: started once, then never None until stop()
            with self._lock:
                if self._thread is None:
                    self._thread = detach.every("cancellation-watch", self.poll_s, self.poll_once)

    def poll_once(self) -> int:
        """Mark the running jobs cancelled since the last look, and give back the
        prefetched ones cancelled before they started; returns how many of each there are."""
        runs = self.runs()
        if not runs:
            return 0
        holder = self._prefetched_by
        prefetched = holder.prefetched_message_ids() if holder is not None else []
        ids = deadline.message_ids(runs)
        with db.connection(timeout_s=self.poll_s * 5) as conn:
            cancelled = [row[0] for row in conn.execute(CANCELLED_AMONG, {"ids": ids + prefetched}).fetchall()]
        marked = len(self.mark_cancelled(cancelled, among=runs))  # one may have ended since
        waiting = set(cancelled).intersection(prefetched)
        if waiting:  # (one started since is a run now: the next look marks it)
            marked += holder.give_back_cancelled(waiting)
        return marked

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop(timeout_s=2)
