"""Transactional enqueue: the message is written in the caller's transaction.

    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("INSERT INTO documents …")
        enqueue(conn, "corpus.index", doc_id)

    async with await psycopg.AsyncConnection.connect(url) as aconn, aconn.transaction():
        await aconn.execute("INSERT INTO documents …")
        await enqueue_async(aconn, "corpus.index", doc_id)

The message row and its NOTIFY are part of the caller's transaction: consumers are
woken at commit, and a rollback leaves nothing behind. Middleware that Dramatiq runs
on enqueue (``before_enqueue`` / ``after_enqueue``) still runs. ``actor.send()``, by
contrast, commits on its own, outside any transaction of yours.

A message is checked before any statement runs, as ``emit`` checks an event, so a
refused one leaves the caller's transaction usable: its arguments must be JSON Postgres
stores (no NaN or infinity, ``\\u0000`` or lone surrogate: ``check_json_value``), its
options values its run can use, and its encoded size at most STANDMEET_MESSAGE_MAX_BYTES
(:class:`broker.errors.InvalidMessage`, :class:`broker.errors.MessageTooLarge`).

A message with a unique key (an actor's ``unique=``, a message's ``unique_key``) is not
written while a message of its key is live: the live one is returned instead. The sync
and the async forms prepare and finish a send with the same functions
(:func:`prepare_send`, :func:`send_steps`, :func:`finish_send`); only the driver that
runs the statements differs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import dramatiq
import psycopg
from dramatiq.message import Message

from broker import app
from broker.engine import sql
from broker.engine.broker import (
    StandmeetBroker,
    Step,
    UniqueItem,
    UniqueOutcome,
    count_skips,
    delay_seconds,
    enqueue_one_params,
    enqueue_params,
    live_messages,
    run_steps,
    split_unique,
    unique_item,
    unique_key_of,
    unique_write,
)
from broker.services import current_broker


def build_message(actor: dramatiq.Actor | str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                  options: dict[str, Any] | None = None) -> Message:
    broker = current_broker()
    target = broker.get_actor(actor) if isinstance(actor, str) else actor
    return target.message_with_options(args=args, kwargs=kwargs or {}, **(options or {}))


@dataclass
class PreparedSend:
    """A send checked and through its ``before_enqueue`` hooks, ready to be written:
    ENQUEUE_ONE's parameters, or the unique item of a message with a unique key."""

    broker: StandmeetBroker
    message: Message
    delay_ms: int | None
    params: dict[str, Any] | None
    item: UniqueItem | None


def prepare_send(message: Message, *, delay_ms: int | None = None) -> PreparedSend:
    """Check ``message`` and run its ``before_enqueue`` hooks; nothing is written yet."""
    broker = current_broker()
    if message.queue_name not in broker.queues:
        raise dramatiq.errors.QueueNotFound(message.queue_name)
    broker.emit_before("enqueue", message, delay_ms)
    limit = broker.settings.message_max_bytes
    key = unique_key_of(message, broker)
    if key is None:
        return PreparedSend(broker, message, delay_ms, enqueue_one_params(message, delay_ms, max_bytes=limit), None)
    return PreparedSend(broker, message, delay_ms, None, unique_item(message, key, max_bytes=limit))


def send_steps(prepared: PreparedSend) -> Generator[Step, list[Any], UniqueOutcome]:
    """The statements of a prepared send (one, unless its unique key is taken)."""
    if prepared.item is None:
        assert prepared.params is not None
        yield sql.ENQUEUE_ONE, prepared.params
        return UniqueOutcome([None], {})
    return (yield from unique_write([prepared.item], delay_seconds(prepared.delay_ms)))


def finish_send(prepared: PreparedSend, outcome: UniqueOutcome) -> Message:
    """The message written, or the live one its key returned; ``after_enqueue`` hooks run."""
    message = live_messages([prepared.message], outcome)[0]
    prepared.broker.emit_after("enqueue", message, prepared.delay_ms)
    return message


