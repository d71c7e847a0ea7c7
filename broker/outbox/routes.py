"""The outbox's producer side: topics and their routes (:func:`route`), and :func:`emit`,
which writes an event in the caller's transaction once its payload is known to be one
its routes take. The relay (:mod:`broker.outbox.relay`) turns events into messages.

    with psycopg.connect(url) as conn, conn.transaction():
        order_id = conn.execute("INSERT INTO shop.orders … RETURNING id").fetchone()[0]
        emit(conn, "order.placed", {"order_id": order_id})
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from broker.engine import sql
from broker.engine.codec import MAX_JSON_DEPTH, check_json_value
from broker.errors import InvalidPayload, PayloadTooLarge, UnknownTopic
from broker.observability import tracing
from broker.services import current_broker

ArgsBuilder = Callable[[int, dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any]]]


@dataclass(frozen=True)
class Route:
    """Events of ``topic`` become a message to ``actor``, with arguments from the event."""

    topic: str
    actor: str
    args: ArgsBuilder = field(default=lambda event_id, payload: ((event_id,), {}))


#: topic -> routes. Domain code declares its routes with :func:`route` at import.
ROUTES: dict[str, list[Route]] = {}


def route(topic: str, actor: str, args: ArgsBuilder | None = None) -> Route:
    """Declare that events of ``topic`` are delivered to ``actor``."""
    r = Route(topic, actor, args) if args is not None else Route(topic, actor)
    existing = ROUTES.setdefault(topic, [])
    if not any(x.actor == actor for x in existing):
        existing.append(r)
    return r


def routed_topics(broker: Any | None = None) -> list[str]:
    """The topics this process relays: those whose every route names an actor it has.

    A topic routed to an actor this process lacks is left to a process that has it (the
    event would otherwise be failed for what this process does not understand)."""
    actors = (broker or current_broker()).actors
    return sorted(topic for topic, routes in list(ROUTES.items())
                  if routes and all(r.actor in actors for r in routes))


def route_actors(routes: list[Route]) -> str:
    """The actors of ``routes``, as the JSON array an event and a relay record (sorted)."""
    return json.dumps(sorted(r.actor for r in routes), separators=(",", ":"))


def routes_for(topic: str) -> list[Route]:
    routes = ROUTES.get(topic)
    if not routes:
        known = ", ".join(sorted(ROUTES)) or "none"
        raise UnknownTopic(f"no route for topic {topic!r}; the known topics are: {known}")
    return routes


#: Deepest nesting of objects and lists a payload may have.
MAX_PAYLOAD_DEPTH = MAX_JSON_DEPTH


def check_payload(topic: str, payload: Any) -> None:
    """Refuse what Postgres' jsonb would refuse (inside the caller's transaction, aborting
    it), before anything is written: :func:`broker.engine.codec.check_json_value`, the check
    messages get too, raising :class:`InvalidPayload`."""
    if not isinstance(payload, dict):
        raise InvalidPayload(f"the payload of {topic!r} must be a JSON object, not {type(payload).__name__}")
    check_json_value(payload, what=f"the payload of {topic!r}", error=InvalidPayload)


def emit_params(topic: str, payload: dict[str, Any], *, max_payload_bytes: int | None = None) -> dict[str, Any]:
    """Parameters of :data:`broker.engine.sql.EMIT` for an event, once it is known to be one its
    routes take: :class:`UnknownTopic`, :class:`PayloadTooLarge` or :class:`InvalidPayload`
    otherwise, before anything is written. The one preparation of :func:`emit` and
    :func:`emit_async`."""
    routes = routes_for(topic)
    cap = max_payload_bytes if max_payload_bytes is not None else current_broker().settings.outbox_max_payload_bytes
    check_payload(topic, payload)
    if tracing.OUTBOX_KEY in payload:  # (an event's own payload: what emit_event keeps elsewhere may use it)
        raise InvalidPayload(f"the payload of {topic!r} has the key {tracing.OUTBOX_KEY!r}, which the outbox "
                             "keeps for the trace an event carries: name it otherwise")
    try:
        text = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidPayload(f"the payload of {topic!r} is not JSON: {exc}") from None
    size = len(text.encode("utf-8"))
    if size > cap:
        raise PayloadTooLarge(
            f"the payload of {topic!r} is {size} bytes, over the cap of {cap} "
            "(STANDMEET_OUTBOX_MAX_PAYLOAD_BYTES); store large data in a table and emit its id"
        )
    for r in routes:  # a payload its routes cannot use is refused now, not at relay time
        try:
            r.args(0, payload)
        except Exception as exc:
            raise UnknownTopic(f"the payload of {topic!r} does not fit the route to {r.actor}: {exc!r}") from exc
    carrier = tracing.produced(f"{topic} emit", {"messaging.system": "standmeet.outbox",
                                                 "messaging.destination.name": topic})
    if carrier:  # the relay moves it to the event's messages (outbox → relay → actors)
        text = json.dumps({**payload, tracing.OUTBOX_KEY: carrier}, separators=(",", ":"))
    # the routes this process knows: a relay that knows fewer leaves the event to one that knows them all
    return {"topic": topic, "payload": text, "routes": route_actors(routes)}


def emit(conn: psycopg.Connection[Any], topic: str, payload: dict[str, Any], *,
         max_payload_bytes: int | None = None) -> int:
    """Write an event in the caller's transaction; return its id.

    Raises :class:`UnknownTopic`, :class:`PayloadTooLarge` or :class:`InvalidPayload`
    before writing anything (so the caller's transaction can still commit).
    """
    row = conn.execute(sql.EMIT, emit_params(topic, payload, max_payload_bytes=max_payload_bytes)).fetchone()
    assert row is not None
    return int(row[0])


async def emit_async(aconn: psycopg.AsyncConnection[Any], topic: str, payload: dict[str, Any], *,
                     max_payload_bytes: int | None = None) -> int:
    """:func:`emit` for async code: ``await emit_async(aconn, topic, payload)`` writes the
    event on a psycopg ``AsyncConnection``, in its transaction, with the same checks."""
    params = emit_params(topic, payload, max_payload_bytes=max_payload_bytes)
    row = await (await aconn.execute(sql.EMIT, params)).fetchone()
    assert row is not None
    return int(row[0])
