"""A scheduler whose shutdown waits on the database (a tick stuck on a lock) exits at
once on a deliberate second Ctrl-C, as a worker does, with status 1; the stuck tick rolls
back whole. A second signal sooner is the echo of the first and changes nothing."""

from __future__ import annotations

import signal
import sys
import time

import psycopg

from broker.exits import FORCE_AFTER_S
from tests.support.db import lock_waits, query, scalar, wait_for
from tests.support.procs import running

SCHEDULER = [sys.executable, "-m", "periodic", "--jobs", "tests.support.periodic_jobs:JOBS"]
PERIODS = "SELECT count(*) FROM standmeet.periodic_runs WHERE job = 'test-every-second'"
#: Periods recorded without their message: a tick half-written.
HALF_WRITTEN = ("SELECT count(*) FROM standmeet.periodic_runs r WHERE r.job = 'test-every-second'"
                " AND NOT EXISTS (SELECT 1 FROM dramatiq.queue q WHERE q.message_id = r.message_id)")


def test_a_second_ctrl_c_forces_a_scheduler_stuck_in_a_tick_to_exit_at_once(broker, database_url,
                                                                            subprocess_env, tmp_path):
    # Given a scheduler ticking every second, its next tick stuck on a lock held here
    log = tmp_path / "scheduler.log"
    with running(SCHEDULER, subprocess_env, log=log) as scheduler, psycopg.connect(database_url) as blocker:
        wait_for(lambda: "scheduler running" in log.read_text() and scalar(database_url, PERIODS) >= 1,
                 timeout_s=60, what="the scheduler to tick")
        blocker.execute("LOCK TABLE standmeet.periodic_runs IN SHARE MODE")
        wait_for(lambda: lock_waits(database_url, statement="periodic_runs"), timeout_s=30,
                 what="a tick to wait on the lock")
        # When the operator presses Ctrl-C: the scheduler waits for its tick
        scheduler.send_signal(signal.SIGINT)
        wait_for(lambda: "stopping: the relay first, then the scheduler" in log.read_text(), timeout_s=30,
                 what="the first Ctrl-C to be heard")
        # (a second signal at once is the echo of the first: it changes nothing)
        scheduler.send_signal(signal.SIGTERM)
        time.sleep(FORCE_AFTER_S + 0.2)  # the operator's pause between the two presses (the behaviour under test)
        assert scheduler.poll() is None, log.read_text()
        # And presses it again
        second = time.monotonic()
        scheduler.send_signal(signal.SIGINT)
        code = scheduler.wait(timeout=30)
        took = time.monotonic() - second
        blocker.rollback()
    # Then it exits at once, with status 1, saying so
    text = log.read_text()
    assert code == 1, text
    assert took < 5, (took, text)
    assert "second Ctrl-C: exiting now" in text, text
    assert "Traceback" not in text, text
    # And the stuck tick rolled back whole: no period recorded without its message
    wait_for(lambda: lock_waits(database_url, statement="periodic_runs") == 0, timeout_s=30,
             what="the cut-off tick's session to end")
    assert scalar(database_url, HALF_WRITTEN) == 0
    query(database_url, "DELETE FROM standmeet.periodic_runs WHERE job = 'test-every-second'")
    broker.flush_all()
