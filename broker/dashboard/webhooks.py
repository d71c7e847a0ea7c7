"""Webhook endpoints, deliveries and attempts, read and steered from the tables.

The runtime must not import the application (``actors``), so replay does not call
``actors.webhooks.replay``: it puts the delivery back to *pending* and re-queues the
delivery's own ``webhook.deliver`` message (same message id, retries reset), or, when
that message is gone (pruned, or never made for a skipped delivery), writes a new one
with the broker's own enqueue statement. A delivery whose message is still queued or
running is only made due now: it is never delivered twice at once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from dramatiq.message import Message
from psycopg.rows import class_row

from broker import ops
from broker.engine import sql_enqueue
from broker.engine.codec import enqueue_params

DELIVER_ACTOR = "webhook.deliver"
DELIVER_QUEUE = "webhook"


@dataclass(frozen=True)
class Endpoint:
    id: int
    url: str
    event_types: list[str]
    enabled: bool
    failing_since: datetime | None
    disabled_reason: str | None
    busy_until: datetime | None
    pending: int
    failed: int
    succeeded: int
    skipped: int
    last_attempt_at: datetime | None
    last_outcome: str | None
    last_status: int | None
    last_error: str | None

    @property
    def health(self) -> str:
        if not self.enabled:
            return "disabled"
        if self.failing_since is not None:
            return "failing"
        return "healthy"

    @property
    def why(self) -> str:
        """Why it is disabled or failing, in the operator's words ('' when healthy)."""
        parts = []
        if not self.enabled:
            parts.append(self.disabled_reason or "disabled")
        if self.failing_since is not None and self.last_outcome and self.last_outcome != "ok":
            status = f" {self.last_status}" if self.last_status else ""
            error = f": {self.last_error}" if self.last_error else ""
            parts.append(f"last attempt {self.last_outcome}{status}{error}")
        return "; ".join(parts)


@dataclass(frozen=True)
class Delivery:
    id: int
    endpoint_id: int
    endpoint_url: str
    event_id: int
    event: str
    state: str
    attempts: int
    next_attempt_at: datetime | None
    last_outcome: str | None
    last_status: int | None
    last_error: str | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True)
class Attempt:
    attempt: int
    started_at: datetime
    duration_ms: int
    status_code: int | None
    outcome: str
    error: str | None
    response_body: str | None
    truncated: bool


ENDPOINTS = """
SELECT e.id, e.url, e.event_types, e.enabled, e.failing_since, e.disabled_reason, e.busy_until,
       count(d.id) FILTER (WHERE d.state = 'pending')::int AS pending,
       count(d.id) FILTER (WHERE d.state = 'failed')::int AS failed,
       count(d.id) FILTER (WHERE d.state = 'succeeded')::int AS succeeded,
       count(d.id) FILTER (WHERE d.state = 'skipped')::int AS skipped,
       last.started_at AS last_attempt_at, last.outcome AS last_outcome,
       last.status_code AS last_status, last.error AS last_error
FROM standmeet.webhook_endpoints e
LEFT JOIN standmeet.webhook_deliveries d ON d.endpoint_id = e.id
LEFT JOIN LATERAL (
    SELECT a.started_at, a.outcome, a.status_code, a.error
    FROM standmeet.webhook_attempts a
    JOIN standmeet.webhook_deliveries ad ON ad.id = a.delivery_id
    WHERE ad.endpoint_id = e.id
    ORDER BY a.started_at DESC, a.id DESC
    LIMIT 1
) last ON true
GROUP BY e.id, last.started_at, last.outcome, last.status_code, last.error
ORDER BY e.id
"""

DELIVERIES = """
SELECT d.id, d.endpoint_id, e.url AS endpoint_url, d.event_id, ev.type AS event, d.state, d.attempts,
       d.next_attempt_at, d.last_outcome, last.status_code AS last_status, last.error AS last_error,
       d.created_at, d.updated_at
FROM standmeet.webhook_deliveries d
JOIN standmeet.webhook_endpoints e ON e.id = d.endpoint_id
JOIN standmeet.webhook_events ev ON ev.id = d.event_id
LEFT JOIN LATERAL (
    SELECT a.status_code, a.error FROM standmeet.webhook_attempts a
    WHERE a.delivery_id = d.id ORDER BY a.attempt DESC, a.id DESC LIMIT 1
) last ON true
WHERE (%(endpoint_id)s::bigint IS NULL OR d.endpoint_id = %(endpoint_id)s::bigint)
  AND (%(delivery_id)s::bigint IS NULL OR d.id = %(delivery_id)s::bigint)
ORDER BY d.id DESC
LIMIT %(limit)s
"""

