"""A worker process: ``python -m broker.worker`` (a process entry point).

The same Dramatiq worker as ``dramatiq actors``, in one process with no fork manager:
SIGTERM starts the shutdown at once (Dramatiq's CLI polls for it every second and
waits up to a second more for its log pipe), so a deploy waits only for the jobs.

    python -m broker.worker [--queues Q …] [--threads N] [--worker-shutdown-timeout MS] [MODULE …]

On SIGTERM or Ctrl-C: claim nothing more, give back prefetched messages, say which
running jobs it waits for, wait up to the shutdown timeout for them, record the process
as stopped and exit. Each job still running at the timeout is named as it is cut off and
given back (no crash counted): it runs again elsewhere (at least once). Further signals
within a second (a group's Ctrl-C, then `run`'s SIGTERM) change nothing; a deliberate
second Ctrl-C later forces the exit: the running jobs are given back and the process
recorded as stopped (within :data:`FORCED_STOP_S`), then it exits with status 1.

The modules are looked up in the current directory first, as ``dramatiq`` does.

A worker that refuses its configuration (the connection budget, a bad setting, an
unknown queue, a module that cannot load) exits with :data:`CONFIG_REFUSED_EXIT` after
one line saying why; any other failure is a crash. Started by ``standmeet-jobs run``
(``--supervised-by``), it dies with it: Linux sends it SIGTERM when ``run`` dies, and it
tells ``run`` its refusal on ``--refusal-fd``, so that ``run`` stops with that reason
instead of starting it again. :func:`die_with_supervisor` and :func:`refuse` serve the
scheduler process the same way.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import math
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

# Only what ``--help`` needs is imported here: Dramatiq, psycopg and the application are
# imported by the commands that use them.
if TYPE_CHECKING:
    from broker.engine.broker import StandmeetBroker

logger = logging.getLogger("standmeet.worker")

#: How often idle worker threads look for a shutdown (Dramatiq's default is 1 s).
WORKER_POLL_MS = 100
#: A second Ctrl-C forces the exit only this long after the first signal.
FORCE_AFTER_S = 1.0
#: The exit status of a process that refuses its configuration (sysexits.h EX_CONFIG):
#: starting it again cannot help, so ``run`` stops instead of restarting it.
CONFIG_REFUSED_EXIT = 78
#: prctl(2): the signal a process gets when the thread that started it exits.
PR_SET_PDEATHSIG = 1
#: The most threads one worker process may be given (``--threads``).
THREADS_MOST = 10_000
#: The longest ``--worker-shutdown-timeout``: a day, as STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S allows.
SHUTDOWN_TIMEOUT_MOST_MS = 86_400_000
#: A forced stop (a deliberate second Ctrl-C) gives the running jobs back and records the
#: process as stopped within this, then exits whatever happened.
FORCED_STOP_S = 3.0
#: How many running jobs a shutdown line names before it says "and N more".
NAMED_JOBS_MOST = 5
#: The attribute of a Dramatiq worker that tells the shutdown how long it waits for jobs (ms).
SHUTDOWN_MS_ATTRIBUTE = "standmeet_shutdown_ms"


@dataclass(frozen=True)
class RunningJob:
    """A job running on a worker thread of this process."""

    actor: str
    message_id: str
    started: float  # time.monotonic()

    def describe(self, now: float | None = None) -> str:
        ran_s = (time.monotonic() if now is None else now) - self.started
        return f"{self.actor} {self.message_id} (running {ran_s:.1f} s)"


class RunningJobs:
    """The jobs running in this process, one per worker thread (``middleware.JobLog``
    keeps it): what a shutdown names while it waits, and what it cuts off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_thread: dict[int, RunningJob] = {}

    def started(self, actor: str, message_id: str) -> None:
        with self._lock:
            self._by_thread[threading.get_ident()] = RunningJob(actor, message_id, time.monotonic())

    def finished(self) -> None:
        with self._lock:
            self._by_thread.pop(threading.get_ident(), None)

    def now(self) -> list[RunningJob]:
        """The running jobs, longest-running first."""
        with self._lock:
            return sorted(self._by_thread.values(), key=lambda job: job.started)


#: This process's running jobs.
running_jobs = RunningJobs()


def name_jobs(jobs: Sequence[RunningJob], *, most: int = NAMED_JOBS_MOST) -> str:
    """``a 0b5a… (running 3.1 s), b 7c1d… (running 0.2 s) and 4 more``."""
    now = time.monotonic()
    named = ", ".join(job.describe(now) for job in jobs[:most])
    return f"{named} and {len(jobs) - most} more" if len(jobs) > most else named


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments are one line naming what was wrong, exit 2 (``--help`` shows the usage)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: {message}\n")


