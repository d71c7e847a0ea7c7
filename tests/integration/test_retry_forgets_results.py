"""An operator's retry of a job whose result is kept forgets the failure stored for its
rejected run: a waiter gets the retried run's result, not the old failure at once."""

from __future__ import annotations

import dramatiq
import psycopg
import pytest

from broker import ops
from tests.support.db import scalar, wait_for
from tests.support.jobs import SECOND_RUNS, result_once_the_second_run_returns, second_run_returns


def test_a_retried_jobs_waiter_gets_the_retried_runs_result_not_the_old_failure(
        broker, database_url, start_worker):
    # Given a job whose result is kept, rejected with its failure stored
    start_worker(queues=["index"], threads=2)
    message = second_run_returns.send("retried-result", "fails")
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s::uuid",
                            (message.message_id,)) == "rejected", timeout_s=20, what="the first run's rejection")
    with pytest.raises(dramatiq.results.ResultFailure):
        message.get_result(block=True, timeout=10_000)
    # When an operator retries it, and the retried run is running
    with psycopg.connect(database_url, autocommit=True) as conn:
        assert ops.retry_jobs(conn, message_ids=[message.message_id], by="test") == 1
    wait_for(lambda: SECOND_RUNS.count("retried-result") == 2, timeout_s=20, what="the retried run to start")
    # Then no result is there while it runs (the old failure is gone), and a waiter gets
    # the retried run's result
    assert result_once_the_second_run_returns(message, "retried-result") == "the second run's"
