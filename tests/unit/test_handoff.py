"""A worker thread that hands its next job to itself wakes no other worker thread; every
other put is Dramatiq's, and nothing put is lost."""

from __future__ import annotations

import threading
import time
from queue import Empty, PriorityQueue

import dramatiq
import pytest
from dramatiq.brokers.stub import StubBroker

from broker.engine.handoff import HandOffQueue, adopt_work_queue, taking_it_myself, will_take_next


def _blocked_getter(queue: PriorityQueue, timeout_s: float) -> tuple[threading.Thread, list]:
    """A thread blocked in ``queue.get``; returns it and what it got (an item or Empty)."""
    got: list = []

    def get() -> None:
        try:
            got.append(queue.get(timeout=timeout_s))
        except Empty as exc:
            got.append(exc)

    thread = threading.Thread(target=get, daemon=True)
    thread.start()
    deadline = time.monotonic() + 5
    while not queue.not_empty._waiters:  # type: ignore[attr-defined]  # it is waiting
        assert time.monotonic() < deadline, "the getter never waited"
        time.sleep(0.001)
    return thread, got


def test_a_put_while_taking_it_myself_leaves_a_waiting_thread_asleep():
    # Given a thread waiting for work on the hand-off queue
    queue = HandOffQueue()
    thread, got = _blocked_getter(queue, timeout_s=1.0)
    # When this thread puts an item it will take itself
    with taking_it_myself():
        queue.put((1, "job"))
    # Then the waiter was not woken (it is still in the condition's waiters) ...
    assert len(queue.not_empty._waiters) == 1  # type: ignore[attr-defined]
    # ... and this thread takes the item at once
    assert queue.get_nowait() == (1, "job")
    thread.join(5)
    assert isinstance(got[0], Empty)
    assert queue.unfinished_tasks == 1  # counted as Dramatiq's put counts it (task_done follows)


def test_any_other_put_wakes_a_waiting_thread_as_dramatiqs_queue_does():
    queue = HandOffQueue()
    thread, got = _blocked_getter(queue, timeout_s=5)
    queue.put((1, "job"))
    thread.join(5)
    assert got == [(1, "job")]


def test_an_item_nobody_was_woken_for_is_found_by_a_waiting_threads_timed_get():
    # Given a thread waiting with a short timeout, and a put that woke nobody (as if its
    # putter never came back for it)
    queue = HandOffQueue()
    thread, got = _blocked_getter(queue, timeout_s=0.2)
    with taking_it_myself():
        queue.put((1, "job"))
    # Then the waiter finds it when its wait times out
    thread.join(5)
    assert got == [(1, "job")]


def test_only_a_running_worker_thread_of_the_same_queue_takes_the_next_itself():
    broker = StubBroker()
    try:
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
        adopt_work_queue(worker)
        assert type(worker.work_queue) is HandOffQueue
        assert not will_take_next(worker.work_queue)  # the test's thread is no worker thread
        seen: list[bool] = []

        @dramatiq.actor(broker=broker, queue_name="handoff")
        def probe() -> None:
            seen.append(will_take_next(worker.work_queue))
            seen.append(will_take_next(PriorityQueue()))

        worker.start()
        try:
            probe.send()
            broker.join("handoff", timeout=10_000)
            worker.join()
        finally:
            worker.stop()
        assert seen == [True, False]
    finally:
        broker.close()


@pytest.mark.parametrize("started", [False, True])
def test_a_worker_keeps_a_work_queue_it_already_uses(started):
    broker = StubBroker()
    try:
        worker = dramatiq.Worker(broker, worker_threads=1, worker_timeout=50)
        original = worker.work_queue
        if started:
            original.put((0, "already there"))
        else:
            worker.work_queue = original = HandOffQueue()
        adopt_work_queue(worker)
        assert worker.work_queue is original
    finally:
        broker.close()
