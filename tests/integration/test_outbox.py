"""The outbox: transactional enqueue and emit, the relay, and their clear refusals."""

from __future__ import annotations

import statistics

import psycopg
import pytest

from broker import emit, enqueue
from broker.errors import PayloadTooLarge, UnknownTopic
from broker.outbox import relay_once
from tests.support.db import query, scalar, wait_for


def test_a_rollback_after_enqueue_or_emit_leaves_nothing_behind(broker, database_url):
    with psycopg.connect(database_url) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            message = enqueue(conn, "test.noop", "rolled-back")
            event_id = emit(conn, "document.written", {"document_id": 42})
            raise RuntimeError("the request failed after writing")
    assert query(database_url, "SELECT 1 FROM dramatiq.queue WHERE message_id = %s", (message.message_id,)) == []
    assert query(database_url, "SELECT 1 FROM standmeet.outbox WHERE id = %s", (event_id,)) == []


def test_a_committed_enqueue_is_there_and_wakes_consumers_at_commit(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    with psycopg.connect(database_url) as conn, conn.transaction():
        message = enqueue(conn, "test.noop", "committed")
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=10, what="the enqueued job")


@pytest.mark.parametrize(
    "topic, payload, error, words",
    [
        ("no.such.topic", {}, UnknownTopic, "no route for topic 'no.such.topic'"),
        ("document.written", {"document_id": 1, "blob": "x" * 70_000}, PayloadTooLarge, "over the cap of 65536"),
        ("document.written", {"title": "no id"}, UnknownTopic, "does not fit the route to corpus.index"),
    ],
    ids=["unknown-topic", "oversized", "payload-that-fits-no-route"],
)
def test_a_refused_event_fails_at_emit_and_the_transaction_commits_its_other_work(
    broker, database_url, topic, payload, error, words
):
    with psycopg.connect(database_url) as conn, conn.transaction():
        (doc_id,) = conn.execute(
            "INSERT INTO standmeet.documents (title) VALUES ('kept') RETURNING id").fetchone()
        before = conn.execute("SELECT count(*) FROM standmeet.outbox").fetchone()
        with pytest.raises(error) as info:
            emit(conn, topic, payload)
        assert words in str(info.value)
        assert conn.execute("SELECT count(*) FROM standmeet.outbox").fetchone() == before
    assert query(database_url, "SELECT title FROM standmeet.documents WHERE id = %s", (doc_id,)) == [("kept",)]


def test_a_relay_pass_turns_events_into_their_messages_and_keeps_a_bad_one_with_its_error(broker, database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM standmeet.outbox")
        with conn.transaction():
            good = [emit(conn, "document.written", {"document_id": i}) for i in (101, 102)]
        # a row written around emit's checks (an older release, a hand edit)
        (bad,) = conn.execute("INSERT INTO standmeet.outbox (topic, payload) VALUES ('document.written', '{}')"
                              " RETURNING id").fetchone()
        result = relay_once(conn, limit=200)
    assert (result.claimed, result.messages, result.failed) == (3, 2, 1)
    assert query(database_url, "SELECT id, messages FROM standmeet.outbox WHERE relayed_at IS NOT NULL ORDER BY id") == [
        (good[0], 1), (good[1], 1)]
    (error,) = query(database_url, "SELECT error FROM standmeet.outbox WHERE id = %s", (bad,))[0]
    assert "KeyError" in error and "document_id" in error
    args = sorted(r[0] for r in query(database_url,
                  "SELECT (message->'args'->>0)::int FROM dramatiq.queue WHERE message->>'actor_name' = 'corpus.index'"
                  " AND (message->'args'->>0)::int IN (101, 102)"))
    assert args == [101, 102]


def test_an_emitted_write_reaches_an_index_consumer_within_100_ms_at_idle(broker, database_url, start_worker):
    # Given an idle worker (which runs the relay, as every worker process does)
    start_worker(queues=["index"], threads=4)
    lateness = []
    for i in range(20):
        label = f"r5-{i}"
        # When a write emits its event and commits
        with psycopg.connect(database_url) as conn:
            with conn.transaction():
                emit(conn, "test.ping", {"label": label})
                (committed_at,) = conn.execute("SELECT clock_timestamp()").fetchone()
        started = wait_for(lambda lb=label: scalar(database_url, "SELECT started_at FROM test_runs WHERE label = %s",
                                                   (lb,)), timeout_s=5, what=f"the job of {label}")
        lateness.append((started - committed_at).total_seconds())
    # Then the job starts within 100 ms of the commit
    lateness.sort()
    p95 = lateness[int(0.95 * len(lateness))]
    assert p95 < 0.1, lateness
    print(f"emit->start: median {statistics.median(lateness) * 1000:.1f} ms, p95 {p95 * 1000:.1f} ms")
