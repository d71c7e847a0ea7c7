"""Which of this process's running jobs an operator cancelled (``cancelled_at``).

One watcher per process, on a detached thread: while jobs run, it asks the database
every ``poll_s`` which of them were cancelled, in one indexed query, and marks their
runs (:class:`broker.deadline.Run`, those it read before asking), which
``broker.deadline.check()`` then stops. Idle, it asks nothing.
"""

from __future__ import annotations

import logging

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

    def _watched(self) -> None:
        if self._thread is None:  # read without the lock: started once, then never None until stop()
            with self._lock:
                if self._thread is None:
                    self._thread = detach.every("cancellation-watch", self.poll_s, self.poll_once)

    def poll_once(self) -> int:
        """Mark the running jobs cancelled since the last look; returns how many are."""
        runs = self.runs()
        if not runs:
            return 0
        ids = deadline.message_ids(runs)
        with db.connection(timeout_s=self.poll_s * 5) as conn:
            cancelled = [row[0] for row in conn.execute(CANCELLED_AMONG, {"ids": ids}).fetchall()]
        return len(self.mark_cancelled(cancelled, among=runs))  # one may have ended since

    def stop(self) -> None:
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.stop(timeout_s=2)
