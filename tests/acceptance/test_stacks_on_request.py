"""`kill -USR1 <pid>` asks a worker, the scheduler, the relay or `run` where each of its
threads is: every thread's stack is written to its log stream, and the process goes on
(it still serves, and stops cleanly afterwards)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from broker.observability.stacks import STACKS_SIGNAL
from tests.support.db import scalar, wait_for
from tests.support.jobs import SLEEP, noop
from tests.support.procs import STACK_HEAD, running, worker_cmd


def _says(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text()


def _ran(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s AND finished_at IS NOT NULL",
                      (label,)))


def _started(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s", (label,)))


def test_a_worker_asked_for_its_stacks_shows_the_running_job_and_goes_on_serving(
        broker, database_url, subprocess_env, tmp_path):
    # Given a worker running a one-minute job
    label = "stacks-on-request"
    SLEEP["fetch"].send(60_000, label)
    log = tmp_path / "worker.log"
    cmd = worker_cmd("--threads", "2", "--queues", "fetch", "index", "--worker-shutdown-timeout", "500")
    with running(cmd, subprocess_env, log=log) as worker:
        wait_for(lambda: _started(database_url, label) == 1, timeout_s=30, what="the long job to start")
        # When it is asked for its stacks
        worker.send_signal(STACKS_SIGNAL)
        # Then every thread's stack is written, the running job's among them, down to its line
        wait_for(lambda: _says(log, STACK_HEAD), timeout_s=30, what="the stacks written")
        wait_for(lambda: _says(log, "in sleep"), timeout_s=30, what="the running job's frame written")
        text = log.read_text()
        assert text.count(STACK_HEAD) >= 3, text  # the main thread, the job's, the consumers'...
        assert "tests/support/jobs.py" in text, text
        # And the worker goes on: another job runs
        noop.send(label + "-after")
        wait_for(lambda: _ran(database_url, label + "-after") == 1, timeout_s=30, what="a job run after the dump")
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=60)
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text()
    broker.flush("fetch")


@pytest.mark.parametrize("name, cmd, ready", [
    ("scheduler", [sys.executable, "-m", "periodic"], "scheduler running"),
    ("relay", [sys.executable, "-m", "broker.relay"], "relay"),
    ("run", [sys.executable, "-m", "broker.cli", "run", "tests.support.jobs", "--queues", "fetch", "--no-scheduler"],
     "worker ready"),
])
def test_the_other_processes_asked_for_their_stacks_write_them_and_stop_cleanly_afterwards(
        name, cmd, ready, database_url, subprocess_env, tmp_path):
    log = tmp_path / f"{name}.log"
    with running(cmd, subprocess_env, log=log) as proc:
        wait_for(lambda: _says(log, ready), timeout_s=60, what=f"the {name} to start")
        # When it is asked for its stacks
        proc.send_signal(STACKS_SIGNAL)
        # Then they are written, and it is still running
        wait_for(lambda: _says(log, STACK_HEAD), timeout_s=30, what=f"the {name}'s stacks written")
        assert proc.poll() is None, log.read_text()
        # And it still stops cleanly
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    assert code == 0, log.read_text()
    assert "Traceback" not in log.read_text()
