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
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import dramatiq

from broker.errors import StandmeetError

logger = logging.getLogger("standmeet.worker")

#: How often idle worker threads look for a shutdown (Dramatiq's default is 1 s).
WORKER_POLL_MS = 100
#: A second Ctrl-C forces the exit only this long after the first signal.
FORCE_AFTER_S = 1.0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m broker.worker", description=__doc__.split("\n")[0])
    parser.add_argument("modules", nargs="*", default=["actors"], help="modules that declare actors (default: actors)")
    parser.add_argument("--queues", nargs="*", help="queues to serve (default: all)")
    parser.add_argument("--threads", type=int, default=0, help="worker threads (default: the sum of the limits)")
    parser.add_argument("--worker-shutdown-timeout", type=int, default=None, metavar="MS",
                        help="wait this long for running jobs on SIGTERM (default: STANDMEET_WORKER_SHUTDOWN_TIMEOUT_S)")
    args = parser.parse_args(argv)
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
        for module in args.modules:
            importlib.import_module(module)
        from broker.pgbroker import current_broker

        broker = current_broker()
        shutdown_ms = args.worker_shutdown_timeout
        if shutdown_ms is None:
            shutdown_ms = int(broker.settings.worker_shutdown_timeout_s * 1000)
        broker.emit_after("process_boot")
        # What is loaded by now lives as long as the process: each full collection would
        # scan it again with every thread stopped (15-23 ms here); frozen, it is skipped
        # (a full collection then takes a fraction of a millisecond).
        gc.collect()
        gc.freeze()
        worker = dramatiq.Worker(broker, queues=args.queues or None, worker_threads=args.threads or 1,
                                 worker_timeout=WORKER_POLL_MS)
        worker.start()
    except StandmeetError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 1
    logger.info("worker ready: queues %s", ", ".join(args.queues or sorted(broker.queues)))
    stop.wait()
    worker.stop(timeout=shutdown_ms)
    broker.close()
    logger.info("worker stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
