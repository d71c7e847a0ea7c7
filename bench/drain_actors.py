"""The actors of the drain benchmarks (``bench/cost_curve.py``, ``bench/scale.py``).

A worker process serves them with ``python -m broker.worker bench.drain_actors --queues
index``. ``bench.noop`` does nothing but count how many of its runs overlap in this
process; when ``BENCH_STATS_DIR`` is set, the most seen at once is written to
``<dir>/<pid>.max`` each time it grows, so the scripts can check the per-process limit.
"""

from __future__ import annotations

import os
import threading

import dramatiq

import broker as infra

infra.configure()

_lock = threading.Lock()
_running = 0
_most = 0
_stats_dir = os.environ.get("BENCH_STATS_DIR")


def _record_most(value: int) -> None:
    if _stats_dir:
        with open(os.path.join(_stats_dir, f"{os.getpid()}.max"), "w") as out:
            out.write(str(value))


@dramatiq.actor(queue_name="index", actor_name="bench.noop", max_retries=0)
def noop(i: int) -> None:
    global _running, _most
    with _lock:
        _running += 1
        grew = _running > _most
        if grew:
            _most = _running
            _record_most(_most)
    with _lock:
        _running -= 1
