"""The drain benchmarks run end to end at tiny sizes (untimed: no speed is asserted)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.procs import ROOT

pytestmark = pytest.mark.slow


def run_bench(script: str, admin_url: str, *args: str) -> str:
    env = {**os.environ, "DATABASE_URL": admin_url}
    done = subprocess.run([sys.executable, f"bench/{script}", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_cost_curve_drains_a_tiny_backlog_and_prints_its_figures(admin_url):
    out = run_bench("cost_curve.py", admin_url, "--n", "200")
    assert "size 200: median" in out
    assert "ms/job" in out and "dead tuples" in out
    assert "ratio rate(200) / rate(200): 1.00" in out


def test_the_scale_script_drains_with_one_and_two_processes_within_their_limits(admin_url):
    out = run_bench("scale.py", admin_url, "--n", "200", "--processes", "1,2")
    assert "1 process(es): median" in out and "2 process(es): median" in out
    assert "EXCEEDED" not in out
    assert "ratio rate(2) / rate(1):" in out


def test_the_webhook_benchmark_delivers_to_its_endpoint_process_twice_and_prints_its_figures(admin_url, monkeypatch):
    monkeypatch.setenv("BENCH_VERBOSE", "1")
    out = run_bench("webhooks.py", admin_url, "--deliveries-only", "--events", "2", "--runs", "2")
    # both runs delivered every one of their 40 (the second from an empty queue), and the
    # CPU of the worker, the server's processes and the endpoint process is printed
    assert out.count("deliveries: 40 to 20 fast endpoints (in their own process) at") == 2, out
    assert "median deliveries/s:" in out and "database transactions per delivery" in out
    assert "Postgres backends" in out and "the endpoint process" in out
