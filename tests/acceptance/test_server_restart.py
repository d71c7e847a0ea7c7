"""A Postgres restart (an upgrade, a configuration change) under a running worker,
scheduler and dashboard: it costs one line each way, nothing else.

The server is one of this module's own (``own_server``: never the suite's, never one a
developer runs), restarted with ``pg_ctl restart -m fast`` (every connection is cut, the
server is back within a second or two). Jobs flow through the restart on a queue whose actor needs no database
(so that no job can fail merely because it ran while the server was away); the jobs
sent after the restart do use the database, through the application pool whose
connections all died with the old server. After the restart: no failed job, no ERROR
line and no traceback in any log, every dashboard page answers 200 at the first try,
and each process says once that the database went away and once that it is back.

The scheduler of this module ticks a periodic job every second (``SCHEDULER_JOBS``,
beside the runtime's own), so that it enqueues through its pool right after the restart.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import psycopg
import pytest

from broker import app
from broker.engine import sql_enqueue
from broker.engine.codec import enqueue_params
from periodic import PeriodicJob
from tests.support import db as testdb
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import noop
from tests.support.pgbouncer import free_port
from tests.support.procs import running

pytestmark = pytest.mark.slow

#: When a server started: the suite's own server must not change while this test runs.
STARTED = "SELECT pg_postmaster_start_time()"

#: The scheduler's table here: the runtime's periodic jobs, and one every second whose
#: job needs no database (contract.slow on the fetch queue).
SCHEDULER_JOBS = [*app.periodic_jobs(), PeriodicJob("restart-tick", "contract.slow", interval_s=1.0,
                                                    kwargs={"ms": 1})]

FLOWING = 600
FLOW_MS = 40
BEFORE = 20
AFTER = 40
PAGES = ("/", "/jobs", "/jobs?state=done", "/workers", "/periodic", "/webhooks", "/healthz", "/metrics")
STATES = "SELECT state::text, count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) GROUP BY 1"
#: Every message that failed at least once, is rejected, or carries an error.
FAILED = """
SELECT message_id::text, state::text, error, message->'options'->>'traceback'
FROM dramatiq.queue
WHERE state = 'rejected' OR error IS NOT NULL OR message->'options' ? 'traceback'
"""
ERROR_LINE = re.compile(r"\] (ERROR|CRITICAL) ")
UNREACHABLE = "database unreachable"
REACHABLE_AGAIN = "reachable again"


@pytest.fixture(scope="module")
def direct_database_url(own_server):
    """This module's database, on the server it restarts."""
    return testdb.create_template(own_server.url(), testdb.unique_name("smt_restart"))


def restart(server) -> float:
    """``pg_ctl restart -m fast``; seconds until it accepts connections again."""
    began = time.monotonic()
    server.restart("fast")
    return time.monotonic() - began


def enqueue(url: str, messages: list) -> list[str]:  # type: ignore[type-arg]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(messages))
    return [m.message_id for m in messages]


def done_count(url: str, ids: list[str]) -> int:
    return int(dict(query(url, STATES, (ids,))).get("done", 0))


def finished(url: str, ids: list[str]) -> bool:
    """Every one of ``ids`` done or rejected (which one is asserted after)."""
    counts = dict(query(url, STATES, (ids,)))
    return counts.get("done", 0) + counts.get("rejected", 0) == len(ids)


def stop(proc: subprocess.Popen[bytes], log: Path, *, codes: tuple[int, ...] = (0,)) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.args} did not stop within 30 s: {log.read_text()[-3000:]}") from None
    assert code in codes, f"{proc.args} exited with {code}: {log.read_text()[-3000:]}"


