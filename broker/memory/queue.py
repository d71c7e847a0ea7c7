"""One queue of the memory broker: its waiting messages, handed out in the order the
engine's claim takes them (due ones first by priority, then due time, then order of
sending), and how many are handed out."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from dramatiq.message import Message

from broker.settings import QueueSettings


@dataclass(order=True)
class Waiting:
    """A message waiting in a queue, due at ``due`` (the broker's monotonic clock)."""

    due: float
    seq: int
    message: Message = field(compare=False)
    #: lower runs first among the due (the engine's claim: by priority, then due time)
    priority: int = field(default=0, compare=False)
    #: taken out (handed out, replaced, cancelled, flushed): skipped where a heap still holds it
    gone: bool = field(default=False, compare=False)

    @property
    def claim_order(self) -> tuple[int, float, int]:
        return self.priority, self.due, self.seq


class MemoryQueue:
    """A queue's waiting messages: those not due yet in a heap by due time, those due in a
    heap by the claim's order, and each live one by its id."""

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.handed_out = 0
        self._later: list[Waiting] = []
        self._due: list[tuple[tuple[int, float, int], Waiting]] = []
        self._by_id: dict[str, Waiting] = {}

    @property
    def name(self) -> str:
        return self.settings.name

    def __len__(self) -> int:
        """How many messages wait (due now or later)."""
        return len(self._by_id)

    def push(self, waiting: Waiting) -> None:
        self._by_id[waiting.message.message_id] = waiting
        heapq.heappush(self._later, waiting)

    def find(self, message_id: str) -> Waiting | None:
        return self._by_id.get(message_id)

    def remove(self, waiting: Waiting) -> None:
        """Take ``waiting`` out (its heaps skip it from now on)."""
        waiting.gone = True
        if self._by_id.get(waiting.message.message_id) is waiting:
            del self._by_id[waiting.message.message_id]

    def first_due(self, now: float) -> Waiting | None:
        """The message the engine would claim next by ``now``: due, the lowest priority,
        then the soonest due, then the first sent."""
        later, due = self._later, self._due
        while later and (later[0].gone or later[0].due <= now):
            waiting = heapq.heappop(later)
            if not waiting.gone:
                heapq.heappush(due, (waiting.claim_order, waiting))
        while due and due[0][1].gone:
            heapq.heappop(due)
        return due[0][1] if due else None

    def next_due(self) -> float | None:
        """When a waiting message is due: one already due gives its time (past), else the
        soonest of the rest (None if none waits)."""
        while self._due and self._due[0][1].gone:
            heapq.heappop(self._due)
        if self._due:
            return self._due[0][1].due
        while self._later and self._later[0].gone:
            heapq.heappop(self._later)
        return self._later[0].due if self._later else None

    def messages(self) -> list[Message]:
        """The waiting messages, soonest due first."""
        return [w.message for w in sorted(self._by_id.values())]

    def take_all(self) -> list[Waiting]:
        """Every waiting message, taken out."""
        taken = list(self._by_id.values())
        for waiting in taken:
            waiting.gone = True
        self._by_id.clear()
        self._later.clear()
        self._due.clear()
        return taken
