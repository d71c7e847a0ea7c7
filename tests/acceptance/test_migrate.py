"""`standmeet-jobs migrate` prepares an empty database, idempotently, from several processes at once:
the runtime's tables, then the application's (its own migrations, its own version history); and a
database migrated before the application's tables left the runtime's migrations ends in the same
schema as a fresh one, with nothing re-created and nothing lost."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from broker.pg.migrate import available_migrations, migrate, package_migrations
from tests.support import db as testdb
from tests.support.old_migrations import old_migrations
from tests.support.procs import ROOT

MIGRATE = [sys.executable, "-m", "broker.cli", "migrate"]
#: The runtime's migrations exactly as the code before the split had them (24 files, the
#: application's tables among them), and the bookkeeping table it made.
OLD_BOOTSTRAP = """
CREATE SCHEMA IF NOT EXISTS standmeet;
CREATE TABLE IF NOT EXISTS standmeet.schema_migrations (
    version     integer PRIMARY KEY,
    name        text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT now()
);
"""
OLD_RECORD = "INSERT INTO standmeet.schema_migrations (version, name) VALUES (%s, %s)"
ACTORS = testdb.APP_MIGRATIONS
APP_TABLES = ("documents", "search_index", "supplier_calls", "reindex_runs", "reindex_batches", "job_sources",
              "job_postings", "source_fetches", "webhook_endpoints", "webhook_events", "webhook_deliveries",
              "webhook_attempts")

#: What `pg_dump --schema-only` would show of the two schemas, as comparable rows (no OIDs).
SCHEMA_QUERIES = {
    "columns": """
        SELECT table_schema, table_name, ordinal_position, column_name, data_type, udt_name,
               column_default, is_nullable, character_maximum_length, numeric_precision
        FROM information_schema.columns WHERE table_schema IN ('standmeet', 'dramatiq')
        ORDER BY 1, 2, 3""",
    "relations": """
        SELECT n.nspname, c.relname, c.relkind, c.relpersistence, coalesce(c.reloptions, '{}')
        FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname IN ('standmeet', 'dramatiq') ORDER BY 1, 2""",
    "indexes": """
        SELECT schemaname, tablename, indexname, indexdef FROM pg_indexes
        WHERE schemaname IN ('standmeet', 'dramatiq') ORDER BY 1, 2, 3""",
    "constraints": """
        SELECT n.nspname, c.conrelid::regclass::text, c.conname, c.contype, pg_get_constraintdef(c.oid)
        FROM pg_constraint c JOIN pg_namespace n ON n.oid = c.connamespace
        WHERE n.nspname IN ('standmeet', 'dramatiq') ORDER BY 1, 2, 3""",
    "functions": """
        SELECT p.oid::regprocedure::text, pg_get_functiondef(p.oid)
        FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
        WHERE n.nspname IN ('standmeet', 'dramatiq') ORDER BY 1""",
    "types": """
        SELECT t.typname, t.typtype, array_agg(e.enumlabel ORDER BY e.enumsortorder)
        FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace LEFT JOIN pg_enum e ON e.enumtypid = t.oid
        WHERE n.nspname IN ('standmeet', 'dramatiq') AND t.typtype IN ('e', 'd', 'b')
        GROUP BY 1, 2 ORDER BY 1""",
    "sequences": """
        SELECT schemaname, sequencename, data_type::text, start_value, increment_by, max_value, cycle
        FROM pg_sequences WHERE schemaname IN ('standmeet', 'dramatiq') ORDER BY 1, 2""",
    "sequence owners": """
        SELECT s.relname, t.relname, a.attname FROM pg_depend d
        JOIN pg_class s ON s.oid = d.objid AND s.relkind = 'S'
        JOIN pg_class t ON t.oid = d.refobjid JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = d.refobjsubid
        JOIN pg_namespace n ON n.oid = s.relnamespace
        WHERE n.nspname IN ('standmeet', 'dramatiq') AND d.deptype = 'a' ORDER BY 1""",
    "triggers": """
        SELECT c.relname, t.tgname, pg_get_triggerdef(t.oid) FROM pg_trigger t
        JOIN pg_class c ON c.oid = t.tgrelid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname IN ('standmeet', 'dramatiq') AND NOT t.tgisinternal ORDER BY 1, 2""",
    "comments": """
        SELECT c.relname, d.objsubid, d.description FROM pg_description d
        JOIN pg_class c ON c.oid = d.objoid JOIN pg_namespace n ON n.oid = c.relnamespace
        WHERE n.nspname IN ('standmeet', 'dramatiq') ORDER BY 1, 2""",
}


def schema_of(url: str) -> dict[str, list[tuple[Any, ...]]]:
    return {what: testdb.query(url, query) for what, query in SCHEMA_QUERIES.items()}


def assert_same_schema(url: str, fresh: dict[str, list[tuple[Any, ...]]]) -> None:
    have = schema_of(url)
    for what, rows in fresh.items():
        missing = [row for row in rows if row not in have[what]]
        extra = [row for row in have[what] if row not in rows]
        assert not missing and not extra, f"{what}: missing {missing}, extra {extra}"
        assert have[what] == rows, what  # the same rows, in the same order (column positions included)


def migrate_as_before_the_split(url: str, *, through: int) -> list[str]:
    """Apply the old migrations up to version ``through`` as the old code did: each file,
    then its version, in one transaction. Returns the files applied."""
    files = [(name, sql) for name, sql in old_migrations() if int(name.split("_", 1)[0]) <= through]
    with psycopg.connect(url) as conn, conn.transaction():
        conn.execute(OLD_BOOTSTRAP)
        for name, sql in files:
            number, _, rest = name.partition("_")
            conn.execute(sql.encode())
            conn.execute(OLD_RECORD, (int(number), rest))
    return [name for name, _ in files]


@pytest.fixture
def new_database(admin_url: str) -> Iterator[str]:
    name = testdb.unique_name("smt_mig")
    testdb.drop_database(admin_url, name)
    testdb.query(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield testdb.with_dbname(admin_url, name)
    finally:
        testdb.drop_database(admin_url, name)


@pytest.fixture(scope="module")
def fresh_schema(admin_url: str) -> Iterator[dict[str, list[tuple[Any, ...]]]]:
    """The schema the new code gives an empty database: the runtime's, then the application's."""
    name = testdb.unique_name("smt_fresh")
    testdb.drop_database(admin_url, name)
    testdb.query(admin_url, f'CREATE DATABASE "{name}"')
    url = testdb.with_dbname(admin_url, name)
    try:
        migrate(url, packages=ACTORS)
        yield schema_of(url)
    finally:
        testdb.drop_database(admin_url, name)


def test_three_concurrent_migrations_of_an_empty_database_apply_each_version_once(new_database, subprocess_env):
    url = new_database
    env = {**subprocess_env, "DATABASE_URL": url}
    procs = [subprocess.Popen(MIGRATE, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [(p.wait(timeout=60), *p.communicate()) for p in procs]
    assert [r[0] for r in results] == [0, 0, 0], results
    # one process applied everything, the runtime's first, then the application's; the others found it done
    outputs = [r[1] for r in results]
    assert outputs.count("schema up to date\n") == 2, outputs
    (output,) = [o for o in outputs if o != "schema up to date\n"]
    runtime, actors = available_migrations(), package_migrations(ACTORS[0])
    assert output.splitlines() == ([f"applied {m.file_name}" for m in runtime]
                                   + [f"applied actors {m.file_name}" for m in actors])
    versions = [r[0] for r in testdb.query(url, "SELECT version FROM standmeet.schema_migrations ORDER BY version")]
    assert versions == [m.version for m in runtime]
    assert testdb.query(url, "SELECT package, version, replaced FROM standmeet.package_migrations "
                             "ORDER BY version") == [("actors", m.version, None) for m in actors]
    assert testdb.scalar(url, "SELECT to_regclass('dramatiq.queue') IS NOT NULL")
    assert testdb.scalar(url, "SELECT to_regclass('standmeet.webhook_deliveries') IS NOT NULL")
    again = subprocess.run(MIGRATE, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == "schema up to date\n"


def test_the_runtime_alone_creates_none_of_the_applications_tables(new_database, fresh_schema):
    migrate(new_database, packages=[])
    present = {row[0] for row in testdb.query(
        new_database, "SELECT table_name FROM information_schema.tables WHERE table_schema = 'standmeet'")}
    assert present and not present & set(APP_TABLES), present & set(APP_TABLES)
    assert testdb.scalar(new_database, "SELECT count(*) FROM standmeet.package_migrations") == 0
    # and the application's migrations, applied later, complete it into the same schema
    applied = migrate(new_database, packages=ACTORS)
    assert [m.describe() for m in applied] == [f"actors {m.file_name}" for m in package_migrations(ACTORS[0])]
    assert_same_schema(new_database, fresh_schema)


OLD_ROWS = """
INSERT INTO standmeet.documents (id, title, body) VALUES (41, 'kept', 'the body');
INSERT INTO standmeet.job_sources (id, url, kind) VALUES (7, 'https://example.org/feed', 'rss');
INSERT INTO standmeet.webhook_endpoints (id, url, event_types, secrets) VALUES (3, 'https://example.org/hook',
    '{document.created}', '{whsec_x}');
