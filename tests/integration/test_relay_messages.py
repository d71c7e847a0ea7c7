"""What a relay pass writes: the message body a consumer decodes, the broker's enqueue
hooks on every relayed message, and an event whose message cannot be written kept with
its error while the rest go on."""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
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
