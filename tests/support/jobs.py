"""Actors used by the tests, declared on our queues the way an application would.

Importing this module imports ``actors`` (which configures the broker), so it also
runs under ``dramatiq tests.support.jobs --queues …`` with all our middleware.
Every actor writes what it saw into the test database, so assertions are made
from rows, not from in-process counters.
"""

from __future__ import annotations

import os
import threading
import time

import dramatiq
import httpx

import actors  # noqa: F401  (configures the broker)
from actors.queues import QUEUE_NAMES
from broker.pg import db
from middleware import Snooze

START = """
INSERT INTO test_runs (actor, queue, label, pid, message_id)
VALUES (%(actor)s, %(queue)s, %(label)s, %(pid)s, %(message_id)s) RETURNING id
"""
FINISH = "UPDATE test_runs SET finished_at = clock_timestamp() WHERE id = %(id)s"
BUMP = """
INSERT INTO test_counters (key, value) VALUES (%(key)s, 1)
ON CONFLICT (key) DO UPDATE SET value = test_counters.value + 1
RETURNING value
"""


def _message_id() -> str | None:
    from dramatiq.middleware import CurrentMessage

    message = CurrentMessage.get_current_message()
    return message.message_id if message is not None else None


def record_start(actor: str, queue: str, label: str) -> int:
    with db.connection() as conn:
        row = conn.execute(
            START,
            {"actor": actor, "queue": queue, "label": label, "pid": os.getpid(), "message_id": _message_id()},
        ).fetchone()
    assert row is not None
    return int(row[0])


def record_finish(run_id: int) -> None:
    with db.connection() as conn:
        conn.execute(FINISH, {"id": run_id})


def bump(key: str) -> int:
    with db.connection() as conn:
        row = conn.execute(BUMP, {"key": key}).fetchone()
    assert row is not None
    return int(row[0])


def cooperative_sleep(seconds: float) -> None:
    """Sleep in small steps, so Dramatiq's asynchronous time-limit exception can land."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.01, max(0.0, end - time.monotonic())))


def _make_sleeper(queue: str) -> dramatiq.Actor:
    def sleep(ms: int, label: str = "") -> None:
        run = record_start(f"test.sleep.{queue}", queue, label)
        cooperative_sleep(ms / 1000)
        record_finish(run)

    return dramatiq.actor(sleep, actor_name=f"test.sleep.{queue}", queue_name=queue, max_retries=0)


#: One sleeping actor per queue: ``SLEEP["index"].send(200, "label")``.
SLEEP = {queue: _make_sleeper(queue) for queue in QUEUE_NAMES}


@dramatiq.actor(actor_name="test.noop", queue_name="index", max_retries=0)
def noop(label: str = "") -> None:
    record_finish(record_start("test.noop", "index", label))


@dramatiq.actor(actor_name="test.raise_once", queue_name="index", min_backoff=10, max_backoff=50)
def raise_once(key: str) -> None:
    """Raises on its first run (a bug in the actor); succeeds on the retry."""
    run = record_start("test.raise_once", "index", key)
    if bump(key) == 1:
        raise RuntimeError(f"boom on the first run of {key}")
    record_finish(run)


@dramatiq.actor(actor_name="test.raise_once_backoff", queue_name="index", min_backoff=1000, max_backoff=4000)
def raise_once_backoff(key: str) -> None:
    """Raises on its first run; its retry is due after 1 to 2 s of back-off."""
    run = record_start("test.raise_once_backoff", "index", key)
    if bump(key) == 1:
        raise RuntimeError(f"boom on the first run of {key}")
    record_finish(run)


@dramatiq.actor(
    actor_name="test.overrun_once", queue_name="index", time_limit=1000, min_backoff=10, max_backoff=50
)
def overrun_once(key: str) -> None:
    """Runs past its 1 s limit on the first run; quick on the retry."""
    run = record_start("test.overrun_once", "index", key)
    if bump(key) == 1:
        cooperative_sleep(30)
    record_finish(run)


@dramatiq.actor(
    actor_name="test.slow_query_once", queue_name="index", time_limit=1000, min_backoff=10, max_backoff=50
)
def slow_query_once(key: str) -> None:
    """A SQL statement longer than the limit, which only statement_timeout can stop."""
    run = record_start("test.slow_query_once", "index", key)
    if bump(key) == 1:
        with db.connection() as conn:
            conn.execute("SELECT pg_sleep(30)")
    record_finish(run)


@dramatiq.actor(actor_name="test.snooze_n", queue_name="index", min_backoff=10, max_backoff=50)
def snooze_n(key: str, times: int, seconds: float = 0.05) -> None:
    """Snoozes ``times`` times, then succeeds."""
    run = record_start("test.snooze_n", "index", key)
    if bump(key) <= times:
        raise Snooze(seconds, reason=f"{key} not ready")
    record_finish(run)


#: One client for every thread (httpx clients are thread-safe; building one loads the
#: CA bundle, tens of milliseconds of CPU under the GIL).
HTTP = httpx.Client(follow_redirects=False)


@dramatiq.actor(actor_name="test.post", queue_name="webhook", max_retries=0)
def post(url: str, label: str = "") -> None:
    """POST to ``url`` holding no database connection, with a deadline-capped timeout."""
    from broker import deadline

    run = record_start("test.post", "webhook", label)
    HTTP.post(url, content=label.encode(), timeout=deadline.cap_timeout(10.0))
    record_finish(run)


@dramatiq.actor(actor_name="test.mark", queue_name="index", max_retries=50, min_backoff=10, max_backoff=100)
def mark(label: str = "") -> None:
    """One row per run, written as the job's only work (for exactly-once counts)."""
    with db.connection() as conn:
        conn.execute(
            "INSERT INTO test_runs (actor, queue, label, pid, message_id, finished_at)"
            " VALUES ('test.mark', 'index', %(label)s, %(pid)s, %(message_id)s, clock_timestamp())",
            {"label": label, "pid": os.getpid(), "message_id": _message_id()},
        )


