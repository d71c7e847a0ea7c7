"""What a worker and `run` say when they stop: the jobs waited for, each job cut off, a
forced stop that gives its jobs back at once, and `run`'s one summary line."""

from __future__ import annotations

import os
import re
import signal
import sys
import time

from broker.running import NAMED_JOBS_MOST
from broker.worker import FORCE_AFTER_S, FORCED_STOP_S
from tests.acceptance.test_run_supervisor import supervised
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP
from tests.support.procs import running, worker_cmd

STOPPED = "SELECT stopped_at IS NOT NULL FROM standmeet.worker_processes WHERE pid = %s"
MESSAGE = "SELECT state::text, worker_id, crashes FROM dramatiq.queue WHERE message_id = %s"


def _started(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s", (label,)))


def test_sigterm_names_the_jobs_it_waits_for_and_each_job_it_cuts_off(broker, database_url, subprocess_env,
                                                                      tmp_path):
    # Given a worker running seven one-minute jobs (fetch: 3 at once, index: 4)
    label = "named-at-shutdown"
    sent = [SLEEP["fetch"].send(60_000, label) for _ in range(3)] + [SLEEP["index"].send(60_000, label)
                                                                    for _ in range(4)]
    cmd = worker_cmd("--threads", "8", "--queues", "fetch", "index", "--worker-shutdown-timeout", "1500")
    log = tmp_path / "worker.log"
    with running(cmd, subprocess_env, log=log) as worker:
        wait_for(lambda: _started(database_url, label) == 7, timeout_s=30, what="the seven jobs to start")
        # When it gets SIGTERM
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(timeout=30)
    text = log.read_text()
    assert code == 0, text
    # Then it says how many it waits for, and for how long, naming a few and counting the rest
    waiting = [line for line in text.splitlines() if "waiting up to 1.5 s for 7 running job(s): " in line]
    assert len(waiting) == 1, text
    assert waiting[0].endswith(f"and {7 - NAMED_JOBS_MOST} more"), waiting[0]
    assert len(re.findall(r"test\.sleep\.(?:fetch|index) [0-9a-f-]{36} \(running \d+\.\d s\)", waiting[0])) \
        == NAMED_JOBS_MOST, waiting[0]
    # And each job cut off at the timeout is named in one line, with how long it ran
    for message in sent:
        cut = [line for line in text.splitlines()
               if f"cut off at the shutdown timeout: {message.actor_name} {message.message_id} after " in line]
        assert len(cut) == 1, (message.message_id, text)
        assert query(database_url, MESSAGE, (message.message_id,)) == [("queued", None, 0)], text
    broker.flush("fetch")  # the next tests' workers have other jobs to run
    broker.flush("index")


def test_a_forced_stop_records_the_worker_stopped_and_gives_its_job_back_with_no_crash(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a worker running a one-minute job
    label = "forced-stop"
    message = SLEEP["notify"].send(60_000, label)
    cmd = worker_cmd("--threads", "2", "--queues", "notify", "--worker-shutdown-timeout", "60000")
    with running(cmd, subprocess_env, log=tmp_path / "first.log") as first:
        wait_for(lambda: _started(database_url, label) == 1, timeout_s=30, what="the job to start")
        # When the operator presses Ctrl-C, waits, and presses it again
        first.send_signal(signal.SIGINT)
        wait_for(lambda: "received SIGINT: shutting down" in (tmp_path / "first.log").read_text(), timeout_s=10,
                 what="the first Ctrl-C to be heard")
        time.sleep(FORCE_AFTER_S + 0.2)  # the operator's pause between the two presses (the behaviour under test)
        second = time.monotonic()
        first.send_signal(signal.SIGINT)
        code = first.wait(timeout=30)
        took = time.monotonic() - second
        # Then, the moment it has exited, it is recorded as stopped and its job is queued again, unblamed
        stopped = query(database_url, STOPPED, (first.pid,))
        row = query(database_url, MESSAGE, (message.message_id,))
    text = (tmp_path / "first.log").read_text()
    assert code == 1, text
    assert took < FORCED_STOP_S + 2, (took, text)
    assert stopped == [(True,)], text
    assert row == [("queued", None, 0)], text
    assert f"cut off by the forced stop: test.sleep.notify {message.message_id} after " in text
    # And another worker runs it again at once, no crash counted
    with running(worker_cmd("--threads", "2", "--queues", "notify"), subprocess_env, log=tmp_path / "second.log"):
        wait_for(lambda: _started(database_url, label) == 2, timeout_s=30, what="the job to run again")
        assert scalar(database_url, "SELECT crashes FROM dramatiq.queue WHERE message_id = %s",
                      (message.message_id,)) == 0
    broker.flush("notify")


def test_run_ends_with_one_summary_line(database_url, subprocess_env, tmp_path):
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "broker.cli", "run", "tests.support.jobs", "--no-scheduler", "--queues", "fetch",
           "--worker-shutdown-timeout", "2000"]
    with supervised(cmd, subprocess_env, log=log) as run:
        wait_for(lambda: "worker ready" in log.read_text(), timeout_s=60, what="the worker to be ready")
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(timeout=30)
    text = log.read_text()
    assert code == 0, text
    last = text.strip().splitlines()[-1]
    # the suite's database is the embedded server's (or another server's, with DATABASE_URL)
    assert re.search(r"run ended after \d+\.\d s: 1 process\(es\) started, 0 restarted; stopped by SIGTERM; "
                     r"(the embedded Postgres keeps running \(`standmeet-jobs db stop` stops it\)"
                     r"|the database \(DATABASE_URL\) is not ours to stop)$", last), text
