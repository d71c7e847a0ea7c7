"""The test actors, in worker processes that log each job and count it for Prometheus.

``python -m broker.worker tests.support.observed_jobs`` (or ``standmeet-jobs run
tests.support.observed_jobs``): the job-log and metrics middleware are in the default
stack; logging follows ``STANDMEET_LOG_FORMAT``.
"""

from __future__ import annotations

import dramatiq

import tests.support.jobs  # noqa: F401  (the test actors, and the configured broker)
from broker.observability.logs import configure_logging
from broker.settings import Settings


@dramatiq.actor(actor_name="observed.fail", queue_name="index", max_retries=0)
def fail(label: str = "") -> None:
    raise ValueError(f"{label} cannot be done")


configure_logging(Settings.from_env().log_format)
