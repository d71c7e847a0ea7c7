"""What a worker process does once at boot, seen from a job it runs."""

from __future__ import annotations

import subprocess
import sys

import psycopg
import pytest

from tests.support.contract_jobs import gc_report
from tests.support.db import scalar, wait_for
from tests.support.procs import ROOT, running, worker_cmd

pytestmark = pytest.mark.slow

WORKER = worker_cmd("--queues", "index", module="tests.support.contract_jobs")


def test_a_worker_freezes_what_it_loaded_at_boot_so_full_collections_skip_it(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a worker process
    with running(WORKER, subprocess_env, log=tmp_path / "worker.log"):
        # When a job reports what the collector of its process no longer scans
        gc_report.send("frozen")
        label = wait_for(lambda: scalar(database_url, "SELECT label FROM test_runs WHERE actor = 'contract.gc_report'"),
                         timeout_s=30, what="the report")
    # Then the modules, actors and broker loaded at boot are frozen (tens of thousands of objects)
    assert int(label.split(":")[1]) > 10_000, label


@pytest.mark.parametrize("entry", [["-m", "broker.worker"], ["-m", "periodic"]], ids=["worker", "scheduler"])
def test_a_child_whose_supervisor_is_already_gone_does_not_start(subprocess_env, entry):
    # Given a child told it is supervised by a process that is not (or no longer) its parent,
    # as when `run` dies between starting it and the child's request to die with it
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # When it starts
    result = subprocess.run([sys.executable, *entry, "--supervised-by", str(gone.pid)], env=subprocess_env,
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    # Then it exits at once, saying why, and serves nothing
    assert result.returncode == 1, result.stderr
    assert f"its supervisor (pid {gone.pid}) is gone: not starting" in result.stderr
    assert "ready" not in result.stderr and "running" not in result.stderr


SELF_CONFIGURING = '''
import dramatiq
import psycopg

import broker

broker.configure()  # as a module written for Dramatiq's own CLI does (`dramatiq thismodule`)


@dramatiq.actor(queue_name="selfconf", actor_name="selfconf.mark")
def mark(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("INSERT INTO selfconf_marks VALUES (1)")
'''


def test_a_worker_serves_a_module_that_configures_the_broker_itself_at_import(
    database_url, subprocess_env, tmp_path
):
    # Given a module that calls broker.configure() at its import, on a queue only it declares
    (tmp_path / "selfconf_jobs.py").write_text(SELF_CONFIGURING)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS selfconf_marks (n int)")
    env = {**subprocess_env, "PYTHONPATH": f"{tmp_path}:{subprocess_env.get('PYTHONPATH') or ROOT}"}
    cmd = [sys.executable, "-m", "broker.worker", "selfconf_jobs", "--queues", "selfconf", "--threads", "1"]
    # When a worker process boots with it (the boot configures first, then the module again)
    with running(cmd, env, log=tmp_path / "worker.log"):
        subprocess.run([sys.executable, "-c", "import selfconf_jobs, sys; selfconf_jobs.mark.send(sys.argv[1])",
                        database_url], env=env, cwd=ROOT, check=True, timeout=60)
        # Then the worker serves the queue of the broker in force, and runs the job
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM selfconf_marks") == 1, timeout_s=30,
                 what="the job of a self-configuring module")