@dramatiq.actor(actor_name="test.on_failure", queue_name="index", max_retries=0)
def on_failure(message_data: dict, exception_data: dict) -> None:
    """A failure callback: if it ever runs, it leaves a row."""
    record_finish(record_start("test.on_failure", "index", message_data.get("message_id", "")))


@dramatiq.actor(actor_name="test.tick", queue_name="maintenance", max_retries=0)
def tick_job(label: str = "") -> None:
    """A periodic job for the scheduler tests."""
    record_finish(record_start("test.tick", "maintenance", label))


def _ping(event_id: int, payload: dict) -> tuple[tuple, dict]:
    return (str(payload["label"]),), {}


from broker.outbox import route  # noqa: E402

#: test.ping events run test.noop with the event's label (index queue: awaited).
route("test.ping", "test.noop", _ping)
#: test.crash events run test.mark with the event's label (retried through an outage).
route("test.crash", "test.mark", _ping)


#: How each run of ``test.held_through_a_cut`` ended, in this process: it needs no
#: database, which may be out of reach while it runs.
CUT_RUNS: list[str] = []


@dramatiq.actor(actor_name="test.held_through_a_cut", queue_name="index", max_retries=0)
def held_through_a_cut(key: str, seconds: float) -> None:
    """The first run of ``key`` sleeps ``seconds`` (cooperatively: an interruption lands),
    later ones end at once; each run's end is kept in :data:`CUT_RUNS`."""
    first = not any(run.startswith(f"{key}:") for run in CUT_RUNS)
    try:
        if first:
            cooperative_sleep(seconds)
    except BaseException as exc:
        CUT_RUNS.append(f"{key}:{type(exc).__name__}")
        raise
    CUT_RUNS.append(f"{key}:done")


#: The cue each first run of ``test.ended_on_cue`` waits for, by key; and every run's key.
CUES: dict[str, threading.Event] = {}
CUED_RUNS: list[str] = []


@dramatiq.actor(actor_name="test.ended_on_cue", queue_name="index", max_retries=0)
def ended_on_cue(key: str) -> None:
    """The first run of ``key`` waits (up to 30 s) for ``CUES[key]`` to be set, then
    ends; later ones end at once. Each run is counted in :data:`CUED_RUNS`."""
    first = key not in CUED_RUNS
    CUED_RUNS.append(key)
    if first:
        CUES.setdefault(key, threading.Event()).wait(30)


@dramatiq.actor(actor_name="test.woken_while_snoozing", queue_name="index", max_retries=0)
def woken_while_snoozing(key: str) -> None:
    """On its first run, is woken (as a webhook lease's holder wakes its next waiter) while
    it is about to snooze for a minute; then succeeds."""
    run = record_start("test.woken_while_snoozing", "index", key)
    if bump(key) == 1:
        with db.connection() as conn:
            conn.execute("UPDATE dramatiq.queue SET woken_at = now() WHERE message_id = %s::uuid", (_message_id(),))
        raise Snooze(60, reason=f"{key} waits for another job")
    record_finish(run)


#: Runs of ``test.second_run_returns``, by key (in this process); the cue each key's
#: second run ends on.
SECOND_RUNS: list[str] = []
SECOND_RUN_ENDS: dict[str, threading.Event] = {}


@dramatiq.actor(actor_name="test.second_run_returns", queue_name="index", max_retries=0, store_results=True)
def second_run_returns(key: str, first: str) -> str:
    """Its result is kept. The first run of ``key`` fails (``first="fails"``) or sleeps a
    minute, cooperatively, so an interruption lands (``"sleeps"``); the second returns once
    :data:`SECOND_RUN_ENDS` ``[key]`` is set."""
    SECOND_RUNS.append(key)
    if SECOND_RUNS.count(key) == 1:
        if first == "fails":
            raise RuntimeError(f"the first run of {key} failed")
        cooperative_sleep(60)
        return "the first run's"
    SECOND_RUN_ENDS.setdefault(key, threading.Event()).wait(30)
    return "the second run's"


def result_once_the_second_run_returns(message: dramatiq.Message, key: str) -> object:
    """While the second run of ``key`` runs, no result is there (``ResultMissing``); once it
    returns, what a waiter gets."""
    import pytest
    from dramatiq.results import ResultMissing

    try:
        with pytest.raises(ResultMissing):
            message.get_result(block=False)
    finally:
        SECOND_RUN_ENDS.setdefault(key, threading.Event()).set()
    return message.get_result(block=True, timeout=20_000)
