"""`standmeet-jobs run` as a supervisor: its children never outlive it, a signal at any
moment stops everything, and a child's configuration refusal stops it instead of a
restart loop. Real processes and signals; every process a test starts is killed by its
process group at the end, whatever happened."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from broker.backoff import Backoff
from broker.cli.supervisor import CHILD_EXIT_GRACE_S, Child, Signals, Supervisor
from broker.exits import CONFIG_REFUSED_EXIT
from broker.pg.migrate import MIGRATION_LOCK_KEY
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP
from tests.support.procs import ROOT, running, supervised_pids, worker_cmd

#: The worker shutdown timeout of these tests, and how long `run` may take to stop all
#: of its children after a signal: that timeout, the documented grace, and room for a
#: loaded machine.
SHUTDOWN_MS = 1000
STOP_BOUND_S = SHUTDOWN_MS / 1000 + CHILD_EXIT_GRACE_S + 5
RUN = [sys.executable, "-m", "broker.cli", "run", "tests.support.jobs", "--queues", "fetch",
       "--worker-shutdown-timeout", str(SHUTDOWN_MS)]
#: A module whose configuration only a worker process refuses (as a worker may, for what
#: only it sees): `run` itself finds nothing wrong with it and starts the workers.
REFUSED_IN_THE_WORKER = '''
import sys

import actors  # noqa: F401  (configures the broker)
from broker import app
from broker.errors import StartupRefused


@app.startup_check
def refuse_in_a_worker(settings):
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    if spec is not None and spec.name == "broker.worker":
        raise StartupRefused("refusing to start: STANDMEET_EXAMPLE is wrong for this worker")
'''
BROKEN_AT_IMPORT = "import actors  # noqa: F401\n\nRATIO = 1 / 0\n"


@pytest.fixture
def env(subprocess_env: dict[str, str]) -> dict[str, str]:
    """The children's environment; the server's room is another test's subject (and other
    clients of a shared test server must not make these tests refuse to start)."""
    return {**subprocess_env, "STANDMEET_SERVER_CONNECTIONS_RESERVE": "0"}


@contextmanager
def supervised(cmd: list[str], env: dict[str, str], *, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``cmd`` in a session of its own; at the end SIGKILL its whole process group,
    so that no child outlives the test, even when `run` itself died or the test failed."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            yield proc
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for its reaper does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return "(gone)"


def session_members(session: int) -> list[int]:
    """The live processes of a session (`run` is started as its leader; its children join it)."""
    out = subprocess.run(["ps", "-o", "pid=", "-s", str(session)], capture_output=True, text=True).stdout
    return [pid for pid in map(int, out.split()) if alive(pid)]




def _started(url: str, label: str) -> int:
    return int(scalar(url, "SELECT count(*) FROM test_runs WHERE label = %s", (label,)))


def test_children_die_with_a_sigkilled_run_and_its_running_job_runs_again(
    broker, database_url, env, tmp_path
):
    # Given `run` with a worker (running a long job) and the scheduler
    log = tmp_path / "run.log"
    job = SLEEP["fetch"].send(60_000, "orphaned")
    try:
        with supervised(RUN, env, log=log) as run:
            children = wait_for(lambda: len(supervised_pids(log.read_text())) == 2 and supervised_pids(log.read_text()),
                                timeout_s=30, what="the worker and the scheduler")
            wait_for(lambda: _started(database_url, "orphaned") == 1, timeout_s=30, what="the job to start")
            # When `run` is SIGKILLed (no chance to stop anything itself)
            killed = time.monotonic()
            os.kill(run.pid, signal.SIGKILL)
            run.wait(timeout=10)
            # Then every child exits by itself, within the shutdown timeout and the grace
            try:
                wait_for(lambda: not any(alive(pid) for pid in children), timeout_s=STOP_BOUND_S,
                         what=f"the children {children} to exit")
            except AssertionError as exc:
                left = {pid: command_line(pid) for pid in children if alive(pid)}
                raise AssertionError(f"{exc}; still running: {left}; the log:\n{log.read_text()}") from None
            assert time.monotonic() - killed < STOP_BOUND_S
        text = log.read_text()
        assert "received SIGTERM: shutting down" in text, text  # the worker stopped as on a deploy
        # And the job it was running is given back, and runs again on another worker
        with running(worker_cmd("--queues", "fetch"), env, log=tmp_path / "next.log"):
            wait_for(lambda: _started(database_url, "orphaned") == 2, timeout_s=30, what="the job to run again")
    finally:
        query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (job.message_id,))


def test_a_signal_before_any_child_starts_starts_none(database_url, env, tmp_path):
    # Given `run` waiting for the migration lock that another session holds
    log = tmp_path / "run.log"
    with psycopg.connect(database_url, autocommit=True) as holder:
        holder.execute("SELECT pg_advisory_lock(%s)", (MIGRATION_LOCK_KEY,))
        with supervised(RUN, env, log=log) as run:
            wait_for(lambda: scalar(database_url, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
                                                  " AND NOT granted AND objid = %s", (MIGRATION_LOCK_KEY,)) == 1,
                     timeout_s=30, what="run to wait for the migration lock")
            # When it gets SIGTERM there, and the lock is then released
            os.kill(run.pid, signal.SIGTERM)
            holder.execute("SELECT pg_advisory_unlock(%s)", (MIGRATION_LOCK_KEY,))
            # Then it exits 0 without starting any process
            code = run.wait(timeout=30)
            members = session_members(run.pid)
    text = log.read_text()
    assert code == 0, text
    assert "stopping: SIGTERM came before any process started" in text
    assert supervised_pids(text) == [] and members == [], text


def _restart_wait_s(text: str, pid: int) -> float:
    """The wait `run` announced before restarting the child ``pid``."""
    (line,) = [ln for ln in text.splitlines() if f"pid {pid} (-m broker.worker) exited with" in ln]
    return float(line.split("restarting it in ")[1].split(" s")[0])


def test_a_signal_during_a_restart_back_off_restarts_nothing_and_stops_at_once(database_url, env, tmp_path):
    # Given `run` whose worker crashed twice: its next restart is 1 to 2 s away (the
    # back-off's second step, 2 s, jittered into its upper half)
    log = tmp_path / "run.log"
    killed: list[int] = []
    waits: list[float] = []
    with supervised([*RUN, "--no-scheduler"], env, log=log) as run:
        for step_s in (1.0, 2.0):
            pid = wait_for(lambda: [p for p in supervised_pids(log.read_text()) if p not in killed], timeout_s=30,
                           what="a new worker process")[0]
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended by itself first: say why, as `run` logged it
                pytest.fail(f"worker {pid} was gone before it could be killed; run's log:\n{log.read_text()}")
            killed.append(pid)
            wait_for(lambda: f"pid {killed[-1]} (-m broker.worker) exited with -9" in log.read_text(),
                     timeout_s=30, what=f"the crash of {pid} to be noticed")
            waits.append(_restart_wait_s(log.read_text(), pid))
            assert step_s / 2 <= waits[-1] <= step_s, (waits, log.read_text())
        # When SIGTERM comes during that back-off
        sent = time.monotonic()
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(timeout=30)
        took = time.monotonic() - sent
        members = session_members(run.pid)
    text = log.read_text()
    # Then nothing is restarted, and `run` exits before the restart would have been due
    assert code == 0, text
    assert text.count("restarted pid") == 1, text
    assert took < waits[-1], (took, text)
    assert members == [], text


#: A child that records when it started (the monotonic clock is the machine's, shared by
#: every process), then crashes; the last one asks the supervisor to stop instead.
CRASHER = """
import os, signal, sys, time
path, last = sys.argv[1], int(sys.argv[2])
with open(path, "a") as out:
    out.write(f"{time.monotonic()}\\n")
