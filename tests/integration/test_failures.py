"""Time limits cancel jobs and count as retryable; exceptions never kill the worker."""

from __future__ import annotations

import json

import dramatiq
import pytest

from tests.support.db import query, wait_for
from tests.support.jobs import noop, overrun_once, raise_once, slow_query_once


def _final(database_url: str, message_id: str, timeout_s: float = 15) -> tuple[str, dict]:
    def settled():
        rows = query(
            database_url, "SELECT state, message FROM dramatiq.queue WHERE message_id = %s", (message_id,)
        )
        return rows[0] if rows and rows[0][0] in ("done", "rejected") else None

    state, message = wait_for(settled, timeout_s=timeout_s, what=f"message {message_id} to settle")
    return state, message if isinstance(message, dict) else json.loads(message)


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_job_past_its_time_limit_is_cancelled_retried_and_the_worker_goes_on(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    message = overrun_once.send("overrun")
    state, body = _final(database_url, message.message_id)
    assert state == "done"
    assert body["options"]["retries"] == 1
    assert "TimeLimitExceeded" in body["options"]["traceback"]
    # the first run was cut short at its 1 s limit, not left to sleep its 30 s
    runs = query(database_url, "SELECT finished_at FROM test_runs WHERE label = 'overrun' ORDER BY id")
    assert [r[0] is None for r in runs] == [True, False]
    # and the same process serves the next job
    after = noop.send("after-overrun")
    assert _final(database_url, after.message_id)[0] == "done"


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_sql_statement_past_the_time_limit_is_stopped_by_postgres(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    message = slow_query_once.send("slow-sql")
    state, body = _final(database_url, message.message_id)
    assert state == "done"
    assert body["options"]["retries"] == 1
    assert "statement timeout" in body["options"]["traceback"]


def test_an_exception_in_an_actor_is_recorded_and_retried(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    message = raise_once.send("raises")
    state, body = _final(database_url, message.message_id)
    assert state == "done"
    assert body["options"]["retries"] == 1
    assert "RuntimeError: boom on the first run of raises" in body["options"]["traceback"]


@dramatiq.actor(actor_name="test.always_fails", queue_name="index", max_retries=2, min_backoff=10, max_backoff=20)
def always_fails() -> None:
    raise ValueError("this actor is broken")


def test_a_job_that_keeps_failing_is_rejected_with_its_traceback(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    message = always_fails.send()
    state, body = _final(database_url, message.message_id)
    assert state == "rejected"
    assert body["options"]["retries"] == 3
    (error,) = query(database_url, "SELECT error FROM dramatiq.queue WHERE message_id = %s", (message.message_id,))[0]
    assert "ValueError: this actor is broken" in error
    # the worker is still serving
    assert _final(database_url, noop.send("after-failures").message_id)[0] == "done"
