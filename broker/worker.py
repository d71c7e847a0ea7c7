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
unknown queue, a module that cannot load) exits with :data:`broker.exits.CONFIG_REFUSED_EXIT` after
one line saying why; any other failure is a crash. Started by ``standmeet-jobs run``
(``--supervised-by``), it dies with it: Linux sends it SIGTERM when ``run`` dies, and it
tells ``run`` its refusal on ``--refusal-fd``, so that ``run`` stops with that reason
instead of starting it again. :func:`~broker.boot.die_with_supervisor` and :func:`~broker.boot.refuse` serve
every process ``run`` supervises the same way.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from broker.boot import (
    OneLineParser,
    add_process_arguments,
    boot,
    refuse,
    supervisor_gone,
)
from broker.exits import FORCE_AFTER_S
from broker.running import SHUTDOWN_MS_ATTRIBUTE, running_jobs

# Only what ``--help`` needs is imported here: Dramatiq, psycopg and the application are
# imported by the commands that use them.
if TYPE_CHECKING:
    from broker.engine.broker import StandmeetBroker

logger = logging.getLogger("standmeet.worker")

#: How often idle worker threads look for a shutdown (Dramatiq's default is 1 s).
WORKER_POLL_MS = 100
#: How often the main thread looks for a signal another thread caught (see ``main``).
SIGNAL_LOOK_S = 0.5
#: The most threads one worker process may be given (``--threads``).
THREADS_MOST = 10_000
#: The longest ``--worker-shutdown-timeout``: a day, as STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S allows.
SHUTDOWN_TIMEOUT_MOST_MS = 86_400_000
#: A forced stop (a deliberate second Ctrl-C) gives the running jobs back and records the
#: process as stopped within this, then exits whatever happened.
FORCED_STOP_S = 3.0


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
    add_process_arguments(parser, declaring="actors")
    parser.add_argument("--queues", nargs="*", help="queues to serve (default: all)")
    parser.add_argument("--threads", type=int, default=0, help="worker threads (default: the sum of the served queues' limits)")
    parser.add_argument("--worker-shutdown-timeout", type=int, default=None, metavar="MS",
                        help="wait this long for running jobs on SIGTERM (default: STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S)")
    args = parser.parse_args(argv)
    if supervisor_gone("worker", args):
        return 1
    from broker.observability.logs import configure_logging

    log_format = (os.environ.get("STANDMEET_LOG_FORMAT") or "text").strip().lower()
    configure_logging("json" if log_format == "json" else "text")
    from broker.observability.stacks import dump_stacks_on_request

    dump_stacks_on_request()

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

        broker = boot(args.modules)
        from broker.pg.preflight import wait_until_migrated

        if not wait_until_migrated(broker.url, stop=stop, who="worker"):
            logger.info("worker stopped before it started")
            return 0
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
    # Timed, not one wait: a SIGTERM that lands while this thread cannot take it (it was
    # creating the worker's threads, which blocks every signal for a moment) is caught by
    # another thread, and only this one runs the handler; it does so once it takes the
    # interpreter again. One untimed wait would never return: the worker would never stop.
    while not stop.wait(SIGNAL_LOOK_S):
        pass
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
