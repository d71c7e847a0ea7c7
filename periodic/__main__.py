"""The scheduler process: ``python -m periodic`` (a process entry point).

Checks the connection budget, starts the outbox relay (every process runs one), then
ticks every periodic job on its period boundaries with APScheduler until SIGTERM or
Ctrl-C (the relay is stopped first). Run two of them: each period still runs once.

    python -m periodic [--jobs module:ATTRIBUTE]   (default: periodic:PERIODIC_JOBS)
"""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
import threading

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from broker.budget import check_budget
from broker.errors import StandmeetError
from broker.logging_setup import configure_logging
from broker.settings import Settings

logger = logging.getLogger("periodic")


def load_jobs(path: str) -> list:  # type: ignore[type-arg]
    module, _, attribute = path.partition(":")
    return list(getattr(importlib.import_module(module), attribute or "PERIODIC_JOBS"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m periodic", description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", default="periodic:PERIODIC_JOBS", help="the table of periodic jobs")
    args = parser.parse_args(argv)
    try:
        settings = Settings.from_env()
        configure_logging(settings.log_format)
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        budget = check_budget(settings)
    except StandmeetError as exc:
        print(f"periodic: {exc}", file=sys.stderr)
        return 1
    # `run` logs the budget once for all its processes; here it is detail.
    logger.debug("connection budget: %s", budget.describe())

    import actors  # noqa: F401  (configures the broker, declares the actors and routes)
    from broker.pgbroker import current_broker
    from periodic import tick, utcnow

    jobs = load_jobs(args.jobs)
    broker = current_broker()
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    broker.start_relay()
    scheduler = BackgroundScheduler(timezone="UTC")
    now = utcnow()
    for job in jobs:
        try:  # the current period first; then on each period boundary
            tick(job)
        except Exception:
            logger.exception("periodic %s: first tick failed; the next boundary will try again", job.name)
        scheduler.add_job(
            tick, IntervalTrigger(seconds=job.interval_s, start_date=job.period_start(now)),
            args=[job], id=job.name, name=job.name, max_instances=1, coalesce=True,
            misfire_grace_time=max(1, int(job.interval_s / 2)),
        )
    scheduler.start()
    logger.info("scheduler running %d periodic job(s)", len(jobs))
    stop.wait()
    logger.info("stopping: the relay first, then the scheduler")
    broker.stop_relay()
    scheduler.shutdown(wait=True)
    broker.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
