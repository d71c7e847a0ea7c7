"""A worker cut off from the database steps down before anyone may take its jobs over.

Another process rescues a worker's claims once its heartbeat is older than the rescue
window. A worker that cannot confirm its heartbeat for half that window stops claiming and
interrupts its running jobs (they run again, with no retry counted), so that a job never
runs here and elsewhere at once; when it can prove it lives again it says which claims it
lost meanwhile, and their late outcomes are fenced off by the claim number.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg import sql as pgsql

from broker.engine import runs
from tests.support.db import conninfo_dbname, query, scalar, wait_for
from tests.support.jobs import (
    CUED_RUNS,
    CUES,
    CUT_RUNS,
    SECOND_RUNS,
    ended_on_cue,
    held_through_a_cut,
    result_once_the_second_run_returns,
    second_run_returns,
)

END_SESSIONS = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
"""


@contextmanager
def cut_off(admin_url: str, database_url: str) -> Iterator[psycopg.Connection]:
    """The database ends every session of this process and takes no new one (as a network
    partition would); the connection yielded, opened before, still reaches it."""
    name = pgsql.Identifier(conninfo_dbname(database_url))
    with psycopg.connect(database_url, autocommit=True) as keeper, \
            psycopg.connect(admin_url, autocommit=True) as admin:
        admin.execute(pgsql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(name))
        try:
            keeper.execute(END_SESSIONS)
            yield keeper
        finally:
            admin.execute(pgsql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(name))


def _state(database_url: str, message_id: str) -> tuple[str, int] | None:
    from tests.support.db import query

    rows = query(database_url, "SELECT state::text, claims FROM dramatiq.queue WHERE message_id = %s", (message_id,))
    return (rows[0][0], int(rows[0][1])) if rows else None


def _started(database_url: str, message_id: str) -> bool:
    return bool(scalar(database_url, "SELECT started_at IS NOT NULL AND state = 'consumed' FROM dramatiq.queue "
                                     "WHERE message_id = %s", (message_id,)))


def test_a_cut_off_worker_interrupts_its_jobs_before_the_rescue_window_and_runs_them_again_after(
    broker, database_url, admin_url, start_worker, caplog
):
    # Given a worker running a long job
    start_worker(queues=["index"], threads=2)
    message = held_through_a_cut.send("cut-a", 60.0)
    wait_for(lambda: _started(database_url, message.message_id), timeout_s=10, what="the job to start")
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        # When the database ends this process's sessions and refuses new ones
        with cut_off(admin_url, database_url):
            cut_at = time.monotonic()
            # Then the job is interrupted within the rescue window, and claiming stops
            wait_for(lambda: "cut-a:CutOff" in CUT_RUNS, timeout_s=broker.settings.rescue_after_s,
                     what="the running job to be interrupted")
            assert time.monotonic() - cut_at < broker.settings.rescue_after_s
            assert broker.stepped_down and not broker.may_claim
        stepping_down = [r.getMessage() for r in caplog.records if "stepping down" in r.getMessage()]
        assert len(stepping_down) == 1 and "1 running job(s) interrupted" in stepping_down[0]
        # When the database takes the process back
        wait_for(lambda: not broker.stepped_down, timeout_s=10, what="the worker to step up")
        # Then nothing was lost: the job runs again, to the end, with no retry counted
        wait_for(lambda: _state(database_url, message.message_id) == ("done", 2), timeout_s=10,
                 what="the job to run again and finish")
    assert CUT_RUNS.count("cut-a:done") == 1
    assert not [r for r in caplog.records if "lost claim" in r.getMessage()]
    assert scalar(database_url, "SELECT message->'options'->>'retries' FROM dramatiq.queue WHERE message_id = %s",
                  (message.message_id,)) in (None, "0")