ATTEMPTS = """
SELECT attempt, started_at, duration_ms, status_code, outcome, error, response_body, truncated
FROM standmeet.webhook_attempts WHERE delivery_id = %(delivery_id)s ORDER BY attempt, id
"""

EVENT_PAYLOAD = """
SELECT ev.payload FROM standmeet.webhook_deliveries d
JOIN standmeet.webhook_events ev ON ev.id = d.event_id WHERE d.id = %(delivery_id)s
"""

MAKE_PENDING = """
UPDATE standmeet.webhook_deliveries SET state = 'pending', updated_at = now()
WHERE id = %(delivery_id)s RETURNING id
"""

#: The delivery's newest ``webhook.deliver`` message, locked against a concurrent replay.
DELIVER_MESSAGE = """
SELECT message_id::text, "state"::text, message::text
FROM dramatiq.queue
WHERE message->>'actor_name' = %(actor)s AND message->'args'->>0 = %(delivery_id)s::text
ORDER BY enqueued_at DESC
LIMIT 1
FOR UPDATE
"""

#: A queued (perhaps delayed) message made due now, and its queue woken.
#: A finished delivery message is run again by the operator's choice: the same message,
#: back to its queue, due now, its retries and blame cleared.
RUN_AGAIN = """
WITH again AS (
    UPDATE dramatiq.queue
    SET "state" = 'queued', eta = now(), mtime = now(), message = %(message)s::jsonb, error = NULL,
        worker_id = NULL, started_at = NULL, suspect_of = NULL, crashes = 0, cancelled_at = NULL
    WHERE message_id = %(message_id)s::uuid AND "state" IN ('done', 'rejected')
    RETURNING queue_name
)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM again
"""

MAKE_DUE = """
WITH due AS (
    UPDATE dramatiq.queue SET eta = now(), mtime = now()
    WHERE message_id = %(message_id)s::uuid AND "state" = 'queued'
    RETURNING queue_name
)
SELECT pg_notify(standmeet.enqueue_channel(queue_name), '') FROM due
"""


def endpoints(conn: psycopg.Connection[Any]) -> list[Endpoint]:
    with conn.cursor(row_factory=class_row(Endpoint)) as cur:
        return cur.execute(ENDPOINTS).fetchall()


def deliveries(conn: psycopg.Connection[Any], *, endpoint_id: int | None = None,
               delivery_id: int | None = None, limit: int = 50) -> list[Delivery]:
    with conn.cursor(row_factory=class_row(Delivery)) as cur:
        return cur.execute(
            DELIVERIES, {"endpoint_id": endpoint_id, "delivery_id": delivery_id, "limit": limit}
        ).fetchall()


def attempts(conn: psycopg.Connection[Any], delivery_id: int) -> list[Attempt]:
    with conn.cursor(row_factory=class_row(Attempt)) as cur:
        return cur.execute(ATTEMPTS, {"delivery_id": delivery_id}).fetchall()


def payload(conn: psycopg.Connection[Any], delivery_id: int) -> Any:
    row = conn.execute(EVENT_PAYLOAD, {"delivery_id": delivery_id}).fetchone()
    return None if row is None else row[0]


def set_enabled(conn: psycopg.Connection[Any], endpoint_id: int, enabled: bool, *, reason: str) -> bool:
    """Turn an endpoint on (its failure streak forgotten) or off (with ``reason``)."""
    return ops.set_endpoint_enabled(conn, endpoint_id, enabled, reason=reason)


def replay(conn: psycopg.Connection[Any], delivery_id: int) -> str | None:
    """Deliver ``delivery_id`` again; returns its message id (None: no such delivery)."""
    with conn.transaction():
        if conn.execute(MAKE_PENDING, {"delivery_id": delivery_id}).fetchone() is None:
            return None
        row = conn.execute(DELIVER_MESSAGE, {"actor": DELIVER_ACTOR, "delivery_id": delivery_id}).fetchone()
        if row is not None and row[1] == "consumed":
            return str(row[0])  # running now: it reads the delivery as pending when it settles
        if row is not None and row[1] == "queued":
            conn.execute(MAKE_DUE, {"message_id": row[0]})
            return str(row[0])
        if row is not None:
            message = Message.decode(row[2].encode())
            options = {k: v for k, v in message.options.items() if k not in ("retries", "traceback")}
            message = dataclasses.replace(message, options=options)  # copy() would merge them
            # enqueue never resurrects a message that ran; an operator's replay does, on purpose
            conn.execute(RUN_AGAIN, {"message_id": message.message_id, "message": message.encode().decode("utf-8")})
            return message.message_id
        else:
            message = Message(queue_name=DELIVER_QUEUE, actor_name=DELIVER_ACTOR, args=(delivery_id,),
                              kwargs={}, options={})
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
        ops.record_delivery_messages(conn, [delivery_id], [message.message_id])
        return message.message_id
