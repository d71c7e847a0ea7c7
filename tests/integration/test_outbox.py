"""The outbox: transactional enqueue and emit, the relay, and their clear refusals."""

from __future__ import annotations

import statistics
import time
import uuid

import psycopg
import pytest

from broker import emit, enqueue
from broker.engine import sql
from broker.errors import InvalidPayload, PayloadTooLarge, UnknownTopic
from broker.outbox import MESSAGE_NAMESPACE, relay_once
from tests.conftest import configured_broker, slow_polls
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import mark

#: The index queue's fallback poll here: far above the latencies asserted, so that
#: only a NOTIFY can wake its consumer in time.
LONG_POLL_S = 30.0
WAKE_S = 5.0
#: The index consumer has made its first claim and gone idle (its last statement asks
#: when the next message is due).
#: The consumer's last statement before it sleeps is the next-due lookup.
NEXT_DUE_MARK = "WITH RECURSIVE priorities"
assert NEXT_DUE_MARK in sql.NEXT_DUE
CONSUMER_IDLE = f"""
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-consumer-index'
  AND state = 'idle' AND query LIKE '%{NEXT_DUE_MARK}%'
"""
RELAY_IDLE = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-relay' AND state = 'idle'
"""
#: Latest emit-to-start accepted: five times the worst seen on a loaded 2-core machine,
#: and far below the 30 s polls.
MAX_LATENESS_S = 2.0
ROW = "SELECT state::text, claims, message, eta, mtime FROM dramatiq.queue WHERE message_id = %s"
UNRELAY = "UPDATE standmeet.outbox SET relayed_at = NULL, relay_txid = NULL, messages = NULL WHERE id = %s"
RUNS = "SELECT count(*) FROM test_runs WHERE label = %s"


@pytest.fixture(scope="module")
def broker(database_url):
    with configured_broker(database_url, relay_poll_s=LONG_POLL_S,
                           **slow_polls(LONG_POLL_S, "index")) as configured:
        yield configured


def test_a_rollback_after_enqueue_or_emit_leaves_nothing_behind(broker, database_url):
    with psycopg.connect(database_url) as conn:
        with pytest.raises(RuntimeError), conn.transaction():
            message = enqueue(conn, "test.noop", "rolled-back")
            event_id = emit(conn, "document.written", {"document_id": 42})
            raise RuntimeError("the request failed after writing")
    assert query(database_url, "SELECT 1 FROM dramatiq.queue WHERE message_id = %s", (message.message_id,)) == []
    assert query(database_url, "SELECT 1 FROM standmeet.outbox WHERE id = %s", (event_id,)) == []


def test_a_committed_enqueue_is_there_and_wakes_consumers_at_commit(broker, database_url, start_worker):
    # Given an idle index consumer, which would not look at its queue again for 30 s
    start_worker(queues=["index"], threads=4)
    wait_for(lambda: scalar(database_url, CONSUMER_IDLE) == 1, timeout_s=20, what="the consumer to go idle")
    # When a transaction enqueues a job and commits
    with psycopg.connect(database_url) as conn, conn.transaction():
        message = enqueue(conn, "test.noop", "committed")
    committed = time.monotonic()
    # Then the commit's NOTIFY wakes the consumer, which runs the job within seconds
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=WAKE_S, what="the enqueued job")
    print(f"enqueue->done: {1000 * (time.monotonic() - committed):.0f} ms with a {LONG_POLL_S:g} s poll")


def test_enqueueing_the_id_of_a_message_that_ran_leaves_it_as_it_was(broker, database_url, start_worker):
    # Given a job that ran and is done
    start_worker(queues=["index"], threads=4)
    message = mark.send("ran-before-re-enqueue")
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=WAKE_S, what="the job to run")
    before = query(database_url, ROW, (message.message_id,))
    # When a message with its id is enqueued again (as a re-relayed event's would be)
    broker.enqueue(message.copy(args=("re-enqueued",)))
    # Then its row is untouched: still done (never claimable again), same text, same times
    assert query(database_url, ROW, (message.message_id,)) == before
    assert before[0][:2] == ("done", 1)
    assert scalar(database_url, RUNS, ("ran-before-re-enqueue",)) == 1
    assert scalar(database_url, RUNS, ("re-enqueued",)) == 0


def test_an_event_relayed_twice_runs_its_job_once(broker, database_url, start_worker):
    # Given an event whose job ran (relayed by the worker's relay)
    start_worker(queues=["index"], threads=4)
    with psycopg.connect(database_url) as conn, conn.transaction():
        event_id = emit(conn, "test.ping", {"label": "relayed-twice"})
    message_id = str(uuid.uuid5(MESSAGE_NAMESPACE, f"{event_id}/0"))
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message_id,)) == "done", timeout_s=WAKE_S, what="the event's job to run")
    before = query(database_url, ROW, (message_id,))
    # When its outbox row is put back to unrelayed and relayed again
    query(database_url, UNRELAY, (event_id,))
    with psycopg.connect(database_url, autocommit=True) as conn:
        relay_once(conn, limit=200)
    wait_for(lambda: scalar(database_url, "SELECT relayed_at IS NOT NULL FROM standmeet.outbox WHERE id = %s",
                            (event_id,)), timeout_s=WAKE_S, what="the event to be relayed again")
    # Then its message is still the one that ran, done after one claim, and the job ran once
    assert query(database_url, ROW, (message_id,)) == before
    assert before[0][:2] == ("done", 1)
    assert scalar(database_url, RUNS, ("relayed-twice",)) == 1


@pytest.mark.parametrize(
    "topic, payload, error, words",
    [
        ("no.such.topic", {}, UnknownTopic, "no route for topic 'no.such.topic'"),
        ("document.written", {"document_id": 1, "blob": "x" * 70_000}, PayloadTooLarge, "over the cap of 65536"),
        ("document.written", {"title": "no id"}, UnknownTopic, "does not fit the route to corpus.index"),
        ("document.written", {"document_id": 1, "_trace": "mine"}, InvalidPayload, "keeps for the trace"),
    ],
    ids=["unknown-topic", "oversized", "payload-that-fits-no-route", "the-outbox-trace-key"],
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
    assert query(database_url, "SELECT id, messages FROM standmeet.outbox WHERE relayed_at IS NOT NULL"
                               " AND id = ANY(%s) ORDER BY id", ([*good, bad],)) == [(good[0], 1), (good[1], 1)]
    (error,) = query(database_url, "SELECT error FROM standmeet.outbox WHERE id = %s", (bad,))[0]
    assert "KeyError" in error and "document_id" in error
    args = sorted(r[0] for r in query(database_url,
                  "SELECT (message->'args'->>0)::int FROM dramatiq.queue WHERE message->>'actor_name' = 'corpus.index'"
                  " AND (message->'args'->>0)::int IN (101, 102)"))
    assert args == [101, 102]


@pytest.mark.parametrize("routes", ["5", "true", '"corpus.index"', "[1]", "[null]", '{"a": 1}'])
def test_an_event_whose_routes_are_not_a_list_of_actor_names_fails_alone_with_its_reason(
        broker, database_url, routes):
    # Given an old event whose routes column another writer than emit filled with something
    # else than a list of actor names, and a good event after it
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM standmeet.outbox")
        (bad,) = conn.execute("INSERT INTO standmeet.outbox (topic, payload, routes, created_at)"
                              " VALUES ('document.written', '{\"document_id\": 7}', %s::jsonb,"
                              " now() - interval '1 hour') RETURNING id", (routes,)).fetchone()
        with conn.transaction():
            good = emit(conn, "document.written", {"document_id": 8})
        # When a relay pass takes both
        result = relay_once(conn, limit=200)
    # Then the bad one is kept with its reason, and the good one relayed
    assert (result.claimed, result.messages, result.failed) == (2, 1, 1)
    (error,) = query(database_url, "SELECT error FROM standmeet.outbox WHERE id = %s", (bad,))[0]
    assert "routes are not a list of actor names" in error
    assert query(database_url, "SELECT relayed_at IS NOT NULL FROM standmeet.outbox WHERE id = %s", (good,)) == [(True,)]


def test_an_emitted_write_reaches_an_index_consumer_within_100_ms_at_idle(broker, database_url, start_worker):
    # Given an idle worker (which runs the relay, as every worker process does), whose
    # consumer and relay would poll only every 30 s
    start_worker(queues=["index"], threads=4)
    wait_for(lambda: scalar(database_url, CONSUMER_IDLE) == 1 and scalar(database_url, RELAY_IDLE) == 1,
             timeout_s=20, what="the consumer and the relay to go idle")
    lateness = []
    for i in range(20):
        label = f"emit-latency-{i}"
        # When a write emits its event and commits
        with psycopg.connect(database_url) as conn:
            with conn.transaction():
                emit(conn, "test.ping", {"label": label})
                (committed_at,) = conn.execute("SELECT clock_timestamp()").fetchone()
        started = wait_for(lambda lb=label: scalar(database_url, "SELECT started_at FROM test_runs WHERE label = %s",
                                                   (lb,)), timeout_s=WAKE_S, what=f"the job of {label}")
        lateness.append((started - committed_at).total_seconds())
    # Then the job typically starts within 100 ms of the commit, and every one well within
    # a second: only the NOTIFYs of emit and enqueue can do that with 30 s polls (on a
    # loaded machine a few take longer than 100 ms; the median still holds)
    median = statistics.median(lateness)
    assert median < 0.1, sorted(lateness)
    assert max(lateness) < MAX_LATENESS_S, sorted(lateness)
    print(f"emit->start: median {median * 1000:.1f} ms, max {max(lateness) * 1000:.1f} ms")


@pytest.mark.slow  # writes 280 MB twice: what the limit takes
def test_a_relay_pass_whose_messages_together_pass_jsonbs_limit_is_written_in_several_statements(
        broker, database_url):
    # Given 460 events of 600 kB each, every one within every cap (the operator raised the
    # payload cap to 1 MiB), together 276 MB: more than one jsonb value may hold (256 MiB)
    blob = "x" * 600_000
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM standmeet.outbox")
        with conn.transaction():
            ids = [emit(conn, "test.ping", {"label": blob}, max_payload_bytes=1 << 20) for _ in range(460)]
        # When one relay pass takes them all
        result = relay_once(conn, limit=500, topics=["test.ping"])
    # Then every one is relayed, none failed
    assert (result.claimed, result.messages, result.failed) == (460, 460, 0)
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE id = ANY(%s) AND relayed_at IS NOT NULL",
                  (ids,)) == 460
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
          ([str(uuid.uuid5(MESSAGE_NAMESPACE, f"{i}/0")) for i in ids],))
