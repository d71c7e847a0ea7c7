"""An over-budget configuration refuses to start, naming every term and the limit."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.procs import ROOT, dramatiq_cmd

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
