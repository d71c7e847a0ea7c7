"""Per-queue concurrency: never more than a queue's ``max_workers`` jobs at once in a process.

The broker's consumer hands out at most that many messages of a queue at once; this
middleware holds the same count where jobs actually start, with one semaphore per
queue, keyed by the claim (message id and claim number: the same message can be
claimed again before its previous run is settled). What ``before_process_message``
acquires is released on every path (returned, raised, skipped). It also raises the
process's worker threads to the sum of the limits of the queues it serves, so that one
queue at its limit never keeps another from a free thread: a slow remote server fills
only the queue of the jobs that call it.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.broker import MessageProxy

logger = logging.getLogger("standmeet.middleware")


def _claim_key(message: Any) -> tuple[str, Any]:
    claim = getattr(message, "standmeet_claim", None)
    return (message.message_id, claim if claim is not None else id(message))


class QueueConcurrency(Middleware):
    def __init__(self) -> None:
        self._semaphores: dict[str, threading.BoundedSemaphore] = {}
        self._lock = threading.Lock()
        self._held: dict[tuple[str, Any], str] = {}

    def _semaphore(self, broker: Any, queue_name: str) -> threading.BoundedSemaphore:
        found = self._semaphores.get(queue_name)  # made once per queue: no lock once it is
        if found is not None:
            return found
        with self._lock:
            if queue_name not in self._semaphores:
                limit = broker.queue_settings(queue_name).max_workers
                self._semaphores[queue_name] = threading.BoundedSemaphore(limit)
            return self._semaphores[queue_name]

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        served = served_queues(broker, worker)
        needed = sum(broker.queue_settings(q).max_workers for q in served)
        if worker.worker_threads < needed:
            logger.info(
                "raising worker threads from %d to %d, the sum of the limits of %s",
                worker.worker_threads, needed, ", ".join(served),
            )
            worker.worker_threads = needed

    def held(self, queue_name: str) -> int:
        """Jobs of ``queue_name`` running now in this process."""
        with self._lock:
            return sum(1 for q in self._held.values() if q == queue_name)

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._semaphore(broker, message.queue_name).acquire()
        with self._lock:
            self._held[_claim_key(message)] = message.queue_name

    def _release(self, broker: Broker, message: MessageProxy) -> None:
        with self._lock:
            if self._held.pop(_claim_key(message), None) is None:
                return
        self._semaphore(broker, message.queue_name).release()

    def after_process_message(
        self, broker: Broker, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        self._release(broker, message)

    def after_skip_message(self, broker: Broker, message: MessageProxy) -> None:
        self._release(broker, message)


def served_queues(broker: Any, worker: Any) -> list[str]:
    """The queues a Dramatiq worker consumes: its ``--queues``, or all declared ones."""
    whitelist = getattr(worker, "consumer_whitelist", None)
    return [q for q in broker.queues if not whitelist or q in whitelist]