def bounded_int(*, low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number from ``low`` to ``high``, else one line saying so."""
    def whole_number(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number: give {low} to {high}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is out of range: give {low} to {high}")
        return value
    return whole_number


def bounded_float(*, low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number from ``low`` to ``high``, else one line saying so."""
    def number(text: str) -> float:
        try:
            value = float(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number: give {low:.15g} to {high:.15g}") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text.strip()} is out of range: give {low:.15g} to {high:.15g}")
        return value
    return number


def check_worker_numbers(*, threads: int, shutdown_ms: int | None) -> None:
    """Refuse a thread count or a shutdown timeout out of range, in one line naming the
    option, the value and the range (:class:`ConfigError`)."""
    from broker.errors import ConfigError

    if not 0 <= threads <= THREADS_MOST:
        raise ConfigError(f"--threads {threads}: give 1 to {THREADS_MOST} threads per worker process "
                          "(0: the sum of the served queues' limits)")
    if shutdown_ms is not None and not 0 <= shutdown_ms <= SHUTDOWN_TIMEOUT_MOST_MS:
        raise ConfigError(f"--worker-shutdown-timeout {shutdown_ms}: give 0 to {SHUTDOWN_TIMEOUT_MOST_MS} "
                          "milliseconds")


def die_with_supervisor(supervisor_pid: int) -> bool:
    """Have Linux send this process SIGTERM when its supervisor dies (prctl
    PR_SET_PDEATHSIG); False when the supervisor is gone already (it died before the
    request took hold, and no signal will come), and this process must not start."""
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            errno = ctypes.get_errno()
            logger.warning("cannot ask to die with the supervisor (pid %d): %s", supervisor_pid, os.strerror(errno))
    return os.getppid() == supervisor_pid


def refuse(who: str, reason: str, refusal_fd: int | None) -> int:
    """Say in one line why this process refuses its configuration (on stderr, and to the
    supervisor on ``refusal_fd``); the exit status that tells it not to restart us."""
    line = " ".join(reason.split())
    print(f"{who}: {line}", file=sys.stderr, flush=True)
    if refusal_fd is not None:
        try:
            os.write(refusal_fd, line.encode()[:4000])
        except OSError:
            pass  # the supervisor still sees the exit status
    return CONFIG_REFUSED_EXIT


def look_in_current_directory() -> str:
    """Put the current directory first on ``sys.path``, as ``dramatiq`` does, so that
    ``run reports`` finds ``./reports.py`` (the children ``run`` starts inherit the
    directory and do the same). Returns the directory."""
    here = os.getcwd()
    if sys.path[:1] != [here]:
        while here in sys.path:
            sys.path.remove(here)
        sys.path.insert(0, here)
    return here


def load_modules(modules: Sequence[str]) -> None:
    """Import the modules that declare actors, queues and commands, looked up in the
    current directory first.

    A module that cannot load raises :class:`ModuleNotLoaded`: one line naming it, the
    last line of its error and where it was raised (``file:line``); our own errors raised
    by its import (a malformed setting, an unreachable database) stay what they are."""
    from broker.errors import ModuleNotLoaded, StandmeetError

    if modules:
        here = look_in_current_directory()
    for module in modules:
        try:
            importlib.import_module(module)
        except StandmeetError:
            raise
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                raise ModuleNotLoaded(
                    f"cannot load module {module!r}: no module named {exc.name!r} in {here} or on the Python "
                    "path: check the name (a module, not a file name), or run from the folder that holds it"
                ) from None
            raise ModuleNotLoaded(f"cannot load module {module!r}: {last_line(exc)}{_where(exc)}") from None
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # SystemExit too: a module that exits at import is refused
            raise ModuleNotLoaded(f"cannot load module {module!r}: {last_line(exc)}{_where(exc)}") from None


def last_line(exc: BaseException) -> str:
    """The last line Python prints for an exception (``ValueError: boom``), on one line."""
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    # a syntax error ends with its type and message; any other error starts with them (a
    # message of several lines continues below: detail)
    return lines[-1] if isinstance(exc, SyntaxError) else lines[0]


def _where(exc: BaseException) -> str:
    """`` (file:line)`` where an exception was raised: the innermost frame outside
    Python's import machinery (for a syntax error, the offending line)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}:{exc.lineno})"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen importlib")]
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``run`` gives each child it supervises."""
    parser.add_argument("--supervised-by", type=int, default=None, metavar="PID",
                        help="exit when this process (the parent, `standmeet-jobs run`) dies")
    parser.add_argument("--refusal-fd", type=int, default=None, metavar="FD",
                        help="write the reason of a configuration refusal to this file descriptor")


def forced_stop(broker: StandmeetBroker | None, closed: threading.Event, *,
                timeout_s: float = FORCED_STOP_S) -> None:
    """A deliberate second Ctrl-C: give the running and prefetched jobs back to their
    queues (no crash counted: they run again elsewhere) and record this process as
    stopped, within ``timeout_s``; then exit with status 1, whatever the threads do.

    Returns at once (it may be called from a signal handler): the work is done on threads
    of its own. ``closed`` is set once the main thread has closed the broker itself."""
    from broker import detach

    jobs = running_jobs.now()
    for job in jobs:
        logger.warning("cut off by the forced stop: %s %s after %.1f s; given back to its queue, it runs again "
                       "(no crash counted)", job.actor, job.message_id, time.monotonic() - job.started)
    given_back = threading.Event()
    closing_elsewhere = broker is None or broker.closing  # then the main thread's close is awaited

    def give_back(stop: threading.Event) -> None:
        if broker is not None and not closing_elsewhere:
            broker.close()  # outcomes written, claims given back, the process recorded as stopped
        given_back.set()

    def exit_when_given_back(stop: threading.Event) -> None:
        deadline = time.monotonic() + timeout_s
        done = given_back.wait(timeout_s)
        if done and closing_elsewhere and broker is not None:
            done = closed.wait(max(0.0, deadline - time.monotonic()))
        if not done:
            logger.error("forced stop: the jobs were not given back within %g s; rescue gives them back "
                         "(a crash may be counted)", timeout_s)
        for handler in logging.getLogger().handlers:
            handler.flush()
        os._exit(1)

    detach.go("forced-stop", give_back)
    detach.go("forced-stop-exit", exit_when_given_back)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m broker.worker", description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", default=["actors"], help="modules that declare actors (default: actors)")
    parser.add_argument("--queues", nargs="*", help="queues to serve (default: all)")
    parser.add_argument("--threads", type=int, default=0, help="worker threads (default: the sum of the served queues' limits)")
    parser.add_argument("--worker-shutdown-timeout", type=int, default=None, metavar="MS",
                        help="wait this long for running jobs on SIGTERM (default: STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S)")
    add_supervision_arguments(parser)
    args = parser.parse_args(argv)
    if args.supervised_by is not None and not die_with_supervisor(args.supervised_by):
        print(f"worker: its supervisor (pid {args.supervised_by}) is gone: not starting", file=sys.stderr)
        return 1
    from broker.observability.logs import configure_logging

    log_format = (os.environ.get("STANDMEET_LOG_FORMAT") or "text").strip().lower()
    configure_logging("json" if log_format == "json" else "text")

    stop = threading.Event()
    closed = threading.Event()
    first_signal_at: list[float] = []
    forced: list[bool] = []
    broker: StandmeetBroker | None = None

    def on_signal(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            # Ctrl-C reaches the whole process group and `run` forwards a SIGTERM a few ms
            # later (so do systemd and `timeout`): only a deliberate second Ctrl-C, more than
            # FORCE_AFTER_S after the first signal, cuts the running jobs off.
            if forced:
                return
            if signum == signal.SIGINT and time.monotonic() - first_signal_at[0] > FORCE_AFTER_S:
                forced.append(True)
                logger.warning("second Ctrl-C: exiting now; running jobs are given back and run again, "
                               "this process is recorded as stopped")
                forced_stop(broker, closed)
                return
            logger.info("received %s while shutting down: still waiting for running jobs "
                        "(a second Ctrl-C after %g s forces the exit)", name, FORCE_AFTER_S)
            return
        first_signal_at.append(time.monotonic())
        logger.info("received %s: shutting down", name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    from broker.errors import ConfigError, StandmeetError

    try:
        check_worker_numbers(threads=args.threads, shutdown_ms=args.worker_shutdown_timeout)
        import dramatiq

        from broker.pg.budget import process_connections, served_queues
        from broker.services import current_broker

        load_modules(args.modules)
        broker = current_broker()
        queues = served_queues(args.queues)
        threads = args.threads or 1
        connections = process_connections(broker.settings, queues, threads=threads)
        shutdown_ms = args.worker_shutdown_timeout
        if shutdown_ms is None:
            shutdown_ms = int(broker.settings.worker_shutdown_timeout_s * 1000)
        if stop.is_set():
            logger.info("worker stopped before it started")
            return 0
        broker.emit_after("process_boot")
        # What is loaded by now lives as long as the process: each full collection would
        # scan it again with every thread stopped (15-23 ms here); frozen, it is skipped
        # (a full collection then takes a fraction of a millisecond).
        import gc

        gc.collect()
        gc.freeze()
        worker = dramatiq.Worker(broker, queues=args.queues or None, worker_threads=threads,
                                 worker_timeout=WORKER_POLL_MS)
        # the shutdown names the jobs it waits for, and for how long (middleware.GracefulShutdown)
        setattr(worker, SHUTDOWN_MS_ATTRIBUTE, shutdown_ms)
        worker.start()  # the connection budget and the declared start-up checks refuse here
    except ConfigError as exc:
        return refuse("worker", str(exc), args.refusal_fd)
    except StandmeetError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 1
    logger.info("worker ready: queues %s; %s", ", ".join(queues), connections.describe())
    stop.wait()
    worker.stop(timeout=shutdown_ms)
    broker.close()
    closed.set()
    if forced:
        return 1
    logger.info("worker stopped")
    return 0


if __name__ == "__main__":
    # Run as ``python -m broker.worker``: the module the middleware imports (its running
    # jobs, its constants) is ``broker.worker``, not this ``__main__`` copy of it.
    from broker import worker as this_module

    sys.exit(this_module.main())
