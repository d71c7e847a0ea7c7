"""The broker's psycopg2 pool (dramatiq-pg's driver), fixed so an ack never fails on it.

dramatiq-pg's ``ThreadedConnectionPool`` raises ``PoolError`` the moment it is
exhausted, and the ack that met it was lost. This pool waits for a free connection
instead (bounded by ``wait_s``), drops connections that broke, and tells one story
per outage (see :class:`Outage`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
import psycopg2.extensions
from psycopg2.pool import ThreadedConnectionPool

from broker.errors import DatabaseUnavailable

logger = logging.getLogger(__name__)

#: psycopg2 errors that mean "the connection or the server is gone": retry later.
DISCONNECTS: tuple[type[BaseException], ...] = (psycopg2.OperationalError, psycopg2.InterfaceError)

#: How long a caller waits for a free connection before giving up.
DEFAULT_POOL_WAIT_S = 30.0


#: An outage is over once things have worked this long after its last failure.
OUTAGE_QUIET_S = 0.5


class Outage:
    """Logs one line when the database becomes unreachable and one when it is back.

    Failures that follow each other (several broken connections discovered one by one)
    belong to one outage: it ends only when an operation succeeds at least
    :data:`OUTAGE_QUIET_S` after the last failure.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.last_failure = 0.0

    def failed(self, where: str, exc: BaseException) -> None:
        with self._lock:
            self.last_failure = time.monotonic()
            if self.down_since is not None:
                return
            self.down_since = self.last_failure
        logger.warning(
            "%s: database unreachable (%s: %s); retrying with back-off",
            self.name,
            where,
            str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
        )

    def ok(self) -> None:
        if self.down_since is None:
            return
        with self._lock:
            if self.down_since is None or time.monotonic() - self.last_failure < OUTAGE_QUIET_S:
                return
            since, self.down_since = self.down_since, None
        if since is not None:
            logger.warning("%s: database reachable again after %.1f s", self.name, time.monotonic() - since)


class BlockingPool:
    """A thread-safe psycopg2 pool that waits for a connection instead of raising."""

    def __init__(self, dsn: str, maxconn: int, *, wait_s: float = DEFAULT_POOL_WAIT_S,
                 application_name: str = "standmeet-broker") -> None:
        self.maxconn = maxconn
        self.minconn = 0  # read by dramatiq-pg helpers
        self.wait_s = wait_s
        self._slots = threading.BoundedSemaphore(maxconn)
        self._pool = ThreadedConnectionPool(
            0, maxconn, dsn,
            application_name=application_name,
            keepalives=1, keepalives_idle=5, keepalives_interval=2, keepalives_count=2,
        )
        # Opened lazily (0 at start), but kept once opened: psycopg2 closes a returned
        # connection whenever the pool holds ``minconn`` or more, so with 0 every ack
        # would reconnect.
        self._pool.minconn = maxconn

    def getconn(self) -> psycopg2.extensions.connection:
        if not self._slots.acquire(timeout=self.wait_s):
            raise DatabaseUnavailable(
                f"no broker connection became free within {self.wait_s:.0f} s "
                f"(pool of {self.maxconn}); raise STANDMEET_BROKER_ACK_CONNECTIONS"
            )
        try:
            return self._pool.getconn()
        except BaseException:
            self._slots.release()
            raise

    def putconn(self, conn: psycopg2.extensions.connection, close: bool = False) -> None:
        try:
            self._pool.putconn(conn, close=close or bool(conn.closed))
        finally:
            self._slots.release()

    @contextmanager
    def connection(self, *, autocommit: bool = True) -> Iterator[psycopg2.extensions.connection]:
        """A connection for one short piece of work; a broken one is closed, not reused."""
        conn = self.getconn()
        broken = False
        try:
            if conn.autocommit != autocommit:
                conn.autocommit = autocommit
            yield conn
            if not autocommit:
                conn.commit()
        except DISCONNECTS:
            broken = True
            self.discard_idle()  # its siblings are likely dead too: do not hand them out
            raise
        except BaseException:
            if not autocommit and not conn.closed:
                conn.rollback()
            raise
        finally:
            self.putconn(conn, close=broken)

    def execute(self, query: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """Run one autocommit statement and return its rows (empty if it returns none)."""
        with self.connection() as conn, conn.cursor() as cur:
            cur.execute(query, params)
            return cur.fetchall() if cur.description else []

    def discard_idle(self) -> None:
        """Close the idle connections; new ones are opened on demand."""
        pool = self._pool
        with pool._lock:  # psycopg2's own lock around its idle list
            idle, pool._pool = list(pool._pool), []
        for conn in idle:
            try:
                conn.close()
            except Exception:
                pass

    def closeall(self) -> None:
        try:
            self._pool.closeall()
        except psycopg2.pool.PoolError:
            pass
