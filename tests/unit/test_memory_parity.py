"""More places where the memory broker parted from the Postgres broker on the same
program (a reviewer's side-by-side run found each): results and their ttl, max_age on the
broker's clock, a send while a retry waits, join's timeout, after_enqueue on a unique skip,
dead letters' reason, the time-limit thread, a job still running at the last worker's
stop. Each test names what production does (tests/integration checks it against
Postgres) and asserts the memory broker does the same."""

from __future__ import annotations

import asyncio
import threading
import uuid

import dramatiq
import pytest
from dramatiq.middleware import Middleware
from dramatiq.results import ResultMissing

from tests.support.db import wait_for


def _name(stem: str) -> str:
    return f"test.{stem}_{uuid.uuid4().hex[:6]}"


def test_a_result_kept_with_no_ttl_or_under_a_second_is_there_to_read_and_expires_by_the_clock(make_broker):
    # (Postgres keeps result_ttl=None until deleted, and counts a ttl in milliseconds)
    broker = make_broker()

    @dramatiq.actor(actor_name=_name("forever"), queue_name="mem_fid", store_results=True, result_ttl=None)
    def forever(x: int) -> int:
        return x * 2

    @dramatiq.actor(actor_name=_name("short"), queue_name="mem_fid", store_results=True, result_ttl=800)
    def short(x: int) -> int:
        return x * 3

    kept, brief = forever.send(2), short.send(3)
    assert broker.drain() == 2
    assert kept.get_result(backend=broker.results) == 4
    assert brief.get_result(backend=broker.results) == 9
    broker.advance(1)
    with pytest.raises(ResultMissing):
        brief.get_result(backend=broker.results)
    broker.advance(10 * 365 * 86_400)
    assert kept.get_result(backend=broker.results) == 4


def test_results_belong_to_their_broker_and_flush_all_forgets_them(make_broker):
    first = make_broker()

    @dramatiq.actor(actor_name=_name("answer"), queue_name="mem_fid", store_results=True)
    def answer() -> int:
        return 42

    message = answer.send()
    first.drain()
    assert message.get_result(backend=first.results) == 42
    second = make_broker()
    with pytest.raises(ResultMissing):
        message.get_result(backend=second.results)
    first.flush_all()
    with pytest.raises(ResultMissing):
        message.get_result(backend=first.results)


def test_a_blocking_read_wakes_when_a_worker_stores_the_result(make_broker):
    broker = make_broker()
    release = threading.Event()

    @dramatiq.actor(actor_name=_name("gated"), queue_name="mem_fid", store_results=True)
    def gated() -> str:
        release.wait(10)
        return "stored"

    worker = dramatiq.Worker(broker, worker_timeout=100)
    worker.start()
    broker.started_workers.append(worker)
    message = gated.send()
    threading.Timer(0.2, release.set).start()
    assert message.get_result(backend=broker.results, block=True, timeout=10_000) == "stored"


def test_max_age_is_measured_on_the_brokers_clock(make_broker):
    # (production drops a message delayed past its max_age: it is that old when it is due)
    broker = make_broker()
    ran: list[int] = []

    @dramatiq.actor(actor_name=_name("aged"), queue_name="mem_fid", max_age=60_000)
    def aged(x: int) -> None:
        ran.append(x)

    aged.send_with_options(args=(1,), delay=120_000)
    aged.send_with_options(args=(2,), delay=30_000)
    broker.drain()
    assert ran == [2]
    (dropped,) = broker.dead_letters
    assert dropped.args == (1,) and "age limit" in dropped.options["error"]


def test_a_message_sent_again_while_it_waits_for_its_retry_replaces_it_and_runs_now(make_broker):
    # (the engine replaces a queued row of the same id, a retry's included, with the new send)
    broker = make_broker()
    calls: list[int] = []

    @dramatiq.actor(actor_name=_name("flaky"), queue_name="mem_fid")
    def flaky(x: int) -> None:
        calls.append(x)
        if len(calls) == 1:
            raise ValueError("the first run fails")

    message = flaky.message(1)
    broker.enqueue(message)
    broker.drain(advance=False)
    assert [(m.args, m.options.get("retries")) for m in broker.waiting("mem_fid")] == [((1,), 1)]
    broker.enqueue(message.copy(args=(2,)))
    assert [(m.args, m.options.get("retries")) for m in broker.waiting("mem_fid")] == [((2,), None)]
    assert broker.drain(advance=False) == 1
    assert calls == [1, 2]
    # and once it is done, the same id sent again is not run again
    broker.enqueue(message.copy(args=(3,)))
    assert broker.drain() == 0


def test_join_with_advance_measures_its_timeout_in_real_time(make_broker):
    broker = make_broker()
    runs: list[int] = []

    @dramatiq.actor(actor_name=_name("retried_later"), queue_name="mem_fid")
    def retried_later() -> None:
        runs.append(1)
        if len(runs) == 1:
            raise ValueError("the first run fails; its retry is a minute away")

    worker = dramatiq.Worker(broker, worker_timeout=100)
    worker.start()
    broker.started_workers.append(worker)
    retried_later.send()
    broker.join("mem_fid", timeout=10_000, advance=True)  # the clock jumps a minute; real time does not
    assert runs == [1, 1]


