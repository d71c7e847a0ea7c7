"""The memory broker does what the Postgres engine does where an application's test could
tell them apart: priority among due messages, an id sent twice, follow-ups and unique
keys, a follow-up it cannot store, refusals of a delay, a batch or an actor's priority,
and a cancelled run that returned. (Each was a difference an attacker's side-by-side run
found; the engine's side is tested in tests/integration.)"""

from __future__ import annotations

import threading

import dramatiq
import pytest

from broker.errors import InvalidMessage
from tests.unit.test_memory_broker import WAIT_S, start_worker


def test_among_due_messages_a_lower_priority_runs_first_then_the_first_due(make_broker):
    broker = make_broker(queues={"mem_prio": 1})
    ran: list[str] = []

    @dramatiq.actor(queue_name="mem_prio")
    def job(label: str) -> None:
        ran.append(label)

    job.send_with_options(args=("low p=10",), priority=10)
    job.send("default p=0 first")
    job.send_with_options(args=("urgent p=-5",), priority=-5)
    job.send("default p=0 second")
    job.send_with_options(args=("urgent but later",), priority=-9, delay=60_000)
    broker.drain(advance=False)
    assert ran == ["urgent p=-5", "default p=0 first", "default p=0 second", "low p=10"]
    broker.drain()
    assert ran[-1] == "urgent but later"


def test_an_id_sent_twice_runs_once_and_one_that_ran_is_never_run_again(make_broker):
    broker = make_broker()
    ran: list[int] = []

    @dramatiq.actor(queue_name="mem_ids")
    def job(n: int) -> None:
        ran.append(n)

    message = job.message(1)
    broker.enqueue(message)
    broker.enqueue(message.copy(args=(2,)))  # the same id while it waits: the new one whole
    assert [m.args for m in broker.waiting("mem_ids")] == [(2,)]
    assert broker.drain() == 1 and ran == [2]
    broker.enqueue(message)  # the same id once it ran: not resurrected
    assert broker.drain() == 0 and ran == [2]
    broker.flush_all()  # a test's reset forgets what ran
    broker.enqueue(message)
    assert broker.drain() == 1 and ran == [2, 1]


def test_a_pipeline_step_to_a_unique_actor_runs_though_its_key_is_held_and_holds_it_when_free(make_broker):
    # (the engine writes a run's follow-up with its key when no live message holds it,
    # and without it otherwise: a pipeline is never cut by a key)
    broker = make_broker()
    ran: list[tuple[str, int]] = []

    @dramatiq.actor(queue_name="mem_follow")
    def edit(n: int) -> int:
        ran.append(("edit", n))
        return n

    @dramatiq.actor(queue_name="mem_follow", unique=True)
    def rebuild(n: int) -> None:
        ran.append(("rebuild", n))

    held = rebuild.send_with_options(args=(7,), delay=60_000)  # holds the key, due later
    dramatiq.pipeline([edit.message(7), rebuild.message()]).run()
    broker.drain(advance=False)
    assert ran == [("edit", 7), ("rebuild", 7)]
    assert [m.message_id for m in broker.waiting("mem_follow")] == [held.message_id]
    # a step whose key is free holds it: the same call sent meanwhile is folded into it
    dramatiq.pipeline([edit.message(8), rebuild.message_with_options(pipe_ignore=True, delay=60_000, args=(8,))]).run()
    broker.drain(advance=False)
    step = [m for m in broker.waiting("mem_follow") if m.args == (8,)]
    assert len(step) == 1
    assert rebuild.send(8).message_id == step[0].message_id


def test_a_follow_up_that_cannot_be_stored_fails_its_hook_and_the_rest_run(make_broker):
    broker = make_broker()
    ran: list[str] = []

    @dramatiq.actor(queue_name="mem_bad_follow")
    def ratio() -> float:
        ran.append("ratio")
        return float("nan")

    @dramatiq.actor(queue_name="mem_bad_follow")
    def report(value: float) -> None:
        ran.append("report")

    @dramatiq.actor(queue_name="mem_bad_follow")
    def other() -> None:
        ran.append("other")

    dramatiq.pipeline([ratio.message(), report.message()]).run()
    other.send()
    # the next step carries NaN: refused in the pipeline's after-hook (logged), as the engine does
    assert broker.drain() == 2
    assert ran == ["ratio", "other"]
    assert [m.actor_name for m in broker.done] == ["ratio", "other"]


@pytest.mark.parametrize("delay", [-5000, "1000", True, 10 ** 13, float("nan"), float("inf")])
def test_a_delay_the_engine_refuses_is_refused_in_one_line(make_broker, delay):
    broker = make_broker()

    @dramatiq.actor(queue_name="mem_delay")
    def job() -> None:
        pass

    with pytest.raises(InvalidMessage, match="is not a number of milliseconds"):
        job.send_with_options(delay=delay)
    with pytest.raises(InvalidMessage, match="is not a number of milliseconds"):
        broker.enqueue_many([job.message()], delay=delay)
    assert broker.waiting("mem_delay") == []


def test_a_batch_is_checked_whole_before_any_of_it_is_kept(make_broker):
    broker = make_broker()

    @dramatiq.actor(queue_name="mem_batch")
    def job(value: object) -> None:
        pass

    twice = job.message("twice")
    with pytest.raises(InvalidMessage, match="is in this batch twice"):
        broker.enqueue_many([twice, job.message("between"), twice])
    with pytest.raises(InvalidMessage, match="holds nan"):
        broker.enqueue_many([job.message("first"), job.message(float("nan")), job.message("third")])
    assert broker.waiting("mem_batch") == []


def test_an_actor_whose_priority_its_column_cannot_hold_has_its_sends_refused(make_broker):
    broker = make_broker()

    @dramatiq.actor(queue_name="mem_big_prio", priority=2 ** 31)
    def job() -> None:
        pass

    with pytest.raises(InvalidMessage, match="has the priority 2147483648"):
        job.send()
    assert broker.waiting("mem_big_prio") == []


def test_a_cancelled_running_unique_job_frees_its_key(make_broker):
    # (the engine's cancel takes the running bit of its key: the same call sent again runs)
    broker = make_broker(queues={"mem_cancel_unique": 2})
    started, cancelled = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name="mem_cancel_unique", unique=True)
    def job(n: int) -> None:
        started.set()
        cancelled.wait(WAIT_S)

    start_worker(broker)
    first = job.send(1)
    assert started.wait(WAIT_S)
    assert broker.cancel(first.message_id) == "stopping"
    again = job.send(1)
    cancelled.set()
    broker.join("mem_cancel_unique", timeout=5_000, fail_fast=False)
    assert again.message_id != first.message_id
    assert [m.message_id for m in broker.dead_letters] == [first.message_id]
    assert again.message_id in [m.message_id for m in broker.done]


def test_a_cancelled_run_that_returns_is_rejected_saying_so(make_broker):
    broker = make_broker(queues={"mem_cancel_returns": 1})
    started, cancelled = threading.Event(), threading.Event()

    @dramatiq.actor(queue_name="mem_cancel_returns")
    def job() -> None:
        started.set()
        cancelled.wait(WAIT_S)  # never looks at its deadline: returns after the cancellation

    start_worker(broker)
    message = job.send()
    assert started.wait(WAIT_S)
    assert broker.cancel(message.message_id) == "stopping"
    cancelled.set()
    broker.join("mem_cancel_returns", timeout=5_000, fail_fast=False)
    (rejected,) = broker.dead_letters
    assert rejected.message_id == message.message_id
    assert rejected.options["error"] == "cancelled by an operator: its run returned after the cancellation"
    assert broker.done == []
