"""Dramatiq's result backend on Postgres (``standmeet.results``), woken by NOTIFY.

What it guarantees:

* A stored result (or failure) is readable by any process until ``ttl`` milliseconds
  after it was stored, measured by the database's clock; after that it is missing,
  whether or not :func:`prune_expired_once` has deleted the row yet.
* Storing is one statement: the row is written and the notification sent in the same
  transaction, so a waiter is never told about a result it cannot read yet.
* A result being stored waits for a database that cannot be reached (a worker's run
  ends during an outage): the write is tried again, at growing intervals up to
  :data:`STORE_RETRY_MAX_S`, until it is written or ``store_wait_s`` has passed (None,
  the default: until it is written). The run is settled only after its after-hooks, so a
  job is never recorded done with its result lost; a worker stopped meanwhile gives the
  run back and it runs again. Other database errors are raised at once.
* ``get_result(block=True)`` does not poll. Each backend object keeps at most one
  LISTEN connection per process (opened by the first blocking wait, on a thread
  started through :mod:`broker.detach`); a waiter reads the table, then sleeps until
  a notification for its key arrives, the listener (re)connects, or the timeout.
  Because every waiter re-reads the table whenever the listener (re)connects, a
  result stored before the LISTEN was in place is not missed.
* A failure stored by Dramatiq's ``Results`` middleware comes back as
  :class:`dramatiq.results.ResultFailure` carrying the original exception's type
  name and message; nothing stored gives ``ResultMissing``; a blocking wait that
  runs out gives ``ResultTimeout``.
* psycopg errors never escape: a connection problem is
  :class:`broker.errors.DatabaseUnavailable`, anything else
  :class:`broker.errors.DatabaseError`, each raised ``from`` the psycopg error.

The LISTEN machinery (:class:`NotificationListener`) and the pool handling
(:class:`Database`) are shared with :mod:`broker.backends.rate_limits`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import psycopg
from dramatiq.encoder import Encoder
from dramatiq.message import Message
from dramatiq.results import Missing, ResultBackend, ResultMissing, ResultTimeout
from dramatiq.results.backend import DEFAULT_TIMEOUT, MResult, Result
from psycopg import sql
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from broker import detach
from broker.backends import RESULTS_NAMESPACE
from broker.errors import ConfigError, DatabaseError, DatabaseUnavailable
from broker.pg import pool as pgpool

logger = logging.getLogger(f"standmeet.{__name__}")

#: The NOTIFY channel a stored result is announced on; the payload is the message key.
RESULTS_CHANNEL = "standmeet_results"

#: Write (or overwrite) a result and announce it, in one statement and one transaction.
STORE_RESULT = """
WITH stored AS (
    INSERT INTO standmeet.results AS r (message_key, value, expires_at)
    VALUES (%(key)s, %(value)s, coalesce(now() + %(ttl_ms)s * interval '1 millisecond', 'infinity'))
    ON CONFLICT (message_key) DO UPDATE
        SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at
    RETURNING r.message_key
)
SELECT pg_notify(%(channel)s, message_key) FROM stored
"""

#: A result that has not expired yet, by the database's clock.
GET_RESULT = """
SELECT value FROM standmeet.results WHERE message_key = %(key)s AND expires_at > now()
"""

#: Delete one batch of expired results (the outer condition is re-checked on rows
#: written concurrently, so a result stored again meanwhile survives). The batch is
#: picked once, in a CTE: as a subquery, a plan may read it again for each row deleted,
#: skip the rows it just locked and deleted, and take the next batch, and the next.
PRUNE_EXPIRED_RESULTS = """
WITH batch AS MATERIALIZED (
    SELECT message_key FROM standmeet.results
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM standmeet.results t
USING batch
WHERE t.message_key = batch.message_key
  AND t.expires_at <= now()
"""

#: ``LISTEN <channel>``; the channel is one of the module constants, quoted as an identifier.
LISTEN = sql.SQL("LISTEN {}")

#: The first and the longest pause between two tries of a result store that found the
#: database unavailable.
STORE_RETRY_FIRST_S = 0.25
STORE_RETRY_MAX_S = 5.0

#: How many expired rows one prune statement deletes at most.
DEFAULT_PRUNE_BATCH = 1000

#: psycopg errors that mean "no usable connection": the database may come back.
UNAVAILABLE: tuple[type[BaseException], ...] = (
    psycopg.OperationalError,
    psycopg.InterfaceError,
    PoolTimeout,
)


@contextmanager
def translated_errors(what: str) -> Iterator[None]:
    """Turn psycopg errors raised inside the block into our :mod:`broker.errors` ones."""
    try:
        yield
    except UNAVAILABLE as exc:
        raise DatabaseUnavailable(f"{what}: database unavailable: {exc}") from exc
    except psycopg.Error as exc:
        raise DatabaseError(f"{what}: {exc}") from exc


def fetch_one(conn: psycopg.Connection[Any], query: str, params: dict[str, Any]) -> tuple[Any, ...] | None:
    """Run one statement and commit it, on an autocommit connection or not."""
    if conn.autocommit:
        return conn.execute(query, params).fetchone()
    with conn.transaction():
        return conn.execute(query, params).fetchone()


T = TypeVar("T")


def reachable_later(exc: DatabaseUnavailable) -> bool:
    """Whether the database may be reached later: not when the pool itself was closed (the
    application is shutting it down: no try will ever get a connection from it)."""
    return not isinstance(exc.__cause__, PoolClosed)


def written_when_reachable(what: str, write: Callable[[], T], *, wait_s: float | None,
                           repeatable: Callable[[DatabaseUnavailable], bool] = reachable_later) -> T:
    """``write()``, tried again while it fails with :class:`DatabaseUnavailable` that
    ``repeatable`` says is safe to try again, at growing intervals from
    :data:`STORE_RETRY_FIRST_S` to :data:`STORE_RETRY_MAX_S`, for up to ``wait_s`` seconds
    (None: until it is written). Each wait is logged once, as it starts and as it ends."""
    waiting_since: float | None = None
    pause_s = STORE_RETRY_FIRST_S
    while True:
        try:
            written = write()
        except DatabaseUnavailable as exc:
            now = time.monotonic()
            if not repeatable(exc):
                raise
            if waiting_since is None:
                waiting_since = now
                logger.warning("%s: %s; trying again until it is written", what, exc)
            waited_s = now - waiting_since
            if wait_s is not None and waited_s >= wait_s:
                raise
            time.sleep(pause_s if wait_s is None else min(pause_s, wait_s - waited_s))
            pause_s = min(pause_s * 2, STORE_RETRY_MAX_S)
            continue
        if waiting_since is not None:
            logger.info("%s written after %.1f s without the database", what, time.monotonic() - waiting_since)
        return written


def nothing_was_sent(exc: DatabaseUnavailable) -> bool:
    """Whether the failed statement never reached the server: no connection could be had
    (the pool checks each one before it lends it). A write that is not the same every
    time (an increment) is repeated only then."""
    return isinstance(exc.__cause__, PoolTimeout)


def prune_expired(
    conn_or_url: psycopg.Connection[Any] | str, query: str, *, batch: int, what: str
) -> int:
    """Run one batched DELETE of expired rows; return how many rows it deleted."""
    if batch < 1:
        raise ConfigError(f"batch must be at least 1, got {batch}")
    with translated_errors(what):
        if isinstance(conn_or_url, str):
            with pgpool.connect(conn_or_url, application_name="standmeet-prune") as conn:
                return conn.execute(query, {"batch": batch}).rowcount
        if conn_or_url.autocommit:
            return conn_or_url.execute(query, {"batch": batch}).rowcount
        with conn_or_url.transaction():
            return conn_or_url.execute(query, {"batch": batch}).rowcount


def prune_expired_once(conn_or_url: psycopg.Connection[Any] | str, *, batch: int = DEFAULT_PRUNE_BATCH) -> int:
    """Delete at most ``batch`` expired results; return how many were deleted.

    Call it again while it returns ``batch``. Safe to run from several processes at once
    (rows another pruner holds are skipped). On a non-autocommit connection it commits.
    """
    return prune_expired(conn_or_url, PRUNE_EXPIRED_RESULTS, batch=batch, what="pruning expired results")


class Database:
    """Where a backend runs its statements: a given pool, or its own small pool opened lazily.

    The backend's own pool (built from ``url``) opens on first use, so merely building
    a backend connects to nothing; its connections are autocommit. A given pool is
    used as it is and never closed here.
    """

    def __init__(
        self,
        *,
        url: str | None,
        pool: ConnectionPool[Any] | None,
        pool_max_size: int,
        checkout_timeout_ms: int,
        application_name: str,
    ) -> None:
        if url is None:
            if pool is None:
                raise ConfigError("a backend needs url= or pool=")
            if not isinstance(pool.conninfo, str):
                raise ConfigError("the pool's conninfo is not a string: give url= too, for the LISTEN connection")
            url = pool.conninfo
        self.url: str = url
        self.application_name = application_name
        self._given_pool = pool
        self._own_pool: ConnectionPool[Any] | None = None
        self._pool_max_size = pool_max_size
        self._checkout_timeout_s = checkout_timeout_ms / 1000
        self._lock = threading.Lock()
        #: set by :meth:`close`: a write waiting for the database gives up
        self.closed = False

    def _pool(self) -> ConnectionPool[Any]:
        if self._given_pool is not None:
            return self._given_pool
        with self._lock:
            if self._own_pool is None:
                self._own_pool = pgpool.open_pool(self.url, max_size=self._pool_max_size,
                                                  timeout_s=self._checkout_timeout_s, name=self.application_name)
            return self._own_pool

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection for a short piece of work (no network call inside)."""
        with self._pool().connection(timeout=self._checkout_timeout_s) as conn:
            yield conn

    def close(self) -> None:
        """Close the backend's own pool, if it opened one; a given pool is left alone."""
        self.closed = True
        with self._lock:
            pool, self._own_pool = self._own_pool, None
        if pool is not None:
            pool.close()


class NotificationListener:
    """One LISTEN connection on one channel, shared by every thread of the process that waits.

    A waiter registers its key with :meth:`watching`, then checks the database, then
    waits on the event it was given. The event is set when a notification whose
    payload is that key arrives, and also whenever the connection (re)starts
    listening, since notifications sent while it was not listening are lost: a waiter
    woken that way simply checks again. So the pattern "watch, check, wait, check…"
    never misses a change that is followed by a notification.

    The thread is started lazily (:meth:`start`) through :func:`broker.detach.go`; it
    reconnects after ``reconnect_delay_ms`` when the connection fails, and is stopped
    by :meth:`close`.
    """

    def __init__(
        self,
        *,
        url: str,
        channel: str,
        thread_name: str,
        application_name: str,
        reconnect_delay_ms: int = 1000,
        stop_check_ms: int = 250,
    ) -> None:
        self._url = url
        self._channel = channel
        self._thread_name = thread_name
        self._application_name = application_name
        self._reconnect_delay_s = reconnect_delay_ms / 1000
        self._stop_check_s = stop_check_ms / 1000
        self._lock = threading.Lock()
        self._waiters: dict[str, set[threading.Event]] = {}
        self._helper: detach.Detached | None = None
        self._pid: int | None = None
        self.listening = threading.Event()

    def start(self) -> None:
        """Start the listening thread unless it runs already (in this process)."""
        with self._lock:
            if self._helper is not None and self._helper.alive and self._pid == os.getpid():
                return
            self._pid = os.getpid()
            self.listening.clear()
            self._helper = detach.go(self._thread_name, self._run)

    @contextmanager
    def watching(self, key: str) -> Iterator[threading.Event]:
        """Register interest in ``key`` for the duration of the block; yield the wake-up event."""
        woken = threading.Event()
        with self._lock:
            self._waiters.setdefault(key, set()).add(woken)
        try:
            yield woken
        finally:
            with self._lock:
                events = self._waiters.get(key)
                if events is not None:
                    events.discard(woken)
                    if not events:
                        del self._waiters[key]

    def close(self, *, timeout_ms: int = 5000) -> bool:
        """Stop listening and close the connection; True once the thread has ended."""
        with self._lock:
            helper, self._helper = self._helper, None
        if helper is None:
            return True
        return helper.stop(timeout_s=timeout_ms / 1000)

    def _wake(self, key: str) -> None:
        with self._lock:
            for event in self._waiters.get(key, ()):
                event.set()

    def _wake_all(self) -> None:
        with self._lock:
            for events in self._waiters.values():
                for event in events:
                    event.set()

    def _run(self, stop: threading.Event) -> None:
        where = pgpool.listen_url(self._url)
        if where is None:  # through a transaction pooler with no listen URL: waiters look again
            self.listening.set()
            while not stop.wait(pgpool.poll_s(self._url)):
                self._wake_all()
            return
        failing = False
        while not stop.is_set():
            conn: psycopg.Connection[Any] | None = None
            try:
                conn = pgpool.connect(where, application_name=self._application_name)
                conn.execute(LISTEN.format(sql.Identifier(self._channel)))
                self.listening.set()
                if failing:
                    logger.info("%s: listening again", self._thread_name)
                    failing = False
                self._wake_all()  # whatever was notified while we were not listening
                while not stop.is_set():
                    for notify in conn.notifies(timeout=self._stop_check_s):
                        self._wake(notify.payload)
            except Exception as exc:  # never dies: said once, retried
                if not failing:  # one line per outage
                    logger.warning("%s: cannot listen (%s); retrying", self._thread_name, exc)
                failing = True
            finally:
                self.listening.clear()
                if conn is not None:
                    try:
                        conn.close()
                    except psycopg.Error:
                        pass
            stop.wait(self._reconnect_delay_s)


def connect_backend(*, url: str | None, pool: ConnectionPool[Any] | None, pool_max_size: int, checkout_timeout_ms: int,
                    application_name: str, channel: str, reconnect_delay_ms: int
                    ) -> tuple[Database, NotificationListener]:
    """A backend's database access and its one LISTEN connection (opened on first wait)."""
    database = Database(url=url, pool=pool, pool_max_size=pool_max_size,
                        checkout_timeout_ms=checkout_timeout_ms, application_name=application_name)
    listener = NotificationListener(url=database.url, channel=channel, thread_name=f"{application_name}-listen",
                                    application_name=f"{application_name}-listen",
                                    reconnect_delay_ms=reconnect_delay_ms)
    return database, listener


class PostgresResultBackend(ResultBackend):
    """Dramatiq results in ``standmeet.results``; blocking reads wait for a NOTIFY.

    Give either ``url`` (the backend opens its own small pool on first use) or
    ``pool`` (an existing psycopg pool, e.g. the application's; if its conninfo is not
    a plain string, give ``url`` as well for the LISTEN connection). Call
    :meth:`close` when done. ``store_wait_s`` bounds how long a store waits for an
    unreachable database (None: until it is back).
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ConnectionPool[Any] | None = None,
        namespace: str = RESULTS_NAMESPACE,
        encoder: Encoder | None = None,
        use_namespace_prefix_keys: bool = False,
        pool_max_size: int = 4,
        checkout_timeout_ms: int = 10_000,
        reconnect_delay_ms: int = 1_000,
        application_name: str = "standmeet-results",
        store_wait_s: float | None = None,
    ) -> None:
        super().__init__(
            namespace=namespace, encoder=encoder, use_namespace_prefix_keys=use_namespace_prefix_keys
        )
        if store_wait_s is not None and not store_wait_s >= 0:
            raise ConfigError(f"store_wait_s must be None or a number of seconds >= 0, not {store_wait_s!r}")
        self.store_wait_s = store_wait_s
        self.database, self.listener = connect_backend(
            url=url, pool=pool, pool_max_size=pool_max_size, checkout_timeout_ms=checkout_timeout_ms,
            application_name=application_name, channel=RESULTS_CHANNEL, reconnect_delay_ms=reconnect_delay_ms,
        )

    def get_result(self, message: Message[Any], *, block: bool = False, timeout: int | None = None) -> Result:
        """The message's result; ``timeout`` is in milliseconds (default 10 s) when blocking.

        Raises ``ResultFailure`` if the actor failed, ``ResultMissing`` if nothing is
        stored and ``block`` is false, ``ResultTimeout`` if nothing arrived in time.
        """
        message_key = self.build_message_key(message)
        if not block:
            result = self._get(message_key)
            if result is Missing:
                raise ResultMissing(message)
            return self.unwrap_result(result)

        timeout_ms = DEFAULT_TIMEOUT if timeout is None else timeout
        deadline = time.monotonic() + timeout_ms / 1000
        self.listener.start()
        with self.listener.watching(message_key) as woken:
            while True:
                result = self._get(message_key)
                if result is not Missing:
                    return self.unwrap_result(result)
                remaining_s = deadline - time.monotonic()
                if remaining_s <= 0:
                    raise ResultTimeout(message)
                woken.wait(remaining_s)
                woken.clear()

    def _get(self, message_key: str) -> MResult:
        with translated_errors("reading a result"), self.database.connection() as conn:
            row = conn.execute(GET_RESULT, {"key": message_key}).fetchone()
        if row is None:
            return Missing
        return self.encoder.decode(bytes(row[0]))

    def _store(self, message_key: str, result: Result, ttl: int | None) -> None:
        """Write the encoded result for ``ttl`` milliseconds (None: kept until deleted, as
        Dramatiq's Redis backend keeps a result stored with no TTL, e.g. a message's
        ``result_ttl=None``) and notify waiters, atomically; while the database cannot be
        reached, try again (``store_wait_s``). The write is an upsert of the same value: a
        try whose commit was lost with its connection is harmless to repeat."""
        params = {
            "key": message_key,
            "value": self.encoder.encode(result),
            "ttl_ms": None if ttl is None else int(ttl),
            "channel": RESULTS_CHANNEL,
        }
        def store() -> None:
            with translated_errors("storing a result"), self.database.connection() as conn:
                fetch_one(conn, STORE_RESULT, params)

        written_when_reachable(f"result {message_key}", store, wait_s=self.store_wait_s,
                               repeatable=lambda exc: reachable_later(exc) and not self.database.closed)

    def close(self, *, timeout_ms: int = 5000) -> None:
        """Stop the listener and close the backend's own pool (a given pool stays open)."""
        self.listener.close(timeout_ms=timeout_ms)
        self.database.close()
