"""RunningJobs: a step-down's interruption reaches a job's body and nothing after it."""

from __future__ import annotations

import threading

import pytest

from broker.engine.runs import RunningJobs, as_run, in_a_run
from broker.errors import CutOff
from tests.support.interrupts import interrupted_over_and_over


def test_an_interruption_is_raised_in_a_job_and_never_after_it():
    # Given two threads running a short job body over and over, as a worker's runs
    jobs = RunningJobs()
    after_the_job: list[BaseException] = []
    runs = {"returned": 0, "interrupted": 0}

    def body() -> None:
        for _ in range(50):  # the job: an interruption may land here, as it should
            pass

    run = as_run(body)

    def worker(stop: threading.Event) -> None:
        in_a_run(jobs)
        try:
            while not stop.is_set():
                try:
                    run()
                    runs["returned"] += 1
                except CutOff:  # in the job (at the latest as it returned): it runs again
                    runs["interrupted"] += 1
        except CutOff as exc:  # in the code after a job's end (a worker's settle, its loop)
            after_the_job.append(exc)
        finally:
            in_a_run(None)

    # When every job is interrupted, again and again, for a few seconds
    threads = interrupted_over_and_over(worker, lambda: (jobs.interrupt_all(CutOff), jobs.resume()), for_s=4,
                                        until=lambda: bool(after_the_job))
    # Then no interruption ever reached a thread once its job had ended, and none is
    # counted as running
    assert not after_the_job, f"an interruption landed after a job's end {len(after_the_job)} time(s)"
    assert not any(thread.is_alive() for thread in threads)
    assert runs["returned"] > 0 and runs["interrupted"] > 0 and len(jobs) == 0


def test_a_job_does_not_start_once_the_jobs_were_interrupted_until_they_resume():
    jobs = RunningJobs()
    ran: list[str] = []
    run = as_run(lambda: ran.append("ran"))
    in_a_run(jobs)
    try:
        jobs.interrupt_all(CutOff)
        with pytest.raises(CutOff):
            run()
        assert ran == [] and len(jobs) == 0
        jobs.resume()
        run()
        assert ran == ["ran"]
    finally:
        in_a_run(None)


def test_a_function_called_outside_a_worker_run_is_called_as_it_is():
    jobs = RunningJobs()
    jobs.interrupt_all(CutOff)
    run = as_run(lambda x: x + 1)
    assert run(1) == 2  # not in a run: neither counted nor refused
    assert as_run(run) is run