def test_after_enqueue_hooks_see_the_live_message_a_unique_send_returns(make_broker):
    broker = make_broker()
    seen: list[str] = []

    class Seen(Middleware):
        def after_enqueue(self, broker: object, message: dramatiq.Message, delay: int | None) -> None:
            seen.append(message.message_id)

    broker.add_middleware(Seen())

    @dramatiq.actor(actor_name=_name("keyed"), queue_name="mem_fid", unique=True)
    def keyed(x: int) -> None:
        """Runs once a key."""

    first = keyed.send(1)
    again = keyed.send(1)
    (many,) = broker.enqueue_many([keyed.message(1)])
    assert again.message_id == many.message_id == first.message_id
    assert seen == [first.message_id] * 3


def test_every_dead_letter_says_why_it_was_rejected(make_broker):
    broker = make_broker(max_retries=0)

    @dramatiq.actor(actor_name=_name("boom"), queue_name="mem_fid")
    def boom() -> None:
        raise KeyError("nope")

    boom.send()
    broker.drain()
    (rejected,) = broker.dead_letters
    assert rejected.options["error"].rstrip().endswith("KeyError: 'nope'")  # its traceback, as the row keeps it


def test_no_time_limit_thread_outlives_the_workers_of_a_memory_broker(make_broker):
    def timers() -> int:
        return sum(1 for t in threading.enumerate() if t.name == "standmeet-time-limits")

    before = timers()
    for _ in range(3):
        broker = make_broker()

        @dramatiq.actor(actor_name=_name("quick"), queue_name="mem_fid")
        def quick() -> None:
            """Does nothing."""

        quick.send()
        broker.drain()
        worker = dramatiq.Worker(broker, worker_timeout=100)
        worker.start()
        worker.stop(timeout=5_000)
    wait_for(lambda: timers() <= before, timeout_s=5, what="the time-limit threads to stop")


def test_a_job_still_running_when_the_last_worker_stops_is_cut_off_and_runs_again(make_broker):
    # (the engine gives a job still running at the shutdown timeout back to its queue: it
    # runs again, no retry counted)
    broker = make_broker()
    events: list[str] = []
    started = threading.Event()

    @dramatiq.actor(actor_name=_name("slow_async"), queue_name="mem_fid")
    async def slow_async() -> None:
        started.set()
        try:
            await asyncio.sleep(30)
            events.append("end")
        except asyncio.CancelledError:
            events.append("cancelled")
            raise
        finally:
            events.append("finally")

    worker = dramatiq.Worker(broker, worker_timeout=100)
    worker.start()
    message = slow_async.send()
    assert started.wait(10)
    # When the worker stops before the job ends
    worker.stop(timeout=200)
    # Then the coroutine was cancelled and cleaned up, and the message waits to run again
    assert events == ["cancelled", "finally"]
    (waiting,) = broker.waiting("mem_fid")
    assert waiting.message_id == message.message_id and not waiting.options.get("retries")
    assert broker.dead_letters == [] and broker.done == []
    wait_for(lambda: not any(t.is_alive() for t in worker.workers), timeout_s=5, what="the worker threads to end")
    assert broker._queue("mem_fid").handed_out == 0  # the queue's count is free for the next worker


def test_a_message_cancelled_once_handed_out_but_before_its_run_starts_is_stopped_and_rejected(make_broker):
    # (the engine's settle rejects any run cancelled before it ended, and its claim never
    # runs a message cancelled while it waited)
    from broker import deadline
    from middleware.queue_concurrency import QueueConcurrency

    broker = make_broker()
    handed_out, go_on = threading.Event(), threading.Event()
    ran: list[str] = []

    class HoldsTheStart(Middleware):
        def before_process_message(self, broker: object, message: object) -> None:
            handed_out.set()
            go_on.wait(10)

    broker.add_middleware(HoldsTheStart(), before=QueueConcurrency)

    @dramatiq.actor(actor_name=_name("checks"), queue_name="mem_fid")
    def checks() -> None:
        ran.append("started")
        deadline.check()
        ran.append("went on")

    worker = dramatiq.Worker(broker, worker_timeout=100)
    worker.start()
    broker.started_workers.append(worker)
    message = checks.send()
    assert handed_out.wait(10)
    # When an operator cancels it between its hand-out and its start
    assert broker.cancel(message.message_id) == "stopping"
    go_on.set()
    broker.join("mem_fid", fail_fast=False, timeout=10_000)
    # Then it stopped at its first check and was rejected, saying so
    assert ran == ["started"] and broker.done == []
    (rejected,) = broker.dead_letters
    assert rejected.options["error"].startswith("cancelled by an operator")


def test_max_age_counts_from_a_send_on_the_brokers_clock_after_it_was_advanced(make_broker):
    broker = make_broker()
    ran: list[int] = []

    @dramatiq.actor(actor_name=_name("fresh"), queue_name="mem_fid", max_age=60_000)
    def fresh(x: int) -> None:
        ran.append(x)

    broker.advance(3_600)  # an hour on the broker's clock, before the send
    fresh.send(1)
    assert broker.drain() == 1 and ran == [1] and broker.dead_letters == []


def test_a_message_cancelled_while_handed_out_and_given_back_unstarted_is_rejected_never_run(make_broker):
    # (the engine's give-back rejects a cancelled claim: it never runs)
    broker = make_broker()
    ran: list[int] = []

    @dramatiq.actor(actor_name=_name("given_back"), queue_name="mem_fid")
    def given_back() -> None:
        ran.append(1)

    message = given_back.send()
    handed = broker.take(["mem_fid"])  # a consumer thread's prefetch
    assert handed is not None and broker.cancel(message.message_id) == "stopping"
    broker.requeue([handed])  # a stopping worker gives its unstarted prefetch back
    assert broker.waiting("mem_fid") == [] and broker.drain() == 0 and ran == []
    (rejected,) = broker.dead_letters
    assert rejected.options["error"] == "cancelled by an operator: not run"
