"""The time limit: once a run's limit is disarmed, its interruption never arrives later.

Before Python 3.13 a pending interruption is signalled by a flag all threads share, which
the first thread to take its own clears. These show that a limit fired into several jobs
at once still lands in its own job, or at its disarm, and never after: a thread that takes
the interpreter lock signals its own pending interruption again (checked on 3.10 to 3.12).
"""

from __future__ import annotations

import logging
import threading
import time

from dramatiq.middleware.time_limit import TimeLimitExceeded

from broker.engine.runs import RunningJobs, as_run, in_a_run
from middleware.time_limit import TimeLimit, Timers
from tests.support.interrupts import interrupted_over_and_over


def test_a_limit_that_fires_as_the_job_ends_is_delivered_at_its_disarm_and_never_after(caplog):
    # Given two worker threads running a short job over and over, each with a limit already
    # due, and the timers firing them as fast as they can (several in the same instant)
    caplog.set_level(logging.ERROR, logger="standmeet.time_limit")  # one warning a fire
    limit = TimeLimit(interval_ms=1)
    timers = limit.manager
    assert isinstance(timers, Timers)
    limit._started = True  # the timers are driven by this test, not by their thread
    after_the_disarm: list[BaseException] = []
    runs = {"ended": 0, "interrupted": 0, "dropped": 0}

    def body() -> None:
        for _ in range(50):  # the job: its limit may land here, as it should
            pass

    run = as_run(body)  # bracketed as the broker brackets an actor's function

    def worker(stop: threading.Event) -> None:
        me = threading.get_ident()
        in_a_run(RunningJobs(), [limit.disarm])
        try:
            while not stop.is_set():
                try:
                    timers.add_timeout(me, 0)  # the run's limit (a before-hook): due at once
                    run()  # its end disarms the limit before anything reads the run
                    runs["ended"] += 1
                except TimeLimitExceeded:
                    runs["interrupted"] += 1
                if in_a_run(RunningJobs(), [limit.disarm])[1] is not None:
                    runs["dropped"] += 1  # it fired as the job ended: delivered at the disarm
                for _ in range(50):  # the after-hooks, the settle, the worker's loop
                    pass
        except TimeLimitExceeded as exc:
            after_the_disarm.append(exc)
        finally:
            in_a_run(None)

    # When the limits fire, again and again, for a few seconds
    threads = interrupted_over_and_over(worker, timers.fire_due, for_s=2, until=lambda: bool(after_the_disarm))
    # Then no limit ever interrupted a thread once its run was disarmed
    assert not after_the_disarm, f"a time limit landed after its disarm {len(after_the_disarm)} time(s)"
    assert not any(thread.is_alive() for thread in threads)
    assert runs["interrupted"] > 0 and runs["ended"] > 0


def test_limits_fired_into_two_blocked_jobs_at_once_land_in_their_jobs_and_never_after(caplog):
    # Given two jobs blocked in a call that releases the interpreter (as on a socket), both
    # past their limit and interrupted in the same instant
    caplog.set_level(logging.ERROR, logger="standmeet.time_limit")
    limit = TimeLimit(interval_ms=1)
    timers = limit.manager
    assert isinstance(timers, Timers)
    limit._started = True
    wake = {"first": threading.Event(), "second": threading.Event()}
    blocked = {"first": threading.Event(), "second": threading.Event()}
    first_done, second_after = threading.Event(), threading.Event()
    seen: dict[str, str] = {}

    def job(name: str) -> None:
        blocked[name].set()
        wake[name].wait(10)
        if name == "first":  # it takes its interruption as it wakes
            for _ in range(100):
                pass

    def worker(name: str) -> None:
        run = as_run(lambda: job(name))
        me = threading.get_ident()
        in_a_run(RunningJobs(), [limit.disarm])
        try:
            try:
                timers.add_timeout(me, 0)
                run()
                seen[name] = "ended"
            except TimeLimitExceeded:
                seen[name] = "interrupted"
            in_a_run(None)
            if name == "first":
                first_done.set()
                return
            second_after.set()
            # the after-hooks, the settle, the next job: a while of Python, with another
            # thread asking for the interpreter meanwhile
            until = time.monotonic() + 1
            while time.monotonic() < until:
                pass
            seen["after"] = "nothing"
        except TimeLimitExceeded:
            seen["after"] = "interrupted after its run was disarmed"

    threads = {name: threading.Thread(target=worker, args=(name,), daemon=True) for name in wake}
    for thread in threads.values():
        thread.start()
    assert blocked["first"].wait(5) and blocked["second"].wait(5)
    assert len(timers.fire_due()) == 2
    # When the first wakes and takes its own interruption, and only then the second, whose
    # job returns as it wakes
    wake["first"].set()
    assert first_done.wait(5)
    wake["second"].set()
    assert second_after.wait(5)
    time.sleep(0.05)  # this thread then asks for the interpreter: a pending interruption lands then
    threads["second"].join(5)
    # Then each interruption landed in its own job (or at its disarm), never after it
    assert seen.get("after") == "nothing", seen
    assert seen["first"] == "interrupted", seen


def test_a_deadline_left_when_the_timer_stopped_never_fires_into_the_thread_that_reuses_its_id():
    # Given a job still running when the last worker stopped (its timer with it), whose
    # own disarm then comes

    limit = TimeLimit()
    assert isinstance(limit.manager, Timers)
    limit.manager.add_timeout(threading.get_ident(), 60_000)
    limit.manager.start()
    limit.manager.stop()
    # Then nothing of it is left for the next timer to fire
    assert limit.manager.deadlines == {}
    limit.manager.add_timeout(threading.get_ident(), 60_000)
    limit.disarm()  # a timer that is not running: the deadline goes all the same
    assert limit.manager.deadlines == {}

