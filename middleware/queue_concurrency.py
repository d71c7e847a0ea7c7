"""Per-queue concurrency: never more than a queue's ``max_workers`` jobs at once in a process.

The broker's consumer hands out at most that many messages of a queue at once; this
middleware holds the same count where jobs actually start, with one semaphore per
queue, keyed by the claim (message id and claim number: the same message can be
claimed again before its previous run is settled). What ``before_process_message``
acquires is released on every path (returned, raised, skipped). A queue's slots are a
count and the claims holding them under one lock (:class:`Slots`): a run takes one lock
to start and one to end, and a thread waits only when every slot is taken. It also raises the
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


class Slots:
    """A queue's running slots: the claims holding one, at most ``limit``, under one lock.
    A thread that finds every slot taken waits on the lock's condition until one is
    given back; otherwise taking and giving back cost one lock each."""

    __slots__ = ("limit", "_lock", "_freed", "_waiting", "_holders")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._freed = threading.Condition(self._lock)
        self._waiting = 0
        self._holders: dict[tuple[str, Any], None] = {}

    def take(self, key: tuple[str, Any]) -> None:
        """Hold a slot for ``key``, waiting while all ``limit`` are held."""
        with self._lock:
            holders = self._holders
            while len(holders) >= self.limit:
                self._waiting += 1
                try:
                    self._freed.wait()
                finally:
                    self._waiting -= 1
            holders[key] = None

    def give_back(self, key: tuple[str, Any]) -> bool:
        """Free ``key``'s slot; False if it held none (released already, or never taken)."""
        with self._lock:
            try:
                del self._holders[key]
            except KeyError:
                return False
            if self._waiting:
                self._freed.notify()
            return True

    def held(self) -> int:
        """How many slots are held now."""
        with self._lock:
            return len(self._holders)


class QueueConcurrency(Middleware):
    def __init__(self) -> None:
        self._slots: dict[str, Slots] = {}
        self._lock = threading.Lock()

    def _slots_of(self, broker: Any, queue_name: str) -> Slots:
        found = self._slots.get(queue_name)  # made once per queue: no lock once it is
        if found is not None:
            return found
        with self._lock:
            if queue_name not in self._slots:
                self._slots[queue_name] = Slots(broker.queue_settings(queue_name).max_workers)
            return self._slots[queue_name]

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
        found = self._slots.get(queue_name)
        return found.held() if found is not None else 0

    def before_process_message(self, broker: Broker, message: MessageProxy) -> None:
        self._slots_of(broker, message.queue_name).take(_claim_key(message))

    def _release(self, broker: Broker, message: MessageProxy) -> None:
        found = self._slots.get(message.queue_name)
        if found is not None:
            found.give_back(_claim_key(message))

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
