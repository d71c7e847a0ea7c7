"""A worker's work queue on which a worker thread hands its next job to itself.

When a job ends, its worker thread frees the job's running slot and, in the same call,
puts the queue's next buffered claim on the Dramatiq worker's work queue
(:meth:`StandmeetBroker.settle`). Dramatiq's ``PriorityQueue.put`` then wakes a thread
waiting on that queue; but the thread that put it goes straight back to the queue and,
holding the interpreter, takes it first. The woken thread finds nothing, and sleeps
again: a wake-up, two context switches and an interpreter hand-over per job, for
nothing.

:class:`HandOffQueue` is the work queue the broker gives a Dramatiq worker
(``before_worker_boot``, before any of its threads exist). Inside
:func:`taking_it_myself`, a put wakes nobody: the putting thread takes the item at its
next ``get``, which a running worker thread makes as soon as the job's post-processing
returns. Everywhere else (the consumer thread's claims, a paused or stopping thread) it
is Dramatiq's queue exactly. Nothing is lost if the thread does not come back for it:
another thread's timed ``get`` finds it within the worker's timeout, and a stopping
worker gives back whatever its work queue holds.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from queue import PriorityQueue
from typing import Any

from dramatiq.worker import WorkerThread

_local = threading.local()


class HandOffQueue(PriorityQueue):  # type: ignore[type-arg]
    """Dramatiq's work queue, but for a put made inside :func:`taking_it_myself`."""

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        if not getattr(_local, "takes_next", False) or self.maxsize > 0:
            super().put(item, block, timeout)
            return
        with self.mutex:
            self._put(item)
            self.unfinished_tasks += 1


def will_take_next(work_queue: Any) -> bool:
    """Whether the calling thread is a running worker thread of ``work_queue`` that will
    ask it for its next job as soon as its current call returns."""
    thread = threading.current_thread()
    return (type(work_queue) is HandOffQueue and isinstance(thread, WorkerThread)
            and thread.work_queue is work_queue and thread.running and not thread.paused)


@contextmanager
def taking_it_myself() -> Iterator[None]:
    """Within the block, a :class:`HandOffQueue` put by this thread wakes no other thread."""
    _local.takes_next = True
    try:
        yield
    finally:
        _local.takes_next = False


def adopt_work_queue(worker: Any) -> None:
    """Give a Dramatiq worker that has not started a :class:`HandOffQueue` as its work
    queue, in place of its own empty ``PriorityQueue`` (one of another kind is kept)."""
    current = getattr(worker, "work_queue", None)
    if type(current) is PriorityQueue and not getattr(worker, "workers", None) and current.empty():
        worker.work_queue = HandOffQueue()
