"""A worker process: ``python -m broker.worker`` (a process entry point).

The same Dramatiq worker as ``dramatiq actors``, in one process with no fork manager:
SIGTERM starts the shutdown at once (Dramatiq's CLI polls for it every second and
waits up to a second more for its log pipe), so a deploy waits only for the jobs.

    python -m broker.worker [--queues Q …] [--threads N] [--worker-shutdown-timeout MS] [MODULE …]

On SIGTERM or Ctrl-C: claim nothing more, give back prefetched messages, wait up to
the shutdown timeout for running jobs, record the process as stopped and exit. Jobs
still running are cut off and rescued by another worker (at least once). Further
signals within a second (a group's Ctrl-C, then `run`'s SIGTERM) change nothing; a
deliberate second Ctrl-C later exits at once, saying so, with status 1.

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
import ctypes
import gc
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
from typing import NoReturn

import dramatiq

from broker.errors import ConfigError, ModuleNotLoaded, StandmeetError

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


def load_modules(modules: Sequence[str]) -> None:
    """Import the modules that declare actors, queues and commands.

    A module that cannot load raises :class:`ModuleNotLoaded`: one line naming it and why
    (and where, for an error inside it); our own errors raised by its import (a malformed
    setting, an unreachable database) stay what they are."""
    for module in modules:
        try:
            importlib.import_module(module)
        except StandmeetError:
            raise
        except ModuleNotFoundError as exc:
            if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
                raise ModuleNotLoaded(f"cannot load module {module!r}: no module named {exc.name!r}") from None
            raise ModuleNotLoaded(f"cannot load module {module!r}: {exc}{_where(exc)}") from None
        except Exception as exc:
            reason = (str(exc).strip().splitlines() or [""])[0]
            raise ModuleNotLoaded(f"cannot load module {module!r}: {type(exc).__name__}: {reason}{_where(exc)}") from None


def _where(exc: BaseException) -> str:
    """`` (file:line)`` of the innermost frame an exception was raised in."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}:{exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""


def add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
    """The options ``run`` gives each child it supervises."""
    parser.add_argument("--supervised-by", type=int, default=None, metavar="PID",
                        help="exit when this process (the parent, `standmeet-jobs run`) dies")
    parser.add_argument("--refusal-fd", type=int, default=None, metavar="FD",
                        help="write the reason of a configuration refusal to this file descriptor")


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
    from broker.logging_setup import configure_logging

    log_format = (os.environ.get("STANDMEET_LOG_FORMAT") or "text").strip().lower()
    configure_logging("json" if log_format == "json" else "text")

    stop = threading.Event()
    first_signal_at: list[float] = []

    def on_signal(signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            # Ctrl-C reaches the whole process group and `run` forwards a SIGTERM a few ms
            # later (so do systemd and `timeout`): only a deliberate second Ctrl-C, more than
            # FORCE_AFTER_S after the first signal, cuts the running jobs off.
            if signum == signal.SIGINT and time.monotonic() - first_signal_at[0] > FORCE_AFTER_S:
                logger.warning("second Ctrl-C: exiting now; running jobs are cut off and will run again")
                os._exit(1)
            logger.info("received %s while shutting down: still waiting for running jobs "
                        "(a second Ctrl-C after %g s forces the exit)", name, FORCE_AFTER_S)
            return
        first_signal_at.append(time.monotonic())
        logger.info("received %s: shutting down", name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)

    try:
        check_worker_numbers(threads=args.threads, shutdown_ms=args.worker_shutdown_timeout)
        from broker.budget import process_connections, served_queues
        from broker.pgbroker import current_broker

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
        gc.collect()
        gc.freeze()
        worker = dramatiq.Worker(broker, queues=args.queues or None, worker_threads=threads,
                                 worker_timeout=WORKER_POLL_MS)
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
    logger.info("worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
