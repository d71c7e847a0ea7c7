"""`standmeet-jobs run` under real signals to its process group, and a worker that crashes.

Each `run` is started in a session of its own and its whole process group is SIGKILLed
at the end of the test, whatever happened (``supervised``)."""

from __future__ import annotations

import os
import re
import signal
import sys
import time
import uuid

import psycopg
import pytest

from actors import settings as app_settings
from actors import webhooks
from broker.settings import replace
from tests.acceptance.test_run_supervisor import session_members, supervised
from tests.support.db import query, wait_for
from tests.support.http import http_server
from tests.support.procs import supervised_pids

RUN = [sys.executable, "-m", "broker.cli", "run", "--no-scheduler", "--queues", "webhook",
       "--worker-shutdown-timeout", "15000"]


@pytest.fixture
def run_env(broker, subprocess_env):
    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",)))
    yield {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    app_settings.use(original)


def _endpoint(url: str) -> tuple[int, str]:
    """An endpoint subscribed to an event type of its own (other tests' endpoints stay out)."""
    event_type = f"deploy.{uuid.uuid4().hex}"
    return webhooks.add_endpoint(url, [event_type])[0], event_type


def _emit(database_url: str, event_type: str) -> int:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return webhooks.emit_event(conn, event_type, {})


@pytest.mark.parametrize("how", ["ctrl-c to the group", "sigterm to the group", "sigterm to run alone"])
def test_ctrl_c_or_sigterm_lets_a_running_delivery_finish(database_url, run_env, tmp_path, how):
    log = tmp_path / "run.log"
    with http_server(delay_s=3.0) as (url, server):
        endpoint, event_type = _endpoint(url)
        with supervised(RUN, run_env, log=log) as run:
            event = _emit(database_url, event_type)
            wait_for(lambda: server.current() == 1, timeout_s=30, what="the POST to be in flight")
            # Ctrl-C (or systemd, or `timeout`) signals the whole group; `run` then sends its
            # own SIGTERM a few ms later. Or an operator signals `run` alone.
            if how == "ctrl-c to the group":
                os.killpg(run.pid, signal.SIGINT)
            elif how == "sigterm to the group":
                os.killpg(run.pid, signal.SIGTERM)
            else:
                os.kill(run.pid, signal.SIGTERM)
            code = run.wait(timeout=30)
            members = session_members(run.pid)
        text = log.read_text()
        assert code == 0, text
        assert members == [], text  # every child stopped with it
        assert len(server.received) == 1  # delivered once, never cut and sent again
    outcomes = query(database_url, "SELECT a.outcome FROM standmeet.webhook_attempts a"
                                   " JOIN standmeet.webhook_deliveries d ON d.id = a.delivery_id"
                                   " WHERE d.event_id = %s AND d.endpoint_id = %s", (event, endpoint))
    assert outcomes == [("ok",)], text
    assert "exiting now" not in text and "forcing" not in text


def test_a_deliberate_second_ctrl_c_forces_the_exit_says_so_and_fails(database_url, run_env, tmp_path):
    log = tmp_path / "run.log"
    with http_server(hold=True) as (url, server):
        endpoint, event_type = _endpoint(url)
        with supervised(RUN, run_env, log=log) as run:
            _emit(database_url, event_type)
            wait_for(lambda: server.current() == 1, timeout_s=30, what="the POST to be in flight")
            os.killpg(run.pid, signal.SIGINT)
            time.sleep(1.5)  # the operator waits, then presses Ctrl-C again (the behaviour under test)
            assert run.poll() is None, log.read_text()  # still waiting for the running job
            second = time.monotonic()
            os.killpg(run.pid, signal.SIGINT)
            code = run.wait(timeout=30)
            took = time.monotonic() - second
            members = session_members(run.pid)
        text = log.read_text()
    assert code == 1, text
    assert members == [], text
    assert took < 5, (took, text)
    assert "second Ctrl-C" in text


def test_run_restarts_a_crashed_worker_with_back_off(database_url, run_env, tmp_path):
    log = tmp_path / "run.log"
    with supervised(RUN, run_env, log=log) as run:
        first = wait_for(lambda: supervised_pids(log.read_text()), timeout_s=30, what="the worker process")
        os.kill(first[0], signal.SIGKILL)
        replaced = wait_for(lambda: [p for p in supervised_pids(log.read_text()) if p not in first], timeout_s=30,
                            what="a new worker process")
        wait_for(lambda: "restarted pid" in log.read_text(), timeout_s=10, what="the restart to be logged")
        os.killpg(run.pid, signal.SIGTERM)
        code = run.wait(timeout=30)
        members = session_members(run.pid)
    text = log.read_text()
    assert code == 0, text
    assert members == [], text
    assert f"pid {first[0]} (-m broker.worker) exited with -9" in text
    # the first restart waits the back-off's first step, jittered into half to all of it
    waits = [float(w) for w in re.findall(r"restarting it in (\S+) s", text)]
    assert waits and 0.5 <= waits[0] <= 1.0, text
    assert f"restarted pid {replaced[0]}" in text
