"""The connection budget: what one process of ours may hold, and what the server can give.

Every count comes from one set of declarations: the queues a worker of the loaded
modules really serves (:func:`served_queues`: those its broker declares, from
``broker.app.queue`` and from every actor's ``queue_name``), so ``check``, ``run``, the
worker's start-up and the scheduler's count the same thing.

* **The application pool.** A process runs at most the sum of its served queues' max
  workers at once, each job holding at most one application connection at a time, plus
  the relay; that may use at most half of ``STANDMEET_POOL_MAX_SIZE`` (the other half is
  for web requests). A configuration that breaks this fails at boot, never as queueing
  in production (:func:`check_budget`).
* **The broker's own connections**, beside it and never pooled with what a job uses:
  one per consumer (a served queue), the settler's, the heartbeat's, the send pool for
  sends and rescue (``STANDMEET_BROKER_ACK_CONNECTIONS``), the results and rate-limit
  backends (a small pool and one LISTEN connection each), and one receipt listener per
  awaited queue. :func:`process_connections` adds up all of one process.
* **The server.** ``run --processes N`` needs N times a worker's connections, the
  scheduler's and its own; :func:`check_server_room` refuses to start when that is more
  than the server's ``max_connections`` less its reserved connections, less
  ``STANDMEET_SERVER_CONNECTIONS_RESERVE``, less what other clients hold now.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import psycopg

from broker import app
from broker.errors import BudgetError, DatabaseUnavailable, StartupRefused
from broker.settings import RELAY_CONNECTIONS, Settings, warn_undeclared

#: Each Dramatiq backend ``broker.configure()`` installs (results, rate limits) opens a
#: pool of at most this many connections, and one LISTEN connection on a blocking wait.
BACKEND_POOL_CONNECTIONS = 2
BACKEND_LISTEN_CONNECTIONS = 1
#: The scheduler ticks its periodic jobs on at most this many threads (APScheduler's pool).
SCHEDULER_TICK_THREADS = 10
#: How many other clients a refusal names (by application name or user); the rest are counted.
NAMED_OTHER_CLIENTS = 4


@dataclass(frozen=True)
class Connections:
    """Every connection one process may hold at once, term by term."""

    #: "a worker process", "the scheduler"
    holder: str
    terms: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(n for _, n in self.terms)

    def describe(self) -> str:
        parts = " + ".join(f"{name} {n}" for name, n in self.terms if n)
        return f"{self.holder} holds at most {self.total} connections: {parts}"


@dataclass(frozen=True)
class Budget:
    """What a process's jobs and relay use of the application pool, term by term, what they
    may use, and every connection the process holds beside them."""

    terms: tuple[tuple[str, int], ...]
    limit: int
    pool_max_size: int
    #: every connection of one such process (the pool's share and the broker's own)
    process: Connections

    @property
    def total(self) -> int:
        return sum(n for _, n in self.terms)

    def describe(self) -> str:
        parts = " + ".join(f"{name} {n}" for name, n in self.terms)
        return (
            f"{parts} = {self.total} connections; the limit is half the application pool "
            f"(STANDMEET_POOL_MAX_SIZE={self.pool_max_size}) = {self.limit}"
        )


def served_queues(requested: Sequence[str] | None = None) -> list[str]:
    """The queues a worker process of the loaded modules serves: ``requested`` (each one
    checked) or every queue their broker declares, as the worker's own broker does.

    Raises :class:`StartupRefused` for a queue nothing declares, naming the known ones,
    and :class:`broker.errors.ConfigError` when no loaded module configured the broker."""
    from broker.services import current_broker

    known = sorted(current_broker().queues)
    unknown = sorted(set(requested or ()) - set(known))
    if unknown:
        raise StartupRefused(f"refusing to start: unknown queue(s) {', '.join(unknown)}; "
                             f"the known queues are {', '.join(known)}")
    return [q for q in known if q in requested] if requested else known


def process_connections(settings: Settings, queues: Sequence[str], *, threads: int = 0,
                        ticks: int = 0) -> Connections:
    """Every connection one process may hold at once: a worker serving ``queues`` with
    ``threads`` worker threads (0: as many as its queues' limits), or, with no queues, the
    scheduler ticking on ``ticks`` threads. Connections opened for an instant at start or
    stop (a probe, the relay's wake-up at shutdown) are not counted."""
    limits = sum(settings.queue(name).max_workers for name in queues)
    jobs = min(threads, limits) if threads > 0 else limits
    runs_jobs = bool(queues)
    backend = (BACKEND_POOL_CONNECTIONS + BACKEND_LISTEN_CONNECTIONS) if runs_jobs else 0
    terms = (
        ("jobs", jobs),
        ("periodic ticks", ticks),
        ("relay", RELAY_CONNECTIONS),
        ("consumers", len(queues)),
        ("settler", 1 if runs_jobs else 0),
        ("heartbeat", 1 if runs_jobs else 0),
        ("broker sends", settings.broker_ack_connections),
        ("results", backend),
        ("rate limits", backend),
        ("receipt listeners", len(app.awaited_queues()) if runs_jobs else 0),
    )
    return Connections("a worker process" if runs_jobs else "the scheduler", terms)


def scheduler_connections(settings: Settings) -> Connections:
    """Every connection the scheduler process (``python -m periodic``) may hold at once."""
    return process_connections(settings, (), ticks=min(len(app.periodic_jobs()), SCHEDULER_TICK_THREADS))


def compute_budget(settings: Settings, queues: Sequence[str], *, threads: int = 0) -> Budget:
    terms = [(f"{name}.max_workers", settings.queue(name).max_workers) for name in queues]
    terms.append(("relay", RELAY_CONNECTIONS))
    return Budget(
        terms=tuple(terms),
        limit=settings.pool_max_size // 2,
        pool_max_size=settings.pool_max_size,
        process=process_connections(settings, queues, threads=threads),
    )


def check_budget(settings: Settings, queues: Sequence[str], *, threads: int = 0) -> Budget:
    """Return the budget of a process serving ``queues`` when it holds; raise
    :class:`BudgetError` naming every term.

    Also runs the start-up checks the loaded modules declared (``broker.app.startup_check``),
    which raise :class:`broker.errors.StartupRefused` naming the variables."""
    budget = compute_budget(settings, queues, threads=threads)
    if budget.total > budget.limit:
        raise BudgetError(
            "refusing to start: the connection budget is exceeded: "
            + budget.describe()
            + ". Lower a queue's STANDMEET_QUEUE_<QUEUE>_MAX_WORKERS or raise STANDMEET_POOL_MAX_SIZE."
        )
    app.run_startup_checks(settings)  # what the loaded modules declared
    warn_undeclared()  # a misspelt STANDMEET_ variable, named with the nearest declared one
    return budget


@dataclass(frozen=True)
class Fleet:
    """What ``run`` starts: its worker processes, the scheduler, and itself."""

    processes: int
    worker: Connections
    scheduler: Connections | None
    #: ``run``'s own (its ``/metrics`` reads the database on each scrape)
    supervisor: int = 0

    @property
    def beside_workers(self) -> int:
        return (self.scheduler.total if self.scheduler is not None else 0) + self.supervisor

    @property
    def total(self) -> int:
        return self.processes * self.worker.total + self.beside_workers

    def fitting_processes(self, free: int) -> int:
        """How many worker processes fit in ``free`` connections, beside the rest."""
        return max(0, (free - self.beside_workers) // max(1, self.worker.total))

    def describe(self) -> str:
        plural = "es" if self.processes != 1 else ""
        parts = [f"{self.processes} worker process{plural} × {self.worker.total}"]
        if self.scheduler is not None:
            parts.append(f"the scheduler {self.scheduler.total}")
        if self.supervisor:
            parts.append(f"run's metrics {self.supervisor}")
        return f"{' + '.join(parts)} = {self.total} connections"


@dataclass(frozen=True)
class ServerRoom:
    """The connections a server can give new clients now."""

    server: str
    max_connections: int
    superuser_reserved: int
    #: ``reserved_connections`` (Postgres 16 and later; 0 before)
    reserved: int
    #: ``STANDMEET_SERVER_CONNECTIONS_RESERVE``: left to web requests, operators, migrations
    reserve: int
    #: what other clients hold now, by application name (or user), most first
    others: tuple[tuple[str, int], ...]

    @property
    def held_by_others(self) -> int:
        return sum(n for _, n in self.others)

    @property
    def free(self) -> int:
        return self.max_connections - self.superuser_reserved - self.reserved - self.reserve - self.held_by_others

    def describe(self) -> str:
        parts = [f"max_connections {self.max_connections}",
                 f"superuser_reserved_connections {self.superuser_reserved}"]
        if self.reserved:
            parts.append(f"reserved_connections {self.reserved}")
        parts.append(f"STANDMEET_SERVER_CONNECTIONS_RESERVE {self.reserve}")
        parts.append(f"{self.held_by_others} held now by other clients{self._who()}")
        return " − ".join(parts) + f" = {self.free}"

    def _who(self) -> str:
        if not self.others:
            return ""
        named = [f"{who} {n}" for who, n in self.others[:NAMED_OTHER_CLIENTS]]
        rest = sum(n for _, n in self.others[NAMED_OTHER_CLIENTS:])
        if rest:
            named.append(f"{rest} more")
        return f" ({', '.join(named)})"


#: The server's limits, and the reserved connections of Postgres 16+ (absent before).
SERVER_LIMITS = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       coalesce(nullif(current_setting('reserved_connections', true), ''), '0')::int
"""
#: Client connections other than this one, by application name (or user). A session of
#: another user shows no backend type to a role without pg_read_all_stats: it counts
#: when it has a user (the server's own processes have none, and no slot of max_connections).
OTHER_CLIENTS = """
SELECT coalesce(nullif(application_name, ''), 'user ' || usename, 'another user') AS who, count(*)::int
FROM pg_stat_activity
WHERE pid <> pg_backend_pid()
  AND (backend_type = 'client backend' OR (backend_type IS NULL AND usesysid IS NOT NULL))
GROUP BY 1 ORDER BY 2 DESC, 1
"""


def server_room(url: str, settings: Settings) -> ServerRoom:
    """What the server at ``url`` can give new clients now (one short connection)."""
    from broker.pg.preflight import CONNECT_TIMEOUT_S, first_line, server_of

    where = server_of(url)
    try:
        with psycopg.connect(url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S,
                             application_name="standmeet-run") as conn:
            limits = conn.execute(SERVER_LIMITS).fetchone()
            others = conn.execute(OTHER_CLIENTS).fetchall()
    except psycopg.Error as exc:
        raise DatabaseUnavailable(f"cannot count the connections of the database at {where}: "
                                  f"{first_line(exc)}") from None
    assert limits is not None
    return ServerRoom(server=where, max_connections=limits[0], superuser_reserved=limits[1], reserved=limits[2],
                      reserve=settings.server_connections_reserve,
                      others=tuple((str(who), int(n)) for who, n in others))


def check_session_pool(fleet: Fleet, pool_size: int | None) -> str:
    """Through a session pooler every client connection holds one of the pooler's server
    connections for its life: a fleet that needs more waits in the pooler, heartbeats
    included, and live workers look dead. Refuse it (:class:`BudgetError`) when
    ``pool_size`` (STANDMEET_POOLER_POOL_SIZE) is known; say what to check otherwise."""
    if pool_size is None:
        return (f"{fleet.describe()}; through a pooler in session mode each holds one of its server connections: "
                "make sure its pool (PgBouncer's default_pool_size) has that many, or set "
                "STANDMEET_POOLER_POOL_SIZE to have it checked")
    if fleet.total <= pool_size:
        return f"{fleet.describe()}, of the {pool_size} server connections of the session pooler"
    fit = fleet.fitting_processes(pool_size)
    lower = (f"Lower --processes ({fit} fit)" if fit >= 1
             else "Not one worker process fits: lower --threads or a queue's STANDMEET_QUEUE_<QUEUE>_MAX_WORKERS")
    raise BudgetError(
        f"refusing to start: {fleet.describe()}, but through a pooler in session mode each holds one of its "
        f"server connections and it has {pool_size} (STANDMEET_POOLER_POOL_SIZE). {lower}, raise the pooler's "
        "default_pool_size (and STANDMEET_POOLER_POOL_SIZE), or use transaction mode."
    )


def check_server_room(fleet: Fleet, room: ServerRoom) -> None:
    """Raise :class:`BudgetError` (one line, every number, what to change) when ``fleet``
    needs more connections than ``room`` gives."""
    if fleet.total <= room.free:
        return
    fit = fleet.fitting_processes(room.free)
    lower = (f"Lower --processes ({fit} fit)" if fit >= 1
             else "Not one worker process fits: lower --threads or a queue's STANDMEET_QUEUE_<QUEUE>_MAX_WORKERS")
    raise BudgetError(
        f"refusing to start: {fleet.describe()}, but the server at {room.server} has {room.free} to give: "
        f"{room.describe()}. {lower}, lower STANDMEET_SERVER_CONNECTIONS_RESERVE, "
        "or raise the server's max_connections."
    )


def check_fleet(settings: Settings, url: str, fleet: Fleet) -> str:
    """Refuse (:class:`BudgetError`) a fleet the server at ``url`` cannot hold; what was
    checked, in one line. Through a pooler, the server's ``max_connections`` bounds the
    pooler's own connections, not its clients': that is said, not checked."""
    from broker.pg.pool import DIRECT, SESSION, topology_for

    topology = topology_for(url)
    if topology.mode == SESSION:
        return check_session_pool(fleet, settings.pooler_pool_size)
    if topology.mode != DIRECT:
        return (f"{fleet.describe()}; through a pooler in {topology.mode} mode the server's max_connections "
                "bounds the pooler's pool, not these clients: not checked against it")
    room = server_room(url, settings)
    check_server_room(fleet, room)
    return f"{fleet.describe()}, of the {room.free} the server at {room.server} can give: {room.describe()}"
