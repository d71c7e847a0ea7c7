"""Prometheus metrics per job, with Dramatiq's names and labels (``queue_name``,
``actor_name``), so existing Dramatiq dashboards work; plus ours: snoozes (those
labelled :data:`middleware.snooze.LEASE_BUSY` also as lease busy), claim-to-start latency (when the consumer stamps the claim time on the
message as ``standmeet_claimed_at``, a ``time.time()`` value).

The metric objects live in :mod:`broker.observability.metrics`. Under ``standmeet-jobs run`` every
worker process writes them to ``PROMETHEUS_MULTIPROC_DIR`` and ``run`` serves them on
one ``/metrics``. Placed before ``Retries`` in the middleware list, so its after-hooks
see the retry policy's decision: a failure either retries or is rejected.

**Written once per batch.** On a broker that writes outcomes in batches (ours: its
``settle_listeners``), a run's hooks only note what to count, and the settler's thread
writes what the runs of a batch counted, summed, just before it writes their outcomes
(and at least twice a second while idle): a run's figures are in ``/metrics`` before its
outcome is in the database. Each value a run counts costs prometheus_client a lock, and
under ``PROMETHEUS_MULTIPROC_DIR`` a write to its file: five a job, against a handful
a batch. ``dramatiq_messages_inprogress`` goes up as a run starts, at once (a long job
is seen running), and down with its batch. On any other broker every value is
written as the run counts it.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections import deque
from typing import Any

from dramatiq import Middleware

from broker.observability import metrics
from middleware.snooze import LEASE_BUSY, Snooze

#: How a noted value is written: added (a counter, or a gauge up or down), observed (a
#: histogram), or a run's end (its children's in-progress down by one, messages up by
#: one, and its duration observed: one note where three were).
ADD, OBSERVE, ENDED = 0, 1, 2


class _Children:
    """The metric children of one (queue, actor), looked up once."""

    __slots__ = ("in_progress", "duration", "messages", "claim_to_start")

    def __init__(self, queue_name: str, actor_name: str) -> None:
        self.in_progress = metrics.child(metrics.IN_PROGRESS, queue_name, actor_name)
        self.duration = metrics.child(metrics.DURATION, queue_name, actor_name)
        self.messages = metrics.child(metrics.MESSAGES, queue_name, actor_name)
        self.claim_to_start = metrics.child(metrics.CLAIM_TO_START, queue_name)


def observe_all(histogram: Any, values: list[float]) -> None:
    """``histogram.observe(v)`` for each of ``values``, written as one addition per bucket
    and one to the sum (prometheus_client's histogram child: its bounds, bucket values and
    sum); one by one when it is not laid out so."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets) or bounds[-1] != float("inf"):
        for value in values:
            histogram.observe(value)
        return
    counts = [0] * len(bounds)
    for value in values:
        counts[bisect_left(bounds, value)] += 1  # the first bound at or above it, as observe() counts
    total.inc(sum(values))
    for i, count in enumerate(counts):
        if count:
            buckets[i].inc(count)


class Metrics(Middleware):
    """Stamps each run's start on its message proxy (one per run), not in a map by id:
    a retry of the same message may start before this run's after-hooks are done."""

    def __init__(self) -> None:
        self._children: dict[tuple[str, str], _Children] = {}
        #: (metric child, ADD or OBSERVE, value) noted by runs, written by :meth:`flush`
        self._noted: deque[tuple[Any, int, float]] = deque()
        #: whether the broker calls :meth:`flush` (else each value is written at once)
        self.batched = False

    def after_process_boot(self, broker: Any) -> None:
        listeners = getattr(broker, "rescue_listeners", None)
        if listeners is not None and metrics.count_rescues not in listeners:
            listeners.append(metrics.count_rescues)  # what this process's rescue passes did
        settle = getattr(broker, "settle_listeners", None)
        if settle is not None and self.flush not in settle:
            settle.append(self.flush)
            self.batched = True

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        self.after_process_boot(broker)  # an embedded Worker emits only worker_boot

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        self.flush()

    def _of(self, queue_name: str, actor_name: str) -> _Children:
        found = self._children.get((queue_name, actor_name))
        if found is None:
            found = self._children[(queue_name, actor_name)] = _Children(queue_name, actor_name)
        return found

    def _note(self, child: Any, how: int, value: float) -> None:
        if self.batched:
            self._noted.append((child, how, value))
        elif how == ADD:
            child.inc(value)
        else:
            child.observe(value)

    def flush(self) -> int:
        """Write what the runs noted since the last flush, summed; how many notes that was
        (a run's end is one)."""
        added: dict[Any, float] = {}
        observed: dict[Any, list[float]] = {}
        noted = 0
        take = self._noted.popleft
        try:
            while True:
                child, how, value = take()
                noted += 1
                if how == ENDED:
                    ended = child.in_progress
                    added[ended] = added.get(ended, 0.0) - 1
                    ended = child.messages
                    added[ended] = added.get(ended, 0.0) + 1
                    observed.setdefault(child.duration, []).append(value)
                elif how == ADD:
                    added[child] = added.get(child, 0.0) + value
                else:
                    observed.setdefault(child, []).append(value)
        except IndexError:
            pass
        for child, amount in added.items():
            if amount:
                child.inc(amount)
        for child, values in observed.items():
            observe_all(child, values)
        return noted

    def before_process_message(self, broker: Any, message: Any) -> None:
        children = self._of(message.queue_name, message.actor_name)
        children.in_progress.inc()  # at once: a long run is seen running
        claimed_at = getattr(message, "standmeet_claimed_at", None)
        if claimed_at is not None:
            self._note(children.claim_to_start, OBSERVE, max(0.0, time.time() - float(claimed_at)))
        message.standmeet_metrics_start = time.monotonic()
        message.standmeet_metrics_children = children

    def after_process_message(self, broker: Any, message: Any, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        labels = (message.queue_name, message.actor_name)
        self._ended(message, labels)
        if exception is not None:
            self._note(metrics.child(metrics.ERRORS, *labels), ADD, 1)
            if not getattr(message, "failed", False):
                self._note(metrics.child(metrics.RETRIES, *labels), ADD, 1)

    def after_skip_message(self, broker: Any, message: Any) -> None:
        labels = (message.queue_name, message.actor_name)
        self._ended(message, labels)
        snooze = getattr(message, "_exception", None)
        if isinstance(snooze, Snooze) and not getattr(message, "failed", False):
            self._note(metrics.child(metrics.SNOOZES, *labels), ADD, 1)
            if snooze.label == LEASE_BUSY:
                self._note(metrics.child(metrics.LEASE_BUSY, *labels), ADD, 1)

    def after_nack(self, broker: Any, message: Any) -> None:
        # at once: a nack comes after its outcome was handed to be written (and after its
        # run's batch may have been), and a message is rejected once at most
        metrics.child(metrics.REJECTS, message.queue_name, message.actor_name).inc()

    def _ended(self, message: Any, labels: tuple[str, str]) -> None:
        started = getattr(message, "standmeet_metrics_start", None)
        message.standmeet_metrics_start = None
        if started is None:
            return  # its before-hook never ran (skipped by an earlier middleware)
        children = getattr(message, "standmeet_metrics_children", None) or self._of(*labels)
        if self.batched:
            self._noted.append((children, ENDED, (time.monotonic() - started) * 1000))
        else:
            children.in_progress.dec()
            children.duration.observe((time.monotonic() - started) * 1000)
            children.messages.inc()
