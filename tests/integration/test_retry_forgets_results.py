"""An operator's retry of a job whose result is kept forgets the failure stored for its
rejected run: a waiter gets the retried run's result, not the old failure at once."""

from __future__ import annotations

import threading

import dramatiq
import psycopg
import pytest
from dramatiq.results import ResultMissing

from broker import ops
from tests.support.db import scalar, wait_for

#: Runs of ``test.fails_then_waits`` by key; the cue its second run of a key ends on.
RUNS: list[str] = []
SECOND_RUN_ENDS = threading.Event()


@dramatiq.actor(actor_name="test.fails_then_waits", queue_name="index", max_retries=0, store_results=True)
def fails_then_waits(key: str) -> str:
    """Its result is kept. The first run of ``key`` fails; the second ends on the cue."""
    RUNS.append(key)
    if RUNS.count(key) == 1:
        raise RuntimeError(f"the first run of {key} failed")
    SECOND_RUN_ENDS.wait(30)
    return "the retried run's"


def test_a_retried_jobs_waiter_gets_the_retried_runs_result_not_the_old_failure(
        broker, database_url, start_worker):
    # Given a job whose result is kept, rejected with its failure stored
    start_worker(queues=["index"], threads=2)
    message = fails_then_waits.send("retried-result")
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s::uuid",
                            (message.message_id,)) == "rejected", timeout_s=20, what="the first run's rejection")
    with pytest.raises(dramatiq.results.ResultFailure):
        message.get_result(block=True, timeout=10_000)
    # When an operator retries it, and the retried run is running
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert ops.retry_jobs(conn, message_ids=[message.message_id], by="test") == 1
    wait_for(lambda: RUNS.count("retried-result") == 2, timeout_s=20, what="the retried run to start")
    # Then no result is there while it runs (the old failure is gone)
    try:
        with pytest.raises(ResultMissing):
            message.get_result(block=False)
    finally:
        SECOND_RUN_ENDS.set()
    # And a waiter gets the retried run's result
    assert message.get_result(block=True, timeout=20_000) == "the retried run's"
