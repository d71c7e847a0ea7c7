"""A step-down interrupts jobs while they run, and at no other moment.

The interruption is asynchronous: the interpreter delivers it at its next check, which
may come after the job has returned (then it is dropped, and the run's outcome is what
the job did), and a job handed to a thread just before the step-down must not start
while the process is stepped down. These tests pause a worker thread exactly where a
descheduled thread would be, then step down.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from dramatiq.middleware import Middleware

from broker.engine import runs
from tests.integration.test_step_down import _started, _state, cut_off
from tests.support.db import wait_for
from tests.support.jobs import CUES, CUT_RUNS, ended_on_cue, held_through_a_cut, raise_once

LEAVE = runs.RunningJobs.leave.__code__


class _PausesAsTheJobEnds(Middleware):
    """Pauses the worker thread running ``message_id`` as it calls ``RunningJobs.leave``
    (the moment its job has returned or raised), until told to go on: where a thread
    descheduled as its job ends would be."""

    def __init__(self) -> None:
        self.message_id: str | None = None
        self.reached = threading.Event()
        self.go_on = threading.Event()

    def before_process_message(self, broker: Any, message: Any) -> None:
        if message.message_id != self.message_id:
            return

        def tracer(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code is LEAVE and not self.reached.is_set():
                sys.settrace(None)
                self.reached.set()
                self.go_on.wait(10)

        sys.settrace(tracer)


@pytest.fixture
def pause(broker: Any) -> Iterator[_PausesAsTheJobEnds]:
    middleware = _PausesAsTheJobEnds()
    broker.add_middleware(middleware)
    yield middleware
    middleware.go_on.set()
    broker.middleware.remove(middleware)


def test_a_step_down_as_a_returned_job_leaves_its_run_does_not_run_it_twice(broker, database_url, start_worker, pause):
    # Given a worker whose job has returned and is about to leave its run
    start_worker(queues=["index"], threads=1)
    message = held_through_a_cut.message("leave-a", 0.0)
    pause.message_id = message.message_id
    broker.enqueue(message)
    assert pause.reached.wait(10), "the job did not end"
    assert "leave-a:done" in CUT_RUNS
    # When the worker steps down at that moment
    broker.liveness.step_down(broker.settings.step_down_after_s)
    pause.go_on.set()
    # Then the job that returned is done after its one run, not run a second time
    wait_for(lambda: (_state(database_url, message.message_id) or ("",))[0] == "done", timeout_s=15,
             what="the run's outcome to be written")
    assert CUT_RUNS.count("leave-a:done") == 1
    assert _state(database_url, message.message_id) == ("done", 1)


def test_a_step_down_as_a_failed_job_leaves_its_run_does_not_kill_the_worker_thread(
    broker, database_url, start_worker, pause
):
    from middleware.queue_concurrency import QueueConcurrency
    from middleware.time_limit import TimeLimit

    # Given a worker whose job has just raised and is leaving its run
    worker = start_worker(queues=["index"], threads=4)
    failing = raise_once.message("leave-b")
    pause.message_id = failing.message_id
    broker.enqueue(failing)
    assert pause.reached.wait(10), "the job did not end"
    # When the worker steps down at that moment
    broker.liveness.step_down(broker.settings.step_down_after_s)
    pause.go_on.set()
    wait_for(lambda: not broker.stepped_down, timeout_s=10, what="the worker to step up")
    wait_for(lambda: (_state(database_url, failing.message_id) or ("",))[0] == "done", timeout_s=10,
             what="the failed job to run again")
    # Then every worker thread still runs, and nothing of that run is left held
    slots = next(m for m in broker.middleware if isinstance(m, QueueConcurrency))
    timers = next(m for m in broker.middleware if isinstance(m, TimeLimit)).manager
    dead = {t.ident for t in worker.workers if not t.is_alive()}
    assert {"dead worker threads": len(dead), "threads counted as running": len(broker._running),
            "queue slots held": slots.held("index"),
            "time limits armed on dead threads": len(dead & set(timers.deadlines))} == {
        "dead worker threads": 0, "threads counted as running": 0, "queue slots held": 0,
        "time limits armed on dead threads": 0}


class _HoldsAfterAck(Middleware):
    """Holds one worker thread just after it acked its run, in which it handed the next
    prefetched claim to the worker (as a thread descheduled there would be)."""

    def __init__(self) -> None:
        self.hold_id: str | None = None
        self.acked = threading.Event()
        self.go_on = threading.Event()

    def after_ack(self, broker: Any, message: Any) -> None:
        if message.message_id == self.hold_id:
            self.acked.set()
            self.go_on.wait(30)


def test_a_claim_handed_to_a_thread_just_before_a_step_down_does_not_start_while_stepped_down(
    broker, database_url, admin_url, start_worker
):
    hold = _HoldsAfterAck()
    broker.add_middleware(hold)
    try:
        # Given a worker running its queue's limit (4): three long jobs and one that ends on
        # cue, and a fifth claim prefetched
        worker = start_worker(queues=["index"], threads=4)
        longs = [held_through_a_cut.send(f"hand-{i}", 60.0) for i in range(3)]
        cued = ended_on_cue.send("hand-cue")
        for m in [*longs, cued]:
            wait_for(lambda m=m: _started(database_url, m.message_id), timeout_s=10, what="the jobs to start")
        fifth = held_through_a_cut.send("hand-b", 3.0)
        state = broker.queue_states["index"]
        wait_for(lambda: any(c.key[0] == fifth.message_id for c in state.buffer), timeout_s=10,
                 what="the fifth claim to be prefetched")
        # and the cued job ends: its thread hands the prefetched claim to the worker
        hold.hold_id = cued.message_id
        CUES.setdefault("hand-cue", threading.Event()).set()
        assert hold.acked.wait(10)
        assert (fifth.message_id, 1) in state.running and worker.work_queue.qsize() == 1
        # When the process is cut off and steps down before a thread has taken that claim
        with cut_off(admin_url, database_url):
            wait_for(lambda: all(f"hand-{i}:CutOff" in CUT_RUNS for i in range(3)),
                     timeout_s=broker.settings.rescue_after_s, what="the running jobs to be interrupted")
            hold.go_on.set()
            wait_for(lambda: (fifth.message_id, 1) not in state.running, timeout_s=10,
                     what="the handed claim to be run or refused")
            # Then it did not run while the process was stepped down (another process may
            # rescue it meanwhile: it would run twice at once)
            assert broker.stepped_down
            assert not [run for run in CUT_RUNS if run.startswith("hand-b:")]
    finally:
        hold.go_on.set()
        wait_for(lambda: not broker.stepped_down, timeout_s=10, what="the worker to step up")
        wait_for(lambda: all(f"hand-{k}:done" in CUT_RUNS for k in ("0", "1", "2", "b")), timeout_s=20,
                 what="every job to end")
        broker.middleware.remove(hold)


class _Watched:
    """A lock that says when a second thread waits for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.contended = threading.Event()

    def __enter__(self) -> _Watched:
        if not self._lock.acquire(blocking=False):
            self.contended.set()
            self._lock.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self._lock.release()


