"""Settings: the only module that reads the environment.

Every option has a named default below and one environment variable, prefixed
``STANDMEET_`` (plus the conventional ``DATABASE_URL``). A malformed value raises
:class:`broker.errors.ConfigError` naming the variable and what was wrong, at start-up.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

import platformdirs

from broker import app
from broker.errors import ConfigError

#: A queue no module declares limits for: one job at a time, Dramatiq's default time limit.
DEFAULT_OTHER_QUEUE_MAX_WORKERS = 1
DEFAULT_OTHER_QUEUE_TIME_LIMIT_S = 600.0
#: The per-queue variables, for any queue: STANDMEET_QUEUE_<NAME>_<FIELD>, where <NAME> is
#: the queue's name upper-cased with every other character than A-Z and 0-9 as ``_``.
QUEUE_VARIABLE = re.compile(r"^STANDMEET_QUEUE_(?P<name>[A-Z0-9_]+?)_(?P<field>MAX_WORKERS|TIME_LIMIT_S|POLL_S|PREFETCH)$")
#: A message for an actor this process does not know (a rolling deploy) is given back this
#: much later, and rejected with the reason after this many claims (about 5 minutes).
DEFAULT_UNKNOWN_ACTOR_DELAY_S = 10.0
DEFAULT_UNKNOWN_ACTOR_MAX_CLAIMS = 30
#: Connections of the application pool (psycopg 3); half is reserved for requests.
DEFAULT_POOL_MAX_SIZE = 40
#: Connections the relay takes from the application pool in each process.
RELAY_CONNECTIONS = 1
#: Connections of the broker's pool for sends, heartbeats and rescue (beside one per
#: consumer and the settler's, which are not pooled).
DEFAULT_BROKER_ACK_CONNECTIONS = 4
#: How long a worker waits for running jobs on SIGTERM before cancelling them.
DEFAULT_WORKER_SHUTDOWN_TIMEOUT_S = 20.0
#: Fallback poll of an idle consumer, in case a notification was missed.
DEFAULT_POLL_S = 1.0
#: Dramatiq's retry policy, applied to every actor unless it says otherwise.
DEFAULT_MAX_RETRIES = 20
DEFAULT_MIN_BACKOFF_MS = 5_000
DEFAULT_MAX_BACKOFF_MS = 3_600_000
#: How often a worker process proves it is alive, and after how long silent it is dead.
DEFAULT_HEARTBEAT_S = 5.0
DEFAULT_RESCUE_AFTER_S = 20.0
#: A message whose worker died more times than this is rejected instead of requeued.
DEFAULT_MAX_CRASHES = 3
#: Finished (done or rejected) messages are pruned after this many days, in batches.
DEFAULT_RETENTION_DAYS = 7.0
DEFAULT_PRUNE_BATCH = 5_000
#: Largest outbox payload (JSON, bytes) that emit accepts.
DEFAULT_OUTBOX_MAX_PAYLOAD_BYTES = 64 * 1024
#: Rows one relay pass (one transaction) claims at most.
DEFAULT_RELAY_BATCH = 200
#: The relay's fallback poll, in case a notification was missed.
DEFAULT_RELAY_POLL_S = 1.0
#: Relayed outbox rows are pruned after this many hours.
DEFAULT_OUTBOX_RETENTION_HOURS = 24.0
#: Waiters a receipt channel holds at most in one process.
DEFAULT_MAX_WAITERS = 64
#: How long a write waits for its receipts by default.
DEFAULT_RECEIPT_WAIT_S = 2.0
#: Mail (notify queue): the SMTP server and the sender.
DEFAULT_SMTP_HOST = "localhost"
DEFAULT_SMTP_PORT = 25
DEFAULT_SMTP_FROM = "standmeet@localhost"
#: SMTP's network timeout; shorter than the notify queue's 30 s job limit.
DEFAULT_SMTP_TIMEOUT_S = 10.0
#: The search index: "postgres" (full-text, in the application's database) or "meilisearch".
SEARCH_BACKENDS = ("postgres", "meilisearch")
DEFAULT_MEILI_URL = "http://127.0.0.1:7700"
DEFAULT_MEILI_INDEX = "documents"
#: The webhook endpoint lease outlives the webhook job limit (15 s), which outlives
#: the HTTP deadline: a crashed worker's lease expires by itself, and a slow
#: endpoint gives a clear timeout, not a killed job.
DEFAULT_WEBHOOK_LEASE_S = 20.0
DEFAULT_WEBHOOK_HTTP_TIMEOUT_S = 10.0
#: How long a delivery to a busy endpoint snoozes (plus up to half as much jitter).
DEFAULT_WEBHOOK_BUSY_SNOOZE_S = 2.0
#: An endpoint failing without a break for this long is disabled by the health job.
DEFAULT_WEBHOOK_DISABLE_AFTER_DAYS = 5.0
#: The dashboard's HTTP basic-auth user (the password has no default: unset, no auth on loopback).
DEFAULT_DASHBOARD_USER = "admin"
#: How logs are written: "text" (one line each) or "json" (one object a line, for shippers).
LOG_FORMATS = ("text", "json")
#: Where ``standmeet-jobs run`` serves /metrics (only when STANDMEET_METRICS_PORT is set).
DEFAULT_METRICS_HOST = "127.0.0.1"
#: Where the embedded Postgres keeps its data when no DATABASE_URL is given: one folder
#: per user (platformdirs' user data folder), whatever the working directory.
DEFAULT_EMBEDDED_DIR = str(Path(platformdirs.user_data_dir("standmeet-jobs", appauthor=False)) / "pgdata")
#: Largest document (title and body, UTF-8 bytes) the write path accepts.
DEFAULT_DOCUMENT_MAX_BYTES = 1024 * 1024
#: Name of the database created on the embedded server for the application.
DEFAULT_EMBEDDED_DATABASE = "standmeet"


@dataclass(frozen=True)
class QueueSettings:
    """One queue's limits: at most ``max_workers`` jobs at once per process."""

    name: str
    max_workers: int
    time_limit_s: float
    poll_s: float = DEFAULT_POLL_S
    #: claimed beyond the running ones, to start the moment one finishes (-1: half the limit)
    prefetch_setting: int = -1

    @property
    def prefetch(self) -> int:
        return max(1, self.max_workers // 2) if self.prefetch_setting < 0 else self.prefetch_setting

    @property
    def awaited(self) -> bool:
        spec = app.queue_spec(self.name)
        return spec is not None and spec.awaited

    @property
    def time_limit_ms(self) -> int:
        return int(self.time_limit_s * 1000)


def queue_variable_name(queue: str) -> str:
    """The <NAME> part of a queue's variables: upper-cased, non-alphanumerics as ``_``."""
    return re.sub(r"[^A-Z0-9]", "_", queue.upper())


def _queue_settings(env: Mapping[str, str], name: str, workers: int, limit_s: float) -> QueueSettings:
    prefix = f"STANDMEET_QUEUE_{queue_variable_name(name)}_"
    return QueueSettings(
        name=name,
        max_workers=_int(env, prefix + "MAX_WORKERS", workers, minimum=1),
        time_limit_s=_float(env, prefix + "TIME_LIMIT_S", limit_s, minimum=0.001),
        poll_s=_float(env, prefix + "POLL_S", DEFAULT_POLL_S, minimum=0.01),
        prefetch_setting=_int(env, prefix + "PREFETCH", -1, minimum=-1),
    )


@dataclass(frozen=True)
class Settings:
    """Everything configurable, resolved once. Build with :meth:`from_env`."""

    database_url: str | None = None
    embedded_dir: Path = Path(DEFAULT_EMBEDDED_DIR)
    pool_max_size: int = DEFAULT_POOL_MAX_SIZE
    broker_ack_connections: int = DEFAULT_BROKER_ACK_CONNECTIONS
    worker_shutdown_timeout_s: float = DEFAULT_WORKER_SHUTDOWN_TIMEOUT_S
    max_retries: int = DEFAULT_MAX_RETRIES
    min_backoff_ms: int = DEFAULT_MIN_BACKOFF_MS
    max_backoff_ms: int = DEFAULT_MAX_BACKOFF_MS
    heartbeat_s: float = DEFAULT_HEARTBEAT_S
    rescue_after_s: float = DEFAULT_RESCUE_AFTER_S
    max_crashes: int = DEFAULT_MAX_CRASHES
    retention_days: float = DEFAULT_RETENTION_DAYS
    prune_batch: int = DEFAULT_PRUNE_BATCH
    outbox_max_payload_bytes: int = DEFAULT_OUTBOX_MAX_PAYLOAD_BYTES
    relay_batch: int = DEFAULT_RELAY_BATCH
    relay_poll_s: float = DEFAULT_RELAY_POLL_S
    outbox_retention_hours: float = DEFAULT_OUTBOX_RETENTION_HOURS
    dashboard_user: str = DEFAULT_DASHBOARD_USER
    dashboard_password: str | None = field(default=None, repr=False)
    dashboard_hide_args: bool = False
    max_waiters: int = DEFAULT_MAX_WAITERS
    receipt_wait_s: float = DEFAULT_RECEIPT_WAIT_S
    smtp_host: str = DEFAULT_SMTP_HOST
    smtp_port: int = DEFAULT_SMTP_PORT
    smtp_from: str = DEFAULT_SMTP_FROM
    smtp_starttls: bool = False
    smtp_username: str | None = None
    smtp_password: str | None = None
    smtp_timeout_s: float = DEFAULT_SMTP_TIMEOUT_S
    search_backend: str = "postgres"
    meili_url: str = DEFAULT_MEILI_URL
    meili_key: str | None = None
    meili_index: str = DEFAULT_MEILI_INDEX
    allowed_networks: tuple[str, ...] = ()
    webhook_lease_s: float = DEFAULT_WEBHOOK_LEASE_S
    webhook_http_timeout_s: float = DEFAULT_WEBHOOK_HTTP_TIMEOUT_S
    webhook_busy_snooze_s: float = DEFAULT_WEBHOOK_BUSY_SNOOZE_S
    webhook_disable_after_days: float = DEFAULT_WEBHOOK_DISABLE_AFTER_DAYS
    #: the STANDMEET_QUEUE_* variables, for queues declared later by any module
    queue_env: Mapping[str, str] = field(default_factory=dict)
    unknown_actor_delay_s: float = DEFAULT_UNKNOWN_ACTOR_DELAY_S
    unknown_actor_max_claims: int = DEFAULT_UNKNOWN_ACTOR_MAX_CLAIMS

    log_format: str = "text"
    metrics_port: int | None = None
    metrics_host: str = DEFAULT_METRICS_HOST

    #: Fernet key that encrypts webhook secrets at rest (embedded default: a key file).
    secret_key: str | None = None
    #: Largest document (title and body, UTF-8) ``write`` accepts.
    document_max_bytes: int = DEFAULT_DOCUMENT_MAX_BYTES

    def __post_init__(self) -> None:
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

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        queue_env = {k: v for k, v in env.items() if QUEUE_VARIABLE.match(k)}
        for key in queue_env:  # malformed values of any queue fail now, naming the variable
            match = QUEUE_VARIABLE.match(key)
            assert match is not None
            _queue_settings(queue_env, match["name"].lower(), 1, 1.0)
        return cls(
            database_url=_database_url(env, "DATABASE_URL"),
            queue_env=queue_env,
            embedded_dir=Path(env.get("STANDMEET_EMBEDDED_DIR") or DEFAULT_EMBEDDED_DIR).expanduser(),
            pool_max_size=_int(env, "STANDMEET_POOL_MAX_SIZE", DEFAULT_POOL_MAX_SIZE, minimum=2),
            broker_ack_connections=_int(
                env, "STANDMEET_BROKER_ACK_CONNECTIONS", DEFAULT_BROKER_ACK_CONNECTIONS, minimum=1
            ),
            worker_shutdown_timeout_s=_float(
                env, "STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S", DEFAULT_WORKER_SHUTDOWN_TIMEOUT_S, minimum=0
            ),
            max_retries=_int(env, "STANDMEET_MAX_RETRIES", DEFAULT_MAX_RETRIES, minimum=0),
            min_backoff_ms=_int(env, "STANDMEET_MIN_BACKOFF_MS", DEFAULT_MIN_BACKOFF_MS, minimum=0),
            max_backoff_ms=_int(env, "STANDMEET_MAX_BACKOFF_MS", DEFAULT_MAX_BACKOFF_MS, minimum=0),
            heartbeat_s=_float(env, "STANDMEET_HEARTBEAT_S", DEFAULT_HEARTBEAT_S, minimum=0.05),
            rescue_after_s=_float(env, "STANDMEET_RESCUE_AFTER_S", DEFAULT_RESCUE_AFTER_S, minimum=0.1),
            max_crashes=_int(env, "STANDMEET_MAX_CRASHES", DEFAULT_MAX_CRASHES, minimum=0),
            retention_days=_float(env, "STANDMEET_RETENTION_DAYS", DEFAULT_RETENTION_DAYS, minimum=0),
            prune_batch=_int(env, "STANDMEET_PRUNE_BATCH", DEFAULT_PRUNE_BATCH, minimum=1),
            outbox_max_payload_bytes=_int(
                env, "STANDMEET_OUTBOX_MAX_PAYLOAD_BYTES", DEFAULT_OUTBOX_MAX_PAYLOAD_BYTES, minimum=2
            ),
            relay_batch=_int(env, "STANDMEET_RELAY_BATCH", DEFAULT_RELAY_BATCH, minimum=1),
            relay_poll_s=_float(env, "STANDMEET_RELAY_POLL_S", DEFAULT_RELAY_POLL_S, minimum=0.01),
            outbox_retention_hours=_float(
                env, "STANDMEET_OUTBOX_RETENTION_HOURS", DEFAULT_OUTBOX_RETENTION_HOURS, minimum=0
            ),
            dashboard_user=env.get("STANDMEET_DASHBOARD_USER") or DEFAULT_DASHBOARD_USER,
            dashboard_password=env.get("STANDMEET_DASHBOARD_PASSWORD") or None,
            dashboard_hide_args=_bool(env, "STANDMEET_DASHBOARD_HIDE_ARGS", False),
            max_waiters=_int(env, "STANDMEET_MAX_WAITERS", DEFAULT_MAX_WAITERS, minimum=1),
            receipt_wait_s=_float(env, "STANDMEET_RECEIPT_WAIT_S", DEFAULT_RECEIPT_WAIT_S, minimum=0),
            smtp_host=env.get("STANDMEET_SMTP_HOST") or DEFAULT_SMTP_HOST,
            smtp_port=_int(env, "STANDMEET_SMTP_PORT", DEFAULT_SMTP_PORT, minimum=1),
            smtp_from=env.get("STANDMEET_SMTP_FROM") or DEFAULT_SMTP_FROM,
            smtp_starttls=_bool(env, "STANDMEET_SMTP_STARTTLS", False),
            smtp_username=env.get("STANDMEET_SMTP_USERNAME") or None,
            smtp_password=env.get("STANDMEET_SMTP_PASSWORD") or None,
            smtp_timeout_s=_float(env, "STANDMEET_SMTP_TIMEOUT_S", DEFAULT_SMTP_TIMEOUT_S, minimum=0.1),
            search_backend=_choice(env, "STANDMEET_SEARCH_BACKEND", "postgres", SEARCH_BACKENDS),
            meili_url=(env.get("STANDMEET_MEILI_URL") or DEFAULT_MEILI_URL).rstrip("/"),
            meili_key=env.get("STANDMEET_MEILI_KEY") or None,
            meili_index=env.get("STANDMEET_MEILI_INDEX") or DEFAULT_MEILI_INDEX,
            allowed_networks=_networks(env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS"),
            webhook_lease_s=_float(env, "STANDMEET_WEBHOOK_LEASE_S", DEFAULT_WEBHOOK_LEASE_S, minimum=0.1),
            webhook_http_timeout_s=_float(
                env, "STANDMEET_WEBHOOK_HTTP_TIMEOUT_S", DEFAULT_WEBHOOK_HTTP_TIMEOUT_S, minimum=0.05
            ),
            webhook_busy_snooze_s=_float(
                env, "STANDMEET_WEBHOOK_BUSY_SNOOZE_S", DEFAULT_WEBHOOK_BUSY_SNOOZE_S, minimum=0.01
            ),
            unknown_actor_delay_s=_float(
                env, "STANDMEET_UNKNOWN_ACTOR_DELAY_S", DEFAULT_UNKNOWN_ACTOR_DELAY_S, minimum=0.01
            ),
            unknown_actor_max_claims=_int(
                env, "STANDMEET_UNKNOWN_ACTOR_MAX_CLAIMS", DEFAULT_UNKNOWN_ACTOR_MAX_CLAIMS, minimum=1
            ),
            webhook_disable_after_days=_float(
                env, "STANDMEET_WEBHOOK_DISABLE_AFTER_DAYS", DEFAULT_WEBHOOK_DISABLE_AFTER_DAYS, minimum=0
            ),
            log_format=_choice(env, "STANDMEET_LOG_FORMAT", "text", LOG_FORMATS),
            metrics_port=_port(env, "STANDMEET_METRICS_PORT"),
            metrics_host=(env.get("STANDMEET_METRICS_HOST") or DEFAULT_METRICS_HOST).strip(),
            secret_key=(env.get("STANDMEET_SECRET_KEY") or "").strip() or None,
            document_max_bytes=_int(env, "STANDMEET_DOCUMENT_MAX_BYTES", DEFAULT_DOCUMENT_MAX_BYTES, minimum=1),
        )

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

    def with_database_url(self, url: str) -> Settings:
        return replace(self, database_url=url)


def _int(env: Mapping[str, str], name: str, default: int, *, minimum: int) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = int(raw.strip())
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a whole number") from None
    if value < minimum:
        raise ConfigError(f"{name}={value} is below its minimum of {minimum}")
    return value


def _port(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = _int(env, name, 0, minimum=1)
    if value > 65535:
        raise ConfigError(f"{name}={value} is not a TCP port (1-65535)")
    return value


def _choice(env: Mapping[str, str], name: str, default: str, choices: tuple[str, ...]) -> str:
    value = (env.get(name) or default).strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={value!r} is not one of {', '.join(choices)}")
    return value


def _networks(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    import ipaddress

    raw = env.get(name) or ""
    networks = []
    for part in (p.strip() for p in raw.split(",")):
        if not part:
            continue
        try:
            networks.append(str(ipaddress.ip_network(part, strict=False)))
        except ValueError:
            raise ConfigError(f"{name}: {part!r} is not a network in CIDR form (e.g. 127.0.0.0/8)") from None
    return tuple(networks)


def _bool(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a yes/no value (use 1 or 0)")


def _float(env: Mapping[str, str], name: str, default: float, *, minimum: float) -> float:
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
