"""The policies of ``middleware/``, on the memory broker: what the integration tier checks
against Postgres (tests/integration/test_snooze_and_delays.py, test_unique_jobs.py,
test_async_actors.py, test_queue_limits.py), here in milliseconds and with no database.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import dramatiq
import pytest
from dramatiq.middleware.time_limit import TimeLimitExceeded

from broker.errors import ConfigError
from middleware import Snooze
from middleware.queue_concurrency import QueueConcurrency


def _name(stem: str) -> str:
    return f"test.{stem}_{uuid.uuid4().hex[:6]}"


def test_a_job_snoozed_three_times_ends_done_with_no_retry_and_three_snoozes(make_broker, caplog):
    broker = make_broker()
    runs: list[str] = []
    failures: list[str] = []

    @dramatiq.actor(actor_name=_name("on_failure"), queue_name="mem_policy")
    def on_failure(message: dict, error: dict) -> None:
        failures.append(message["message_id"])

    @dramatiq.actor(actor_name=_name("snooze_n"), queue_name="mem_policy")
    def snooze_n(times: int) -> None:
        runs.append("run")
        if len(runs) <= times:
            raise Snooze(0.05, reason="not ready")

    with caplog.at_level(logging.INFO):
        message = snooze_n.send_with_options(args=(3,), on_failure=on_failure.actor_name)
        assert broker.drain() == 4  # three snoozes and the success
    (done,) = broker.done
    assert done.message_id == message.message_id
    assert done.options.get("retries", 0) == 0 and done.options["snoozes"] == 3
    assert failures == []  # no failure callback fired
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    outcomes = [r.outcome for r in caplog.records if getattr(r, "message_id", None) == message.message_id]
    assert outcomes == ["snoozed", "snoozed", "snoozed", "done"]  # the job log's lines


def test_an_endless_snooze_fails_clearly_at_its_message_cap(make_broker):
    broker = make_broker()
    runs: list[int] = []

    @dramatiq.actor(actor_name=_name("snooze_forever"), queue_name="mem_policy")
    def snooze_forever() -> None:
        runs.append(1)
        raise Snooze(0)

    snooze_forever.send_with_options(max_snoozes=5)
    broker.drain()
    assert len(runs) == 6
    (rejected,) = broker.dead_letters
    assert rejected.options["error"] == "snoozed 6 times, more than its cap of 5"


def test_each_failed_run_fires_the_failure_callback_once_that_run_is_settled(make_broker):
    broker = make_broker(max_retries=1)
    failures: list[tuple[str, str]] = []

    @dramatiq.actor(actor_name=_name("on_failure"), queue_name="mem_policy")
    def on_failure(message: dict, error: dict) -> None:
        failures.append((message["message_id"], error["message"]))

    @dramatiq.actor(actor_name=_name("always_fails"), queue_name="mem_policy")
    def always_fails() -> None:
        raise ValueError("no good")

    message = always_fails.send_with_options(on_failure=on_failure.actor_name)
    assert broker.drain() == 4  # the run and its one retry, each with its callback (Dramatiq's Callbacks)
    assert failures == [(message.message_id, "no good")] * 2
    assert [m.message_id for m in broker.dead_letters] == [message.message_id]


def test_a_retry_of_a_unique_job_is_not_blocked_by_its_own_key(make_broker):
    broker = make_broker()
    runs: list[str] = []

    @dramatiq.actor(actor_name=_name("unique_raise_once"), queue_name="mem_policy", unique=True)
    def unique_raise_once(label: str) -> None:
        runs.append(label)
        if len(runs) == 1:
            raise RuntimeError("first run fails")

    message = unique_raise_once.send("retry-1")
    assert broker.drain() == 2
    assert runs == ["retry-1", "retry-1"]
    assert [m.message_id for m in broker.done] == [message.message_id]
    assert broker.done[0].options["retries"] == 1


def test_a_delayed_message_holds_its_key_until_it_runs(make_broker):
    broker = make_broker()

    @dramatiq.actor(actor_name=_name("unique_later"), queue_name="mem_policy", unique=True)
    def unique_later(label: str) -> None:
        pass

    delayed = unique_later.send_with_options(args=("held",), delay=60_000)
    assert unique_later.send("held").message_id == delayed.message_id
    broker.drain()
    assert unique_later.send("held").message_id != delayed.message_id


def test_a_bad_unique_option_is_refused_in_one_line_when_the_actor_is_declared(make_broker):
    make_broker()
    with pytest.raises(ConfigError, match=r"unique='yes' is not true, false or a UniqueBy"):
        dramatiq.actor(actor_name=_name("bad_unique"), queue_name="mem_policy", unique="yes")(lambda: None)


def test_worker_threads_are_raised_to_the_sum_of_the_served_queues_limits(make_broker):
    broker = make_broker(queues={"mem_wide": 5, "mem_narrow": 2})

    @dramatiq.actor(actor_name=_name("wide"), queue_name="mem_wide")
    def wide() -> None:
        pass

    @dramatiq.actor(actor_name=_name("narrow"), queue_name="mem_narrow")
    def narrow() -> None:
        pass

    worker = dramatiq.Worker(broker, queues=["mem_wide", "mem_narrow"], worker_threads=1, worker_timeout=20)
    (concurrency,) = [m for m in broker.middleware if isinstance(m, QueueConcurrency)]
    concurrency.before_worker_boot(broker, worker)
    assert worker.worker_threads == 7


def test_an_async_job_that_snoozes_runs_again_without_a_retry(make_broker):
    broker = make_broker()
    runs: list[int] = []

    @dramatiq.actor(actor_name=_name("async_snooze"), queue_name="mem_policy")
    async def async_snooze() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise Snooze(10)

    async_snooze.send()
    assert broker.drain() == 2
    (done,) = broker.done
    assert done.options["snoozes"] == 1 and "retries" not in done.options


def test_an_async_job_past_its_time_limit_is_cancelled_and_fails(make_broker):
    broker = make_broker(max_retries=0)
    ended: list[str] = []

    @dramatiq.actor(actor_name=_name("async_endless"), queue_name="mem_policy", time_limit=50)
    async def async_endless() -> None:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            ended.append("cancelled")
            raise

    async_endless.send()
    assert broker.drain() == 1
    (rejected,) = broker.dead_letters
    assert isinstance(rejected._exception, TimeLimitExceeded)
    assert ended == ["cancelled"]


def test_the_memory_broker_runs_the_production_policies_in_their_order(make_broker):
    from dramatiq.rate_limits.backends.stub import StubBackend as StubRateLimiterBackend
    from dramatiq.results.backends.stub import StubBackend

    from middleware import default_middleware

    broker = make_broker()
    production = default_middleware(broker.settings, results=StubBackend(), rate_limiter=StubRateLimiterBackend())
    postgres_only = {"ConnectionBudget", "Metrics", "GracefulShutdown"}
    on_the_clock = {"ClockedAgeLimit": "AgeLimit"}  # the same policy, on the broker's clock
    assert [on_the_clock.get(type(m).__name__, type(m).__name__) for m in broker.middleware] == [
        type(m).__name__ for m in production if type(m).__name__ not in postgres_only]
