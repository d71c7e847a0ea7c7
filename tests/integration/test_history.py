"""Per-minute history: written by the workers as they settle, counting exactly what ran."""

from __future__ import annotations

import time
from datetime import timedelta

import dramatiq
import psycopg
import pytest

from broker.engine.sql_history import HISTORY_BOUNDS_MS
from broker.ops import history
from broker.settings import replace
from middleware import Snooze
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import bump, record_finish, record_start

COUNTS = ("done", "failed", "rejected", "cancelled", "snoozed", "timed_out", "crashed", "given_back")
#: Every shard of an actor's history, added together.
ACTOR_HISTORY = ("SELECT " + ", ".join(f"coalesce(sum({c}), 0)::int" for c in COUNTS)
                 + " FROM standmeet.queue_history WHERE actor_name = %s")
RUNS_OF = "SELECT count(*) FROM test_runs WHERE actor = %s"
FINAL = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state IN ('done', 'rejected')"


def _ran(actor: str, key: str) -> int:
    run = record_start(actor, "index", key)
    record_finish(run)
    return bump(key)


@dramatiq.actor(actor_name="history.flaky", queue_name="index", max_retries=5, min_backoff=10, max_backoff=20)
def flaky(key: str, failures: int) -> None:
    if _ran("history.flaky", key) <= failures:
        raise ValueError(f"failure of {key}")


@dramatiq.actor(actor_name="history.broken", queue_name="index", max_retries=1, min_backoff=10, max_backoff=20)
def broken(key: str) -> None:
    _ran("history.broken", key)
    raise RuntimeError("history.broken is broken")


@dramatiq.actor(actor_name="history.snoozer", queue_name="index", max_retries=0)
def snoozer(key: str) -> None:
    if _ran("history.snoozer", key) == 1:
        raise Snooze(0.05)


@dramatiq.actor(actor_name="history.quick", queue_name="index", max_retries=0)
def quick(key: str) -> None:
    _ran("history.quick", key)


@dramatiq.actor(actor_name="history.until_cancelled", queue_name="index", max_retries=3)
def until_cancelled(key: str, url: str, message_id: str) -> None:
    """Runs until an operator cancels it (or 20 s), then returns."""
    _ran("history.until_cancelled", key)
    end = time.monotonic() + 20
    with psycopg.connect(url, autocommit=True) as conn:
        while time.monotonic() < end:
            row = conn.execute("SELECT cancelled_at IS NOT NULL FROM dramatiq.queue WHERE message_id = %s",
                               (message_id,)).fetchone()
            if row and row[0]:
                return
            time.sleep(0.02)


@dramatiq.actor(actor_name="history.sleeper", queue_name="index", max_retries=0)
def sleeper(ms: int) -> None:
    time.sleep(ms / 1000)


def _counts(url: str, actor: str) -> dict[str, int]:
    return dict(zip(COUNTS, query(url, ACTOR_HISTORY, (actor,))[0], strict=True))


def _expect(**counts: int) -> dict[str, int]:
    return {c: counts.get(c, 0) for c in COUNTS}


def _bucket_of(ms: float) -> tuple[float, float]:
    for low, high in zip(HISTORY_BOUNDS_MS, HISTORY_BOUNDS_MS[1:], strict=False):
        if low <= ms < high:
            return (low, high)
    return (HISTORY_BOUNDS_MS[-1], float("inf"))


