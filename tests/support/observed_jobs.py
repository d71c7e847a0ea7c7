"""The test actors, in worker processes that log each job and count it for Prometheus.

``python -m broker.worker tests.support.observed_jobs`` (or ``standmeet-jobs run
--module tests.support.observed_jobs``): the job-log and metrics middleware are added
where ``middleware.default_middleware`` is to place them, just before ``Retries``, and
logging follows ``STANDMEET_LOG_FORMAT`` as the worker entry point is to do.
"""

from __future__ import annotations

import dramatiq

import tests.support.jobs  # noqa: F401  (the test actors, and the configured broker)
from broker.logging_setup import configure_logging
from broker.pgbroker import current_broker
from broker.settings import Settings
from middleware.job_log import JobLog
from middleware.metrics import Metrics
from middleware.retries import Retries


def observe(broker: dramatiq.Broker) -> None:
    """Add the job log and the metrics to ``broker``, before the retry policy."""
    for middleware in (JobLog(), Metrics()):
        if not any(type(m) is type(middleware) for m in broker.middleware):
            broker.add_middleware(middleware, before=Retries)


@dramatiq.actor(actor_name="observed.fail", queue_name="index", max_retries=0)
def fail(label: str = "") -> None:
    raise ValueError(f"{label} cannot be done")


observe(current_broker())
configure_logging(Settings.from_env().log_format)
