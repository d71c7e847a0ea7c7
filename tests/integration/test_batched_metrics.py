"""The per-job metrics are written once per batch of outcomes, before the batch is: a
run's figures are in the metrics by the time its outcome is in the database, and what a
run noted is written even when no outcome follows it."""

from __future__ import annotations

import logging
import threading

import dramatiq
from prometheus_client import REGISTRY

from broker.observability import metrics
from middleware.metrics import ADD, Metrics
from tests.support.db import query, wait_for
from tests.support.jobs import noop, raise_once

LABELS = {"queue_name": "index", "actor_name": "test.noop"}


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {**LABELS, **labels}) or 0.0


def _figures() -> tuple[float, float, float, float]:
    return (_sample("dramatiq_messages_total"), _sample("dramatiq_message_duration_milliseconds_count"),
            REGISTRY.get_sample_value("standmeet_claim_to_start_seconds_count", {"queue_name": "index"}) or 0.0,
            _sample("dramatiq_messages_inprogress"))


#: lets the held job end (set by the test that holds it)
_release = threading.Event()


@dramatiq.actor(actor_name="test.held_for_metrics", queue_name="index", max_retries=0)
def held_for_metrics() -> None:
    _release.wait(30)


def _in_progress(actor: str) -> float:
    return _sample("dramatiq_messages_inprogress", actor_name=actor)


def _metrics(broker) -> Metrics:  # type: ignore[no-untyped-def]
    return next(m for m in broker.middleware if isinstance(m, Metrics))


def _all_done(url: str, ids: list[str]) -> bool:
    rows = query(url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state = 'done'",
                 (ids,))
    return rows[0][0] == len(ids)


def test_a_runs_figures_are_in_the_metrics_by_the_time_its_outcome_is_written(broker, database_url, start_worker):
    # Given a worker on our broker, which writes the metrics once per batch of outcomes,
    # and a look at the metrics each time a batch of outcomes is about to be written
    start_worker(queues=["index"])
    assert _metrics(broker).batched
    messages, durations, claims, _ = _figures()
    seen: list[tuple[int, float]] = []  # (outcomes of test.noop written with this batch, messages counted)
    settler, write = broker.settler, broker.settler.settle_once

    def looked_at(outcomes, started):  # type: ignore[no-untyped-def]
        ours = sum(1 for o in outcomes if o.actor_name == "test.noop")
        seen.append(((seen[-1][0] if seen else 0) + ours, _sample("dramatiq_messages_total") - messages))
        return write(outcomes, started)

    settler.settle_once = looked_at
    try:
        # When 40 jobs run
        sent = [noop.send() for _ in range(40)]
        wait_for(lambda: _all_done(database_url, [m.message_id for m in sent]), timeout_s=20, what="the jobs done")
    finally:
        del settler.settle_once
    # Then as each batch was written, every run in it and before it was counted already
    assert seen and seen[-1][0] == 40
    assert all(counted >= written for written, counted in seen), seen
    # and, once done, every run is counted, timed, and no longer in progress
    assert _figures() == (messages + 40, durations + 40, claims + 40, 0.0)


def test_a_failed_run_is_counted_with_its_error_and_its_retry_in_the_same_batch(broker, database_url, start_worker):
    start_worker(queues=["index"])
    errors = REGISTRY.get_sample_value("dramatiq_message_errors_total",
                                       {"queue_name": "index", "actor_name": "test.raise_once"}) or 0.0
    retries = REGISTRY.get_sample_value("dramatiq_message_retries_total",
                                        {"queue_name": "index", "actor_name": "test.raise_once"}) or 0.0
    message = raise_once.send("batched-metrics")
    wait_for(lambda: _all_done(database_url, [message.message_id]), timeout_s=20, what="the retried job done")
    labels = {"queue_name": "index", "actor_name": "test.raise_once"}
    assert REGISTRY.get_sample_value("dramatiq_message_errors_total", labels) == errors + 1
    assert REGISTRY.get_sample_value("dramatiq_message_retries_total", labels) == retries + 1


def test_what_a_run_noted_is_written_while_no_outcome_follows_it(broker, database_url, start_worker):
    # Given an idle worker whose settler has written a job's outcome
    start_worker(queues=["index"])
    first = noop.send()
    wait_for(lambda: _all_done(database_url, [first.message_id]), timeout_s=20, what="the first job done")
    # When a value is noted with no run, and so no outcome, after it
    child = metrics.child(metrics.SNOOZES, "index", "test.batched-idle")
    before = REGISTRY.get_sample_value("standmeet_snoozes_total",
                                       {"queue_name": "index", "actor_name": "test.batched-idle"}) or 0.0
    _metrics(broker)._note(child, ADD, 1)
    # Then the idle settler writes it within its tick
    wait_for(lambda: REGISTRY.get_sample_value("standmeet_snoozes_total",
                                               {"queue_name": "index", "actor_name": "test.batched-idle"}) == before + 1,
             timeout_s=5, what="the noted value written by the idle settler")


def test_a_failing_batch_listener_is_said_once_and_never_stops_the_outcomes(broker, database_url, start_worker, caplog):
    # Given a batch listener that always fails
    def broken() -> None:
        raise RuntimeError("listener broke")

    broker.settle_listeners.append(broken)
    try:
        start_worker(queues=["index"])
        # When jobs run in several batches
        with caplog.at_level(logging.ERROR, logger="standmeet.broker"):
            for _ in range(3):
                message = noop.send()
                wait_for(lambda m=message: _all_done(database_url, [m.message_id]), timeout_s=20, what="a job done")
    finally:
        broker.settle_listeners.remove(broken)
    # Then every outcome was written, and the failure said once
    assert [r.getMessage() for r in caplog.records if "batch listener" in r.getMessage()] == [
        f"settler: a batch listener ({broken!r}) failed; outcomes are still written"]


def test_a_long_job_is_seen_in_progress_while_it_runs_and_no_longer_once_it_ended(broker, database_url, start_worker):
    # Given a worker on our broker, whose runs note their start with the next batch
    start_worker(queues=["index"])
    assert _metrics(broker).batched
    _release.clear()
    before = _in_progress("test.held_for_metrics")
    try:
        # When a job runs and goes on running, with no other outcome written meanwhile
        message = held_for_metrics.send()
        # Then the gauge counts it while it runs (the idle settler's tick writes its start)
        wait_for(lambda: _in_progress("test.held_for_metrics") == before + 1, timeout_s=5,
                 what="the running job counted in progress")
    finally:
        _release.set()
    # and no longer once it has ended
    wait_for(lambda: _all_done(database_url, [message.message_id]), timeout_s=20, what="the held job done")
    assert _in_progress("test.held_for_metrics") == before
