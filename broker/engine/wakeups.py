"""One LISTEN connection of a process for its consumers' wake-ups, where the claim
connections cannot LISTEN (through a transaction pooler).

PgBouncer in transaction mode hands each transaction to any server connection, so a
LISTEN on it would be heard by nobody. Given a connection that can listen
(``STANDMEET_LISTEN_DATABASE_URL``: direct, or session-pooled), :class:`WakeListener`
listens there on every served queue's channel and wakes that queue's consumer. Without
one, consumers poll (see :mod:`broker.pg.pool`).

The listener never dies for good: a lost connection is said once (through the process's
:class:`~broker.pg.pool.Outage`), retried with back-off, and on reconnecting it wakes every
consumer once, since notifications sent meanwhile were missed (after its LISTENs, so that
nothing sent between a consumer's look and the LISTEN is missed); a queue added while
it waits is woken once it listens there.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import psycopg

from broker import detach
from broker.backoff import Backoff
from broker.pg.pool import Outage, close_quietly, connect

logger = logging.getLogger("standmeet.broker")

#: How long one wait for notifications lasts before the stop flag is looked at.
LISTEN_WAIT_S = 1.0


class WakeListener:
    """LISTENs on some channels over one connection; calls each channel's wake-up."""

    def __init__(self, url: str, *, outage: Outage) -> None:
        self.url = url
        self.outage = outage
        self._lock = threading.Lock()
        self._wakes: dict[str, Callable[[], None]] = {}
        self._listening: set[str] = set()
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: detach.Detached | None = None

    def add(self, channel: str, wake: Callable[[], None]) -> None:
        """Wake ``wake()`` on every notification of ``channel`` (listened from the next wait,
        and woken once then)."""
        with self._lock:
            self._wakes[channel] = wake

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = detach.go("wake-listener", self.run)

    def listen_once(self, timeout_s: float = LISTEN_WAIT_S) -> int:
        """Connect and LISTEN if needed, then wake the consumers notified within ``timeout_s``;
        returns the notifications heard."""
        with self._lock:
            wakes = dict(self._wakes)
        conn = self._conn
        reconnected = conn is None or conn.closed
        if conn is None or reconnected:
            conn = self._conn = connect(self.url, application_name="standmeet-wakeups")
            self._listening = set()
        new = [channel for channel in wakes if channel not in self._listening]
        for channel in new:
            conn.execute('LISTEN "' + channel.replace('"', '""') + '"')
            self._listening.add(channel)
        # What was sent while nobody listened there: its consumers look again, once the
        # LISTEN is in place (woken before it, a consumer could look, find nothing, and
        # miss a send committed between its look and the LISTEN).
        for channel in wakes if reconnected else new:
            wakes[channel]()
        heard = 0
        for notify in conn.notifies(timeout=timeout_s, stop_after=1):
            heard += 1
            woken = wakes.get(notify.channel)
            if woken is not None:
                woken()
        return heard

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff(start_s=0.05, cap_s=2.0)
        while not stop.is_set():
            try:
                self.listen_once()
                self.outage.ok()
                backoff.reset()
            except Exception as exc:  # never dies: said once, retried with back-off
                self.outage.failed("wake-ups", exc)
                self._close()
                stop.wait(backoff.next_s())
        self._close()

    def stop(self, timeout_s: float = 2.0) -> None:
        thread = self._thread
        if thread is not None:
            thread.stop(timeout_s)
        self._close()

    def _close(self) -> None:
        close_quietly(self._conn)
        self._conn = None