def _in_leave(thread_id: int) -> bool:
    """Whether the thread is inside ``RunningJobs.leave`` (its job has returned)."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code is runs.RunningJobs.leave.__code__:
            return True
        frame = frame.f_back
    return False


def test_a_step_down_never_interrupts_a_run_that_has_already_ended(
    broker, database_url, start_worker, monkeypatch, caplog
):
    # Given a worker running a job that ends on cue, and a step-down that has counted it
    # among the running jobs: its interruption goes out only once the job has returned
    # (its thread then waits for the lock the step-down holds, to leave its run)
    start_worker(queues=["index"], threads=1)
    message = ended_on_cue.send("ended-b")
    # (in its body, not only marked started: a claim is marked as it is handed to a thread,
    # a moment before its body begins, and a step-down then skips it instead)
    wait_for(lambda: "ended-b" in CUED_RUNS, timeout_s=10, what="the job to start")
    raise_thread_exception = runs.raise_thread_exception

    def raised_once_the_job_has_returned(thread_id: int, exception: type[BaseException]) -> None:
        if thread_id != threading.get_ident():  # (the step-down's; not the thread's own as it leaves)
            CUES["ended-b"].set()
            wait_for(lambda: _in_leave(thread_id), timeout_s=10, what="the job to return")
        raise_thread_exception(thread_id, exception)

    monkeypatch.setattr(runs, "raise_thread_exception", raised_once_the_job_has_returned)
    with caplog.at_level(logging.INFO, logger="standmeet.broker"):
        # When the worker steps down
        broker.liveness.step_down(broker.settings.step_down_after_s)
        # Then, back up, it writes the run's outcome: done, after one run
        try:
            wait_for(lambda: (_state(database_url, message.message_id) or ("",))[0] == "done", timeout_s=10,
                     what="the run's outcome to be written")
        except AssertionError as exc:  # what the process was doing, for whoever reads the failure
            raise AssertionError(f"{exc}: row {_state(database_url, message.message_id)}, stepped down "
                                 f"{broker.stepped_down}, runs {CUED_RUNS.count('ended-b')}, outcomes waiting "
                                 f"{broker.settler.pending_claims()}, log {[r.getMessage() for r in caplog.records]}"
                                 ) from exc
    assert (_state(database_url, message.message_id), CUED_RUNS.count("ended-b")) == (("done", 1), 1)
    # and the interruption reached the thread only once its run had ended, and was dropped
    assert any(f"message {message.message_id}: CutOff arrived after the job had ended" in r.getMessage()
               for r in caplog.records)


def test_a_run_a_step_down_interrupted_stores_no_result_a_waiter_gets_the_run_that_ends(
        broker, database_url, start_worker):
    # Given a job whose result is kept, running
    start_worker(queues=["index"], threads=2)
    message = second_run_returns.send("cut-result", "sleeps")
    wait_for(lambda: SECOND_RUNS.count("cut-result") == 1, timeout_s=10, what="the first run to start")
    # When the worker steps down, interrupting it, and it runs again
    broker.liveness.step_down(broker.settings.step_down_after_s)
    wait_for(lambda: SECOND_RUNS.count("cut-result") == 2, timeout_s=30, what="the second run to start")
    # Then while the second run runs, no result is there (none was stored for the first),
    # and a waiter gets the result of the run that ended
    assert result_once_the_second_run_returns(message, "cut-result") == "the second run's"


def test_a_worker_back_from_a_cut_says_which_claims_it_lost_and_writes_no_stale_settle(
    broker, database_url, admin_url, start_worker, caplog
):
    # Given a worker running a long job
    start_worker(queues=["index"], threads=2)
    message = held_through_a_cut.send("cut-b", 60.0)
    wait_for(lambda: _started(database_url, message.message_id), timeout_s=10, what="the job to start")
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        with cut_off(admin_url, database_url) as keeper:
            wait_for(lambda: "cut-b:CutOff" in CUT_RUNS, timeout_s=broker.settings.rescue_after_s,
                     what="the running job to be interrupted")
            # and, meanwhile, another host rescued and claimed the job (as rescue would,
            # once this process's heartbeat was older than the window)
            keeper.execute("UPDATE dramatiq.queue SET claims = claims + 1, worker_id = gen_random_uuid(), "
                           "mtime = now() WHERE message_id = %s", (message.message_id,))
        # When the process is back
        wait_for(lambda: not broker.stepped_down, timeout_s=10, what="the worker to step up")
        # Then it says which claim it lost
        lost = [r.getMessage() for r in caplog.records if "lost claim" in r.getMessage()]
        assert len(lost) == 1 and message.message_id in lost[0]
    # and its interrupted run's outcome is not written over the other host's claim
    assert broker.settler.flush(5)
    assert _state(database_url, message.message_id) == ("consumed", 2)
    assert "cut-b:done" not in CUT_RUNS
    scalar(database_url, "UPDATE dramatiq.queue SET state = 'done', worker_id = NULL WHERE message_id = %s "
                         "RETURNING 1", (message.message_id,))


def test_a_worker_that_was_cut_off_takes_back_the_crash_rescue_blamed_on_it(
    broker, database_url, admin_url, start_worker, caplog
):
    from broker.engine import sql

    # Given a worker running one long job
    start_worker(queues=["index"], threads=2)
    message = held_through_a_cut.send("cut-c", 60.0)
    wait_for(lambda: _started(database_url, message.message_id), timeout_s=10, what="the job to start")
    with cut_off(admin_url, database_url) as keeper:
        wait_for(lambda: "cut-c:CutOff" in CUT_RUNS, timeout_s=broker.settings.rescue_after_s,
                 what="the running job to be interrupted")
        # When another process's rescue finds this one silent for a whole window: with one
        # job started, that job is blamed for killing its worker
        window = broker.settings.rescue_after_s
        rescue = {"after_s": window, "max_crashes": 5, "worker_id": "00000000-0000-4000-8000-000000000002"}
        wait_for(lambda: keeper.execute(sql.RESCUE, rescue).fetchall(), timeout_s=3 * window, interval_s=0.2,
                 what="another process to rescue the cut-off worker's claim")
        assert keeper.execute("SELECT crashes, blamed_worker::text FROM dramatiq.queue WHERE message_id = %s",
                              (message.message_id,)).fetchone() == (1, broker.worker_id)
    # Then, back, the worker says it lost the claim and takes the blame back: it was cut off
    wait_for(lambda: not broker.stepped_down, timeout_s=10, what="the worker to step up")
    wait_for(lambda: _blame(database_url, message.message_id) == (0, None), timeout_s=10,
             what="the crash counted on the cut-off worker to be taken back")
    assert any("lost claim" in r.getMessage() and message.message_id in r.getMessage() for r in caplog.records)
    wait_for(lambda: (_state(database_url, message.message_id) or ("",))[0] == "done", timeout_s=10,
             what="the job to run again and finish")



def test_a_worker_back_from_a_cut_gives_back_what_the_database_says_it_holds_and_it_does_not(
    broker, database_url, admin_url, start_worker, caplog
):
    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    # Given a worker running one long job, cut off from the database
    start_worker(queues=["index"], threads=2)
    running = held_through_a_cut.send("cut-d", 60.0)
    wait_for(lambda: _started(database_url, running.message_id), timeout_s=10, what="the job to start")
    unknown = held_through_a_cut.message("cut-e", 0.0)
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        with cut_off(admin_url, database_url) as keeper:
            wait_for(lambda: "cut-d:CutOff" in CUT_RUNS, timeout_s=broker.settings.rescue_after_s,
                     what="the running job to be interrupted")
            # and a message the database says this process holds, started, which the process
            # does not know (the server it wrote that message's outcome to was lost in a
            # failover before the outcome reached the standby; or a claim's answer never came)
            keeper.execute(sql_enqueue.ENQUEUE, enqueue_params([unknown]))
            keeper.execute("UPDATE dramatiq.queue SET state = 'consumed', claims = 1, worker_id = %s, "
                           "started_at = now() WHERE message_id = %s", (broker.worker_id, unknown.message_id))
        # When the process is back
        wait_for(lambda: not broker.stepped_down, timeout_s=10, what="the worker to step up")
        # Then it gives that message back, saying so, and it runs to the end
        wait_for(lambda: "cut-e:done" in CUT_RUNS, timeout_s=10, what="the message to run again")
        given_back = [r.getMessage() for r in caplog.records if "held by this process in the database" in r.getMessage()]
        assert len(given_back) == 1 and unknown.message_id in given_back[0]
    wait_for(lambda: (_state(database_url, unknown.message_id) or ("",))[0] == "done", timeout_s=10,
             what="the message to be done")
    # and the job it knew it held was neither given back nor lost
    wait_for(lambda: _state(database_url, running.message_id) == ("done", 2), timeout_s=10,
             what="the interrupted job to run again and finish")
    assert not [r for r in caplog.records if "lost claim" in r.getMessage()]

#: Ends the worker's claim connection of queue ``index``, and no other of its sessions.
END_INDEX_CONSUMER = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-consumer-index'
"""