def test_history_counts_each_outcome_of_a_drain_exactly_as_the_jobs_ran(broker, database_url, start_worker):
    # Given jobs that fail then succeed, fail for good, snooze, get cancelled while running, or just run
    cancelled = until_cancelled.message("cancel-me", database_url, "")
    cancelled = cancelled._replace(args=("cancel-me", database_url, cancelled.message_id))
    messages = [flaky.send("flaky-a", 2), flaky.send("flaky-b", 2), broken.send("broken"), snoozer.send("snoozer"),
                *[quick.send(f"quick-{i}") for i in range(10)], broker.enqueue(cancelled)]
    ids = [m.message_id for m in messages]
    # When a worker drains them, and an operator cancels the one that waits for it
    start_worker(queues=["index"], threads=4)
    wait_for(lambda: scalar(database_url, RUNS_OF, ("history.until_cancelled",)) == 1, timeout_s=15,
             what="the cancellable job to start")
    query(database_url, "UPDATE dramatiq.queue SET cancelled_at = now(), cancelled_by = 'test' WHERE message_id = %s",
          (cancelled.message_id,))
    wait_for(lambda: scalar(database_url, FINAL, (ids,)) == len(ids), timeout_s=30, what="every job to finish")
    # Then the history counts exactly the runs each actor recorded, by outcome
    expected = {
        "history.flaky": _expect(done=2, failed=4),
        "history.broken": _expect(failed=1, rejected=1),
        "history.snoozer": _expect(snoozed=1, done=1),
        "history.quick": _expect(done=10),
        "history.until_cancelled": _expect(cancelled=1),
    }
    for actor, counts in expected.items():
        assert _counts(database_url, actor) == counts, actor
        runs = scalar(database_url, RUNS_OF, (actor,))
        assert runs == sum(counts.values()), actor
    # and every run's wait and run time are measured (a snooze's and a cancel's too)
    measured = query(database_url, "SELECT sum(wait_count)::int, sum(run_count)::int, sum((SELECT sum(x) FROM"
                                   " unnest(run_hist) x))::int FROM standmeet.queue_history"
                                   " WHERE actor_name LIKE 'history.%%' AND actor_name <> 'history.sleeper'")[0]
    total = sum(sum(counts.values()) for counts in expected.values())
    assert measured == (total, total, total)


def test_wait_and_run_percentiles_fall_in_the_buckets_of_the_known_times(broker, database_url, start_worker):
    # Given four jobs that sleep 120 ms, due three seconds ago when a worker starts
    messages = [sleeper.send(120) for _ in range(4)]
    ids = [m.message_id for m in messages]
    query(database_url, "UPDATE dramatiq.queue SET eta = now() - interval '3 seconds' WHERE message_id = ANY(%s::uuid[])",
          (ids,))
    # When a worker runs them side by side
    start_worker(queues=["index"], threads=4)
    wait_for(lambda: scalar(database_url, FINAL, (ids,)) == 4, timeout_s=15, what="the sleepers to finish")
    # Then per bucket and over the window, waits are in [2 s, 5 s) and runs in [100 ms, 200 ms)
    with psycopg.connect(database_url, autocommit=True) as conn:
        row = conn.execute("SELECT now() - interval '10 minutes'").fetchone()
        assert row is not None
        since = row[0]
        points = history.series(conn, since=since, bucket_s=60, actor="history.sleeper")
        (index,) = [s for s in history.summary(conn, since=since) if s.queue == "index"]
    busy = [p for p in points if p.figures.done]
    assert sum(p.figures.done for p in busy) == 4
    assert all(p.start.timestamp() % 60 == 0 for p in points)
    assert [b.start - a.start for a, b in zip(points, points[1:], strict=False)] == [timedelta(seconds=60)] * (len(points) - 1)
    for figures in [p.figures for p in busy]:
        for value in (figures.wait_p50_ms, figures.wait_p95_ms):
            assert value is not None and _bucket_of(value) == (2_000, 5_000), figures
        for value in (figures.run_p50_ms, figures.run_p95_ms):
            assert value is not None and _bucket_of(value) == (100, 200), figures
        assert figures.run_mean_ms is not None and 120 <= figures.run_mean_ms < 200
    # the summary of the queue adds up every actor of it (all of this module's runs)
    assert index.figures.done == scalar(database_url, "SELECT sum(done) FROM standmeet.queue_history"
                                                      " WHERE queue_name = 'index'")
    assert index.as_json()["name"] == "index" and index.as_json()["done"] == index.figures.done


