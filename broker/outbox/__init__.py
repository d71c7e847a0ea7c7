"""The transactional outbox and the relay.

An application writes its domain rows and the events they cause in one transaction:

    with psycopg.connect(url) as conn, conn.transaction():
        order_id = conn.execute("INSERT INTO shop.orders … RETURNING id").fetchone()[0]
        emit(conn, "order.placed", {"order_id": order_id})

``emit`` checks the topic and the payload *before* writing anything, so a refused
event leaves the caller's transaction usable. At commit, a NOTIFY wakes the relay.

The relay runs in every worker process and in the scheduler (no leader): each pass
(:func:`relay_once`) takes at most ``STANDMEET_RELAY_BATCH`` pending rows with ``FOR
UPDATE SKIP LOCKED`` (rows, not a cursor: concurrent relays skip each other's rows),
marking them relayed in the statement that takes them, and writes the messages their
routes call for, in event order, all in one short pipelined transaction.

A fleet's processes may load different modules (``run actors`` beside ``run reports``,
old and new versions during a deploy), so a relay takes only the events of the topics
it routes (:func:`routed_topics`): another topic's events stay pending, untouched, for a
process that knows them. Each relay records its topics with a heartbeat in
``standmeet.relays``, so an event no live relay routes shows in ``status``, the
dashboard and the metrics. Only an event at fault itself (its payload does not fit its
route, or Postgres refuses what it holds) is failed, with the reason; ``standmeet-jobs
outbox retry`` gives a failed event back to the relays.

Where things are: ``routes.py`` (topics, routes, :func:`emit`), ``relay.py`` (a relay
pass and the :class:`Relay` loop), ``receipts.py`` (waiting for a message's outcome).
This package's names are its public ones, gathered here.
"""

from broker.errors import InvalidPayload, PayloadTooLarge, UnknownTopic
from broker.outbox.relay import (
    MESSAGE_NAMESPACE,
    PRUNE_RELAYS,
    Relay,
    RelayResult,
    message_id_of,
    relay_once,
)
from broker.outbox.routes import (
    ROUTES,
    Route,
    check_payload,
    emit,
    emit_async,
    emit_params,
    route,
    routed_topics,
    routes_for,
)

__all__ = [
    "MESSAGE_NAMESPACE", "PRUNE_RELAYS", "ROUTES", "InvalidPayload", "PayloadTooLarge", "Relay", "RelayResult",
    "Route", "UnknownTopic", "check_payload", "emit", "emit_async", "emit_params", "message_id_of", "relay_once",
    "route", "routed_topics", "routes_for",
]