def test_a_claim_whose_answer_is_lost_in_a_blip_too_short_to_step_down_is_given_back(
    broker, database_url, start_worker, caplog
):
    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    # Given a worker running one job, and proving it lives all along
    start_worker(queues=["index"], threads=2)
    running = held_through_a_cut.send("blip-a", 2.0)
    wait_for(lambda: _started(database_url, running.message_id), timeout_s=10, what="the job to start")
    lost_answer = held_through_a_cut.message("blip-b", 0.0)
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        # When a claim of this process commits a message as its own, started...
        with psycopg.connect(database_url) as conn:
            conn.execute(sql_enqueue.ENQUEUE, enqueue_params([lost_answer]))
            conn.execute("UPDATE dramatiq.queue SET state = 'consumed', claims = 1, worker_id = %s, "
                         "started_at = now() WHERE message_id = %s", (broker.worker_id, lost_answer.message_id))
        # ...and its answer is lost with the claim connection, which the server ends
        assert query(database_url, END_INDEX_CONSUMER)[0][0] == 1
        # Then, on its next connection, the consumer gives that message back, saying so,
        # and it runs to the end, without the process ever stepping down
        wait_for(lambda: "blip-b:done" in CUT_RUNS, timeout_s=10, what="the message whose answer was lost to run")
        given_back = [r.getMessage() for r in caplog.records if "held by this process in the database" in r.getMessage()]
        assert len(given_back) == 1 and lost_answer.message_id in given_back[0]
        # and the job it knew it held, running meanwhile, was neither given back nor run twice
        wait_for(lambda: _state(database_url, running.message_id) == ("done", 1), timeout_s=10,
                 what="the running job to finish")
    assert CUT_RUNS.count("blip-a:done") == 1 and "blip-a:CutOff" not in CUT_RUNS
    assert not [r for r in caplog.records if "stepping down" in r.getMessage() or "lost claim" in r.getMessage()]
    wait_for(lambda: (_state(database_url, lost_answer.message_id) or ("",))[0] == "done", timeout_s=10,
             what="the message to be done")


