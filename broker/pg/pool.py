"""The broker's connections (psycopg 3): how every connection of the runtime is made.

* Every connection the runtime opens gets its options from :func:`connect_kwargs`:
  keepalives and ``tcp_user_timeout`` (a cut-off server is noticed in seconds), a connect
  timeout, and prepared statements only where the connection is known to allow them.
* What stands between this process and Postgres is found out once per URL
  (:func:`topology_for`): a direct connection, or a pooler (PgBouncer) in session or
  transaction mode. Through a transaction pooler nothing relies on session state
  (deadlines are ``SET LOCAL``, locks are transaction-scoped), statements are not
  prepared unless ``STANDMEET_PREPARED_STATEMENTS=on``, and LISTEN goes over
  ``STANDMEET_LISTEN_DATABASE_URL`` or, without one, wake-ups poll.
* Every consumer owns one dedicated connection (its claims), and so does the settler:
  none of them is taken from a pool, so however many queues a process serves, sending a
  message never waits on a consumer's connection. Sends, heartbeats and rescue share
  :func:`open_send_pool`, a ``psycopg_pool`` pool whose size does not depend on the
  number of queues.
* Pooled connections are checked when handed out (:func:`check_cheaply`): one that died
  with a restarted server is replaced, not handed to a job.

:class:`Outage` tells one story per outage: one line when the database goes away and
one when it is back, whatever the number of threads that noticed.
"""

from __future__ import annotations

import logging
import select
import threading
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from broker.errors import DatabaseUnavailable

logger = logging.getLogger("standmeet.broker")
# psycopg_pool logs every failed connection attempt; an outage is told by Outage, once.
logging.getLogger("psycopg.pool").setLevel(logging.ERROR)

#: psycopg errors that mean "the connection or the server is gone": retry later.
DISCONNECTS: tuple[type[BaseException], ...] = (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout)

#: How long a send waits for a pooled connection before it fails.
DEFAULT_POOL_WAIT_S = 10.0
#: An outage is over once things have worked this long after its last failure.
OUTAGE_QUIET_S = 0.5
#: TCP keepalives, so an idle connection to a vanished server is noticed within seconds.
KEEPALIVES: dict[str, Any] = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2, "keepalives_count": 2}
#: A connection attempt gives up after this long (libpq's connect_timeout).
CONNECT_TIMEOUT_S = 5

DIRECT, SESSION, TRANSACTION = "direct", "session", "transaction"
#: How a topology that could not be probed is described (and not remembered).
UNPROBED = "assumed direct"


@dataclass(frozen=True)
class Topology:
    """What stands between this process and one database URL, and what follows from it."""

    #: direct | session | transaction
    mode: str
    #: whether statements may be prepared on the server
    prepare: bool
    #: where LISTEN goes (None: nowhere; wake-ups poll every ``poll_s``)
    listen_url: str | None
    #: how it was known: "told" (STANDMEET_POOLER) or what the probe saw
    how: str = "told"
    poll_s: float = 0.05

    @property
    def known_direct(self) -> bool:
        """Direct, as probed or told: not merely assumed (a probe that got no answer)."""
        return self.mode == DIRECT and not self.how.startswith(UNPROBED)

    @property
    def session_state(self) -> bool:
        """Whether a session-level setting stays with this client (not through a transaction pooler)."""
        return self.mode != TRANSACTION

    def describe(self) -> str:
        if self.mode == DIRECT:
            where = "a direct connection"
        else:
            where = f"a pooler in {self.mode} mode"
        listen = ("LISTEN on the same connection" if self.listen_url is not None and self.mode != TRANSACTION
                  else "LISTEN on STANDMEET_LISTEN_DATABASE_URL" if self.listen_url is not None
                  else f"no LISTEN: wake-ups and receipts poll every {self.poll_s * 1000:g} ms "
                       "(set STANDMEET_LISTEN_DATABASE_URL to a direct connection)")
        prepared = "statements prepared" if self.prepare else "no prepared statements"
        return f"{where} ({self.how}); {prepared}; {listen}"


@dataclass(frozen=True)
class Hints:
    """What the settings say of the topology (the process's, installed by ``configure``)."""

    pooler: str = "auto"
    prepared_statements: str = "auto"
    listen_url: str | None = None
    poll_s: float = 0.05
    tcp_user_timeout_ms: int = 5_000

    @classmethod
    def of(cls, settings: Any) -> Hints:
        return cls(pooler=settings.pooler, prepared_statements=settings.prepared_statements,
                   listen_url=settings.listen_database_url, poll_s=settings.unlistened_poll_s,
                   tcp_user_timeout_ms=settings.tcp_user_timeout_ms)


_hints: Hints | None = None
_topologies: dict[str, Topology] = {}
_topology_lock = threading.Lock()


def use_settings(settings: Any) -> None:
    """Take the pooler, prepared-statement and LISTEN settings of this process."""
    global _hints
    hints = Hints.of(settings)
    with _topology_lock:
        if hints != _hints:
            _hints = hints
            _topologies.clear()


