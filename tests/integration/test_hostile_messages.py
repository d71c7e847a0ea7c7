"""Hostile messages: a run with no outcome is bounded, bad options and values are refused
before any SQL, an unencodable result fails its job, and a huge message is logged short."""

from __future__ import annotations

import logging
import time

import dramatiq
import psycopg
import pytest
from dramatiq.results import ResultFailure

from broker.engine.enqueue import enqueue as enqueue_in
from broker.errors import InvalidMessage
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import bump, noop

MAX_RUNS = 5  # STANDMEET_MAX_RUNS_WITHOUT_OUTCOME's default, which the test broker keeps


def _no_response(retries: int, exc: BaseException) -> bool:
    return exc.response.status_code >= 500  # type: ignore[attr-defined]  # the bug under test


@dramatiq.actor(actor_name="test.hostile.bad_retry_when", queue_name="index", retry_when=_no_response)
def bad_retry_when(key: str) -> None:
    bump(key)  # a side effect each run
    raise RuntimeError("no response attribute on this one")


@dramatiq.actor(actor_name="test.hostile.returns_a_set", queue_name="index", store_results=True, max_retries=3)
def returns_a_set(key: str) -> set[int]:
    bump(key)
    return {1, 2}


@dramatiq.actor(actor_name="test.hostile.returns_a_number", queue_name="index", store_results=True)
def returns_a_number() -> int:
    return 42


@dramatiq.actor(actor_name="test.hostile.fails_with_huge_args", queue_name="index", max_retries=0)
def fails_with_huge_args(blob: str) -> None:
    raise ValueError("refused")


def _settled(url: str, message_id: str, timeout_s: float = 20) -> tuple[str, str | None]:
    def done() -> tuple[str, str | None] | None:
        rows = query(url, "SELECT state::text, error FROM dramatiq.queue WHERE message_id = %s", (message_id,))
        return rows[0] if rows and rows[0][0] in ("done", "rejected") else None

    return wait_for(done, timeout_s=timeout_s, what=f"message {message_id} to settle")


def _count(url: str, key: str) -> int:
    return int(scalar(url, "SELECT coalesce(max(value), 0) FROM test_counters WHERE key = %s", (key,)))


def test_a_run_whose_retry_logic_raises_is_rejected_after_the_runs_without_outcome_allowed(
        broker, database_url, start_worker):
    # Given an actor whose retry_when reads e.response of an exception that has none
    start_worker(queues=["index"], threads=2)
    message = bad_retry_when.send("no-outcome")
    # Then the message is rejected after STANDMEET_MAX_RUNS_WITHOUT_OUTCOME runs, not run forever
    state, error = _settled(database_url, message.message_id)
    assert state == "rejected"
    assert _count(database_url, "no-outcome") == MAX_RUNS
    assert f"{MAX_RUNS} runs ended with no outcome" in error
    assert "AttributeError" in error and "Retries" in error
    assert scalar(database_url, "SELECT runs_without_outcome FROM dramatiq.queue WHERE message_id = %s",
                  (message.message_id,)) == MAX_RUNS


@pytest.mark.parametrize(("options", "named"), [
    ({"max_retries": "3"}, "max_retries='3'"),
    ({"time_limit": -1}, "time_limit=-1"),
    ({"time_limit": "x"}, "time_limit='x'"),
    ({"min_backoff": "10"}, "min_backoff='10'"),
    ({"max_backoff": float("nan")}, "max_backoff=nan"),
    ({"max_age": -5}, "max_age=-5"),
    ({"delay": -5}, "delay=-5"),
    ({"delay": "soon"}, "delay='soon'"),
    ({"priority": 1.5}, "priority=1.5"),
    ({"store_results": "yes"}, "store_results='yes'"),
])
def test_a_bad_option_value_is_refused_at_send_naming_the_option_and_the_value(broker, database_url, options, named):
    before = scalar(database_url, "SELECT count(*) FROM dramatiq.queue")
    with pytest.raises(InvalidMessage) as refused:
        noop.send_with_options(args=("bad-option",), **options)
    text = str(refused.value)
    assert named in text and "\n" not in text
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue") == before


BAD_VALUES = [
    (float("nan"), "nan"),
    (float("inf"), "inf"),
    ("a\x00b", "NUL"),
    ("a\ud800b", "lone surrogate"),
    ({"deep": {1: "x"}}, "non-string key"),
    (object(), "not JSON"),
]


@pytest.mark.parametrize(("value", "words"), BAD_VALUES)
def test_enqueue_refuses_what_emit_refuses_before_any_sql_and_the_transaction_goes_on(
        broker, database_url, value, words):
    with psycopg.connect(database_url) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO test_counters (key, value) VALUES ('tx-usable', 1) "
                         "ON CONFLICT (key) DO UPDATE SET value = test_counters.value + 1")
            with pytest.raises(InvalidMessage, match=words) as refused:
                enqueue_in(conn, noop, {"payload": [value]})
            assert "$" in str(refused.value) and "\n" not in str(refused.value)
            with pytest.raises(InvalidMessage, match=words):
                broker.enqueue_many([noop.message("fine"), noop.message(value)], conn=conn)
            # the caller's transaction was not aborted: it goes on and commits
            good = enqueue_in(conn, noop, "after-a-refusal")
    assert query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                 (good.message_id,)) == [("queued",)]
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (good.message_id,))


