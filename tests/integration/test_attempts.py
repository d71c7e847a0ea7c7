"""Every attempt kept: one row per run of a job, with its own outcome and error."""

from __future__ import annotations

import logging
import threading

import dramatiq
import psycopg

from broker.ops import history
from middleware import Snooze
from middleware.keyed_lease import Lease
from middleware.time_limit import TimeLimit
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import bump, cooperative_sleep

FINAL = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state IN ('done', 'rejected')"
#: What the three failing runs of ``three_ways`` raise, in order.
THREE_WAYS = (ValueError("first, a bad value"), KeyError("second, a missing key"), RuntimeError("third, a runtime"))


@dramatiq.actor(actor_name="attempts.three_ways", queue_name="index", max_retries=5, min_backoff=10, max_backoff=20)
def three_ways(key: str) -> None:
    n = bump(key)
    if n <= len(THREE_WAYS):
        raise THREE_WAYS[n - 1]


@dramatiq.actor(actor_name="attempts.hopeless", queue_name="index", max_retries=1, min_backoff=10, max_backoff=20)
def hopeless(key: str) -> None:
    raise LookupError(f"run {bump(key)} of hopeless found nothing")


@dramatiq.actor(actor_name="attempts.slow_once", queue_name="index", time_limit=300, max_retries=2,
                min_backoff=10, max_backoff=20)
def slow_once(key: str) -> None:
    if bump(key) == 1:
        cooperative_sleep(10)


@dramatiq.actor(actor_name="attempts.snooze_once", queue_name="index", max_retries=0)
def snooze_once(key: str) -> None:
    if bump(key) == 1:
        raise Snooze(0.05, "not yet")


@dramatiq.actor(actor_name="attempts.a_step", queue_name="index")
def a_step(key: str) -> int:
    return bump(key)


@dramatiq.actor(actor_name="attempts.slow_after_a_step", queue_name="index", time_limit=300, max_retries=0)
def slow_after_a_step(key: str) -> None:
    a_step(key)  # another actor's function, called directly: it runs here and now
    cooperative_sleep(10)


#: A lease whose take fails, as any statement can (a pool's timeout, a statement timeout,
#: a connection dropped): here a real error from the server.
UNTAKEABLE = Lease(key=lambda message: message.args[0], take="SELECT 1 / 0, %(key)s, %(lease_s)s",
                   release="SELECT %(key)s, %(token)s, %(message_id)s", lease_s=lambda: 5.0,
                   busy_snooze_s=lambda: 60.0)


@dramatiq.actor(actor_name="attempts.leased", queue_name="index", lease=UNTAKEABLE)
def leased(key: str) -> None:
    bump(key)


def _no_key(message: object) -> str:
    raise KeyError("account")  # a message of an older shape, without the field the key reads


#: A lease whose key cannot be found, and whose own wait cannot be read either.
KEYLESS = Lease(key=_no_key, take="SELECT gen_random_uuid(), %(key)s, %(lease_s)s",
                release="SELECT %(key)s, %(token)s, %(message_id)s", lease_s=lambda: 5.0,
                busy_snooze_s=lambda: 1 / 0)


@dramatiq.actor(actor_name="attempts.keyless", queue_name="index", lease=KEYLESS)
def keyless(key: str) -> None:
    bump(key)


#: A lease of a row with a database-clock expiry, taken for one second: far shorter than
#: its jobs' time limit (the queue's, 30 s).
SHORT_TAKE = """
INSERT INTO test_short_leases (key, token, until)
VALUES (%(key)s, gen_random_uuid(), clock_timestamp() + make_interval(secs => %(lease_s)s))
ON CONFLICT (key) DO UPDATE SET token = EXCLUDED.token, until = EXCLUDED.until
    WHERE test_short_leases.until < clock_timestamp()
RETURNING token::text
"""
SHORT = Lease(key=lambda message: message.args[0], take=SHORT_TAKE,
              release="DELETE FROM test_short_leases WHERE key = %(key)s AND token = %(token)s::uuid",
              lease_s=lambda: 1.0, busy_snooze_s=lambda: 0.1)
#: How many runs of a key hold its short lease at once, now and at most.
SHORT_HOLDERS = {"now": 0, "most": 0}
SHORT_LOCK = threading.Lock()