def enqueue_message(conn: psycopg.Connection[Any], message: Message, *, delay_ms: int | None = None) -> Message:
    """Write ``message`` on ``conn`` (in its transaction, if one is open); the message
    written, or the live message of its unique key."""
    prepared = prepare_send(message, delay_ms=delay_ms)
    outcome = run_steps(conn, send_steps(prepared))
    count_skips(outcome.skipped, prepared.broker)
    return finish_send(prepared, outcome)


def enqueue_messages(conn: psycopg.Connection[Any], messages: list[Message]) -> list[Message]:
    """Write many messages on ``conn`` in one statement (those with a unique key in one
    more); each skipped one is replaced by the live message of its key."""
    if not messages:
        return messages
    broker = current_broker()
    for message in messages:
        if message.queue_name not in broker.queues:
            raise dramatiq.errors.QueueNotFound(message.queue_name)
        broker.emit_before("enqueue", message, None)
    keyed, keys = split_unique(messages, broker)
    limit = broker.settings.message_max_bytes
    items = [unique_item(messages[i], keys[i], max_bytes=limit) for i in keyed]  # type: ignore[arg-type]
    plain = [m for m, k in zip(messages, keys, strict=True) if k is None]
    params = enqueue_params(plain, max_bytes=limit) if plain else None
    if params is not None:
        conn.execute(sql.ENQUEUE, params)
    written = list(messages)
    if items:
        outcome = run_steps(conn, unique_write(items))
        count_skips(outcome.skipped, broker)
        for i, live in zip(keyed, live_messages([messages[i] for i in keyed], outcome), strict=True):
            written[i] = live
    for message in written:
        broker.emit_after("enqueue", message, None)
    return written


def enqueue(conn: psycopg.Connection[Any], actor: dramatiq.Actor | str, *args: Any,
            delay_ms: int | None = None, options: dict[str, Any] | None = None, **kwargs: Any) -> Message:
    """Enqueue ``actor(*args, **kwargs)`` in the caller's transaction; return the message
    (for a unique actor whose key is live: the live message, whose ``message_id``
    ``get_result`` waits on)."""
    return enqueue_message(conn, build_message(actor, args, kwargs, options), delay_ms=delay_ms)


async def run_steps_async(aconn: psycopg.AsyncConnection[Any],
                          steps: Generator[Step, list[Any], UniqueOutcome]) -> UniqueOutcome:
    """:func:`broker.engine.broker.run_steps` on an ``AsyncConnection``."""
    try:
        step = next(steps)
        while True:
            cur = await aconn.execute(*step)
            step = steps.send(await cur.fetchall())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


async def enqueue_message_async(aconn: psycopg.AsyncConnection[Any], message: Message, *,
                                delay_ms: int | None = None) -> Message:
    """:func:`enqueue_message` on an ``AsyncConnection``, in its transaction."""
    prepared = prepare_send(message, delay_ms=delay_ms)
    outcome = await run_steps_async(aconn, send_steps(prepared))
    if outcome.skipped:  # on the broker's own (sync) connection: not on the event loop
        await asyncio.to_thread(count_skips, outcome.skipped, prepared.broker)
    return finish_send(prepared, outcome)


async def enqueue_async(aconn: psycopg.AsyncConnection[Any], actor: dramatiq.Actor | str, *args: Any,
                        delay_ms: int | None = None, options: dict[str, Any] | None = None,
                        **kwargs: Any) -> Message:
    """:func:`enqueue` for async code: ``await enqueue_async(aconn, actor, *args)`` writes
    the message on a psycopg ``AsyncConnection``, in its transaction, with the same checks
    and hooks."""
    return await enqueue_message_async(aconn, build_message(actor, args, kwargs, options), delay_ms=delay_ms)


def finish_queued(conn: psycopg.Connection[Any], message_ids: list[str]) -> None:
    """Mark done the messages of ``message_ids`` still queued, without running them: their
    work was done by another job. Call it in the transaction that records that work, so a
    message is never done unless its work is recorded. No hook runs for them (no callback,
    pipeline step, result or job log line): only for messages that have none. A message
    already claimed, or cancelled, is left as it is (a claimed one must find its work made
    and end)."""
    if message_ids:
        conn.execute(sql.FINISH_QUEUED, {"ids": message_ids, "awaited": app.awaited_queues()})
