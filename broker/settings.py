"""Settings: the only module that reads the environment.

Each setting is declared once, below: its name, type, default, bounds and a one-line
description, as a pydantic-settings field. The variable is the name upper-cased with the
prefix ``STANDMEET_`` (plus the conventional ``DATABASE_URL``). Parsing, validation, the
README's table (``scripts/settings_table.py``) and the tests' environment all derive from
these declarations. A malformed or out-of-range value raises
:class:`broker.errors.ConfigError`: one line naming the variable and what was wrong.

This module holds the runtime's settings only. An application declares its own the same
way (a subclass of :class:`Declared`) and registers the class with ``broker.app.settings``,
so that its variables count as declared and ``standmeet-jobs check`` validates them.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, get_args

import platformdirs
from pydantic import Field, ValidationError, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    SettingsError,
)

from broker import app
from broker.errors import ConfigError

logger = logging.getLogger(f"standmeet.{__name__}")

PREFIX = "STANDMEET_"
#: A queue no module declares limits for: one job at a time, Dramatiq's default time limit.
DEFAULT_OTHER_QUEUE_MAX_WORKERS = 1
DEFAULT_OTHER_QUEUE_TIME_LIMIT_S = 600.0
#: The per-queue variables, for any queue: STANDMEET_QUEUE_<NAME>_<FIELD>, where <NAME> is
#: the queue's name upper-cased with every other character than A-Z and 0-9 as ``_``.
QUEUE_VARIABLE = re.compile(r"^STANDMEET_QUEUE_(?P<name>[A-Z0-9_]+?)_(?P<field>MAX_WORKERS|TIME_LIMIT_S|POLL_S|PREFETCH)$")
#: Fallback poll of an idle consumer, in case a notification was missed.
DEFAULT_POLL_S = 1.0
#: Connections the relay takes from the application pool in each process.
RELAY_CONNECTIONS = 1
#: How logs are written: "text" (one line each) or "json" (one object a line, for shippers).
LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
#: What stands between the processes and Postgres (``auto``: found out at start-up).
PoolerMode = Literal["auto", "direct", "session", "transaction"]
#: When the dashboard's cookie is marked Secure (``auto``: when the request came over https).
SecureCookieMode = Literal["auto", "on", "off"]
#: Whether statements are prepared on the server (``auto``: only on a direct connection).
PreparedMode = Literal["auto", "on", "off"]
#: Where the embedded Postgres keeps its data when no DATABASE_URL is given: one folder
#: per user (platformdirs' user data folder), whatever the working directory.
DEFAULT_EMBEDDED_DIR = str(Path(platformdirs.user_data_dir("standmeet-jobs", appauthor=False)) / "pgdata")
#: Upper bounds of the settings that have no natural one: finite, so that no value an
#: operator can type overflows a timer, an interval or an allocation later.
WEEK_MS = 7 * 24 * 3_600_000
MONTH_S = 30 * 24 * 3_600
GIB = 1024 ** 3
#: The most any one queue's variables may say: jobs at once per process, and a time limit.
QUEUE_MAX_WORKERS_MOST = 10_000
QUEUE_TIME_LIMIT_MOST_S = 7 * 24 * 3_600.0
MIB = 1024 ** 2
#: Name of the database created on the embedded server for the application.
DEFAULT_EMBEDDED_DATABASE = "standmeet"

#: The environment ``from_env`` reads while it builds one object (None: ``os.environ``).
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("standmeet_environ", default=None)

D = TypeVar("D", bound="Declared")


def shown(default: str) -> dict[str, Any]:
    """How the README shows a default that is not a plain value."""
    return {"shown": default}


class _MappingSource(EnvSettingsSource):
    """pydantic-settings' environment source, over the mapping ``from_env`` was given."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        environ = _ENVIRON.get()
        environ = os.environ if environ is None else environ
        # blank is unset, as it always was here; names are matched case-insensitively
        return {(k if self.case_sensitive else k.lower()): v for k, v in environ.items() if v.strip()}