@contextmanager
def _a_run_just_ended(broker: Any, database_url: str, key: str) -> Iterator[dramatiq.Message]:
    """A message this process claimed and ran, whose outcome is not yet handed to the
    settler (the moment between a run's end and its settle); done afterwards."""
    message = held_through_a_cut.send(key, 0.0)
    state = broker.queue_states["index"]
    broker.claiming = True  # (a worker stopped by an earlier test stopped the broker's claiming)
    consumer = broker.consume("index")
    try:
        assert consumer.claim_once(consumer._connection()) == 1
        claim = state.next_buffered()
        assert claim is not None and claim.key == (message.message_id, 1)
        state.finished(claim.key)
        yield message
    finally:
        state.submitted((message.message_id, 1))
        consumer.close()
        scalar(database_url, "UPDATE dramatiq.queue SET state = 'done', worker_id = NULL WHERE message_id = %s "
                             "RETURNING 1", (message.message_id,))


def test_a_run_that_has_just_ended_is_not_taken_for_a_claim_the_process_never_knew(broker, database_url):
    # Given a message this process claimed and ran, whose outcome is not yet handed to
    # the settler
    with _a_run_just_ended(broker, database_url, "ended-a") as message:
        # When the process checks what the database says it holds against what it knows
        given_back = broker.give_back_unknown(queue="index")
        # Then that claim is known: not given back, to run a second time
        assert given_back == 0
        assert _state(database_url, message.message_id) == ("consumed", 1)


def test_a_worker_back_from_a_cut_says_it_lost_the_claim_of_a_run_that_had_just_ended(broker, database_url, caplog):
    # Given a message this process claimed and ran, its outcome not yet handed to the
    # settler, while the process was cut off and another host took the message over
    with _a_run_just_ended(broker, database_url, "ended-c") as message:
        scalar(database_url, "UPDATE dramatiq.queue SET claims = claims + 1, worker_id = gen_random_uuid() "
                             "WHERE message_id = %s RETURNING 1", (message.message_id,))
        with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
            broker.liveness.step_down(broker.settings.step_down_after_s)
            # When the process proves it lives again (its heartbeat may do it first)
            broker.liveness.prove_alive()
        # Then it says that claim was lost (its outcome is not written)
        assert not broker.stepped_down
        lost = [r.getMessage() for r in caplog.records if "lost claim" in r.getMessage()]
        assert lost == [m for m in lost if f"lost claim 1 of message {message.message_id}" in m] and lost


