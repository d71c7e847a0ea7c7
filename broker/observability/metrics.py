"""Prometheus metrics: the ones each process counts, and the database-derived gauges.

Counted in worker processes (by ``middleware/metrics.py`` and the broker): with
``PROMETHEUS_MULTIPROC_DIR`` set (``standmeet-jobs run`` sets it for its children)
prometheus_client writes them to files there, and the ``run`` process serves them all
on one ``/metrics`` (:func:`serve`), with the database-derived gauges of
:class:`DatabaseCollector` (the runtime's, and those the applications declared with
``broker.app.gauges``) computed there once per scrape, not once per process.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import psycopg
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from broker import app, deadline, detach, ops
from broker.engine import enqueue as writer
from broker.ops import history
from broker.pg import pool as pgpool

logger = logging.getLogger(f"standmeet.{__name__}")

#: The gauges' reads stop after the collector's timeout: a deadline of their own
#: transaction, never a setting left on the session (it may be a pooler's).
SET_LOCAL_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"

LABELS = ("queue_name", "actor_name")
#: The window the history gauges sum (one summary statement per scrape).
HISTORY_WINDOW = timedelta(hours=1)

@functools.lru_cache(maxsize=4096)
def child(metric: Any, *labels: str) -> Any:
    """``metric.labels(*labels)``, looked up once per label set: ``labels()`` validates and
    locks on every call, and the per-job metrics call it five times a job."""
    return metric.labels(*labels)


# -- Dramatiq's names and labels, so existing Dramatiq dashboards work ----------------------
MESSAGES = Counter("dramatiq_messages_total", "The total number of messages processed.", LABELS)
ERRORS = Counter("dramatiq_message_errors_total", "The total number of errored messages.", LABELS)
RETRIES = Counter("dramatiq_message_retries_total", "The total number of retried messages.", LABELS)
REJECTS = Counter("dramatiq_message_rejects_total", "The total number of dead-lettered messages.", LABELS)
IN_PROGRESS = Gauge("dramatiq_messages_inprogress", "The number of messages in progress.", LABELS,
                    multiprocess_mode="livesum")
DURATION = Histogram(
    "dramatiq_message_duration_milliseconds", "The time spent processing messages.", LABELS,
    buckets=(5, 10, 25, 50, 75, 100, 250, 500, 750, 1000, 2500, 5000, 7500, 10000, 30000, 60000, 600000,
             900000, float("inf")),
)

# -- ours ---------------------------------------------------------------------------------
SNOOZES = Counter("standmeet_snoozes_total", "Jobs that asked to run later (not a retry).", LABELS)
LEASE_BUSY = Counter("standmeet_lease_busy_total",
                     "Jobs snoozed because the key of their lease was busy.", LABELS)
RESCUES = Counter("standmeet_rescues_total", "Messages of dead worker processes, requeued or rejected.",
                  ("queue_name", "outcome"))
RECEIPT_WAITERS = Gauge("standmeet_receipt_waiters", "Requests waiting for a job's receipt.", ("channel",),
                        multiprocess_mode="livesum")
RECEIPT_WAITERS_REFUSED = Counter("standmeet_receipt_waiters_refused_total",
                                  "Requests told at once not to wait: their channel held its maximum.",
                                  ("channel",))
UNIQUE_SKIPPED = Counter("standmeet_unique_skipped_total",
                         "Sends not written because a message with their unique key was live; the live one "
                         "was returned instead.", ("queue", "actor"))
CLAIM_TO_START = Histogram(
    "standmeet_claim_to_start_seconds", "From a message's claim to the start of its run.", ("queue_name",),
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, float("inf")),
)


def count_unique_skips(skipped: dict[tuple[str, str], int]) -> None:
    """Count sends skipped for a live unique key, {(queue, actor): n} (the broker calls it)."""
    for (queue_name, actor_name), n in skipped.items():
        child(UNIQUE_SKIPPED, queue_name, actor_name).inc(n)


writer.SKIP_COUNTERS.append(count_unique_skips)


def count_rescues(result: dict[str, tuple[int, int]]) -> None:
    """Count a rescue pass's {queue: (requeued, rejected)} (the broker's heartbeat calls it)."""
    for queue_name, (requeued, rejected) in result.items():
        if requeued:
            RESCUES.labels(queue_name, "requeued").inc(requeued)
        if rejected:
            RESCUES.labels(queue_name, "rejected").inc(rejected)


#: Held while a :class:`DatabaseCollector` reads the database (one reading at a time).
_READING = threading.Lock()
#: The last reading of each (url, rescue window): when it started, and its families.
_LAST_READ: dict[tuple[str, float], tuple[float, list[Any]]] = {}


class DatabaseCollector(Collector):
    """Gauges read from the database at each scrape (export them from one process only)."""

    def __init__(self, url: str, *, rescue_after_s: float = ops.DEFAULT_RESCUE_AFTER_S,
                 timeout_s: float = 5.0) -> None:
        self.url = url
        self.rescue_after_s = rescue_after_s
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[Any]:
        """The gauges, read once for every scrape that asks while a reading is under way:
        one reading of a database at a time in this process (scrapes never pile up
        connections), and a scrape that waited for one started after it asked takes
        that one's figures, as fresh as its own would be."""
        key = (self.url, self.rescue_after_s)
        asked = time.monotonic()
        with _READING:
            last = _LAST_READ.get(key)
            if last is not None and last[0] >= asked:
                families = last[1]
            else:
                started = time.monotonic()
                families = list(self._read())
                _LAST_READ[key] = (started, families)
        yield from families

    def _read(self) -> Iterator[Any]:
        depth = GaugeMetricFamily("standmeet_queue_depth", "Jobs in a queue by state.",
                                  labels=["queue_name", "state"])
        prefetched = GaugeMetricFamily("standmeet_queue_prefetched",
                                       "Jobs of a queue claimed by a worker process and not yet started "
                                       "(counted in its running depth).", labels=["queue_name"])
        oldest = GaugeMetricFamily("standmeet_oldest_queued_age_seconds",
                                   "How long the oldest due job of a queue has waited (0: none).",
                                   labels=["queue_name"])
        unserved = GaugeMetricFamily("standmeet_queue_unserved",
                                     "1 when a queue has due jobs and no live worker process serves it.",
                                     labels=["queue_name"])
        alive = GaugeMetricFamily("standmeet_workers_alive", "Worker processes with a fresh heartbeat.")
        lag = GaugeMetricFamily("standmeet_outbox_lag_seconds",
                                "How long the oldest unrelayed outbox event has waited (0: none).")
        unrouted = GaugeMetricFamily("standmeet_outbox_unrouted",
                                     "Pending outbox events of a topic that no live process routes.",
                                     labels=["topic"])
        unrouted_age = GaugeMetricFamily("standmeet_outbox_unrouted_oldest_age_seconds",
                                         "How long the oldest event of a topic no live process routes has waited.",
                                         labels=["topic"])
        failed = GaugeMetricFamily("standmeet_outbox_failed",
                                   "Outbox events kept with an error, relayed again only when retried.")
        relays = GaugeMetricFamily("standmeet_relays_alive", "Outbox relays with a fresh heartbeat.")
        throughput = GaugeMetricFamily("standmeet_queue_throughput_per_second",
                                       "Jobs of a queue done per second over the last hour (from the history).",
                                       labels=["queue_name"])
        failures = GaugeMetricFamily("standmeet_queue_failures_last_hour",
                                     "Runs of a queue that failed (retried or for good) or died with their process "
                                     "in the last hour.", labels=["queue_name"])
        wait = GaugeMetricFamily("standmeet_queue_wait_seconds",
                                 "From a job being due to its start, over the last hour: an estimate of the quantile "
                                 "from the history's histogram (absent when nothing started).",
                                 labels=["queue_name", "quantile"])
        run = GaugeMetricFamily("standmeet_queue_run_seconds",
                                "From a run's start to its end, over the last hour: an estimate of the quantile from "
                                "the history's histogram (absent when nothing ran).", labels=["queue_name", "quantile"])
        up = GaugeMetricFamily("standmeet_database_up", "1 when the gauges above could be read.")
        try:
            kwargs = {**pgpool.connect_kwargs(self.url), "connect_timeout": max(1, int(self.timeout_s))}
            with psycopg.connect(self.url, autocommit=True, application_name="standmeet-metrics", **kwargs) as conn, \
                    conn.transaction():  # read-only; the deadline is this transaction's, not the session's
                conn.execute(SET_LOCAL_STATEMENT_TIMEOUT, (str(int(self.timeout_s * 1000)),))
                queues = ops.queue_overview(conn, rescue_after_s=self.rescue_after_s)
                workers = ops.worker_overview(conn, rescue_after_s=self.rescue_after_s)
                outbox = ops.outbox_overview(conn, rescue_after_s=self.rescue_after_s)
                last_hour = history.summary(conn, since=ops.db_now(conn) - HISTORY_WINDOW)
                declared = declared_gauges(conn)
        except psycopg.Error as exc:
            logger.warning("metrics: could not read the database: %s", str(exc).strip().splitlines()[0])
            up.add_metric([], 0)
            yield up
            return
        for q in queues:
            for state, value in (("queued", q.queued), ("delayed", q.delayed), ("running", q.running),
                                 ("rejected_24h", q.rejected)):
                depth.add_metric([q.name, state], value)
            prefetched.add_metric([q.name], q.prefetched)
            oldest.add_metric([q.name], q.oldest_queued_age_s or 0.0)
            unserved.add_metric([q.name], 1 if q.unserved else 0)
        alive.add_metric([], sum(1 for w in workers if w.alive))
        lag.add_metric([], outbox.lag_s or 0.0)
        for topic in outbox.unrouted:
            unrouted.add_metric([topic.topic], topic.events)
            unrouted_age.add_metric([topic.topic], topic.oldest_age_s)
        failed.add_metric([], outbox.failed)
        relays.add_metric([], sum(1 for r in outbox.relays if r.alive))
        for s in last_hour:
            f = s.figures
            throughput.add_metric([s.queue], f.throughput_per_s)
            failures.add_metric([s.queue], f.failures)
            for quantile, wait_ms, run_ms in (("0.5", f.wait_p50_ms, f.run_p50_ms), ("0.95", f.wait_p95_ms, f.run_p95_ms)):
                if wait_ms is not None:
                    wait.add_metric([s.queue, quantile], wait_ms / 1000)
                if run_ms is not None:
                    run.add_metric([s.queue, quantile], run_ms / 1000)
        up.add_metric([], 1)
        yield from (depth, prefetched, oldest, unserved, alive, lag, unrouted, unrouted_age, failed, relays,
                    throughput, failures, wait, run, up)
        yield from declared


