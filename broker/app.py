"""The registration API: how any module tells the runtime what it brings.

The runtime knows nothing of the application. A module (``actors`` is one; yours can be
another) declares, at import, through these few calls:

    from broker import app

    app.queue("reports", max_workers=2, time_limit_s=120)          # limits, and whether
    app.queue("thumbs", max_workers=4, time_limit_s=30, awaited=True)  # requests wait on it
    app.periodic("nightly-report", "reports.nightly", cron="0 3 * * *", timezone="Europe/Berlin")
    app.periodic("refresh", "reports.refresh", interval_s=900)
    app.command("report", "print the last report", setup=add_arguments, run=main)
    app.startup_check(refuse_bad_timings)                            # fn(settings) -> None
    app.settings(ReportSettings)   # its own settings, declared like broker.settings.Settings
    app.page("/reports", reports_page, title="Reports", templates=("reports", "templates"))
    app.dashboard_notice("exported", "The report was exported.")   # after a page's action
    app.gauges(read_report_gauges)  # fn(conn) -> metric families, read at each /metrics scrape
    app.migrations(package="reports", folder="migrations")  # its tables, versioned on their own

and its actors with ``@dramatiq.actor``, its topics and routes with
``broker.outbox.route``. Every entry point (``standmeet-jobs run MODULE…``,
``python -m broker.worker MODULE…``, ``dramatiq MODULE``, ``python -m periodic``) loads
the named modules and serves what they declared: their queues with their limits
(``STANDMEET_QUEUE_<NAME>_*`` override them), their periodic jobs, their commands, their
dashboard pages; ``standmeet-jobs migrate MODULE…`` applies their migrations after the
runtime's.
Declaring the same name twice with different values is an error, not a silent win.
"""

from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from broker.cron import Cron, parse_cron
from broker.errors import ConfigError


@dataclass(frozen=True)
class QueueSpec:
    """A queue's declared defaults: jobs at once per process, hard time limit, awaited."""

    name: str
    max_workers: int
    time_limit_s: float
    #: requests wait on it (receipts are sent when its jobs finish for good)
    awaited: bool = False


#: The longest interval of a periodic job (366 days): a rarer job is a cron one.
INTERVAL_MOST_S = 366 * 86400.0
#: The shortest interval of a periodic job: each period is a claimed row, and a scheduler
#: ticks four times a period; a job wanted more often is a loop inside one job.
INTERVAL_LEAST_S = 1.0


