"""An actor for the dashboard's tests: it fails for good on its first run and succeeds
on any later one, so only an operator's retry can make it done.

Runs under ``python -m broker.worker tests.support.dashboard_jobs --queues index``.
"""

from __future__ import annotations

import dramatiq

from tests.support.jobs import bump, record_finish, record_start


@dramatiq.actor(actor_name="test.fail_until_retried", queue_name="index", max_retries=0)
def fail_until_retried(key: str) -> None:
    run = record_start("test.fail_until_retried", "index", key)
    if bump(key) == 1:
        raise RuntimeError(f"{key}: the first run fails, an operator's retry succeeds")
    record_finish(run)
