"""``enqueue_many`` copies a batch a chunk at a time: 100,000 messages in one call are all
written, in one transaction, holding one chunk's rows at once; every message is checked,
before the caller's first statement, or as its chunk is copied in a transaction of the
broker's own that a refusal rolls back; the hooks run for each message; a message with a
unique key is still deduplicated; in the caller's transaction the batch is part of it;
and an id that exists already is written over as a queued message's, never over a
started one."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import dramatiq
import psycopg
import pytest
from dramatiq import Middleware
from dramatiq.message import Message

from broker import enqueue_many
from broker.engine import copy_rows
from broker.errors import InvalidMessage, MessageTooLarge
from broker.settings import MIB
from tests.support import unique_jobs
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import mark

CHANNEL = '"dramatiq.index.enqueue"'
COUNT = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
#: The peak of Python memory a 100,000-message call may reach beyond its messages: the
#: rows of one chunk (at most 1,000 messages or 1 MiB), held about three times over while
#: they are written (the rows, their text, its bytes), and a pointer per message (0.8 MB;
#: twice while the ids are sorted to find one sent twice); measured 1.9 MiB. The whole
#: batch encoded at once took 70 MiB.
MAX_PEAK_BYTES = 4 * MIB


def _ids(messages: list[Message]) -> list[str]:
    return [m.message_id for m in messages]


def _forget(database_url: str, messages: list[Message]) -> None:
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (_ids(messages),))


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunks of 10 messages: a batch of 25 is written in three."""
    monkeypatch.setattr(copy_rows, "CHUNK_MESSAGES", 10)


@pytest.mark.slow  # 100,000 messages under tracemalloc: 10 to 30 s; runs once in CI, not in every pass
def test_100000_messages_in_one_call_are_all_written_in_order_and_wake_the_queue_with_one_chunk_in_memory(
        broker, database_url):
    # Given 100,000 messages, and a listener on their queue
    messages = [mark.message(f"bulk-{n}") for n in range(100_000)]
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        # When they are enqueued in one call
        tracemalloc.start()
        try:
            start = tracemalloc.get_traced_memory()[0]
            written = enqueue_many(messages)
            peak = tracemalloc.get_traced_memory()[1] - start
        finally:
            tracemalloc.stop()
        woken = [n.channel for n in listener.notifies(timeout=10, stop_after=1)]
    # Then every one is written, due together, the list returned is the batch in its order,
    # its queue was woken, and no more than one chunk's rows were held at once
    assert _ids(written) == _ids(messages)
    assert query(database_url, "SELECT count(*), count(DISTINCT eta) FROM dramatiq.queue"
                               " WHERE message_id = ANY(%s::uuid[]) AND state = 'queued'",
                 (_ids(messages),)) == [(100_000, 1)]
    assert scalar(database_url, "SELECT message->'args'->>0 FROM dramatiq.queue WHERE message_id = %s::uuid",
                  (messages[99_999].message_id,)) == "bulk-99999"
    assert woken == ["dramatiq.index.enqueue"]
    print(f"peak {peak / MIB:.2f} MiB")
    assert peak < MAX_PEAK_BYTES, f"peak {peak / MIB:.1f} MiB"
    # (its rows stay: the module's database is dropped after it)


class _Hooks(Middleware):
    """Records each message's hooks; before_enqueue stamps an option on it, after_enqueue
    looks, on a connection of its own, whether the message's row is committed."""

    def __init__(self, database_url: str) -> None:
        self.url = database_url
        self.before: list[str] = []
        self.after: list[tuple[str, int]] = []

    def before_enqueue(self, broker: Any, message: Message, delay: Any) -> None:
        self.before.append(message.message_id)
        message.options["stamped"] = True

    def after_enqueue(self, broker: Any, message: Message, delay: Any) -> None:
        self.after.append((message.message_id, int(scalar(self.url, COUNT, ([message.message_id],)))))


@pytest.fixture
def hooks(broker, database_url) -> Iterator[_Hooks]:
    middleware = _Hooks(database_url)
    broker.add_middleware(middleware)
    yield middleware
    broker.middleware.remove(middleware)


def test_each_message_of_a_batch_goes_through_its_hooks_before_it_is_written_and_after_it_is_committed(
        hooks, database_url, small_chunks):
    # Given a batch over several chunks
    messages = [mark.message(f"hooked-{n}") for n in range(25)]
    # When it is enqueued
    enqueue_many(messages)
    # Then each message went through before_enqueue (its stamp is in its row) and, once
    # its row was committed, through after_enqueue
    assert hooks.before == _ids(messages)
    assert hooks.after == [(m.message_id, 1) for m in messages]
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
                                " AND message->'options'->'stamped' = 'true'", (_ids(messages),)) == 25
    _forget(database_url, messages)