def declared_gauges(conn: psycopg.Connection[Any]) -> list[Any]:
    """The families of the gauges the loaded applications declared (``broker.app.gauges``),
    each reader in a savepoint of ``conn``'s transaction: one that fails is logged and
    left out, the others and the runtime's gauges are served."""
    families: list[Any] = []
    for read in list(app.REGISTRY.gauge_readers):
        try:
            with conn.transaction():
                families.extend(read(conn))
        except Exception as exc:  # an application's reader never takes the runtime's gauges down
            name = getattr(read, "__qualname__", repr(read))
            logger.warning("metrics: the gauges of %s could not be read: %s", name,
                           str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)
    return families


def registry_for(url: str, *, multiprocess_dir: str | None, rescue_after_s: float) -> CollectorRegistry:
    """What one /metrics serves: every process's metrics (multiprocess mode), and the
    database gauges once."""
    registry = CollectorRegistry()
    if multiprocess_dir:
        from prometheus_client import multiprocess

        multiprocess.MultiProcessCollector(registry, path=multiprocess_dir)
    registry.register(DatabaseCollector(url, rescue_after_s=rescue_after_s))
    return registry


class _QuietHandler(WSGIRequestHandler):
    #: a client that sends nothing for this long is hung up on (socket timeout)
    timeout = 10

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("metrics: " + format, *args)


