"""``standmeet-jobs run``: check, migrate, then supervise the worker processes and the scheduler.

What ``run`` guarantees as a supervisor (:class:`Supervisor`):

* Nothing starts unless it fits: every worker's connection budget, the scheduler's, and
  all of their connections together in what the server can give (``broker.pg.budget``).
* A SIGTERM or SIGINT at any moment, start-up and restarts included, starts nothing
  more and stops every child within the worker shutdown timeout plus
  :data:`CHILD_EXIT_GRACE_S` (then SIGKILL); an exception in the supervisor does the same.
* Children never outlive it: each asks Linux for a SIGTERM when ``run`` dies.
* A child that refuses its configuration (exit :data:`~broker.exits.CONFIG_REFUSED_EXIT`)
  stops ``run`` with its one-line reason and that exit status; a crash is restarted after
  the runtime's one back-off (:class:`broker.backoff.Backoff`): a step doubling from
  :data:`RESTART_MIN_BACKOFF_S` to :data:`RESTART_MAX_BACKOFF_S`, each wait jittered into
  [half, full] of its step so that children that crashed together do not restart together.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

from broker.backoff import Backoff
from broker.boot import app_modules, load_modules
from broker.cli.common import check_counts, logger, say, threads_per_worker
from broker.exits import CONFIG_REFUSED_EXIT, FORCE_AFTER_S

if TYPE_CHECKING:
    from broker.settings import Settings

#: Grace given to child processes beyond the worker shutdown timeout before SIGKILL.
CHILD_EXIT_GRACE_S = 5.0
#: A crashed child is restarted after a back-off whose step doubles (reset once it ran a
#: while); each wait is jittered into [half, full] of the step.
RESTART_MIN_BACKOFF_S = 1.0
RESTART_MAX_BACKOFF_S = 30.0
RESTART_RESET_AFTER_S = 60.0
#: What ``signal.signal`` takes and gives back.
SignalHandler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None
#: How often the supervisor looks at its children (and at the signals it received).
WATCH_INTERVAL_S = 0.1


def cmd_run(args: argparse.Namespace) -> int:
    """``run``: refuse what cannot work, in one line and before starting anything; then
    supervise the children until a signal, a child's refusal, or an error."""
    from broker.errors import ConfigError

    with Signals() as signals:  # from now on, a signal starts nothing more
        try:
            return run_fleet(args, signals)
        except ConfigError as exc:  # its own refusal, like a child's: starting again cannot help
            say(str(exc))
            return CONFIG_REFUSED_EXIT


def run_fleet(args: argparse.Namespace, signals: Signals) -> int:
    import importlib.util

    from broker.errors import BudgetError
    from broker.pg.budget import (
        Fleet,
        check_budget,
        check_fleet,
        scheduler_connections,
        served_queues,
    )
    from broker.pg.embedded import resolve_database_url
    from broker.pg.migrate import migrate
    from broker.settings import Settings

    settings = Settings.from_env()
    check_counts(args.threads, args.processes, shutdown_ms=args.worker_shutdown_timeout)
    args.modules = app_modules([*(args.positional_modules or []), *(args.modules or [])])
    load_modules(args.modules)
    # What each child will check at its start, checked here first, from the same declarations.
    queues = served_queues(args.queues)
    threads = threads_per_worker(settings, queues, args.threads)
    budget = check_budget(settings, queues, threads=threads)
    with_scheduler = not args.no_scheduler and importlib.util.find_spec("periodic.__main__") is not None
    if with_scheduler:
        try:  # the scheduler checks the budget of a worker serving every queue
            check_budget(settings, served_queues())
        except BudgetError as exc:
            raise BudgetError(f"{exc} (the scheduler checks every queue's budget; --no-scheduler starts none)") from None
    fleet = Fleet(processes=args.processes, worker=budget.process,
                  scheduler=scheduler_connections(settings) if with_scheduler else None,
                  supervisor=1 if settings.metrics_port is not None else 0)
    url = resolve_database_url(settings)
    from broker import log_database

    log_database(settings, url)
    connections = check_fleet(settings, url, fleet)
    from broker import app

    if not migrate(url, record_queues=list(app.REGISTRY.queues)):  # each migration applied logs its own line
        logger.info("schema up to date")
    logger.info("connection budget: %s", budget.describe())
    logger.info("connections: %s", connections)

    shutdown_ms = args.worker_shutdown_timeout
    if shutdown_ms is None:
        shutdown_ms = int(settings.worker_shutdown_timeout_s * 1000)
    log_format = getattr(args, "log_format", None) or settings.log_format
    env = {**os.environ, "DATABASE_URL": url, "STANDMEET_LOG_FORMAT": log_format}
    worker = [
        sys.executable, "-m", "broker.worker", *args.modules,
        "--threads", str(threads),
        "--worker-shutdown-timeout", str(shutdown_ms),
        *(["--queues", *queues] if args.queues else []),
    ]
    commands = [worker for _ in range(args.processes)]
    if with_scheduler:
        commands.append([sys.executable, "-m", "periodic", *args.modules])
    if signals.stopping:
        logger.info("stopping: %s came before any process started", signals.first_name)
        return signals.exit_status
    from broker.pg.embedded import is_embedded

    began = time.monotonic()
    with serving_metrics(settings, url, env):
        supervisor = Supervisor(commands, env=env, shutdown_s=shutdown_ms / 1000 + CHILD_EXIT_GRACE_S, signals=signals)
        try:
            status = supervisor.run()
        finally:
            logger.info("%s", run_summary(supervisor, time.monotonic() - began, embedded=is_embedded(settings, url)))
    if supervisor.refusal is not None:
        say(supervisor.refusal)
    return status


