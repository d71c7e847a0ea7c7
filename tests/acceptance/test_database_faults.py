"""Database faults: the worker reconnects by itself; no job and no ack is lost."""

from __future__ import annotations

import psycopg

from broker.engine import sql_enqueue
from broker.engine.codec import enqueue_params
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import mark
from tests.support.procs import running, worker_cmd

KILL_WORKER_BACKENDS = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'standmeet-%%' AND pid <> pg_backend_pid()
"""


def _marked(url: str) -> int:
    """Jobs done so far. Through a transaction pooler the test's own query may land on a
    server connection the fault is terminating (it served a worker a moment ago): then
    it asks again, on another."""
    for attempt in range(3):
        try:
            return int(scalar(url, "SELECT count(DISTINCT message_id) FROM test_runs WHERE label = 'fault'"))
        except psycopg.OperationalError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def test_every_backend_terminated_three_times_and_all_jobs_still_complete(
    broker, database_url, subprocess_env, tmp_path
):
    # Given 1,000 queued jobs and a worker draining them
    total = 1_000
    messages = [mark.message("fault") for _ in range(total)]
    with psycopg.connect(database_url) as conn, conn.cursor() as cur:
        cur.execute(sql_enqueue.ENQUEUE, enqueue_params(messages))
    log = tmp_path / "worker.log"
    with running(worker_cmd("--queues", "index"), subprocess_env, log=log) as worker:
        # When every backend of the worker is terminated three times during the drain
        killed = []
        for threshold in (100, 400, 700):
            wait_for(lambda t=threshold: _marked(database_url) >= t, timeout_s=60, what=f"{threshold} jobs done")
            killed.append(scalar(database_url, KILL_WORKER_BACKENDS))
        # Then the worker stays up and every job completes
        wait_for(lambda: _marked(database_url) == total, timeout_s=90, what="all 1,000 jobs done")
        assert worker.poll() is None, log.read_text()
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE state <> 'done'"
                                              " AND message_id = ANY(%s::uuid[])",
                                ([m.message_id for m in messages],)) == 0,
                 timeout_s=30, what="every ack to be written")
        # the end of the last outage is logged at the next successful claim (≤ 1 s poll)
        wait_for(lambda: log.read_text().count("database unreachable") == log.read_text().count("reachable again"),
                 timeout_s=10, what="the last outage's recovery line")
    assert all(n >= 1 for n in killed), killed
    text = log.read_text()
    # One line when the database went away and one when it came back, per outage: not one per message
    assert text.count("database unreachable") <= 3, text
    assert text.count("database unreachable") == text.count("reachable again")


def test_a_message_whose_worker_died_too_often_is_rejected_with_the_reason(broker, database_url):
    # Given a message held by a process that is gone, already rescued max_crashes times
    message = mark.message("poison")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
        conn.execute(
            "UPDATE dramatiq.queue SET state = 'consumed', worker_id = gen_random_uuid(), started_at = now(), crashes = %s"
            " WHERE message_id = %s",
            (broker.settings.max_crashes, message.message_id),
        )
    # When crash rescue runs
    result = broker.rescue_once()
    # Then it is rejected, with the reason, instead of crashing workers forever (the
    # counts are of every rescued row in the database; the row itself is what we judge)
    assert result.get("index", (0, 0))[1] >= 1
    state, error = query(database_url, "SELECT state::text, error FROM dramatiq.queue WHERE message_id = %s",
                         (message.message_id,))[0]
    assert state == "rejected"
    assert f"its worker process died while running it {broker.settings.max_crashes + 1} times" in error


def test_a_message_of_a_live_worker_is_left_alone_by_rescue(broker, database_url):
    message = mark.message("alive")
    broker.ensure_registered()
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
        conn.execute("UPDATE dramatiq.queue SET state = 'consumed', worker_id = %s WHERE message_id = %s",
                     (broker.worker_id, message.message_id))
    broker.heartbeat_once()
    assert query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                 (message.message_id,)) == [("consumed",)]
