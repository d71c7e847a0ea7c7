"""``async def`` actors, out of the box: every policy holds for them as for the others.

No middleware is added by hand: the broker's default stack runs one event loop per worker
process, and an async actor's worker thread waits for its coroutine, so the queue's
concurrency, the time limit (the coroutine is cancelled), snoozes, the keyed lease,
results, the job's deadline and an operator's cancel all apply. Each test asserts from
the rows the coroutines wrote.
"""

from __future__ import annotations

import itertools

import psycopg
import pytest
from dramatiq.middleware.asyncio import AsyncIO

from broker import ops
from tests.support import async_jobs
from tests.support.db import query, scalar, wait_for
from tests.support.webserver import Reply, web_server

STATE = "SELECT state::text FROM dramatiq.queue WHERE message_id = %s::uuid"
RUNS = "SELECT started_at, finished_at FROM test_runs WHERE actor = %s AND label = ANY(%s) ORDER BY started_at"


def _settled(url: str, message_id: str, *, timeout_s: float = 20) -> str:
    wait_for(lambda: scalar(url, STATE, (message_id,)) in ("done", "rejected"), timeout_s=timeout_s,
             what=f"{message_id} to be settled")
    return str(scalar(url, STATE, (message_id,)))


def _most_at_once(runs: list[tuple]) -> int:
    """The most runs in progress at one moment (from their start and finish times)."""
    events = sorted(itertools.chain(((s, 1) for s, _ in runs), ((f, -1) for _, f in runs)),
                    key=lambda e: (e[0], e[1]))
    at_once = most = 0
    for _, step in events:
        at_once += step
        most = max(most, at_once)
    return most


@pytest.fixture(scope="module", autouse=True)
def _leases(database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(async_jobs.LEASES)


def test_the_default_stack_runs_async_actors_with_no_middleware_added(broker):
    assert any(isinstance(m, AsyncIO) for m in broker.middleware)


def test_async_jobs_of_a_queue_run_at_most_its_limit_at_once_and_all_complete(broker, database_url, start_worker):
    # Given a queue limited to 2 at once, and 8 workers threads
    start_worker(queues=[async_jobs.QUEUE], threads=8)
    labels = [f"limit-{i}" for i in range(6)]
    # When 6 async jobs of 300 ms are sent
    messages = [async_jobs.sleep.send(label, 300) for label in labels]
    for message in messages:
        assert _settled(database_url, message.message_id) == "done"
    # Then they all ran, never more than 2 at once, and at least 2 at once (so that the
    # limit, not a single event loop serialising them, is what held)
    runs = query(database_url, RUNS, ("async.sleep", labels))
    assert len(runs) == 6 and all(f is not None for _, f in runs)
    assert _most_at_once(runs) == 2


def test_an_async_job_past_its_time_limit_is_cancelled_and_fails(broker, database_url, start_worker):
    start_worker(queues=[async_jobs.QUEUE], threads=2)
    # When an async job awaits 30 s under a 300 ms limit
    message = async_jobs.overrun.send("overrun")
    # Then its coroutine is cancelled (it saw CancelledError) and the job fails for good
    assert _settled(database_url, message.message_id, timeout_s=10) == "rejected"
    assert scalar(database_url, "SELECT value FROM test_counters WHERE key = 'overrun:cancelled'") == 1
    assert "TimeLimitExceeded" in (scalar(database_url, "SELECT message->'options'->>'traceback' FROM "
                                                        "dramatiq.queue WHERE message_id = %s::uuid",
                                          (message.message_id,)) or "")
    assert query(database_url, RUNS, ("async.overrun", ["overrun"]))[0][1] is None


def test_an_async_job_that_snoozes_runs_again_without_a_retry(broker, database_url, start_worker):
    start_worker(queues=[async_jobs.QUEUE], threads=2)
    message = async_jobs.snooze_once.send("async-snooze")
    assert _settled(database_url, message.message_id) == "done"
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'async-snooze'") == 2
    assert scalar(database_url, "SELECT coalesce((message->'options'->>'retries')::int, 0) FROM dramatiq.queue "
                                "WHERE message_id = %s::uuid", (message.message_id,)) == 0


def test_async_jobs_of_one_key_never_overlap_under_the_keyed_lease(broker, database_url, start_worker):
    start_worker(queues=[async_jobs.QUEUE], threads=8)
    labels = [f"keyed-{i}" for i in range(4)]
    messages = [async_jobs.keyed.send("one-key", label, 150) for label in labels]
    for message in messages:
        assert _settled(database_url, message.message_id) == "done"
    runs = query(database_url, RUNS, ("async.keyed", labels))
    assert len(runs) == 4 and _most_at_once(runs) == 1


def test_an_async_jobs_result_comes_back(broker, start_worker):
    start_worker(queues=[async_jobs.QUEUE], threads=2)
    assert async_jobs.add.send(20, 22).get_result(block=True, timeout=10_000) == 42


def test_an_async_job_sees_its_deadline_and_its_http_timeout_is_capped_to_it(broker, database_url, start_worker):
    start_worker(queues=[async_jobs.QUEUE], threads=2)
    with web_server() as server:
        server.on("GET", "/ok", lambda request: Reply(200, b"ok"))
        message = async_jobs.sees_deadline.send("deadline", server.base + "/ok")
        assert _settled(database_url, message.message_id) == "done"
    seen = dict(query(database_url, "SELECT key, value FROM test_counters WHERE key LIKE 'deadline:%%'"))
    # Then its coroutine saw what remained of its 2 s limit, not "no deadline" (-1), and the
    # HTTP client's 60 s timeout was cut to it
    assert 0 < seen["deadline:left_ms"] <= 2_000
    assert seen["deadline:status"] == 200
    assert 0 < seen["deadline:timeout_ms"] <= 2_000
    # And its database connection's statement_timeout was set to it
    assert 0 < seen["deadline:statement_timeout_ms"] <= 2_000


def test_an_async_jobs_statement_past_its_deadline_is_stopped_by_the_server(broker, database_url, start_worker):
    start_worker(queues=[async_jobs.QUEUE], threads=2)
    message = async_jobs.slow_query.send("async-query")
    assert _settled(database_url, message.message_id, timeout_s=15) == "rejected"
    assert scalar(database_url, "SELECT value FROM test_counters WHERE key = 'async-query:QueryCanceled'") == 1


def test_a_cancelled_async_job_stops_at_its_next_check(broker, database_url, start_worker):
    start_worker(queues=[async_jobs.QUEUE], threads=2)
    message = async_jobs.until_cancelled.send("cancel-async")
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'cancel-async'") == 1,
             timeout_s=10, what="the async job to start")
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert ops.cancel_jobs(conn, message_ids=[message.message_id], by="ops@host") == 1
    assert _settled(database_url, message.message_id, timeout_s=15) == "rejected"
    assert query(database_url, RUNS, ("async.until_cancelled", ["cancel-async"]))[0][1] is None
