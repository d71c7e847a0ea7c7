"""Fixtures of the unit tier: a memory broker (``broker.testing``), no database."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import dramatiq
import pytest

from broker import services
from broker.settings import Settings, queue_variable_name
from broker.testing import MemoryBroker, memory_broker


@pytest.fixture
def make_broker(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., MemoryBroker]]:
    """A fresh memory broker as the global one, with only the test's own actors; the
    previous broker (whose actors stay on it) and services come back after."""
    monkeypatch.setattr(dramatiq.broker, "global_broker", None)
    monkeypatch.setattr(services, "_current", services.installed())
    workers: list[dramatiq.Worker] = []

    def make(*, queues: dict[str, int] | None = None, **overrides: object) -> MemoryBroker:
        environ = {f"STANDMEET_QUEUE_{queue_variable_name(q)}_MAX_WORKERS": str(n) for q, n in (queues or {}).items()}
        made = memory_broker(Settings.from_env(environ={**os.environ, **environ}),
                             **{"max_retries": 3, "min_backoff_ms": 60_000, "max_backoff_ms": 120_000, **overrides})
        made.started_workers = workers  # type: ignore[attr-defined]
        return made

    yield make
    for worker in workers:
        worker.stop(timeout=5_000)
