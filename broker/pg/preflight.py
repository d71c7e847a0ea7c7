"""Before a command touches the database: is it reachable, and is its schema current?

Each answer is one line naming the cause — the variable, the server's host and port, or
"run `standmeet-jobs migrate`" — instead of a traceback or a pool timeout, and comes
within :data:`CONNECT_TIMEOUT_S`.
"""

from __future__ import annotations

import psycopg
from psycopg.conninfo import conninfo_to_dict

from broker.errors import DatabaseError, DatabaseUnavailable
from broker.pg import pool as pgpool
from broker.settings import masked_url

#: How long a command waits for the database to answer a connection.
CONNECT_TIMEOUT_S = 5

SCHEMA_TABLE = "SELECT to_regclass('standmeet.schema_migrations') IS NOT NULL"
SCHEMA_VERSION = "SELECT coalesce(max(version), 0) FROM standmeet.schema_migrations"


class NotMigrated(DatabaseError):
    """The database has no (or an older) schema: ``standmeet-jobs migrate`` is needed."""


def server_of(url: str) -> str:
    """``host:port`` of a libpq URL or conninfo string (the local socket when no host)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return "?"
    host = params.get("host") or params.get("hostaddr") or "the local socket"
    return f"{host}:{params.get('port') or 5432}"


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def check_database(url: str, *, connect_timeout_s: int = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`DatabaseUnavailable` or :class:`NotMigrated` with one clear line."""
    from broker.pg.migrate import available_migrations

    where = server_of(url)
    try:
        conn = psycopg.connect(url, autocommit=True, **{**pgpool.connect_kwargs(url), "connect_timeout": connect_timeout_s})
    except psycopg.Error as exc:
        raise DatabaseUnavailable(
            f"cannot reach the database at {where} ({masked_url(url)}): {first_line(exc)}") from None
    with conn:
        try:
            row = conn.execute(SCHEMA_TABLE).fetchone()
            if not row or not row[0]:
                raise NotMigrated(f"the database at {where} has no standmeet schema: run `standmeet-jobs migrate`")
            version_row = conn.execute(SCHEMA_VERSION).fetchone()
        except psycopg.Error as exc:
            raise DatabaseUnavailable(f"the database at {where} answered: {first_line(exc)}") from None
    have = int(version_row[0]) if version_row else 0
    need = max((m.version for m in available_migrations()), default=0)
    if have < need:
        raise NotMigrated(f"the database at {where} is at schema version {have}, this code needs {need}: "
                          "run `standmeet-jobs migrate`")
