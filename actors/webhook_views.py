"""What operators see of webhooks: endpoints with their health, deliveries with their
last attempt, a delivery's attempts and its event's payload.

Two views of the same tables: the command line's (``webhooks list``, ``webhooks
deliveries --json``: :class:`EndpointStatus`, :class:`DeliveryStatus`) and the
dashboard's pages (:class:`Endpoint`, :class:`Delivery`, :class:`Attempt`). Each
function takes a psycopg 3 connection and only reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import class_row

from broker.ops import MAX_LIMIT, OpsError

#: The most webhook.ping events one call emits (all in one transaction).
PING_MOST = 10_000

#: Largest id of an endpoint or a delivery (Postgres bigint).
MAX_ROW_ID = 2 ** 63 - 1


class _Row:
    def asdict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


# -- the command line's ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeliveryStatus(_Row):
    id: int
    endpoint_id: int
    event: str                          # the event's type
    state: str                          # pending | succeeded | failed | skipped
    attempts: int
    last_status: int | None             # the last attempt's HTTP status
    last_error: str | None              # the last attempt's error (or its outcome)
    event_id: int
    last_outcome: str | None
    updated_at: datetime
    next_attempt_at: datetime | None


@dataclasses.dataclass(frozen=True)
class EndpointStatus(_Row):
    id: int
    url: str
    event_types: list[str]
    enabled: bool
    disabled_reason: str | None
    failing_since: datetime | None
    last_attempt_at: datetime | None
    last_outcome: str | None
    last_status: int | None
    last_error: str | None
    pending: int
    failed: int

    @property
    def why_failing(self) -> str | None:
        """One line on why it fails, or None while it is healthy."""
        if not self.enabled:
            return f"disabled: {self.disabled_reason or 'by an operator'}"
        if self.failing_since is None:
            return None
        last = self.last_error or self.last_outcome or "unknown"
        if self.last_status is not None:
            last = f"HTTP {self.last_status}" + ("" if self.last_error is None else f": {self.last_error}")
        return f"failing since {self.failing_since.isoformat(timespec='seconds')}: {last}"


WEBHOOK_DELIVERIES = """
SELECT d.id, d.endpoint_id, ev.type, d.state, d.attempts, a.status_code,
       coalesce(a.error, CASE WHEN a.outcome <> 'ok' THEN a.outcome END),
       d.event_id, coalesce(a.outcome, d.last_outcome), d.updated_at, d.next_attempt_at
FROM standmeet.webhook_deliveries d
JOIN standmeet.webhook_events ev ON ev.id = d.event_id
LEFT JOIN LATERAL (
    SELECT status_code, outcome, error FROM standmeet.webhook_attempts
    WHERE delivery_id = d.id ORDER BY attempt DESC, id DESC LIMIT 1
) a ON true
WHERE (%(endpoint_id)s::bigint IS NULL OR d.endpoint_id = %(endpoint_id)s)
ORDER BY d.id DESC
LIMIT %(limit)s
"""

#: An endpoint ``e``'s last attempt: that of its most recently attempted delivery, found
#: through the (endpoint_id, updated_at) index (a lateral subquery of the two lists below).
_LAST_ATTEMPT = """
    SELECT last.started_at, last.outcome, last.status_code, last.error
    FROM standmeet.webhook_deliveries d
    CROSS JOIN LATERAL (
        SELECT started_at, outcome, status_code, error FROM standmeet.webhook_attempts
        WHERE delivery_id = d.id ORDER BY attempt DESC, id DESC LIMIT 1
    ) last
    WHERE d.endpoint_id = e.id AND d.attempts > 0
    ORDER BY d.updated_at DESC, d.id DESC
    LIMIT 1
"""
WEBHOOK_ENDPOINTS = """
SELECT e.id, e.url, e.event_types, e.enabled, e.disabled_reason, e.failing_since,
       a.started_at, a.outcome, a.status_code, a.error,
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'pending'),
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'failed')
FROM standmeet.webhook_endpoints e
LEFT JOIN LATERAL (""" + _LAST_ATTEMPT + """) a ON true
ORDER BY e.id
"""


def webhook_deliveries(conn: psycopg.Connection[Any], endpoint_id: int | None = None, *,
                       limit: int = 100) -> list[DeliveryStatus]:
    """Deliveries, newest first, with their last attempt's HTTP status and error."""
    if not 0 < limit <= MAX_LIMIT:
        raise OpsError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    rows = conn.execute(WEBHOOK_DELIVERIES, {"endpoint_id": endpoint_id, "limit": limit}).fetchall()
    return [DeliveryStatus(int(r[0]), int(r[1]), r[2], r[3], int(r[4]), r[5], r[6], int(r[7]), r[8], r[9], r[10])
            for r in rows]


def webhook_endpoints(conn: psycopg.Connection[Any]) -> list[EndpointStatus]:
    """Endpoints with their health: the last attempt, and deliveries pending or failed."""
    return [EndpointStatus(int(r[0]), r[1], list(r[2]), bool(r[3]), r[4], r[5], r[6], r[7], r[8], r[9],
                           int(r[10]), int(r[11]))
            for r in conn.execute(WEBHOOK_ENDPOINTS).fetchall()]


# -- the dashboard's ---------------------------------------------------------------------

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


#: Each endpoint with its deliveries counted by state and its last attempt: each count a
#: look-up of the endpoint's own deliveries, and the last attempt that of its most recently
#: attempted delivery (as ``WEBHOOK_ENDPOINTS``), each through the (endpoint_id, updated_at)
#: index: never a pass over every delivery and attempt (a join of them all took 1.6 s at
#: 400,000 deliveries, and the page refreshes every 3 s).
ENDPOINTS = """
SELECT e.id, e.url, e.event_types, e.enabled, e.failing_since, e.disabled_reason, e.busy_until,
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'pending')::int
           AS pending,
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'failed')::int
           AS failed,
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'succeeded')::int
           AS succeeded,
       (SELECT count(*) FROM standmeet.webhook_deliveries d WHERE d.endpoint_id = e.id AND d.state = 'skipped')::int
           AS skipped,
       last.started_at AS last_attempt_at, last.outcome AS last_outcome,
       last.status_code AS last_status, last.error AS last_error
FROM standmeet.webhook_endpoints e
LEFT JOIN LATERAL (""" + _LAST_ATTEMPT + """) last ON true
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