def test_a_server_restart_under_a_worker_scheduler_and_dashboard_costs_one_line_each_way_and_nothing_else(
    broker, database_url, subprocess_env, own_server, admin_url, tmp_path
):
    suite_server_started = scalar(admin_url, STARTED)
    from tests.support.contract_jobs import slow

    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "scheduler", "dashboard")}
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    commands = {
        "worker": [sys.executable, "-m", "broker.worker", "tests.support.contract_jobs", "--queues", "index", "fetch"],
        "scheduler": [sys.executable, "-m", "periodic", "tests.support.contract_jobs",
                      "--jobs", "tests.acceptance.test_server_restart:SCHEDULER_JOBS"],
        "dashboard": [sys.executable, "-m", "broker.cli", "dashboard", "--port", str(port)],
    }
    with ExitStack() as stack:
        procs = {name: stack.enter_context(running(cmd, subprocess_env, log=logs[name]))
                 for name, cmd in commands.items()}
        # Given a worker whose application pool holds connections (jobs that used the
        # database ran), a scheduler ticking every second, and a dashboard whose pages were served
        before = enqueue(database_url, [noop.message(f"before-{i}") for i in range(BEFORE)])
        wait_for(lambda: done_count(database_url, before) == BEFORE, timeout_s=60,
                 what=f"the jobs before the restart to be done: {logs['worker'].read_text()[-2000:]}")
        wait_for(lambda: _answers(base), timeout_s=30, what="the dashboard to answer")
        for path in PAGES:
            assert httpx.get(base + path, timeout=15).status_code == 200, path
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs"
                                              " WHERE job = 'restart-tick'") >= 2,
                 timeout_s=30, what="the scheduler to tick")
        # And jobs flowing (600 × 40 ms on a queue of three)
        flowing = enqueue(database_url, [slow.message(FLOW_MS) for _ in range(FLOWING)])
        wait_for(lambda: done_count(database_url, flowing) >= FLOWING // 10, timeout_s=60,
                 what="the flow to be under way")
        # When the server restarts
        down_s = restart(own_server)
        done_at_restart = done_count(database_url, flowing)
        # Then every dashboard page answers 200 at the first try (asserted below, with the rest)
        pages = {path: httpx.get(base + path, timeout=15) for path in PAGES}
        failed_pages = {path: (r.status_code, r.text[:300]) for path, r in pages.items() if r.status_code != 200}
        # And jobs that use the database, sent now, all run and succeed
        after = enqueue(database_url, [noop.message(f"after-{i}") for i in range(AFTER)])
        wait_for(lambda: finished(database_url, after), timeout_s=60,
                 what=f"the jobs sent after the restart to finish: {dict(query(database_url, STATES, (after,)))}")
        # And the flow completes
        wait_for(lambda: finished(database_url, flowing), timeout_s=120,
                 what=f"the flowing jobs to finish: {dict(query(database_url, STATES, (flowing,)))}")
        # And the scheduler ticks again
        ticks = scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs WHERE job = 'restart-tick'")
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs"
                                              " WHERE job = 'restart-tick'") >= ticks + 3,
                 timeout_s=30, what=f"three more ticks: {logs['scheduler'].read_text()[-2000:]}")
        # And the worker and the scheduler each say that the database is back
        for name in ("worker", "scheduler"):
            wait_for(lambda n=name: REACHABLE_AGAIN in logs[n].read_text(), timeout_s=30,
                     what=f"the {name} to say the database is back: {logs[name].read_text()[-2000:]}")
        for name in ("worker", "scheduler"):
            stop(procs[name], logs[name])
        stop(procs["dashboard"], logs["dashboard"], codes=(0, -signal.SIGTERM))  # uvicorn's own exit
    print(f"server restart: down {down_s:.1f} s; {done_at_restart} of {FLOWING} flowing jobs done when it was back")
    assert failed_pages == {}, failed_pages
    # And the server the rest of the suite uses ran through it untouched
    assert scalar(admin_url, STARTED) == suite_server_started
    # And no job failed: none rejected, none with an error, none that failed once and was retried
    failed = query(database_url, FAILED)
    assert failed == [], failed[:5]
    assert done_count(database_url, before + after + flowing) == BEFORE + AFTER + FLOWING
    # And no process logged an ERROR line or a traceback, and each said once that the
    # database went away and once that it was back
    texts = {name: log.read_text() for name, log in logs.items()}
    for name, text in texts.items():
        errors = [line for line in text.splitlines() if ERROR_LINE.search(line) or "Traceback" in line]
        assert errors == [], f"{name}: {errors[:5]}\n{text[-4000:]}"
    for name in ("worker", "scheduler"):
        outage = [line for line in texts[name].splitlines() if UNREACHABLE in line or REACHABLE_AGAIN in line]
        assert (texts[name].count(UNREACHABLE), texts[name].count(REACHABLE_AGAIN)) == (1, 1), (name, outage)
    # (the dashboard notices only if asked during the restart: at most one line each way)
    dashboard = texts["dashboard"]
    assert dashboard.count(UNREACHABLE) == dashboard.count(REACHABLE_AGAIN) <= 1, dashboard[-3000:]


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