def hints() -> Hints:
    global _hints
    if _hints is None:
        from broker.settings import Settings

        try:
            _hints = Hints.of(Settings.current())
        except Exception:  # a malformed setting is reported by whoever reads the settings
            _hints = Hints()
    return _hints


def base_kwargs(*, prepare: bool, at_first_use: bool = False) -> dict[str, Any]:
    """Options every runtime connection gets: keepalives, tcp_user_timeout, connect timeout;
    statements prepared (at psycopg's default fifth use, or ``at_first_use``) or never."""
    kwargs: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S, **KEEPALIVES}
    if not prepare:
        kwargs["prepare_threshold"] = None
    elif at_first_use:
        kwargs["prepare_threshold"] = 0
    timeout_ms = hints().tcp_user_timeout_ms
    if timeout_ms:
        kwargs["tcp_user_timeout"] = timeout_ms
    return kwargs


def topology_for(url: str) -> Topology:
    """What stands between this process and ``url``: told by STANDMEET_POOLER, or found out
    once (per URL and process) by :func:`probe`. A process's start says it once
    (``broker.configure``)."""
    with _topology_lock:
        found = _topologies.get(url)
    if found is not None:
        return found
    h = hints()
    if h.pooler == "auto":
        mode, how = probe(url)
    else:
        mode, how = h.pooler, "told by STANDMEET_POOLER"
    if h.prepared_statements == "auto":
        prepare = mode != TRANSACTION
    else:
        prepare = h.prepared_statements == "on"
    listen_url = h.listen_url or (url if mode != TRANSACTION else None)
    topology = Topology(mode=mode, prepare=prepare, listen_url=listen_url, how=how, poll_s=h.poll_s)
    if how.startswith(UNPROBED):
        return topology  # nothing was learnt: the next connection looks again
    with _topology_lock:
        return _topologies.setdefault(url, topology)


#: Rounds of the probe in which no server connection moved between its two clients before
#: it concludes session pooling (each round: four statements, one transaction).
PROBE_ROUNDS = 4


def probe(url: str) -> tuple[str, str]:
    """Direct, or through a pooler, and in which mode: ``(mode, how it was seen)``.

    A pooler announces a backend pid of its own at connect (PgBouncer's cancel key), so
    ``pg_backend_pid()`` differs from it. Its mode shows with a second client: in
    transaction mode, a server connection the first client released serves the second
    one's transaction, and the first client then gets another, or, after the second
    commits, the one the second released. In session mode each client keeps one server
    connection of its own for its life: a client seen on two, or two clients seen on one,
    prove transaction pooling. Other clients of the pooler, taking and freeing server
    connections meanwhile, can hide the moves of one round (about one probe in twenty-five
    under a busy neighbour): session mode is concluded only after PROBE_ROUNDS rounds in
    which nothing moved. A pooler that hands out server connections in another order than
    PgBouncer's (last freed, first used) could pass for a session pooler: tell it with
    STANDMEET_POOLER. An unreachable server is taken as direct for now (nothing was learnt,
    nothing is remembered: the next connection looks again)."""
    kwargs = {**base_kwargs(prepare=False), "autocommit": True, "application_name": "standmeet-probe"}
    try:
        first = psycopg.connect(url, **kwargs)
    except psycopg.Error:
        return DIRECT, f"{UNPROBED}: the server did not answer the probe"
    try:
        with first:
            own = _backend_pid(first)
            if own == first.info.backend_pid:
                return DIRECT, "detected"
            with psycopg.connect(url, **kwargs) as second:
                seen_first, seen_second = {own}, set()
                for _ in range(PROBE_ROUNDS):
                    with second.transaction():
                        seen_second.add(_backend_pid(second))
                        seen_first.add(_backend_pid(first))
                    # released last, the second's server connection serves the first's next
                    # transaction in transaction mode (PgBouncer reuses the last one freed)
                    seen_first.add(_backend_pid(first))
                    seen_second.add(_backend_pid(second))
                    if len(seen_first) > 1 or len(seen_second) > 1 or not seen_first.isdisjoint(seen_second):
                        return TRANSACTION, "detected: server connections move between clients"
            return SESSION, "detected: each client keeps its server connection"
    except psycopg.Error:
        return DIRECT, f"{UNPROBED}: the probe failed"


