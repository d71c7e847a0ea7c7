"""Dramatiq middleware, one policy per file; :func:`default_middleware` fixes the order.

Order matters: ``before_*`` hooks run top to bottom, ``after_*`` hooks bottom to top.

1. ``ConnectionBudget``  refuse to boot over the connection budget, or for an unknown queue
   ``Tracing``           a consumer span per run, the producer's trace carried on (``[otel]``)
2. ``QueueConcurrency``  never more than a queue's max_workers jobs at once in a process
3. ``AgeLimit``          (Dramatiq's) drop messages older than their ``max_age``
4. ``TimeLimit``         a hard limit per job kind; records the deadline where jobs block
5. ``CurrentMessage``, ``ShutdownNotifications`` (Dramatiq's)
6. ``Callbacks``, ``Pipelines`` (Dramatiq's)
   ``Metrics``, ``JobLog``, ``Cancellation``  Dramatiq's metric names; one log line per
                         finished job; a cancelled running job stops at its next check
                         (before Retries, so their after-hooks see its decision)
7. ``Retries``           retry failures with back-off; the delay lives in the database
8. ``Results``           results in Postgres (``store_results=True``), none for a snoozed run;
                         a result that is not JSON fails its job
9. ``GroupCallbacks``    (Dramatiq's) group completion callbacks, on the Postgres rate limiter
10. ``SnoozePolicy``     run a job again later without counting a retry
11. ``KeyedLease``       at most one message in flight per key (an actor's ``lease``), by a
                         row lease; busy means snooze (counted as lease busy)
    ``UniqueJobs``       the ``unique`` actor option: a send whose key is live returns the
                         live message (the broker's write decides, by a unique index)
12. ``GracefulShutdown`` stop the relay and claiming on SIGTERM
13. ``AsyncIO``          (Dramatiq's) one event loop per worker process: ``async def`` actors
                         run there while their worker thread waits, so every policy above
                         holds for them (a time limit or a cut-off cancels the coroutine)

A policy that acts on a run only when an option names it costs every other run
nothing: the broker skips the hooks of ``AgeLimit`` (without a default ``max_age``),
``ShutdownNotifications`` (without ``notify_shutdown``), ``Callbacks``, ``Pipelines``,
``GroupCallbacks`` and ``KeyedLease`` for a run whose message and actor set none of
their options (``broker.engine.hooks``; a middleware of yours declares the same with a
``runs_only_with_options`` attribute). ``Tracing`` without the OpenTelemetry API
installed has no run hooks at all. Every other policy above runs for every run.

The broker disarms the time limit before any after-hook runs, so the limit never fires
inside the settle path; what after-hooks send (retries, snoozes, pipelines, callbacks)
is written with the run's settle, in one transaction.

Importing this package (``from middleware import Snooze``) loads no database driver: the
two policies that need Postgres to exist at all (the connection budget, the metrics'
database gauges) are imported by :func:`default_middleware`, so an application's actors
load on the memory broker of ``broker.testing`` with psycopg absent.
"""

from __future__ import annotations

from typing import Any

from dramatiq.middleware import (
    AgeLimit,
    AsyncIO,
    Callbacks,
    CurrentMessage,
    GroupCallbacks,
    Pipelines,
    ShutdownNotifications,
)
from dramatiq.rate_limits import RateLimiterBackend
from dramatiq.results import ResultBackend

from broker.settings import Settings
from middleware.cancellation import Cancellation, Watcher
from middleware.graceful_shutdown import GracefulShutdown
from middleware.job_log import JobLog
from middleware.keyed_lease import Held, KeyedLease, Lease, LeaseStore, given_back, lease_of
from middleware.queue_concurrency import QueueConcurrency
from middleware.results import results_middleware
from middleware.retries import Retries
from middleware.snooze import Snooze, SnoozePolicy, snooze_before_start
from middleware.time_limit import TimeLimit
from middleware.tracing import Tracing
from middleware.unique_jobs import UniqueJobs

__all__ = ["Held", "Lease", "Snooze", "default_middleware", "given_back", "lease_of", "snooze_before_start"]


def default_middleware(
    settings: Settings, *, results: ResultBackend | None = None, rate_limiter: RateLimiterBackend | None = None,
    leases: LeaseStore | None = None, cancel_watcher: Watcher | None = None, postgres: bool = True,
) -> list[Any]:
    """The policies every broker of ours runs, in order; results and group callbacks
    when their backends are given (``broker.configure()`` gives the Postgres ones).

    ``leases`` and ``cancel_watcher``: where keyed leases live and what learns of
    cancellations (None: in Postgres). ``postgres=False`` leaves out the policies that
    only a Postgres broker has (the connection budget, the metrics with their database
    gauges, the outbox relay's shutdown): the memory broker of ``broker.testing``.
    """
    stores = [results_middleware(backend=results)] if results is not None else []
    groups = [GroupCallbacks(rate_limiter)] if rate_limiter is not None else []
    budget: list[Any] = []
    measures: list[Any] = []
    shutdown: list[Any] = []
    if postgres:
        from middleware.connection_budget import ConnectionBudget
        from middleware.metrics import Metrics

        budget, measures, shutdown = [ConnectionBudget()], [Metrics()], [GracefulShutdown()]
    return [
        *budget,
        Tracing(),
        QueueConcurrency(),
        AgeLimit(),
        TimeLimit(),
        CurrentMessage(),
        ShutdownNotifications(),
        Callbacks(),
        Pipelines(),
        *measures,
        JobLog(),
        Cancellation(watcher=cancel_watcher),
        Retries(
            max_retries=settings.max_retries,
            min_backoff_ms=settings.min_backoff_ms,
            max_backoff_ms=settings.max_backoff_ms,
        ),
        *stores,
        *groups,
        SnoozePolicy(),
        KeyedLease(store=leases),
        UniqueJobs(),
        *shutdown,
        AsyncIO(),
    ]
