"""What a relay pass writes: the message body a consumer decodes, the broker's enqueue
hooks on every relayed message, and an event whose message cannot be written kept with
its error while the rest go on."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest
from dramatiq import Middleware
from dramatiq.message import Message

from broker import emit
from broker.outbox import MESSAGE_NAMESPACE, relay_once, route
from tests.support.db import query

BODY = "SELECT message::text FROM dramatiq.queue WHERE message_id = %s"


def _kw(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (), {"label": payload["label"]}


def _unwritable(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (object() if payload.get("bad") else payload["label"],), {}


route("test.relay.kwargs", "test.noop", _kw)
route("test.relay.fan", "test.noop", _kw)
route("test.relay.fan", "test.mark", _kw)
route("test.relay.unwritable", "test.noop", _unwritable)


def _nul(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return ("\x00" if payload.get("nul") else payload["label"],), {}


route("test.relay.nul", "test.noop", _nul)


def _id(event_id: int, index: int) -> str:
    return str(uuid.uuid5(MESSAGE_NAMESPACE, f"{event_id}/{index}"))


def _relay(database_url: str, events: list[tuple[str, dict[str, Any]]]) -> tuple[list[int], Any]:
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM standmeet.outbox")
        with conn.transaction():
            ids = [emit(conn, topic, payload) for topic, payload in events]
        return ids, relay_once(conn, limit=200)


def test_a_relayed_message_is_the_body_dramatiq_would_encode_for_it(broker, database_url):
    (fan, single), result = _relay(database_url, [("test.relay.fan", {"label": "fanned"}),
                                                  ("test.relay.kwargs", {"label": "single \"quoted\" é"})])
    assert (result.claimed, result.messages, result.failed) == (2, 3, 0)
    for event_id, index, actor_name, label in [(fan, 0, "test.noop", "fanned"), (fan, 1, "test.mark", "fanned"),
                                               (single, 0, "test.noop", "single \"quoted\" é")]:
        (text,) = query(database_url, BODY, (_id(event_id, index),))[0]
        decoded = Message.decode(text.encode())  # as a consumer reads it
        actor = broker.get_actor(actor_name)
        expected = Message(queue_name=actor.queue_name, actor_name=actor_name, args=(), kwargs={"label": label},
                           options={}, message_id=_id(event_id, index),
                           message_timestamp=decoded.message_timestamp)
        assert json.loads(text) == json.loads(expected.encode())
        assert decoded == expected
        assert isinstance(decoded.message_timestamp, int)


class _Stamp(Middleware):
    """An enqueue hook of the application's: stamps each message, records what it saw."""

    def __init__(self) -> None:
        self.before: list[str] = []
        self.after: list[str] = []

    def before_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        message.options["stamped"] = True
        self.before.append(message.message_id)

    def after_enqueue(self, broker: Any, message: Any, delay: Any) -> None:
        self.after.append(message.message_id)


def test_every_relayed_message_goes_through_the_brokers_enqueue_hooks(broker, database_url):
    stamp = _Stamp()
    broker.add_middleware(stamp)
    try:
        (event_id,), result = _relay(database_url, [("test.relay.fan", {"label": "hooked"})])
    finally:
        broker.middleware.remove(stamp)
    assert result.messages == 2
    ids = [_id(event_id, 0), _id(event_id, 1)]
    assert stamp.before == ids and stamp.after == ids
    for message_id in ids:
        (text,) = query(database_url, BODY, (message_id,))[0]
        assert json.loads(text)["options"] == {"stamped": True}


def test_an_event_whose_message_cannot_be_encoded_is_kept_with_its_error_and_the_rest_go_on(
        broker, database_url):
    (first, bad, last), result = _relay(database_url, [("test.relay.unwritable", {"label": "first"}),
                                                       ("test.relay.unwritable", {"label": "bad", "bad": True}),
                                                       ("test.relay.unwritable", {"label": "last"})])
    assert (result.claimed, result.messages, result.failed) == (3, 2, 1)
    (error,) = query(database_url, "SELECT error FROM standmeet.outbox WHERE id = %s", (bad,))[0]
    assert "TypeError" in error and "JSON serializable" in error
    assert query(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = %s", (_id(bad, 0),)) == [(0,)]
    for event_id, label in ((first, "first"), (last, "last")):
        (text,) = query(database_url, BODY, (_id(event_id, 0),))[0]
        assert json.loads(text)["args"] == [label]


ORDER_WRITES = """
CREATE TABLE test_write_order (n bigserial PRIMARY KEY, message_id uuid NOT NULL, txid bigint NOT NULL);
CREATE FUNCTION test_record_write_order() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_write_order (message_id, txid) VALUES (NEW.message_id, txid_current());
    RETURN NULL;
END $$;
CREATE TRIGGER test_write_order AFTER INSERT ON dramatiq.queue
    FOR EACH ROW EXECUTE FUNCTION test_record_write_order();
"""
FORGET_ORDER = """
DROP TRIGGER test_write_order ON dramatiq.queue;
DROP FUNCTION test_record_write_order();
DROP TABLE test_write_order;
"""


def test_a_pass_claimed_in_chunks_is_one_transaction_in_event_order(broker, database_url):
    query(database_url, ORDER_WRITES)
    try:
        with psycopg.connect(database_url, autocommit=True) as conn:
            conn.execute("DELETE FROM standmeet.outbox")
            with conn.transaction():
                events = [emit(conn, "test.relay.fan", {"label": f"chunk-{i}"}) for i in range(12)]
            # When a pass of at most 10 events claims them 3 at a time
            result = relay_once(conn, limit=10, chunk_rows=3)
        # Then it took the 10 oldest, all in one transaction, and wrote their messages in event order
        assert (result.claimed, result.messages, result.failed) == (10, 20, 0)
        marked = query(database_url, "SELECT id, relay_txid FROM standmeet.outbox WHERE relayed_at IS NOT NULL"
                                     " ORDER BY id")
        assert [event_id for event_id, _ in marked] == events[:10]
        assert len({txid for _, txid in marked}) == 1
        written = query(database_url, "SELECT message_id::text, txid FROM test_write_order ORDER BY n")
        assert [message_id for message_id, _ in written] == [_id(e, i) for e in events[:10] for i in (0, 1)]
        assert {txid for _, txid in written} == {marked[0][1]}
    finally:
        query(database_url, FORGET_ORDER)


def test_a_pass_that_postgres_refuses_marks_nothing_and_leaves_the_connection_usable(broker, database_url):
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("DELETE FROM standmeet.outbox")
        with conn.transaction():
            events = [emit(conn, "test.relay.nul", {"label": f"refused-{i}", "nul": i == 4}) for i in range(6)]
        # When Postgres refuses the messages of a pass claimed in chunks (jsonb takes no \u0000)
        with pytest.raises(psycopg.errors.UntranslatableCharacter):
            relay_once(conn, limit=200, chunk_rows=2)
        # Then nothing was marked or written, and the same connection relays once the bad event is gone
        assert query(database_url, "SELECT count(*) FROM standmeet.outbox WHERE relayed_at IS NOT NULL") == [(0,)]
        assert query(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                     ([_id(e, 0) for e in events],)) == [(0,)]
        conn.execute("DELETE FROM standmeet.outbox WHERE id = %s", (events[4],))
        result = relay_once(conn, limit=200, chunk_rows=2)
    assert (result.claimed, result.messages, result.failed) == (5, 5, 0)
