"""A queue's running slots (``middleware.queue_concurrency.Slots``) and the per-run
bookkeeping of the cancellation watch, the running-jobs list and the time limit, with
real threads: what each guarantees, seen from the other threads."""

from __future__ import annotations

import threading
import time

import pytest

from broker import deadline
from broker.deadline import WatchedRuns
from broker.errors import JobCancelled
from broker.running import RunningJobs
from middleware.queue_concurrency import Slots
from middleware.time_limit import TimeLimit, Timers

WAIT_S = 5.0


def test_a_take_beyond_the_limit_waits_until_a_slot_is_given_back():
    # Given two slots, both held
    slots = Slots(2)
    slots.take(("a", 1))
    slots.take(("b", 1))
    started = threading.Event()
    took = threading.Event()

    def third() -> None:
        started.set()
        slots.take(("c", 1))
        took.set()

    thread = threading.Thread(target=third, daemon=True)
    thread.start()
    assert started.wait(WAIT_S)
    # Then the third waits while both are held (as long as we care to look)
    assert not took.wait(0.2)
    assert slots.held() == 2
    # When one is given back, the waiting one takes it
    assert slots.give_back(("a", 1))
    assert took.wait(WAIT_S)
    thread.join(WAIT_S)
    assert slots.held() == 2


def test_giving_back_a_slot_twice_frees_it_once():
    slots = Slots(1)
    slots.take(("a", 1))
    assert slots.give_back(("a", 1)) is True
    assert slots.give_back(("a", 1)) is False
    assert slots.give_back(("never", 1)) is False
    # the limit still holds: one taken, a second would wait
    slots.take(("b", 1))
    assert slots.held() == 1
    waiter = threading.Thread(target=slots.take, args=(("c", 1),), daemon=True)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    slots.give_back(("b", 1))
    waiter.join(WAIT_S)
    assert not waiter.is_alive()


def test_many_threads_never_hold_more_than_the_limit_at_once():
    slots = Slots(3)
    lock = threading.Lock()
    holding = 0
    most = 0

    def run(n: int) -> None:
        nonlocal holding, most
        for i in range(200):
            key = (f"t{n}", i)
            slots.take(key)
            with lock:
                holding += 1
                most = max(most, holding)
            with lock:
                holding -= 1
            assert slots.give_back(key)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert 1 <= most <= 3
    assert slots.held() == 0


def test_a_message_running_on_two_threads_is_watched_until_both_runs_end_and_both_are_cancelled():
    runs = WatchedRuns()
    first, second = runs.watch("m1"), runs.watch("m1")
    assert runs.mark_cancelled(["m1"]) == ["m1", "m1"]
    runs.unwatch(first)
    assert runs.running() == ["m1"]
    assert second.cancelled  # still running on the other thread: still cancelled
    runs.unwatch(second)
    assert runs.running() == []


def test_a_run_reads_its_own_cancellation_and_no_other():
    runs = WatchedRuns()
    cancelled, other = runs.watch("m1"), runs.watch("m2")
    runs.mark_cancelled(["m1"])
    try:
        deadline.set_run(other)
        deadline.check()  # not cancelled: goes on
        deadline.set_run(cancelled)
        with pytest.raises(JobCancelled):
            deadline.check()
    finally:
        deadline.set_run(None)
        runs.unwatch(cancelled)
        runs.unwatch(other)
    assert not deadline.cancelled()  # out of a run: nothing to cancel


def test_an_answer_about_the_runs_a_watcher_read_marks_no_run_started_since():
    # Given the watcher read a message's run, and asked the database about it
    runs = WatchedRuns()
    read_run = runs.watch("m1")
    read = runs.runs()
    # When that run ends and another run of the message starts (an operator took the
    # cancel back and retried it) before the answer, "cancelled", arrives
    runs.unwatch(read_run)
    later = runs.watch("m1")
    try:
        runs.mark_cancelled(["m1"], among=read)
        # Then the later run is not marked by an answer about a run before it
        assert not later.cancelled
    finally:
        runs.unwatch(later)


