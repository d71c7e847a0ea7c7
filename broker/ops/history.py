"""What an operator view reads of the past: per-minute history and every job's attempts.

The workers write both as they settle (``broker.engine.sql_history.RECORD_RAN``: ``standmeet.queue_history``
and ``standmeet.job_attempts``, migration 0022); nothing here reads ``dramatiq.queue``, so
no view of the past costs the queue anything. Percentiles are estimated from the fixed
histograms (``broker.engine.sql_history.HISTORY_BOUNDS_MS``), interpolated linearly inside the bucket
they fall in: an estimate is never outside the bucket that holds the true value.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg

from broker.engine.sql_history import HISTORY_BOUNDS_MS

_BUCKETS = len(HISTORY_BOUNDS_MS)
_COUNTS = ("done", "failed", "rejected", "cancelled", "snoozed", "timed_out", "crashed", "given_back")


def _summed(column: str) -> str:
    """Histograms of a group added element by element."""
    return "ARRAY[" + ", ".join(f"coalesce(sum(h.{column}[{i}]), 0)" for i in range(1, _BUCKETS + 1)) + "]::bigint[]"


_AGGREGATES = (", ".join(f"coalesce(sum(h.{c}), 0)::bigint" for c in _COUNTS)
               + ", coalesce(sum(h.wait_count), 0)::bigint, coalesce(sum(h.wait_sum_ms), 0)::float8, "
               + _summed("wait_hist")
               + ", coalesce(sum(h.run_count), 0)::bigint, coalesce(sum(h.run_sum_ms), 0)::float8, "
               + _summed("run_hist"))

_FILTER = """
      AND h.minute < coalesce(%(until)s::timestamptz, now())
      AND (%(queue)s::text IS NULL OR h.queue_name = %(queue)s::text)
      AND (%(actor)s::text IS NULL OR h.actor_name = %(actor)s::text)"""

#: The window's buckets of ``bucket_s`` seconds, aligned on the epoch, from the one
#: holding ``since`` to the one holding ``until`` (default: now): the grid both series
#: fill, so that every bucket is present.
_WINDOW_GRID = """
WITH span AS (
    SELECT floor(EXTRACT(EPOCH FROM %(since)s::timestamptz)::float8 / %(bucket_s)s) * %(bucket_s)s AS first_s,
           floor(EXTRACT(EPOCH FROM coalesce(%(until)s::timestamptz, now()))::float8 / %(bucket_s)s) * %(bucket_s)s
               AS last_s
), grid AS (
    SELECT to_timestamp(s::float8) AS bucket
    FROM span, generate_series(span.first_s::numeric, span.last_s::numeric, %(bucket_s)s::numeric) AS s
)
"""

#: The history of some queues and actors (all when NULL) cut into buckets of ``bucket_s``
#: seconds, aligned on the epoch, from the one holding ``since`` to the one holding
#: ``until`` (default: now), every bucket present (empty ones with no row of history).
SERIES = _WINDOW_GRID + """, per_bucket AS (
    SELECT to_timestamp(floor(EXTRACT(EPOCH FROM h.minute)::float8 / %(bucket_s)s) * %(bucket_s)s) AS bucket,
           """ + _AGGREGATES + """
    FROM standmeet.queue_history h
    WHERE h.minute >= (SELECT to_timestamp(first_s) FROM span)""" + _FILTER + """
    GROUP BY 1
)
SELECT grid.bucket, per_bucket.*
FROM grid LEFT JOIN per_bucket ON per_bucket.bucket = grid.bucket
ORDER BY grid.bucket
"""

#: The history of each queue since ``since`` (to ``until``, default now), every shard and
#: actor added together; the seconds the window spans come first (from the start of the
#: minute ``since`` falls in: the first minute counted is counted whole).
SUMMARY = """
SELECT EXTRACT(EPOCH FROM coalesce(%(until)s::timestamptz, now()) - date_trunc('minute', %(since)s::timestamptz))::float8,
       h.queue_name, """ + _AGGREGATES + """