def test_pruning_removes_history_and_attempts_past_their_retention_only(broker, database_url, start_worker):
    # Given history and attempts from 20 days ago and from now (retention: 14 days)
    zeros = [0] * len(HISTORY_BOUNDS_MS)
    with psycopg.connect(database_url, autocommit=True) as conn:
        for age in ("20 days", "20 days", "20 days", "0 days"):
            for actor in ("prune.a", "prune.b"):
                conn.execute("INSERT INTO standmeet.queue_history (minute, queue_name, actor_name, shard, done,"
                             " wait_hist, run_hist) VALUES (date_trunc('minute', now() - %s::interval), 'index', %s, 0,"
                             " 1, %s, %s) ON CONFLICT DO NOTHING", (age, actor, zeros, zeros))
                conn.execute("INSERT INTO standmeet.job_attempts (message_id, attempt, queue_name, actor_name,"
                             " ended_at, outcome) VALUES (gen_random_uuid(), 1, 'index', %s, now() - %s::interval,"
                             " 'done')", (actor, age))
    original = broker.settings
    broker.settings = replace(original, prune_batch=2)
    try:
        # When the maintenance job prunes, two rows a batch
        start_worker(queues=["maintenance"], threads=1)
        job = dramatiq.get_broker().get_actor("maintenance.prune_messages").send()
        wait_for(lambda: query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                               (job.message_id,)) == [("done",)], timeout_s=15, what="the prune job")
    finally:
        broker.settings = original
    # Then only the recent rows are left
    left_history = query(database_url, "SELECT actor_name, minute > now() - interval '1 day' FROM"
                                       " standmeet.queue_history WHERE actor_name LIKE 'prune.%%' ORDER BY 1")
    assert left_history == [("prune.a", True), ("prune.b", True)]
    left_attempts = query(database_url, "SELECT actor_name, ended_at > now() - interval '1 day' FROM"
                                        " standmeet.job_attempts WHERE actor_name LIKE 'prune.%%' ORDER BY 1")
    assert left_attempts == [("prune.a", True), ("prune.b", True)]


@pytest.mark.parametrize(("hist", "q", "low", "high"), [
    ([0, 0, 0, 0, 0, 0, 0, 4] + [0] * 11, 0.5, 100, 200),
    ([0] * 18 + [3], 0.95, 3_600_000, 3_600_000),
    ([1] + [0] * 17 + [1], 0.5, 0, 1),
])
def test_percentiles_are_estimated_inside_the_bucket_that_holds_them(hist, q, low, high):
    value = history.percentile_ms(hist, q)
    assert value is not None and low <= value <= high
    assert history.percentile_ms([0] * 19, q) is None


def test_a_stretch_counts_its_first_minute_whole_and_divides_by_the_seconds_it_counted(broker, database_url):
    # Given 600 runs done in the minute a stretch starting 30 s into it falls in
    query(database_url, "INSERT INTO standmeet.queue_history (minute, queue_name, actor_name, shard, done,"
                        " wait_hist, run_hist) VALUES (date_trunc('minute', now() - interval '59 minutes 30 seconds'),"
                        " 'history-span', 'a.b', 0, 600, array_fill(0::bigint, ARRAY[%s]), array_fill(0::bigint, ARRAY[%s]))",
          (len(HISTORY_BOUNDS_MS), len(HISTORY_BOUNDS_MS)))
    with psycopg.connect(database_url) as conn:
        since = conn.execute("SELECT now() - interval '59 minutes 30 seconds'").fetchone()[0]
        (span,) = [s for s in history.summary(conn, since=since) if s.queue == "history-span"]
    # Then the stretch's seconds run from the start of that minute: the rate is the runs it
    # counted over the time they were counted in, not over a shorter hour
    assert span.figures.done == 600
    into_its_minute = (since - since.replace(second=0, microsecond=0)).total_seconds()
    assert span.figures.seconds >= 59 * 60 + 30 + into_its_minute
