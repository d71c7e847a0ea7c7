"""What the memory broker keeps instead of rows: its clock, keyed leases, cancellations,
results.

Each is the in-memory side of a seam whose Postgres side lives with its policy
(``middleware.keyed_lease.PostgresLeases``, ``broker.engine.cancel_watch``).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.middleware import AgeLimit, SkipMessage
from dramatiq.results import Missing, ResultBackend
from dramatiq.results.backend import MResult, Result

from broker import deadline
from broker.backends import RESULTS_NAMESPACE


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

    def __init__(self) -> None:
        super().__init__()
        #: cancelled once handed out, before their run was watched: marked as it starts
        self.pending: set[str] = set()

    def watch(self, message_id: str) -> deadline.Run:
        run = super().watch(message_id)
        if message_id in self.pending:
            run.cancelled = True
        return run

    def stop(self) -> None:
        """Nothing to stop: no thread asks anything."""

    def cancel(self, message_id: str) -> bool:
        """Mark ``message_id`` cancelled if it runs now; whether it does."""
        return bool(self.mark_cancelled([message_id]))


class MemoryResults(ResultBackend):
    """Results in a dict of this instance, kept as the Postgres backend keeps them: for
    ``ttl`` milliseconds by the broker's clock (:meth:`Clock.advance` expires them), or
    until the test ends when ``ttl`` is None (a message's ``result_ttl=None``)."""

    def __init__(self, clock: Clock, *, namespace: str = RESULTS_NAMESPACE, **options: Any) -> None:
        super().__init__(namespace=namespace, **options)
        self._clock = clock
        self._lock = threading.Condition()
        self._stored: dict[str, tuple[bytes, float]] = {}

    def get_result(self, message: Any, *, block: bool = False, timeout: int | None = None) -> Result:
        """As the Postgres backend: ``timeout`` in milliseconds (default 10 s, real time);
        a blocking read wakes when the result is stored."""
        if not block:
            return super().get_result(message)
        from dramatiq.results import ResultTimeout
        from dramatiq.results.backend import DEFAULT_TIMEOUT

        key = self.build_message_key(message)
        end = time.monotonic() + (DEFAULT_TIMEOUT if timeout is None else timeout) / 1000
        with self._lock:
            while (result := self._get(key)) is Missing:
                left_s = end - time.monotonic()
                if left_s <= 0:
                    raise ResultTimeout(message)
                self._lock.wait(min(left_s, 0.05))  # a clock moved meanwhile is seen within it
        return self.unwrap_result(result)

    def _get(self, message_key: str) -> MResult:
        with self._lock:
            stored = self._stored.get(message_key)
        if stored is None or stored[1] <= self._clock.monotonic():
            return Missing
        return self.encoder.decode(stored[0])

    def _store(self, message_key: str, result: Result, ttl: int | None) -> None:
        data = self.encoder.encode(result)
        expires = float("inf") if ttl is None else self._clock.monotonic() + int(ttl) / 1000
        with self._lock:
            self._stored[message_key] = (data, expires)
            self._lock.notify_all()

    def clear(self) -> None:
        """Forget every result (``MemoryBroker.flush_all``)."""
        with self._lock:
            self._stored.clear()


class ClockedAgeLimit(AgeLimit):
    """Dramatiq's ``AgeLimit`` measured on the memory broker's clock: a message delayed
    past its ``max_age`` by :meth:`Clock.advance` is too old, as it would be in production."""

    runs_only_with_options = frozenset({"max_age"})

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self._clock = clock

    def before_process_message(self, broker: Any, message: MessageProxy) -> None:
        actor = broker.get_actor(message.actor_name)
        max_age = message.options.get("max_age") or actor.options.get("max_age", self.max_age)
        if max_age and self._clock.wall() * 1000 - message.message_timestamp >= max_age:
            self.logger.warning("Message %r has exceeded its age limit.", message.message_id)
            message.fail()
            raise SkipMessage("Message age limit exceeded")
