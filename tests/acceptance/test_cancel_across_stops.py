"""Cancel holds across stops: a running job cancelled with ``jobs cancel`` is never run
again, whether its worker stops gracefully (SIGTERM) or dies (SIGKILL, then rescue)."""

from __future__ import annotations

import os
import signal

import psycopg

from broker import ops
from tests.conftest import TEST_OVERRIDES
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP
from tests.support.procs import running, worker_cmd

WORKER = worker_cmd("--threads", "4", "--queues", "fetch", "--worker-shutdown-timeout", "1000")
#: As test_shutdown_and_crash: a dead worker's jobs are rescued within this bound.
RESCUE_BOUND_S = 3 * (TEST_OVERRIDES["rescue_after_s"] + TEST_OVERRIDES["heartbeat_s"])
LIVE_WORKERS = "SELECT count(*) FROM standmeet.worker_processes WHERE pid = ANY(%s) AND stopped_at IS NULL"


def _started(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s", (label,)))


def _finished(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s AND finished_at IS NOT NULL", (label,)))


def _cancel(url: str, message_ids: list[str]) -> None:
    with psycopg.connect(url) as conn:
        assert ops.cancel_jobs(conn, message_ids=message_ids, by="ops@host") == len(message_ids)


def _states(url: str, message_ids: list[str]) -> list[tuple[str, str | None]]:
    return query(url, "SELECT state::text, error FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
                      " ORDER BY message_id", (message_ids,))


def _a_later_job_runs(url: str, env: dict[str, str], log, label: str) -> None:
    """Another worker starts and finishes a job sent after the cancelled ones: it has
    claimed from that queue since, so a cancelled job it could claim would have started."""
    with running(WORKER, env, log=log):
        SLEEP["fetch"].send(10, label)
        wait_for(lambda: _finished(url, label) == 1, timeout_s=30, what="a later job to run")


def test_a_cancelled_running_job_is_not_run_again_after_a_graceful_stop(
        broker, database_url, subprocess_env, tmp_path):
    # Given a worker running a 60 s job, which an operator cancels (it never checks its deadline)
    job = SLEEP["fetch"].send(60_000, "cancel-graceful")
    with running(WORKER, subprocess_env, log=tmp_path / "first.log") as first:
        wait_for(lambda: _started(database_url, "cancel-graceful") == 1, timeout_s=30, what="the job to start")
        _cancel(database_url, [job.message_id])
        # When the worker is stopped gracefully (its 1 s shutdown timeout cuts the job off)
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=30) == 0, (tmp_path / "first.log").read_text()
    # Then the job is settled as cancelled, not requeued
    [(state, error)] = _states(database_url, [job.message_id])
    assert state == "rejected", (state, error)
    assert error.startswith("cancelled by ops@host at ") and "its worker stopped while holding it" in error
    # and a new worker does not run it again
    _a_later_job_runs(database_url, subprocess_env, tmp_path / "second.log", "after-graceful")
    assert _started(database_url, "cancel-graceful") == 1


def test_cancelled_running_jobs_of_a_sigkilled_worker_are_not_run_again_after_rescue(
        broker, database_url, subprocess_env, tmp_path):
    # Given a worker running two 60 s jobs, both cancelled by an operator, and a second worker
    jobs = [SLEEP["fetch"].send(60_000, "cancel-killed") for _ in range(2)]
    ids = [j.message_id for j in jobs]
    with running(WORKER, subprocess_env, log=tmp_path / "a.log") as a:
        wait_for(lambda: _started(database_url, "cancel-killed") == 2, timeout_s=30, what="both jobs to start")
        _cancel(database_url, ids)
        with running(WORKER, subprocess_env, log=tmp_path / "b.log") as b:
            wait_for(lambda: scalar(database_url, LIVE_WORKERS, ([a.pid, b.pid],)) == 2,
                     timeout_s=20, what="both workers registered")
            # When the first is SIGKILLed
            os.kill(a.pid, signal.SIGKILL)
            # Then the rescue settles both as cancelled, not requeued
            wait_for(lambda: all(s == "rejected" for s, _ in _states(database_url, ids)), timeout_s=RESCUE_BOUND_S,
                     what="the rescue to settle the cancelled jobs")
            # and the surviving worker, still claiming, never runs them again
            SLEEP["fetch"].send(10, "after-kill")
            wait_for(lambda: _finished(database_url, "after-kill") == 1, timeout_s=30, what="a later job to run")
    assert all(e.startswith("cancelled by ops@host at ") and "died holding it" in e
               for _, e in _states(database_url, ids))
    assert _started(database_url, "cancel-killed") == 2