@dramatiq.actor(actor_name="attempts.short_leased", queue_name="index", max_retries=0, lease=SHORT)
def short_leased(key: str) -> None:
    with SHORT_LOCK:
        SHORT_HOLDERS["now"] += 1
        SHORT_HOLDERS["most"] = max(SHORT_HOLDERS["most"], SHORT_HOLDERS["now"])
    try:
        cooperative_sleep(2.5)  # longer than the lease's own second
    finally:
        with SHORT_LOCK:
            SHORT_HOLDERS["now"] -= 1


#: A lease whose key is always busy (its take finds no row).
ALWAYS_BUSY = Lease(key=lambda message: message.args[0], take="SELECT 1 WHERE %(key)s IS NULL AND %(lease_s)s > 0",
                    release="SELECT %(key)s, %(token)s, %(message_id)s", lease_s=lambda: 5.0,
                    busy_snooze_s=lambda: 60.0)


@dramatiq.actor(actor_name="attempts.busy_keyed", queue_name="index", lease=ALWAYS_BUSY, time_limit=50)
def busy_keyed(key: str) -> None:
    bump(key)


def _attempts(url: str, message_id: str) -> list[history.Attempt]:
    with psycopg.connect(url, autocommit=True) as conn:
        return history.attempts(conn, message_id)


def _drained(url: str, messages: list[dramatiq.Message]) -> None:
    ids = [m.message_id for m in messages]
    wait_for(lambda: scalar(url, FINAL, (ids,)) == len(ids), timeout_s=30, what="the jobs to finish")


def test_a_job_that_failed_three_different_ways_shows_three_attempts_each_with_its_own_error(
    broker, database_url, start_worker
):
    start_worker(queues=["index"], threads=4)
    message = three_ways.send("three-ways")
    _drained(database_url, [message])
    attempts = _attempts(database_url, message.message_id)
    assert [a.outcome for a in attempts] == ["failed", "failed", "failed", "done"]
    for attempt, exc in zip(attempts, THREE_WAYS, strict=False):
        assert f"{type(exc).__name__}: {exc}" in (attempt.error or ""), attempt
        others = [e for e in THREE_WAYS if e is not exc]
        assert not any(str(e) in (attempt.error or "") for e in others), attempt
    assert attempts[-1].error is None
    numbers = [a.attempt for a in attempts]
    assert numbers == sorted(set(numbers)) and numbers[0] == 1
    assert {a.worker_id for a in attempts} == {broker.worker_id}
    for a in attempts:
        assert a.started_at is not None and a.started_at <= a.ended_at
        assert (a.queue, a.actor) == ("index", "attempts.three_ways")
    # one run's end comes before the next one's start, by the database's clock
    assert all(a.ended_at <= b.started_at for a, b in zip(attempts, attempts[1:], strict=False))  # type: ignore[operator]