def test_a_step_up_proven_while_the_step_down_interrupts_leaves_jobs_free_to_start(broker, database_url, monkeypatch):
    # Given a step-down held between its flag and its interruption of the running jobs
    liveness = broker.liveness
    watched = _Watched()
    monkeypatch.setattr(liveness, "_down_lock", watched, raising=False)
    interrupt_all = liveness.running.interrupt_all
    interrupting, go_on = threading.Event(), threading.Event()

    def held_interrupt_all(exception: Any) -> int:
        interrupting.set()
        assert go_on.wait(10)
        return interrupt_all(exception)

    monkeypatch.setattr(liveness.running, "interrupt_all", held_interrupt_all)
    stepping_down = threading.Thread(target=lambda: liveness.step_down(1.0), name="test-step-down")
    stepping_down.start()
    assert interrupting.wait(10)
    # When the heartbeat proves the process alive meanwhile (it steps up, or waits to)
    proven = threading.Event()
    proving = threading.Thread(target=lambda: (liveness.prove_alive(), proven.set()), name="test-prove-alive")
    proving.start()
    wait_for(lambda: proven.is_set() or watched.contended.is_set(), timeout_s=10,
             what="the step-up, or its wait for the step-down")
    go_on.set()
    stepping_down.join(timeout=10)
    proving.join(timeout=10)
    assert not stepping_down.is_alive() and not proving.is_alive()
    # Then the process is up, and a job may start: it is not cut off as it enters
    assert not liveness.stepped_down
    liveness.running.enter()
    assert liveness.running.leave() is None
