"""The scheduler process: ``python -m periodic`` (a process entry point).

Checks the connection budget, then ticks every periodic job on its interval with
APScheduler until SIGTERM or Ctrl-C. Run two of them: each period still runs once.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from broker.budget import check_budget
from broker.errors import StandmeetError
from broker.settings import Settings

logger = logging.getLogger("periodic")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings.from_env()
    try:
        budget = check_budget(settings)
    except StandmeetError as exc:
        print(f"periodic: {exc}", file=sys.stderr)
        return 1
    logger.info("connection budget: %s", budget.describe())

    import actors  # noqa: F401  (configures the broker, declares the actors)
    from broker.pgbroker import current_broker
    from periodic import PERIODIC_JOBS, tick, utcnow

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())

    scheduler = BackgroundScheduler(timezone="UTC")
    now = utcnow()
    for job in PERIODIC_JOBS:
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
    logger.info("scheduler running %d periodic job(s)", len(PERIODIC_JOBS))
    stop.wait()
    logger.info("stopping the scheduler")
    scheduler.shutdown(wait=True)
    current_broker().close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
