"""The statements of the runs' history: each run ended is one row of
``standmeet.job_attempts`` and counts in the per-minute ``standmeet.queue_history``,
written by the statement that ends it (settle, rescue, graceful stop: their tails
:data:`RAN_OF_SETTLED` and :data:`RECORD_RAN`), and pruned past its retention.
Conventions as in :mod:`broker.engine.sql`.
"""

from __future__ import annotations

#: The bounds (milliseconds) of the wait and run histograms of ``standmeet.queue_history``:
#: element i (1-based) of a histogram counts the values in [bound i, bound i+1); the last
#: one everything from the last bound up. Never change them in place: a migration would
#: have to rewrite every row.
HISTORY_BOUNDS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000,
                     300_000, 900_000, 3_600_000)
#: How many rows of one minute, queue and actor the writers spread over: a process writes
#: the shard of its id, so processes settling the same actor do not wait on one row's lock.
HISTORY_SHARDS = 8
#: Longest error text kept on an attempt.
ATTEMPT_ERROR_CHARS = 4000

_BOUNDS = "'{" + ",".join(str(b) for b in HISTORY_BOUNDS_MS) + "}'::float8[]"
_SHARD = "(hashtext(%(worker_id)s::text) & " + str(HISTORY_SHARDS - 1) + ")::smallint"


def _histogram(bucket: str) -> str:
    """The histogram of a group's ``bucket`` column (width_bucket over _BOUNDS), as an array."""
    return "ARRAY[" + ", ".join(f"count(*) FILTER (WHERE r.{bucket} = {i})"
                                for i in range(1, len(HISTORY_BOUNDS_MS) + 1)) + "]"


def _added(column: str) -> str:
    """Two histograms added element by element (an upsert's stored row and its new one)."""
    return "ARRAY[" + ", ".join(f"h.{column}[{i}] + EXCLUDED.{column}[{i}]"
                                for i in range(1, len(HISTORY_BOUNDS_MS) + 1)) + "]"


_COUNTED = ("done", "failed", "rejected", "cancelled", "snoozed", "timed_out", "crashed", "given_back",
            "wait_count", "wait_sum_ms", "run_count", "run_sum_ms")

#: The tail of every statement that ends runs: from its CTE ``ran`` (message_id, attempt,
#: queue_name, actor_name, worker_id, outcome, state, started_at, ended_at, error, wait_ms,
#: run_ms: one row per run ended, ``state`` the message's state after it, ``wait_ms`` and
#: ``run_ms`` NULL when not measured), one row per run into ``standmeet.job_attempts`` and
#: one upsert of the runs' per-minute counts and histograms into
#: ``standmeet.queue_history`` (this process's shard), in the statement (and transaction)
#: that ends them: a run is counted exactly when its outcome is written. The groups are
#: written in key order, so two writers of a shard never lock its rows in opposite orders.
RECORD_RAN = """, attempted AS (
    INSERT INTO standmeet.job_attempts
        (message_id, attempt, queue_name, actor_name, worker_id, started_at, ended_at, outcome, error)
    SELECT message_id, attempt, queue_name, actor_name, worker_id, started_at, ended_at, outcome,
           left(error, """ + str(ATTEMPT_ERROR_CHARS) + """)
    FROM ran
), rolled_up AS (
    INSERT INTO standmeet.queue_history AS h
        (minute, queue_name, actor_name, shard, """ + ", ".join(_COUNTED[:8]) + """,
         wait_count, wait_sum_ms, wait_hist, run_count, run_sum_ms, run_hist)
    SELECT date_trunc('minute', r.ended_at), r.queue_name, r.actor_name, """ + _SHARD + """,
           count(*) FILTER (WHERE r.outcome = 'done'),
           count(*) FILTER (WHERE r.state = 'queued' AND r.outcome IN ('failed', 'timeout')),
           count(*) FILTER (WHERE r.state = 'rejected' AND r.outcome IN ('rejected', 'timeout')),
           count(*) FILTER (WHERE r.outcome = 'cancelled'),
           count(*) FILTER (WHERE r.outcome = 'snoozed'),
           count(*) FILTER (WHERE r.outcome = 'timeout'),
           count(*) FILTER (WHERE r.outcome = 'crashed'),
           count(*) FILTER (WHERE r.outcome IN ('cut_at_shutdown', 'interrupted')),
           count(r.wait_ms), coalesce(sum(r.wait_ms), 0), """ + _histogram("wait_b") + """,
           count(r.run_ms), coalesce(sum(r.run_ms), 0), """ + _histogram("run_b") + """
    FROM (SELECT ran.*, width_bucket(ran.wait_ms, """ + _BOUNDS + """) AS wait_b,
                 width_bucket(ran.run_ms, """ + _BOUNDS + """) AS run_b
          FROM ran) AS r
    GROUP BY 1, 2, 3
    ORDER BY 1, 2, 3
    ON CONFLICT (minute, queue_name, actor_name, shard) DO UPDATE SET
        """ + ", ".join(f"{c} = h.{c} + EXCLUDED.{c}" for c in _COUNTED) + """,
        wait_hist = """ + _added("wait_hist") + """,
        run_hist = """ + _added("run_hist") + """
)
"""