def test_a_rejected_jobs_last_attempt_is_rejected_with_its_own_error(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    message = hopeless.send("hopeless")
    _drained(database_url, [message])
    attempts = _attempts(database_url, message.message_id)
    assert [a.outcome for a in attempts] == ["failed", "rejected"]
    assert "run 1 of hopeless" in (attempts[0].error or "")
    assert "run 2 of hopeless" in (attempts[1].error or "")


def test_a_time_limit_shows_as_a_timeout_and_a_snooze_as_snoozed(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    slow, snoozed = slow_once.send("slow-once"), snooze_once.send("snooze-once")
    _drained(database_url, [slow, snoozed])
    slow_attempts = _attempts(database_url, slow.message_id)
    assert [a.outcome for a in slow_attempts] == ["timeout", "done"]
    assert "TimeLimitExceeded" in (slow_attempts[0].error or "")
    run_ms = slow_attempts[0].run_ms
    assert run_ms is not None and 250 <= run_ms < 5_000  # cut at its 300 ms limit, not after its 10 s
    snoozed_attempts = _attempts(database_url, snoozed.message_id)
    assert [a.outcome for a in snoozed_attempts] == ["snoozed", "done"]
    assert "not yet" in (snoozed_attempts[0].error or "")


def test_a_job_that_calls_another_actors_function_keeps_its_own_time_limit(broker, database_url, start_worker):
    # Given a job of a 300 ms limit that calls another actor's function, then runs on for 10 s
    start_worker(queues=["index"], threads=2)
    message = slow_after_a_step.send("calls-a-step")
    # When it runs
    # Then it is stopped at its limit, not when it ends on its own
    wait_for(lambda: scalar(database_url, FINAL, ([message.message_id],)) == 1, timeout_s=5,
             what="the job stopped at its time limit")
    [attempt] = _attempts(database_url, message.message_id)
    assert "TimeLimitExceeded" in (attempt.error or ""), attempt
    assert scalar(database_url, "SELECT value FROM test_counters WHERE key = 'calls-a-step'") == 1


def test_a_job_whose_lease_cannot_be_taken_waits_and_never_runs_without_it(broker, database_url, start_worker):
    # Given a job of a keyed lease whose take fails
    key = "unleased"
    start_worker(queues=["index"], threads=2)
    message = leased.send(key)
    # When a worker picks it up
    wait_for(lambda: scalar(database_url, "SELECT (message->'options'->>'snoozes')::int FROM dramatiq.queue"
                                          " WHERE message_id = %s AND state = 'queued'", (message.message_id,)) == 1,
             timeout_s=10, what="the job snoozed")
    # Then it waits for a later try, due in the future, and its body never ran
    assert scalar(database_url, "SELECT eta > now() FROM dramatiq.queue WHERE message_id = %s", (message.message_id,))
    assert scalar(database_url, "SELECT count(*) FROM test_counters WHERE key = %s", (key,)) == 0
    broker.flush("index")


def test_a_job_whose_arguments_cannot_name_its_lease_key_is_rejected_at_once_saying_why(
        broker, database_url, start_worker):
    # Given a job whose lease key cannot be made from its arguments (a message of an older
    # shape), whose lease's own wait cannot be read either
    start_worker(queues=["index"], threads=2)
    message = keyless.send("keyless")
    # When a worker picks it up
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "rejected", timeout_s=10, what="the job rejected")
    # Then it is rejected at its first look, saying why, and its body never ran
    error, snoozes = query(database_url, "SELECT error, message->'options'->>'snoozes' FROM dramatiq.queue"
                                         " WHERE message_id = %s", (message.message_id,))[0]
    assert "lease key" in error and "KeyError" in error and snoozes is None
    assert scalar(database_url, "SELECT count(*) FROM test_counters WHERE key = 'keyless'") == 0


def test_a_lease_shorter_than_its_jobs_time_limit_never_expires_under_a_holder_that_still_runs(
        broker, database_url, start_worker):
    # Given two jobs of one key, each running 2.5 s under a lease the actor takes for 1 s
    query(database_url, "CREATE TABLE IF NOT EXISTS test_short_leases (key text PRIMARY KEY, token uuid,"
                        " until timestamptz)")
    try:
        start_worker(queues=["index"], threads=4)
        sent = [short_leased.send("one-key") for _ in range(2)]
        # When both have run
        for message in sent:
            wait_for(lambda m=message: scalar(database_url, "SELECT state::text FROM dramatiq.queue"
                                                            " WHERE message_id = %s", (m.message_id,)) == "done",
                     timeout_s=60, what=f"{message.message_id} to be done")
        # Then they never held the key at once: the lease was taken for the time limit left
        assert SHORT_HOLDERS["most"] == 1
    finally:
        query(database_url, "DROP TABLE IF EXISTS test_short_leases")


def test_a_time_limit_due_while_a_skipped_run_is_reported_leaves_the_worker_thread_working(
        broker, database_url, start_worker, monkeypatch):
    # Given a one-thread worker whose report of a skipped run (Dramatiq's "was skipped"
    # line) is held until that run's time limit has passed, unless it was disarmed
    [time_limit] = [m for m in broker.middleware if isinstance(m, TimeLimit)]
    worker_log = logging.getLogger("dramatiq.worker.WorkerThread")
    warning = worker_log.warning

    def held_warning(msg: object, *args: object, **kwargs: object) -> None:
        if "was skipped" in str(msg):
            wait_for(lambda: threading.get_ident() not in time_limit.manager.deadlines, timeout_s=5,
                     what="the skipped run's time limit to pass or be disarmed")
        warning(msg, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(worker_log, "warning", held_warning)
    start_worker(queues=["index"], threads=1)
    # When a run of a 50 ms limit is skipped before it starts (its key busy), then another job comes
    skipped = busy_keyed.send("busy-key")
    wait_for(lambda: scalar(database_url, "SELECT (message->'options'->>'snoozes')::int FROM dramatiq.queue"
                                          " WHERE message_id = %s AND state = 'queued'", (skipped.message_id,)) == 1,
             timeout_s=10, what="the skipped run's snooze written")
    after = a_step.send("after-the-skip")
    # Then the worker's one thread runs it: it lived through the skip
    wait_for(lambda: scalar(database_url, FINAL, ([after.message_id],)) == 1, timeout_s=10,
             what="the next job on the same thread")
