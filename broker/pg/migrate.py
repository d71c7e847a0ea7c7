"""Versioned, idempotent schema migrations, safe to run from several processes at once.

Each ``migrations/NNNN_name.sql`` file is applied once, in order, inside one
transaction that first takes a transaction-scoped advisory lock: a second process
running ``migrate`` at the same time waits, then finds everything applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import resources

import psycopg

from broker.errors import DatabaseUnavailable, MigrationError
from broker.pg import pool as pgpool

logger = logging.getLogger(f"standmeet.{__name__}")

#: Key of the advisory lock that serialises migrations (any constant bigint).
MIGRATION_LOCK_KEY = 727_274_001

LOCK_SQL = "SELECT pg_advisory_xact_lock(%s)"
BOOTSTRAP_SQL = """
CREATE SCHEMA IF NOT EXISTS standmeet;
CREATE TABLE IF NOT EXISTS standmeet.schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
"""
APPLIED_SQL = "SELECT version FROM standmeet.schema_migrations"
RECORD_SQL = "INSERT INTO standmeet.schema_migrations (version, name) VALUES (%s, %s)"

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


def available_migrations() -> list[Migration]:
    found = []
    for entry in resources.files("broker.pg").joinpath("migrations").iterdir():
        if not entry.name.endswith(".sql"):
            continue
        number, _, rest = entry.name.partition("_")
        found.append(Migration(int(number), rest.removesuffix(".sql"), entry.read_text()))
    found.sort(key=lambda m: m.version)
    return found


def migrate(url: str) -> list[Migration]:
    """Apply every pending migration; return the ones this call applied."""
    try:
        conn = psycopg.connect(url, **pgpool.connect_kwargs(url))
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(f"cannot connect to migrate: {exc}") from exc
    applied: list[Migration] = []
    with conn:
        try:
            with conn.transaction():
                conn.execute(LOCK_SQL, (MIGRATION_LOCK_KEY,))
                conn.execute(BOOTSTRAP_SQL)
                done = {row[0] for row in conn.execute(APPLIED_SQL)}
                for migration in available_migrations():
                    if migration.version in done:
                        continue
                    logger.info("applying migration %04d_%s", migration.version, migration.name)
                    conn.execute(migration.sql.encode())
                    conn.execute(RECORD_SQL, (migration.version, migration.name))
                    applied.append(migration)
                adopted = conn.execute(ADOPT_DRAMATIQ_PG).rowcount
                if adopted:
                    logger.info("adopted %d delayed message(s) written by dramatiq-pg", adopted)
        except psycopg.Error as exc:
            raise MigrationError(f"migration failed and was rolled back: {exc}") from exc
    return applied
