"""What a new operator meets first: every refusal one line naming the cause and the fix,
modules found in the current directory, a quick --help, and `db stop` saying who is
still connected."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest

from tests.support.db import wait_for
from tests.support.procs import ROOT, dramatiq_cmd, running

CLI = [sys.executable, "-m", "broker.cli"]
#: The installed command, as an operator runs it: unlike ``python -m``, Python puts no
#: current directory on its path.
INSTALLED = [str(Path(sys.executable).with_name("standmeet-jobs"))]
#: Modules that fail at their third line: an error of two lines, and an exit at import.
BROKEN = 'import os\n\nraise ValueError("the first line\\nand a second")\n'
EXITS = 'import sys\n\nsys.exit("its configuration file is missing")\n'
#: A module that declares a queue of its own (and loads the runtime's broker).
REPORTS = """import dramatiq

import actors  # noqa: F401
from broker import app

app.queue("reports_here", max_workers=1, time_limit_s=60)


@dramatiq.actor(actor_name="reports_here.nightly", queue_name="reports_here")
def nightly() -> None: ...
"""


def _operator_env(subprocess_env: dict[str, str]) -> dict[str, str]:
    """The suite's environment with only the checkout on the Python path (the suite's
    ``PYTHONPATH`` may end with an empty entry, which is the current directory)."""
    return {**subprocess_env, "PYTHONPATH": str(ROOT)}


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    """The refusal, checked to be the only line on stderr besides log lines."""
    lines = [line for line in result.stderr.strip().splitlines() if " INFO " not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


def test_a_busy_dashboard_port_is_one_line_naming_the_port_and_the_option(subprocess_env):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([*CLI, "dashboard", "--port", str(port)], env=subprocess_env, cwd=ROOT,
                                capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    line = _one_line(result)
    assert line == (f"standmeet-jobs: cannot serve the dashboard on 127.0.0.1:{port}: the port {port} is in use; "
                    "pass --port with a free one"), result.stderr
    assert "dashboard on http" not in result.stderr + result.stdout  # no address it does not serve


def test_dramatiqs_cli_refuses_a_mistyped_queue_in_one_line_naming_the_nearest(subprocess_env):
    result = subprocess.run(dramatiq_cmd("--queues", "indx", "--threads", "1", module="tests.support.jobs"),
                            env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    output = result.stdout + result.stderr
    assert result.returncode == 78, output
    assert "Traceback" not in output, output
    refusals = [line for line in output.splitlines() if "refusing to start" in line]
    assert refusals == ["dramatiq worker: refusing to start: unknown queue(s) indx (did you mean index?); the "
                        "known queues are fetch, index, maintenance, notify, webhook: fix --queues"], output


ENTRIES = {
    "run": [*INSTALLED, "run", "--no-scheduler"],
    "check": [*INSTALLED, "check"],
    "worker": [sys.executable, "-m", "broker.worker"],
    "periodic": [sys.executable, "-m", "periodic"],
}


@pytest.mark.parametrize("module, source, error", [
    ("broken_here", BROKEN, "ValueError: the first line"),
    ("exits_here", EXITS, "SystemExit: its configuration file is missing"),
], ids=["raises", "exits"])
@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_module_that_fails_to_import_is_one_line_with_its_error_and_where(subprocess_env, tmp_path, entry,
                                                                           module, source, error):
    (tmp_path / f"{module}.py").write_text(source)
    result = subprocess.run([*ENTRIES[entry], module], env=_operator_env(subprocess_env), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0, result.stderr
    line = _one_line(result)
    assert line.endswith(f"cannot load module {module!r}: {error} ({tmp_path / f'{module}.py'}:3)"), result.stderr


@pytest.mark.parametrize("entry", ["run", "check"])
def test_run_and_check_find_a_module_in_the_current_directory(subprocess_env, tmp_path, entry):
    # A module in the current directory, which only its lookup can find: it refuses to load,
    # naming its own error (a module not found would be "no module named 'broken_here'")
    (tmp_path / "broken_here.py").write_text(BROKEN)
    result = subprocess.run([*ENTRIES[entry], "broken_here"], env=_operator_env(subprocess_env), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert "ValueError: the first line" in _one_line(result), result.stderr


def test_check_serves_the_queues_of_a_module_in_the_current_directory(subprocess_env, tmp_path):
    (tmp_path / "reports_here.py").write_text(REPORTS)
    result = subprocess.run([*INSTALLED, "check", "reports_here"], env=_operator_env(subprocess_env), cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "reports_here.max_workers 1" in result.stdout, result.stdout


def _imported_by_help(argv: list[str]) -> list[str]:
    script = ("import sys\nfrom broker.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
              "print(' '.join(m for m in ('dramatiq', 'starlette', 'psycopg_pool', 'actors') if m in sys.modules),"
              " file=sys.stderr)\n")
    env = {k: v for k, v in os.environ.items() if k != "STANDMEET_APP_MODULES"}
    env["PYTHONPATH"] = str(ROOT)
    result = subprocess.run([sys.executable, "-c", script, *argv], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert "usage: standmeet-jobs" in result.stdout, result.stdout + result.stderr
    return result.stderr.split()


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["check", "--help"], ["migrate", "--help"],
                                  ["dashboard", "--help"], ["db", "--help"]], ids=" ".join)
def test_help_imports_neither_dramatiq_nor_starlette_nor_the_pools_nor_the_application(argv):
    assert _imported_by_help(argv) == []


def test_db_stop_names_the_worker_processes_still_connected_then_stops(tmp_path):
    # Given an embedded server of its own (not the suite's) and a worker process using it
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    env.update({"STANDMEET_EMBEDDED_DIR": str(tmp_path / "pgdata"), "PYTHONPATH": str(ROOT),
                "PYTHONUNBUFFERED": "1", "STANDMEET_HEARTBEAT_S": "0.5"})
    migrated = subprocess.run([*CLI, "migrate"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    if migrated.returncode != 0 and "embedded Postgres is not installed" in migrated.stderr:
        pytest.skip("the [embedded] extra is not installed")
    assert migrated.returncode == 0, migrated.stderr
    url = subprocess.run([*CLI, "db", "url"], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=60).stdout.strip()
    try:
        worker_cmd = [sys.executable, "-m", "broker.worker", "actors", "--queues", "fetch", "--threads", "1"]
        with running(worker_cmd, env, log=tmp_path / "worker.log") as worker:
            def registered() -> bool:
                with psycopg.connect(url) as conn:
                    return conn.execute("SELECT count(*) FROM standmeet.worker_processes WHERE pid = %s "
                                        "AND stopped_at IS NULL", (worker.pid,)).fetchone() == (1,)

            wait_for(registered, timeout_s=60, what="the worker's heartbeat")
            # When the operator stops the server
            result = subprocess.run([*CLI, "db", "stop"], env=env, cwd=ROOT, capture_output=True, text=True,
                                    timeout=120)
            # Then it names the worker still connected and what it will do, and stops anyway
            assert result.returncode == 0, result.stderr
            assert result.stdout.splitlines() == [
                f"1 worker process(es) still connected ({socket.gethostname()} pid {worker.pid}): stopping the "
                "server anyway; they log the outage and reconnect when it is back",
                "embedded Postgres stopped",
            ], result.stdout + result.stderr
            assert not (Path(tmp_path / "pgdata") / "postmaster.pid").exists()
            assert worker.poll() is None  # it waits for the server; the operator asked only for the server
    finally:
        subprocess.run([*CLI, "db", "stop"], env=env, cwd=ROOT, capture_output=True, timeout=120)
