"""Our Postgres broker: dramatiq-pg, subclassed to fix its measured defects.

What changes against ``dramatiq_pg.PostgresBroker`` / ``PostgresConsumer``:

* **Claiming.** A consumer claims due messages with one ``UPDATE … FROM (SELECT …
  FOR UPDATE SKIP LOCKED LIMIT n)`` statement, recording the claiming process
  (``worker_id``) and a claim counter on the row. No advisory lock outlives the
  statement, so the locks held stay bounded whatever the backlog.
* **Per-queue prefetch.** Each queue's consumer holds at most that queue's
  ``max_workers`` messages (claimed and not yet acked) in this process, whatever
  prefetch Dramatiq's worker asks for, and wakes the moment one of them is acked
  (a self-pipe beside the LISTEN socket): no back-off counter, no fixed wait.
* **Delays live in the database.** ``enqueue(delay=…)`` writes the message with an
  ``eta``; it is claimed only when due, and the consumer sleeps exactly until the
  next due message. No delay queues, nothing held in worker memory.
* **Acks never vanish.** Acks go through a pool that waits rather than raising, and
  are retried through an outage; an ack only applies to the claim it belongs to.
* **Liveness.** Every consuming process registers itself and sends heartbeats; the
  messages of a process that stopped or fell silent are requeued (crash rescue).
* **One line per outage.** Consumers reconnect with back-off by themselves.
"""

from __future__ import annotations

import logging
import os
import random
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Iterable
from typing import Any

import dramatiq
import psycopg2
import psycopg2.extensions
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import ConnectionError as DramatiqConnectionError
from dramatiq.errors import QueueNotFound
from dramatiq.message import Message
from dramatiq_pg import PostgresBroker

from broker import detach, sql
from broker.budget import broker_pool_size
from broker.errors import Deferred
from broker.pgpool import DISCONNECTS, BlockingPool, Outage
from broker.settings import AWAITED_QUEUES, QueueSettings, Settings

logger = logging.getLogger(__name__)

#: Longest back-off between reconnection attempts of a consumer or an ack.
MAX_RECONNECT_BACKOFF_S = 5.0
#: Queues whose final acks send a receipt (R5): the ones a request waits on.
AWAITED = sorted(AWAITED_QUEUES)
#: A message for an unknown actor is given back this much later, and rejected after this many claims.
UNKNOWN_ACTOR_DELAY_S = 10.0
UNKNOWN_ACTOR_MAX_CLAIMS = 30
#: Shortest sleep when due messages exist but were all locked by another claimer.
MIN_WAIT_S = 0.005
#: How often a consumer that no longer claims (shutdown) returns to Dramatiq's loop.
SHUTDOWN_POLL_S = 0.05