def test_a_batch_mixing_unique_keys_with_plain_messages_still_writes_one_message_per_key(
        broker, database_url, small_chunks):
    # Given a live unique message
    live = unique_jobs.unique.send("bulk-live")
    # When a batch over several chunks holds it again, a new key twice, and plain messages
    plain = [unique_jobs.plain.message(f"bulk-plain-{n}") for n in range(22)]
    batch = [unique_jobs.unique.message("bulk-live"), *plain[:11], unique_jobs.unique.message("bulk-new"),
             *plain[11:], unique_jobs.unique.message("bulk-new")]
    written = enqueue_many(batch)
    # Then the repeat of the live one returned it, the new key was written once, and every
    # plain message is written as it is
    assert written[0].message_id == live.message_id
    assert written[12].message_id == written[-1].message_id == batch[12].message_id
    assert _ids(written[1:12]) + _ids(written[13:-1]) == _ids(plain)
    assert scalar(database_url, COUNT, (_ids(plain),)) == 22
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message->>'actor_name' = 'test.unique'"
                                " AND message->'args' = '[\"bulk-new\"]'") == 1
    _forget(database_url, [live, *plain, batch[12]])


@pytest.mark.parametrize("bad, error, words", [
    (lambda: mark.message(float("nan")), InvalidMessage, "holds nan at"),
    (lambda: mark.message("x" * (MIB + 10)), MessageTooLarge, "over the limit of"),
])
def test_a_message_refused_in_the_last_chunk_refuses_the_batch_whole_and_the_callers_before_any_statement(
        broker, database_url, small_chunks, bad, error, words):
    # Given a batch over several chunks whose last message is refused
    messages = [mark.message(f"refused-batch-{n}") for n in range(24)] + [bad()]
    # When it is enqueued on the broker's pool, and in a caller's transaction that wrote a row
    with pytest.raises(error, match=words):
        enqueue_many(messages)
    with psycopg.connect(database_url) as conn:
        conn.execute("INSERT INTO test_counters (key, value) VALUES ('refused-batch', 1)")
        with pytest.raises(error, match=words):
            enqueue_many(messages, conn=conn)
        # Then the caller's transaction is usable and holds its own row
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        assert conn.execute("SELECT value FROM test_counters WHERE key = 'refused-batch'").fetchone() == (1,)
        conn.rollback()
        # and on a connection with no transaction open, no statement ran: none was begun
        with pytest.raises(error, match=words):
            enqueue_many(messages, conn=conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    # and nothing of the batch was written
    assert scalar(database_url, COUNT, (_ids(messages),)) == 0


def test_on_the_brokers_pool_the_copy_is_under_way_while_later_chunks_are_checked_and_a_refusal_undoes_it(
        broker, database_url, small_chunks, monkeypatch):
    # Given a batch of three chunks whose last message is refused, a listener on its
    # queue, and a look at the server each time a message leaves the quick check
    messages = [mark.message(f"overlapped-{n}") for n in range(24)] + [mark.message(float("nan"))]
    copying: list[int] = []
    check = copy_rows.check_message_quickly

    def check_and_look(message: Any) -> None:
        if message.message_id == messages[-1].message_id:
            copying.append(scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' "
                                                "AND query LIKE 'COPY dramatiq.queue %%'"))
        check(message)

    monkeypatch.setattr(copy_rows, "check_message_quickly", check_and_look)
    told: list[BaseException | None] = []  # the error psycopg would tell the server (and its log)
    finish = psycopg.Copy.finish

    def finish_and_note(copy: psycopg.Copy, exc: BaseException | None = None) -> None:
        told.append(exc)
        finish(copy, exc)

    monkeypatch.setattr(psycopg.Copy, "finish", finish_and_note)
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        # When it is enqueued on the broker's pool
        with pytest.raises(InvalidMessage, match="holds nan at"):
            enqueue_many(messages)
        woken = list(listener.notifies(timeout=0.3, stop_after=1))
    # Then Postgres was storing its first chunks while its last was checked,
    assert copying == [1]
    # the copy was ended without telling the server why (nothing of the message in its log),
    assert told == [None]
    # the refusal rolled the copy back: nothing written, no consumer woken,
    assert scalar(database_url, COUNT, (_ids(messages),)) == 0
    assert woken == []
    # and the pool's next batch is written
    good = [mark.message(f"after-overlapped-{n}") for n in range(3)]
    enqueue_many(good)
    assert scalar(database_url, COUNT, (_ids(good),)) == 3
    _forget(database_url, good)


