"""Transactional enqueue: the message is written in the caller's transaction.

    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute("INSERT INTO documents …")
        enqueue(conn, "corpus.index", doc_id)

The message row and its NOTIFY are part of the caller's transaction: consumers are
woken at commit, and a rollback leaves nothing behind. Middleware that Dramatiq runs
on enqueue (``before_enqueue`` / ``after_enqueue``) still runs.

A message is checked before any statement runs, as ``emit`` checks an event, so a
refused one leaves the caller's transaction usable: its arguments must be JSON Postgres
stores (no NaN or infinity, ``\\u0000`` or lone surrogate: ``check_json_value``), its
options values its run can use, and its encoded size at most STANDMEET_MESSAGE_MAX_BYTES
(:class:`broker.errors.InvalidMessage`, :class:`broker.errors.MessageTooLarge`).
"""

from __future__ import annotations

from typing import Any

import dramatiq
import psycopg
from dramatiq.message import Message

from broker import app, sql
from broker.pgbroker import current_broker, enqueue_one_params, enqueue_params


def build_message(actor: dramatiq.Actor | str, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None,
                  options: dict[str, Any] | None = None) -> Message:
    broker = current_broker()
    target = broker.get_actor(actor) if isinstance(actor, str) else actor
    return target.message_with_options(args=args, kwargs=kwargs or {}, **(options or {}))


def enqueue_message(conn: psycopg.Connection[Any], message: Message, *, delay_ms: int | None = None) -> Message:
    """Write ``message`` on ``conn`` (in its transaction, if one is open)."""
    broker = current_broker()
    if message.queue_name not in broker.queues:
        raise dramatiq.errors.QueueNotFound(message.queue_name)
    broker.emit_before("enqueue", message, delay_ms)
    params = enqueue_one_params(message, delay_ms, max_bytes=broker.settings.message_max_bytes)
    conn.execute(sql.ENQUEUE_ONE, params)
    broker.emit_after("enqueue", message, delay_ms)
    return message


def enqueue_messages(conn: psycopg.Connection[Any], messages: list[Message]) -> list[Message]:
    """Write many messages on ``conn`` in one statement (the relay's pass)."""
    if not messages:
        return messages
    broker = current_broker()
    for message in messages:
        if message.queue_name not in broker.queues:
            raise dramatiq.errors.QueueNotFound(message.queue_name)
        broker.emit_before("enqueue", message, None)
    params = enqueue_params(messages, max_bytes=broker.settings.message_max_bytes)
    conn.execute(sql.ENQUEUE, params)
    for message in messages:
        broker.emit_after("enqueue", message, None)
    return messages


def enqueue(conn: psycopg.Connection[Any], actor: dramatiq.Actor | str, *args: Any,
            delay_ms: int | None = None, options: dict[str, Any] | None = None, **kwargs: Any) -> Message:
    """Enqueue ``actor(*args, **kwargs)`` in the caller's transaction; return the message."""
    return enqueue_message(conn, build_message(actor, args, kwargs, options), delay_ms=delay_ms)


def finish_queued(conn: psycopg.Connection[Any], message_ids: list[str]) -> None:
    """Mark done the messages of ``message_ids`` still queued, without running them: their
    work was done by another job. Call it in the transaction that records that work, so a
    message is never done unless its work is recorded. No hook runs for them (no callback,
    pipeline step, result or job log line): only for messages that have none. A message
    already claimed, or cancelled, is left as it is (a claimed one must find its work made
    and end)."""
    if message_ids:
        conn.execute(sql.FINISH_QUEUED, {"ids": message_ids, "awaited": app.awaited_queues()})
