"""The memory broker (``broker.memory.broker``) and what it keeps instead of rows
(``broker.memory.stores``). Users build one with ``broker.testing.memory_broker()``."""

from broker.memory.broker import MemoryBroker, MemoryConsumer, MemoryMessage
from broker.memory.stores import (
           Clock,
           ClockedAgeLimit,
           MemoryCancellations,
           MemoryLeases,
           MemoryResults,
)

__all__ = ["Clock", "MemoryBroker", "MemoryCancellations", "MemoryConsumer", "MemoryLeases", "MemoryMessage",
           "MemoryResults", "ClockedAgeLimit"]