class QueueState:
    """What this process holds of one queue: shared by its successive consumers and acks.

    A claim is identified by (message id, claim number): the same message can be
    claimed again (a snooze or retry due at once) before the previous run is settled.
    At most ``limit`` claims are *running* (handed to Dramatiq's worker); up to
    ``prefetch`` more wait in :attr:`buffer`, claimed, and start the moment a running
    one finishes, without a round trip to the database.
    """

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.limit = settings.max_workers
        self.prefetch = settings.prefetch
        self.lock = threading.Lock()
        #: every claim made and not yet settled: (message_id, claim number).
        self.in_flight: set[tuple[str, int]] = set()
        #: the claims handed to Dramatiq's worker and not finished: at most ``limit``.
        self.running: set[tuple[str, int]] = set()
        #: claimed messages not yet handed to Dramatiq's worker, with their claim number.
        self.buffer: deque[tuple[Message, int]] = deque()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def free(self) -> int:
        """How many more messages this process may claim now."""
        with self.lock:
            return self.limit + self.prefetch - len(self.in_flight)

    def hold(self, message: Message, claims: int) -> None:
        with self.lock:
            self.in_flight.add((message.message_id, claims))
            self.buffer.append((message, claims))

    def next_buffered(self) -> MessageProxy | None:
        """The next claimed message to start, if fewer than ``limit`` are running."""
        with self.lock:
            if not self.buffer or len(self.running) >= self.limit:
                return None
            message, claims = self.buffer.popleft()
            self.running.add((message.message_id, claims))
        proxy = MessageProxy(message)
        proxy.standmeet_claim = claims  # type: ignore[attr-defined]  # travels with the message to its ack
        return proxy

    def take_buffer(self) -> list[tuple[Message, int]]:
        with self.lock:
            taken = list(self.buffer)
            self.buffer.clear()
            return taken

    def finished(self, claim: tuple[str, int]) -> None:
        """A running job has ended: its slot is free (its ack may still be on its way)."""
        with self.lock:
            self.running.discard(claim)
        self.wake()

    def release(self, claims: Iterable[tuple[str, int]]) -> None:
        with self.lock:
            for claim in claims:
                self.in_flight.discard(claim)
                self.running.discard(claim)
        self.wake()

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the consumer is going to wake anyway

    def drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    @property
    def wake_fd(self) -> int:
        return self._wake_r

    def close(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass


class StandmeetBroker(PostgresBroker):
    """dramatiq-pg's broker with per-queue limits, database delays and crash rescue."""

    def __init__(self, *, settings: Settings, url: str, middleware: list[Any] | None = None) -> None:
        self.settings = settings
        self.url = url
        self.worker_id = str(uuid.uuid4())
        self.outage = Outage("worker")
        self.claiming = True
        self.closing = False
        self.queue_states: dict[str, QueueState] = {}
        self._registered = False
        self._register_lock = threading.Lock()
        self._heartbeat: detach.Detached | None = None
        self._app_pool: Any = None
        self.relay: Any = None
        self._waiters: Any = None
        pool = BlockingPool(url, broker_pool_size(settings, len(settings.queues)))
        super().__init__(pool=pool, results=False, middleware=middleware)
        for name in settings.queues:
            self.declare_queue(name)

    # -- queues -------------------------------------------------------------------

    def declare_queue(self, queue_name: str) -> None:
        # No delay queues: delays live in the database (the ``eta`` column).
        if queue_name not in self.queues:
            self.emit_before("declare_queue", queue_name)
            self.queues[queue_name] = True
            self.queue_states[queue_name] = QueueState(self._queue_settings(queue_name))
            self.emit_after("declare_queue", queue_name)

    def _queue_settings(self, queue_name: str) -> QueueSettings:
        if queue_name in self.settings.queues:
            return self.settings.queues[queue_name]
        # A queue outside R1 (declared by an application actor): limits like "fetch".
        base = self.settings.queues["fetch"]
        return QueueSettings(queue_name, base.max_workers, base.time_limit_s, base.poll_s)

    def queue_settings(self, queue_name: str) -> QueueSettings:
        return self.queue_states[queue_name].settings

    # -- enqueue ------------------------------------------------------------------

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        """Write ``message`` (due after ``delay`` ms) and wake its queue's consumers."""
        if message.queue_name not in self.queues:
            raise QueueNotFound(message.queue_name)
        message.options.pop("eta", None)  # Dramatiq would hold an ``eta`` message in memory
        self.emit_before("enqueue", message, delay)
        params = enqueue_params([message], delay)
        backoff = 0.05
        while True:
            try:
                self.pool.execute(sql.ENQUEUE, params)
                self.outage.ok()
                break
            except DISCONNECTS as exc:
                # A retry re-enqueues from a worker thread: wait out a short outage.
                self.outage.failed("enqueue", exc)
                if self.closing or backoff > MAX_RECONNECT_BACKOFF_S * 4:
                    raise DramatiqConnectionError(f"could not enqueue {message.message_id}: {exc}") from exc
                time.sleep(backoff)
                backoff *= 2
        self.emit_after("enqueue", message, delay)
        return message

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        # A job that asked to run later (Snooze) is not a failure: Dramatiq's worker
        # reports it as "processed with an exception"; we report it as skipped, so
        # no retry is counted and no failure callback fires, and every middleware
        # releases what it acquired in ``after_skip_message``.
        if signal == "process_message" and isinstance(kwargs.get("exception"), Deferred):
            signal, kwargs = "skip_message", {}
        super().emit_after(signal, *args, **kwargs)

    # -- consuming ----------------------------------------------------------------

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> StandmeetConsumer:
        # ``prefetch`` is ignored on purpose: a queue holds at most its own limit. No I/O
        # here: the consumer registers this process on its first connection, inside its
        # outage handling (a database down at start-up is one log line, then a retry).
        return StandmeetConsumer(self, self.queue_states[queue_name], timeout_ms=timeout)

    def stop_claiming(self) -> None:
        """Claim nothing more (shutdown); consumers wake up to notice."""
        self.claiming = False
        for state in self.queue_states.values():
            state.wake()

    def settle(self, message: Message | MessageProxy, query: str, extra: dict[str, Any]) -> None:
        """Write an ack or nack, retrying through an outage; then free the queue slot."""
        state = self.queue_states[message.queue_name]
        claims = claim_of(message)
        if claims is None:
            logger.debug("settle: %s was not claimed by this process", message.message_id)
            return
        state.finished((message.message_id, claims))  # the next buffered job may start now
        params = {
            "message": message_json(message),
            "message_id": message.message_id,
            "claims": claims,
            "awaited": AWAITED,
            **extra,
        }
        backoff = 0.05
        while True:
            try:
                self.pool.execute(query, params)
                self.outage.ok()
                break
            except DISCONNECTS as exc:
                self.outage.failed("ack", exc)
                if self.closing:
                    # Leave it "consumed": crash rescue runs it again (at least once).
                    raise DramatiqConnectionError(str(exc)) from exc
                time.sleep(backoff * (1 + random.random()))
                backoff = min(backoff * 2, MAX_RECONNECT_BACKOFF_S)
        state.release([(message.message_id, claims)])

    def requeue(self, messages: Iterable[Message | MessageProxy], claims: Iterable[int] | None = None) -> int:
        """Give claimed messages that never started back to their queue."""
        by_queue: dict[str, list[tuple[str, int]]] = {}
        messages = list(messages)
        numbers = list(claims) if claims is not None else [claim_of(m) for m in messages]
        for message, number in zip(messages, numbers, strict=True):
            if number is not None:
                by_queue.setdefault(message.queue_name, []).append((message.message_id, number))
        total = 0
        for queue_name, held in by_queue.items():
            ids = [message_id for message_id, _ in held]
            self.pool.execute(sql.REQUEUE, {"message_ids": ids, "worker_id": self.worker_id})
            self.queue_states[queue_name].release(held)
            total += len(ids)
        if total:
            logger.info("returned %d prefetched message(s) to the queue", total)
        return total

    # -- liveness -----------------------------------------------------------------

    def ensure_registered(self) -> None:
        """Register this process and start its heartbeat (once, before the first claim)."""
        with self._register_lock:
            if self._registered:
                return
            self.pool.execute(
                sql.REGISTER_WORKER,
                {
                    "worker_id": self.worker_id,
                    "hostname": socket.gethostname(),
                    "pid": os.getpid(),
                    "queues": sorted(self.queues),
                },
            )
            self._registered = True
            self._heartbeat = detach.every(
                f"heartbeat-{self.worker_id[:8]}", self.settings.heartbeat_s, self.heartbeat_once
            )

    def heartbeat_once(self) -> dict[str, tuple[int, int]]:
        """Prove this process alive, and rescue the messages of dead ones."""
        self.pool.execute(sql.HEARTBEAT, {"worker_id": self.worker_id})
        return self.rescue_once()

    def rescue_once(self) -> dict[str, tuple[int, int]]:
        """Requeue messages whose process died; returns {queue: (requeued, rejected)}."""
        rows = self.pool.execute(
            sql.RESCUE,
            {"after_s": self.settings.rescue_after_s, "max_crashes": self.settings.max_crashes},
        )
        result = {row[0]: (int(row[1]), int(row[2])) for row in rows}
        for queue_name, (requeued, rejected) in result.items():
            logger.warning(
                "crash rescue: %d message(s) of queue %r requeued, %d rejected after too many crashes",
                requeued, queue_name, rejected,
            )
        return result

    # -- the outbox relay ------------------------------------------------------------

    def start_relay(self) -> None:
        """Run the outbox relay in this process (every worker process runs one)."""
        from broker.outbox import Relay

        with self._register_lock:
            if self.relay is None:
                self.relay = Relay(
                    self.url, batch=self.settings.relay_batch, poll_s=self.settings.relay_poll_s, outage=self.outage
                ).start()

    def stop_relay(self) -> None:
        """Stop the relay first on shutdown: no new messages from this process."""
        relay, self.relay = self.relay, None
        if relay is not None:
            relay.stop()

    # -- receipts -------------------------------------------------------------------

    @property
    def waiters(self) -> Any:
        """This process's receipt listeners and waiters (one LISTEN connection a channel)."""
        if self._waiters is None:
            with self._register_lock:
                if self._waiters is None:
                    from broker.receipts import Waiters

                    self._waiters = Waiters(self.url, max_waiters=self.settings.max_waiters)
        return self._waiters

    # -- application pool (psycopg 3) ---------------------------------------------

    @property
    def app_pool(self) -> Any:
        """The application's psycopg 3 pool, opened on first use."""
        if self._app_pool is None:
            with self._register_lock:
                if self._app_pool is None:
                    from broker.db import open_pool

                    self._app_pool = open_pool(self.url, max_size=self.settings.pool_max_size)
        return self._app_pool

    # -- shutdown -----------------------------------------------------------------

    def close(self) -> None:
        if self.closing:
            return
        self.closing = True
        self.stop_relay()
        self.stop_claiming()
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout_s=2)
        if self._registered:
            try:
                self.pool.execute(sql.STOP_WORKER, {"worker_id": self.worker_id})
            except DISCONNECTS as exc:
                logger.warning("could not record this worker as stopped: %s", exc)
        if self._waiters is not None:
            self._waiters.close()
        if self._app_pool is not None:
            self._app_pool.close(timeout=1.0)  # a job still running past shutdown keeps its own
        self.pool.closeall()
        super().close()


