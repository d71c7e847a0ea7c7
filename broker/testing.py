"""Test your actors without Postgres: the memory broker, with this runtime's policies.

    from broker.testing import memory_broker

    broker = memory_broker()        # Dramatiq's global broker now; declared actors moved over
    my_actor.send(1)
    broker.drain()                  # runs everything on this thread (delays jump ahead)

or with a Dramatiq worker, as with Dramatiq's ``StubBroker``::

    worker = dramatiq.Worker(broker, worker_timeout=100)
    worker.start()
    my_actor.send(1)
    broker.join(my_actor.queue_name)
    worker.stop()

The broker runs :func:`middleware.default_middleware` (per-queue concurrency, time limits,
retries, snoozes, results, keyed leases, unique jobs, cancellation) with in-memory
backends, and leaves out what only a Postgres broker has (the connection budget, the
metrics with their database gauges, the outbox relay). It imports no database driver
and opens no connection. See ``docs/testing.md``.
"""

from __future__ import annotations

import os
from typing import Any

from dramatiq.middleware import AgeLimit
from dramatiq.rate_limits.backends.stub import StubBackend as StubRateLimiterBackend

from broker import services
from broker.errors import ConfigError
from broker.memory import (
    Clock,
    ClockedAgeLimit,
    MemoryBroker,
    MemoryCancellations,
    MemoryLeases,
    MemoryResults,
)
from broker.settings import Settings, replace
from middleware import default_middleware

__all__ = ["Clock", "MemoryBroker", "memory_broker"]

#: The variables that name a database: the memory broker has none, so it neither reads nor
#: checks them (checking a URL's form would import the database driver).
DATABASE_VARIABLES = frozenset({"DATABASE_URL", "STANDMEET_LISTEN_DATABASE_URL"})
#: The ``url`` the memory broker's services report.
MEMORY_URL = "memory://"


def _no_database() -> Any:
    raise ConfigError("the memory broker has no database: this part of the runtime needs Postgres "
                      "(broker.configure())")


def memory_broker(settings: Settings | None = None, *, fail_fast: bool = True, **overrides: Any) -> MemoryBroker:
    """Build a memory broker and make it Dramatiq's global one; actors declared before move over.

    ``settings``: as ``broker.configure()`` takes them (default: from the environment, so
    ``STANDMEET_QUEUE_<NAME>_MAX_WORKERS`` and the other queue variables hold), with
    ``overrides`` applied (``max_retries=3``, ``min_backoff_ms=10`` …). ``fail_fast``:
    whether ``join`` raises the error of a message rejected on its queue (Dramatiq's
    StubBroker does). Its results are in ``broker.results``, kept for their ``result_ttl`` by the
    broker's clock; ``max_age`` is measured on that clock too.
    """
    settings = settings or Settings.from_env(environ={k: v for k, v in os.environ.items()
                                                      if k not in DATABASE_VARIABLES})
    if overrides:
        settings = replace(settings, **overrides)
    clock = Clock()
    cancellations = MemoryCancellations()
    results = MemoryResults(clock)
    rate_limiter = StubRateLimiterBackend()
    middleware = default_middleware(settings, results=results, rate_limiter=rate_limiter,
                                    leases=MemoryLeases(clock), cancel_watcher=cancellations, postgres=False)
    middleware = [ClockedAgeLimit(clock) if type(m) is AgeLimit else m for m in middleware]
    broker = MemoryBroker(
        settings=settings, clock=clock, cancellations=cancellations, backends=(results, rate_limiter),
        fail_fast_default=fail_fast, middleware=middleware)
    services.make_global(broker)  # actors declared before move over
    services.install(services.Services(settings=settings, url=MEMORY_URL, broker=broker,  # type: ignore[arg-type]
                                       open_app_pool=_no_database, open_waiters=_no_database,
                                       start_relay=_no_database))
    return broker
