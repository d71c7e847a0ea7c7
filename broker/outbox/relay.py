"""The relay: turns the outbox's events into messages.

It runs in every worker process and in the scheduler (no leader): each pass
(:func:`relay_once`) takes at most ``STANDMEET_RELAY_BATCH`` pending rows with ``FOR
UPDATE SKIP LOCKED`` (rows, not a cursor: concurrent relays skip each other's rows),
marking them relayed in the statement that takes them, and writes the messages their
routes call for, in event order, all in one short pipelined transaction, through the
one writer of message rows (:mod:`broker.engine.enqueue`, whose docstring says which
enqueue hooks run). :class:`Relay` is the loop of one process.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import psycopg
from dramatiq.message import Message
from psycopg.types.json import Jsonb

from broker import detach
from broker.backoff import Backoff
from broker.engine import enqueue as writer
from broker.engine import sql
from broker.engine.codec import check_encoded_size, checked_json, compact_json
from broker.engine.unique import UniqueBy, UniqueItem, unique_key_for, unique_of
from broker.errors import UnknownTopic
from broker.observability import tracing
from broker.outbox.routes import ROUTES, Route, route_actors, routed_topics, routes_for
from broker.pg import pool as pgpool
from broker.pg.pool import DISCONNECTS, Outage, close_quietly
from broker.services import current_broker
from broker.settings import Settings

#: The outbox's log (the relay's lines have always been under this name).
logger = logging.getLogger("standmeet.broker.outbox")

#: Namespace of the message ids derived from (outbox id, route): a relayed event's
#: messages have stable ids, so they can be traced back to it.
MESSAGE_NAMESPACE = uuid.UUID("6f1d3a52-7d2e-4f0e-9c41-5b8e0d3c9a10")


@dataclass(frozen=True)
class RelayResult:
    """What one relay pass did."""

    claimed: int
    messages: int
    failed: int = 0
    #: claimed, then given back untouched: this process could not route them after all
    given_back: int = 0


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
    #: the actor's uniqueness (None: its messages carry no unique key)
    unique: UniqueBy | None = None


def _target(broker: Any, actor_name: str) -> _Target:
    actor = broker.get_actor(actor_name)
    head = f'{{"queue_name":{compact_json(actor.queue_name)},"actor_name":{compact_json(actor.actor_name)},"args":'
    return _Target(actor, str(int(actor.priority)), head, unique_of(actor))


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
    #: STANDMEET_MESSAGE_MAX_BYTES: an event making a larger message is failed, with the reason
    max_bytes: int
    targets: dict[str, _Target] = field(default_factory=dict)
    #: topic -> its routes with their targets
    routes: dict[str, list[tuple[Route, _Target]]] = field(default_factory=dict)
    hooked: list[Message[Any]] = field(default_factory=list)
    #: sends skipped because their unique key was live, per (queue, actor): counted after the pass
    skipped: dict[tuple[str, str], int] = field(default_factory=dict)
    #: (topic, routes no live process knows) -> events relayed without them: said once a pass
    without: dict[tuple[str, tuple[str, ...]], int] = field(default_factory=dict)
    messages: int = 0
    failed: int = 0
    given_back: int = 0


def _begin_pass() -> _Pass:
    broker = current_broker()
    foreign, hooked_unless_carried = writer.relay_hooks(broker)
    return _Pass(broker, foreign, hooked_unless_carried, int(time.time() * 1000), broker.settings.message_max_bytes)


#: One relay pass takes up to ``limit`` pending rows of the topics this relay routes
#: (``topics``), oldest first, and marks them relayed by it (``relay_id``) in the same
#: statement (rows, not a cursor: concurrent relays skip each other's rows), each with
#: the number of messages its topic's routes make (``counts``: topic -> n). The pass's
#: transaction then writes their messages; an event at fault is put back as failed
#: (RELAY_FAIL_EVENT) before it commits, so nothing is marked that was not written. Rows
#: come back in no particular order: the relay sorts them by id. Other topics' events
#: are not touched: they wait for a process that routes them. The scan starts at the
#: oldest pending event of these topics (one probe per topic on the (topic, id) index):
#: a backlog of events no process here routes, older than ours, is not read at every pass.
#: An event whose emitter routed it to actors this relay does not know (``routes``: a
#: newer release's) is left to a relay that knows them all; only once it is older than
#: ``orphaned_after_s`` and no relay that knows them all has been alive for as long
#: (running, or stopped or silent within that time: a newer release's relay restarting
#: in a rolling deploy still counts; a running one counts as long as rescue would, should
#: the setting be shorter than its heartbeat) is it taken, to the routes known (a release
#: that removed a route). The rows are picked once, in a CTE of their own: joined as a
#: subquery, a plan may read it again for each row marked, and each time find the rows
#: it just marked locked by itself, skip them and take the next ones (with statistics
#: from a nearly empty outbox, one pass took the whole backlog whatever its limit).
RELAY_CLAIM_ROUTED = """
WITH pending AS MATERIALIZED (
    SELECT id FROM standmeet.outbox e
    WHERE relayed_at IS NULL AND error IS NULL AND topic = ANY(%(topics)s::text[])
      AND (routes IS NULL OR %(routes)s::jsonb -> topic @> routes
           OR (created_at < now() - make_interval(secs => %(orphaned_after_s)s)
               AND NOT EXISTS (SELECT FROM standmeet.relays r
                               WHERE coalesce(r.stopped_at, r.heartbeat_at) > now() - make_interval(
                                         secs => greatest(%(orphaned_after_s)s::float8, CASE WHEN r.stopped_at IS NULL
                                                          THEN greatest(%(rescue_after_s)s::float8,
                                                                        coalesce(r.rescue_after_s, 0))
                                                          ELSE 0 END))
                                 AND r.routes -> e.topic @> e.routes)))
      AND id >= (SELECT min(oldest.id) FROM unnest(%(topics)s::text[]) AS t(topic)
                 CROSS JOIN LATERAL (SELECT p.id FROM standmeet.outbox p
                                     WHERE p.topic = t.topic AND p.relayed_at IS NULL AND p.error IS NULL
                                     ORDER BY p.id LIMIT 1) AS oldest)
    ORDER BY id
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE standmeet.outbox AS o
SET relayed_at = now(), relay_txid = txid_current(), relayed_by = %(relay_id)s::uuid,
    messages = (%(counts)s::jsonb ->> o.topic)::int
FROM pending
WHERE o.id = pending.id
RETURNING o.id, o.topic, o.payload, o.routes
"""

#: An event that cannot become its messages, for a reason of its own: kept, with the
#: reason, and claimed by no relay until an operator retries it (``outbox retry``).
RELAY_FAIL_EVENT = """
UPDATE standmeet.outbox
SET error = %(error)s, relayed_at = NULL, relay_txid = NULL, relayed_by = NULL, messages = NULL
WHERE id = %(id)s
"""

#: An event Postgres refused in a pass of its own (rolled back: it is pending again), set
#: aside with the reason, unless another relay took it meanwhile (it is then relayed, or
#: claimed by that relay: no longer this one's to judge).
RELAY_SET_ASIDE = """
UPDATE standmeet.outbox SET error = %(error)s
WHERE id = %(id)s AND relayed_at IS NULL AND error IS NULL
"""

#: An event claimed by a pass that could not route it after all: pending again, no
#: error recorded, for a process that routes it.
RELAY_GIVE_BACK = """
UPDATE standmeet.outbox SET relayed_at = NULL, relay_txid = NULL, relayed_by = NULL, messages = NULL
WHERE id = %(id)s
"""


def _target_of(state: _Pass, actor_name: str) -> _Target:
    target = state.targets.get(actor_name)
    if target is None:
        target = state.targets[actor_name] = _target(state.broker, actor_name)
    return target


def _relay_rows(conn: psycopg.Connection[Any], state: _Pass, rows: list[Any]) -> None:
    """Send the messages of claimed ``rows`` (in event order) and the failures of those
    that cannot be relayed; on a pipelined connection, nothing waits for them here."""
    rows.sort(key=lambda row: row[0])
    broker = state.broker
    # in event order: a message's (JSON text, priority), a Message for the hooks, or a
    # message of a unique actor with its key
    pending: list[tuple[str, str] | Message[Any] | UniqueItem] = []
    for event_id, topic, payload, emitted_with in rows:
        pairs = state.routes.get(topic)
        if pairs is None:
            try:
                pairs = state.routes[topic] = [(r, _target_of(state, r.actor)) for r in routes_for(topic)]
            except (UnknownTopic, dramatiq.errors.ActorNotFound) as exc:  # not the event's fault
                logger.warning("outbox event %s (%s) given back for another process: %s", event_id, topic, exc)
                conn.execute(RELAY_GIVE_BACK, {"id": event_id})
                state.given_back += 1
                continue
        try:
            if emitted_with is not None and not (isinstance(emitted_with, list)
                                                 and all(isinstance(a, str) for a in emitted_with)):
                raise ValueError(f"its routes are not a list of actor names: {str(emitted_with)[:200]}")
            unknown = tuple(sorted(set(emitted_with or ()) - {r.actor for r, _ in pairs}))
            if unknown:  # no live process routes them, for longer than STANDMEET_OUTBOX_UNROUTED_MAX_AGE_S
                state.without[(topic, unknown)] = state.without.get((topic, unknown), 0) + 1
            built: list[tuple[str, str] | Message[Any] | UniqueItem] = []
            # the trace emit carried (a mapping); anything else under the key is the payload's own
            carrier = payload.get(tracing.OUTBOX_KEY) if isinstance(payload, dict) else None
            if isinstance(carrier, dict):
                del payload[tracing.OUTBOX_KEY]
            else:
                carrier = None
            options = {tracing.OPTION: carrier} if carrier else {}
            for index, (r, target) in enumerate(pairs):
                args, kwargs = r.args(event_id, payload)
                message_id = message_id_of(event_id, index)
                if state.foreign or (state.hooked_unless_carried and not carrier):
                    # as actor.message_with_options builds it, with the event's own id
                    built.append(Message(queue_name=target.actor.queue_name, actor_name=target.actor.actor_name,
                                         args=tuple(args), kwargs=kwargs or {}, options=dict(options),
                                         message_id=message_id, message_timestamp=state.now_ms))
                else:
                    text = (f'{target.head}{compact_json(args)},"kwargs":{compact_json(kwargs) if kwargs else "{}"},'
                            f'"options":{compact_json(options) if options else "{}"},'
                            f'"message_id":"{message_id}","message_timestamp":{state.now_ms}}}')
                    key = unique_key_for(r.actor, target.unique, args, kwargs, options) if target.unique else None
                    built.append((text, target.priority) if key is None else UniqueItem(
                        message_id, target.actor.queue_name, r.actor, text, target.priority, key))
            for item, (r, _) in zip(built, pairs, strict=True):  # compact JSON: ASCII, a byte a character
                if isinstance(item, Message):
                    checked_json(item, max_bytes=state.max_bytes)
                else:
                    check_encoded_size(len(item.text if isinstance(item, UniqueItem) else item[0]), r.actor,
                                       state.max_bytes)
        except Exception as exc:  # the event's own fault: keep it, say why, go on with the rest
            logger.error("outbox event %s (%s) cannot be relayed: %s", event_id, topic, exc)
            conn.execute(RELAY_FAIL_EVENT, {"id": event_id, "error": f"{type(exc).__name__}: {exc}"})
            state.failed += 1
            continue
        pending.extend(built)
    for queue in {target.actor.queue_name for target in state.targets.values()}:
        if queue not in broker.queues:
            raise dramatiq.errors.QueueNotFound(queue)
    if pending:
        for where, n in writer.relay_write(conn, broker, pending).items():
            state.skipped[where] = state.skipped.get(where, 0) + n
    state.hooked.extend(m for m in pending if isinstance(m, Message))
    state.messages += len(pending)


def known_routes(topics: Sequence[str]) -> str:
    """What this process routes each of ``topics`` to, as the relays' and the claim's
    JSON object (``{"topic": ["actor", …]}``): it takes an event only if these are all
    the routes its emitter knew (a process of an older release leaves a newer event alone)."""
    return "{" + ",".join(f"{json.dumps(t)}:{route_actors(ROUTES.get(t, []))}" for t in topics) + "}"


def relay_once(conn: psycopg.Connection[Any], *, limit: int = 200, chunk_rows: int = RELAY_CHUNK_ROWS,
               topics: Sequence[str] | None = None, relay_id: str | None = None,
               claimed_ids: list[int] | None = None) -> RelayResult:
    """Relay at most ``limit`` pending events of ``topics`` (default: :func:`routed_topics`)
    in one transaction on ``conn``, oldest first: each statement takes and marks up to
    ``chunk_rows`` of them, another writes their messages (in event order). The
    statements are pipelined: the next chunk is claimed while this one's messages are
    built. Events of other topics are left pending, untouched. ``relay_id`` is recorded
    on each event as the relay that took it; ``claimed_ids`` (when given) receives the
    ids taken, even if the pass then fails.

    A message goes through the broker's enqueue hooks as the writer's policy says
    (:func:`broker.engine.enqueue.relay_hooks`): when no hook would change it (the event
    brought its trace along, or there is nothing to carry), its JSON text is written
    straight from the route, as Dramatiq would encode it, without a ``Message`` in between.
    The ``after_enqueue`` hooks run once the pass has committed.
    """

    wanted = list(routed_topics() if topics is None else topics)
    if not wanted:
        return RelayResult(0, 0)
    counts = Jsonb({topic: len(routes) for topic, routes in ROUTES.items()})
    settings = current_broker().settings
    params: dict[str, Any] = {"counts": counts, "topics": wanted, "relay_id": relay_id,
                              "routes": known_routes(wanted), "rescue_after_s": settings.rescue_after_s,
                              "orphaned_after_s": settings.outbox_unrouted_max_age_s}
    state: _Pass | None = None
    claimed = 0
    with conn.pipeline(), conn.transaction():
        asked = min(limit, chunk_rows)
        cur = conn.cursor()
        cur.execute(RELAY_CLAIM_ROUTED, {**params, "limit": asked})
        while True:
            rows = cur.fetchall()
            claimed += len(rows)
            if claimed_ids is not None:
                claimed_ids.extend(row[0] for row in rows)
            following = None
            if len(rows) == asked and claimed < limit:
                asked = min(limit - claimed, chunk_rows)
                following = conn.cursor()
                following.execute(RELAY_CLAIM_ROUTED, {**params, "limit": asked})
            if rows:
                if state is None:
                    state = _begin_pass()
                _relay_rows(conn, state, rows)
            if following is None:
                break
            cur = following
    if state is None:
        return RelayResult(0, 0)
    writer.relay_written(state.broker, state.hooked, state.skipped)
    for (topic, unknown), events in state.without.items():
        logger.warning("%d outbox event(s) of %s relayed without their routes to %s: no live process routes them",
                       events, topic, ", ".join(unknown))
    return RelayResult(claimed, state.messages, state.failed, state.given_back)


#: Register a relay with the topics it routes, or prove it alive (the database's clock),
#: with its rescue window (:mod:`broker.pg.liveness`).
RELAY_HEARTBEAT = """
INSERT INTO standmeet.relays AS r (id, hostname, pid, topics, routes, rescue_after_s)
VALUES (%(id)s::uuid, %(hostname)s, %(pid)s, %(topics)s::text[], %(routes)s::jsonb, %(rescue_after_s)s::float8)
ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), stopped_at = NULL, topics = EXCLUDED.topics,
    routes = EXCLUDED.routes, rescue_after_s = EXCLUDED.rescue_after_s
