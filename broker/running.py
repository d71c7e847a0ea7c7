"""The jobs running in this process, one per worker thread: what a shutdown names while
it waits, and what it cuts off (kept by ``middleware.JobLog``, read by
``middleware.GracefulShutdown`` and the worker's forced stop)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

#: How many running jobs a shutdown line names before it says "and N more".
NAMED_JOBS_MOST = 5
#: The attribute of a Dramatiq worker that tells the shutdown how long it waits for jobs (ms).
SHUTDOWN_MS_ATTRIBUTE = "standmeet_shutdown_ms"


@dataclass(frozen=True)
class RunningJob:
    """A job running on a worker thread of this process."""

    actor: str
    message_id: str
    started: float  # time.monotonic()

    def describe(self, now: float | None = None) -> str:
        ran_s = (time.monotonic() if now is None else now) - self.started
        return f"{self.actor} {self.message_id} (running {ran_s:.1f} s)"


class RunningJobs:
    """The jobs running in this process, one per worker thread (``middleware.JobLog``
    keeps it): what a shutdown names while it waits, and what it cuts off."""

    def __init__(self) -> None:
        #: (actor, message id, start) by thread: a tuple a job, made into a RunningJob
        #: only when a shutdown asks (a frozen dataclass costs a job more than the tuple).
        #: Each thread writes only its own key, with one dictionary operation, and a
        #: reader copies the dictionary in one: no lock is needed for either.
        self._by_thread: dict[int, tuple[str, str, float]] = {}

    def started(self, actor: str, message_id: str) -> None:
        self._by_thread[threading.get_ident()] = (actor, message_id, time.monotonic())

    def finished(self) -> None:
        self._by_thread.pop(threading.get_ident(), None)

    def now(self) -> list[RunningJob]:
        """The running jobs, longest-running first."""
        running = self._by_thread.copy().values()
        return sorted((RunningJob(*job) for job in running), key=lambda job: job.started)


#: This process's running jobs.
running_jobs = RunningJobs()


def name_jobs(jobs: Sequence[RunningJob], *, most: int = NAMED_JOBS_MOST) -> str:
    """``a 0b5a… (running 3.1 s), b 7c1d… (running 0.2 s) and 4 more``."""
    now = time.monotonic()
    named = ", ".join(job.describe(now) for job in jobs[:most])
    return f"{named} and {len(jobs) - most} more" if len(jobs) > most else named