def test_with_every_pooled_connection_taken_a_refused_message_is_still_the_error_raised(
        broker, database_url, small_chunks, monkeypatch):
    # Given a pool whose every connection is taken, and that gives up waiting at once
    monkeypatch.setattr(broker.pool, "timeout", 0.2)
    held = [broker.pool.getconn() for _ in range(broker.pool.max_size)]
    try:
        # When batches with a refused message are enqueued: in the first chunk, in a later
        # one, and a message of a unique actor whose key cannot be made
        first = [mark.message(float("nan"))] + [mark.message(f"no-pool-{n}") for n in range(5)]
        later = [mark.message(f"no-pool-later-{n}") for n in range(24)] + [mark.message(float("inf"))]
        keyed = [unique_jobs.unique.message(float("nan"))]
        # Then each raises its refusal, not the pool's timeout, nor chained to it
        for batch in (first, later, keyed):
            with pytest.raises(InvalidMessage, match="holds (nan|inf) at") as raised:
                enqueue_many(batch)
            shown = raised.value.__context__ if not raised.value.__suppress_context__ else None
            assert not isinstance(raised.value.__cause__ or shown, psycopg.Error)
    finally:
        for conn in held:
            broker.pool.putconn(conn)
    assert scalar(database_url, COUNT, (_ids(first + later + keyed),)) == 0


def test_a_batch_with_an_id_that_exists_and_a_later_refused_message_raises_the_refusal_and_logs_nothing(
        broker, database_url, caplog, monkeypatch):
    # Given a queued message, sent again first in a batch whose last chunk holds a refused
    # one (1,500 rows before it: Postgres stores a copy's rows a thousand at a time)
    queued = mark.message("exists-then-refused")
    enqueue_many([queued])
    batch = ([Message(**{**queued.asdict(), "args": ("again",)})] + [mark.message(f"after-{n}") for n in range(1500)]
             + [mark.message(float("nan"))])
    # and the server failing the copy on that id before the refused message is checked
    copies: list[psycopg.Copy] = []
    write, check = psycopg.Copy.write, copy_rows.check_message_quickly

    def write_and_keep(copy: psycopg.Copy, data: Any) -> None:
        copies.append(copy)
        write(copy, data)

    def check_once_the_server_failed(message: Any) -> None:
        if message.message_id == batch[-1].message_id:
            connection = copies[-1].connection
            connection.pgconn.flush()
            wait_for(lambda: scalar(database_url, "SELECT state FROM pg_stat_activity WHERE pid = %s",
                                    (connection.info.backend_pid,)) == "idle in transaction (aborted)",
                     timeout_s=10, what="the server to fail the copy on the existing id")
        check(message)

    monkeypatch.setattr(psycopg.Copy, "write", write_and_keep)
    monkeypatch.setattr(copy_rows, "check_message_quickly", check_once_the_server_failed)
    # When it is enqueued on the broker's pool
    with caplog.at_level("WARNING"), pytest.raises(InvalidMessage, match="holds nan at"):
        enqueue_many(batch)
    # Then nothing was written, the queued message kept its text, and nothing was logged
    assert scalar(database_url, COUNT, (_ids(batch[1:]),)) == 0
    assert scalar(database_url, "SELECT message->'args' FROM dramatiq.queue WHERE message_id = %s",
                  (queued.message_id,)) == ["exists-then-refused"]
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []
    _forget(database_url, [queued])


def test_an_actor_whose_priority_postgres_cannot_store_is_refused_before_the_callers_first_statement(
        broker, database_url):
    actor = dramatiq.actor(lambda: None, actor_name="test.bulk.too_urgent", queue_name="index", priority=2 ** 40)
    with psycopg.connect(database_url) as conn:
        with pytest.raises(InvalidMessage, match="has the priority 1099511627776"):
            enqueue_many([mark.message("fine"), actor.message()], conn=conn)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # no statement ran


