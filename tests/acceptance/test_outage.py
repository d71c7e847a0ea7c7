"""A database outage longer than every timeout, while jobs run and some fail.

Nothing is recorded that did not happen: a job is ``done`` only if its actor returned,
a failed run is retried, no worker thread dies, and the same worker process goes on
claiming the moment the database is back.
"""

from __future__ import annotations

import time

import pytest

from tests.support.db import query, wait_for
from tests.support.journal_jobs import journal, read_journal
from tests.support.procs import running, worker_cmd
from tests.support.proxy import PostgresProxy

pytestmark = pytest.mark.slow

#: Longer than every timeout of the runtime: connect (5 s), back-off caps (5 s), the
#: rescue window of the tests (3 s), the jobs' time limit (30 s).
OUTAGE_S = 50
#: A rescue window whose half (the time a worker that cannot prove it lives waits before
#: it steps down) is longer than the outage: the worker rides it out with its jobs running.
RIDE_OUT_RESCUE_AFTER_S = 2 * OUTAGE_S + 10
#: An outage longer than the tests' rescue window (3 s), shorter than the long one.
STEP_DOWN_OUTAGE_S = 8


def _states(url: str, ids: list[str]) -> dict[str, tuple[str, int]]:
    rows = query(url, "SELECT message_id::text, state::text, crashes FROM dramatiq.queue"
                      " WHERE message_id = ANY(%s::uuid[])", (ids,))
    return {row[0]: (row[1], row[2]) for row in rows}


def _journal_env(subprocess_env: dict[str, str], proxy: PostgresProxy, path: str, **extra: str) -> dict[str, str]:
    """A worker's environment: the database through ``proxy``, its journal at ``path``, the
    index queue limited to 8."""
    return {**subprocess_env, "DATABASE_URL": proxy.url, "STANDMEET_TEST_JOURNAL": path,
            "STANDMEET_QUEUE_INDEX_MAX_WORKERS": "8", **extra}


def _wait_for_all_eight_to_start(path: str) -> None:
    wait_for(lambda: len({e[1] for e in read_journal(path) if e[0] == "start"}) == 8,
             timeout_s=30, what="all 8 jobs to start")


def test_a_fifty_second_outage_loses_nothing_and_records_only_what_happened(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a worker reaching the database through a proxy we can cut, running 8 jobs
    # at once on a queue limited to 8; half of them fail on their first run; its rescue
    # window long enough that it need not step down during the outage
    proxy = PostgresProxy(database_url)
    path = str(tmp_path / "journal.txt")
    env = _journal_env(subprocess_env, proxy, path, STANDMEET_RESCUE_AFTER_S=str(RIDE_OUT_RESCUE_AFTER_S))
    # (each stores its result: the runs that end during the outage store theirs then)
    jobs = [journal.send_with_options(args=(4_000,), kwargs={"fail_first": i % 2 == 0}, store_results=True)
            for i in range(8)]
    ids = [m.message_id for m in jobs]
    log = tmp_path / "worker.log"
    cmd = worker_cmd("--queues", "index", module="tests.support.journal_jobs")
    try:
        with running(cmd, env, log=log) as worker:
            _wait_for_all_eight_to_start(path)
            # When the database refuses every connection for 50 s while they finish
            proxy.cut()
            wait_for(lambda: sum(1 for e in read_journal(path) if e[0] in ("returned", "raised")) == 8,
                     timeout_s=20, what="the 8 first runs to end during the outage")
            outage_end = time.monotonic() + OUTAGE_S
            while time.monotonic() < outage_end:  # the outage itself: the worker must ride it out
                assert worker.poll() is None, log.read_text()
                time.sleep(0.5)
            proxy.restore()
            # Then every job completes, and each is done only after a run that returned
            wait_for(lambda: all(s == ("done", 0) for s in _states(database_url, ids).values()),
                     timeout_s=60, what="every job done, none blamed for a crash")
            entries = read_journal(path)
            for message_id in ids:
                events = [e[0] for e in entries if e[1] == message_id]
                assert events[-1] == "returned", (message_id, events)
            # with its result kept (a job is done only with its result written)
            for message in jobs:
                assert message.get_result(block=True, timeout=10_000) is None
            failed_first = {m.message_id for i, m in enumerate(jobs) if i % 2 == 0}
            for message_id in failed_first:  # retried after the outage, not marked done
                assert [e[0] for e in entries if e[1] == message_id] == ["start", "raised", "start", "returned"]
            # And a job enqueued afterwards runs at once, in the same worker process
            after = journal.send(0)
            wait_for(lambda: any(e[0] == "returned" and e[1] == after.message_id for e in read_journal(path)),
                     timeout_s=10, what="a job sent after the outage to run")
            pids = {e[2] for e in read_journal(path)}
            assert pids == {worker.pid}
            assert worker.poll() is None
    finally:
        proxy.close()
    text = log.read_text()
    assert "Traceback" not in text or "RuntimeError: the first run of this job fails" in text
    assert "database unreachable" in text and "reachable again" in text


def test_an_outage_longer_than_half_the_rescue_window_interrupts_the_jobs_and_loses_none(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a worker reaching the database through a proxy we can cut, running 8 jobs, half
    # of which fail on their first run; the tests' rescue window (3 s)
    proxy = PostgresProxy(database_url)
    path = str(tmp_path / "journal.txt")
    env = _journal_env(subprocess_env, proxy, path)
    jobs = [journal.send(20_000, fail_first=(i % 2 == 0), then_ms=0) for i in range(8)]
    ids = [m.message_id for m in jobs]
    log = tmp_path / "worker.log"
    cmd = worker_cmd("--queues", "index", module="tests.support.journal_jobs")
    try:
        with running(cmd, env, log=log) as worker:
            _wait_for_all_eight_to_start(path)
            # When the database is out of its reach for longer than the rescue window
            proxy.cut()
            cut_at = time.monotonic()
            # Then it steps down before anyone may rescue its jobs: it interrupts all of them
            wait_for(lambda: sum(1 for e in read_journal(path) if e[0] == "interrupted") == 8,
                     timeout_s=10, what="the 8 running jobs to be interrupted")
            assert time.monotonic() - cut_at < 3.0
            while time.monotonic() - cut_at < STEP_DOWN_OUTAGE_S:
                assert worker.poll() is None, log.read_text()
                time.sleep(0.5)
            proxy.restore()
            # and once back, every job runs again and completes, none blamed for a crash
            wait_for(lambda: all(s == ("done", 0) for s in _states(database_url, ids).values()),
                     timeout_s=60, what="every job done, none blamed for a crash")
            entries = read_journal(path)
            for message_id in ids:
                events = [e[0] for e in entries if e[1] == message_id]
                assert events[:2] == ["start", "interrupted"] and events[-1] == "returned", (message_id, events)
            assert worker.poll() is None
    finally:
        proxy.close()
    text = log.read_text()
    assert text.count("stepping down") == 1 and "8 running job(s) interrupted" in text
    assert text.count("stepping up") == 1
