"""Hard time limits: every job kind has one; reaching it cancels the job.

The limit is resolved in one order: the message's ``time_limit`` option, the actor's,
then the queue's default (``STANDMEET_QUEUE_<QUEUE>_TIME_LIMIT_S``). The
job is cancelled by Dramatiq's asynchronous ``TimeLimitExceeded``, which the retry
policy treats as a retryable failure.

The timers (:class:`Timers`) set that exception while holding the lock that disarming
takes, so once a job's limit is disarmed no interruption can still be on its way unless
it was set already, and the broker receives and drops that one before any after-hook
(``broker.engine.runs.disarm``): a limit that fires as the job ends never lands in the
settle path, nor in the thread's next job.

The asynchronous exception cannot interrupt a blocking socket read or a running SQL
statement, so the deadline is also recorded (``broker.deadline``) for the places
where the job blocks: ``broker.pg.db.connection()`` sets ``statement_timeout`` to what
remains, HTTP clients cap their timeouts to it, and long actors call
``broker.deadline.check()`` between batches.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.middleware.time_limit import TimeLimit as DramatiqTimeLimit
from dramatiq.middleware.time_limit import TimeLimitExceeded
from dramatiq.threading import is_gevent_active, raise_thread_exception

from broker import deadline, detach

logger = logging.getLogger("standmeet.time_limit")


def resolve_time_limit_ms(broker: Any, message: MessageProxy) -> int:
    """Message option, then actor option, then the queue's default."""
    value = message.options.get("time_limit")
    if value is None:
        value = broker.get_actor(message.actor_name).options.get("time_limit")
    if value is None:
        value = broker.queue_settings(message.queue_name).time_limit_ms
    return int(value)


class Timers:
    """Each worker thread's deadline; every ``interval_ms`` the thread past its deadline is
    interrupted (:meth:`fire_due`, on a thread of :mod:`broker.detach` started with the
    worker's process boot)."""

    def __init__(self, interval_ms: int) -> None:
        self.interval_s = interval_ms / 1000
        self.mu = threading.Lock()
        self.deadlines: dict[int, float] = {}

    def start(self) -> None:
        self.thread = detach.every("standmeet-time-limits", self.interval_s, self.fire_due)

    def stop(self) -> None:
        """Stop the thread :meth:`start` started (its last look may still be under way)."""
        thread = getattr(self, "thread", None)
        if thread is not None:
            thread.stop(timeout_s=self.interval_s * 10)
        with self.mu:  # a job still running now is past its workers: no later timer fires for it
            self.deadlines.clear()

    def add_timeout(self, thread_id: int, ttl_ms: float) -> None:
        with self.mu:
            self.deadlines[thread_id] = time.monotonic() + ttl_ms / 1000

    def remove_timeout(self, thread_id: int) -> None:
        with self.mu:
            self.deadlines.pop(thread_id, None)

    def fire_due(self) -> list[int]:
        """Interrupt every thread past its deadline, under the lock; the threads interrupted."""
        now = time.monotonic()
        with self.mu:
            due = [thread_id for thread_id, at in self.deadlines.items() if now >= at]
            for thread_id in due:
                del self.deadlines[thread_id]
                logger.warning("time limit exceeded: interrupting worker thread %d", thread_id)
                raise_thread_exception(thread_id, TimeLimitExceeded)
        return due


class TimeLimit(DramatiqTimeLimit):
    def __init__(self, *, interval_ms: int = 100) -> None:
        super().__init__(interval=interval_ms)
        if not is_gevent_active():
            self.manager = Timers(interval_ms)  # type: ignore[assignment]
        self._started = False
        self._start_lock = threading.Lock()
        self._workers = 0

    def after_process_boot(self, broker: Any) -> None:
        # Dramatiq's CLI emits process_boot; an embedded Worker only emits worker_boot.
        with self._start_lock:
            if not self._started:
                self._started = True
                super().after_process_boot(broker)

    def before_worker_boot(self, broker: Any, worker: Any) -> None:
        with self._start_lock:
            self._workers += 1
        self.after_process_boot(broker)

    def after_worker_shutdown(self, broker: Any, worker: Any) -> None:
        # The timers' thread ends with the last worker: a test suite that boots a worker (or
        # drains a memory broker) for each test keeps none of them running.
        with self._start_lock:
            self._workers = max(0, self._workers - 1)
            if self._workers or not self._started or type(self.manager) is not Timers:
                return
            self._started = False
            self.manager.stop()

    def before_process_message(self, broker: Any, message: MessageProxy) -> None:
        limit_ms = resolve_time_limit_ms(broker, message)
        deadline.set_deadline(limit_ms / 1000)
        self.manager.add_timeout(threading.get_ident(), limit_ms)

    def disarm(self) -> None:
        """Stop this thread's limit. The broker calls it before any after-hook runs.

        Always under the timers' lock, even when this thread's deadline looks gone: the
        timers delete a fired deadline before they raise its interruption, both under
        that lock, so only taking it makes sure an interruption on its way has been set,
        and is delivered (and dropped) by the broker's disarm, not in the after-hooks."""
        if self._started or type(self.manager) is Timers:  # (a deadline outlives a stopped timer)
            self.manager.remove_timeout(threading.get_ident())
        deadline.clear()

    def _disarm_unless_disarmed(self) -> None:
        """The after-hooks' disarm: nothing to do when the broker's disarm ran for this run
        (it cleared the run's deadline, which every run of this policy sets, and removed
        the thread's timer under the lock: only this thread arms it again). Otherwise (a
        broker that does not disarm first) the whole :meth:`disarm`."""
        manager = self.manager
        if deadline.armed() or type(manager) is not Timers or threading.get_ident() in manager.deadlines:
            self.disarm()

    def after_process_message(
        self, broker: Any, message: MessageProxy, *, result: Any = None, exception: BaseException | None = None
    ) -> None:
        self._disarm_unless_disarmed()

    def after_skip_message(  # type: ignore[override]  # Dramatiq aliases it to after_process_message
        self, broker: Any, message: MessageProxy
    ) -> None:
        self._disarm_unless_disarmed()
