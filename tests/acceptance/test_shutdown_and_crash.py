"""Graceful shutdown and crash rescue: SIGTERM finishes what it can; a dead worker's jobs run again."""

from __future__ import annotations

import os
import random
import signal
import time

from tests.conftest import TEST_OVERRIDES
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP, mark
from tests.support.procs import running, worker_cmd

WORKER = worker_cmd("--threads", "8", "--queues", "index", "fetch")
#: A dead worker's jobs are rescued once its last heartbeat is a rescue window old, at a
#: survivor's next heartbeat. Three times that is the bound: room for a loaded machine.
RESCUE_AFTER_S = TEST_OVERRIDES["rescue_after_s"]
RESCUE_BOUND_S = 3 * (RESCUE_AFTER_S + TEST_OVERRIDES["heartbeat_s"])
#: The shutdown timeout of the SIGTERM test, and the exit it allows (twice the timeout:
#: still far from the 60 s job it cuts off).
SHUTDOWN_S = 5
EXIT_BOUND_S = 2 * SHUTDOWN_S
LIVE_WORKERS = "SELECT count(*) FROM standmeet.worker_processes WHERE pid = ANY(%s) AND stopped_at IS NULL"
#: The second start of a job, measured from its worker's last heartbeat, by the database's clock.
RESTART_AFTER_HEARTBEAT = """
SELECT EXTRACT(EPOCH FROM max(r.started_at) - w.heartbeat_at)::float8
FROM test_runs r, standmeet.worker_processes w
WHERE r.label = %s AND w.pid = %s
GROUP BY w.heartbeat_at
"""