with open(path) as started:
    count = len(started.read().split())
if count >= last:
    os.kill(os.getppid(), signal.SIGTERM)
    time.sleep(60)
sys.exit(3)
"""


def test_a_crashed_child_is_restarted_after_each_wait_of_the_jittered_back_off(tmp_path, caplog):
    # Given a supervisor whose child crashes as soon as it starts, five times over, and
    # the runtime's back-off, seeded so that its waits can be told in advance
    starts = tmp_path / "starts"
    seed, start_s, cap_s, crashes = 7, 0.4, 1.6, 4
    expected = Backoff(start_s=start_s, cap_s=cap_s, rng=random.Random(seed))
    waits = [expected.next_s() for _ in range(crashes)]
    assert len({round(w / s, 3) for w, s in zip(waits, (0.4, 0.8, 1.6, 1.6), strict=True)}) > 1  # jittered
    command = [sys.executable, "-c", CRASHER, str(starts), str(crashes + 1)]

    def deadline(signum: int, frame: object) -> None:
        raise TimeoutError("the supervisor did not restart its child 4 times within 30 s")

    previous = signal.signal(signal.SIGALRM, deadline)
    signal.setitimer(signal.ITIMER_REAL, 30)
    caplog.set_level(logging.INFO, logger="standmeet")
    try:
        with Signals() as signals:
            supervisor = Supervisor([command], env=dict(os.environ), shutdown_s=10, signals=signals,
                                    backoff=lambda: Backoff(start_s=start_s, cap_s=cap_s, rng=random.Random(seed)))
            # When it runs until the fifth start stops it
            code = supervisor.run()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    # Then each restart came after the back-off's wait, and not much later (a start of
    # Python, and two looks of the supervisor at its children)
    assert code == 0
    times = [float(t) for t in starts.read_text().split()]
    assert len(times) == crashes + 1, times
    gaps = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
    for gap, wait in zip(gaps, waits, strict=True):
        assert wait <= gap <= wait + 0.75, (gaps, waits)
    announced = [r.getMessage() for r in caplog.records if "restarting it in" in r.getMessage()]
    assert [line.split("restarting it in ")[1] for line in announced] == [f"{w:.2f} s" for w in waits]


def test_a_signal_right_after_the_start_stops_every_child_within_the_shutdown_timeout(database_url, env, tmp_path):
    # Given `run` starting two workers and the scheduler
    log = tmp_path / "run.log"
    with supervised([*RUN, "--processes", "2"], env, log=log) as run:
        wait_for(lambda: supervised_pids(log.read_text()), timeout_s=30, what="the first child")
        # When SIGTERM comes as soon as the first child is started
        sent = time.monotonic()
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(timeout=30)
        took = time.monotonic() - sent
        members = session_members(run.pid)
    text = log.read_text()
    # Then `run` stops every child it started, within the shutdown timeout and the grace
    assert code == 0, text
    assert took < STOP_BOUND_S, (took, text)
    assert members == [], text
    assert 1 <= len(supervised_pids(text)) <= 3 and "restarted pid" not in text, text


def test_a_child_refusing_its_configuration_stops_run_with_its_reason(database_url, env, tmp_path):
    # Given a module whose configuration its workers refuse
    (tmp_path / "refused_in_the_worker.py").write_text(REFUSED_IN_THE_WORKER)
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "broker.cli", "run", "refused_in_the_worker", "--processes", "2", "--no-scheduler",
           "--queues", "fetch", "--worker-shutdown-timeout", str(SHUTDOWN_MS)]
    with supervised(cmd, env, log=log) as run:
        # When `run` starts them
        code = run.wait(timeout=60)
        members = session_members(run.pid)
    text = log.read_text()
    # Then it stops with the child's reason and the configuration status, restarting nothing
    assert code == CONFIG_REFUSED_EXIT, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("standmeet-jobs: pid ") and "(-m broker.worker) refused its configuration: " \
        "refusing to start: STANDMEET_EXAMPLE is wrong for this worker" in last, text
    assert len(supervised_pids(text)) == 2 and "restarted pid" not in text and "Traceback" not in text, text
    assert members == [], text


@pytest.mark.parametrize("entry", [["-m", "broker.worker"], ["-m", "periodic"]], ids=["worker", "scheduler"])
@pytest.mark.parametrize("module, words", [
    ("no_module_by_that_name", "cannot load module 'no_module_by_that_name': no module named 'no_module_by_that_name'"),
    ("broken_at_import", "cannot load module 'broken_at_import': ZeroDivisionError: division by zero ("),
], ids=["missing", "broken"])
def test_a_module_that_cannot_load_is_a_configuration_refusal_in_one_line(
    subprocess_env, tmp_path, entry, module, words
):
    (tmp_path / "broken_at_import.py").write_text(BROKEN_AT_IMPORT)
    env = {**subprocess_env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{subprocess_env['PYTHONPATH']}"}
    result = subprocess.run([sys.executable, *entry, module], env=env, cwd=ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == CONFIG_REFUSED_EXIT, result.stderr
    assert words in result.stderr and "Traceback" not in result.stderr, result.stderr


def test_run_refuses_a_module_that_cannot_load_before_starting_anything(subprocess_env, tmp_path):
    log = tmp_path / "run.log"
    with supervised([sys.executable, "-m", "broker.cli", "run", "no_module_by_that_name"], subprocess_env,
                    log=log) as run:
        code = run.wait(timeout=60)
        members = session_members(run.pid)
    text = log.read_text()
    assert code == CONFIG_REFUSED_EXIT, text
    assert "standmeet-jobs: cannot load module 'no_module_by_that_name'" in text and "Traceback" not in text, text
    assert supervised_pids(text) == [] and members == [], text


def test_an_exception_in_the_supervisor_stops_its_children(monkeypatch):
    # Given a supervisor of a long-running child and one that crashes at once, whose
    # restart fails (no more processes can be started, say)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    crasher = [sys.executable, "-c", "raise SystemExit(3)"]
    real_popen = subprocess.Popen
    started: list[subprocess.Popen[bytes]] = []

    def popen(*args: object, **kwargs: object) -> subprocess.Popen[bytes]:
        if len(started) == 2:
            raise OSError(11, "Resource temporarily unavailable")
        started.append(real_popen(*args, **kwargs))  # type: ignore[call-overload]
        return started[-1]

    monkeypatch.setattr("broker.cli.supervisor.subprocess.Popen", popen)
    try:
        with Signals() as signals:
            supervisor = Supervisor([sleeper, crasher], env=dict(os.environ), shutdown_s=10, signals=signals)
            # When the restart raises in the supervise loop
            with pytest.raises(OSError, match="Resource temporarily unavailable"):
                supervisor.run()
        # Then the child still running was stopped (and reaped) before the error went on
        assert len(started) == 2
        assert all(p.poll() is not None for p in started)
        assert started[0].returncode == -signal.SIGTERM
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()


#: A child that exits with the status it is given on SIGTERM.
EXITS_ON_SIGTERM = ("import signal, sys, time\n"
                    "signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(sys.argv[1])))\n"
                    "time.sleep(60)\n")


def test_the_stop_says_how_each_child_ended_a_crash_just_before_it_included(caplog):
    # Given a supervisor of four children: one that stops cleanly, one that exits 3 on
    # SIGTERM, one that crashed (SIGKILL) an instant before the stop, unseen by a look,
    # and one that SIGTERM's default action ends (as a child whose interpreter is ending)
    up = [sys.executable, "-c", EXITS_ON_SIGTERM]
    plain = [sys.executable, "-c", "import time; time.sleep(60)"]
    supervisor = Supervisor([[*up, "0"], [*up, "3"], [*up, "0"], plain], env=dict(os.environ), shutdown_s=10,
                            signals=Signals())
    supervisor.children = [Child(command) for command in supervisor.commands]
    caplog.set_level(logging.INFO, logger="standmeet")
    try:
        for child in supervisor.children:
            supervisor._start(child, restarted=False)
        clean, failing, crashed, ended_by_default = (child.process for child in supervisor.children)
        assert clean is not None and failing is not None and crashed is not None and ended_by_default is not None
        wait_for(lambda: all(_sigterm_handled(p.pid) for p in (clean, failing)), timeout_s=30,
                 what="the children to handle SIGTERM")
        crashed.kill()
        crashed.wait(timeout=10)
        # When it stops them
        supervisor._stop_children()
    finally:
        for child in supervisor.children:
            if child.process is not None and child.process.poll() is None:
                child.process.kill()
                child.process.wait()
    # Then each one's end is said, in words for a signal, the crash as not restarted
    lines = [r.getMessage() for r in caplog.records]
    for stopped in (clean, ended_by_default):
        assert any(line.startswith(f"pid {stopped.pid} (") and line.endswith(") stopped") for line in lines), lines
    assert any(line.startswith(f"pid {failing.pid} (") and line.endswith(") exited with 3 as it stopped")
               for line in lines), lines
    assert any(line.startswith(f"pid {crashed.pid} (")
               and line.endswith(") exited with -9 (killed by SIGKILL) before the stop; not restarted")
               for line in lines), lines


def _sigterm_handled(pid: int) -> bool:
    """Whether process ``pid`` catches SIGTERM (its handler is installed)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) & (1 << (signal.SIGTERM - 1)))


