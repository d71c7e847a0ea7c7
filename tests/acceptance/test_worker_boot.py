"""What a worker process does once at boot, seen from a job it runs."""

from __future__ import annotations

import pytest

from tests.support.contract_jobs import gc_report
from tests.support.db import scalar, wait_for
from tests.support.procs import running, worker_cmd

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
