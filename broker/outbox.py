"""The transactional outbox and the relay.

An application writes its domain rows and the events they cause in one transaction:

    with psycopg.connect(url) as conn, conn.transaction():
        doc_id = conn.execute("INSERT INTO standmeet.documents …").fetchone()[0]
        emit(conn, "document.written", {"document_id": doc_id})

``emit`` checks the topic and the payload *before* writing anything, so a refused
event leaves the caller's transaction usable. At commit, a NOTIFY wakes the relay.

The relay runs in every worker process and in the scheduler (no leader): each pass
(:func:`relay_once`) takes at most ``STANDMEET_RELAY_BATCH`` pending rows with ``FOR
UPDATE SKIP LOCKED`` (rows, not a cursor: concurrent relays skip each other's rows),
marking them relayed in the statement that takes them, and writes the messages their
routes call for, in event order, all in one short pipelined transaction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import psycopg
from dramatiq.message import Message
from psycopg.types.json import Jsonb

from broker import detach, sql, tracing
from broker.backoff import Backoff
from broker.errors import InvalidPayload, PayloadTooLarge, UnknownTopic
from broker.pgbroker import (
    batch_params,
    compact_json,
    current_broker,
    message_json,
    message_priority,
)
from broker.pgpool import Outage, close_quietly

logger = logging.getLogger(f"standmeet.{__name__}")

#: Namespace of the message ids derived from (outbox id, route): a relayed event's
#: messages have stable ids, so they can be traced back to it.
MESSAGE_NAMESPACE = uuid.UUID("6f1d3a52-7d2e-4f0e-9c41-5b8e0d3c9a10")

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


def routes_for(topic: str) -> list[Route]:
    routes = ROUTES.get(topic)
    if not routes:
        known = ", ".join(sorted(ROUTES)) or "none"
        raise UnknownTopic(f"no route for topic {topic!r}; the known topics are: {known}")
    return routes


#: Deepest nesting of objects and lists a payload may have.
MAX_PAYLOAD_DEPTH = 32


def _bad_text(text: str) -> str | None:
    if "\x00" in text:
        return "a \\u0000 (NUL) character, which Postgres cannot store"
    if any("\ud800" <= c <= "\udfff" for c in text):
        return "a lone surrogate (not valid Unicode)"
    return None


def check_payload(topic: str, payload: Any) -> None:
    """Refuse what Postgres' jsonb would refuse (inside the caller's transaction, aborting
    it), before anything is written. Walks iteratively: depth cannot blow the stack."""
    if not isinstance(payload, dict):
        raise InvalidPayload(f"the payload of {topic!r} must be a JSON object, not {type(payload).__name__}")
    stack: list[tuple[Any, int, str]] = [(payload, 1, "$")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict | list | tuple):
            if depth > MAX_PAYLOAD_DEPTH:
                raise InvalidPayload(f"the payload of {topic!r} nests deeper than {MAX_PAYLOAD_DEPTH} levels")
            if isinstance(value, dict):
                for key, item in value.items():
                    if not isinstance(key, str):
                        raise InvalidPayload(f"the payload of {topic!r} has a non-string key at {path}")
                    bad = _bad_text(key)
                    if bad:
                        raise InvalidPayload(f"a key of the payload of {topic!r} at {path} holds {bad}")
                    stack.append((item, depth + 1, f"{path}.{key[:40]}"))
            else:
                stack.extend((item, depth + 1, f"{path}[{n}]") for n, item in enumerate(value))
        elif isinstance(value, str):
            bad = _bad_text(value)
            if bad:
                raise InvalidPayload(f"the payload of {topic!r} holds {bad} at {path}")
        elif isinstance(value, float):
            if value != value or value in (float("inf"), float("-inf")):
                raise InvalidPayload(f"the payload of {topic!r} holds {value!r} at {path}, which JSON cannot express")
        elif value is not None and not isinstance(value, bool | int):
            raise InvalidPayload(f"the payload of {topic!r} holds a {type(value).__name__} at {path}, not JSON")


def emit(conn: psycopg.Connection[Any], topic: str, payload: dict[str, Any], *,
         max_payload_bytes: int | None = None) -> int:
    """Write an event in the caller's transaction; return its id.

    Raises :class:`UnknownTopic`, :class:`PayloadTooLarge` or :class:`InvalidPayload`
    before writing anything (so the caller's transaction can still commit).
    """

    routes = routes_for(topic)
    cap = max_payload_bytes if max_payload_bytes is not None else current_broker().settings.outbox_max_payload_bytes
    check_payload(topic, payload)
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
    row = conn.execute(sql.EMIT, {"topic": topic, "payload": text}).fetchone()
    assert row is not None
    return int(row[0])


@dataclass(frozen=True)
class RelayResult:
    """What one relay pass did."""

    claimed: int
    messages: int
    failed: int = 0


def message_id_of(event_id: int, index: int) -> str:
    """The id of the message an event's ``index``-th route makes: ``uuid5(MESSAGE_NAMESPACE,
    "<event id>/<index>")``, spelt out (``uuid.uuid5`` and ``str`` cost more than the rest of
    building the message): the SHA-1 of the namespace is taken once and copied, and the
    version and variant are set in the hex digits. A re-relayed event makes the same ids."""
    sha = _NAMESPACE_SHA1.copy()
    sha.update(b"%d/%d" % (event_id, index))
    h = sha.hexdigest()
    # version 5 in the 13th digit; RFC 4122 variant (10xx) in the 17th
    return f"{h[:8]}-{h[8:12]}-5{h[13:16]}-{_VARIANT[h[16]]}{h[17:20]}-{h[20:32]}"


_NAMESPACE_SHA1 = hashlib.sha1(MESSAGE_NAMESPACE.bytes)
_VARIANT = {d: format((int(d, 16) & 0x3) | 0x8, "x") for d in "0123456789abcdef"}


@dataclass(frozen=True)
class _Target:
    """What a route's messages share: the actor, its priority (as the text sent), and the
    start of their JSON text up to the arguments."""

    actor: dramatiq.Actor[Any, Any]
    priority: str
    head: str


def _target(broker: Any, actor_name: str) -> _Target:
    actor = broker.get_actor(actor_name)
    head = f'{{"queue_name":{compact_json(actor.queue_name)},"actor_name":{compact_json(actor.actor_name)},"args":'
    return _Target(actor, str(int(actor.priority)), head)


#: Rows a relay pass claims per statement. A pass (one transaction, at most ``limit``
#: rows) claims in chunks on a pipelined connection: while Postgres marks the next chunk
#: and writes the last one's messages, Python builds the messages of this one.
RELAY_CHUNK_ROWS = 500


@dataclass
class _Pass:
    """What a relay pass needs per event, settled once per pass."""

    broker: Any
    foreign: bool  # an enqueue hook other than the tracing one: every message is hooked
    hooked_unless_carried: bool  # a message without a carrier goes through the hooks
    now_ms: int
    targets: dict[str, _Target] = field(default_factory=dict)
    hooked: list[Message[Any]] = field(default_factory=list)
    messages: int = 0
    failed: int = 0


def _begin_pass() -> _Pass:
    broker = current_broker()
    foreign = bool(broker._hooks("after_enqueue")) or not broker.before_enqueue_only_carries_traces()
    # without a carrier of its own, a message needs the tracing hook only when it has work
    hooked_unless_carried = foreign or (bool(broker._hooks("before_enqueue")) and not tracing.nothing_to_carry())
    return _Pass(broker, foreign, hooked_unless_carried, int(time.time() * 1000))


def _relay_rows(conn: psycopg.Connection[Any], state: _Pass, rows: list[Any]) -> None:
    """Send the messages of claimed ``rows`` (in event order) and the failures of those
    that cannot be relayed; on a pipelined connection, nothing waits for them here."""
    rows.sort(key=lambda row: row[0])
    broker = state.broker
    # in event order: a message's (JSON text, priority), or a Message for the hooks
    pending: list[tuple[str, str] | Message[Any]] = []
    for event_id, topic, payload in rows:
        try:
            built: list[tuple[str, str] | Message[Any]] = []
            carrier = payload.pop(tracing.OUTBOX_KEY, None) if isinstance(payload, dict) else None
            options = {tracing.OPTION: carrier} if carrier else {}
            for index, r in enumerate(routes_for(topic)):
                args, kwargs = r.args(event_id, payload)
                target = state.targets.get(r.actor)
                if target is None:
                    target = state.targets[r.actor] = _target(broker, r.actor)
                message_id = message_id_of(event_id, index)
                if state.foreign or (state.hooked_unless_carried and not carrier):
                    # as actor.message_with_options builds it, with the event's own id
                    built.append(Message(queue_name=target.actor.queue_name, actor_name=target.actor.actor_name,
                                         args=tuple(args), kwargs=kwargs or {}, options=dict(options),
                                         message_id=message_id, message_timestamp=state.now_ms))
                else:
                    built.append((f'{target.head}{compact_json(args)},"kwargs":{compact_json(kwargs) if kwargs else "{}"},'
                                  f'"options":{compact_json(options) if options else "{}"},'
                                  f'"message_id":"{message_id}","message_timestamp":{state.now_ms}}}',
                                  target.priority))
        except Exception as exc:  # keep the event, say why, go on with the rest
            logger.error("outbox event %s (%s) cannot be relayed: %s", event_id, topic, exc)
            conn.execute(sql.RELAY_FAIL, {"id": event_id, "error": f"{type(exc).__name__}: {exc}"})
            state.failed += 1
            continue
        pending.extend(built)
    hooked = [m for m in pending if isinstance(m, Message)]
    for message in hooked:  # as enqueue_messages does
        if message.queue_name not in broker.queues:
            raise dramatiq.errors.QueueNotFound(message.queue_name)
        broker.emit_before("enqueue", message, None)
    for queue in {target.actor.queue_name for target in state.targets.values()}:
        if queue not in broker.queues:
            raise dramatiq.errors.QueueNotFound(queue)
    if pending:
        texts: list[str] = []
        priorities: list[str] = []
        for m in pending:
            if isinstance(m, Message):
                texts.append(message_json(m))
                priorities.append(str(message_priority(m)))
            else:
                texts.append(m[0])
                priorities.append(m[1])
        conn.execute(sql.ENQUEUE, batch_params(texts, priorities))
    state.hooked.extend(hooked)
    state.messages += len(pending)


def relay_once(conn: psycopg.Connection[Any], *, limit: int = 200, chunk_rows: int = RELAY_CHUNK_ROWS) -> RelayResult:
    """Relay at most ``limit`` pending events in one transaction on ``conn``, oldest first:
    each statement takes and marks up to ``chunk_rows`` of them, another writes
    their messages (in event order). The statements are pipelined: the next chunk is
    claimed while this one's messages are built.

    A message goes through the broker's enqueue hooks, as every enqueue does, unless every
    hook is declared carrier-only and would leave the message as it is (the event brought
    its trace along, or there is nothing to carry): then its JSON text is written
    straight from the route, as Dramatiq would encode it, without a ``Message`` in between.
    The ``after_enqueue`` hooks run once the pass has committed.
    """

    counts = Jsonb({topic: len(routes) for topic, routes in ROUTES.items()})
    state: _Pass | None = None
    claimed = 0
    with conn.pipeline(), conn.transaction():
        asked = min(limit, chunk_rows)
        cur = conn.cursor()
        cur.execute(sql.RELAY_CLAIM, {"limit": asked, "counts": counts})
        while True:
            rows = cur.fetchall()
            claimed += len(rows)
            following = None
            if len(rows) == asked and claimed < limit:
                asked = min(limit - claimed, chunk_rows)
                following = conn.cursor()
                following.execute(sql.RELAY_CLAIM, {"limit": asked, "counts": counts})
            if rows:
                if state is None:
                    state = _begin_pass()
                _relay_rows(conn, state, rows)
            if following is None:
                break
            cur = following
    if state is None:
        return RelayResult(0, 0)
    for message in state.hooked:
        state.broker.emit_after("enqueue", message, None)
    return RelayResult(claimed, state.messages, state.failed)


class Relay:
    """The relay loop of one process: woken by NOTIFY, with a poll fallback.

    Owns one dedicated connection (the ``relay 1`` of the connection budget).
    Start it with :meth:`start` (a ``broker.detach`` thread); :meth:`stop` is called
    first on shutdown.
    """

    def __init__(self, url: str, *, batch: int = 200, poll_s: float = 1.0, outage: Outage | None = None) -> None:
        self.url = url
        self.batch = batch
        self.poll_s = poll_s
        # Inside a worker the relay shares the broker's outage: one line per outage.
        self.outage = outage or Outage("relay")
        self.relayed = 0
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: Any = None

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            conn = psycopg.connect(self.url, autocommit=True, application_name="standmeet-relay")
            conn.execute("LISTEN " + sql.OUTBOX_CHANNEL)
            self._conn = conn
        return self._conn

    def drain_once(self) -> int:
        """Relay passes until the outbox is empty (or a pass is partial); rows relayed."""
        conn = self._connection()
        total = 0
        while True:
            result = relay_once(conn, limit=self.batch)
            total += result.claimed
            if result.claimed < self.batch:
                return total

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff(start_s=0.1, cap_s=5.0)
        while not stop.is_set():
            try:
                self.relayed += self.drain_once()
                self.outage.ok()
                backoff.reset()
                conn = self._connection()
                # Wait for a NOTIFY (or the poll interval); notifies are drained after.
                for _ in conn.notifies(timeout=self.poll_s, stop_after=1):
                    pass
            except psycopg.OperationalError as exc:
                self.outage.failed("relay", exc)
                self.close()
                stop.wait(backoff.next_s())

    def start(self) -> Relay:

        self._thread = detach.go("relay", self.run)
        return self

    def stop(self, timeout_s: float = 5.0) -> bool:
        stopped = True
        if self._thread is not None:
            self._thread.stop_event.set()
            if self._conn is not None and not self._conn.closed:
                try:  # wake it from its wait on the connection
                    with psycopg.connect(self.url, autocommit=True) as waker:
                        waker.execute("SELECT pg_notify(%s, 'stop')", (sql.OUTBOX_CHANNEL,))
                except psycopg.Error:
                    pass
            stopped = self._thread.join(timeout_s)
        self.close()
        return stopped

    def close(self) -> None:

        close_quietly(self._conn)
        self._conn = None
