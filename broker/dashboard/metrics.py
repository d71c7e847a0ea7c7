"""``/metrics``: gauges read from the database at scrape time, by one process.

A collector of our own (not module-level gauges) so each scrape reads fresh rows and
nothing is registered globally: ``generate_latest`` over a private registry.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

#: Messages per queue and state; a queued message not yet due counts as delayed, a
#: claimed one as running. Finished (done) messages are not depth.
QUEUE_DEPTH = """
SELECT queue_name,
       CASE WHEN "state" = 'queued' AND eta > now() THEN 'delayed'
            WHEN "state" = 'consumed' THEN 'running'
            ELSE "state"::text END AS state,
       count(*)::int
FROM dramatiq.queue
WHERE "state" IN ('queued', 'consumed', 'rejected')
GROUP BY 1, 2
"""

OLDEST_DUE = """
SELECT queue_name, EXTRACT(EPOCH FROM now() - min(eta))::float8
FROM dramatiq.queue WHERE "state" = 'queued' AND eta <= now()
GROUP BY queue_name
"""

WORKERS_ALIVE = """
SELECT count(*)::int FROM standmeet.worker_processes
WHERE stopped_at IS NULL AND heartbeat_at > now() - make_interval(secs => %(after_s)s)
"""

OUTBOX_LAG = """
SELECT coalesce(EXTRACT(EPOCH FROM now() - min(created_at)), 0)::float8
FROM standmeet.outbox WHERE relayed_at IS NULL AND error IS NULL
"""


class DatabaseGauges(Collector):
    """standmeet_queue_depth, _oldest_queued_age_seconds, _workers_alive, _outbox_lag_seconds."""

    def __init__(self, connect: Callable[[], Any], *, queues: tuple[str, ...], rescue_after_s: float) -> None:
        self.connect = connect
        self.queues = queues
        self.rescue_after_s = rescue_after_s

    def collect(self) -> Iterator[Metric]:
        with self.connect() as conn:
            yield from self._collect(conn)

    def _collect(self, conn: psycopg.Connection[Any]) -> Iterator[Metric]:
        depth = GaugeMetricFamily("standmeet_queue_depth", "Messages per queue and state",
                                  labels=["queue_name", "state"])
        counts = {(q, s): n for q, s, n in conn.execute(QUEUE_DEPTH).fetchall()}
        names = sorted(set(self.queues) | {q for q, _ in counts})
        for queue in names:
            for state in ("queued", "delayed", "running", "rejected"):
                depth.add_metric([queue, state], counts.get((queue, state), 0))
        yield depth
        oldest = GaugeMetricFamily("standmeet_oldest_queued_age_seconds",
                                   "Age of the oldest due message per queue (0 when none)",
                                   labels=["queue_name"])
        ages = dict(conn.execute(OLDEST_DUE).fetchall())
        for queue in names:
            oldest.add_metric([queue], float(ages.get(queue) or 0.0))
        yield oldest
        row = conn.execute(WORKERS_ALIVE, {"after_s": self.rescue_after_s}).fetchone()
        yield GaugeMetricFamily("standmeet_workers_alive", "Worker processes with a fresh heartbeat",
                                value=row[0] if row else 0)
        row = conn.execute(OUTBOX_LAG).fetchone()
        yield GaugeMetricFamily("standmeet_outbox_lag_seconds", "Age of the oldest unrelayed outbox row",
                                value=row[0] if row else 0.0)


def render_metrics(collector: Collector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return generate_latest(registry)
