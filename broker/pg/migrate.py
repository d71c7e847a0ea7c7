"""Versioned, idempotent schema migrations, safe to run from several processes at once.

The runtime's own tables are created by ``broker/pg/migrations/NNNN_name.sql``, recorded
in ``standmeet.schema_migrations``. An application's tables are its own: a package
declares its folder (``broker.app.migrations(package=..., folder=...)``), numbered on its
own and recorded in ``standmeet.package_migrations``. ``migrate`` applies the runtime's
pending migrations, then each declared package's, in the order declared, each once,
all in one transaction that first takes a transaction-scoped advisory lock: a second
process running ``migrate`` at the same time waits, then finds everything applied.

Before the applications had migrations of their own, their tables were created by the
runtime's (versions 3, 6, 7, 11, 15, 16, and 10 in part, under their names then; those
numbers are never used again). A package migration with a line
``-- replaces runtime migration NNNN_name`` does what that runtime migration did: in a
database that has ``NNNN_name`` recorded, it is recorded as applied without being run.
A runtime migration never has the version and name of one a package migration replaces.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import psycopg

from broker import app
from broker.errors import DatabaseUnavailable, MigrationError, first_line
from broker.pg import pool as pgpool

logger = logging.getLogger(f"standmeet.{__name__}")

#: Key of the advisory lock that serialises migrations (any constant bigint).
MIGRATION_LOCK_KEY = 727_274_001
#: The runtime's migrations (in this package's ``migrations`` folder).
RUNTIME_FOLDER = app.MigrationFolder(package="broker.pg", folder="migrations")

LOCK_SQL = "SELECT pg_advisory_xact_lock(%s)"
BOOTSTRAP_SQL = """
CREATE SCHEMA IF NOT EXISTS standmeet;
CREATE TABLE IF NOT EXISTS standmeet.schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS standmeet.package_migrations (
    package       text NOT NULL,
    version       integer NOT NULL,
    name          text NOT NULL,
    applied_at    timestamptz NOT NULL DEFAULT now(),
    -- the runtime migration (NNNN_name) that had applied it: recorded, not run
    replaced      text,
    PRIMARY KEY (package, version)
);
"""
APPLIED_SQL = "SELECT version FROM standmeet.schema_migrations"
RUNTIME_RECORDED_SQL = "SELECT version, name FROM standmeet.schema_migrations"
RECORD_SQL = "INSERT INTO standmeet.schema_migrations (version, name) VALUES (%s, %s)"
PACKAGE_APPLIED_SQL = "SELECT version FROM standmeet.package_migrations WHERE package = %s"
PACKAGE_RECORD_SQL = """
INSERT INTO standmeet.package_migrations (package, version, name, replaced) VALUES (%s, %s, %s, %s)
"""

#: ``NNNN_name.sql``: the file names of migrations.
FILE_NAME = re.compile(r"^(\d+)_(\w+)\.sql$")
#: The line by which a package migration says which runtime migration applied it before.
REPLACES = re.compile(r"^-- replaces runtime migration (\d+)_(\w+)\b", re.MULTILINE)

#: Adopt what dramatiq-pg writes (run on every migrate, so a database still written by
#: dramatiq-pg processes during a switch-over is adopted again): its delayed messages live
#: in a queue named ``<queue>.DQ`` with an ``eta`` option in epoch milliseconds; ours
#: live on their canonical queue with the ``eta`` column. Messages it left ``consumed``
#: carry no worker id: crash rescue requeues them, without blame (they never started here).
ADOPT_DRAMATIQ_PG = r"""
UPDATE dramatiq.queue
SET queue_name = left(queue_name, -3),
    eta = CASE WHEN message->'options' ? 'eta'
               THEN to_timestamp((message->'options'->>'eta')::float8 / 1000.0)
               ELSE eta END,
    message = jsonb_set(message #- '{options,eta}', '{queue_name}', to_jsonb(left(queue_name, -3)))
WHERE queue_name LIKE '%.DQ'
"""


@dataclass(frozen=True)
class Migration:
    version: int
    name: str
    sql: str
    #: whose migration it is: None for the runtime's, else the package that declared it
    package: str | None = None
    #: the runtime migration (``NNNN_name``) that did the same before this one existed
    replaces: str | None = None
    #: recorded as applied without being run (what it replaces had run)
    adopted: bool = False

    @property
    def file_name(self) -> str:
        return f"{self.version:04d}_{self.name}"

    def describe(self) -> str:
        """``0001_dramatiq_queue`` for the runtime's, ``actors 0001_documents`` for a package's."""
        return self.file_name if self.package is None else f"{self.package} {self.file_name}"


def folder_path(source: app.MigrationFolder) -> Path:
    """Where a package's migrations are, found without importing the package."""
    try:
        spec = importlib.util.find_spec(source.package)
    except (ImportError, ValueError) as exc:
        raise MigrationError(f"cannot find package {source.package!r} for its migrations: {exc}") from None
    if spec is None or not spec.submodule_search_locations:
        raise MigrationError(f"cannot find package {source.package!r} for its migrations: no such package")
    for location in spec.submodule_search_locations:
        path = Path(location) / source.folder
        if path.is_dir():
            return path
    raise MigrationError(f"package {source.package!r} has no migrations folder {source.folder!r}")


def read_migrations(source: app.MigrationFolder, *, package: str | None) -> list[Migration]:
    """The migrations of ``source``, in version order; a misnamed file or a version used
    twice is a :class:`MigrationError` naming it."""
    found: dict[int, Migration] = {}
    for entry in sorted(folder_path(source).iterdir()):
        if not entry.name.endswith(".sql"):
            continue
        named = FILE_NAME.match(entry.name)
        if named is None:
            raise MigrationError(f"migration {entry.name!r} of {source.package}: name it NNNN_name.sql")
        version, sql = int(named[1]), entry.read_text(encoding="utf-8")
        if version in found:
            raise MigrationError(f"migrations of {source.package}: version {version} is used twice "
                                 f"({found[version].file_name}.sql and {entry.name})")
        replaced = REPLACES.search(sql) if package is not None else None
        replaces = f"{int(replaced[1]):04d}_{replaced[2]}" if replaced else None
        found[version] = Migration(version, named[2], sql, package=package, replaces=replaces)
    return [found[v] for v in sorted(found)]


def available_migrations() -> list[Migration]:
    """The runtime's migrations, in version order."""
    return read_migrations(RUNTIME_FOLDER, package=None)


def package_migrations(source: app.MigrationFolder) -> list[Migration]:
    """A package's migrations (declared with ``broker.app.migrations``), in version order."""
    return read_migrations(source, package=source.package)


#: The queues the loaded modules declare, recorded for the operator's commands (which load
#: no application module): see the 0027 migration.
RECORD_DECLARED_QUEUES = """
INSERT INTO standmeet.declared_queues (name) SELECT unnest(%s::text[])
ON CONFLICT (name) DO UPDATE SET declared_at = now()
"""
#: A queue the application no longer declares is forgotten (a migrate run with its modules).
FORGET_UNDECLARED_QUEUES = "DELETE FROM standmeet.declared_queues WHERE name <> ALL(%s::text[])"


def migrate(url: str, *, packages: Sequence[app.MigrationFolder] | None = None,
            record_queues: Sequence[str] | None = None) -> list[Migration]:
    """Apply the runtime's pending migrations, then those of each package (by default the
    ones the loaded modules declared), in order; return what this call applied, or
    recorded as applied (``adopted``: what it replaces had run). ``record_queues``: the
    application's declared queues, recorded for the operator's commands (``migrate`` and
    ``run`` give those of the modules they loaded; a library call records none)."""
    runtime = available_migrations()
    declared = [(source.package, package_migrations(source))
                for source in (app.migration_folders() if packages is None else packages)]
    try:
        conn = psycopg.connect(url, **pgpool.connect_kwargs(url))
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to migrate: {first_line(exc)}") from exc
    applied: list[Migration] = []
    with conn:
        try:
            with conn.transaction():
                conn.execute(LOCK_SQL, (MIGRATION_LOCK_KEY,))
                conn.execute(BOOTSTRAP_SQL)
                done = {row[0] for row in conn.execute(APPLIED_SQL)}
                for migration in runtime:
                    if migration.version in done:
                        continue
                    logger.info("applying migration %s", migration.describe())
                    conn.execute(migration.sql.encode())
                    conn.execute(RECORD_SQL, (migration.version, migration.name))
                    applied.append(migration)
                recorded = {f"{version:04d}_{name}" for version, name in conn.execute(RUNTIME_RECORDED_SQL)}
                for package, migrations in declared:
                    applied += apply_package(conn, package, migrations, runtime_recorded=recorded)
                if record_queues is not None:
                    declared_queues = sorted(set(record_queues))
                    conn.execute(RECORD_DECLARED_QUEUES, (declared_queues,))
                    if set(declared_queues) - app.RUNTIME_QUEUES:  # the application's modules: its whole set
                        conn.execute(FORGET_UNDECLARED_QUEUES, (declared_queues,))
                adopted = conn.execute(ADOPT_DRAMATIQ_PG).rowcount
                if adopted:
                    logger.info("adopted %d delayed message(s) written by dramatiq-pg", adopted)
        except psycopg.Error as exc:
            raise MigrationError(f"migration failed and was rolled back: {first_line(exc)}") from exc
    return applied


def apply_package(conn: psycopg.Connection[Any], package: str, migrations: Sequence[Migration], *,
                  runtime_recorded: set[str]) -> list[Migration]:
    """One package's pending migrations, in the caller's transaction (which holds the lock):
    each one whose replaced runtime migration is recorded is recorded, the others run."""
    done = {row[0] for row in conn.execute(PACKAGE_APPLIED_SQL, (package,))}
    applied: list[Migration] = []
    for migration in migrations:
        if migration.version in done:
            continue
        if migration.replaces is not None and migration.replaces in runtime_recorded:
            logger.info("recording migration %s as applied: the runtime's %s applied it",
                        migration.describe(), migration.replaces)
            migration = replace(migration, adopted=True)
        else:
            logger.info("applying migration %s", migration.describe())
            conn.execute(migration.sql.encode())
        conn.execute(PACKAGE_RECORD_SQL, (package, migration.version, migration.name,
                                          migration.replaces if migration.adopted else None))
        applied.append(migration)
    return applied