def test_running_jobs_name_each_threads_job_and_forget_it_when_it_ends():
    jobs = RunningJobs()
    ready = threading.Barrier(3)
    done = threading.Event()

    def run(n: int) -> None:
        jobs.started(f"actor{n}", f"m{n}")
        ready.wait(WAIT_S)
        done.wait(WAIT_S)
        jobs.finished()

    threads = [threading.Thread(target=run, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    ready.wait(WAIT_S)
    assert sorted(job.message_id for job in jobs.now()) == ["m0", "m1"]
    done.set()
    for t in threads:
        t.join(WAIT_S)
    assert jobs.now() == []


def test_disarming_twice_stops_the_limit_once_and_clears_the_deadline():
    limit = TimeLimit(interval_ms=1000)
    limit._started = True  # as after the worker's boot, without its timer thread
    assert isinstance(limit.manager, Timers)
    ident = threading.get_ident()
    limit.manager.add_timeout(ident, 60_000)
    deadline.set_deadline(60)
    limit.disarm()
    assert ident not in limit.manager.deadlines
    assert deadline.remaining_s() is None
    limit.disarm()  # the after-hook's call, after the broker's: nothing left, no error
    assert ident not in limit.manager.deadlines
    # a limit armed again afterwards is disarmed again
    limit.manager.add_timeout(ident, 60_000)
    limit.disarm()
    assert ident not in limit.manager.deadlines


def test_a_thread_past_its_deadline_is_interrupted_and_then_has_nothing_to_disarm():
    limit = TimeLimit(interval_ms=1000)
    limit._started = True
    interrupted = threading.Event()
    armed = threading.Event()

    def job() -> None:
        limit.manager.add_timeout(threading.get_ident(), 1)
        armed.set()
        try:
            end = time.monotonic() + WAIT_S
            while time.monotonic() < end:
                time.sleep(0.001)
        except BaseException:
            interrupted.set()
        limit.disarm()  # its deadline was removed when it fired: nothing to stop

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    assert armed.wait(WAIT_S)
    deadline_at = time.monotonic() + WAIT_S
    while not limit.manager.fire_due() and time.monotonic() < deadline_at:
        time.sleep(0.005)
    assert interrupted.wait(WAIT_S)
    thread.join(WAIT_S)
    assert not thread.is_alive()
    assert limit.manager.deadlines == {}


def test_a_limit_firing_as_the_run_ends_is_delivered_to_the_brokers_disarm_not_after_it():
    """The timers delete a fired deadline, log, then raise its interruption, all under
    their lock: a disarm that found the deadline gone and did not wait for the lock let
    the interruption land later, in the after-hooks or the thread's next job."""
    import logging

    from dramatiq.middleware.time_limit import TimeLimitExceeded

    from broker.engine.runs import disarm

    # Given the timers paused inside their log line, the job's deadline already deleted
    inside, release = threading.Event(), threading.Event()

    class Paused(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            inside.set()
            release.wait(WAIT_S)

    log = logging.getLogger("standmeet.time_limit")
    handler = Paused()
    log.addHandler(handler)
    limit = TimeLimit(interval_ms=1000)
    limit._started = True
    armed, disarm_returned, fired = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def job() -> None:
        limit.manager.add_timeout(threading.get_ident(), 0)  # its limit has just passed
        armed.set()
        try:
            inside.wait(WAIT_S)
            # When the run ends and the broker disarms, before any after-hook
            seen["late"] = disarm([limit.disarm])
            disarm_returned.set()
            fired.wait(WAIT_S)
            for _ in range(1000):  # the after-hooks, the settle, the next job
                _ = len(seen)
            seen["after"] = None
        except TimeLimitExceeded as exc:
            seen["after"] = exc
        finally:
            disarm_returned.set()

    worker = threading.Thread(target=job, daemon=True)
    try:
        worker.start()
        assert armed.wait(WAIT_S)
        firer = threading.Thread(target=limit.manager.fire_due, daemon=True)
        firer.start()
        assert inside.wait(WAIT_S)
        # (a disarm that does not wait for the timers' lock returns now)
        disarm_returned.wait(0.5)
        release.set()
        firer.join(WAIT_S)
        fired.set()
        worker.join(WAIT_S)
        assert not worker.is_alive()
    finally:
        release.set()
        log.removeHandler(handler)
    # Then the interruption reached the broker's disarm, and nothing arrived after it
    assert isinstance(seen["late"], TimeLimitExceeded), seen
    assert seen["after"] is None, seen


def test_a_cancel_read_for_a_run_that_has_ended_since_leaves_no_mark_behind():
    # Given the watcher read two running ids, and one of the runs ended before its answer
    runs = WatchedRuns()
    still = runs.watch("still-running")
    ended = runs.watch("ended-meanwhile")
    read = runs.running()
    runs.unwatch(ended)
    try:
        # When the answer says both were cancelled
        marked = runs.mark_cancelled(read)
        # Then only the running one is marked; a later run of the ended one's message in
        # this process starts unmarked (it would otherwise start cancelled)
        assert marked == ["still-running"]
        assert still.cancelled
        later = runs.watch("ended-meanwhile")
        assert not later.cancelled
        runs.unwatch(later)
    finally:
        runs.unwatch(still)
    assert runs.running() == []