def _started(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s", (label,)))


def _finished(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s AND finished_at IS NOT NULL", (label,)))


def test_sigterm_finishes_short_jobs_returns_the_rest_and_the_long_one_runs_again(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a worker running two 3 s jobs and one 60 s job on the fetch queue (limit 3),
    # with three more jobs waiting behind them
    long_job = SLEEP["fetch"].send(60_000, "long")
    for _ in range(2):
        SLEEP["fetch"].send(3_000, "short")
    waiting = [SLEEP["fetch"].send(3_000, "waiting") for _ in range(3)]
    cmd = worker_cmd("--threads", "8", "--queues", "fetch", "--worker-shutdown-timeout", str(SHUTDOWN_S * 1000))
    with running(cmd, subprocess_env, log=tmp_path / "first.log") as first:
        wait_for(lambda: _started(database_url, "short") == 2 and _started(database_url, "long") == 1,
                 timeout_s=30, what="the three jobs to start")
        # When it gets SIGTERM
        sent = time.monotonic()
        first.send_signal(signal.SIGTERM)
        code = first.wait(timeout=30)
        took = time.monotonic() - sent
    log = (tmp_path / "first.log").read_text()
    # Then it exits soon after the shutdown timeout (not after the 60 s job), and the 3 s jobs completed
    assert took < EXIT_BOUND_S, (took, log)
    assert code == 0, log
    assert _finished(database_url, "short") == 2
    assert _started(database_url, "waiting") == 0
    # The waiting (and any prefetched) jobs are back in the queue, not held by the dead process
    states = query(database_url, "SELECT state::text, worker_id FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                   ([m.message_id for m in waiting],))
    assert states == [("queued", None)] * 3
    # The long job was cut off at the shutdown timeout: back in its queue, without blame
    # (a deploy is not a crash), and the worker is recorded as stopped
    assert query(database_url, "SELECT state::text, worker_id, crashes, suspect_of FROM dramatiq.queue"
                               " WHERE message_id = %s", (long_job.message_id,)) == [("queued", None, 0, None)]
    assert scalar(database_url, LIVE_WORKERS, ([first.pid],)) == 0
    # And a new worker runs it again (at least once)
    with running(cmd, subprocess_env, log=tmp_path / "second.log"):
        wait_for(lambda: _started(database_url, "long") == 2, timeout_s=20, what="the long job to start again")
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (long_job.message_id,))


def test_a_sigkilled_workers_job_is_run_by_the_other_worker_within_the_rescue_window(
    broker, database_url, subprocess_env, tmp_path
):
    # Given two worker processes, and a job that one of them is running
    with running(WORKER, subprocess_env, log=tmp_path / "a.log") as a:
        job = SLEEP["fetch"].send(4_000, "victim")
        wait_for(lambda: _started(database_url, "victim") == 1, timeout_s=20, what="the job to start on A")
        with running(WORKER, subprocess_env, log=tmp_path / "b.log") as b:
            wait_for(lambda: scalar(database_url, LIVE_WORKERS, ([a.pid, b.pid],)) == 2,
                     timeout_s=20, what="both workers registered")
            # When A's worker process is SIGKILLed mid-job
            os.kill(a.pid, signal.SIGKILL)
            # Then B runs the job again, soon after the rescue window (3 s here; 20 s by default)
            wait_for(lambda: _started(database_url, "victim") == 2, timeout_s=RESCUE_BOUND_S,
                     what="B to run the job again")
            # and never before A's last heartbeat was a whole rescue window old
            assert scalar(database_url, RESTART_AFTER_HEARTBEAT, ("victim", a.pid)) >= RESCUE_AFTER_S
            wait_for(lambda: query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                                   (job.message_id,)) == [("done",)], timeout_s=15, what="the job to be done")


def test_a_worker_started_with_a_shorter_rescue_window_never_takes_a_live_slower_workers_job(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a worker started with a heartbeat every 4 s and rescue after 12 s (a newer
    # release's settings in a rolling deploy), running an 8 s job
    slow_env = {**subprocess_env, "STANDMEET_HEARTBEAT_S": "4", "STANDMEET_RESCUE_AFTER_S": "12"}
    fetch_only = worker_cmd("--threads", "8", "--queues", "fetch")
    with running(fetch_only, slow_env, log=tmp_path / "slow.log") as slow:
        job = SLEEP["fetch"].send(8_000, "slow-beater")
        wait_for(lambda: _started(database_url, "slow-beater") == 1, timeout_s=20, what="the job to start")
        # and beside it a worker of the same queue started with the suite's window (3 s,
        # a heartbeat and a rescue pass every 0.5 s), to which the first is silent
        # between its beats for longer than that window
        with running(fetch_only, subprocess_env, log=tmp_path / "quick.log") as quick:
            wait_for(lambda: scalar(database_url, LIVE_WORKERS, ([slow.pid, quick.pid],)) == 2,
                     timeout_s=20, what="both workers registered")
            # When the job ends
            wait_for(lambda: query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                                   (job.message_id,)) == [("done",)], timeout_s=30, what="the job to be done")
    # Then it ran once, on the worker that held it: the other judged it by its own, longer window
    assert _started(database_url, "slow-beater") == 1, (tmp_path / "quick.log").read_text()
    # and was never counted as a crash (the log may name rescues of earlier tests' leftovers)
    assert query(database_url, "SELECT crashes, suspect_of FROM dramatiq.queue WHERE message_id = %s",
                 (job.message_id,)) == [(0, None)]


def test_chaos_every_job_completes_through_five_sigkills(broker, database_url, subprocess_env, tmp_path):
    # Given 300 jobs and one worker that is SIGKILLed and restarted 5 times at random moments
    rng = random.Random(1234)
    env = {**subprocess_env, "STANDMEET_MAX_CRASHES": "20"}
    messages = [SLEEP["index"].send(40, "chaos") for _ in range(300)]
    for round_ in range(6):
        with running(WORKER, env, log=tmp_path / f"w{round_}.log") as worker:
            if round_ == 5:
                wait_for(lambda: _finished(database_url, "chaos") >= 300 and scalar(
                    database_url, "SELECT count(*) FROM dramatiq.queue WHERE state <> 'done' AND message_id = ANY(%s::uuid[])",
                    ([m.message_id for m in messages],)) == 0, timeout_s=120, what="all 300 jobs done")
                break
            wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.worker_processes WHERE pid = %s",
                                    (worker.pid,)), timeout_s=20, what="the worker to register")
            time.sleep(rng.uniform(0.3, 1.5))  # a random moment of the drain: the chaos itself
            os.kill(worker.pid, signal.SIGKILL)
    # Then every job completed at least once
    done = scalar(database_url, "SELECT count(DISTINCT message_id) FROM test_runs WHERE label = 'chaos' AND finished_at IS NOT NULL")
    assert done == 300
    duplicates = scalar(database_url, "SELECT count(*) - count(DISTINCT message_id) FROM test_runs WHERE label = 'chaos'")
    print(f"chaos: 300 jobs, 5 SIGKILLs, {duplicates} duplicate run(s)")


def test_a_backlog_drained_by_two_processes_runs_each_message_once_with_few_locks(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a 20,000-message backlog
    total = 20_000
    import psycopg

    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    with psycopg.connect(database_url) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([mark.message("backlog") for _ in range(total)]))
    dbname = scalar(database_url, "SELECT current_database()")
    max_locks = max_by_one = 0
    # When two worker processes drain it
    with running(WORKER, subprocess_env, log=tmp_path / "a.log"), running(WORKER, subprocess_env, log=tmp_path / "b.log"):
        deadline = time.monotonic() + 240
        while scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'backlog'") < total:
            held = [n for (n,) in query(
                database_url,
                "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE a.datname = %s"
                " AND a.application_name LIKE 'standmeet%%' GROUP BY l.pid",
                (dbname,),
            )]
            max_locks, max_by_one = max(max_locks, sum(held)), max([max_by_one, *held])
            assert time.monotonic() < deadline, "the backlog was not drained in time"
            time.sleep(0.05)
    # Then every message ran exactly once, and the locks held stayed small: no lock per
    # message (a claim takes up to 128), only the relations a statement touches
    assert scalar(database_url, "SELECT count(DISTINCT message_id) FROM test_runs WHERE label = 'backlog'") == total
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'backlog'") == total
    assert max_by_one < 40, max_by_one
    assert max_locks < 200, max_locks
    print(f"backlog: {total} messages, at most {max_locks} locks held at once, {max_by_one} by one connection")