def _backend_pid(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    return int(row[0]) if row else -1


def connect_kwargs(url: str, *, at_first_use: bool = False) -> dict[str, Any]:
    """The options of a connection to ``url``: :func:`base_kwargs` as its topology allows
    (the broker's own connections, which run a few statements very often, prepare them
    ``at_first_use``)."""
    return base_kwargs(prepare=topology_for(url).prepare, at_first_use=at_first_use)


def listen_url(url: str) -> str | None:
    """Where this process LISTENs for notifications sent on ``url``'s database; None when
    it cannot (transaction pooling with no STANDMEET_LISTEN_DATABASE_URL): poll instead."""
    return topology_for(url).listen_url


def poll_s(url: str) -> float:
    """How often to look for work when notifications cannot be heard."""
    return topology_for(url).poll_s


#: What poll reports for a descriptor that has something to read, or whose peer is gone.
_READABLE = select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP if hasattr(select, "poll") else 0


def readable(fds: list[int], timeout_s: float) -> list[int]:
    """Which of ``fds`` have something to read (or a peer gone) within ``timeout_s``.

    ``poll``, not ``select``: a process with more than 1024 descriptors open (many
    connections, many sockets) gets descriptors that ``select`` refuses ("filedescriptor
    out of range"), which made every pooled connection look dead and every wait fail.
    ``select`` only where the platform has no ``poll``."""
    if not hasattr(select, "poll"):
        found, _, _ = select.select(fds, [], [], timeout_s)
        return list(found)
    poller = select.poll()
    for fd in fds:
        poller.register(fd, _READABLE)
    return [fd for fd, _ in poller.poll(max(0.0, timeout_s) * 1000)]


def check_cheaply(conn: psycopg.Connection[Any]) -> None:
    """Hand out only live connections, at the cost of a system call: an idle connection has
    nothing to read, so one that does (a server's goodbye, an end of file) is checked for
    real, and discarded by the pool if it is dead (the pool then takes or makes another)."""
    if conn.closed or conn.broken:
        raise psycopg.OperationalError("the connection is closed")
    try:
        waiting = readable([conn.fileno()], 0)
    except (OSError, ValueError) as exc:
        raise psycopg.OperationalError(f"the connection's socket is gone: {exc}") from exc
    if waiting:
        ConnectionPool.check_connection(conn)


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
        unreachable = isinstance(exc, (*DISCONNECTS, DatabaseUnavailable))
        what = "database unreachable" if unreachable else f"database error {type(exc).__name__}"
        logger.warning(
            "%s: %s (%s: %s); retrying with back-off",
            self.name, what, where, text.splitlines()[0] if text else type(exc).__name__,
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


def connect(url: str, *, application_name: str, at_first_use: bool = False) -> psycopg.Connection[Any]:
    """A dedicated autocommit connection (a consumer's, the settler's, a listener's, the relay's)."""
    return psycopg.connect(url, autocommit=True, application_name=application_name,
                           **connect_kwargs(url, at_first_use=at_first_use))


def open_send_pool(url: str, *, max_size: int, wait_s: float = DEFAULT_POOL_WAIT_S) -> ConnectionPool:
    """The broker's pool for sends, heartbeats and rescue; connections are made on demand."""
    return open_pool(url, max_size=max_size, timeout_s=wait_s, name="standmeet-broker", at_first_use=True)


#: How long a job waits for a pooled application connection before failing (retryable).
APP_CHECKOUT_TIMEOUT_S = 10.0


def open_app_pool(url: str, *, max_size: int) -> ConnectionPool:
    """The application's pool, for jobs and requests; connections are made on demand."""
    return open_pool(url, max_size=max_size, timeout_s=APP_CHECKOUT_TIMEOUT_S, name="standmeet-app")


def open_pool(url: str, *, max_size: int, timeout_s: float, name: str, min_size: int = 0,
              statement_timeout_ms: int | None = None, at_first_use: bool = False) -> ConnectionPool:
    """A ``psycopg_pool`` pool of the runtime: its connections made as :func:`connect_kwargs`
    says, each checked cheaply when handed out (:func:`check_cheaply`).

    With ``statement_timeout_ms``, every statement on a borrowed connection stops after that
    long: a session setting where the session is ours; through a transaction pooler, a
    ``SET LOCAL`` that opens the borrowing's one transaction (committed when the borrower
    gives the connection back, rolled back if it raised)."""
    kwargs: dict[str, Any] = {"autocommit": True, "application_name": name,
                              **connect_kwargs(url, at_first_use=at_first_use)}
    check: Any = check_cheaply
    configure: Any = None
    if statement_timeout_ms is not None:
        timeout = str(int(statement_timeout_ms))
        if topology_for(url).session_state:
            def configure(conn: psycopg.Connection[Any]) -> None:
                conn.execute(SET_STATEMENT_TIMEOUT, (timeout,))
        else:
            kwargs["autocommit"] = False

            def check(conn: psycopg.Connection[Any]) -> None:
                check_cheaply(conn)
                conn.execute(SET_LOCAL_STATEMENT_TIMEOUT, (timeout,))
    return ConnectionPool(
        url, min_size=min_size, max_size=max_size, open=True, timeout=timeout_s, check=check,
        configure=configure, kwargs=kwargs, name=name,
    )


#: A session's statement timeout (only where the session is this process's own).
SET_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, false)"
#: The current transaction's statement timeout (through a transaction pooler).
SET_LOCAL_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, true)"


def close_quietly(conn: psycopg.Connection[Any] | None) -> None:
    """Close a dedicated connection that may already be broken."""
    if conn is not None:
        try:
            conn.close()
        except psycopg.Error:
            pass