#: Requests /metrics serves at once; a connection beyond them is closed at once.
MOST_REQUESTS = 8
#: The longest a request may take, from its first byte to the last of its answer (a
#: scrape's database reading has 5 s per statement; a client may trickle its bytes).
REQUEST_MOST_S = 30.0


class _Server(WSGIServer):
    """wsgiref's server, each request on a thread of its own (:mod:`broker.detach`), at
    most :data:`MOST_REQUESTS` at once: a client that idles holds one of them for at
    most its handler's timeout, never the scrapes of the others."""

    def server_activate(self) -> None:
        super().server_activate()
        self._slots = threading.BoundedSemaphore(MOST_REQUESTS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            detach.go("metrics-request", lambda stop: self._serve(request, client_address))
        except BaseException:  # (no thread could be started: the slot is free again, the client hung up on)
            self._slots.release()
            self.shutdown_request(request)
            raise

    def _serve(self, request: Any, client_address: Any) -> None:
        try:  # a whole request within REQUEST_MOST_S, however its client trickles it
            with deadline.watchdog(REQUEST_MOST_S, lambda: _hang_up(request)):
                self.finish_request(request, client_address)
        except Exception:  # a client gone mid-answer, or hung up on: nothing to tell anyone
            logger.debug("metrics: a request failed", exc_info=True)
        finally:
            self.shutdown_request(request)
            self._slots.release()


def _hang_up(request: Any) -> None:
    """End a request's connection from the watchdog's thread: its reads and writes fail."""
    try:
        request.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


class MetricsServer:
    """``/metrics`` over HTTP, on a detached thread; :meth:`stop` closes it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        app = make_wsgi_app(registry)
        self.server: WSGIServer = make_server(host, port, app, server_class=_Server, handler_class=_QuietHandler)
        self.port = int(self.server.server_port)
        self._thread = detach.go(f"metrics-http-{self.port}", lambda stop: self.server.serve_forever(0.2))

    def stop(self) -> None:
        self.server.shutdown()
        self._thread.join(timeout_s=5)
        self.server.server_close()


def serve(registry: CollectorRegistry, host: str, port: int) -> MetricsServer:
    return MetricsServer(registry, host, port)