FROM standmeet.queue_history h
WHERE h.minute >= date_trunc('minute', %(since)s::timestamptz)""" + _FILTER + """
GROUP BY h.queue_name
ORDER BY h.queue_name
"""

#: The history of each queue (or only ``queue``) in buckets as :data:`SERIES` cuts them, in
#: one statement: every bucket of every queue with history in the window (and of ``queue``
#: even without any), queue by queue, oldest first.
SERIES_BY_QUEUE = _WINDOW_GRID + """, per_bucket AS (
    SELECT h.queue_name,
           to_timestamp(floor(EXTRACT(EPOCH FROM h.minute)::float8 / %(bucket_s)s) * %(bucket_s)s) AS bucket,
           """ + _AGGREGATES + """
    FROM standmeet.queue_history h
    WHERE h.minute >= (SELECT to_timestamp(first_s) FROM span)""" + _FILTER + """
    GROUP BY 1, 2
), queues AS (
    SELECT DISTINCT queue_name FROM per_bucket
    UNION SELECT %(queue)s::text WHERE %(queue)s::text IS NOT NULL
)
SELECT queues.queue_name, grid.bucket, per_bucket.*
FROM queues CROSS JOIN grid
LEFT JOIN per_bucket ON per_bucket.queue_name = queues.queue_name AND per_bucket.bucket = grid.bucket
ORDER BY queues.queue_name, grid.bucket
"""

#: Every run of a message, first first, with the host and pid of the process that ran it
#: (while its row of ``standmeet.worker_processes`` is kept).
ATTEMPTS = """
SELECT a.attempt, a.outcome, a.worker_id::text, a.started_at, a.ended_at, a.error, a.queue_name, a.actor_name,
       w.hostname, w.pid
FROM standmeet.job_attempts a
LEFT JOIN standmeet.worker_processes w ON w.id = a.worker_id
WHERE a.message_id = %(message_id)s::uuid
ORDER BY a.attempt, a.ended_at
"""


@dataclass(frozen=True)
class Figures:
    """What a stretch of history counts: runs by outcome, and wait and run times.

    ``failed`` are runs retried, ``rejected`` runs failed for good (both include the
    ``timed_out``); ``crashed`` started runs whose process died (rescued); ``given_back``
    started runs cut at a graceful shutdown or interrupted by a step-down. Times are in
    milliseconds, None when nothing was measured; ``throughput_per_s`` is runs done per
    second of the stretch."""

    seconds: float
    done: int
    failed: int
    rejected: int
    cancelled: int
    snoozed: int
    timed_out: int
    crashed: int
    given_back: int
    wait_count: int
    wait_mean_ms: float | None
    wait_p50_ms: float | None
    wait_p95_ms: float | None
    run_count: int
    run_mean_ms: float | None
    run_p50_ms: float | None
    run_p95_ms: float | None
    wait_hist: tuple[int, ...]
    run_hist: tuple[int, ...]

    @property
    def failures(self) -> int:
        """Runs that failed (retried or for good) or died with their process."""
        return self.failed + self.rejected + self.crashed

    @property
    def throughput_per_s(self) -> float:
        return self.done / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        """The figures as ``status --json`` and the dashboard give them (histograms left out)."""
        fields = {k: v for k, v in vars(self).items() if k not in ("wait_hist", "run_hist")}
        return {**fields, "failures": self.failures, "throughput_per_s": round(self.throughput_per_s, 3)}


@dataclass(frozen=True)
class SeriesPoint:
    """One bucket of a series: it starts at ``start`` and lasts ``figures.seconds``."""

    start: datetime
    figures: Figures


@dataclass(frozen=True)
class QueueSummary:
    """One queue's history over a window."""

    queue: str
    figures: Figures

    def as_json(self) -> dict[str, Any]:
        return {"name": self.queue, **self.figures.as_json()}


@dataclass(frozen=True)
class Attempt:
    """One run of a job. ``attempt`` is its claim number; ``outcome`` one of done, failed
    (retried), rejected, cancelled, snoozed, timeout, crashed (its process died; rescued),
    cut_at_shutdown (given back by a graceful stop), interrupted (its worker stepped
    down); ``started_at`` is None when it never started; ``run_ms`` is None then."""

    attempt: int
    outcome: str
    worker_id: str | None
    started_at: datetime | None
    ended_at: datetime
    error: str | None
    queue: str
    actor: str
    #: the host and pid of the process that ran it, None once its record is gone
    worker_host: str | None = None
    worker_pid: int | None = None

    @property
    def run_ms(self) -> float | None:
        if self.started_at is None:
            return None
        return (self.ended_at - self.started_at).total_seconds() * 1000

    def as_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "outcome": self.outcome, "worker_id": self.worker_id,
                "started_at": self.started_at.isoformat() if self.started_at else None,
                "ended_at": self.ended_at.isoformat(), "run_ms": self.run_ms, "error": self.error,
                "queue": self.queue, "actor": self.actor, "worker_host": self.worker_host,
                "worker_pid": self.worker_pid}


