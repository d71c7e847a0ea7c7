"""An over-budget configuration refuses to start, naming every term and the limit; so
does a fleet the server cannot hold, with nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from broker.exits import CONFIG_REFUSED_EXIT
from tests.acceptance.test_run_supervisor import session_members, supervised
from tests.support.db import wait_for
from tests.support.procs import ROOT, dramatiq_cmd, supervised_pids

OVER_BUDGET = {"STANDMEET_QUEUE_WEBHOOK_MAX_WORKERS": "30"}
EXPECTED_TERMS = [
    "index.max_workers 4", "notify.max_workers 2", "webhook.max_workers 30",
    "maintenance.max_workers 1", "fetch.max_workers 3", "relay 1", "= 41", "STANDMEET_POOL_MAX_SIZE=40) = 20",
]


def _run(cmd: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "cmd",
    [
        [sys.executable, "-m", "broker.cli", "check"],
        dramatiq_cmd("--threads", "4"),
        [sys.executable, "-m", "periodic"],
    ],
    ids=["check", "worker", "scheduler"],
)
def test_an_over_budget_configuration_refuses_to_start(cmd, subprocess_env):
    result = _run(cmd, {**subprocess_env, **OVER_BUDGET})
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "connection budget is exceeded" in output
    for term in EXPECTED_TERMS:
        assert term in output


def test_a_worker_serving_one_queue_counts_only_that_queue(subprocess_env):
    # webhook at 30 is over budget for the whole system, but not for an index-only worker
    result = _run([sys.executable, "-m", "broker.cli", "check", "--queues", "index"], {**subprocess_env, **OVER_BUDGET})
    assert result.returncode == 0, result.stderr
    assert "index.max_workers 4 + relay 1 = 5" in result.stdout


def test_a_malformed_setting_is_named_at_start(subprocess_env):
    result = _run([sys.executable, "-m", "broker.cli", "check"], {**subprocess_env, "STANDMEET_POOL_MAX_SIZE": "forty"})
    assert result.returncode == 1
    assert "STANDMEET_POOL_MAX_SIZE='forty' is not a whole number" in result.stderr


def _run_session(cmd: list[str], env: dict[str, str], log: Path) -> tuple[int, str, list[int]]:
    """Run ``cmd`` to its end in a session of its own: its status, its output, and the
    processes of its session still alive after it (none may be)."""
    with supervised(cmd, env, log=log) as proc:
        code = proc.wait(timeout=120)
        members = session_members(proc.pid)
    return code, log.read_text(), members


def test_run_refuses_more_worker_processes_than_the_server_can_hold_and_starts_none(subprocess_env, tmp_path):
    code, text, members = _run_session([sys.executable, "-m", "broker.cli", "run", "--processes", "100000"],
                                       subprocess_env, tmp_path / "run.log")
    assert code == CONFIG_REFUSED_EXIT, text
    refusal = text.strip().splitlines()[-1]
    assert refusal.startswith("standmeet-jobs: refusing to start: 100000 worker processes × "), text
    for words in ("+ the scheduler ", "max_connections ", "superuser_reserved_connections ",
                  "STANDMEET_SERVER_CONNECTIONS_RESERVE 10", "held now by other clients", "Lower --processes ("):
        assert words in refusal, refusal
    assert "Traceback" not in text and supervised_pids(text) == [] and members == [], text


def test_run_refuses_when_the_reserve_leaves_no_room_for_one_worker(subprocess_env, tmp_path):
    env = {**subprocess_env, "STANDMEET_SERVER_CONNECTIONS_RESERVE": "100000"}
    code, text, members = _run_session([sys.executable, "-m", "broker.cli", "run", "--no-scheduler"], env,
                                       tmp_path / "run.log")
    assert code == CONFIG_REFUSED_EXIT, text
    refusal = text.strip().splitlines()[-1]
    assert "STANDMEET_SERVER_CONNECTIONS_RESERVE 100000" in refusal and "Not one worker process fits" in refusal, text
    assert supervised_pids(text) == [] and members == [], text


@pytest.mark.parametrize("processes, threads", [("0", "0"), ("1", "-1")])
def test_run_refuses_nonsensical_counts_in_one_line(subprocess_env, tmp_path, processes, threads):
    code, text, members = _run_session([sys.executable, "-m", "broker.cli", "run", "--processes", processes,
                                        "--threads", threads], subprocess_env, tmp_path / "run.log")
    assert code == CONFIG_REFUSED_EXIT, text
    assert text.strip().splitlines()[-1].startswith("standmeet-jobs: --"), text
    assert supervised_pids(text) == [] and members == [], text


def test_check_prints_every_connection_of_a_process_and_checks_a_fleet(subprocess_env):
    result = _run([sys.executable, "-m", "broker.cli", "check", "--queues", "index", "--processes", "1"],
                  subprocess_env)
    assert result.returncode == 0, result.stderr
    worker = "per process: a worker process holds at most "
    assert worker in result.stdout and "jobs 4 + relay 1 + consumers 1 + settler 1 + heartbeat 1 + broker sends 4" in result.stdout
    per_worker = int(result.stdout.split(worker)[1].split()[0])
    assert f"ok: 1 worker process × {per_worker} + the scheduler " in result.stdout, result.stdout
    refused = _run([sys.executable, "-m", "broker.cli", "check", "--processes", "100000"], subprocess_env)
    assert refused.returncode == 1 and "refusing to start: 100000 worker processes" in refused.stderr


def test_queues_declared_only_by_actors_are_counted_alike_by_check_run_and_the_worker(subprocess_env, tmp_path):
    # Given a module whose eight queues are named only by its actors' queue_name
    module = "tests.support.many_queues"
    checked = _run([sys.executable, "-m", "broker.cli", "check", module], subprocess_env)
    assert checked.returncode == 0, checked.stderr
    assert all(f"own-queue-{i}.max_workers 1" in checked.stdout for i in range(8)), checked.stdout
    one = _run([sys.executable, "-m", "broker.cli", "check", module, "--queues", "own-queue-3"], subprocess_env)
    assert one.returncode == 0 and "own-queue-3.max_workers 1 + relay 1 = 2" in one.stdout, one.stderr
    # When `run` starts a worker of it
    log = tmp_path / "run.log"
    with supervised([sys.executable, "-m", "broker.cli", "run", module, "--no-scheduler"], subprocess_env,
                    log=log):
        ready = wait_for(lambda: [line for line in log.read_text().splitlines() if "worker ready:" in line],
                         timeout_s=60, what="the worker to be ready")[0]
    # Then `run` counted the connections the worker says it holds: one budget
    per_worker = int(ready.split("holds at most ")[1].split()[0])
    assert "consumers 9" in ready, ready  # its eight queues and the runtime's maintenance queue
    assert f"connections: 1 worker process × {per_worker} = {per_worker} connections" in log.read_text()
