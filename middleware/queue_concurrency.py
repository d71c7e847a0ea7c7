"""Per-queue concurrency (R1): never more than a queue's ``max_workers`` jobs at once.

The consumer already holds at most that many messages of the queue; this middleware
guards the count where jobs actually start, with one semaphore per queue, so the
limit holds even if a message reached the worker another way. It also raises the
process's worker threads to the sum of the limits of the queues it serves, so that
one queue at its limit never keeps another from a free thread (R2).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dramatiq import Broker, Middleware
from dramatiq.message import Message

logger = logging.getLogger(__name__)


class QueueConcurrency(Middleware):
    def __init__(self) -> None:
        self._semaphores: dict[str, threading.BoundedSemaphore] = {}
        self._lock = threading.Lock()
        self._held: set[str] = set()

    def _semaphore(self, broker: Any, queue_name: str) -> threading.BoundedSemaphore:
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

    def before_process_message(self, broker: Broker, message: Message) -> None:
        self._semaphore(broker, message.queue_name).acquire()
        with self._lock:
            self._held.add(message.message_id)

    def _release(self, broker: Broker, message: Message) -> None:
        with self._lock:
            if message.message_id not in self._held:
                return
            self._held.discard(message.message_id)
        self._semaphore(broker, message.queue_name).release()

    def after_process_message(
        self, broker: Broker, message: Message, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        self._release(broker, message)

    def after_skip_message(self, broker: Broker, message: Message) -> None:
        self._release(broker, message)


def served_queues(broker: Any, worker: Any) -> list[str]:
    """The queues a Dramatiq worker consumes: its ``--queues``, or all declared ones."""
    whitelist = getattr(worker, "consumer_whitelist", None)
    return [q for q in broker.queues if not whitelist or q in whitelist]
