"""The outbox and its relays: its lag, events not relayed (pending, unrouted, failed),
the relays alive, and the retry of failed events."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg

from broker.ops.common import DEFAULT_RESCUE_AFTER_S, MAX_BIGINT, MAX_LIMIT, OpsError, _float, _Row
from broker.pg.liveness import rescue_window


@dataclasses.dataclass(frozen=True)
class RelayStatus(_Row):
    """An outbox relay (one per worker process, scheduler or relay process) and its topics."""

    id: str
    host: str
    pid: int
    topics: list[str]
    started_at: datetime
    last_heartbeat_age_s: float
    alive: bool
    stopped_at: datetime | None


@dataclasses.dataclass(frozen=True)
class UnroutedTopic(_Row):
    """Pending events of a topic that no live relay routes: nothing will relay them."""

    topic: str
    events: int
    oldest_age_s: float


@dataclasses.dataclass(frozen=True)
class OutboxStatus(_Row):
    lag_s: float | None                 # how long the oldest pending event has waited
    failed: int                         # events kept with their error (``outbox retry`` re-relays them)
    unrouted: list[UnroutedTopic]       # pending topics that no live relay routes
    relays: list[RelayStatus]           # live ones first

    @property
    def routed_topics(self) -> list[str]:
        """The topics some live relay routes."""
        return sorted({t for r in self.relays if r.alive for t in r.topics})


#: The states of an event not relayed, as :func:`list_outbox_events` names them.
OUTBOX_STATES: tuple[str, ...] = ("pending", "unrouted", "failed")


@dataclasses.dataclass(frozen=True)
class OutboxEvent(_Row):
    id: int
    topic: str
    state: str                          # pending | unrouted (no live relay routes it) | failed
    created_at: datetime
    age_s: float
    error: str | None                   # why it failed


#: How long the oldest event not yet relayed has waited (NULL: nothing waits).
OUTBOX_LAG = """
SELECT EXTRACT(EPOCH FROM now() - created_at)::float8
FROM standmeet.outbox
WHERE relayed_at IS NULL AND error IS NULL
ORDER BY id
LIMIT 1
"""


def outbox_lag_s(conn: psycopg.Connection[Any]) -> float | None:
    """Seconds the oldest unrelayed event has waited; None when none waits."""
    row = conn.execute(OUTBOX_LAG).fetchone()
    return None if row is None else _float(row[0])


# -- the outbox and its relays -----------------------------------------------------------

#: The topics live relays route (a fresh heartbeat, not stopped).
#: Whether a live relay can take the event ``o``: one routes its topic, to each of the
#: actors its emitter routed it to (an older release's relay, which knows fewer, leaves it).
_TAKEN_BY_A_LIVE_RELAY = """EXISTS (
    SELECT 1 FROM standmeet.relays r
    WHERE r.stopped_at IS NULL AND r.heartbeat_at > now() - """ + rescue_window("r", "rescue_after_s") + """
      AND o.topic = ANY(r.topics) AND (o.routes IS NULL OR r.routes IS NULL OR r.routes -> o.topic @> o.routes))"""

#: Each pending topic with events no live relay can take (no live relay routes the topic,
#: or none to all the actors their emitter routed it to), with those events and the
#: oldest's age. The pending topics are found by skipping from one to the next on the
#: (topic, id) index, not by reading every pending event.
UNROUTED_TOPICS = """
WITH RECURSIVE topics AS (
    (SELECT topic FROM standmeet.outbox WHERE relayed_at IS NULL AND error IS NULL ORDER BY topic LIMIT 1)
    UNION ALL
    SELECT (SELECT o.topic FROM standmeet.outbox o
            WHERE o.relayed_at IS NULL AND o.error IS NULL AND o.topic > t.topic
            ORDER BY o.topic LIMIT 1)
    FROM topics t WHERE t.topic IS NOT NULL
)
SELECT t.topic, counted.events, counted.oldest_age_s
FROM topics t
CROSS JOIN LATERAL (
    SELECT count(*) AS events, EXTRACT(EPOCH FROM now() - min(o.created_at))::float8 AS oldest_age_s
    FROM standmeet.outbox o
    WHERE o.topic = t.topic AND o.relayed_at IS NULL AND o.error IS NULL AND NOT """ + _TAKEN_BY_A_LIVE_RELAY + """
) counted
WHERE t.topic IS NOT NULL AND counted.events > 0
ORDER BY t.topic
"""

OUTBOX_FAILED = "SELECT count(*) FROM standmeet.outbox WHERE error IS NOT NULL"

RELAY_OVERVIEW = """
SELECT r.id::text, r.hostname, r.pid, r.topics, r.started_at,
       EXTRACT(EPOCH FROM now() - r.heartbeat_at)::float8,
       r.stopped_at IS NULL AND r.heartbeat_at > now() - """ + rescue_window("r", "rescue_after_s") + """ AS alive,
       r.stopped_at
FROM standmeet.relays r
ORDER BY alive DESC, r.started_at DESC, r.id
"""

#: Events not relayed, oldest first: pending, unrouted (no live relay can take them:
#: :data:`_TAKEN_BY_A_LIVE_RELAY`), or failed (with the reason).
LIST_OUTBOX_EVENTS = """
SELECT o.id, o.topic,
       CASE WHEN o.error IS NOT NULL THEN 'failed'
            WHEN NOT """ + _TAKEN_BY_A_LIVE_RELAY + """ THEN 'unrouted'
            ELSE 'pending' END,
       o.created_at, EXTRACT(EPOCH FROM now() - o.created_at)::float8, o.error
