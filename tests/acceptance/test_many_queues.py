"""Any number of queues: an application's own queues are served, each with its own limits."""

from __future__ import annotations

import subprocess
import sys

import dramatiq
import pytest

from tests.support.db import query, scalar, wait_for
from tests.support.procs import ROOT, running, worker_cmd

pytestmark = pytest.mark.slow

COUNT_BROKER_CONNECTIONS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name LIKE 'standmeet-%%'
  AND application_name NOT IN ('standmeet-app', 'standmeet-relay')
"""


def test_a_module_with_eight_queues_of_its_own_runs_every_message(broker, database_url, subprocess_env, tmp_path):
    # Given a module that declares eight queues of its own, and messages on each (sent
    # as another process would, without importing that module here)
    queues = [f"own-queue-{i}" for i in range(8)]
    for queue in queues:
        broker.declare_queue(queue)
        for i in range(5):
            broker.enqueue(dramatiq.Message(queue_name=queue, actor_name=f"own.record.{queue}",
                                            args=(f"{queue}-{i}",), kwargs={}, options={}))
    # When one worker process serves that module
    with running(worker_cmd(module="tests.support.many_queues"), subprocess_env, log=tmp_path / "w.log") as worker:
        # Then every message runs, on its own queue
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE actor = 'own'") == 40,
                 timeout_s=30, what="all 40 messages to run")
        per_queue = dict(query(database_url, "SELECT queue, count(*) FROM test_runs WHERE actor = 'own' GROUP BY queue"))
        assert per_queue == {queue: 5 for queue in queues}
        # And the process records the queues it really serves: its own, and the runtime's
        # maintenance queue (every broker runs the runtime's own jobs)
        served = scalar(database_url, "SELECT queues FROM standmeet.worker_processes WHERE pid = %s", (worker.pid,))
        assert sorted(served) == sorted([*queues, "maintenance"])
        # And its broker holds one connection per consumer, the settler's and a small pool
        assert scalar(database_url, COUNT_BROKER_CONNECTIONS) <= 9 + 1 + broker.settings.broker_ack_connections
        # And a send from another process never waits on the consumers' connections
        sent = subprocess.run(
            [sys.executable, "-c", "from tests.support.many_queues import ACTORS; "
             "ACTORS['own-queue-7'].send('late'); print('sent')"],
            env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=30,
        )
        assert sent.stdout.strip() == "sent", sent.stderr
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'late'") == 1,
                 timeout_s=10, what="the late message to run")


def test_an_unknown_queue_is_refused_by_the_worker_with_the_known_ones(subprocess_env, tmp_path):
    result = subprocess.run(worker_cmd("--queues", "indx"), env=subprocess_env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "unknown queue(s) indx" in result.stderr
    assert "index" in result.stderr and "Traceback" not in result.stderr


def test_an_unknown_queue_is_refused_by_dramatiqs_own_cli(subprocess_env, tmp_path):
    from tests.support.procs import dramatiq_cmd

    result = subprocess.run(dramatiq_cmd("--queues", "indx", "--threads", "1", module="tests.support.jobs"),
                            env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "unknown queue(s) indx" in result.stdout + result.stderr

