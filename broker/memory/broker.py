"""The memory broker: this runtime's queue policies with no database, for tests of actors.

What it keeps from the Postgres broker (``broker.engine.broker``), so that an actor
behaves under test as it does in production:

* **Bounded hand-out per queue.** A consumer hands out at most the queue's
  ``max_workers`` messages at once (``STANDMEET_QUEUE_<NAME>_MAX_WORKERS``); the
  ``QueueConcurrency`` middleware holds the same count where jobs start.
* **One settle path.** A run's outcome is decided as the engine decides it: a
  ``Snooze`` (any ``Deferred``) is a skip, not a failure; a result the results backend
  cannot encode fails the run for good; the time limit is disarmed before any after-hook;
  what the after-hooks send for the same message (a retry, a snooze) puts that message
  back, due after the delay, keeping its id and options; what they send for others
  (pipelines, callbacks) is enqueued once the run is settled.
* **Delays by a clock a test can move** (:meth:`MemoryBroker.advance`): a delayed
  message is due when the broker's clock reaches it; by itself the clock follows real time.
* **Unique keys** (the ``unique`` actor option, ``unique_key`` / ``unique_period_s``
  message options): a send whose key is live returns the live message.
* **Cancellation** (:meth:`MemoryBroker.cancel`): a waiting message is dropped; a
  running one is stopped at its next ``broker.deadline.check()`` and not retried.

It imports no database driver. ``broker.testing.memory_broker()`` builds one with the
default middleware and installs it.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dramatiq
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import QueueJoinTimeout, QueueNotFound
from dramatiq.message import Message
from dramatiq.results import ResultBackend

from broker.engine.codec import check_distinct_ids, checked_json, delay_seconds, message_priority
from broker.engine.queues import DeclaredQueues
from broker.engine.runs import RunningJobs, as_run, disarm, in_a_run, rejection_reason, run_signal
from broker.engine.unique import unique_key_of
from broker.errors import ConfigError, CutOff
from broker.memory.queue import MemoryQueue, Waiting
from broker.memory.runner import DrainRunner
from broker.memory.stores import Clock, MemoryCancellations, MemoryResults
from broker.settings import QueueSettings, Settings

logger = logging.getLogger("standmeet.broker.memory")

#: How many runs one :meth:`MemoryBroker.drain` makes before it calls it a loop.
DEFAULT_MAX_RUNS = 10_000
#: How long a consumer or a join waits at most between two looks (seconds): a clock moved
#: by another thread is noticed within it.
LOOK_AGAIN_S = 0.05
#: How long the last worker's shutdown waits for the jobs it cut off to leave their body
#: (an async job's coroutine is cancelled within Dramatiq's one-second look, then given a
#: second to clean up) before the event loop stops.
CUT_OFF_WAIT_S = 3.0

_local = threading.local()


@dataclass
class SettleContext:
    """What the after-hooks of one run decided (read by ``middleware.results`` too)."""

    proxy: MessageProxy
    requeue_delay_ms: int | None = None
    followups: list[tuple[Message, int | None]] = field(default_factory=list)
    returned: bool = False
    skipped: bool = False


class MemoryMessage(MessageProxy):
    """A message handed to a worker: it keeps its exception (as Dramatiq's stub broker's
    does), so a join can raise it and a test can read it."""

    def __init__(self, message: Message, *, claim: int) -> None:
        super().__init__(message)
        self.standmeet_claim = claim
        self.standmeet_settle: SettleContext | None = None
        self.standmeet_lease: Any = None

    def clear_exception(self) -> None:
        """Kept for the test to read (see Dramatiq's ``_StubMessageProxy``)."""


def as_message(message: Message | MessageProxy) -> Message:
    return message._message if isinstance(message, MessageProxy) else message  # type: ignore[attr-defined]


def delay_ms_of(delay: Any) -> int:
    """A send's ``delay`` (milliseconds, or None) as whole milliseconds; refused as the
    engine refuses it (:func:`broker.engine.codec.delay_seconds`)."""
    return int(delay_seconds(delay) * 1000)


class MemoryBroker(DeclaredQueues, dramatiq.Broker):
    """A Dramatiq broker in memory with the Postgres broker's policies (see the module)."""

    def __init__(self, *, settings: Settings, middleware: list[Any] | None = None,
                 clock: Clock | None = None, cancellations: MemoryCancellations | None = None,
                 backends: Sequence[Any] = (), fail_fast_default: bool = True) -> None:
        self.settings = settings
        self.clock = clock or Clock()
        self.cancellations = cancellations or MemoryCancellations()
        #: the result and rate-limiter backends its middleware use (``results`` first)
        self.backends = list(backends)
        #: as Dramatiq's StubBroker: whether ``join`` raises a dead-lettered message's error
        self.fail_fast_default = fail_fast_default
        self.dead_letters_by_queue: defaultdict[str, list[MessageProxy]] = defaultdict(list)
        #: messages that ran to ``done``, in order (the engine's ``done`` rows)
        self.done: list[Message] = []
        self.claiming = True
        self._cond = threading.Condition()
        self._seq = itertools.count()
        self._claims = itertools.count(1)
        self._unique: dict[tuple[bytes, float | None], tuple[Message, bool]] = {}
        self._key_of: dict[str, tuple[bytes, float | None]] = {}
        self._cancelled: set[str] = set()
        #: ids handed out to run at least once: a send with one of them is never run again
        self._ran_ids: set[str] = set()
        self._runs_without_outcome: defaultdict[str, int] = defaultdict(int)
        #: the messages handed out and not settled yet, by claim number
        self._handed: dict[int, MemoryMessage] = {}
        self._running = RunningJobs()  # the threads inside a job's body (broker.engine.runs)
        self._workers: list[Any] = []
        self._close_hooks: list[Callable[[], None]] = []
        super().__init__(middleware=middleware or [])

    @property
    def results(self) -> Any:
        """The results backend its middleware store in (None without one)."""
        return next((b for b in self.backends if isinstance(b, ResultBackend)), None)

    # -- queues -------------------------------------------------------------------

    def new_queue(self, queue_name: str, settings: QueueSettings) -> MemoryQueue:
        return MemoryQueue(settings)  # no delay queues: delays are the broker's (a due time)

    def _queue(self, queue_name: str) -> MemoryQueue:
        queue = self.queues.get(queue_name)
        if queue is None:
            raise QueueNotFound(queue_name)
        return queue  # type: ignore[no-any-return]

    # -- enqueue ------------------------------------------------------------------

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        """Keep ``message``, due after ``delay`` ms; a send whose unique key is live
        returns the live message instead. Sent from a run's after-hooks, it is kept with
        that run's outcome (the same message: put back; another: sent once settled)."""
        self._queue(message.queue_name)
        message.options.pop("eta", None)  # Dramatiq's worker would hold an ``eta`` message itself
        context: SettleContext | None = getattr(_local, "settling", None)
        self.emit_before("enqueue", message, delay)
        if context is not None:
            if message.message_id == context.proxy.message_id:
                context.requeue_delay_ms = delay_ms_of(delay)
            else:  # refused here, in the hook, as the engine refuses a bad follow-up
                self._check(as_message(message), delay)
                context.followups.append((as_message(message), delay))
        else:
            self._check(as_message(message), delay)
            with self._cond:
                live = self._keep(as_message(message), delay, send=True)
            if live is not None:  # the engine's after-hooks see the live message, as the caller does
                message = live
        self.emit_after("enqueue", message, delay)
        return message

    def enqueue_many(self, messages: Sequence[Message], *, conn: Any = None,
                     delay: int | None = None) -> list[Message]:
        """Each message as :meth:`enqueue` keeps it; a skipped one's live message in its place."""
        if conn is not None:
            raise ConfigError("the memory broker has no database: enqueue_many(conn=...) cannot write in a "
                              "transaction here; send without conn")
        batch = list(messages)
        for message in batch:
            self._queue(message.queue_name)
            message.options.pop("eta", None)
        for message in batch:
            self.emit_before("enqueue", message, delay)
        check_distinct_ids(batch)  # every message checked before any is kept: all or none
        for message in batch:
            self._check(as_message(message), delay)
        with self._cond:
            written = [self._keep(as_message(m), delay, send=True) or m for m in batch]
        for message in written:
            self.emit_after("enqueue", message, delay)
        return written

    def _check(self, message: Message, delay: Any) -> None:
        """What the engine checks before it writes a row: options its run can use, arguments
        Postgres stores, at most STANDMEET_MESSAGE_MAX_BYTES encoded, a priority its column
        holds, a delay in range."""
        checked_json(message, max_bytes=self.settings.message_max_bytes)
        message_priority(message)
        delay_ms_of(delay)

    def _keep(self, message: Message, delay: Any, *, send: bool = False, followup: bool = False) -> Message | None:
        """Add ``message`` (checked) to its queue (the lock held). A ``send`` whose unique
        key is taken returns the live message; one with the id of a waiting message
        replaces it whole (one that waits for its retry or snooze too); one with the id of a
        message that ran and waits no more is not run again (as the engine's rows). A
        ``followup`` is never written over an existing id; it holds its unique key when no
        live message does, and is written without it when one does. A message sent is
        stamped on the broker's clock (``max_age`` counts from there)."""
        if (send or followup) and self.clock.advanced_s:
            message = message.copy(message_timestamp=message.message_timestamp + int(self.clock.advanced_s * 1000))
        data = message.encode()
        message_id = message.message_id
        key = self._unique_key(message) if send or followup else None
        if send or followup:
            waiting = next((w for q in self.queues.values() if (w := q.find(message_id)) is not None), None)
            # a message that ran and waits again (a retry, a snooze) is queued: replaced whole
            if (message_id in self._ran_ids and waiting is None) or (followup and waiting is not None):
                return None
            if waiting is not None:
                if key is not None:
                    return waiting.message  # the engine's keyed write never replaces a row
                self._queue(waiting.message.queue_name).remove(waiting)
                self._free_key(message_id, done=False)
        if key is not None:
            holder = self._unique.get(key)
            if holder is not None and followup:
                key = None  # a pipeline is never cut by a key: written without it, as the engine does
            elif holder is not None:
                logger.debug("unique: %s skipped, %s holds its key", message.message_id, holder[0].message_id)
                return holder[0]
            else:
                self._unique[key] = (message, False)
                self._key_of[message.message_id] = key
        due = self.clock.monotonic() + delay_ms_of(delay) / 1000
        self._queue(message.queue_name).push(
            Waiting(due, next(self._seq), Message.decode(data), message_priority(message)))
        self._cond.notify_all()
        return None

    def _unique_key(self, message: Message) -> tuple[bytes, float | None] | None:
        """The message's unique key as the engine forms it (``unique_key_of``), with the
        start of the period the send falls in by this broker's clock."""
        key = unique_key_of(message, self)
        if key is None:
            return None
        period = key.period_s
        return key.digest, None if period is None else math.floor(self.clock.wall() / period) * period

    def _free_key(self, message_id: str, *, done: bool) -> None:
        key = self._key_of.pop(message_id, None)
        if key is None:
            return
        if done and key[1] is not None:  # done within its period: still holds the key
            self._unique[key] = (self._unique[key][0], True)
        else:
            self._unique.pop(key, None)

    # -- signals: the settle path ---------------------------------------------------

    def declare_actor(self, actor: Any) -> None:
        actor.fn = as_run(actor.fn)  # a job's body, bracketed as the engine brackets it
        super().declare_actor(actor)

    def _disarms(self) -> list[Callable[[], None]]:
        return [hook for hook in (getattr(m, "disarm", None) for m in self.middleware) if callable(hook)]

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal == "process_message":
            args[0].standmeet_thread = threading.get_ident()  # in its body until its after-hooks
            disarms = self._disarms()
            in_a_run(self._running, disarms)
            try:
                super().emit_before(signal, *args, **kwargs)
            except BaseException:  # skipped: its time limit goes now, as the engine's does
                disarm(disarms)
                raise
            return
        if signal == "worker_boot" and args:
            self._running.resume()  # jobs start again (after a shutdown cut the last ones off)
            self._workers = [*self._workers, args[0]]
        elif signal == "worker_shutdown" and args:
            self._workers = [w for w in self._workers if w is not args[0]]
        super().emit_before(signal, *args, **kwargs)

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal not in ("process_message", "skip_message"):
            if signal == "worker_shutdown" and not self._workers:
                self._give_back_cut_off()  # before the event loop of async jobs stops
            super().emit_after(signal, *args, **kwargs)
            return
        proxy = args[0]
        with self._cond:
            proxy.standmeet_thread = None
            self._cond.notify_all()
        left, _late = in_a_run(None)  # a time limit as the job returned is dropped, as the engine drops it
        if not left:
            disarm(self._disarms())
        hooks = [getattr(middleware, "refuse_result", None) for middleware in self.middleware]
        signal, kwargs, exception = run_signal(  # a snooze or a cut-off is a skip; a refused result a failure
            self, signal, proxy, kwargs, refuse_hooks=[hook for hook in hooks if callable(hook)],
            not_at_fault=(CutOff,))
        context = getattr(proxy, "standmeet_settle", None)
        if context is None:
            context = proxy.standmeet_settle = SettleContext(proxy)
        if isinstance(exception, CutOff):
            context.requeue_delay_ms = 0  # it runs again (given back by the shutdown that cut it off)
        if signal == "process_message" and exception is None:
            context.returned = True
        if signal == "skip_message":
            context.skipped = True
        _local.settling = context
        try:
            super().emit_after(signal, *args, **kwargs)
        finally:
            _local.settling = None

    def settle(self, proxy: MessageProxy, *, rejected: bool) -> None:
        """Decide a finished run's outcome (done, put back, rejected) and free its slot."""
        context: SettleContext | None = getattr(proxy, "standmeet_settle", None)
        proxy.standmeet_settle = None  # type: ignore[attr-defined]
        message = as_message(proxy)
        with self._cond:
            if self._handed.pop(getattr(proxy, "standmeet_claim", 0), None) is None:
                logger.info("message %s: its run ended after the shutdown gave it back; it runs again",
                            proxy.message_id)
                return
            queue = self._queue(proxy.queue_name)
            queue.handed_out -= 1
            again = context is not None and context.requeue_delay_ms is not None
            if message.message_id in self._cancelled:
                # cancelled while it ran: not retried, and rejected even if its run returned
                returned = not again and not rejected and context is not None and (context.returned
                                                                                    or context.skipped)
                proxy.options["error"] = ("cancelled by an operator: its run returned after the cancellation"
                                          if returned else "cancelled by an operator: its run was stopped"
                                          if rejected else "cancelled by an operator: not retried")
                rejected, again = True, False
            if rejected:
                self._reject(proxy)
            elif again:
                assert context is not None and context.requeue_delay_ms is not None
                self._keep(message, context.requeue_delay_ms)
            elif context is not None and (context.returned or context.skipped):
                self._done(message)
            else:
                self._rerun(proxy)
            for followup, delay in context.followups if context is not None else []:
                self._keep(followup, delay, followup=True)  # holds its key if free; written all the same
            self._cond.notify_all()

    def _done(self, message: Message) -> None:
        self.done.append(message)
        self._free_key(message.message_id, done=True)
        self._cancelled.discard(message.message_id)
        self.cancellations.pending.discard(message.message_id)
        self._runs_without_outcome.pop(message.message_id, None)

    def _reject(self, proxy: MessageProxy) -> None:
        proxy.options["error"] = rejection_reason(proxy)  # what the engine keeps on the row
        self.dead_letters_by_queue[proxy.queue_name].append(proxy)
        self._free_key(proxy.message_id, done=False)
        self._cancelled.discard(proxy.message_id)
        self.cancellations.pending.discard(proxy.message_id)
        self._runs_without_outcome.pop(proxy.message_id, None)

    def _rerun(self, proxy: MessageProxy) -> None:
        """No middleware decided the run's outcome (an after-hook raised): as the engine
        does, run it again after the shortest back-off, at most ``max_runs_without_outcome``."""
        runs = self._runs_without_outcome[proxy.message_id] = self._runs_without_outcome[proxy.message_id] + 1
        if runs >= self.settings.max_runs_without_outcome:
            proxy.options["error"] = f"ended {runs} runs without an outcome"
            self._reject(proxy)
            return
        logger.error("message %s ended without an outcome; running it again", proxy.message_id)
        self._keep(as_message(proxy), self.settings.min_backoff_ms)

    # -- handing out ------------------------------------------------------------------

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> MemoryConsumer:
        self._queue(queue_name)
        return MemoryConsumer(self, queue_name, timeout_ms=timeout)

    def take(self, queue_names: Iterable[str], *, wait_s: float = 0.0) -> MemoryMessage | None:
        """The oldest due message of these queues whose queue is below its limit, handed
        out (None if there is none within ``wait_s``)."""
        names = list(queue_names)
        end = self.clock.monotonic() + wait_s
        with self._cond:
            while True:
                now = self.clock.monotonic()
                best: tuple[MemoryQueue, Waiting] | None = None
                for name in names:
                    queue = self._queue(name)
                    if not self.claiming or queue.handed_out >= queue.settings.max_workers:
                        continue
                    first = queue.first_due(now)
                    if first is not None and (best is None or first.claim_order < best[1].claim_order):
                        best = queue, first
                if best is not None:
                    queue, first = best
                    queue.remove(first)
                    queue.handed_out += 1
                    self._ran_ids.add(first.message.message_id)
                    claim = next(self._claims)
                    proxy = self._handed[claim] = MemoryMessage(first.message, claim=claim)
                    return proxy
                if now >= end:
                    return None
                self._cond.wait(min(end - now, LOOK_AGAIN_S))

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        """Give handed-out messages that never started back to their queue, due now."""
        with self._cond:
            for proxy in messages:
                if self._handed.pop(getattr(proxy, "standmeet_claim", 0), None) is None:
                    continue
                self._queue(proxy.queue_name).handed_out -= 1
                self._ran_ids.discard(proxy.message_id)  # given back unstarted: queued again, as the engine's row
                self._give_back(proxy)

    def stop_claiming(self) -> None:
        with self._cond:
            self.claiming = False

    def _give_back(self, proxy: MessageProxy) -> None:
        """Put a handed-out message back, due now; one cancelled meanwhile is rejected
        instead, never to run (the engine's give-back rejects it)."""
        if proxy.message_id in self._cancelled:
            proxy.options["error"] = "cancelled by an operator: not run"
            self._reject(proxy)
        else:
            self._keep(as_message(proxy), 0)

    def _give_back_cut_off(self) -> None:
        """The last worker stopped with jobs still running (past ``Worker.stop``'s timeout):
        as the engine's shutdown does, they are cut off and given back, due now, no retry
        counted; their runs' ends are ignored. A cut-off job stops at its next bytecode (an
        async one's coroutine is cancelled), waited for up to :data:`CUT_OFF_WAIT_S`."""
        with self._cond:
            left = list(self._handed.values())
            self._handed.clear()
            for proxy in left:
                self._queue(proxy.queue_name).handed_out -= 1
                self._give_back(proxy)
            self._cond.notify_all()
        if not left:
            return
        logger.warning("shutdown: %d job(s) still running cut off and given back, to run again: %s", len(left),
                       ", ".join(f"{p.actor_name} {p.message_id}" for p in left))
        self._running.interrupt_all(CutOff)  # only threads inside a job's body, as the engine's step-down
        end = time.monotonic() + CUT_OFF_WAIT_S
        with self._cond:
            while any(getattr(p, "standmeet_thread", None) for p in left) and (now := time.monotonic()) < end:
                self._cond.wait(min(end - now, LOOK_AGAIN_S))

    # -- the test's controls ----------------------------------------------------------

    def advance(self, seconds: float) -> None:
        """Move the broker's clock ``seconds`` forward: delayed messages (retries, snoozes,
        ``send_with_options(delay=…)``) due by then can run, leases held that long expire."""
        self.clock.advance(seconds)
        with self._cond:
            self._cond.notify_all()

    def _advance_to_next_due(self, queue_names: Iterable[str]) -> bool:
        """Move the clock to the next due time of these queues if nothing of theirs is due
        or handed out; whether it moved."""
        with self._cond:
            queues = [self._queue(name) for name in queue_names]
            if any(q.handed_out for q in queues):
                return False
            dues = [q.next_due() for q in queues if len(q)]
            if not dues:
                return False
            ahead = min(d for d in dues if d is not None) - self.clock.monotonic()
            if ahead > 0:
                self.clock.advance(ahead)
            self._cond.notify_all()
            return True

    def drain(self, *queue_names: str, advance: bool = True, max_runs: int = DEFAULT_MAX_RUNS) -> int:
        """Run the messages of ``queue_names`` (default: all) on this thread, through
        every middleware, until none is left; how many runs it made.

        With ``advance`` (the default) the clock jumps to each delayed message's due time
        (a retry's back-off, a snooze) instead of waiting for it; without, only what is
        due now runs. Not while a Dramatiq ``Worker`` runs on this broker (use ``join``).
        """
        if self._workers:
            raise RuntimeError("drain() runs jobs on this thread: stop the Worker first, or join() its queues")
        names = list(queue_names) or sorted(self.queues)
        for name in names:
            self._queue(name)
        runner = DrainRunner(self)
        self.emit_before("worker_boot", runner)  # the time limit's timer, the event loop of async actors
        self.emit_after("worker_boot", runner)
        runs = 0
        try:
            while True:
                proxy = self.take(names)
                if proxy is None:
                    if advance and self._advance_to_next_due(names):
                        continue
                    return runs
                runs += 1
                if runs > max_runs:
                    self.requeue([proxy])
                    raise RuntimeError(f"drain: more than {max_runs} runs; does a job send itself forever?")
                runner.thread.process_message(proxy)
        finally:
            self.emit_before("worker_shutdown", runner)
            self.emit_after("worker_shutdown", runner)

    def cancel(self, message_id: str) -> str:
        """Cancel a message, as an operator's ``jobs cancel`` does: a waiting one is dropped
        (``"dropped"``), a running one (or one handed out to start) stops at its next
        ``broker.deadline.check()`` and is rejected (``"stopping"``); ``"unknown"`` else."""
        with self._cond:
            for queue in self.queues.values():
                waiting = queue.find(message_id)
                if waiting is not None:
                    queue.remove(waiting)
                    self._free_key(message_id, done=False)
                    self._cond.notify_all()
                    return "dropped"
            self._cancelled.add(message_id)
            # handed out, its run not watched yet: it starts cancelled, and is rejected as it ends
            handed = any(p.message_id == message_id for p in self._handed.values())
            if handed:
                self.cancellations.pending.add(message_id)
        if self.cancellations.cancel(message_id) or handed:
            with self._cond:  # ending, it no longer holds its unique key: the same call sent again runs
                self._free_key(message_id, done=False)
            return "stopping"
        with self._cond:
            self._cancelled.discard(message_id)
        return "unknown"

    @property
    def dead_letters(self) -> list[MessageProxy]:
        """The rejected messages of every queue (as Dramatiq's StubBroker names them)."""
        return [message for messages in self.dead_letters_by_queue.values() for message in messages]

    def waiting(self, queue_name: str) -> list[Message]:
        """The messages of ``queue_name`` not handed out yet (due now or later), soonest first."""
        with self._cond:
            return self._queue(queue_name).messages()

    def flush(self, queue_name: str) -> None:
        """Drop the messages of ``queue_name`` that wait (due now or later)."""
        with self._cond:
            queue = self._queue(queue_name)
            for waiting in queue.take_all():
                self._free_key(waiting.message.message_id, done=False)
            self._cond.notify_all()

    def flush_all(self) -> None:
        """Drop the waiting messages of every queue, the dead letters, the done list and
        the stored results (and which ids ran: a message sent again after it runs again)."""
        for queue_name in list(self.queues):
            self.flush(queue_name)
        with self._cond:
            self.dead_letters_by_queue.clear()
            self.done.clear()
            self._ran_ids.clear()  # what ran is forgotten with the done list: a test starts afresh
            self._unique.clear()
            self._key_of.clear()
            self._cancelled.clear()
            self.cancellations.pending.clear()
        if isinstance(self.results, MemoryResults):
            self.results.clear()

    def join(self, queue_name: str, *, timeout: int | None = None, fail_fast: bool | None = None,
             advance: bool = False) -> None:
        """Wait until ``queue_name`` has nothing waiting (delayed included) or running.

        ``timeout`` in milliseconds of real time (:class:`QueueJoinTimeout` past it); ``fail_fast``
        (default: ``fail_fast_default``) raises the error of a message rejected on that
        queue; ``advance`` jumps the clock to a delayed message's due time whenever
        nothing else of the queue is left, instead of waiting for it.
        """
        queue = self._queue(queue_name)
        # real time: the broker's clock jumps ahead when ``advance`` moves it
        end = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            with self._cond:
                if not len(queue) and not queue.handed_out:
                    break
                now = time.monotonic()
                if end is not None and now >= end:
                    raise QueueJoinTimeout(queue_name)
            if not (advance and self._advance_to_next_due([queue_name])):
                with self._cond:
                    self._cond.wait(LOOK_AGAIN_S if end is None else max(0.0, min(end - now, LOOK_AGAIN_S)))
        if fail_fast if fail_fast is not None else self.fail_fast_default:
            for message in self.dead_letters_by_queue[queue_name]:
                raise (message._exception or Exception(message.options.get("error", "rejected"))) from None

    # -- shutdown -----------------------------------------------------------------

    def on_close(self, hook: Callable[[], None]) -> None:
        self._close_hooks.append(hook)

    def close(self) -> None:
        self.stop_claiming()
        hooks, self._close_hooks = self._close_hooks, []
        for hook in hooks:
            hook()


class MemoryConsumer(Consumer):
    """What a Dramatiq worker's consumer thread reads a queue through."""

    def __init__(self, broker: MemoryBroker, queue_name: str, *, timeout_ms: int) -> None:
        self.broker = broker
        self.queue_name = queue_name
        self.timeout_s = timeout_ms / 1000

    def __iter__(self) -> MemoryConsumer:
        return self

    def __next__(self) -> MessageProxy | None:
        return self.broker.take([self.queue_name], wait_s=self.timeout_s)

    def ack(self, message: MessageProxy) -> None:
        self.broker.settle(message, rejected=False)

    def nack(self, message: MessageProxy) -> None:
        self.broker.settle(message, rejected=True)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        self.broker.requeue(messages)

    def close(self) -> None:
        """Nothing to close."""