#: A module that fails at import while the file its environment names exists (a service
#: it reads at import briefly unreachable).
FLAKY_AT_IMPORT = '''
import os

import actors  # noqa: F401  (configures the broker)

if os.path.exists(os.environ["FLAKY_FLAG"]):
    raise ConnectionError("a service it reads at import was briefly unreachable")
'''


def test_a_restart_that_fails_at_import_is_restarted_again_and_the_fleet_goes_on(database_url, env, tmp_path):
    # Given `run` whose worker started with a module that fails at import while a flag exists
    (tmp_path / "flaky_at_import.py").write_text(FLAKY_AT_IMPORT)
    flag = tmp_path / "unreachable"
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}", "FLAKY_FLAG": str(flag)}
    cmd = [sys.executable, "-m", "broker.cli", "run", "tests.support.jobs", "flaky_at_import", "--queues", "fetch",
           "--worker-shutdown-timeout", str(SHUTDOWN_MS), "--no-scheduler"]
    log = tmp_path / "run.log"
    with supervised(cmd, env, log=log) as run:
        wait_for(lambda: "worker ready: " in log.read_text(), timeout_s=30, what="the worker ready")
        [first] = supervised_pids(log.read_text())
        # When the worker crashes while that import fails, so that its restart fails at import
        flag.write_text("")
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: "refused to start again (cannot load module 'flaky_at_import'" in log.read_text(),
                 timeout_s=30, what="the restart failing at import")
        # and the import then works again
        flag.unlink()
        # Then `run` restarts it once more instead of stopping, and stops cleanly when told
        wait_for(lambda: log.read_text().count("restarted pid") >= 2, timeout_s=30, what="another restart")
        assert run.poll() is None, log.read_text()
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(timeout=30)
        members = session_members(run.pid)
    text = log.read_text()
    assert code == 0, text
    assert "stopping the others" not in text, text
    assert members == [], text


