"""The one-thread worker :meth:`broker.memory.broker.MemoryBroker.drain` runs its messages
on: Dramatiq's own ``WorkerThread.process_message`` on the caller's thread, each run
settled as Dramatiq's consumer thread settles it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dramatiq.broker import MessageProxy
from dramatiq.worker import WorkerThread

if TYPE_CHECKING:
    from broker.memory.broker import MemoryBroker


class DrainRunner:
    """The worker :meth:`broker.memory.broker.MemoryBroker.drain` boots: one thread (the caller's), Dramatiq's
    own ``WorkerThread.process_message`` run on it, settled as a consumer thread would."""

    consumer_whitelist = None
    worker_threads = 1
    worker_timeout = 100

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker
        self.consumers = _Settles(broker)
        self.thread = WorkerThread(broker=broker, consumers=self.consumers,  # type: ignore[arg-type]
                                   work_queue=_Done(), worker_timeout=self.worker_timeout)  # type: ignore[arg-type]


class _Settles:
    """Every queue's post-processing, as Dramatiq's consumer thread does it."""

    def __init__(self, broker: MemoryBroker) -> None:
        self.broker = broker

    def __getitem__(self, queue_name: str) -> _Settles:
        return self

    def post_process_message(self, message: MessageProxy) -> None:
        signal = "nack" if message.failed else "ack"
        self.broker.emit_before(signal, message)
        self.broker.settle(message, rejected=message.failed)
        self.broker.emit_after(signal, message)


class _Done:
    """The work queue a drained message never was on."""

    def task_done(self) -> None:
        """Nothing was taken from it."""