def test_in_the_callers_transaction_a_batch_of_several_chunks_rolls_back_with_it_and_wakes_nobody(
        broker, database_url, small_chunks):
    # Given a listener, and a batch of several chunks written in a caller's transaction
    messages = [mark.message(f"rolled-back-{n}") for n in range(25)]
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute(f"LISTEN {CHANNEL}")
        with psycopg.connect(database_url) as conn:
            written = enqueue_many(messages, conn=conn, delay_ms=60_000)
            assert scalar(database_url, COUNT, (_ids(messages),)) == 0  # not before the commit
            assert conn.execute(COUNT, (_ids(messages),)).fetchone() == (25,)
            # When the transaction rolls back
            conn.rollback()
        woken = list(listener.notifies(timeout=0.3, stop_after=1))
    # Then nothing is left, and no consumer was woken
    assert _ids(written) == _ids(messages)
    assert scalar(database_url, COUNT, (_ids(messages),)) == 0
    assert woken == []


@pytest.mark.parametrize("on_callers_connection", [False, True])
def test_an_id_that_exists_in_a_later_chunk_writes_the_batch_whole_and_keeps_a_started_message(
        broker, database_url, small_chunks, on_callers_connection):
    # Given a queued message and a finished one
    queued, done = mark.message("exists-queued"), mark.message("exists-done")
    enqueue_many([queued, done])
    query(database_url, "UPDATE dramatiq.queue SET state = 'done' WHERE message_id = %s", (done.message_id,))
    # When both are sent again with new arguments, at the end of a batch of several chunks
    new = [mark.message(f"exists-new-{n}") for n in range(23)]
    again = [Message(**{**queued.asdict(), "args": ("queued-again",)}),
             Message(**{**done.asdict(), "args": ("done-again",)})]
    if on_callers_connection:
        with psycopg.connect(database_url) as conn:
            conn.execute("INSERT INTO test_counters (key, value) VALUES ('exists-batch', 1)")
            enqueue_many(new + again, conn=conn, delay_ms=60_000)
            conn.commit()  # the caller's transaction was not aborted: its own row is kept
        assert scalar(database_url, "SELECT value FROM test_counters WHERE key = 'exists-batch'") == 1
    else:
        enqueue_many(new + again, delay_ms=60_000)
    rows = dict(query(database_url, "SELECT message_id::text, message->'args' || jsonb_build_array(state::text)"
                                    " FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                      (_ids([queued, done, *new]),)))
    # Then every new message is queued, the queued one carries its new text, and the
    # finished one is not resurrected
    assert rows[queued.message_id] == ["queued-again", "queued"]
    assert rows[done.message_id] == ["exists-done", "done"]
    assert [rows[m.message_id] for m in new] == [[f"exists-new-{n}", "queued"] for n in range(23)]
    _forget(database_url, [queued, done, *new])


@pytest.mark.parametrize("on_callers_connection", [False, True])
def test_a_delayed_batch_is_due_exactly_its_delay_after_it_was_enqueued(broker, database_url, on_callers_connection):
    messages = [mark.message(f"delayed-{n}") for n in range(3)]
    if on_callers_connection:  # whose session writes and reads times its own way
        with psycopg.connect(database_url) as conn:
            conn.execute("SET DateStyle = 'SQL, DMY'")
            conn.execute("SET TimeZone = 'Asia/Kolkata'")
            enqueue_many(messages, conn=conn, delay_ms=90_500)
    else:
        enqueue_many(messages, delay_ms=90_500)
    assert query(database_url, "SELECT DISTINCT eta - enqueued_at FROM dramatiq.queue"
                               " WHERE message_id = ANY(%s::uuid[])", (_ids(messages),)) == [(timedelta(seconds=90.5),)]
    _forget(database_url, messages)


def test_text_that_copy_would_read_as_separators_or_escapes_is_stored_as_it_was_sent(broker, database_url):
    # Given arguments full of what COPY's text format reads specially
    tricky = ["back\\slash", "tab\tstop", "new\nline", "carriage\rreturn", "\\N", "\\.", 'quote"d', "é\u2603\U0001f600"]
    messages = [mark.message(text) for text in tricky]
    # When they are enqueued
    enqueue_many(messages)
    # Then each row holds its message as sent
    stored = dict(query(database_url, "SELECT message_id::text, message::text FROM dramatiq.queue"
                                      " WHERE message_id = ANY(%s::uuid[])", (_ids(messages),)))
    assert [Message.decode(stored[m.message_id].encode()).args for m in messages] == [(t,) for t in tricky]
    _forget(database_url, messages)


def test_a_batch_in_the_callers_pipeline_is_written_too(broker, database_url):
    messages = [mark.message(f"pipelined-{n}") for n in range(3)]
    with psycopg.connect(database_url, autocommit=True) as conn, conn.pipeline():
        enqueue_many(messages, conn=conn)
    assert scalar(database_url, COUNT, (_ids(messages),)) == 3
    _forget(database_url, messages)