class Declared(BaseSettings):
    """Settings declared once each; built by :meth:`from_env`, changed by :func:`replace`."""

    model_config = SettingsConfigDict(
        env_prefix=PREFIX, env_ignore_empty=True, frozen=True, allow_inf_nan=False,
        extra="ignore", populate_by_name=True, validate_default=False,
    )

    #: per class: the object this process built (see :meth:`current`)
    _current: ClassVar[dict[type, Any]] = {}
    _current_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return init_settings, _MappingSource(settings_cls)

    @classmethod
    def from_env(cls: type[D], environ: Mapping[str, str] | None = None, **given: Any) -> D:
        """The settings ``environ`` (default: the process environment) gives; a bad value
        raises :class:`ConfigError` naming its variable."""
        token = _ENVIRON.set(environ)
        try:
            return cls(**given)
        except ValidationError as exc:
            raise ConfigError(describe(cls, exc)) from None
        except SettingsError as exc:  # a value pydantic-settings could not decode
            raise ConfigError(str(exc).splitlines()[0]) from None
        finally:
            _ENVIRON.reset(token)

    @classmethod
    def variables(cls) -> dict[str, str]:
        """Each declared variable and its field's name."""
        return {variable(name, info): name for name, info in cls.model_fields.items()
                if (info.json_schema_extra or {}) != {"env": False}}

    @classmethod
    def current(cls: type[D]) -> D:
        """This process's settings of this class: built from the environment once, cached."""
        with cls._current_lock:
            found = cls._current.get(cls)
            if found is None:
                found = cls._current[cls] = cls.from_env()
            return found

    @classmethod
    def use(cls: type[D], settings: D | None) -> None:
        """Make ``settings`` this process's (None: rebuilt from the environment when next used)."""
        with cls._current_lock:
            if settings is None:
                cls._current.pop(cls, None)
            else:
                cls._current[cls] = settings


def variable(name: str, info: FieldInfo) -> str:
    """The environment variable of a field."""
    alias = info.validation_alias
    return alias if isinstance(alias, str) else PREFIX + name.upper()


def replace(settings: D, **overrides: Any) -> D:
    """A copy of ``settings`` with ``overrides``, validated like the environment's values."""
    cls = type(settings)
    values = {name: getattr(settings, name) for name in cls.model_fields}
    try:
        return cls.model_validate({**values, **overrides})
    except ValidationError as exc:
        raise ConfigError(describe(cls, exc)) from None


def describe(cls: type[Declared], exc: ValidationError) -> str:
    """The first error of ``exc`` as one line naming the variable."""
    error = exc.errors()[0]
    field = str(error["loc"][0]) if error["loc"] else ""
    info = cls.model_fields.get(field)
    name = variable(field, info) if info is not None else (field or cls.__name__)
    raw = error.get("input")
    ctx = error.get("ctx") or {}
    kind = error["type"]
    if kind in ("int_parsing", "int_from_float", "int_type"):
        return f"{name}={raw!r} is not a whole number"
    if kind in ("float_parsing", "float_type"):
        return f"{name}={raw!r} is not a number"
    if kind == "finite_number":
        return f"{name}={raw!r} is not a finite number"
    if kind == "greater_than_equal":
        return f"{name}={raw} is below its minimum of {_number(ctx['ge'])}"
    if kind == "greater_than":
        return f"{name}={raw} must be above {ctx['gt']}"
    if kind == "less_than_equal":
        return f"{name}={raw} is above its maximum of {_number(ctx['le'])}"
    if kind == "bool_parsing":
        return f"{name}={raw!r} is not a yes/no value (use 1 or 0)"
    if kind == "literal_error":
        return f"{name}={raw!r} is not one of {ctx.get('expected', '')}".replace("'", "")
    return f"{name}={raw!r}: {error['msg']}".replace("\n", " ")


def _number(bound: Any) -> str:
    """A bound as people write it: 86400, not 86400.0."""
    return f"{bound:g}" if isinstance(bound, float) else str(bound)


