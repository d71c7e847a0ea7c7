"""Actors for the Dramatiq-contract tests: results, pipelines, groups, rate limits, priority."""

from __future__ import annotations

import gc
import os

import dramatiq
from dramatiq.rate_limits import ConcurrentRateLimiter

import tests.support.jobs  # noqa: F401  (configures the broker, declares the test actors)
from broker import PostgresRateLimiterBackend, current_broker
from tests.support.jobs import cooperative_sleep, record_finish, record_start

_limiter_backend: PostgresRateLimiterBackend | None = None


def limiter_backend() -> PostgresRateLimiterBackend:
    global _limiter_backend
    if _limiter_backend is None:
        _limiter_backend = PostgresRateLimiterBackend(url=current_broker().url, pool_max_size=2)
    return _limiter_backend


@dramatiq.actor(actor_name="contract.add", queue_name="index", store_results=True, max_retries=0)
def add(a: int, b: int) -> int:
    return a + b


@dramatiq.actor(actor_name="contract.fail", queue_name="index", store_results=True, max_retries=0)
def fail(text: str) -> None:
    raise ValueError(text)


@dramatiq.actor(actor_name="contract.work", queue_name="index", max_retries=0)
def work(label: str, ms: int = 50) -> None:
    run = record_start("contract.work", "index", label)
    cooperative_sleep(ms / 1000)
    record_finish(run)


@dramatiq.actor(actor_name="contract.done", queue_name="index", max_retries=0)
def group_done(label: str) -> None:
    record_finish(record_start("contract.done", "index", label))


@dramatiq.actor(actor_name="contract.limited", queue_name="index", max_retries=50, min_backoff=20, max_backoff=100)
def limited(label: str, ms: int = 100) -> None:
    """At most one at a time across every process, by a ConcurrentRateLimiter in Postgres."""
    mutex = ConcurrentRateLimiter(limiter_backend(), "contract-mutex", limit=1, ttl=30_000)
    with mutex.acquire():
        run = record_start("contract.limited", "index", f"{label}:{os.getpid()}")
        cooperative_sleep(ms / 1000)
        record_finish(run)


@dramatiq.actor(actor_name="contract.slow", queue_name="fetch", max_retries=0)
def slow(ms: int) -> None:
    cooperative_sleep(ms / 1000)


@dramatiq.actor(actor_name="contract.ordered", queue_name="contract-prio", max_retries=0)
def ordered(label: str) -> None:
    """On a queue of its own with one worker: runs in the order messages are claimed."""
    record_finish(record_start("contract.ordered", "contract-prio", label))


@dramatiq.actor(actor_name="contract.gc_report", queue_name="index", max_retries=0)
def gc_report(label: str) -> None:
    """Records how many objects the worker froze out of the collector's reach."""
    record_finish(record_start("contract.gc_report", "index", f"{label}:{gc.get_freeze_count()}"))
