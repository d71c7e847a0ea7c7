"""Test databases: one server (embedded or DATABASE_URL), a migrated template, a clone per module."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from broker.app import MigrationFolder
from broker.pg.embedded import embedded_server_url
from broker.pg.migrate import migrate
from broker.settings import DEFAULT_EMBEDDED_DIR, Settings

#: Extra tables the test actors write what they observed into.
TEST_SCHEMA = """
CREATE TABLE IF NOT EXISTS test_runs (
    id           bigserial PRIMARY KEY,
    actor        text NOT NULL,
    queue        text NOT NULL,
    label        text NOT NULL DEFAULT '',
    pid          integer NOT NULL,
    message_id   uuid,
    started_at   timestamptz NOT NULL DEFAULT clock_timestamp(),
    finished_at  timestamptz
);
CREATE TABLE IF NOT EXISTS test_counters (
    key    text PRIMARY KEY,
    value  integer NOT NULL DEFAULT 0
);
"""


#: The application's migrations (what ``import actors`` declares), applied without importing it.
APP_MIGRATIONS = (MigrationFolder(package="actors", folder="migrations"),)

#: The suite's own embedded data folder, beside the default one `standmeet-jobs` uses.
SUITE_EMBEDDED_FOLDER = "pgdata-tests"


def suite_embedded_dir(given: str = "") -> Path:
    """Where the suite's embedded server keeps its data: ``given``, else a folder of its own
    next to the default embedded folder (never the default itself)."""
    if given.strip():
        return Path(given.strip()).expanduser()
    return Path(DEFAULT_EMBEDDED_DIR).expanduser().parent / SUITE_EMBEDDED_FOLDER


def server_url() -> str:
    """The admin URL of the server the tests use: DATABASE_URL, else the embedded one."""
    settings = Settings.from_env()
    if settings.database_url:
        return settings.database_url
    return embedded_server_url(settings.embedded_dir)


def with_dbname(url: str, dbname: str) -> str:
    params = conninfo_to_dict(url)
    params["dbname"] = dbname
    return make_conninfo(**params)


def create_template(admin_url: str, name: str) -> str:
    drop_database(admin_url, name)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = with_dbname(admin_url, name)
    migrate(url, packages=APP_MIGRATIONS)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TEST_SCHEMA)
    return url


def clone(admin_url: str, template: str, name: str) -> str:
    drop_database(admin_url, name)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
        )
    return with_dbname(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def query(url: str, text: str, params: Any = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(text.encode(), params)
        return cur.fetchall() if cur.description else []


def scalar(url: str, text: str, params: Any = None) -> Any:
    rows = query(url, text, params)
    return rows[0][0] if rows else None


#: Sessions of this database waiting for a lock, in a statement containing ``%(like)s``
#: (None: any), of the ``%(event)s`` kind (None: any).
LOCK_WAITS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND wait_event_type = 'Lock'
  AND (%(like)s::text IS NULL OR strpos(query, %(like)s::text) > 0)
  AND (%(event)s::text IS NULL OR wait_event = %(event)s::text)
"""


def lock_waits(url: str, *, statement: str | None = None, event: str | None = None) -> int:
    """How many sessions of this database wait for a lock (in a statement containing
    ``statement``; of the ``event`` kind, e.g. ``advisory``): what a test of two
    transactions waits for before it lets the first one go."""
    return int(scalar(url, LOCK_WAITS, {"like": statement, "event": event}))


def wait_for(
    condition: Callable[[], Any], *, timeout_s: float, interval_s: float = 0.02, what: str = "condition"
) -> Any:
    """Poll ``condition`` until truthy; fail the test with ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what} (last: {value!r})")
        time.sleep(interval_s)


def unique_name(prefix: str) -> str:
    return f"{prefix}_{os.getpid()}_{int(time.time() * 1000) % 10_000_000}"


def conninfo_dbname(url: str) -> str:
    return str(conninfo_to_dict(url)["dbname"])