@dataclass(frozen=True)
class QueueSettings:
    """One queue's limits: at most ``max_workers`` jobs at once per process."""

    name: str
    max_workers: int
    time_limit_s: float
    poll_s: float = DEFAULT_POLL_S
    #: claimed beyond the running ones, to start the moment one finishes (-1: as many as
    #: finish within PREFETCH_HORIZON_S, between half the limit and ``prefetch_ceiling``)
    prefetch_setting: int = -1

    @property
    def prefetch(self) -> int:
        """The prefetch a queue starts with: the setting, or by default half the limit."""
        return self.prefetch_floor if self.prefetch_setting < 0 else self.prefetch_setting

    @property
    def adaptive_prefetch(self) -> bool:
        """By default the prefetch follows how fast the queue's jobs finish."""
        return self.prefetch_setting < 0

    @property
    def prefetch_floor(self) -> int:
        return max(1, self.max_workers // 2)

    @property
    def prefetch_ceiling(self) -> int:
        """The most a queue prefetches by default, however fast its jobs end."""
        return max(2 * self.max_workers, PREFETCH_MOST)

    @property
    def awaited(self) -> bool:
        spec = app.queue_spec(self.name)
        return spec is not None and spec.awaited

    @property
    def time_limit_ms(self) -> int:
        return int(self.time_limit_s * 1000)


#: A queue's default prefetch holds about as many messages as its running jobs finish in
#: this long: short jobs start back to back without a claim between them, while a process
#: never holds long jobs that another one could start sooner.
PREFETCH_HORIZON_S = 0.05

#: The default prefetch of a queue of short jobs stops here (or at twice its limit, if
#: that is more): claiming up to half of it at a time keeps every slot busy while the
#: next claim is on its way, at thousands of jobs a second; shutdown gives back at most
#: this many.
PREFETCH_MOST = 128

#: A queue with the default prefetch gives back what its buffer would hold longer than
#: this (by its mean run time, or because no running slot has freed for this long), down
#: to half its limit: a queue whose jobs turned slow, or all hang, keeps no more claims
#: than that. Far above the prefetch's horizon, so a short stall gives nothing back.
PREFETCH_HOLD_S = 1.0


def queue_variable_name(queue: str) -> str:
    """The <NAME> part of a queue's variables: upper-cased, non-alphanumerics as ``_``."""
    return re.sub(r"[^A-Z0-9]", "_", queue.upper())


def _queue_settings(env: Mapping[str, str], name: str, workers: int, limit_s: float) -> QueueSettings:
    prefix = f"STANDMEET_QUEUE_{queue_variable_name(name)}_"
    return QueueSettings(
        name=name,
        max_workers=_int(env, prefix + "MAX_WORKERS", workers, minimum=1, maximum=QUEUE_MAX_WORKERS_MOST),
        time_limit_s=_float(env, prefix + "TIME_LIMIT_S", limit_s, minimum=0.001, maximum=QUEUE_TIME_LIMIT_MOST_S),
        poll_s=_float(env, prefix + "POLL_S", DEFAULT_POLL_S, minimum=0.01, maximum=3_600),
        prefetch_setting=_int(env, prefix + "PREFETCH", -1, minimum=-1, maximum=100_000),
    )



class Settings(Declared):
    """The runtime's settings, resolved once. Build with :meth:`from_env`."""

    database_url: str | None = Field(
        None, validation_alias="DATABASE_URL", json_schema_extra=shown("(embedded)"),
        description="the Postgres server to use; unset means the embedded one")
    embedded_dir: Path = Field(
        Path(DEFAULT_EMBEDDED_DIR), json_schema_extra=shown("user data folder + `/pgdata`"),
        description="data folder of the embedded server (platformdirs' user data folder, the same from any directory)")
    pool_max_size: int = Field(
        40, ge=2, le=10_000, description="the application's psycopg 3 pool; half is kept for web requests")
    broker_ack_connections: int = Field(
        4, ge=1, le=1_000, description="the broker's pool for sends, heartbeats and rescue "
        "(consumers and the settler have their own connection each)")
    unknown_actor_delay_s: float = Field(
        10.0, ge=0.01, le=86_400, description="a message for an actor this process lacks (a rolling deploy) "
        "is given back this much later")
    unknown_actor_max_claims: int = Field(
        30, ge=1, le=100_000, description="such a message is rejected after this many claims (about 5 minutes), "
        "the reason on the job")
    worker_shutdown_timeout_s: float = Field(
        20.0, ge=0, le=86_400, description="how long `run` lets running jobs finish on SIGTERM")
    max_retries: int = Field(20, ge=0, le=100_000, description="retries of a failed job (actors may override)")
    min_backoff_ms: int = Field(5_000, ge=0, le=WEEK_MS, description="retry back-off, shortest (at most the longest)")
    max_backoff_ms: int = Field(3_600_000, ge=0, le=WEEK_MS, description="retry back-off, longest")
    heartbeat_s: float = Field(5.0, ge=0.05, le=3_600, description="how often a worker process records it is alive")
    rescue_after_s: float = Field(
        20.0, ge=0.1, le=86_400, description="silence after which a worker is dead and its jobs are requeued; "
        "at least twice the heartbeat; each process records its own, and is judged by the longer of its "
        "own and its judge's")
    max_crashes: int = Field(3, ge=0, le=1_000, description="a job that killed its worker more often is rejected, with the reason")
    retention_days: float = Field(7.0, ge=0, le=36_500, description="finished messages kept")
    prune_batch: int = Field(5_000, ge=1, le=1_000_000, description="finished messages pruned per batch")
    history_retention_days: float = Field(
        14.0, ge=0, le=3_650, description="the per-minute history of each queue and actor (throughput, "
        "failures, wait and run times), every job's attempts and the periodic jobs' claimed periods (each "
        "job's latest kept) are kept this long")
    outbox_max_payload_bytes: int = Field(64 * 1024, ge=2, le=GIB, description="largest event payload `emit` accepts")
    relay_batch: int = Field(1000, ge=1, le=100_000, description="outbox rows per relay pass (one transaction)")
    relay_poll_s: float = Field(1.0, ge=0.01, le=3_600, description="the relay's fallback poll")
    outbox_retention_hours: float = Field(24.0, ge=0, le=876_000, description="relayed outbox rows kept")
    max_waiters: int = Field(64, ge=1, le=100_000, description="waiters per receipt channel per process")
    receipt_wait_s: float = Field(2.0, ge=0, le=3_600, description="how long a write waits for its receipts by default")
    log_format: LogFormat = Field(
        "text", description="`text`, or `json`: one object a line for log shippers (`--log-format` says the same)")
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="where `run` serves `/metrics` for all its processes; "
        "unset: no metrics are served")
    metrics_host: str = Field("127.0.0.1", description="the address `/metrics` is served on")
    dashboard_user: str = Field("admin", description="HTTP basic-auth user of the dashboard")
    dashboard_password: str | None = Field(
        None, repr=False, description="HTTP basic auth for every dashboard request; "
        "required to listen beyond loopback")
    dashboard_hide_args: bool = Field(
        False, description="`1`: the dashboard never shows job arguments, nor the payloads an application's "
        "pages show, nor searches them")
    dashboard_allowed_hosts: str = Field(
        "", description="host names the dashboard answers to besides the address it is bound to "
        "(comma-separated, e.g. a reverse proxy's public name); any other `Host` is refused")
    dashboard_secure_cookie: SecureCookieMode = Field(
        "auto", description="the dashboard's cookie is marked `Secure`: `auto` when the request came "
        "over https (behind a proxy, as its trusted `X-Forwarded-Proto` says), `on` always, `off` never")
    message_max_bytes: int = Field(
        MIB, ge=1024, le=GIB, json_schema_extra=shown("`1048576` (1 MiB)"),
        description="largest encoded message a send, `enqueue` or the relay accepts; a larger row "
        "already in the table is rejected when claimed, with the reason")
    max_runs_without_outcome: int = Field(
        5, ge=1, le=1_000, description="a message whose runs ended this many times with no outcome "
        "(its retry logic itself failed) is rejected with the reason instead of running again")
    pooler: PoolerMode = Field(
        "auto", description="what stands between the processes and Postgres: `auto` (found out at start-up), "
        "`direct`, `session` or `transaction` (PgBouncer's pool modes); through a transaction pooler nothing "
        "relies on session state, LISTEN needs `STANDMEET_LISTEN_DATABASE_URL`, and statements are not prepared")
    prepared_statements: PreparedMode = Field(
        "auto", description="`auto`: statements are prepared only on a direct or session-pooled connection; "
        "`on`: also through a transaction pooler that tracks them (PgBouncer 1.21+ `max_prepared_statements`); "
        "`off`: never")
    listen_database_url: str | None = Field(
        None, json_schema_extra=shown("(the main URL, unless it is transaction-pooled)"),
        description="a connection that can LISTEN (direct or session-pooled), for wake-ups and receipts "
        "when `DATABASE_URL` goes through a transaction pooler; unset there, wake-ups poll")
    unlistened_poll_s: float = Field(
        0.05, ge=0.01, le=5.0, description="with no connection that can LISTEN, how often idle consumers, "
        "the relay and receipt waiters look for work")
    tcp_user_timeout_ms: int = Field(
        5_000, ge=0, le=3_600_000, description="a connection whose sent data stays unacknowledged this long is dead "
        "(libpq `tcp_user_timeout`; keepalives cover idle ones): a cut-off host finds out in seconds, "
        "not the kernel's ~15 minutes; `0`: the kernel's default")
    pooler_pool_size: int | None = Field(
        None, ge=1, le=1_000_000, description="the server connections a session pooler gives this database and user "
        "(PgBouncer's `default_pool_size`): in session mode each connection of a process holds one for its "
        "life, and `run` refuses processes that need more; unset: not checked, said at start-up")
    server_connections_reserve: int = Field(
        10, ge=0, le=1_000_000, description="connections of the server's `max_connections` that `run` leaves to others "
        "(web requests, operators, migrations) when it checks `--processes`")
    outbox_unrouted_max_age_s: float = Field(
        300.0, ge=0, le=MONTH_S, description="an outbox event that no live process routes for this long fails "
        "`status --check`; one whose emitter routed it to actors no process has known all of for this long "
        "(running, or stopped within it) is then relayed to the routes known, with a warning")
    queue_unserved_max_age_s: float = Field(
        60.0, ge=0, le=MONTH_S, description="due work of a queue that no live worker serves, this old, fails "
        "`status --check` and shows as \"no worker\"")
    #: the STANDMEET_QUEUE_* variables, for queues declared later by any module
    queue_env: Mapping[str, str] = Field(default_factory=dict, json_schema_extra={"env": False})

    @field_validator("database_url", mode="before")
    @classmethod
    def _database_url(cls, raw: Any) -> str | None:
        return _database_url({"DATABASE_URL": str(raw) if raw is not None else ""}, "DATABASE_URL")

    @field_validator("listen_database_url", mode="before")
    @classmethod
    def _listen_url(cls, raw: Any) -> str | None:
        name = PREFIX + "LISTEN_DATABASE_URL"
        return _database_url({name: str(raw) if raw is not None else ""}, name)

    @field_validator("pooler", "prepared_statements", "dashboard_secure_cookie", mode="before")
    @classmethod
    def _lower_choice(cls, raw: Any) -> Any:
        return raw.strip().lower() if isinstance(raw, str) else raw

    @field_validator("embedded_dir", mode="after")
    @classmethod
    def _expand(cls, path: Path) -> Path:
        return path.expanduser()

    @field_validator("log_format", mode="before")
    @classmethod
    def _lower(cls, raw: Any) -> Any:
        return raw.strip().lower() if isinstance(raw, str) else raw

    @field_validator("metrics_host", "dashboard_user", mode="after")
    @classmethod
    def _strip(cls, raw: str) -> str:
        return raw.strip()

    @model_validator(mode="after")
    def _rules(self) -> Settings:
        if self.rescue_after_s < 2 * self.heartbeat_s:
            raise ConfigError(
                f"STANDMEET_RESCUE_AFTER_S={self.rescue_after_s:g} must be at least twice "
                f"STANDMEET_HEARTBEAT_S={self.heartbeat_s:g}: a live worker would be rescued "
                "(its jobs run twice at once) after one late heartbeat"
            )
        if self.min_backoff_ms > self.max_backoff_ms:
            raise ConfigError(
                f"STANDMEET_MIN_BACKOFF_MS={self.min_backoff_ms} is above "
                f"STANDMEET_MAX_BACKOFF_MS={self.max_backoff_ms}"
            )
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **given: Any) -> Settings:
        env = os.environ if environ is None else environ
        queue_env = {k: v for k, v in env.items() if QUEUE_VARIABLE.match(k)}
        for key in queue_env:  # malformed values of any queue fail now, naming the variable
            match = QUEUE_VARIABLE.match(key)
            assert match is not None
            _queue_settings(queue_env, match["name"].lower(), 1, 1.0)
        return super().from_env(environ, queue_env=queue_env, **given)

    def queue(self, name: str) -> QueueSettings:
        """A queue's limits: what its module declared (``broker.app.queue``), or the
        documented defaults of any other queue, each overridable by
        STANDMEET_QUEUE_<NAME>_MAX_WORKERS / _TIME_LIMIT_S / _POLL_S / _PREFETCH."""
        spec = app.queue_spec(name)
        if spec is not None:
            return _queue_settings(self.queue_env, name, spec.max_workers, spec.time_limit_s)
        return _queue_settings(self.queue_env, name, DEFAULT_OTHER_QUEUE_MAX_WORKERS,
                               DEFAULT_OTHER_QUEUE_TIME_LIMIT_S)

    @property
    def queues(self) -> dict[str, QueueSettings]:
        """Every declared queue's limits."""
        return {name: self.queue(name) for name in sorted(app.REGISTRY.queues)}

    @property
    def step_down_after_s(self) -> float:
        """A worker that cannot confirm its heartbeat for this long (half the rescue window)
        stops claiming and interrupts its running jobs, before anyone may rescue them."""
        return self.rescue_after_s / 2


