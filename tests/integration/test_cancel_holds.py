"""Cancel holds everywhere: a cancelled message is never claimed again, and every path
that ends its claim (a settle, a give-back, a graceful stop, a crash rescue) settles it
as cancelled, never done nor queued."""

from __future__ import annotations

import logging
import time
import uuid

import dramatiq
import psycopg

from broker import ops
from broker.engine import sql, sql_enqueue
from broker.engine.codec import claim_size_params, enqueue_params
from broker.settings import MIB
from tests.support.db import lock_waits, query, scalar, wait_for
from tests.support.jobs import noop, record_finish, record_start

CLAIM_SIZES = {**claim_size_params(MIB), "claim_until_s": None}
#: How long the holding actor waits for its release before it gives up (a test bound).
HOLD_LIMIT_S = 30


@dramatiq.actor(actor_name="test.cancel_holds.hold", queue_name="index", max_retries=0)
def hold(key: str) -> None:
    """Runs until the test releases it (a counter row), then returns."""
    run = record_start("test.cancel_holds.hold", "index", key)
    released = f"release:{key}"
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not scalar_released(released):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{key} was never released")
        time.sleep(0.01)  # the job's own wait for its release, not the test's
    record_finish(run)


def scalar_released(key: str) -> bool:
    from broker.pg import db

    with db.connection() as conn:
        return conn.execute("SELECT 1 FROM test_counters WHERE key = %s", (key,)).fetchone() is not None


def _row(url: str, message_id: str) -> tuple[str, str | None, object]:
    rows = query(url, "SELECT state::text, error, cancelled_at FROM dramatiq.queue WHERE message_id = %s",
                 (message_id,))
    assert rows, message_id
    return rows[0]


def _claimed(url: str, label: str, *, started: bool) -> tuple[str, str, int]:
    """A message of ``noop`` enqueued and claimed by a process that is not running (no row
    in worker_processes): (message id, that process's id, claim number)."""
    message = noop.message(label)
    worker = str(uuid.uuid4())
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
        conn.execute("UPDATE dramatiq.queue SET queue_name = 'cancel_holds' WHERE message_id = %s",
                     (message.message_id,))
        rows = conn.execute(sql.CLAIM, {"queue": "cancel_holds", "n": 1, "n_start": 1 if started else 0,
                                        "worker_id": worker, **CLAIM_SIZES}).fetchall()
    assert [r[3] for r in rows] == [message.message_id]
    return message.message_id, worker, int(rows[0][1])


def _cancel(url: str, message_id: str) -> None:
    with psycopg.connect(url) as conn:
        assert ops.cancel_jobs(conn, message_ids=[message_id], by="ops@host") == 1


def _assert_cancelled(url: str, message_id: str, how: str) -> None:
    state, error, cancelled_at = _row(url, message_id)
    assert (state, cancelled_at is not None) == ("rejected", True), (state, error)
    assert error.startswith("cancelled by ops@host at ") and how in error, error


def test_a_cancelled_running_job_that_returns_is_settled_as_cancelled_not_done(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=2)
    message = hold.send("returns-after-cancel")
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'returns-after-cancel'"),
             timeout_s=15, what="the job to start")
    _cancel(database_url, message.message_id)
    query(database_url, "INSERT INTO test_counters (key, value) VALUES ('release:returns-after-cancel', 1)")
    wait_for(lambda: _row(database_url, message.message_id)[0] != "consumed", timeout_s=15,
             what="the run to be settled")
    _assert_cancelled(database_url, message.message_id, "its run returned after the cancellation")


@dramatiq.actor(actor_name="test.cancel_holds.checks", queue_name="index", max_retries=5)
def checks(key: str) -> None:
    """Runs until it is cancelled (its check raises), or for HOLD_LIMIT_S."""
    from broker import deadline as job_deadline

    record_start("test.cancel_holds.checks", "index", key)
    end = time.monotonic() + HOLD_LIMIT_S
    while time.monotonic() < end:
        job_deadline.check()
        time.sleep(0.01)


def test_a_cancelled_running_job_is_counted_and_logged_as_rejected_never_as_a_retry(
        broker, database_url, start_worker, caplog):
    from prometheus_client import REGISTRY

    def count(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"queue_name": "index", "actor_name": "test.cancel_holds.checks"}) or 0.0

    # Given a running job that looks for a cancel, on an actor that retries
    start_worker(queues=["index"], threads=2)
    before = {n: count(n) for n in ("dramatiq_message_retries_total", "dramatiq_message_rejects_total")}
    with caplog.at_level(logging.INFO, logger="standmeet.jobs"):
        message = checks.send("cancelled-while-running")
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'cancelled-while-running'"),
                 timeout_s=15, what="the job to start")
        # When an operator cancels it
        _cancel(database_url, message.message_id)
        wait_for(lambda: _row(database_url, message.message_id)[0] != "consumed", timeout_s=15,
                 what="the run to be settled")
        wait_for(lambda: count("dramatiq_message_rejects_total") > before["dramatiq_message_rejects_total"],
                 timeout_s=5, what="the reject counted")
    # Then it is rejected as cancelled, counted as a reject and no retry, and logged so
    _assert_cancelled(database_url, message.message_id, "its run was stopped")
    assert "JobCancelled" in scalar(database_url, "SELECT message->'options'->>'traceback' FROM dramatiq.queue"
                                                  " WHERE message_id = %s", (message.message_id,))
    assert count("dramatiq_message_retries_total") == before["dramatiq_message_retries_total"]
    outcomes = [r.outcome for r in caplog.records if getattr(r, "message_id", None) == message.message_id]
    assert outcomes == ["rejected"], outcomes