def percentile_ms(hist: Sequence[int], q: float) -> float | None:
    """The ``q`` quantile (0 < q <= 1) of the values a histogram over HISTORY_BOUNDS_MS
    counts, interpolated inside its bucket (the open last bucket gives its lower bound);
    None for an empty histogram."""
    if not 0 < q <= 1:
        raise ValueError(f"a quantile is in (0, 1], not {q}")
    total = sum(hist)
    if total == 0:
        return None
    rank = q * total
    seen = 0
    for i, count in enumerate(hist):
        if count and seen + count >= rank:
            low = float(HISTORY_BOUNDS_MS[i])
            if i + 1 >= len(HISTORY_BOUNDS_MS):
                return low
            return low + (rank - seen) / count * (HISTORY_BOUNDS_MS[i + 1] - low)
        seen += count
    return float(HISTORY_BOUNDS_MS[-1])


def _figures(seconds: float, row: Sequence[Any]) -> Figures:
    """Figures from the aggregates of _AGGREGATES, in order (all None: an empty bucket)."""
    counts = [int(v or 0) for v in row[:len(_COUNTS)]]
    wait_count, wait_sum, wait_hist, run_count, run_sum, run_hist = row[len(_COUNTS):len(_COUNTS) + 6]
    wait = tuple(int(v) for v in wait_hist) if wait_hist is not None else (0,) * _BUCKETS
    run = tuple(int(v) for v in run_hist) if run_hist is not None else (0,) * _BUCKETS
    wait_count, run_count = int(wait_count or 0), int(run_count or 0)
    done, failed, rejected, cancelled, snoozed, timed_out, crashed, given_back = counts
    return Figures(
        seconds, done=done, failed=failed, rejected=rejected, cancelled=cancelled, snoozed=snoozed,
        timed_out=timed_out, crashed=crashed, given_back=given_back,
        wait_count=wait_count, wait_mean_ms=float(wait_sum) / wait_count if wait_count else None,
        wait_p50_ms=percentile_ms(wait, 0.5), wait_p95_ms=percentile_ms(wait, 0.95),
        run_count=run_count, run_mean_ms=float(run_sum) / run_count if run_count else None,
        run_p50_ms=percentile_ms(run, 0.5), run_p95_ms=percentile_ms(run, 0.95),
        wait_hist=wait, run_hist=run,
    )


def series(conn: psycopg.Connection[Any], *, since: datetime, bucket_s: int, queue: str | None = None,
           actor: str | None = None, until: datetime | None = None) -> list[SeriesPoint]:
    """The history of ``queue`` and ``actor`` (every one when None) from ``since`` to
    ``until`` (default: now, by the database's clock) in buckets of ``bucket_s`` seconds
    (a whole number of minutes, aligned on the epoch), oldest first, empty buckets included."""
    if bucket_s < 60 or bucket_s % 60:
        raise ValueError(f"a bucket is a whole number of minutes (history is kept per minute), not {bucket_s} s")
    rows = conn.execute(SERIES, {"since": since, "until": until, "bucket_s": bucket_s,
                                 "queue": queue, "actor": actor}).fetchall()
    return [SeriesPoint(row[0], _figures(float(bucket_s), row[2:])) for row in rows]


def series_by_queue(conn: psycopg.Connection[Any], *, since: datetime, bucket_s: int, queue: str | None = None,
                    until: datetime | None = None) -> dict[str, list[SeriesPoint]]:
    """:func:`series` of each queue with history in the window (only ``queue`` when given,
    every bucket zero when it has none), by queue name, in one statement."""
    if bucket_s < 60 or bucket_s % 60:
        raise ValueError(f"a bucket is a whole number of minutes (history is kept per minute), not {bucket_s} s")
    rows = conn.execute(SERIES_BY_QUEUE, {"since": since, "until": until, "bucket_s": bucket_s,
                                          "queue": queue, "actor": None}).fetchall()
    out: dict[str, list[SeriesPoint]] = {}
    for row in rows:
        out.setdefault(row[0], []).append(SeriesPoint(row[1], _figures(float(bucket_s), row[4:])))
    return out


def summary(conn: psycopg.Connection[Any], *, since: datetime, until: datetime | None = None,
            queue: str | None = None) -> list[QueueSummary]:
    """Each queue's history from ``since`` to ``until`` (default now), by queue name;
    queues with no history in the window are absent."""
    rows = conn.execute(SUMMARY, {"since": since, "until": until, "queue": queue, "actor": None}).fetchall()
    return [QueueSummary(row[1], _figures(float(row[0]), row[2:])) for row in rows]


def attempts(conn: psycopg.Connection[Any], message_id: str | uuid.UUID) -> list[Attempt]:
    """Every run of a message that history keeps, first first."""
    rows = conn.execute(ATTEMPTS, {"message_id": str(message_id)}).fetchall()
    return [Attempt(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8], None if r[9] is None else int(r[9]))
            for r in rows]