#: The per-queue variables as the README shows them: (suffix, default, bounds, meaning); the
#: bounds are those ``_queue_settings`` checks.
QUEUE_ROWS: tuple[tuple[str, str, str, str], ...] = (
    ("MAX_WORKERS", "as its module declares; `1` for any other queue", f"1 – {QUEUE_MAX_WORKERS_MOST}",
     "jobs of that queue running at once, per process (`<NAME>`: the queue's name upper-cased, "
     "other characters than letters and digits as `_`)"),
    ("TIME_LIMIT_S", "as its module declares; `600` for any other queue", f"0.001 – {QUEUE_TIME_LIMIT_MOST_S:g}", "the queue's default hard time limit"),
    ("POLL_S", f"`{DEFAULT_POLL_S:g}`", "0.01 – 3600", "fallback poll of an idle consumer (notifications do the real waking)"),
    ("PREFETCH", f"as many as the queue's jobs finish in {PREFETCH_HORIZON_S * 1000:g} ms, between half the limit"
                 f" (at least 1) and {PREFETCH_MOST} (twice the limit, if more)", "-1 – 100000 (-1: the default)",
     "messages claimed beyond the running ones, to start the moment one finishes"),
)


def declarations() -> list[type[Declared]]:
    """The runtime's declaration, then each registered application's."""
    return [Settings, *app.REGISTRY.settings]