INSERT INTO standmeet.outbox (topic, payload) VALUES ('document.created', '{"id": 41}');
INSERT INTO standmeet.operator_actions (action, by_whom, source) VALUES ('pause', 'ops', 'cli');
"""
KEPT_ROWS = """
SELECT (SELECT title FROM standmeet.documents WHERE id = 41), (SELECT url FROM standmeet.job_sources WHERE id = 7),
       (SELECT url FROM standmeet.webhook_endpoints WHERE id = 3), (SELECT count(*) FROM standmeet.outbox),
       (SELECT count(*) FROM standmeet.operator_actions)
"""
#: Each table's identity: a table created again would have another.
TABLE_IDS = """
SELECT c.relname, c.oid::bigint FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE n.nspname IN ('standmeet', 'dramatiq') AND c.relkind IN ('r', 'i', 'S') ORDER BY 1
"""


#: What the application's migrations written after the split create (they replace none of
#: the runtime's, and run on a database migrated before it).
WRITTEN_AFTER_THE_SPLIT = {"webhook_deliveries_retry_due_idx", "webhook_deliveries_pending_message_idx"}
#: What the runtime's migrations written after the split create.
RUNTIME_AFTER_THE_SPLIT = {"declared_queues", "declared_queues_pkey"}


def test_a_database_migrated_before_the_split_records_the_applications_history_and_loses_nothing(
        new_database, subprocess_env, fresh_schema):
    # Given a database migrated by the code before the split, with rows in the runtime's and
    # the application's tables
    url = new_database
    old = migrate_as_before_the_split(url, through=24)
    assert len(old) == 24
    testdb.query(url, OLD_ROWS)
    ids_before = testdb.query(url, TABLE_IDS)
    # When `standmeet-jobs migrate` runs on it
    env = {**subprocess_env, "DATABASE_URL": url}
    done = subprocess.run(MIGRATE, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # Then only the runtime's migrations written since run; the application's that replace
    # one of the runtime's are recorded, each as the one it replaces, not run; those
    # written after the split run
    actors = package_migrations(ACTORS[0])
    since = [f"applied {m.file_name}" for m in available_migrations() if m.version > 24]
    assert done.stdout.splitlines() == since + [
        f"recorded actors {m.file_name} (the runtime's {m.replaces} applied it)" if m.replaces
        else f"applied actors {m.file_name}" for m in actors]
    assert testdb.query(url, "SELECT package, version, name, replaced FROM standmeet.package_migrations "
                             "ORDER BY version") == [("actors", m.version, m.name, m.replaces) for m in actors]
    # nothing was created again, nothing was lost, and the schema is a fresh database's
    ids_after = dict(testdb.query(url, TABLE_IDS))
    assert {name: ids_after.get(name) for name, _ in ids_before} == dict(ids_before)
    assert set(ids_after) - dict(ids_before).keys() == {"package_migrations", "package_migrations_pkey",
                                                        *WRITTEN_AFTER_THE_SPLIT, *RUNTIME_AFTER_THE_SPLIT}
    assert testdb.query(url, KEPT_ROWS) == [("kept", "https://example.org/feed", "https://example.org/hook", 1, 1)]
    assert_same_schema(url, fresh_schema)
    again = subprocess.run(MIGRATE, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == "schema up to date\n", again


@pytest.mark.parametrize("through", [2, 5, 9, 10, 14, 16])
def test_a_database_migrated_part_way_before_the_split_ends_in_the_fresh_schema(new_database, fresh_schema, through):
    # Given a database the old code migrated up to a version (one between the application's,
    # 10 the one that served both)
    old = set(migrate_as_before_the_split(new_database, through=through))
    # When the new code migrates it
    applied = migrate(new_database, packages=ACTORS)
    # Then what the old code had applied is recorded, not run, and the rest is applied
    adopted = {m.file_name for m in applied if m.adopted}
    assert adopted == {m.file_name for m in package_migrations(ACTORS[0]) if m.replaces in old}
    ran_again = [m.describe() for m in applied if m.package is None and m.file_name in old]
    assert not ran_again, "runtime migrations the old code applied ran again"
    assert_same_schema(new_database, fresh_schema)


def test_a_second_package_declared_after_the_application_migrates_after_it_with_its_own_numbers(
        new_database, subprocess_env, tmp_path):
    # Given a module that declares a package of its own with a migration numbered 1, like the application's first
    package = tmp_path / "inventory"
    (package / "schema").mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent("""
        from broker import app

        app.migrations(package="inventory", folder="schema")
    """))
    (package / "schema" / "0001_items.sql").write_text(
        "CREATE TABLE inventory_items (id bigint PRIMARY KEY, document_id bigint REFERENCES standmeet.documents (id));\n")
    env = {**subprocess_env, "DATABASE_URL": new_database}
    # When `migrate actors inventory` runs from the folder that holds it
    done = subprocess.run([*MIGRATE, "actors", "inventory"], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    # Then it is applied after the application's (whose tables it names), and recorded as its own version 1
    assert done.returncode == 0, done.stderr
    last_of_the_application = package_migrations(ACTORS[0])[-1].file_name
    assert done.stdout.splitlines()[-2:] == [f"applied actors {last_of_the_application}", "applied inventory 0001_items"]
    assert testdb.query(new_database, "SELECT package, version FROM standmeet.package_migrations WHERE version = 1 "
                                      "ORDER BY package") == [("actors", 1), ("inventory", 1)]
    assert testdb.scalar(new_database, "SELECT to_regclass('public.inventory_items') IS NOT NULL")


def test_a_module_that_cannot_load_stops_migrate_in_one_line_before_the_database_is_touched(
        new_database, subprocess_env):
    env = {**subprocess_env, "DATABASE_URL": new_database}
    done = subprocess.run([*MIGRATE, "no_such_module_here"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("standmeet-jobs: cannot load module 'no_such_module_here'")
    assert testdb.scalar(new_database, "SELECT to_regclass('standmeet.schema_migrations') IS NULL")


def test_the_preflight_refuses_a_database_whose_application_migrations_are_behind(new_database, monkeypatch):
    from broker import app
    from broker.pg.preflight import NotMigrated, check_database

    # Given the application's migrations declared, and a database migrated by the runtime alone
    monkeypatch.setattr(app, "migration_folders", lambda: list(ACTORS))
    migrate(new_database, packages=[])
    # Then a command of the application is refused in one line naming the package and the fix
    with pytest.raises(NotMigrated) as refused:
        check_database(new_database)
    need = max(m.version for m in package_migrations(ACTORS[0]))
    assert str(refused.value).endswith(f"is at version 0 of the migrations of actors, this code needs {need}: "
                                       "run `standmeet-jobs migrate`")
    # When the application's migrations are applied, it passes
    migrate(new_database, packages=ACTORS)
    check_database(new_database)