def test_a_run_that_returned_before_the_cancel_was_made_is_recorded_done(broker, database_url, start_worker):
    # Given a running job, and an operator's transaction holding its row (as a bulk
    # cancel's does while it works)
    start_worker(queues=["index"], threads=2)
    message = hold.send("returns-before-cancel")
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'returns-before-cancel'"),
             timeout_s=15, what="the job to start")
    with psycopg.connect(database_url) as operator:
        operator.execute("SELECT 1 FROM dramatiq.queue WHERE message_id = %s FOR UPDATE", (message.message_id,))
        # When the run returns, its outcome waits for the row, and only then the cancel is made
        query(database_url, "INSERT INTO test_counters (key, value) VALUES ('release:returns-before-cancel', 1)")
        wait_for(lambda: scalar(database_url, "SELECT finished_at IS NOT NULL FROM test_runs"
                                              " WHERE label = 'returns-before-cancel'"), timeout_s=15,
                 what="the run to return")
        wait_for(lambda: lock_waits(database_url, statement="dramatiq.queue"), timeout_s=15,
                 what="its outcome to wait for the row")
        assert ops.cancel_jobs(operator, message_ids=[message.message_id], by="ops@host") == 1
        operator.commit()
    # Then the run is recorded as it ended: done (the cancel came too late to stop anything)
    wait_for(lambda: _row(database_url, message.message_id)[0] != "consumed", timeout_s=15,
             what="the run to be settled")
    state, error, cancelled_at = _row(database_url, message.message_id)
    assert (state, error, cancelled_at is not None) == ("done", None, True)


def test_a_prefetched_job_cancelled_before_it_starts_is_given_back_rejected_and_never_runs(
        broker, database_url, start_worker):
    # Given the queue's four slots held by running jobs, and a fifth job prefetched behind them
    held = [f"slot-holder-{n}" for n in range(4)]
    for key in held:
        hold.send(key)
    waiting = hold.send("prefetched-then-cancelled")
    start_worker(queues=["index"], threads=8)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label LIKE 'slot-holder-%%'") == 4,
             timeout_s=15, what="the four jobs to start")
    wait_for(lambda: query(database_url, "SELECT state::text, started_at FROM dramatiq.queue WHERE message_id = %s",
                           (waiting.message_id,)) == [("consumed", None)], timeout_s=15,
             what="the fifth to be prefetched, not started")
    try:
        # When an operator cancels it while it waits for a slot
        _cancel(database_url, waiting.message_id)
        # Then it is given back and rejected before any slot frees: it never runs
        wait_for(lambda: _row(database_url, waiting.message_id)[0] == "rejected", timeout_s=15,
                 what="the cancelled job to be given back")
        _assert_cancelled(database_url, waiting.message_id, "not run")
    finally:
        for key in held:
            query(database_url, "INSERT INTO test_counters (key, value) VALUES (%s, 1)", (f"release:{key}",))
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label LIKE 'slot-holder-%%'"
                                          " AND finished_at IS NOT NULL") == 4, timeout_s=15,
             what="the four jobs to end")
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'prefetched-then-cancelled'") == 0


def _claim_index(url: str, worker: str) -> dict[str, int]:
    """Claim what the index queue holds for ``worker`` (a process that is not running):
    claim numbers by message id."""
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(sql.CLAIM, {"queue": "index", "n": 10, "n_start": 10, "worker_id": worker,
                                        **CLAIM_SIZES}).fetchall()
    return {str(r[3]): int(r[1]) for r in rows}


def _keyed_rows(url: str, key_of: str) -> list[tuple[str, str, bool]]:
    return [(str(m), s, live) for m, s, live in query(
        url, "SELECT message_id, state::text, standmeet.unique_live(unique_states, state) FROM dramatiq.queue"
             " WHERE unique_key = (SELECT unique_key FROM dramatiq.queue WHERE message_id = %s)"
             " ORDER BY enqueued_at, message_id", (key_of,))]


