"""Each package's migrations, and how they relate to the runtime's before the split (no database)."""

from __future__ import annotations

from pathlib import Path

import pytest

from broker import app
from broker.errors import ConfigError, MigrationError
from broker.pg.migrate import available_migrations, package_migrations, read_migrations
from tests.support.old_migrations import old_migrations

ROOT = Path(__file__).resolve().parents[2]
#: The runtime's migrations as the code before the split had them.
BEFORE_SPLIT = [name for name, _ in old_migrations()]
ACTORS = app.MigrationFolder(package="actors", folder="migrations")


def test_every_migration_of_before_the_split_is_still_the_runtimes_or_replaced_by_one_of_the_applications():
    runtime = {m.file_name for m in available_migrations()}
    replaced = [m.replaces for m in package_migrations(ACTORS) if m.replaces is not None]
    assert len(BEFORE_SPLIT) == 24
    assert len(replaced) == len(set(replaced)), "two application migrations replace the same one"
    assert set(replaced) <= set(BEFORE_SPLIT), "a replaced migration the old code never had"
    assert not [old for old in BEFORE_SPLIT if old not in runtime and old not in replaced]


def test_no_runtime_migration_has_the_version_and_name_of_one_the_application_replaces():
    # else a fresh database would record the application's migration without running it
    runtime = {m.file_name for m in available_migrations()}
    assert not runtime & {m.replaces for m in package_migrations(ACTORS)}


def test_the_runtime_never_reuses_the_number_of_a_migration_that_left_it():
    old_numbers = {int(name.split("_", 1)[0]) for name in BEFORE_SPLIT}
    old = set(BEFORE_SPLIT)
    reused = [m.file_name for m in available_migrations() if m.version in old_numbers and m.file_name not in old
              and m.file_name != "0010_operator_actions"]  # the one that served both, renamed on purpose
    assert not reused
    assert all(m.version > max(old_numbers) for m in available_migrations() if m.version not in old_numbers)


def test_the_application_numbers_its_migrations_on_its_own_from_one():
    versions = [m.version for m in package_migrations(ACTORS)]
    assert versions == list(range(1, len(versions) + 1))
    assert all(m.package == "actors" for m in package_migrations(ACTORS))
    assert all(m.package is None and m.replaces is None for m in available_migrations())


@pytest.fixture
def folders(monkeypatch):
    declared: dict[str, app.MigrationFolder] = {}
    monkeypatch.setattr(app, "_MIGRATION_FOLDERS", declared)
    return declared


def test_a_package_declares_its_folder_once_and_in_order(folders):
    app.migrations(package="shop", folder="db/migrations")
    app.migrations(package="billing")
    app.migrations(package="shop", folder="db/migrations")  # the same again: no change
    assert app.migration_folders() == [app.MigrationFolder("shop", "db/migrations"), app.MigrationFolder("billing")]
    with pytest.raises(ConfigError, match="declared twice, differently"):
        app.migrations(package="shop", folder="other")


@pytest.mark.parametrize(("package", "folder"), [
    ("broker", "migrations"), ("broker.pg", "migrations"), ("no-dash", "migrations"), ("", "migrations"),
    ("shop", "../elsewhere"), ("shop", "/etc"), ("shop", ""), ("shop", "a//b"),
])
def test_the_runtime_or_a_path_out_of_the_package_is_refused(folders, package, folder):
    with pytest.raises(ConfigError) as refused:
        app.migrations(package=package, folder=folder)
    assert "\n" not in str(refused.value)
    assert not folders


@pytest.fixture
def package(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "pkg_with_migrations"
    (root / "migrations").mkdir(parents=True)
    (root / "__init__.py").write_text("raise RuntimeError('reading its migrations must not import it')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return root


def test_a_packages_migrations_are_read_in_version_order_without_importing_it(package):
    (package / "migrations" / "0010_later.sql").write_text("SELECT 10;\n")
    (package / "migrations" / "0002_first.sql").write_text(
        "-- replaces runtime migration 0007_webhooks: before\nSELECT 2;\n")
    (package / "migrations" / "README.md").write_text("not a migration\n")
    found = package_migrations(app.MigrationFolder("pkg_with_migrations"))
    assert [(m.version, m.name, m.replaces, m.describe()) for m in found] == [
        (2, "first", "0007_webhooks", "pkg_with_migrations 0002_first"),
        (10, "later", None, "pkg_with_migrations 0010_later")]


@pytest.mark.parametrize(("files", "says"), [
    ({"first.sql": ""}, "name it NNNN_name.sql"),
    ({"0001_a.sql": "", "1_b.sql": ""}, "version 1 is used twice"),
])
def test_a_misnamed_or_doubled_migration_is_refused_in_one_line(package, files, says):
    for name, text in files.items():
        (package / "migrations" / name).write_text(text)
    with pytest.raises(MigrationError, match=says) as refused:
        package_migrations(app.MigrationFolder("pkg_with_migrations"))
    assert "\n" not in str(refused.value)


def test_a_missing_package_or_folder_is_refused_in_one_line(package):
    with pytest.raises(MigrationError, match="cannot find package 'no_such_pkg_here' for its migrations: no such package"):
        read_migrations(app.MigrationFolder("no_such_pkg_here"), package="no_such_pkg_here")
    with pytest.raises(MigrationError, match="has no migrations folder 'schema'"):
        package_migrations(app.MigrationFolder("pkg_with_migrations", "schema"))


def test_the_old_migrations_the_runtime_kept_are_byte_for_byte_what_databases_applied():
    # (old_migrations() refuses a kept migration whose bytes changed since it was applied)
    assert [name for name, _ in old_migrations()] == BEFORE_SPLIT and len(BEFORE_SPLIT) == 24
