"""What the memory broker keeps instead of rows: its clock, keyed leases, cancellations.

Each is the in-memory side of a seam whose Postgres side lives with its policy
(``middleware.keyed_lease.PostgresLeases``, ``broker.engine.cancel_watch``).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from broker import deadline


class Clock:
    """This process's clocks, which a test can move forward (never back).

    ``monotonic()`` decides when a delayed message is due and when a lease expires;
    ``wall()`` is the epoch time unique periods fall in. Both move by :meth:`advance`.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._offset_s = 0.0

    @property
    def advanced_s(self) -> float:
        """How far the tests moved this clock, in seconds."""
        return self._offset_s

    def monotonic(self) -> float:
        return time.monotonic() + self._offset_s

    def wall(self) -> float:
        return time.time() + self._offset_s

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back ({seconds} s)")
        with self._lock:
            self._offset_s += seconds


class MemoryLeases:
    """Keyed leases in a dict: a key is busy while a token for it is unexpired.

    A lease is keyed by ``lease.key(message)`` (its ``take`` statement is not run, so a
    ``take`` that resolves a message to another key, or reads columns beside the token,
    is not reproduced: :attr:`middleware.keyed_lease.Held.row` is empty)."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._held: dict[Any, tuple[str, float]] = {}

    def take(self, lease: Any, key: Any) -> tuple[Any, ...] | None:
        now = self._clock.monotonic()
        with self._lock:
            current = self._held.get(key)
            if current is not None and current[1] > now:
                return None
            token = uuid.uuid4().hex
            self._held[key] = (token, now + float(lease.lease_s()))
        return (token, key)

    def release(self, held: Any, message_id: str) -> None:
        with self._lock:
            current = self._held.get(held.key)
            if current is not None and current[0] == held.token:
                del self._held[held.key]

    def holder(self, key: Any) -> str | None:
        """The token holding ``key`` now (None: it is free)."""
        with self._lock:
            current = self._held.get(key)
        return current[0] if current is not None and current[1] > self._clock.monotonic() else None


class MemoryCancellations(deadline.WatchedRuns):
    """The cancellation watcher of a memory broker: :meth:`cancel` marks a running job
    at once (its next ``broker.deadline.check()`` raises ``JobCancelled``)."""

    def stop(self) -> None:
        """Nothing to stop: no thread asks anything."""

    def cancel(self, message_id: str) -> bool:
        """Mark ``message_id`` cancelled if it runs now; whether it does."""
        return bool(self.mark_cancelled([message_id]))
