"""Unique actors, declared as an application would (``unique=`` on ``@dramatiq.actor``).

Each records its run in ``test_runs``, so tests assert from rows what ran. Importing this
module imports ``actors`` (which configures the broker), so it also runs under
``python -m broker.worker tests.support.unique_jobs``.
"""

from __future__ import annotations

import dramatiq

from broker import UniqueBy, deadline
from broker.outbox import route
from tests.support.jobs import bump, cooperative_sleep, record_finish, record_start

QUEUE = "index"


@dramatiq.actor(actor_name="test.unique", queue_name=QUEUE, unique=True, max_retries=0, store_results=True)
def unique(label: str) -> str:
    """One live message per label."""
    record_finish(record_start("test.unique", QUEUE, label))
    return f"ran {label}"


@dramatiq.actor(actor_name="test.unique_per_hour", queue_name=QUEUE, unique=UniqueBy(period_s=3600), max_retries=0)
def unique_per_hour(label: str) -> None:
    """One message per label and hour, done ones included."""
    record_finish(record_start("test.unique_per_hour", QUEUE, label))


@dramatiq.actor(actor_name="test.unique_raise_once", queue_name=QUEUE, unique=True, min_backoff=10, max_backoff=50)
def unique_raise_once(key: str) -> None:
    """Raises on its first run; its retry (the same message, the same key) succeeds."""
    run = record_start("test.unique_raise_once", QUEUE, key)
    if bump(key) == 1:
        raise RuntimeError(f"boom on the first run of {key}")
    record_finish(run)


@dramatiq.actor(actor_name="test.unique_slow", queue_name=QUEUE, unique=True, max_retries=0)
def unique_slow(label: str, ms: int) -> None:
    """One live message per label, running ``ms`` milliseconds, stopped by a cancellation
    at its next deadline check (every 10 ms)."""
    run = record_start("test.unique_slow", QUEUE, label)
    end = ms / 1000
    while end > 0:
        deadline.check()
        cooperative_sleep(0.01)
        end -= 0.01
    record_finish(run)


@dramatiq.actor(actor_name="test.unique_fails", queue_name=QUEUE, unique=True, max_retries=0)
def unique_fails(label: str) -> None:
    """One live message per label; every run fails (rejected at once: no retries)."""
    record_start("test.unique_fails", QUEUE, label)
    raise RuntimeError(f"{label} fails")


@dramatiq.actor(actor_name="test.plain", queue_name=QUEUE, max_retries=0)
def plain(label: str) -> None:
    """No key: every send is a message."""
    record_finish(record_start("test.plain", QUEUE, label))


#: Every ``test.unique_fanout`` event becomes a message to the unique actor, keyed by its
#: ``label`` alone (the event id is not an argument): duplicates of a label fold into one.
route("test.unique_fanout", "test.unique", lambda event_id, payload: ((payload["label"],), {}))
