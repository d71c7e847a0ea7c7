"""Completion receipts and the waiters of a web request.

When a job on an awaited queue (index, notify) finishes for good — done, or rejected
with no retry left; not when it is retried or snoozed — its settle sends, in the same
statement and so at once, ``NOTIFY standmeet_receipts_<queue>, '<message id>:<state>,…'``
(one notification for the receipts of a settled batch, at most 150 a notification).

Each process has **one** LISTEN connection per channel (:class:`Listener`, owned by a
``broker.detach`` thread), shared by all its waiters. A request that wrote something
waits for its jobs' receipts with :meth:`Waiters.expect`: it registers the message
ids *before* it commits (so a fast job cannot finish unseen), then waits up to 2 s.
At most 64 waiters per channel: the 65th is told ``False`` at once, without queuing.
No waiter opens a connection or polls. If the listener loses its connection, it
reconnects and then asks the database once for the jobs still awaited, so a receipt
sent while it was away is not missed. It never dies for good: any error is said once and
retried with back-off.

Through a transaction pooler a LISTEN is heard by nobody: the listener then LISTENs on
``STANDMEET_LISTEN_DATABASE_URL``, or, with none, asks the database for the awaited jobs
every ``STANDMEET_UNLISTENED_POLL_S`` while any request waits (one query for all of them).
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg

from broker import detach
from broker.backoff import Backoff
from broker.engine import sql
from broker.errors import InvalidMessage
from broker.observability import metrics
from broker.pg.pool import Outage, close_quietly, connect, listen_url, poll_s

logger = logging.getLogger(f"standmeet.{__name__}")

#: Waiters a channel holds at most; one more is answered False at once.
DEFAULT_MAX_WAITERS = 64
#: How long a request waits for its receipts by default.
DEFAULT_WAIT_S = 2.0

#: Finished messages among some ids (the listener's re-check after a reconnect), found by
#: their ids: the state is compared as text so that no plan reads the finished rows' index
#: (partial on that state: every message finished within the retention) to find them, as
#: the planner would with statistics that counted few finished rows.
FINISHED = """
SELECT message_id::text, "state"::text FROM dramatiq.queue
WHERE message_id = ANY(%(ids)s::uuid[]) AND "state"::text IN ('done', 'rejected')
"""


def channel_for(queue: str) -> str:
    return sql.RECEIPT_CHANNEL.format(queue=queue)


def canonical_id(message_id: object) -> str:
    """``message_id`` as Postgres writes a uuid (its receipts carry that text)."""
    try:
        return str(uuid.UUID(str(message_id)))
    except ValueError:
        raise InvalidMessage(f"a receipt is awaited for message ids: {str(message_id)[:100]!r} is not one") from None


@dataclass
class Waiter:
    """One request waiting for a set of messages to finish."""

    pending: set[str]
    event: threading.Event = field(default_factory=threading.Event)
    failed: bool = False

    def settle(self, message_id: str, state: str) -> None:
        self.pending.discard(message_id)
        if state != "done":
            self.failed = True
        if not self.pending or self.failed:
            self.event.set()

    def wait(self, timeout_s: float) -> bool:
        """True when every awaited message is done within ``timeout_s``."""
        return self.event.wait(timeout_s) and not self.failed and not self.pending


#: The listener notices it is stopped within this long (a process exits as soon as it has
#: its answer, not a second later), as the relay does.
STOP_CHECK_S = 0.1


class Listener:
    """The one LISTEN connection of this process for one channel, and its waiters."""

    def __init__(self, url: str, channel: str, *, max_waiters: int = DEFAULT_MAX_WAITERS) -> None:
        self.url = url
        self.channel = channel
        self.max_waiters = max_waiters
        self.outage = Outage(f"receipts {channel}")
        self._lock = threading.Lock()
        self._by_message: dict[str, list[Waiter]] = {}
        self._waiters: set[int] = set()
        self._conn: psycopg.Connection[Any] | None = None
        self._recheck = threading.Event()  # a waiter for messages that may have finished already
        self._connected = threading.Event()
        self._thread: detach.Detached | None = None

    # -- waiters --------------------------------------------------------------------

    def add(self, message_ids: Iterable[str], *, committed: bool = False) -> Waiter | None:
        """Register a waiter, or None when the channel already holds its maximum.
        ``committed``: its messages were written before it was registered, so some may
        have finished unheard: the listener asks the database once, on its next turn.
        An id that is not a message id is refused here (:class:`InvalidMessage`), before
        it could reach the listener's look-up and break it for the channel's other waiters;
        ids are compared as Postgres writes them (lower-case)."""
        waiter = Waiter(pending={canonical_id(message_id) for message_id in message_ids})
        with self._lock:
            if len(self._waiters) >= self.max_waiters:
                metrics.RECEIPT_WAITERS_REFUSED.labels(self.channel).inc()
                return None
            self._waiters.add(id(waiter))
            metrics.RECEIPT_WAITERS.labels(self.channel).inc()
            for message_id in waiter.pending:
                self._by_message.setdefault(message_id, []).append(waiter)
        if not waiter.pending:
            waiter.event.set()
        elif committed:
            self._recheck.set()
        return waiter

    def remove(self, waiter: Waiter) -> None:
        with self._lock:
            if id(waiter) in self._waiters:
                self._waiters.discard(id(waiter))
                metrics.RECEIPT_WAITERS.labels(self.channel).dec()
            for message_id in list(waiter.pending):
                waiters = self._by_message.get(message_id, [])
                if waiter in waiters:
                    waiters.remove(waiter)
                if not waiters:
                    self._by_message.pop(message_id, None)

    @property
    def waiting(self) -> int:
        with self._lock:
            return len(self._waiters)

    def dispatch(self, message_id: str, state: str) -> None:
        with self._lock:
            waiters = self._by_message.pop(message_id, [])
        for waiter in waiters:
            waiter.settle(message_id, state)

    # -- the connection ---------------------------------------------------------------

    def listen_once(self, stop: threading.Event, timeout_s: float = STOP_CHECK_S) -> int:
        """Connect if needed, then dispatch the notifications of up to ``timeout_s``."""
        where = listen_url(self.url)
        if self._conn is None or self._conn.closed:
            conn = connect(where or self.url, application_name="standmeet-receipts")
            if where is not None:  # quoted: a queue's name may hold capitals, dots or dashes
                conn.execute('LISTEN "' + self.channel.replace('"', '""') + '"')
            self._conn = conn
            self._connected.set()
            self.recheck()  # receipts sent while we were not listening
        if self._recheck.is_set():
            self._recheck.clear()
            self.recheck()
        if where is None:  # nothing can be heard: ask, while anyone waits
            if not stop.wait(poll_s(self.url)):
                return self.recheck()
            return 0
        dispatched = 0
        for notify in self._conn.notifies(timeout=timeout_s):
            for receipt in notify.payload.split(","):  # one notification per settled batch
                message_id, _, state = receipt.partition(":")
                self.dispatch(message_id, state or "done")
                dispatched += 1
            if stop.is_set():
                break
        return dispatched

    def recheck(self) -> int:
        """Dispatch the awaited messages that have finished; returns how many."""
        with self._lock:
            ids = list(self._by_message)
        if not ids or self._conn is None:
            return 0
        rows = self._conn.execute(FINISHED, {"ids": ids}).fetchall()
        for message_id, state in rows:
            self.dispatch(message_id, state)
        return len(rows)

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff(start_s=0.05, cap_s=2.0)
        while not stop.is_set():
            try:
                self.listen_once(stop, timeout_s=STOP_CHECK_S)
                self.outage.ok()
                backoff.reset()
            except Exception as exc:  # never dies: said once, retried with back-off
                self.outage.failed("listen", exc)
                self._connected.clear()
                self._close()
                stop.wait(backoff.next_s())

    def start(self, *, ready_timeout_s: float = 5.0) -> Listener:
        self._thread = detach.go(f"receipts-{self.channel}", self.run)
        self._connected.wait(ready_timeout_s)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.stop_event.set()
            self._thread.join(2.0)
        self._close()

    def _close(self) -> None:

        close_quietly(self._conn)
        self._conn = None

    @property
    def connection_pid(self) -> int | None:
        """The server pid of the LISTEN connection (for operators and tests)."""
        conn = self._conn
        return conn.info.backend_pid if conn is not None and not conn.closed else None


class Waiters:
    """This process's listeners, one per channel, started on first use."""

    def __init__(self, url: str, *, max_waiters: int = DEFAULT_MAX_WAITERS) -> None:
        self.url = url
        self.max_waiters = max_waiters
        self._listeners: dict[str, Listener] = {}
        self._lock = threading.Lock()

    def listener(self, channel: str) -> Listener:
        with self._lock:
            if channel not in self._listeners:
                self._listeners[channel] = Listener(self.url, channel, max_waiters=self.max_waiters).start()
            return self._listeners[channel]

    @contextmanager
    def expect(self, channel: str, message_ids: Iterable[str], *, committed: bool = False) -> Iterator[Waiter | None]:
        """Register before committing; ``None`` means the channel is full (answer False).
        ``committed``: registered after its messages were committed (see :meth:`Listener.add`)."""
        listener = self.listener(channel)
        waiter = listener.add(message_ids, committed=committed)
        try:
            yield waiter
        finally:
            if waiter is not None:
                listener.remove(waiter)

    def wait(self, channel: str, keys: str | Iterable[str], timeout_s: float = DEFAULT_WAIT_S) -> bool:
        """Wait up to ``timeout_s`` for the messages ``keys`` (committed already) to be
        done; False at once if full. One that finished before the call counts: the
        listener asks the database for them once."""
        ids = [keys] if isinstance(keys, str) else list(keys)
        with self.expect(channel, ids, committed=True) as waiter:
            return waiter is not None and waiter.wait(timeout_s)

    def close(self) -> None:
        with self._lock:
            listeners, self._listeners = list(self._listeners.values()), {}
        for listener in listeners:
            listener.stop()