def run_summary(supervisor: Supervisor, ran_s: float, *, embedded: bool) -> str:
    """``run``'s last line: how long it ran, what it started and restarted, how it
    stopped, and what became of the database server."""
    signals = supervisor.signals
    if supervisor.refusal is not None:
        how = "stopped: a process refused its configuration"
    elif signals.forced:
        how = f"stopped by {signals.first_name}, then forced by a second Ctrl-C (running jobs given back)"
    elif signals.stopping:
        how = f"stopped by {signals.first_name}"
    else:
        how = "stopped by an error in the supervisor"
    if supervisor.killed:
        how += f"; {supervisor.killed} process(es) killed after the shutdown timeout"
    database = ("the embedded Postgres keeps running (`standmeet-jobs db stop` stops it)" if embedded
                else "the database (DATABASE_URL) is not ours to stop")
    return (f"run ended after {format_duration(ran_s)}: {supervisor.started} process(es) started, "
            f"{supervisor.restarted} restarted; {how}; {database}")


def format_duration(seconds: float) -> str:
    """``12.3 s``, ``5 min 02 s``, ``2 h 03 min``, ``3 d 04 h``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    if whole < 3600:
        return f"{whole // 60} min {whole % 60:02d} s"
    if whole < 86_400:
        return f"{whole // 3600} h {whole % 3600 // 60:02d} min"
    return f"{whole // 86_400} d {whole % 86_400 // 3600:02d} h"


@contextmanager
def serving_metrics(settings: Settings, url: str, env: dict[str, str]) -> Iterator[None]:
    """With STANDMEET_METRICS_PORT: one /metrics for every child (prometheus_client's
    multiprocess mode, in a folder made here and removed after), plus the database
    gauges, computed here once per scrape."""
    if settings.metrics_port is None:
        yield
        return
    import shutil
    import tempfile

    from broker.errors import ConfigError
    from broker.observability.metrics import registry_for, serve

    folder = tempfile.mkdtemp(prefix="standmeet-metrics-")
    env["PROMETHEUS_MULTIPROC_DIR"] = folder
    registry = registry_for(url, multiprocess_dir=folder, rescue_after_s=settings.rescue_after_s)
    try:
        server = serve(registry, settings.metrics_host, settings.metrics_port)
    except OSError as exc:
        shutil.rmtree(folder, ignore_errors=True)
        raise ConfigError(f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: "
                          f"{exc.strerror or exc}") from exc
    logger.info("metrics: http://%s:%d/metrics", settings.metrics_host, server.port)
    try:
        yield
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _child_exited(pid: int, env: dict[str, str]) -> None:
    """A child is gone: its live gauges (jobs in progress) no longer count."""
    folder = env.get("PROMETHEUS_MULTIPROC_DIR")
    if folder:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, folder)


class Signals:
    """SIGTERM and SIGINT as ``run`` hears them, from its start to its end.

    The first one asks for a graceful stop, whenever it comes: nothing more is started,
    and every child gets SIGTERM and its full shutdown timeout (a Ctrl-C also reaches
    them directly, through the process group; they wait all the same). A deliberate
    second Ctrl-C, more than :data:`FORCE_AFTER_S` after the first, forces the exit:
    ``on_force`` runs (the supervisor sends SIGINT, which makes the children exit at
    once); before any child is started, ``run`` exits at once. Either way ``run`` exits 1.
    """

    def __init__(self) -> None:
        self.first_at: float | None = None
        self.first_name = ""
        self.forced = False
        #: what a forced exit does while children run (None: exit now, nothing runs)
        self.on_force: Callable[[], None] | None = None
        self._previous: dict[int, SignalHandler] = {}

    def __enter__(self) -> Signals:
        for signum in (signal.SIGTERM, signal.SIGINT):
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    @property
    def stopping(self) -> bool:
        return self.first_at is not None

    @property
    def exit_status(self) -> int:
        return 1 if self.forced else 0

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        now = time.monotonic()
        if self.first_at is None:
            self.first_at, self.first_name = now, signal.Signals(signum).name
            return
        if signum == signal.SIGINT and now - self.first_at > FORCE_AFTER_S and not self.forced:
            self.forced = True
            if self.on_force is None:
                logger.warning("second Ctrl-C: exiting now")
                raise SystemExit(1)
            logger.warning("second Ctrl-C: forcing the workers to exit now; running jobs are cut off")
            self.on_force()


def restart_backoff() -> Backoff:
    """The back-off of a crashed child's restarts: the runtime's one, jittered."""
    return Backoff(start_s=RESTART_MIN_BACKOFF_S, cap_s=RESTART_MAX_BACKOFF_S)


@dataclass
class Child:
    """One supervised command: its running process (if any) and its restart state."""

    command: list[str]
    process: subprocess.Popen[bytes] | None = None
    #: the read end of the pipe on which the process says why it refuses its configuration
    refusal_fd: int | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    #: the waits before its restarts (reset once it ran :data:`RESTART_RESET_AFTER_S`)
    backoff: Backoff = field(default_factory=restart_backoff)
    #: its running process is a restart: an earlier one accepted the configuration
    restarted: bool = False

    @property
    def name(self) -> str:
        return " ".join(self.command[1:3])

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def read_refusal(self) -> str:
        """What the exited process wrote on its refusal pipe (it has exited: no more comes)."""
        if self.refusal_fd is None:
            return ""
        chunks: list[bytes] = []
        os.set_blocking(self.refusal_fd, False)
        try:
            while chunk := os.read(self.refusal_fd, 4096):
                chunks.append(chunk)
        except BlockingIOError:
            pass
        return b"".join(chunks).decode(errors="replace").strip()

    def forget_process(self) -> None:
        self.process = None
        if self.refusal_fd is not None:
            os.close(self.refusal_fd)
            self.refusal_fd = None


@dataclass
class Supervisor:
    """Runs the children of ``run`` and keeps the promises of this module's docstring.

    :meth:`run` returns the exit status: 0 after a graceful stop, 1 when forced,
    :data:`CONFIG_REFUSED_EXIT` when a child refused its configuration (:attr:`refusal`
    then says which, and why)."""

    commands: list[list[str]]
    env: dict[str, str]
    #: how long children get to exit after SIGTERM before SIGKILL
    shutdown_s: float
    signals: Signals
    children: list[Child] = field(default_factory=list)
    refusal: str | None = None
    #: makes each child's restart back-off (one each)
    backoff: Callable[[], Backoff] = restart_backoff
    #: processes started (restarts not counted), restarts, and processes killed at the end
    started: int = 0
    restarted: int = 0
    killed: int = 0

    def run(self) -> int:
        self.children = [Child(command, backoff=self.backoff()) for command in self.commands]
        self.signals.on_force = self._force
        try:
            for child in self.children:
                if self.signals.stopping:
                    break
                self._start(child, restarted=False)
            while not self.signals.stopping and self.refusal is None:
                self._watch(time.monotonic())
                time.sleep(WATCH_INTERVAL_S)
        finally:
            try:
                self._stop_children()
            finally:
                self.signals.on_force = None
        if self.refusal is not None:
            return CONFIG_REFUSED_EXIT
        if self.killed:  # a process did not stop within the shutdown timeout: not a clean stop
            return 1
        return self.signals.exit_status

    def _start(self, child: Child, *, restarted: bool) -> None:
        read_fd, write_fd = os.pipe()
        command = [*child.command, "--supervised-by", str(os.getpid()), "--refusal-fd", str(write_fd)]
        try:
            process = subprocess.Popen(command, env=self.env, pass_fds=(write_fd,))
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        child.process, child.refusal_fd = process, read_fd
        child.started_at, child.restart_at, child.restarted = time.monotonic(), None, restarted
        if restarted:
            self.restarted += 1
        else:
            self.started += 1
        logger.info("%s pid %d: %s", "restarted" if restarted else "started", process.pid, " ".join(child.command[1:]))

    def _watch(self, now: float) -> None:
        """Restart what crashed (after its back-off); note the first refusal."""
        for child in self.children:
            process = child.process
            if process is not None and process.poll() is not None:
                _child_exited(process.pid, self.env)
                ran = now - child.started_at
                how = exit_description(process.returncode)
                if process.returncode == CONFIG_REFUSED_EXIT:
                    reason = child.read_refusal() or "(it gave no reason)"
                    if not child.restarted:
                        child.forget_process()
                        self.refusal = f"pid {process.pid} ({child.name}) refused its configuration: {reason}"
                        logger.error("%s; stopping the others", self.refusal)
                        return
                    # A restart refusing what its first start accepted (a module that
                    # failed at import, a server briefly short of room): passing, not a
                    # configuration to fix; restarted with back-off like a crash.
                    how = f"refused to start again ({reason})"
                child.forget_process()
                if ran > RESTART_RESET_AFTER_S:
                    child.backoff.reset()
                wait_s = child.backoff.next_s()
                logger.error("pid %d (%s) %s after %.1f s; restarting it in %.2f s",
                             process.pid, child.name, how, ran, wait_s)
                child.restart_at = now + wait_s
            if child.restart_at is not None and now >= child.restart_at and not self.signals.stopping:
                self._start(child, restarted=True)

    def _force(self) -> None:
        for child in self.children:
            if child.process is not None and child.alive:
                _send(child.process, signal.SIGINT)

    def _stop_children(self) -> None:
        """SIGTERM to every child; SIGKILL to those still running after ``shutdown_s``."""
        processes = [c.process for c in self.children if c.process is not None]
        alive = [p for p in processes if p.poll() is None]
        logger.info("stopping: SIGTERM to %s; running jobs get up to %.0f s",
                    ", ".join(str(p.pid) for p in alive) or "none", self.shutdown_s - CHILD_EXIT_GRACE_S)
        for process in alive:
            _send(process, signal.SIGTERM)
        deadline = time.monotonic() + self.shutdown_s
        while any(p.poll() is None for p in alive) and time.monotonic() < deadline:
            time.sleep(WATCH_INTERVAL_S / 2)
        for process in alive:
            if process.poll() is None:
                logger.error("pid %d did not stop in time; killing it", process.pid)
                self.killed += 1
                _send(process, signal.SIGKILL)
        for child in self.children:
            if child.process is None:
                continue
            ended = child.process
            ended.wait()
            _child_exited(ended.pid, self.env)
            how = exit_description(ended.returncode)
            if ended not in alive:  # it ended on its own, unseen before the stop: not restarted
                logger.error("pid %d (%s) %s before the stop; not restarted", ended.pid, child.name, how)
            elif ended.returncode in (0, -signal.SIGTERM):
                # (-SIGTERM: the SIGTERM sent here came as the child's interpreter was ending,
                # its own stop done and its handlers gone: SIGTERM's default action ended it)
                logger.info("pid %d (%s) stopped", ended.pid, child.name)
            else:
                logger.warning("pid %d (%s) %s as it stopped", ended.pid, child.name, how)
        for child in self.children:
            child.forget_process()


def exit_description(returncode: int) -> str:
    """How a child ended, for a log line: ``exited with 1``; ``exited with -9 (killed by
    SIGKILL)`` for a signal (the negative number is what ``subprocess`` reports)."""
    if returncode >= 0:
        return f"exited with {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    return f"exited with {returncode} (killed by {name})"


def _send(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        process.send_signal(signum)
    except ProcessLookupError:
        pass  # it has just exited