FROM standmeet.outbox o
WHERE o.relayed_at IS NULL
  AND (NOT %(failed)s OR o.error IS NOT NULL)
  AND (%(topic)s::text IS NULL OR o.topic = %(topic)s)
  AND (%(ids)s::bigint[] IS NULL OR o.id = ANY(%(ids)s::bigint[]))
ORDER BY o.id
LIMIT %(limit)s
"""

#: Failed events (the ids given, or every one of a topic, or every one) back to pending,
#: their error cleared: a relay that routes their topic takes them again (woken at
#: commit). A re-relayed event makes the messages it would have made (their ids derive
#: from the event's), so one whose message was written before is never run twice.
RETRY_OUTBOX_EVENTS = """
WITH retried AS (
    UPDATE standmeet.outbox
    SET error = NULL, relayed_at = NULL, relay_txid = NULL, relayed_by = NULL, messages = NULL
    WHERE error IS NOT NULL
      AND (%(ids)s::bigint[] IS NULL OR id = ANY(%(ids)s::bigint[]))
      AND (%(topic)s::text IS NULL OR topic = %(topic)s)
    RETURNING id
), woken AS (
    SELECT pg_notify(standmeet.outbox_channel(), '') FROM (SELECT 1 FROM retried LIMIT 1) AS any_retried
)
SELECT (SELECT count(*) FROM retried), (SELECT count(*) FROM woken)
"""

#: What became of some events: (id, state), state one of OUTBOX_STATES or ``relayed``.
OUTBOX_EVENT_STATES = """
SELECT o.id, CASE WHEN o.error IS NOT NULL THEN 'failed'
                  WHEN o.relayed_at IS NOT NULL THEN 'relayed'
                  ELSE 'pending' END
FROM standmeet.outbox o WHERE o.id = ANY(%(ids)s::bigint[])
"""


def relay_overview(conn: psycopg.Connection[Any], *,
                   rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[RelayStatus]:
    """The outbox relays, live ones first; "alive" is judged with the database's clock."""
    return [RelayStatus(r[0], r[1], int(r[2]), list(r[3]), r[4], float(r[5]), bool(r[6]), r[7])
            for r in conn.execute(RELAY_OVERVIEW, {"rescue_after_s": rescue_after_s}).fetchall()]


def unrouted_topics(conn: psycopg.Connection[Any], *,
                    rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[UnroutedTopic]:
    """Pending topics that no live relay routes: their events wait for a process that does."""
    return [UnroutedTopic(r[0], int(r[1]), float(r[2]))
            for r in conn.execute(UNROUTED_TOPICS, {"rescue_after_s": rescue_after_s}).fetchall()]


def outbox_overview(conn: psycopg.Connection[Any], *,
                    rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> OutboxStatus:
    """The outbox at a glance: its lag, its failed events, the topics nobody routes, the relays."""
    row = conn.execute(OUTBOX_FAILED).fetchone()
    return OutboxStatus(outbox_lag_s(conn), int(row[0]) if row else 0,
                        unrouted_topics(conn, rescue_after_s=rescue_after_s),
                        relay_overview(conn, rescue_after_s=rescue_after_s))


def list_outbox_events(conn: psycopg.Connection[Any], *, failed: bool = False, topic: str | None = None,
                       ids: Sequence[int] | None = None, limit: int = 50,
                       rescue_after_s: float = DEFAULT_RESCUE_AFTER_S) -> list[OutboxEvent]:
    """Events not relayed, oldest first (``failed``: only those kept with an error)."""
    if not 0 < limit <= MAX_LIMIT:
        raise OpsError(f"limit must be between 1 and {MAX_LIMIT}, not {limit}")
    rows = conn.execute(LIST_OUTBOX_EVENTS, {
        "failed": failed, "topic": topic or None, "ids": None if ids is None else list(ids), "limit": limit,
        "rescue_after_s": rescue_after_s}).fetchall()
    return [OutboxEvent(int(r[0]), r[1], r[2], r[3], float(r[4]), r[5]) for r in rows]


def retry_outbox_events(conn: psycopg.Connection[Any], *, ids: Sequence[int] | None = None,
                        topic: str | None = None) -> int:
    """Give failed events (the ids given, else every one, of ``topic`` if given) back to
    the relays; return how many. Events pending or relayed are left alone."""
    with conn.transaction():
        row = conn.execute(RETRY_OUTBOX_EVENTS, {"ids": None if ids is None else list(ids),
                                                 "topic": topic or None}).fetchone()
    return int(row[0]) if row else 0


def outbox_event_states(conn: psycopg.Connection[Any], ids: Sequence[int]) -> dict[int, str]:
    """id → pending | failed | relayed, for those of ``ids`` that exist."""
    return {int(r[0]): r[1] for r in conn.execute(OUTBOX_EVENT_STATES, {"ids": list(ids)}).fetchall()}


def parse_event_id(value: str) -> int:
    """An outbox event id; a clear error when it is not one."""
    try:
        number = int(str(value).strip())
    except ValueError:
        raise OpsError(f"{value!r} is not an outbox event id (a number)") from None
    if not 0 < number <= MAX_BIGINT:
        raise OpsError(f"{value!r} is not an outbox event id (a number from 1 to {MAX_BIGINT})")
    return number
