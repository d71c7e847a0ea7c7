"""A crash of the Postgres server itself, in the middle of a drain and a relay.

The broker's own connections commit asynchronously (claims, settles): a server crash
may lose their last few hundred milliseconds. That may only make a job run again,
never lose one: enqueues and emits commit synchronously, and every job completes.
The server is one of this module's own (``own_server``: never the suite's, never one a
developer runs), stopped with ``pg_ctl stop -m immediate`` (no checkpoint: the restart
runs crash recovery from the WAL).
"""

from __future__ import annotations

import time
import uuid

import psycopg
import pytest

from broker import emit
from broker.engine import sql_enqueue
from broker.engine.codec import enqueue_params
from broker.outbox import MESSAGE_NAMESPACE
from tests.conftest import TEST_OVERRIDES
from tests.support import db as testdb
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import mark
from tests.support.procs import running, worker_cmd

pytestmark = pytest.mark.slow

#: When a server started: the suite's own server must not change while this test runs.
STARTED = "SELECT pg_postmaster_start_time()"

JOBS = 2000
EVENTS = 2000
#: Events per relay pass: small, so that the relay is still at work when the server dies.
RELAY_BATCH = 5
#: Rescue waits a whole rescue window after the server's restart, and a worker judges
#: nobody until it has been back that long; then the rest of the drain. Budgets are
#: several times what a loaded 2-core machine needs.
RESCUE_WINDOW_S = TEST_OVERRIDES["rescue_after_s"] + TEST_OVERRIDES["heartbeat_s"]
DRAIN_BUDGET_S = 240.0

STATES = "SELECT state::text, count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) GROUP BY 1"
RELAYED = "SELECT count(*) FROM standmeet.outbox WHERE id = ANY(%s) AND relayed_at IS NOT NULL"
PRESENT_EVENTS = "SELECT count(*) FROM standmeet.outbox WHERE id = ANY(%s)"
DONE = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state = 'done'"
#: Per message: how many runs completed (test.mark writes one row per run).
RUNS = """
SELECT count(*) AS runs, count(DISTINCT message_id) AS messages
FROM test_runs WHERE actor = 'test.mark' AND message_id = ANY(%s::uuid[])
"""


@pytest.fixture(scope="module")
def direct_database_url(own_server):
    """This module's database, on the server it crashes."""
    return testdb.create_template(own_server.url(), testdb.unique_name("smt_crash"))


def crash_and_restart(server) -> float:
    """Kill the server without a checkpoint, start it again; seconds it was down."""
    down = time.monotonic()
    server.stop("immediate")
    server.start()  # pg_ctl start: crash recovery replays the WAL
    return time.monotonic() - down


def test_a_server_crash_mid_drain_and_mid_relay_loses_nothing_and_every_job_completes(
    broker, database_url, subprocess_env, own_server, admin_url, tmp_path
):
    suite_server_started = scalar(admin_url, STARTED)
    # Given 2,000 jobs enqueued and 2,000 events emitted (each will become a job), all committed
    jobs = [mark.message(f"crash-job-{i}") for i in range(JOBS)]
    job_ids = [m.message_id for m in jobs]
    with psycopg.connect(database_url) as conn, conn.transaction():
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(jobs))
        events = [emit(conn, "test.crash", {"label": f"crash-event-{i}"}) for i in range(EVENTS)]
    event_job_ids = [str(uuid.uuid5(MESSAGE_NAMESPACE, f"{event_id}/0")) for event_id in events]
    all_ids = job_ids + event_job_ids
    env = {**subprocess_env, "STANDMEET_RELAY_BATCH": str(RELAY_BATCH)}
    log = tmp_path / "worker.log"
    with running(worker_cmd("--threads", "8", "--queues", "index"), env, log=log):
        # And a worker process draining the jobs while its relay turns events into jobs
        wait_for(lambda: scalar(database_url, DONE, (job_ids,)) >= JOBS // 10
                 and scalar(database_url, RELAYED, (events,)) >= EVENTS // 10,
                 timeout_s=120, what="the drain and the relay to be under way")
        done_before = scalar(database_url, DONE, (all_ids,))
        relayed_before = scalar(database_url, RELAYED, (events,))
        # When the server crashes (no checkpoint, no clean shutdown) and restarts
        down_s = crash_and_restart(own_server)
        restarted = time.monotonic()
        # Then nothing enqueued or emitted is lost: every job and every event is there
        assert scalar(database_url, PRESENT_EVENTS, (events,)) == EVENTS
        assert sum(n for _, n in query(database_url, STATES, (job_ids,))) == JOBS
        # And every event is relayed and every job completes, within a rescue window
        # after the restart plus the rest of the drain
        deadline_s = 2 * RESCUE_WINDOW_S + DRAIN_BUDGET_S
        wait_for(lambda: scalar(database_url, RELAYED, (events,)) == EVENTS, timeout_s=deadline_s,
                 what="every event to be relayed")
        try:
            wait_for(lambda: scalar(database_url, DONE, (all_ids,)) == JOBS + EVENTS, timeout_s=deadline_s,
                     interval_s=0.5, what=f"all {JOBS + EVENTS} jobs done")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; their states: {dict(query(database_url, STATES, (all_ids,)))}") from None
        recovered_s = time.monotonic() - restarted
    output = log.read_text()
    runs, messages = query(database_url, RUNS, (all_ids,))[0]
    # And each job ran at least once; the re-runs the crash caused are counted and reported
    assert messages == JOBS + EVENTS
    assert "database unreachable" in output, output[-3000:]
    reruns = runs - messages
    print(f"server crash: {done_before} of {JOBS + EVENTS} jobs done and {relayed_before} of {EVENTS} events "
          f"relayed when it died; down {down_s:.1f} s; all done {recovered_s:.1f} s after the restart; "
          f"{reruns} re-run(s)")
    assert scalar(database_url, RELAYED, (events,)) == EVENTS
    assert relayed_before < EVENTS and done_before < JOBS + EVENTS, "the crash came after the work"
    # And the server the rest of the suite uses ran through it untouched
    assert scalar(admin_url, STARTED) == suite_server_started
