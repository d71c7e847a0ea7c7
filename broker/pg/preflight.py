"""Before a command touches the database: is it reachable, and is its schema current?

Each answer is one line naming the cause — the variable, the server's host and port, or
"run `standmeet-jobs migrate`" — instead of a traceback or a pool timeout, and comes
within :data:`CONNECT_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import threading
import time

import psycopg
from psycopg.conninfo import conninfo_to_dict

from broker.errors import DatabaseError, DatabaseUnavailable, first_line
from broker.pg import pool as pgpool
from broker.settings import masked_url

#: How long a command waits for the database to answer a connection.
CONNECT_TIMEOUT_S = 5
#: How often a long-running process started before ``migrate`` looks at the schema again.
MIGRATE_POLL_S = 2.0
#: How often it says again that it waits.
MIGRATE_SAY_AGAIN_S = 60.0

logger = logging.getLogger(f"standmeet.{__name__}")

SCHEMA_TABLE = "SELECT to_regclass('standmeet.schema_migrations') IS NOT NULL"
SCHEMA_VERSION = "SELECT coalesce(max(version), 0) FROM standmeet.schema_migrations"
#: The newest applied version of each package's own migrations (NULL: the table is missing).
PACKAGE_VERSIONS = """
SELECT CASE WHEN to_regclass('standmeet.package_migrations') IS NULL THEN NULL
            ELSE (SELECT coalesce(jsonb_object_agg(package, version), '{}'::jsonb)
                  FROM (SELECT package, max(version) AS version FROM standmeet.package_migrations
                        GROUP BY package) AS newest) END
"""


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




def check_database(url: str, *, connect_timeout_s: int = CONNECT_TIMEOUT_S) -> None:
    """Raise :class:`DatabaseUnavailable` or :class:`NotMigrated` with one clear line: the
    runtime's schema and that of every package the loaded modules declared
    (``broker.app.migrations``) must be current."""
    from broker import app
    from broker.pg.migrate import available_migrations, package_migrations

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
            packages_row = conn.execute(PACKAGE_VERSIONS).fetchone()
        except psycopg.Error as exc:
            raise DatabaseUnavailable(f"the database at {where} answered: {first_line(exc)}") from None
    have = int(version_row[0]) if version_row else 0
    need = max((m.version for m in available_migrations()), default=0)
    if have < need:
        raise NotMigrated(f"the database at {where} is at schema version {have}, this code needs {need}: "
                          "run `standmeet-jobs migrate`")
    packages_have = packages_row[0] if packages_row else None
    for source in app.migration_folders():
        need = max((m.version for m in package_migrations(source)), default=0)
        have = int((packages_have or {}).get(source.package, 0))
        if have < need:
            raise NotMigrated(f"the database at {where} is at version {have} of the migrations of {source.package}, "
                              f"this code needs {need}: run `standmeet-jobs migrate`")


def wait_until_migrated(url: str, *, stop: threading.Event, who: str, poll_s: float = MIGRATE_POLL_S) -> bool:
    """Return True once the schema (the runtime's, and that of every package the loaded
    modules declared) is current; False if ``stop`` is set first.

    What a long-running process (a worker, the scheduler, a relay) does at its start: a
    deploy may start it a moment before ``standmeet-jobs migrate`` commits, and it then
    waits, saying so in one line (again every minute), instead of running statements the
    schema cannot serve or exiting (a supervisor told not to restart a refused process
    would never bring it back). A database it cannot reach is left to the process's own
    outage handling: True at once."""
    said_at: float | None = None
    while True:
        try:
            check_database(url)
        except NotMigrated as exc:
            now = time.monotonic()
            if said_at is None or now - said_at >= MIGRATE_SAY_AGAIN_S:
                logger.warning("%s: waiting for the schema, looking again every %g s: %s", who, poll_s, exc)
                said_at = now
        except DatabaseUnavailable:
            return True
        else:
            if said_at is not None:
                logger.info("%s: the schema is current: starting", who)
            return True
        if stop.wait(poll_s):
            return False
