"""Dramatiq's composition and results across worker processes, with no Redis.

"Composition" (group completion callbacks need a rate-limiter backend shared by every
worker) and "Results" (a result stored by one process is read by another).
"""

from __future__ import annotations

import dramatiq
import pytest

from tests.support.contract_jobs import add, group_done, limited, work
from tests.support.db import query, scalar, wait_for
from tests.support.procs import running, worker_cmd

pytestmark = pytest.mark.slow

WORKER = worker_cmd("--queues", "index", module="tests.support.contract_jobs")
#: Worker processes among some pids that registered as consuming the index queue (each
#: does so before its first claim): a process still starting could let the other run
#: every member.
CONSUMING = """
SELECT count(*) FROM standmeet.worker_processes
WHERE pid = ANY(%s) AND stopped_at IS NULL AND 'index' = ANY(queues)
"""


def test_a_groups_callback_runs_once_after_members_that_ran_in_two_processes(
    broker, database_url, subprocess_env, tmp_path
):
    # Given two worker processes, both consuming the index queue
    with running(WORKER, subprocess_env, log=tmp_path / "a.log") as a, \
            running(WORKER, subprocess_env, log=tmp_path / "b.log") as b:
        wait_for(lambda: scalar(database_url, CONSUMING, ([a.pid, b.pid],)) == 2, timeout_s=30,
                 what="both workers registered as consuming the index queue")
        # When a group of 20 members with a completion callback runs on them
        group = dramatiq.group([work.message(f"xgroup-{i}", 100) for i in range(20)])
        group.add_completion_callback(group_done.message("xgroup-finished"))
        group.run()
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'xgroup-finished'"),
                 timeout_s=30, what="the completion callback")
        # And a result stored by a worker is read here, woken by its notification
        assert add.send(20, 22).get_result(block=True, timeout=10_000) == 42
    # Then the members ran in both processes, the callback once, after every member
    pids = {row[0] for row in query(database_url, "SELECT pid FROM test_runs WHERE label LIKE 'xgroup-%%'"
                                                  " AND label <> 'xgroup-finished'")}
    assert len(pids) == 2
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'xgroup-finished'") == 1
    assert scalar(database_url, "SELECT max(finished_at) FROM test_runs WHERE label LIKE 'xgroup-%%'"
                                " AND label <> 'xgroup-finished'") <= scalar(
        database_url, "SELECT started_at FROM test_runs WHERE label = 'xgroup-finished'")


def test_a_concurrent_rate_limiter_holds_across_two_worker_processes(broker, database_url, subprocess_env, tmp_path):
    # Given two worker processes and ten jobs that each hold a mutex of limit 1
    with running(WORKER, subprocess_env, log=tmp_path / "a.log"), running(WORKER, subprocess_env, log=tmp_path / "b.log"):
        for i in range(10):
            limited.send(f"mutex-{i}", 100)
        # When they have all run (a refused one is retried)
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE actor = 'contract.limited'"
                                              " AND finished_at IS NOT NULL") == 10,
                 timeout_s=60, what="the ten limited jobs")
    # Then no two ever overlapped, as the jobs themselves recorded it
    runs = query(database_url, "SELECT started_at, finished_at FROM test_runs WHERE actor = 'contract.limited'"
                               " ORDER BY started_at")
    for (_, previous_end), (next_start, _) in zip(runs, runs[1:], strict=False):
        assert next_start >= previous_end