def test_a_run_to_be_retried_is_rejected_by_a_cancel_made_after_it_ended_and_takes_no_key_back(
        broker, database_url):
    from broker.engine.settler import Outcome, settle_params
    from tests.support import unique_jobs

    # Given a unique job's run that raised a second ago, its retry not yet written, then
    # cancelled by an operator, and the same call sent again (the cancel freed the key)
    query(database_url, "DELETE FROM dramatiq.queue WHERE queue_name = 'index'")
    worker = str(uuid.uuid4())
    first = unique_jobs.unique_slow.send_with_options(args=("late", 0), unique_key="late-retry")
    claims = _claim_index(database_url, worker)
    ended = time.monotonic() - 1.0
    _cancel(database_url, first.message_id)
    again = unique_jobs.unique_slow.send_with_options(args=("late", 0), unique_key="late-retry")
    assert again.message_id != first.message_id
    # When its retry is settled
    outcome = Outcome(first.message_id, claims[first.message_id], "index", "queued", None, delay_s=3600,
                      error="boom", attempt="failed", actor_name="test.unique_slow", started_mono=ended - 1,
                      ended_mono=ended)
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SETTLE, {**settle_params([outcome], []), "worker_id": worker, "max_runs_without_outcome": 5})
    # Then it is rejected, not retried (cancel is final), and the new message alone holds the key
    _assert_cancelled(database_url, first.message_id, "not retried")
    assert _keyed_rows(database_url, again.message_id) == [(first.message_id, "rejected", False),
                                                          (again.message_id, "queued", True)]


def test_a_run_done_in_its_period_cancelled_too_late_takes_no_key_back_and_its_batch_settles(
        broker, database_url):
    from tests.support import unique_jobs

    # Given a once-an-hour unique job and a plain one, both run to the end a second ago,
    # their outcomes not yet written; the first cancelled then, and the same call sent again
    query(database_url, "DELETE FROM dramatiq.queue WHERE queue_name = 'index'")
    worker = str(uuid.uuid4())
    first = unique_jobs.unique_per_hour.send("late-done")
    other = unique_jobs.plain.send("late-done-other")
    claims = _claim_index(database_url, worker)
    ended = time.monotonic() - 1.0
    _cancel(database_url, first.message_id)
    again = unique_jobs.unique_per_hour.send("late-done")
    assert again.message_id != first.message_id
    # When their outcomes are written together
    now = time.monotonic()
    ids = [first.message_id, other.message_id]
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql.SETTLE_DONE, {"ids": ids, "claims": [claims[i] for i in ids], "worker_id": worker,
                                       "s_ids": [], "s_claims": [], "awaited": [], "actors": ["x", "x"],
                                       "started_ago": [now - ended + 1] * 2, "ended_ago": [now - ended] * 2})
    # Then both are done (the cancel came too late), and only the new message holds the key
    assert _row(database_url, first.message_id)[:2] == ("done", None)
    assert _row(database_url, other.message_id)[:2] == ("done", None)
    assert _keyed_rows(database_url, again.message_id) == [(first.message_id, "done", False),
                                                          (again.message_id, "queued", True)]


def test_a_cancelled_prefetched_message_given_back_is_rejected_not_requeued(broker, database_url):
    message_id, worker, claim = _claimed(database_url, "prefetched", started=False)
    _cancel(database_url, message_id)
    query(database_url, sql.REQUEUE, {"ids": [message_id], "claims": [claim], "worker_id": worker})
    _assert_cancelled(database_url, message_id, "not run")


def test_a_cancelled_message_held_by_a_gracefully_stopped_worker_is_rejected_not_requeued(broker, database_url):
    message_id, worker, _ = _claimed(database_url, "stopped", started=True)
    _cancel(database_url, message_id)
    query(database_url, sql.STOP_WORKER, {"worker_id": worker})
    _assert_cancelled(database_url, message_id, "its worker stopped while holding it")


def test_a_cancelled_message_of_a_dead_worker_is_rejected_by_rescue_not_requeued(broker, database_url):
    message_id, _, _ = _claimed(database_url, "rescued", started=True)
    _cancel(database_url, message_id)
    # the rescue of a process with no heartbeat row, by another one, with a window that has passed
    epoch_age_s = scalar(database_url, "SELECT EXTRACT(EPOCH FROM now() - standmeet.server_epoch_since())::float8")
    query(database_url, sql.RESCUE, {"after_s": min(1.0, epoch_age_s / 2), "max_crashes": 3,
                                     "worker_id": str(uuid.uuid4())})
    _assert_cancelled(database_url, message_id, "its worker process died holding it")


def test_a_queued_row_marked_cancelled_is_rejected_by_the_claim_and_never_handed_out(broker, database_url):
    message = noop.message("queued-cancelled")
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
        conn.execute("UPDATE dramatiq.queue SET queue_name = 'cancel_holds', cancelled_at = now(),"
                     " cancelled_by = 'ops@host' WHERE message_id = %s", (message.message_id,))
        rows = conn.execute(sql.CLAIM, {"queue": "cancel_holds", "n": 5, "n_start": 5,
                                        "worker_id": str(uuid.uuid4()), **CLAIM_SIZES}).fetchall()
    assert [(r[0], r[3]) for r in rows] == [(None, message.message_id)]  # no text: never loaded
    _assert_cancelled(database_url, message.message_id, "found queued; not run")
