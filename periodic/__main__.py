"""The scheduler process: ``python -m periodic [MODULE …]`` (a process entry point).

Loads the named modules (default: ``actors``), which declare their periodic jobs
(``broker.app.periodic``) beside the runtime's own maintenance jobs; checks the
connection budget, starts the outbox relay (every process runs one), then ticks every
periodic job on its period boundaries with APScheduler until SIGTERM or Ctrl-C (the
relay is stopped first). Run two of them: each period still runs once.

    python -m periodic [MODULE …] [--jobs module:ATTRIBUTE]

Like a worker, it refuses its configuration (the budget, a bad setting, a module that
cannot load) with one line and exit status 78, and started by ``standmeet-jobs run`` it
dies with it (see :mod:`broker.worker`).
"""

from __future__ import annotations

import importlib
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from apscheduler.schedulers.background import BackgroundScheduler

from broker import services
from broker.boot import (
    OneLineParser,
    add_process_arguments,
    boot,
    load_modules,
    refuse,
    supervisor_gone,
)
from broker.errors import ConfigError, ModuleNotLoaded, StandmeetError
from broker.exits import FORCE_AFTER_S
from broker.observability.logs import configure_logging
from broker.pg.budget import (
    SCHEDULER_TICK_THREADS,
    check_budget,
    scheduler_connections,
    served_queues,
)
from broker.settings import Settings

logger = logging.getLogger("standmeet.periodic")
#: How often schedules that could not be recorded (the database down) are tried again.
PUBLISH_RETRY_S = 10.0


def load_jobs(path: str) -> list:  # type: ignore[type-arg]
    """An explicit table of jobs (``module:ATTRIBUTE``), instead of the declared ones."""
    module, _, attribute = path.partition(":")
    load_modules([module])
    try:
        return list(getattr(importlib.import_module(module), attribute))
    except (AttributeError, TypeError) as exc:
        raise ModuleNotLoaded(f"--jobs {path}: {type(exc).__name__}: {exc}") from None


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m periodic", description=__doc__.split("\n")[0])
    add_process_arguments(parser, declaring="actors and periodic jobs")
    parser.add_argument("--jobs", default=None, metavar="MODULE:ATTRIBUTE",
                        help="run only this table of periodic jobs instead of the declared ones")
    args = parser.parse_args(argv)
    if supervisor_gone("periodic", args):
        return 1
    stop = threading.Event()
    first_signal_at: list[float] = []

    def on_signal(signum: int, frame: object) -> None:
        if not first_signal_at:
            first_signal_at.append(time.monotonic())
            stop.set()
            return
        if signum == signal.SIGINT and time.monotonic() - first_signal_at[0] > FORCE_AFTER_S:
            forced_exit()

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, on_signal)
    from broker.observability.stacks import dump_stacks_on_request
    from periodic import (
        ClockWatch,
        periodic_jobs,
        publish_schedules,
        reschedule_if_stepped,
        tick_every_s,
        tick_or_say,
        trigger,
        utcnow,
    )

    try:
        settings = Settings.from_env()
        configure_logging(settings.log_format)
        dump_stacks_on_request()
        logging.getLogger("apscheduler").setLevel(logging.WARNING)
        broker = boot(args.modules, settings=settings)
        # The budget of the queues a worker of these modules serves: the one `run` checks.
        budget = check_budget(settings, served_queues())
        jobs = load_jobs(args.jobs) if args.jobs else periodic_jobs()
        names = [job.name for job in jobs]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:  # each name is one schedule, one claim per period: two would fight over it
            raise ConfigError(f"periodic job name(s) given more than once: {', '.join(twice)}")
        unknown = [f"{job.name} ({job.actor})" for job in jobs if job.actor not in broker.actors]
        if unknown:  # it could never be enqueued: every tick would fail
            raise ConfigError(f"periodic job(s) for an actor no loaded module declares: {', '.join(unknown)}")
    except ConfigError as exc:
        return refuse("periodic", str(exc), args.refusal_fd)
    except StandmeetError as exc:
        print(f"periodic: {exc}", file=sys.stderr)
        return 1
    # `run` logs the budget once for all its processes; here it is detail.
    logger.debug("connection budget: %s; %s", budget.describe(), scheduler_connections(settings).describe())
    from broker.pg.preflight import wait_until_migrated

    if stop.is_set() or not wait_until_migrated(broker.url, stop=stop, who="scheduler"):
        logger.info("scheduler stopped before it started")
        return 0

    services.current().start_relay()
    # As many tick threads as the connection budget counts for the scheduler.
    scheduler = BackgroundScheduler(timezone="UTC", executors={
        "default": {"type": "threadpool", "max_workers": SCHEDULER_TICK_THREADS}})
    # Every process shows these schedules, whatever modules it loads: recorded now, or,
    # the database down at this moment, again every PUBLISH_RETRY_S until they are.
    published = _publish(publish_schedules, jobs, said=False)
    publish_at = time.monotonic() + PUBLISH_RETRY_S
    now = utcnow()
    for job in jobs:
        # the current period first (not once stopping, nor while the database does not
        # answer: each try would wait out a connection's timeout before the scheduler, or
        # its stop, could start; its own ticks claim the period once it is back)
        if not stop.is_set() and not broker.outage.down:
            try:
                tick_or_say(job)
            except Exception:
                logger.exception("periodic %s: first tick failed; the next boundary will try again", job.name)
        scheduler.add_job(  # on its interval's boundaries, or every CRON_TICK_S for a cron job
            tick_or_say, trigger(job, now),
            args=[job], id=job.name, name=job.name, max_instances=1, coalesce=True,
            misfire_grace_time=max(1, int(tick_every_s(job) / 2)),
        )
    scheduler.start()
    logger.info("scheduler running %d periodic job(s)", len(jobs))
    clock = ClockWatch()
    while not stop.wait(1.0):
        reschedule_if_stepped(scheduler, jobs, clock)
        if not published and time.monotonic() >= publish_at:
            published = _publish(publish_schedules, jobs, said=True)
            publish_at = time.monotonic() + PUBLISH_RETRY_S
    logger.info("stopping: the relay first, then the scheduler")
    services.current().stop_relay()
    scheduler.shutdown(wait=True)
    broker.close()
    return 0


def forced_exit() -> None:
    """A deliberate second Ctrl-C (``run`` forwards one as SIGINT): exit now, status 1. A
    tick waiting on the database is cut off with its transaction, which rolls back: nothing
    is half-written, and its period is enqueued once by another scheduler, or by this one
    restarted within the period. A relay pass under way (one transaction) rolls back too:
    its events stay pending for the next relay."""
    logger.warning("second Ctrl-C: exiting now; a tick under way is rolled back (nothing half-written)")
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(1)


def _publish(publish: Callable[[Any], None], jobs: Any, *, said: bool) -> bool:
    """Record the schedules; True once done. A failure is said once (the jobs still run;
    the dashboard and ``status`` show less until they are recorded)."""
    try:
        publish(jobs)
    except Exception as exc:
        if not said:
            logger.warning("could not record the periodic schedules (trying again every %g s): %s",
                           PUBLISH_RETRY_S, str(exc).strip().splitlines()[0])
        return False
    if said:
        logger.info("recorded the periodic schedules")
    return True


if __name__ == "__main__":
    sys.exit(main())
