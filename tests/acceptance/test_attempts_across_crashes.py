"""Attempts across crashes and stops: a SIGKILL shows as a crashed attempt, a graceful
stop's give-back as cut at shutdown, each followed by the run that finished the job."""

from __future__ import annotations

import os
import signal

import psycopg

from broker.ops import history
from tests.conftest import TEST_OVERRIDES
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP
from tests.support.procs import running, worker_cmd

WORKER = worker_cmd("--threads", "8", "--queues", "index", "fetch")
RESCUE_BOUND_S = 3 * (TEST_OVERRIDES["rescue_after_s"] + TEST_OVERRIDES["heartbeat_s"])
WORKER_OF = "SELECT id::text FROM standmeet.worker_processes WHERE pid = %s"
STARTED = "SELECT count(*) FROM test_runs WHERE label = %s"
STATE = "SELECT state::text FROM dramatiq.queue WHERE message_id = %s"
RUNNER_OF = "SELECT worker_id::text FROM dramatiq.queue WHERE message_id = %s"
HISTORY_OF = ("SELECT coalesce(sum(done), 0)::int, coalesce(sum(crashed), 0)::int, coalesce(sum(given_back), 0)::int"
              " FROM standmeet.queue_history WHERE actor_name = %s")


def _attempts(url: str, message_id: str) -> list[history.Attempt]:
    with psycopg.connect(url, autocommit=True) as conn:
        return history.attempts(conn, message_id)


def test_a_sigkilled_workers_job_shows_a_crashed_attempt_then_the_one_that_finished_it(
    broker, database_url, subprocess_env, tmp_path
):
    # Given two workers, both up before the job is sent (so that the job outlasts neither
    # start-up on a loaded machine), and the job running on one of them
    with running(WORKER, subprocess_env, log=tmp_path / "a.log") as a, \
            running(WORKER, subprocess_env, log=tmp_path / "b.log") as b:
        ids = {proc.pid: wait_for(lambda p=proc: scalar(database_url, WORKER_OF, (p.pid,)), timeout_s=20,
                                  what=f"worker {proc.pid} to register") for proc in (a, b)}
        job = SLEEP["fetch"].send(3_000, "crash-victim")
        wait_for(lambda: scalar(database_url, STARTED, ("crash-victim",)) == 1, timeout_s=20, what="the job to start")
        runner_id = scalar(database_url, RUNNER_OF, (job.message_id,))
        victim, other = (a, b) if ids[a.pid] == runner_id else (b, a)
        # When the worker running it is SIGKILLed mid-job, and the other rescues and runs it
        os.kill(victim.pid, signal.SIGKILL)
        wait_for(lambda: query(database_url, STATE, (job.message_id,)) == [("done",)],
                 timeout_s=RESCUE_BOUND_S + 15, what="the job to be done on the other worker")
    # Then its attempts are the killed worker's crashed run and the other's finished one
    attempts = _attempts(database_url, job.message_id)
    assert [(a.outcome, a.worker_id) for a in attempts] == [("crashed", ids[victim.pid]), ("done", ids[other.pid])]
    assert attempts[0].started_at is not None and "died" in (attempts[0].error or "")
    assert attempts[0].attempt < attempts[1].attempt
    # and the history counts one crash and one run done
    assert query(database_url, HISTORY_OF, ("test.sleep.fetch",)) == [(1, 1, 0)]


def test_a_job_cut_at_a_graceful_shutdown_shows_as_cut_at_shutdown_then_runs_again(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a worker with a 1 s shutdown timeout running a 4 s job
    job = SLEEP["index"].send(4_000, "cut-victim")
    cmd = worker_cmd("--threads", "8", "--queues", "index", "--worker-shutdown-timeout", "1000")
    with running(cmd, subprocess_env, log=tmp_path / "first.log") as first:
        wait_for(lambda: scalar(database_url, STARTED, ("cut-victim",)) == 1, timeout_s=20, what="the job to start")
        first_id = scalar(database_url, WORKER_OF, (first.pid,))
        # When it gets SIGTERM
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0
    # Then the run it cut is an attempt cut at shutdown, by that worker, and the job waits again
    attempts = _attempts(database_url, job.message_id)
    assert [(a.outcome, a.worker_id) for a in attempts] == [("cut_at_shutdown", first_id)]
    assert query(database_url, STATE, (job.message_id,)) == [("queued",)]
    # And once another worker finishes it, the finished run follows
    with running(cmd, subprocess_env, log=tmp_path / "second.log"):
        wait_for(lambda: query(database_url, STATE, (job.message_id,)) == [("done",)], timeout_s=30,
                 what="the job to be done")
    assert [a.outcome for a in _attempts(database_url, job.message_id)] == ["cut_at_shutdown", "done"]
    assert query(database_url, HISTORY_OF, ("test.sleep.index",)) == [(1, 0, 1)]