#: Delete one batch of attempts that ended before the history's retention.
PRUNE_ATTEMPTS = """
DELETE FROM standmeet.job_attempts
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM standmeet.job_attempts
    WHERE ended_at < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
))
"""

#: Delete one batch of the periodic jobs' claimed periods older than the retention, each
#: job's latest kept (what ``status`` shows). A claimed period is kept as long as it can
#: be claimed again: an interval's while it is current (its start and the job's declared
#: interval: a period of a changed interval may start before the old one's latest), a cron
#: fire time's up to an hour after it; then for the retention, at least a day.
PRUNE_PERIODIC_RUNS = """
DELETE FROM standmeet.periodic_runs
WHERE ctid = ANY(ARRAY(
    SELECT r.ctid FROM standmeet.periodic_runs r
    LEFT JOIN standmeet.periodic_schedules s ON s.job = r.job
    WHERE r.period_start < now() - make_interval(secs => greatest(%(retention_s)s, 86400)
                                                         + coalesce(s.interval_s, CASE WHEN s.cron IS NULL
                                                                                       THEN 0 ELSE 3600 END))
      AND r.period_start < (SELECT max(l.period_start) FROM standmeet.periodic_runs l WHERE l.job = r.job)
    LIMIT %(batch)s
))
"""

#: Delete one batch of per-minute history older than its retention.
PRUNE_HISTORY = """
DELETE FROM standmeet.queue_history
WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM standmeet.queue_history
    WHERE minute < now() - make_interval(secs => %(retention_s)s)
    LIMIT %(batch)s
))
"""
#: How a settled run's ``ran`` row is computed from a ``settled`` CTE that returns, beside
#: the message's new state, ``cancelled``, ``claims``, ``due_at`` (when the message became
#: due for this run), ``actor_name``, ``started_ago`` and ``ended_ago`` (seconds before
#: this statement the run started and ended, measured by the worker's monotonic clock and
#: placed on the database's), ``hint`` (the run's outcome as its worker saw it) and
#: ``run_error``: every timestamp is the database's.
RAN_OF_SETTLED = """, ran AS (
    SELECT message_id, claims AS attempt, queue_name, actor_name, %(worker_id)s::uuid AS worker_id,
           CASE WHEN cancelled THEN 'cancelled'
                WHEN hint = 'rerun' AND state = 'rejected' THEN 'rejected'
                WHEN hint = 'rerun' THEN 'failed'
                ELSE hint END AS outcome,
           state,
           now() - make_interval(secs => started_ago) AS started_at,
           now() - make_interval(secs => ended_ago) AS ended_at,
           run_error AS error,
           greatest((EXTRACT(EPOCH FROM now() - due_at)::float8 - started_ago) * 1000, 0) AS wait_ms,
           greatest((started_ago - ended_ago) * 1000, 0) AS run_ms
    FROM settled
)"""
