"""``from broker import enqueue_many``: many Dramatiq messages in one statement, each in its
own queue with its own priority, due together; on the caller's connection, part of its
transaction."""

from __future__ import annotations

import psycopg
from dramatiq.message import Message

from broker import enqueue_many
from tests.support.db import query
from tests.support.jobs import mark, post

ROWS = """
SELECT message_id::text, queue_name, priority, message::text, eta > now() + interval '30 seconds'
FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state = 'queued'
"""


def test_a_batch_lands_each_message_in_its_queue_with_its_priority_as_dramatiq_encodes_it(broker, database_url):
    # Given messages for two queues, one with a priority of its own
    messages = [mark.message("batch-a"), post.message("http://127.0.0.1:9/", "batch-b"),
                mark.message_with_options(args=("batch-c",), priority=7)]
    # When they are enqueued together, due in a minute
    enqueue_many(messages, delay_ms=60_000)
    rows = {r[0]: r[1:] for r in query(database_url, ROWS, ([m.message_id for m in messages],))}
    # Then each row is its message: its queue, its priority, its body, and the delay
    assert [rows[m.message_id][0] for m in messages] == ["index", "webhook", "index"]
    assert [rows[m.message_id][1] for m in messages] == [0, 0, 7]
    for m in messages:
        stored = Message.decode(rows[m.message_id][2].encode())
        assert (stored.message_id, stored.args, stored.options.get("priority")) == (
            m.message_id, m.args, m.options.get("priority"))
        assert rows[m.message_id][3]  # not due for 30 s at least
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
          ([m.message_id for m in messages],))


def test_on_the_callers_connection_a_batch_is_part_of_its_transaction(broker, database_url):
    # Given a batch written in the caller's transaction, which then rolls back
    kept, dropped = [mark.message("kept")], [mark.message("rolled-back")]
    with psycopg.connect(database_url) as conn:
        enqueue_many(dropped, conn=conn)
        conn.rollback()
        # When another batch is written and committed, with a listener on the queue
        with psycopg.connect(database_url, autocommit=True) as listener:
            listener.execute('LISTEN "dramatiq.index.enqueue"')
            enqueue_many(kept, conn=conn)
            assert list(listener.notifies(timeout=0.2, stop_after=1)) == []  # nothing before the commit
            conn.commit()
            woken = [n.channel for n in listener.notifies(timeout=5, stop_after=1)]
    # Then only the committed one is there, and its queue was woken at the commit
    ids = [m.message_id for m in kept + dropped]
    assert [r[0] for r in query(database_url, ROWS, (ids,))] == [kept[0].message_id]
    assert woken == ["dramatiq.index.enqueue"]
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,))


def test_a_message_enqueued_again_while_queued_takes_the_new_text_and_a_finished_one_stays_finished(
        broker, database_url):
    # Given one message still queued and one already done
    queued, done = mark.message("first"), mark.message("finished")
    enqueue_many([queued, done])
    query(database_url, "UPDATE dramatiq.queue SET state = 'done' WHERE message_id = %s", (done.message_id,))
    # When both are enqueued again with new arguments, in a batch with a new message
    new = mark.message("new")
    again = [Message(**{**queued.asdict(), "args": ("second",)}), new,
             Message(**{**done.asdict(), "args": ("again",)})]
    enqueue_many(again)
    ids = [queued.message_id, done.message_id, new.message_id]
    rows = dict(query(database_url, "SELECT message_id::text, message->'args' || jsonb_build_array(state::text)"
                                    " FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,)))
    # Then the queued one carries the new text, the finished one is not resurrected,
    # and the new one is queued
    assert rows[queued.message_id] == ["second", "queued"]
    assert rows[done.message_id] == ["finished", "done"]
    assert rows[new.message_id] == ["new", "queued"]
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,))


def test_a_batch_of_new_messages_and_one_that_exists_is_written_whole_on_the_callers_connection_too(
        broker, database_url):
    # Given a queued message
    queued = mark.message("before")
    enqueue_many([queued])
    # When it is enqueued again beside a new one, in the caller's transaction
    new = mark.message("beside")
    with psycopg.connect(database_url) as conn:
        enqueue_many([Message(**{**queued.asdict(), "args": ("after",)}), new], conn=conn)
        conn.execute("SELECT 1")  # the transaction was not aborted
    ids = [queued.message_id, new.message_id]
    rows = dict(query(database_url, "SELECT message_id::text, message->'args' FROM dramatiq.queue"
                                    " WHERE message_id = ANY(%s::uuid[]) AND state = 'queued'", (ids,)))
    # Then both are queued, the first with its new text
    assert rows == {queued.message_id: ["after"], new.message_id: ["beside"]}
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", (ids,))
