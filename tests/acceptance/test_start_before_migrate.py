"""A worker, the scheduler and a relay started a moment before `migrate` (a deploy that
starts them together) wait for the schema, saying so in one line, then start once it is
current: the worker serves, the scheduler records its schedules. Stopped while waiting,
each exits cleanly; none writes a traceback."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.support import db as testdb
from tests.support.db import scalar, wait_for
from tests.support.procs import ROOT, exit_status, running, worker_cmd

MIGRATE = [sys.executable, "-m", "broker.cli", "migrate"]
SCHEDULER = [sys.executable, "-m", "periodic"]
RELAY = [sys.executable, "-m", "broker.relay"]
WAITING = "waiting for the schema, looking again every"


@pytest.fixture
def new_database(admin_url: str) -> Iterator[str]:
    """A database no `migrate` has touched."""
    name = testdb.unique_name("smt_unmigrated")
    testdb.drop_database(admin_url, name)
    testdb.query(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield testdb.with_dbname(admin_url, name)
    finally:
        testdb.drop_database(admin_url, name)


def says(log: Path, text: str) -> bool:
    return log.exists() and text in log.read_text()


def test_processes_started_before_migrate_wait_for_it_then_start(new_database, subprocess_env, tmp_path):
    # Given a worker, the scheduler and a relay started on a database with no schema
    env = {**subprocess_env, "DATABASE_URL": new_database}
    logs = {name: tmp_path / f"{name}.log" for name in ("worker", "scheduler", "relay")}
    commands = {"worker": worker_cmd("--threads", "1", module="actors"), "scheduler": SCHEDULER, "relay": RELAY}
    with running(commands["worker"], env, log=logs["worker"]) as worker, \
            running(commands["scheduler"], env, log=logs["scheduler"]) as scheduler, \
            running(commands["relay"], env, log=logs["relay"]) as relay:
        # Then each says, in one line, that it waits for the schema
        for name, log in logs.items():
            wait_for(lambda log=log: says(log, WAITING), timeout_s=60, what=f"the {name} to say it waits")
        assert not says(logs["worker"], "worker ready")
        # When migrate runs
        subprocess.run(MIGRATE, env=env, cwd=ROOT, check=True, capture_output=True, timeout=120)
        # Then each starts: the worker serves, the scheduler records its schedules
        wait_for(lambda: says(logs["worker"], "worker ready"), timeout_s=30, what="the worker to start")
        wait_for(lambda: scalar(new_database, "SELECT count(*) FROM standmeet.worker_processes"
                                              " WHERE stopped_at IS NULL"), timeout_s=30,
                 what="the worker registered")
        wait_for(lambda: scalar(new_database, "SELECT count(*) FROM standmeet.periodic_schedules"), timeout_s=30,
                 what="the scheduler's schedules recorded")
        wait_for(lambda: scalar(new_database, "SELECT count(*) FROM standmeet.relays"), timeout_s=30,
                 what="the relay registered")
        for proc in (worker, scheduler, relay):
            proc.send_signal(signal.SIGTERM)
        codes = [exit_status(proc, logs[name], timeout_s=60)
                 for name, proc in (("worker", worker), ("scheduler", scheduler), ("relay", relay))]
    texts = {name: log.read_text() for name, log in logs.items()}
    assert codes == [0, 0, 0], texts
    for text in texts.values():
        assert text.count(WAITING) == 1, text  # one line, not one per look
        assert "Traceback" not in text, text


def test_a_worker_stopped_while_it_waits_for_the_schema_exits_cleanly(new_database, subprocess_env, tmp_path):
    env = {**subprocess_env, "DATABASE_URL": new_database}
    log = tmp_path / "worker.log"
    with running(worker_cmd("--threads", "1", module="actors"), env, log=log) as worker:
        wait_for(lambda: says(log, WAITING), timeout_s=60, what="the worker to say it waits")
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
    text = log.read_text()
    assert code == 0, text
    assert "worker stopped before it started" in text and "Traceback" not in text, text


@contextmanager
def scheduler_cut_off(database_url: str, env: dict[str, str], log: Path) -> Iterator[tuple[Any, Any]]:
    """The scheduler, started while its database does not answer (a relay in front of it,
    cut), once it has said it could not record its schedules: (the process, the relay)."""
    from tests.support.proxy import PostgresProxy

    proxy = PostgresProxy(database_url)
    proxy.cut()
    try:
        with running(SCHEDULER, {**env, "DATABASE_URL": proxy.url}, log=log) as scheduler:
            wait_for(lambda: says(log, "could not record the periodic schedules"), timeout_s=60,
                     what="the scheduler to say it could not record its schedules")
            yield scheduler, proxy
    finally:
        proxy.close()


def test_a_scheduler_started_while_the_database_is_down_records_its_schedules_once_it_is_back(
        database_url, subprocess_env, tmp_path):
    # Given the scheduler started while its database does not answer
    scalar(database_url, "DELETE FROM standmeet.periodic_schedules")
    log = tmp_path / "scheduler.log"
    with scheduler_cut_off(database_url, subprocess_env, log) as (scheduler, proxy):
        assert scalar(database_url, "SELECT count(*) FROM standmeet.periodic_schedules") == 0
        # When the database is back
        proxy.restore()
        # Then it records them, without a restart
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.periodic_schedules"),
                 timeout_s=60, what="the schedules recorded")
        scheduler.send_signal(signal.SIGTERM)
        assert scheduler.wait(timeout=60) == 0, log.read_text()
    text = log.read_text()
    assert text.count("could not record the periodic schedules") == 1, text  # said once
    assert "recorded the periodic schedules" in text, text


def test_a_scheduler_started_while_the_database_is_down_stops_at_once_when_asked(
        database_url, subprocess_env, tmp_path):
    # Given the scheduler of the application's periodic jobs, started while its database
    # does not answer (each first tick would wait out a connection's timeout)
    log = tmp_path / "scheduler.log"
    with scheduler_cut_off(database_url, subprocess_env, log) as (scheduler, _):
        # When it is asked to stop
        asked = time.monotonic()
        scheduler.send_signal(signal.SIGTERM)
        code = exit_status(scheduler, log, timeout_s=60)
        took = time.monotonic() - asked
    # Then it stops within a connection's timeout, not one for each of its jobs
    assert code == 0, log.read_text()
    assert took < 25, (took, log.read_text())
