"""Snooze costs no retry; delays live in the database and start on time."""

from __future__ import annotations

import json
import logging

import dramatiq
import pytest

from middleware import Snooze
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import SLEEP, on_failure, snooze_n


def _row(url: str, message_id: str):
    rows = query(url, "SELECT state::text, message, eta, error FROM dramatiq.queue WHERE message_id = %s", (message_id,))
    return rows[0] if rows else None


def test_a_job_snoozed_three_times_ends_done_with_no_retry_and_three_snoozes(broker, database_url, start_worker, caplog):
    start_worker(queues=["index"], threads=4)
    with caplog.at_level(logging.DEBUG):
        message = snooze_n.send_with_options(
            args=("snooze-3", 3), on_failure=on_failure.actor_name
        )
        wait_for(lambda: (_row(database_url, message.message_id) or ("",))[0] == "done", timeout_s=15,
                 what="the snoozed job to be done")
    state, body, _, _ = _row(database_url, message.message_id)
    body = body if isinstance(body, dict) else json.loads(body)
    assert body["options"].get("retries", 0) == 0
    assert body["options"]["snoozes"] == 3
    # it ran four times: three snoozes and the success
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'snooze-3'") == 4
    # no failure callback fired, nothing was logged as an error
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE actor = 'test.on_failure' AND label = %s",
                  (message.message_id,)) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_an_endless_snooze_fails_clearly_at_its_cap(broker, database_url, start_worker):
    start_worker(queues=["index"], threads=4)
    message = snooze_n.send_with_options(args=("snooze-forever", 1_000), kwargs={"seconds": 0.0}, max_snoozes=5)
    wait_for(lambda: (_row(database_url, message.message_id) or ("",))[0] == "rejected", timeout_s=15,
             what="the endless snooze to be rejected")
    _, body, _, error = _row(database_url, message.message_id)
    assert "snoozed 6 times, more than its cap of 5" in error
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'snooze-forever'") == 6


def test_a_delayed_message_waits_in_the_database_and_starts_when_due(broker, database_url, start_worker):
    start_worker(queues=["index", "webhook"], threads=16)
    index_message = SLEEP["index"].send_with_options(args=(1, "delayed-index"), delay=800)
    webhook_message = SLEEP["webhook"].send_with_options(args=(1, "delayed-webhook"), delay=800)
    # While not due, both stay queued in Postgres: no worker has claimed them
    state, _, eta, _ = _row(database_url, index_message.message_id)
    assert state == "queued"
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE state = 'consumed'"
                                " AND message_id = ANY(%s::uuid[])",
                  ([index_message.message_id, webhook_message.message_id],)) == 0
    wait_for(
        lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label LIKE 'delayed-%%'") == 2,
        timeout_s=10,
        what="both delayed jobs to start",
    )
    lateness = dict(query(
        database_url,
        """SELECT r.label, EXTRACT(EPOCH FROM r.started_at - q.eta)::float8
           FROM test_runs r JOIN dramatiq.queue q USING (message_id) WHERE r.label LIKE 'delayed-%%'""",
    ))
    # never before its eta; on time (the consumer sleeps until the next eta, not a whole
    # 1 s poll): within half the poll, room for a loaded machine
    assert 0 <= lateness["delayed-index"] < 0.5, lateness
    assert 0 <= lateness["delayed-webhook"] < 1.0, lateness
    assert webhook_message.message_id


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_retried_job_waits_for_its_back_off_before_it_runs_again(broker, database_url, start_worker):
    from tests.support.jobs import raise_once_backoff

    # Given a job that fails once, with a back-off of at least 1 s (1 to 2 s with jitter)
    start_worker(queues=["index"], threads=4)
    message = raise_once_backoff.send("backoff-1s")
    # When it has run twice
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'backoff-1s'") == 2,
             timeout_s=15, what="the retry")
    # Then the retry started no sooner than the back-off after the failed run, by the database's clock
    gap = scalar(database_url, "SELECT extract(epoch FROM max(started_at) - min(started_at)) FROM test_runs"
                               " WHERE label = 'backoff-1s'")
    assert gap >= 1.0, gap
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=10, what="the retry to be done")


def test_a_job_woken_while_it_runs_is_due_at_once_when_it_snoozes(broker, database_url, start_worker):
    from tests.support.jobs import woken_while_snoozing

    # Given a job that is woken by the job it waits for while it is deciding to snooze (the
    # waker found it running, so it could not make a queued message due)
    start_worker(queues=["index"], threads=2)
    message = woken_while_snoozing.send("woken-1")
    # When it snoozes for a minute
    # Then its snooze's settle makes it due at once: it runs again and is done in seconds
    wait_for(lambda: (_row(database_url, message.message_id) or ("",))[0] == "done", timeout_s=10,
             what="the woken job to run again and be done")
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'woken-1'") == 2
    assert scalar(database_url, "SELECT woken_at FROM dramatiq.queue WHERE message_id = %s", (message.message_id,)) is None


#: Runs of ``test.snoozes_too_far`` and their ends, by key (in this process).
TOO_FAR_RUNS: list[str] = []


@dramatiq.actor(actor_name="test.snoozes_too_far", queue_name="index", max_retries=0)
def snoozes_too_far(key: str) -> None:
    """Its first run snoozes past the longest delay a message may have (over ten years):
    the put-back is refused; a later run ends."""
    TOO_FAR_RUNS.append(key)
    if TOO_FAR_RUNS.count(key) == 1:
        raise Snooze(4e8, "come back in thirteen years")
    TOO_FAR_RUNS.append(f"{key}:ended")


def test_a_snooze_whose_put_back_is_refused_is_not_recorded_done_it_runs_again(broker, database_url, start_worker):
    # Given a job whose snooze cannot be put back (its delay is past the longest allowed)
    start_worker(queues=["index"], threads=2)
    message = snoozes_too_far.send("too-far")
    # When it has been settled
    wait_for(lambda: "too-far:ended" in TOO_FAR_RUNS, timeout_s=30, what="a run of it to end")
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                            (message.message_id,)) == "done", timeout_s=30, what="it to be done")
    # Then it was not recorded done after the refused snooze (its body never ran): it ran
    # again, as a run without an outcome does, and that run ended
    assert TOO_FAR_RUNS == ["too-far", "too-far", "too-far:ended"]