@pytest.mark.parametrize(("value", "words"), BAD_VALUES[:4])
def test_a_send_with_a_value_postgres_refuses_is_one_clear_error(broker, value, words):
    with pytest.raises(InvalidMessage, match=words):
        noop.send(value)


BAD_IDS = [
    ("not-a-uuid", "'not-a-uuid'"),
    ("0B5A1C2D-0000-4000-8000-000000000001", "'0B5A1C2D-"),  # Postgres would give it back lowercase
    ("{0b5a1c2d-0000-4000-8000-000000000001}", "'{0b5a1c2d-"),
    ("0b5a1c2d00004000800000000000000a", "'0b5a1c2d0000"),
    (12, "id 12 "),
    ("x" * 10_000, "'xxxx"),
]


@pytest.mark.parametrize(("message_id", "named"), BAD_IDS)
def test_a_message_whose_id_is_not_a_uuid_in_dramatiqs_form_is_refused_naming_it_on_every_path(
        broker, database_url, message_id, named):
    before = scalar(database_url, "SELECT count(*) FROM dramatiq.queue")
    bad = noop.message("bad-id").copy(message_id=message_id)
    for send in (lambda: broker.enqueue(bad),                              # actor.send()
                 lambda: broker.enqueue_many([noop.message("fine"), bad]),  # a batch, copied
                 lambda: broker.enqueue_many([noop.message("fine").copy(options={"unique_key": "k"}), bad])):
        with pytest.raises(InvalidMessage) as refused:
            send()
        text = str(refused.value)
        assert named in text and "not a UUID" in text and "\n" not in text and len(text) < 400, text
    with psycopg.connect(database_url) as conn, conn.transaction():  # on the caller's connection, too
        with pytest.raises(InvalidMessage, match="not a UUID"):
            broker.enqueue_many([bad], conn=conn)
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue") == before


def test_a_batch_holding_one_id_twice_is_refused_naming_it_and_nothing_is_written(broker, database_url):
    before = scalar(database_url, "SELECT count(*) FROM dramatiq.queue")
    twice = noop.message("twice")
    for batch in ([noop.message("a"), twice, noop.message("b"), twice.copy(args=("again",))],
                  [twice.copy(options={"unique_key": "u1"}), twice.copy(options={"unique_key": "u2"})]):
        with pytest.raises(InvalidMessage) as refused:
            broker.enqueue_many(batch)
        assert twice.message_id in str(refused.value) and "twice" in str(refused.value)
        with psycopg.connect(database_url) as conn, conn.transaction():
            with pytest.raises(InvalidMessage, match="twice"):
                broker.enqueue_many(batch, conn=conn)
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue") == before


def test_an_unencodable_result_fails_the_job_with_the_reason_and_a_waiter_gets_it_at_once(
        broker, database_url, start_worker):
    start_worker(queues=["index"], threads=2)
    message = returns_a_set.send("a-set")
    started = time.monotonic()
    with pytest.raises(ResultFailure) as failure:
        message.get_result(block=True, timeout=30_000)
    assert time.monotonic() - started < 10  # not the whole 30 s timeout
    assert "cannot be stored" in str(failure.value)
    state, error = _settled(database_url, message.message_id)
    assert state == "rejected"
    assert "ResultRefused: the result of 'test.hostile.returns_a_set' cannot be stored: set is not JSON" in error
    assert _count(database_url, "a-set") == 1  # failed for good: not retried


def test_an_actor_returning_a_value_logs_no_false_missing_results_warning(
        broker, database_url, start_worker, caplog):
    caplog.set_level(logging.WARNING, logger="dramatiq")
    start_worker(queues=["index"], threads=2)
    message = returns_a_number.send()
    assert message.get_result(block=True, timeout=20_000) == 42
    _settled(database_url, message.message_id)
    assert not [r for r in caplog.records if "Results middleware" in r.getMessage()]


def test_a_failing_message_with_huge_arguments_is_logged_in_a_few_hundred_characters(
        broker, database_url, start_worker, caplog):
    caplog.set_level(logging.INFO)
    start_worker(queues=["index"], threads=2)
    message = fails_with_huge_args.send("x" * 500_000)
    assert _settled(database_url, message.message_id)[0] == "rejected"
    failed = [r for r in caplog.records if "Failed to process message" in r.getMessage()]
    assert failed, "Dramatiq's failure line was not logged"
    assert max(len(r.getMessage()) for r in caplog.records) < 1_000
