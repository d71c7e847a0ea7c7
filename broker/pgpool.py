"""The broker's connections (psycopg 3): a small pool for sends, dedicated ones for the rest.

* Every consumer owns one dedicated connection (its LISTEN and its claims), and so does
  the settler: none of them is taken from a pool, so however many queues a process
  serves, sending a message never waits on a consumer's connection.
* Sends, heartbeats and rescue share :func:`open_send_pool`, a ``psycopg_pool`` pool
  whose size does not depend on the number of queues.

:class:`Outage` tells one story per outage: one line when the database goes away and
one when it is back, whatever the number of threads that noticed.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

logger = logging.getLogger("standmeet.broker")
# psycopg_pool logs every failed connection attempt; an outage is told by Outage, once.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

#: psycopg errors that mean "the connection or the server is gone": retry later.
DISCONNECTS: tuple[type[BaseException], ...] = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)

#: How long a send waits for a pooled connection before it fails.
DEFAULT_POOL_WAIT_S = 10.0
#: An outage is over once things have worked this long after its last failure.
OUTAGE_QUIET_S = 0.5
#: TCP keepalives, so a connection to a vanished server is noticed within seconds.
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 2}
#: A connection attempt gives up after this long (libpq's connect_timeout).
CONNECT_TIMEOUT_S = 5


class Outage:
    """Logs one line when the database becomes unreachable and one when it is back.

    Failures that follow each other (several broken connections discovered one by one)
    belong to one outage: it ends only when an operation succeeds at least
    :data:`OUTAGE_QUIET_S` after the last failure. :attr:`ended_at` (monotonic) tells
    when the last outage ended, so that rescue can wait before judging others.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.last_failure = 0.0
        self.ended_at: float | None = None

    @property
    def down(self) -> bool:
        return self.down_since is not None

    def failed(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self.last_failure = time.monotonic()
            if self.down_since is not None:
                return
            self.down_since = self.last_failure
        text = str(exc).strip()
        logger.warning(
            "%s: database unreachable (%s: %s); retrying with back-off",
            self.name, where, text.splitlines()[0] if text else type(exc).__name__,
        )

    def ok(self) -> None:
        if self.down_since is None:
            return
        with self._lock:
            if self.down_since is None or time.monotonic() - self.last_failure < OUTAGE_QUIET_S:
                return
            since, self.down_since = self.down_since, None
            self.ended_at = time.monotonic()
        logger.warning("%s: database reachable again after %.1f s", self.name, time.monotonic() - since)


def connect(url: str, *, application_name: str, async_commit: bool = False) -> psycopg.Connection[Any]:
    """A dedicated autocommit connection (a consumer's, the settler's, a listener's)."""
    from broker.sql import ASYNC_COMMIT_OPTIONS

    extra: dict[str, Any] = {"options": ASYNC_COMMIT_OPTIONS} if async_commit else {}
    return psycopg.connect(
        url, autocommit=True, application_name=application_name, prepare_threshold=0,
        connect_timeout=CONNECT_TIMEOUT_S, **KEEPALIVES, **extra,
    )


def open_send_pool(url: str, *, max_size: int, wait_s: float = DEFAULT_POOL_WAIT_S) -> ConnectionPool:
    """The broker's pool for sends, heartbeats and rescue; connections are made on demand."""
    return ConnectionPool(
        url,
        min_size=0,
        max_size=max_size,
        open=True,
        timeout=wait_s,
        kwargs={"autocommit": True, "application_name": "standmeet-broker", "prepare_threshold": 0,
                "connect_timeout": CONNECT_TIMEOUT_S, **KEEPALIVES},
        name="standmeet-broker",
    )


#: How long a job waits for a pooled application connection before failing (retryable).
APP_CHECKOUT_TIMEOUT_S = 10.0


def open_app_pool(url: str, *, max_size: int) -> ConnectionPool:
    """The application's pool, for jobs and requests; connections are made on demand."""
    return ConnectionPool(
        url,
        min_size=0,
        max_size=max_size,
        open=True,
        kwargs={"application_name": "standmeet-app", "autocommit": True},
        timeout=APP_CHECKOUT_TIMEOUT_S,
    )


def close_quietly(conn: psycopg.Connection[Any] | None) -> None:
    """Close a dedicated connection that may already be broken."""
    if conn is not None:
        try:
            conn.close()
        except psycopg.Error:
            pass
