"""Prometheus metrics per job, with Dramatiq's names and labels (``queue_name``,
``actor_name``), so existing Dramatiq dashboards work; plus ours: snoozes (those
labelled :data:`middleware.snooze.LEASE_BUSY` also as lease busy), claim-to-start latency (when the consumer stamps the claim time on the
message as ``standmeet_claimed_at``, a ``time.time()`` value).

The metric objects live in :mod:`broker.observability.metrics`. Under ``standmeet-jobs run`` every
worker process writes them to ``PROMETHEUS_MULTIPROC_DIR`` and ``run`` serves them on
one ``/metrics``. Placed before ``Retries`` in the middleware list, so its after-hooks
see the retry policy's decision: a failure either retries or is rejected.
"""

from __future__ import annotations

import time
from typing import Any

from dramatiq import Middleware

from broker.observability import metrics
from middleware.snooze import LEASE_BUSY, Snooze


class Metrics(Middleware):
    """Stamps each run's start on its message proxy (one per run), not in a map by id:
    a retry of the same message may start before this run's after-hooks are done."""

    def after_process_boot(self, broker: Any) -> None:
        listeners = getattr(broker, "rescue_listeners", None)
        if listeners is not None and metrics.count_rescues not in listeners:
            listeners.append(metrics.count_rescues)  # what this process's rescue passes did

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        self.after_process_boot(broker)  # an embedded Worker emits only worker_boot

    def before_process_message(self, broker: Any, message: Any) -> None:
        labels = (message.queue_name, message.actor_name)
        metrics.child(metrics.IN_PROGRESS, *labels).inc()
        now = time.time()
        claimed_at = getattr(message, "standmeet_claimed_at", None)
        if claimed_at is not None:
            metrics.child(metrics.CLAIM_TO_START, message.queue_name).observe(max(0.0, now - float(claimed_at)))
        message.standmeet_metrics_start = time.monotonic()

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        labels = (message.queue_name, message.actor_name)
        self._ended(message, labels)
        if exception is not None:
            metrics.child(metrics.ERRORS, *labels).inc()
            if not getattr(message, "failed", False):
                metrics.child(metrics.RETRIES, *labels).inc()

    def after_skip_message(self, broker: Any, message: Any) -> None:
        labels = (message.queue_name, message.actor_name)
        self._ended(message, labels)
        snooze = getattr(message, "_exception", None)
        if isinstance(snooze, Snooze) and not getattr(message, "failed", False):
            metrics.child(metrics.SNOOZES, *labels).inc()
            if snooze.label == LEASE_BUSY:
                metrics.child(metrics.LEASE_BUSY, *labels).inc()

    def after_nack(self, broker: Any, message: Any) -> None:
        metrics.child(metrics.REJECTS, message.queue_name, message.actor_name).inc()

    def _ended(self, message: Any, labels: tuple[str, str]) -> None:
        started = getattr(message, "standmeet_metrics_start", None)
        message.standmeet_metrics_start = None
        if started is None:
            return  # its before-hook never ran (skipped by an earlier middleware)
        metrics.child(metrics.IN_PROGRESS, *labels).dec()
        metrics.child(metrics.DURATION, *labels).observe((time.monotonic() - started) * 1000)
        metrics.child(metrics.MESSAGES, *labels).inc()