class StandmeetConsumer(Consumer):
    """Claims due messages of one queue, never more than its limit in flight."""

    def __init__(self, broker: StandmeetBroker, state: QueueState, *, timeout_ms: int) -> None:
        self.broker = broker
        self.state = state
        self.timeout_s = max(0.05, timeout_ms / 1000)
        self.conn: psycopg2.extensions.connection | None = None
        self.next_due_s: float | None = 0.0
        self.backoff_s = 0.0
        self.channel = sql.ENQUEUE_CHANNEL.format(queue=state.name)

    def __iter__(self) -> StandmeetConsumer:
        return self

    def __next__(self) -> MessageProxy | None:
        # Shutting down: start nothing more; the buffer goes back to the queue on close.
        proxy = self.state.next_buffered() if self.broker.claiming else None
        if proxy is not None:
            return proxy
        try:
            return self._claim_or_wait()
        except DISCONNECTS as exc:
            self.broker.outage.failed(f"consumer {self.state.name}", exc)
            self._drop_connection()
            self.backoff_s = min(max(0.1, self.backoff_s * 2), MAX_RECONNECT_BACKOFF_S)
            self._wait_on_pipe(self.backoff_s * (0.5 + random.random() / 2))
            return None

    def _claim_or_wait(self) -> MessageProxy | None:
        conn = self._connection()
        if self.broker.claiming and self.state.free() > 0 and self._due():
            if self.claim_once(conn):
                return self.state.next_buffered()
        self._wait(conn)
        return None

    def _due(self) -> bool:
        return self.next_due_s is not None and self.next_due_s <= time.monotonic()

    def claim_once(self, conn: psycopg2.extensions.connection) -> int:
        """Claim up to the free slots of this queue; return how many were claimed."""
        want = self.state.free()
        if want <= 0:
            return 0
        with conn.cursor() as cur:
            cur.execute(sql.CLAIM, {"queue": self.state.name, "n": want, "worker_id": self.broker.worker_id})
            rows = sorted(cur.fetchall(), key=lambda row: row[2])
            for text, claims, _eta, row_id in rows:
                try:
                    message = Message.decode(text.encode("utf-8"))
                except Exception as exc:  # a malformed row: reject it, keep going
                    self._reject_malformed(cur, row_id, exc)
                    continue
                if message.actor_name not in self.broker.actors:
                    self._bounce_unknown_actor(cur, message)
                    continue
                self.state.hold(message, claims)
            if len(rows) < want:
                cur.execute(sql.NEXT_DUE, {"queue": self.state.name})
                (seconds,) = cur.fetchone() or (None,)
                now = time.monotonic()
                if seconds is None:
                    self.next_due_s = now + self.state.settings.poll_s
                else:
                    wait = max(MIN_WAIT_S, float(seconds))
                    self.next_due_s = now + min(wait, self.state.settings.poll_s)
            else:
                self.next_due_s = 0.0  # there may be more: claim again when a slot frees
        self.broker.outage.ok()
        self.backoff_s = 0.0
        return len(rows)

    def _reject_malformed(self, cur: Any, message_id: str, exc: Exception) -> None:
        logger.error("queue %r: rejecting a malformed message %s: %s", self.state.name, message_id, exc)
        cur.execute(sql.REJECT_MALFORMED, {"message_id": message_id, "error": f"malformed message: {exc!r}"})

    def _bounce_unknown_actor(self, cur: Any, message: Message) -> None:
        error = (f"no actor {message.actor_name!r} in worker {self.broker.worker_id} "
                 f"(host {socket.gethostname()}, pid {os.getpid()})")
        logger.warning("queue %r: message %s is for an unknown actor %r; giving it back for %.0f s",
                       self.state.name, message.message_id, message.actor_name, UNKNOWN_ACTOR_DELAY_S)
        cur.execute(sql.UNKNOWN_ACTOR, {"message_id": message.message_id, "error": error,
                                        "delay_s": UNKNOWN_ACTOR_DELAY_S, "max_claims": UNKNOWN_ACTOR_MAX_CLAIMS})

    def _wait(self, conn: psycopg2.extensions.connection) -> None:
        now = time.monotonic()
        timeout = self.timeout_s
        if not self.broker.claiming:
            timeout = SHUTDOWN_POLL_S  # let the consumer thread see that it must stop
        elif self.state.free() > 0 and self.next_due_s is not None:
            # a due time matters only with room to claim; when full, a finishing job wakes us
            timeout = min(timeout, max(0.0, self.next_due_s - now))
        if conn.notifies:
            self._heard(conn)
            return
        readable, _, _ = select.select([conn, self.state.wake_fd], [], [], timeout)
        if self.state.wake_fd in readable:
            self.state.drain_wake()
            self.next_due_s = min(self.next_due_s or 0.0, time.monotonic())
        if conn in readable:
            conn.poll()
        if conn.notifies:
            self._heard(conn)

    def _heard(self, conn: psycopg2.extensions.connection) -> None:
        conn.notifies.clear()
        self.next_due_s = 0.0

    def _wait_on_pipe(self, timeout: float) -> None:
        readable, _, _ = select.select([self.state.wake_fd], [], [], timeout)
        if readable:
            self.state.drain_wake()

    def _connection(self) -> psycopg2.extensions.connection:
        if self.conn is not None and not self.conn.closed:
            return self.conn
        self.broker.ensure_registered()  # before the first claim: rescue must know us
        conn = self.broker.pool.getconn()
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute('LISTEN "' + self.channel.replace('"', '""') + '"')
        except BaseException:
            self.broker.pool.putconn(conn, close=True)
            raise
        self.conn = conn
        self.next_due_s = 0.0  # we may have missed notifications: look now
        return conn

    def _drop_connection(self) -> None:
        if self.conn is not None:
            try:
                self.broker.pool.putconn(self.conn, close=True)
            except Exception:  # the pool refuses a connection it does not know
                pass
            self.conn = None

    # -- settling (called from worker threads) ------------------------------------

    def ack(self, message: MessageProxy) -> None:
        self.broker.settle(message, sql.ACK, {})

    def nack(self, message: MessageProxy) -> None:
        error = message.options.get("traceback") or message.options.get("error") or "failed"
        self.broker.settle(message, sql.NACK, {"error": str(error)[-4000:]})

    def requeue(self, messages: Iterable[Message]) -> None:
        try:
            self.broker.requeue(messages)
        except DISCONNECTS as exc:
            raise DramatiqConnectionError(str(exc)) from exc

    def close(self) -> None:
        buffered = self.state.take_buffer()
        if buffered:
            try:
                self.broker.requeue([m for m, _ in buffered], [c for _, c in buffered])
            except DISCONNECTS as exc:
                # Still ours: hand them out again when the next consumer starts.
                with self.state.lock:
                    self.state.buffer.extendleft(reversed(buffered))
                logger.warning("could not return prefetched messages yet: %s", exc)
        if self.conn is not None:
            try:
                with self.conn.cursor() as cur:
                    cur.execute("UNLISTEN *")
                self.broker.pool.putconn(self.conn)
            except DISCONNECTS:
                self._drop_connection()
            self.conn = None


def claim_of(message: Message | MessageProxy) -> int | None:
    """The claim number our consumer attached to this message, if it claimed it."""
    return getattr(message, "standmeet_claim", None) if isinstance(message, MessageProxy) else None


def message_json(message: Message | MessageProxy) -> str:
    """The message as JSON text, as Dramatiq encodes it."""
    return message.encode().decode("utf-8")


def enqueue_params(messages: Iterable[Message | MessageProxy], delay: int | None = None) -> dict[str, Any]:
    """Parameters of :data:`broker.sql.ENQUEUE` for ``messages``, due after ``delay`` ms."""
    batch = list(messages)
    return {
        "queues": [m.queue_name for m in batch],
        "message_ids": [m.message_id for m in batch],
        "messages": [message_json(m) for m in batch],
        "delays": [(delay or 0) / 1000.0] * len(batch),
    }


def current_broker() -> StandmeetBroker:
    """The configured broker; a clear error if ``broker.configure()`` was not called."""
    from broker.errors import ConfigError

    current = dramatiq.broker.global_broker
    if not isinstance(current, StandmeetBroker):
        raise ConfigError("the broker is not configured: import actors, or call broker.configure()")
    return current