"""
#: A relay that stopped routes nothing any more.
RELAY_STOPPED = "UPDATE standmeet.relays SET stopped_at = now() WHERE id = %(id)s::uuid"
#: Forget the relays stopped or silent for a day, or for ``%(orphaned_after_s)s`` if longer
#: (the relays whose routes an old event may still wait for).
PRUNE_RELAYS = """
DELETE FROM standmeet.relays
WHERE coalesce(stopped_at, heartbeat_at)
      < now() - greatest(interval '1 day', make_interval(secs => %(orphaned_after_s)s::float8))
"""
LISTEN_OUTBOX = "LISTEN " + sql.OUTBOX_CHANNEL

#: How a relay's heartbeat is paced when neither it nor a configured broker says.
DEFAULT_HEARTBEAT_S = 5.0
#: A waiting relay looks at its stop event at least this often.
STOP_CHECK_S = 0.1


class Relay:
    """The relay loop of one process: woken by NOTIFY where it can LISTEN, polling where
    it cannot (``pgpool.listen_url``), registered with its topics in ``standmeet.relays``.

    Owns one dedicated connection (the ``relay 1`` of the connection budget), and one to
    ``STANDMEET_LISTEN_DATABASE_URL`` when the main URL goes through a transaction pooler.
    Start it with :meth:`start` (a ``broker.detach`` thread); :meth:`stop` is called first
    on shutdown and records it stopped. The loop never ends on an error: whatever a pass
    raises is logged once per failure streak (and once more when it relays again) and
    retried with back-off; a pass Postgres refuses for an event's data fails that event
    alone, with the reason.
    """

    def __init__(self, url: str, *, batch: int = 200, poll_s: float = 1.0, outage: Outage | None = None,
                 heartbeat_s: float | None = None, topics: Sequence[str] | None = None) -> None:
        self.url = url
        self.batch = batch
        self.poll_s = poll_s
        # Inside a worker the relay shares the broker's outage: one line per outage.
        self.outage = outage or Outage("relay")
        self.heartbeat_s = heartbeat_s
        self._topics = None if topics is None else list(topics)
        self.id = str(uuid.uuid4())
        self._conn: psycopg.Connection[Any] | None = None
        self._listen: psycopg.Connection[Any] | None = None
        self._thread: Any = None
        self._next_heartbeat = 0.0
        #: the pace of the heartbeat while it runs (None: not running; a lone drain beats none)
        self._heartbeat_s: float | None = None
        self._failing_since: float | None = None
        self._failures = 0
        self._said_failing = False

    @property
    def topics(self) -> list[str]:
        """The topics this relay takes: the ones given, or what this process routes now."""
        return list(self._topics) if self._topics is not None else routed_topics()

    @property
    def listening(self) -> bool:
        """Whether a NOTIFY wakes it (False: it polls every ``pgpool.poll_s``)."""
        return self._listen is not None and not self._listen.closed

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self.close()
            self._conn = pgpool.connect(self.url, application_name="standmeet-relay")
            where = pgpool.listen_url(self.url)
            if where == self.url:
                self._listen = self._conn
            elif where is not None:
                self._listen = pgpool.connect(where, application_name="standmeet-relay-listen")
            if self._listen is not None:
                self._listen.execute(LISTEN_OUTBOX)
        return self._conn

    def drain_once(self, stop: threading.Event | None = None) -> int:
        """Relay passes until nothing it routes is pending (or a pass is partial, or ``stop``
        is set: a relay stops between two passes, a backlog or not); rows taken.
        Between passes, it proves itself alive when its heartbeat is due: a relay draining a
        long backlog is not taken for gone (other releases' relays then wait for it before
        relaying its routes' events without them)."""
        conn = self._connection()
        topics = self.topics
        total = 0
        while True:
            result = relay_once(conn, limit=self.batch, topics=topics, relay_id=self.id)
            total += result.claimed
            if result.claimed < self.batch or (stop is not None and stop.is_set()):
                return total
            self._heartbeat_if_due()

    def _heartbeat_if_due(self) -> None:
        if self._heartbeat_s is not None and time.monotonic() >= self._next_heartbeat:
            self.heartbeat()
            self._next_heartbeat = time.monotonic() + self._heartbeat_s

    def heartbeat(self) -> None:
        """Record this relay alive, with the topics it routes (by the database's clock)."""
        topics = self.topics
        self._connection().execute(RELAY_HEARTBEAT, {"id": self.id, "hostname": socket.gethostname(),
                                                     "pid": os.getpid(), "topics": topics,
                                                     "routes": known_routes(topics),
                                                     "rescue_after_s": self.rescue_after_s()})

    def rescue_after_s(self) -> float:
        """How long this relay may be silent before others take it for gone: its process's
        rescue window, and at least twice its heartbeat's pace (a relay given a slow
        heartbeat is not judged gone between two beats)."""
        pace = self._heartbeat_s if self._heartbeat_s is not None else _process_heartbeat_s()
        return max(_process_rescue_after_s(), 2 * pace)

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff(start_s=0.1, cap_s=5.0)
        self._heartbeat_s = self.heartbeat_s if self.heartbeat_s is not None else _process_heartbeat_s()
        self._next_heartbeat = 0.0
        try:
            while not stop.is_set():
                try:
                    self._cycle(stop)
                except Exception as exc:  # every failure: the loop lives on
                    if self._set_aside_refused_event(exc):
                        continue
                    self._failed(exc)
                    self.close()
                    self._next_heartbeat = 0.0  # registered again as soon as it is back
                    stop.wait(backoff.next_s())
                else:
                    backoff.reset()
        finally:
            self._mark_stopped()

    def _cycle(self, stop: threading.Event) -> None:
        """Heartbeat when due, relay what is pending, then wait for a NOTIFY or the next poll."""
        self._heartbeat_if_due()
        self.drain_once(stop)
        self._recovered()
        poll_s = self.poll_s if self.listening else pgpool.poll_s(self.url)
        self._wait(stop, min(poll_s, self._next_heartbeat - time.monotonic()))

    def _wait(self, stop: threading.Event, timeout_s: float) -> None:
        """Until a NOTIFY, ``stop``, or ``timeout_s``. With a :class:`broker.detach.StopEvent`
        it sleeps on the listening socket and the event's descriptor together; with a plain
        event, it looks at the event every ``STOP_CHECK_S``."""
        deadline = time.monotonic() + timeout_s
        stop_fd = stop.fileno() if isinstance(stop, detach.StopEvent) else None
        while not stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            listen = self._listen
            if listen is None:
                stop.wait(remaining)
                return
            woken = False
            if stop_fd is not None:
                for _ in listen.notifies(timeout=0):  # what arrived already (read into the buffer)
                    woken = True
                if woken:
                    return
                if not pgpool.readable([listen.fileno(), stop_fd], remaining):
                    return  # the poll's time
                for _ in listen.notifies(timeout=0):
                    woken = True
            else:
                for _ in listen.notifies(timeout=min(remaining, STOP_CHECK_S), stop_after=1):
                    woken = True
            if woken:
                return

    def _set_aside_refused_event(self, exc: BaseException) -> bool:
        """After a pass Postgres refused for the data it was given (a message it cannot
        store): relay one event at a time, and fail the one refused alone, with the reason.
        True when one was set aside; the rest then go on."""
        if not isinstance(exc, psycopg.errors.DataError):
            return False
        try:
            conn = self._connection()
            topics = self.topics
            for _ in range(self.batch):
                taken: list[int] = []
                try:
                    result = relay_once(conn, limit=1, chunk_rows=1, topics=topics, relay_id=self.id,
                                        claimed_ids=taken)
                except psycopg.errors.DataError as refused:
                    if len(taken) != 1:
                        return False
                    reason = f"{type(refused).__name__}: {_first_line(refused)}"
                    logger.error("outbox event %s cannot be relayed: %s", taken[0], reason)
                    if conn.execute(RELAY_SET_ASIDE, {"id": taken[0], "error": reason}).rowcount == 0:
                        logger.info("outbox event %s was relayed by another relay meanwhile: not set aside", taken[0])
                    return True
                if result.claimed == 0:
                    return False
        except Exception:  # the original failure is reported instead
            logger.debug("relay: looking for the refused event failed", exc_info=True)
        return False

    def _failed(self, exc: BaseException) -> None:
        """One line when the relay starts failing (the database's outage has its own)."""
        if self._failing_since is None:
            self._failing_since = time.monotonic()
        self._failures += 1
        if isinstance(exc, DISCONNECTS):
            self.outage.failed("relay", exc)
        elif not self._said_failing:
            self._said_failing = True
            logger.error("relay: a pass failed (%s: %s); retrying with back-off", type(exc).__name__,
                         _first_line(exc))
            logger.debug("relay: the failure in full", exc_info=exc)

    def _recovered(self) -> None:
        self.outage.ok()
        if self._failing_since is None:
            return
        if self._said_failing:
            logger.warning("relay: relaying again after %.1f s (%d failed attempt(s))",
                           time.monotonic() - self._failing_since, self._failures)
        self._failing_since, self._failures, self._said_failing = None, 0, False

    def _mark_stopped(self) -> None:
        conn = self._conn
        if conn is None or conn.closed or conn.broken:
            return
        try:
            conn.execute(RELAY_STOPPED, {"id": self.id})
        except psycopg.Error:  # it is judged dead after its silence instead
            pass

    def start(self) -> Relay:
        self._thread = detach.go("relay", self.run)
        return self

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop the loop (it notices at once), recorded as stopped."""
        stopped = True
        if self._thread is not None:
            stopped = self._thread.stop(timeout_s)
        self.close()
        return stopped

    def close(self) -> None:
        listen, conn = self._listen, self._conn
        self._listen = self._conn = None
        if listen is not None and listen is not conn:
            close_quietly(listen)
        close_quietly(conn)


def _process_rescue_after_s() -> float:
    """This process's rescue window: its broker's (the default without one)."""
    try:
        return float(current_broker().settings.rescue_after_s)
    except Exception:  # no broker configured: the setting's default
        return float(Settings.model_fields["rescue_after_s"].default)


def _process_heartbeat_s() -> float:
    """How often this process's relay proves it is alive: its broker's heartbeat."""
    try:
        return float(current_broker().settings.heartbeat_s)
    except Exception:  # no broker configured: the documented default
        return DEFAULT_HEARTBEAT_S


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