@dataclass(frozen=True)
class PeriodicJob:
    """Run ``actor`` once per period across all schedulers: every ``interval_s`` seconds,
    or at each fire time of ``cron`` (five fields) in ``timezone`` (see :mod:`broker.cron`)."""

    name: str
    actor: str
    interval_s: float | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)
    cron: str | None = None
    timezone: str = "UTC"
    schedule: Cron | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if (self.interval_s is None) == (self.cron is None):
            raise ConfigError(f"periodic job {self.name!r}: give interval_s or cron, one of them")
        try:  # every tick sends them: refused now, not at each tick
            if not isinstance(self.kwargs, dict) or not all(isinstance(key, str) for key in self.kwargs):
                raise TypeError("not a dict with text keys")
            json.dumps(self.kwargs, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            raise ConfigError(f"periodic job {self.name!r}: its kwargs are not JSON a message can carry "
                              f"({type(exc).__name__}: {str(exc)[:200]})") from None
        if self.interval_s is not None:
            if not INTERVAL_LEAST_S <= self.interval_s <= INTERVAL_MOST_S:
                raise ConfigError(f"periodic job {self.name!r}: interval_s must be at least {INTERVAL_LEAST_S:g} and at"
                                  f" most {INTERVAL_MOST_S:,.0f} (366 days; a rarer job is a cron one), not {self.interval_s!r}")
            if self.timezone != "UTC":
                raise ConfigError(f"periodic job {self.name!r}: a time zone applies to cron, not to interval_s")
            return
        try:
            parsed = parse_cron(str(self.cron), self.timezone)
        except ConfigError as exc:
            raise ConfigError(f"periodic job {self.name!r}: {exc}") from None
        object.__setattr__(self, "schedule", parsed)

    @property
    def every(self) -> str:
        """The schedule as people read it: ``every 900 s`` or ``0 3 * * * (Europe/Berlin)``."""
        if self.schedule is not None:
            return str(self.schedule)
        return f"every {self.interval_s:g} s"

    def period_start(self, now: datetime) -> datetime:
        """The start of the period ``now`` is in: for an interval, ``now`` floored to a
        multiple of it since the epoch; for cron, its latest fire time at or before ``now``.
        Schedulers only align their ticks with it: which period a tick claims is computed
        from the database's clock (``periodic.tick``)."""
        if self.schedule is not None:
            previous = self.schedule.previous(now)
            return previous if previous is not None else datetime.fromtimestamp(0, timezone.utc)
        assert self.interval_s is not None
        epoch = now.timestamp()
        start = epoch - (epoch % self.interval_s)
        return datetime.fromtimestamp(start, timezone.utc)

    def next_run(self, now: datetime) -> datetime | None:
        """When the next period starts after ``now`` (aware; in the job's zone for cron)."""
        if self.schedule is not None:
            following = self.schedule.next(now)
            return following.astimezone(self.schedule.tz) if following is not None else None
        assert self.interval_s is not None
        return self.period_start(now) + timedelta(seconds=self.interval_s)


@dataclass(frozen=True)
class Command:
    """A ``standmeet-jobs`` subcommand an application adds: ``run(args)`` returns the exit code."""

    name: str
    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


StartupCheck = Callable[[Any], None]
#: An application's database-derived gauges: ``read(conn)`` returns Prometheus metric
#: families (``prometheus_client.core.GaugeMetricFamily``…), read at each scrape.
GaugeReader = Callable[[Any], Iterable[Any]]


@dataclass(frozen=True)
class Page:
    """A dashboard route an application adds: ``handler(request)`` (a Starlette handler,
    ``async``) answers ``path`` (a Starlette path: ``/reports/{id:int}``) for ``methods``.
    A ``title`` lists it in the dashboard's navigation. ``templates`` is where its
    templates are, ``(package, folder)``, looked up after the dashboard's own (so they
    may extend ``base.html``). The dashboard answers its refusals and bad input as it
    does its own pages' (``broker.dashboard.pages.guarded``)."""

    path: str
    handler: Callable[[Any], Awaitable[Any]]
    title: str | None = None
    methods: tuple[str, ...] = ("GET",)
    templates: tuple[str, str] | None = None


class Registry:
    """What the loaded modules declared. One per process (:data:`REGISTRY`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.queues: dict[str, QueueSpec] = {}
        self.periodic: dict[str, PeriodicJob] = {}
        self.commands: dict[str, Command] = {}
        self.startup_checks: list[StartupCheck] = []
        #: the applications' dashboard routes, by "METHODS path"
        self.pages: dict[str, Page] = {}
        #: the applications' dashboard notices, by code (``?notice=CODE`` after an action)
        self.notices: dict[str, str] = {}
        #: the applications' gauge readers (see :func:`gauges`)
        self.gauge_readers: list[GaugeReader] = []
        #: the applications' settings declarations (``broker.settings.Declared`` subclasses)
        self.settings: list[Any] = []

    def _put(self, table: dict[str, Any], kind: str, name: str, value: Any) -> Any:
        with self._lock:
            existing = table.get(name)
            if existing is not None and existing != value:
                raise ConfigError(f"{kind} {name!r} is declared twice, differently: {existing} and {value}")
            table[name] = value
            return value


REGISTRY = Registry()


def queue(name: str, *, max_workers: int, time_limit_s: float, awaited: bool = False) -> QueueSpec:
    """Declare a queue's default limits (the environment may override them)."""
    if max_workers < 1 or not time_limit_s > 0:
        raise ConfigError(f"queue {name!r}: max_workers must be >= 1 and time_limit_s > 0")
    return REGISTRY._put(REGISTRY.queues, "queue", name, QueueSpec(name, max_workers, time_limit_s, awaited))


def periodic(name: str, actor: str, *, interval_s: float | None = None, cron: str | None = None,
             timezone: str = "UTC", kwargs: dict[str, Any] | None = None) -> PeriodicJob:
    """Declare a periodic job: ``actor`` enqueued once per ``interval_s`` period, or once at
    each fire time of ``cron`` in ``timezone`` (``cron="0 3 * * *", timezone="Europe/Berlin"``)."""
    job = PeriodicJob(name, actor, interval_s, kwargs or {}, cron=cron, timezone=timezone)
    return REGISTRY._put(REGISTRY.periodic, "periodic job", name, job)


def command(name: str, help: str, *, setup: Callable[[argparse.ArgumentParser], None],
            run: Callable[[argparse.Namespace], int]) -> Command:
    """Declare a ``standmeet-jobs NAME`` subcommand."""
    return REGISTRY._put(REGISTRY.commands, "command", name, Command(name, help, setup, run))


def startup_check(check: StartupCheck) -> StartupCheck:
    """Declare a check every process runs at start-up with its settings; it raises
    :class:`broker.errors.StartupRefused` (naming the variables) to refuse to start."""
    with REGISTRY._lock:
        if check not in REGISTRY.startup_checks:
            REGISTRY.startup_checks.append(check)
    return check


def page(path: str, handler: Callable[[Any], Awaitable[Any]], *, title: str | None = None,
         methods: tuple[str, ...] = ("GET",), templates: tuple[str, str] | None = None) -> Page:
    """Declare a dashboard route (a page, or with ``methods=("POST",)`` an action); see :class:`Page`."""
    if not path.startswith("/"):
        raise ConfigError(f"dashboard page {path!r}: a path starts with /")
    methods = tuple(m.upper() for m in methods)
    declared = Page(path, handler, title, methods, templates)
    return REGISTRY._put(REGISTRY.pages, "dashboard page", f"{','.join(methods)} {path}", declared)


def gauges(read: GaugeReader) -> GaugeReader:
    """Declare database-derived gauges: the ``/metrics`` that ``run`` and the dashboard
    serve call ``read(conn)`` at each scrape, after the runtime's own reads, in the same
    read-only transaction (its statement timeout applies), and serve the families it
    returns. A reader that fails is logged and left out of that scrape."""
    with REGISTRY._lock:
        if read not in REGISTRY.gauge_readers:
            REGISTRY.gauge_readers.append(read)
    return read


def dashboard_notice(code: str, text: str) -> str:
    """Declare what the dashboard says after an action that redirects with ``notice=code``."""
    return REGISTRY._put(REGISTRY.notices, "dashboard notice", code, text)


def dashboard_pages() -> list[Page]:
    """The dashboard routes the loaded applications declared, in the order declared."""
    return list(REGISTRY.pages.values())


def settings(declaration: Any) -> Any:
    """Declare an application's settings: a ``broker.settings.Declared`` subclass. Its
    variables then count as declared, and every process validates them at start-up."""
    with REGISTRY._lock:
        if declaration not in REGISTRY.settings:
            REGISTRY.settings.append(declaration)
    return declaration


def setting(name: str) -> Any:
    """The current value of an application's setting ``name`` (its declaration's
    ``current()``, built once per process), for the runtime's parts that an application
    parameterises; a name no loaded application declares is a ConfigError."""
    for declaration in list(REGISTRY.settings):
        if name in declaration.model_fields:
            return getattr(declaration.current(), name)
    raise ConfigError(f"no loaded application declares the setting {name!r}")


def queue_spec(name: str) -> QueueSpec | None:
    return REGISTRY.queues.get(name)


def awaited_queues() -> list[str]:
    """The queues requests wait on, as declared."""
    return sorted(name for name, spec in REGISTRY.queues.items() if spec.awaited)


def periodic_jobs() -> list[PeriodicJob]:
    return list(REGISTRY.periodic.values())


def run_startup_checks(settings: Any) -> None:
    """Validate the applications' settings, then run the declared checks."""
    for declaration in list(REGISTRY.settings):
        declaration.current()
    for check in list(REGISTRY.startup_checks):
        check(settings)


# The runtime's own queue and periodic jobs (their actors are in broker.maintenance).
queue("maintenance", max_workers=1, time_limit_s=600.0)
#: The runtime's own queues (declared above, before any application module loads).
RUNTIME_QUEUES = frozenset(REGISTRY.queues)
periodic("prune-messages", "maintenance.prune_messages", interval_s=3600)
periodic("rescue", "maintenance.rescue", interval_s=30)
periodic("prune-outbox", "maintenance.prune_outbox", interval_s=3600)
periodic("prune-expired", "maintenance.prune_expired", interval_s=600)


# An application's own tables: its migrations, numbered and recorded on their own.
@dataclass(frozen=True)
class MigrationFolder:
    """``<package>/<folder>/NNNN_name.sql``: a package's migrations, versioned on their own
    and applied by ``standmeet-jobs migrate`` after the runtime's (``broker.pg.migrate``)."""

    package: str
    folder: str = "migrations"


_MIGRATION_FOLDERS: dict[str, MigrationFolder] = {}


def migrations(*, package: str, folder: str = "migrations") -> MigrationFolder:
    """Declare that ``package`` brings the migrations in its ``folder``: ``migrate`` applies
    them (once each, in their order) after the runtime's and those declared before."""
    if not all(part.isidentifier() for part in package.split(".")) or package.split(".")[0] == "broker":
        raise ConfigError(f"migrations: {package!r} is not the name of an application's package")
    parts = folder.replace("\\", "/").split("/")
    if folder.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise ConfigError(f"migrations of {package!r}: folder {folder!r} must be a plain relative path inside it")
    return REGISTRY._put(_MIGRATION_FOLDERS, "migrations of package", package, MigrationFolder(package, folder))


def migration_folders() -> list[MigrationFolder]:
    """The declared migration folders, in the order they were declared."""
    return list(_MIGRATION_FOLDERS.values())
