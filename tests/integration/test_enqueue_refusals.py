"""What a send refuses, it refuses in one line of our own errors before any statement, on
every path (``send``, ``enqueue_many`` on the pool or the caller's connection, with unique
keys); what Postgres refuses mid-batch leaves nothing of the batch, on an autocommit
connection and in pipeline mode too; and an id sent again takes its new queue."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterator
from typing import Any

import dramatiq
import psycopg
import pytest

from broker import enqueue_many
from broker.engine.codec import DISTINCT_IN_A_SET
from broker.errors import ConfigError, DatabaseError, InvalidMessage, MessageRefused
from tests.support import unique_jobs
from tests.support.db import query, scalar
from tests.support.jobs import mark, post

COUNT = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"

def _ids(messages: list[Any]) -> list[str]:
    return [m.message_id for m in messages]


@pytest.fixture
def refusing_boom(database_url: str) -> Iterator[None]:
    """The queue table refuses a row whose first argument is 'boom' (a server-side refusal
    after the batch's checks passed), for this test only."""
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("""
            CREATE OR REPLACE FUNCTION public.test_no_boom() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF NEW.message -> 'args' ->> 0 = 'boom' THEN RAISE EXCEPTION 'boom refused by the test'; END IF;
                RETURN NEW;
            END $$""")
        conn.execute("CREATE TRIGGER test_no_boom BEFORE INSERT ON dramatiq.queue "
                     "FOR EACH ROW EXECUTE FUNCTION public.test_no_boom()")
    try:
        yield
    finally:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DROP TRIGGER test_no_boom ON dramatiq.queue")
            conn.execute("DROP FUNCTION public.test_no_boom()")


def _every_path(broker: dramatiq.Broker, database_url: str, bad: Any) -> list[Callable[[], object]]:
    """Each way a message is written, sending ``bad`` (beside good ones in a batch)."""
    def on_a_connection() -> object:
        with psycopg.connect(database_url) as conn:
            return broker.enqueue_many([mark.message("fine"), bad], conn=conn)

    return [lambda: broker.enqueue(bad),
            lambda: broker.enqueue_many([mark.message("fine"), bad]),
            lambda: broker.enqueue_many([unique_jobs.unique.message("refusal-key"), bad]),
            on_a_connection]


@pytest.mark.parametrize(("make_bad", "named"), [
    (lambda: mark.message_with_options(args=("prio",), priority=2 ** 31), "priority=2147483648"),
    (lambda: mark.message_with_options(args=("prio",), priority=-(2 ** 31) - 1), "priority=-2147483649"),
    (lambda: mark.message(10 ** 5000), "an integer of more than 4300 digits at $[0]"),
    (lambda: mark.message({"deep": [10 ** 5000]}), "an integer of more than 4300 digits at $[0].deep[0]"),
    (lambda: mark.message("x").copy(actor_name="test.mark\x00"), "the actor name 'test.mark\\x00'"),
    (lambda: mark.message("x").copy(actor_name="test.\ud800"), "the actor name 'test.\\ud800'"),
    (lambda: mark.message("x").copy(message_timestamp=float("nan")), "message_timestamp nan"),
    (lambda: mark.message("x").copy(message_timestamp=datetime.datetime(2026, 1, 1)), "message_timestamp datetime"),
    (lambda: mark.message("x").copy(message_timestamp=True), "message_timestamp True"),
])
def test_a_message_postgres_or_json_could_not_take_is_refused_in_one_line_on_every_path(
        broker, database_url, make_bad, named):
    bad = make_bad()
    before = scalar(database_url, "SELECT count(*) FROM dramatiq.queue")
    for send in _every_path(broker, database_url, bad):
        with pytest.raises(InvalidMessage) as refused:
            send()
        text = str(refused.value)
        assert named in text and "\n" not in text and len(text) < 400, text
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue") == before


def test_an_actor_whose_priority_is_out_of_range_has_its_sends_refused_naming_it(broker, database_url):
    actor = dramatiq.actor(lambda: None, actor_name="test.refusals.too_urgent", queue_name="index",
                           priority=2 ** 40)
    before = scalar(database_url, "SELECT count(*) FROM dramatiq.queue")
    for send in (actor.send, lambda: enqueue_many([actor.message()])):
        with pytest.raises(InvalidMessage, match="actor 'test.refusals.too_urgent' has the priority 1099511627776"):
            send()
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue") == before


def test_a_queue_whose_name_its_channels_cannot_carry_is_refused_when_declared(broker):
    broker.declare_queue("q" * 44)  # the longest: 'standmeet_receipts_' and the name, 63 bytes
    with pytest.raises(ConfigError, match="is 45 bytes long; at most 44"):
        broker.declare_queue("q" * 45)
    assert "q" * 45 not in broker.queues


def test_on_an_autocommit_connection_a_mixed_batch_the_server_refuses_leaves_nothing(
        broker, database_url, refusing_boom):
    # Given a batch of plain messages (copied first) and keyed ones, one of which the
    # server refuses once the plain rows are in
    plain = [mark.message(f"autocommit-{n}") for n in range(5)]
    batch = [*plain, unique_jobs.unique.message("autocommit-key"), unique_jobs.unique.message("boom")]
    with psycopg.connect(database_url, autocommit=True) as conn:
        # When it is enqueued on the caller's autocommit connection
        with pytest.raises(DatabaseError, match="boom refused by the test") as refused:
            enqueue_many(batch, conn=conn)
        assert "\n" not in str(refused.value)
        # Then nothing of it is written, the plain rows included, and the connection goes on
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert scalar(database_url, COUNT, (_ids(batch),)) == 0


def _refused_in_a_callers_pipeline(database_url: str, batch: list[Any], prefix: str) -> list[tuple[str, int]]:
    """In a caller's transaction in pipeline mode that wrote a row ``<prefix>-before``,
    ``enqueue_many(batch)`` must raise the server's refusal; the caller then writes
    ``<prefix>-after`` and commits. The caller's rows, as committed (and removed)."""
    upsert = "INSERT INTO test_counters (key, value) VALUES (%s, 1) ON CONFLICT (key) DO UPDATE SET value = 1"
    with psycopg.connect(database_url) as conn:
        with conn.pipeline():
            conn.execute(upsert, (f"{prefix}-before",))
            # (the refusal is raised by enqueue_many itself, not at the caller's next statement)
            with pytest.raises(DatabaseError, match="boom refused by the test"):
                enqueue_many(batch, conn=conn)
            conn.execute(upsert, (f"{prefix}-after",))
        conn.commit()
    rows = query(database_url, "SELECT key, value FROM test_counters WHERE key IN (%s, %s) ORDER BY key",
                 (f"{prefix}-after", f"{prefix}-before"))
    query(database_url, "DELETE FROM test_counters WHERE key IN (%s, %s)", (f"{prefix}-after", f"{prefix}-before"))
    return rows


@pytest.mark.parametrize("existing", [False, True])
def test_in_pipeline_mode_a_batch_the_server_refuses_raises_at_once_and_the_transaction_goes_on(
        broker, database_url, refusing_boom, existing):
    # Given a batch with a row the server refuses (and, one way, whose first message
    # exists already: the upsert path)
    first = mark.message("pipeline-first")
    if existing:
        enqueue_many([first])
    batch = [first, mark.message("pipeline-second"), mark.message("boom")]
    # When it is sent in a caller's transaction in pipeline mode, Then that transaction is
    # usable: its own rows are kept, later statements run, and nothing of the batch is written
    assert _refused_in_a_callers_pipeline(database_url, batch, "pipeline") == [
        ("pipeline-after", 1), ("pipeline-before", 1)]
    assert scalar(database_url, COUNT, (_ids(batch[1:]),)) == 0
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s::uuid", (first.message_id,))


def test_in_pipeline_mode_a_refusal_that_arrives_while_later_chunks_are_sent_still_leaves_the_transaction_usable(
        broker, database_url, refusing_boom):
    # Given a batch of several chunks whose first row the server refuses: the refusal
    # arrives while the later chunks are sent, before the server has answered them
    batch = [mark.message("boom"), *[mark.message(f"pipeline-chunks-{n}") for n in range(2500)]]
    # When it is sent in a caller's transaction in pipeline mode, Then the batch's savepoint
    # was rolled back to: the caller's statements go on, nothing of the batch is written
    assert _refused_in_a_callers_pipeline(database_url, batch, "pipeline-chunks") == [
        ("pipeline-chunks-after", 1), ("pipeline-chunks-before", 1)]
    assert scalar(database_url, COUNT, (_ids(batch),)) == 0


def test_a_connection_whose_transaction_failed_already_is_refused_in_one_line(broker, database_url):
    messages = [mark.message("after-a-failure")]
    with psycopg.connect(database_url) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1 / 0")
        with pytest.raises(MessageRefused, match="roll it back first") as refused:
            enqueue_many(messages, conn=conn)
        assert "\n" not in str(refused.value)
    assert scalar(database_url, COUNT, (_ids(messages),)) == 0


def test_an_id_sent_again_while_queued_takes_its_new_queue_and_drops_the_old_key(broker, database_url):
    # Given a queued message that holds a unique key
    keyed = unique_jobs.unique.send("moved-key")
    # When a plain message with its id is sent to another queue, alone and in a batch
    moved = post.message("http://127.0.0.1:9/", "moved").copy(message_id=keyed.message_id)
    assert moved.queue_name != keyed.queue_name
    broker.enqueue(moved)
    row = query(database_url, "SELECT queue_name, message->>'queue_name', unique_key IS NULL FROM dramatiq.queue"
                              " WHERE message_id = %s::uuid", (keyed.message_id,))
    # Then the row is the new message whole: its queue, and no key of the old one
    assert row == [(moved.queue_name, moved.queue_name, True)]
    back = unique_jobs.plain.message("moved-back").copy(message_id=keyed.message_id)
    enqueue_many([back, mark.message("beside")])
    assert query(database_url, "SELECT queue_name FROM dramatiq.queue WHERE message_id = %s::uuid",
                 (keyed.message_id,)) == [(back.queue_name,)]
    # and the key is free for a new message
    again = unique_jobs.unique.send("moved-key")
    assert again.message_id != keyed.message_id
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
          ([keyed.message_id, again.message_id],))


@pytest.mark.parametrize(("value", "named"), [(float("nan"), "holds nan at $[0]"), ({1, 2}, "holds a set at $[0]")])
def test_a_unique_actors_message_that_is_not_json_is_refused_in_one_line_before_its_key_is_made(
        broker, database_url, value, named):
    bad = unique_jobs.unique.message(value)
    before = scalar(database_url, "SELECT count(*) FROM dramatiq.queue")
    for send in _every_path(broker, database_url, bad):
        with pytest.raises(InvalidMessage) as refused:
            send()
        assert named in str(refused.value) and "\n" not in str(refused.value)
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue") == before


@pytest.mark.parametrize("size", [2500, DISTINCT_IN_A_SET + 500], ids=["ids-in-a-set", "ids-sorted"])
def test_in_a_batch_of_thousands_one_id_twice_far_apart_is_refused_naming_it(broker, database_url, size):
    messages = [mark.message(f"far-{n}") for n in range(size)]
    messages[size - 100] = messages[3].copy(args=("far-again",))
    with pytest.raises(InvalidMessage, match=f"the message id '{messages[3].message_id}' is in this batch twice"):
        enqueue_many(messages)
    assert scalar(database_url, COUNT, (_ids(messages),)) == 0