#: A module whose supervised processes cannot exit (a thread of its own that never ends).
NEVER_EXITS = '''
import sys
import threading
import time

import actors  # noqa: F401  (configures the broker)

if "--supervised-by" in sys.argv:
    threading.Thread(target=time.sleep, args=(3600,), name="never-ends", daemon=False).start()
'''


def test_run_that_had_to_kill_a_process_after_the_shutdown_timeout_does_not_exit_0(database_url, env, tmp_path):
    # Given `run` whose worker cannot exit when stopped
    (tmp_path / "never_exits.py").write_text(NEVER_EXITS)
    env = {**env, "PYTHONPATH": f"{tmp_path}{os.pathsep}{env['PYTHONPATH']}"}
    cmd = [sys.executable, "-m", "broker.cli", "run", "tests.support.jobs", "never_exits", "--queues", "fetch",
           "--worker-shutdown-timeout", str(SHUTDOWN_MS), "--no-scheduler"]
    log = tmp_path / "run.log"
    with supervised(cmd, env, log=log) as run:
        wait_for(lambda: "worker ready: " in log.read_text(), timeout_s=30, what="the worker ready")
        # When it is stopped
        os.kill(run.pid, signal.SIGTERM)
        code = run.wait(timeout=STOP_BOUND_S + 10)
        members = session_members(run.pid)
    text = log.read_text()
    # Then the worker is killed after the shutdown timeout, and the exit status says so
    assert "1 process(es) killed after the shutdown timeout" in text, text
    assert code == 1, text
    assert members == [], text