#: What a standby promoted in a failover holds when a run's claim reached it and its
#: settle did not: the row consumed by this worker, under the claim that ran here.
SETTLE_LOST_IN_A_FAILOVER = ("UPDATE dramatiq.queue SET state = 'consumed', worker_id = %s, started_at = now() "
                             "WHERE message_id = %s AND claims = 1 RETURNING 1")


def _given_back(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "held by this process in the database" in r.getMessage()]


def _a_run_done_here(database_url: str, start_worker: Callable[..., Any], key: str) -> dramatiq.Message:
    """A worker on queue ``index``, and a message it has run, its outcome written."""
    start_worker(queues=["index"], threads=2)
    ran = held_through_a_cut.send(key, 0.0)
    wait_for(lambda: _state(database_url, ran.message_id) == ("done", 1), timeout_s=10, what="the run to be done")
    return ran


def test_a_settle_lost_in_a_failover_is_given_back_at_step_up_however_recent_its_run(
    broker, database_url, admin_url, start_worker, caplog
):
    # Given a run that ended here a moment ago, its outcome written
    ran = _a_run_done_here(database_url, start_worker, "failover-a")
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        # When the worker is cut off long enough to step down, and the server it comes back
        # to (a promoted standby) had the run's claim but not its settle
        with cut_off(admin_url, database_url) as keeper:
            wait_for(lambda: broker.stepped_down, timeout_s=2 * broker.settings.rescue_after_s, what="a step-down")
            assert keeper.execute(SETTLE_LOST_IN_A_FAILOVER, (broker.worker_id, ran.message_id)).fetchall() == [(1,)]
        wait_for(lambda: not broker.stepped_down, timeout_s=10, what="the worker to step up")
        # Then the message is given back and runs again
        wait_for(lambda: CUT_RUNS.count("failover-a:done") == 2, timeout_s=10,
                 what="the run whose settle was lost to run again")
        assert len(_given_back(caplog)) == 1


def test_a_settle_lost_in_a_failover_too_quick_to_step_down_is_given_back_after_the_blip(
    broker, database_url, start_worker, caplog
):
    # Given a run that ended here a moment ago, its outcome written
    ran = _a_run_done_here(database_url, start_worker, "failover-b")
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        # When a failover too quick to step down loses its settle (its claim replicated)
        # and ends the claim connection
        assert query(database_url, SETTLE_LOST_IN_A_FAILOVER, (broker.worker_id, ran.message_id)) == [(1,)]
        assert query(database_url, END_INDEX_CONSUMER)[0][0] == 1
        # Then the consumer's check on its next connection gives it back, and it runs again
        wait_for(lambda: CUT_RUNS.count("failover-b:done") == 2, timeout_s=10,
                 what="the run whose settle was lost to run again")
        assert len(_given_back(caplog)) == 1
    assert not broker.stepped_down


def test_a_claim_still_waiting_on_the_server_when_its_connection_is_given_up_never_commits_unknown(
    broker, database_url, start_worker, caplog
):
    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    # Given the worker's claim of a new message waiting on the server for a table lock (a
    # migration's, a VACUUM FULL's)
    worker = start_worker(queues=["index"], threads=2)
    wait_for(lambda: query(database_url, "SELECT 1 FROM pg_stat_activity WHERE application_name = "
                                         "'standmeet-consumer-index' AND datname = current_database()"),
             timeout_s=10, what="the consumer to connect")
    message = held_through_a_cut.message("waiting-claim", 0.0)
    waiting_claim = ("SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' "
                     "AND application_name = 'standmeet-consumer-index'")
    with psycopg.connect(database_url) as holder, caplog.at_level(logging.INFO, logger="standmeet.broker"):
        holder.execute("LOCK TABLE standmeet.queue_pauses IN ACCESS EXCLUSIVE MODE")
        query(database_url, sql_enqueue.ENQUEUE, enqueue_params([message]))
        old_pid = wait_for(lambda: query(database_url, waiting_claim), timeout_s=10, what="the claim to wait")[0][0]
        # When the client gives that connection up (as its keepalives would in a partition:
        # the server does not know it yet) and the consumer connects again
        conn = worker.consumers["index"].consumer.conn
        cut = socket.socket(fileno=os.dup(conn.fileno()))
        cut.shutdown(socket.SHUT_RDWR)
        cut.close()
        # Then the abandoned session is ended before the check, its claim rolled back
        wait_for(lambda: any(f"server process {old_pid}) was ended" in r.getMessage() for r in caplog.records),
                 timeout_s=10, what="the consumer to end the abandoned claim session")
        assert not query(database_url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (old_pid,))
        holder.commit()
    # and the message is claimed again and runs, not left claimed by this live worker
    wait_for(lambda: "waiting-claim:done" in CUT_RUNS, timeout_s=10, what="the message to run")
    wait_for(lambda: _state(database_url, message.message_id) == ("done", 1), timeout_s=10,
             what="the message to be done on its first claim")


