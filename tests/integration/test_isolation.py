"""A slow endpoint fills only the webhook queue; indexing goes on at full speed."""

from __future__ import annotations

import statistics

from actors.queues import QUEUE_NAMES
from tests.support.db import query, scalar, wait_for
from tests.support.http import http_server
from tests.support.jobs import SLEEP, post

LATENCIES = """
SELECT EXTRACT(EPOCH FROM r.finished_at - q.enqueued_at)
FROM test_runs r JOIN dramatiq.queue q ON q.message_id = r.message_id
WHERE r.label = %s AND r.finished_at IS NOT NULL
"""


def _index_latencies(database_url: str, label: str, count: int = 50) -> list[float]:
    for _ in range(count):
        SLEEP["index"].send(20, label)
    wait_for(
        lambda: scalar(
            database_url, "SELECT count(*) FROM test_runs WHERE label = %s AND finished_at IS NOT NULL", (label,)
        )
        == count,
        timeout_s=30,
        what=f"{count} index jobs ({label})",
    )
    return sorted(float(row[0]) for row in query(database_url, LATENCIES, (label,)))


def test_a_blocked_webhook_queue_does_not_slow_index_jobs(broker, database_url, start_worker):
    start_worker(queues=list(QUEUE_NAMES), threads=32)
    # Given the index latency with the webhook queue idle
    idle = _index_latencies(database_url, "idle")
    with http_server(hold=True) as (url, server):
        # When an endpoint holds every request open and fills the webhook queue
        for i in range(20):
            post.send(url, f"held-{i}")
        wait_for(lambda: server.current() == 8, timeout_s=10, what="8 requests held by the endpoint")
        blocked = _index_latencies(database_url, "blocked")
        # Then the endpoint saw the webhook queue at its limit the whole time, no more
        assert server.current() == 8
        assert server.max_in_flight == 8
    # And the index jobs finished as fast as with the webhook queue idle
    p50_idle, p50_blocked = statistics.median(idle), statistics.median(blocked)
    p95_idle, p95_blocked = idle[int(0.95 * len(idle))], blocked[int(0.95 * len(blocked))]
    assert p50_blocked <= p50_idle * 2 + 0.1, (p50_idle, p50_blocked)
    assert p95_blocked <= p95_idle * 2 + 0.2, (p95_idle, p95_blocked)