def declared_variables() -> dict[str, str]:
    """Every declared variable (runtime and registered applications), to its field."""
    names: dict[str, str] = {}
    for cls in declarations():
        names.update(cls.variables())
    return names


#: Variables whose value is not repeated in a warning (nor that of a misspelling of one).
SECRET_WORDS = re.compile(r"PASS|PWD|KEY|SECRET|TOKEN", re.IGNORECASE)


def undeclared(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line for each ``STANDMEET_*`` variable no declaration has, with the nearest one."""
    env = os.environ if environ is None else environ
    known = sorted(declared_variables())
    short = {name.removeprefix(PREFIX): name for name in known}
    lines = []
    for key in sorted(env):
        if not key.startswith(PREFIX) or key in known or QUEUE_VARIABLE.match(key):
            continue
        near = difflib.get_close_matches(key.removeprefix(PREFIX), list(short), n=1, cutoff=0.6)
        nearest = short[near[0]] if near else ""
        hint = f"; did you mean {nearest}?" if near else " (no declared variable is close)"
        value = "***" if SECRET_WORDS.search(key) or SECRET_WORDS.search(nearest) else env[key]
        lines.append(f"{key}={value} is not a setting{hint}")
    return lines


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_undeclared(environ: Mapping[str, str] | None = None) -> list[str]:
    """Log each undeclared variable once per process; every line, for printing."""
    lines = undeclared(environ)
    with _warned_lock:
        for line in lines:
            if line not in _warned:
                _warned.add(line)
                logger.warning("%s", line)
    return lines


def markdown_table(cls: type[Declared]) -> Iterator[str]:
    """The rows of the README's table for one declaration."""
    for name, info in cls.model_fields.items():
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        if extra.get("env") is False:
            continue
        if "shown" in extra:
            default = str(extra["shown"])
        elif info.default is None:
            default = "–"
        elif isinstance(info.default, bool):
            default = f"`{int(info.default)}`"
        elif isinstance(info.default, float):
            default = f"`{info.default:g}`"
        else:
            default = f"`{info.default}`"
        yield f"| `{variable(name, info)}` | {default} | {bounds(info)} | {info.description or ''} |"


def bounds(info: FieldInfo) -> str:
    """A field's declared bounds, as the README shows them (``≥ 1``, ``1 – 65535``)."""
    low = high = None
    for item in info.metadata:
        low = getattr(item, "ge", low)
        low = f"> {item.gt}" if getattr(item, "gt", None) is not None else low
        high = getattr(item, "le", high)
    annotation = info.annotation
    if annotation is bool:
        return "`0` / `1`"
    if annotation is not None and getattr(annotation, "__origin__", None) is Literal:
        return " / ".join(f"`{choice}`" for choice in annotation.__args__)
    if low is not None and high is not None:
        return f"{low} – {high}"
    if low is not None:
        return str(low) if str(low).startswith(">") else f"≥ {low}"
    return ""


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int, maximum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} is below its minimum of {minimum}")
    if value > maximum:
        raise ConfigError(f"{name}={value} is above its maximum of {maximum}")
    return value


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float, maximum: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number")
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} is below its minimum of {minimum}")
    if value > maximum:
        raise ConfigError(f"{name}={raw!r} is above its maximum of {maximum:g}")
    return value


def masked_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (URL or conninfo form), for logs."""
    import re

    url = re.sub(r"^([a-z]+://[^:/@]*:)[^/@][^/]*@", r"\1***@", url)
    return re.sub(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", r"\1***", url)


def _database_url(env: Mapping[str, str], name: str) -> str | None:
    """A libpq URL or conninfo string, checked for form (not for reachability)."""
    raw = (env.get(name) or "").strip()
    if not raw:
        return None
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(raw)
    except Exception as exc:  # psycopg.ProgrammingError, with libpq's reason
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].replace(raw, masked_url(raw))
        raise ConfigError(f"{name} is not a valid Postgres URL or conninfo string: {reason}") from None
    for port in str(params.get("port") or "").split(","):
        if port and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"{name} has port {port!r}, not a number from 1 to 65535")
    return raw