def test_a_claim_that_commits_after_the_check_on_a_session_that_could_not_be_ended_is_given_back_later(
    broker, database_url, start_worker, caplog, monkeypatch
):
    from broker.engine import sql, sql_enqueue
    from broker.engine.codec import enqueue_params
    from broker.pg.pool import DIRECT, UNPROBED, Topology

    # Given a worker whose connections may be a pooler's (its server sessions cannot be
    # ended), whose claims go out only when the test says so
    monkeypatch.setattr(broker, "topology", Topology(mode=DIRECT, prepare=True, listen_url=broker.url,
                                                      how=f"{UNPROBED}: the server did not answer the probe"))
    worker = start_worker(queues=["index"], threads=2)
    consumer = worker.consumers["index"].consumer
    claim_once, claiming, go_on = consumer.claim_once, threading.Event(), threading.Event()

    def claim_once_when_told(conn: psycopg.Connection) -> int:
        claiming.set()
        go_on.wait(10)
        return claim_once(conn)

    monkeypatch.setattr(consumer, "claim_once", claim_once_when_told)
    message = held_through_a_cut.message("late-claim", 0.0)
    query(database_url, sql_enqueue.ENQUEUE, enqueue_params([message]))
    assert claiming.wait(10), "the consumer did not claim"
    waiting = ("SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock' "
               "AND application_name = 'standmeet-consumer-index'")
    with psycopg.connect(database_url) as holder, caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        # and its claim of a queued message waiting on the server for a table lock
        holder.execute("LOCK TABLE dramatiq.queue IN SHARE MODE")  # no claim's update until it goes
        # (sent whole: a claim psycopg prepares first would wait in its Parse, the rest unsent)
        consumer.conn.prepare_threshold = None
        claiming.clear()
        go_on.set()
        wait_for(lambda: query(database_url, waiting), timeout_s=10, what="the claim to wait")
        go_on.clear()
        # When the client gives that connection up and the consumer connects again and
        # checks what this process holds, and only then the lock goes: the abandoned
        # claim commits after the check, within its window
        cut = socket.socket(fileno=os.dup(consumer.conn.fileno()))
        cut.shutdown(socket.SHUT_RDWR)
        cut.close()
        assert claiming.wait(sql.CLAIM_WITHIN_S / 2), "the consumer did not connect again and check"
        holder.commit()
    wait_for(lambda: _state(database_url, message.message_id) == ("consumed", 1), timeout_s=sql.CLAIM_WITHIN_S / 2,
             what="the abandoned claim to commit")
    go_on.set()
    # Then, once no claim of the abandoned session can commit any more, what this process
    # holds is checked again: the message is given back, runs and is done
    wait_for(lambda: _state(database_url, message.message_id) == ("done", 2), timeout_s=sql.CLAIM_WITHIN_S + 10,
             what="the message claimed after the check to be given back and run")
    assert "late-claim:done" in CUT_RUNS
    assert len(_given_back(caplog)) == 1


def test_a_claim_that_waited_past_its_deadline_claims_nothing(database_url):
    from broker.engine import sql, sql_enqueue
    from broker.engine.codec import claim_size_params, enqueue_params

    # Given a claim due to end 0.2 s from now by the server's clock, waiting on the
    # server for a table lock
    message = held_through_a_cut.message("window-a", 0.0)
    query(database_url, sql_enqueue.ENQUEUE, enqueue_params([message]))
    params = {"queue": "index", "n": 5, "n_start": 5, "worker_id": "00000000-0000-0000-0000-000000000001",
              "claim_until_s": scalar(database_url, "SELECT extract(epoch FROM clock_timestamp())::float8 + 0.2"),
              **claim_size_params(1 << 20)}
    claimed: list[Any] = []
    with psycopg.connect(database_url) as holder, psycopg.connect(database_url, autocommit=True) as claimer:
        holder.execute("LOCK TABLE standmeet.queue_pauses IN ACCESS EXCLUSIVE MODE")
        pid = claimer.info.backend_pid
        claiming = threading.Thread(target=lambda: claimed.extend(claimer.execute(sql.CLAIM, params).fetchall()))
        claiming.start()
        # When the lock goes only after the claim's deadline has passed
        wait_for(lambda: query(database_url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND wait_event_type = "
                                             "'Lock' AND now() - query_start > interval '0.3 s'", (pid,)),
                 timeout_s=10, what="the claim to wait past its deadline")
        holder.commit()
        claiming.join(10)
    # Then it claimed nothing: the message is still queued, for the next claim
    assert not claiming.is_alive() and claimed == []
    assert _state(database_url, message.message_id) == ("queued", 0)
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s RETURNING 1", (message.message_id,))


def test_an_outcome_lost_in_a_failover_no_connection_saw_is_given_back_at_the_next_heartbeat(
    broker, database_url, start_worker, caplog
):
    # Given a run that ended here a moment ago, its outcome written
    ran = _a_run_done_here(database_url, start_worker, "failover-c")
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        # When the database fails over behind a pooler, which hides it from every connection
        # of the process (the server answering now is another: a new timeline), and the
        # promoted server had the run's claim but not its settle
        with psycopg.connect(database_url) as conn:
            conn.execute("UPDATE standmeet.server_epoch SET identity = 'another server/0000000F'")
            conn.execute(SETTLE_LOST_IN_A_FAILOVER, (broker.worker_id, ran.message_id))
        # Then the next heartbeat sees the server changed, and the message is given back
        wait_for(lambda: CUT_RUNS.count("failover-c:done") == 2, timeout_s=4 * broker.settings.heartbeat_s + 10,
                 what="the run whose settle was lost to run again")
        assert len(_given_back(caplog)) == 1
        assert any("restarted or failed over" in r.getMessage() for r in caplog.records)
    assert not broker.stepped_down


def test_an_abandoned_claim_session_is_kept_until_it_has_been_ended(broker, database_url):
    # Given a consumer connected directly, its server session recorded
    assert broker.topology.known_direct
    consumer = broker.consume("index")
    try:
        first = consumer._connection()
        session = consumer.session
        assert session is not None and session[0] == first.info.backend_pid
        # When ending it, once that connection is given up, fails (the new connection is lost too)
        lost = psycopg.connect(database_url)
        lost.close()
        with pytest.raises(psycopg.OperationalError):
            consumer._end_abandoned_session(lost)
        # Then the session is kept, and ended by the next attempt
        assert consumer.session == session
        with psycopg.connect(database_url, autocommit=True) as live:
            consumer._end_abandoned_session(live)
        assert consumer.session is None
        assert not query(database_url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s", (session[0],))
    finally:
        consumer.close()


def test_a_consumer_records_no_session_to_end_where_the_connection_was_only_assumed_direct(broker, monkeypatch):
    from broker.pg.pool import DIRECT, UNPROBED, Topology

    # Given a topology the probe could not see (a pooler that did not answer at start-up)
    monkeypatch.setattr(broker, "topology", Topology(mode=DIRECT, prepare=True, listen_url=broker.url,
                                                      how=f"{UNPROBED}: the server did not answer the probe"))
    consumer = broker.consume("index")
    try:
        # When it connects, Then it records no server session it could end later: behind a
        # pooler that session would be another client's
        consumer._connection()
        assert consumer.session is None
    finally:
        consumer.close()


def _blame(database_url: str, message_id: str) -> tuple[int, str | None]:
    from tests.support.db import query

    crashes, blamed = query(database_url, "SELECT crashes, blamed_worker::text FROM dramatiq.queue "
                                          "WHERE message_id = %s", (message_id,))[0]
    return int(crashes), blamed
