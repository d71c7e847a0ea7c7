"""Our Postgres broker: a ``dramatiq.Broker`` on psycopg 3, in dramatiq-pg's table.

What it guarantees:

* **Claims are bounded per queue.** A consumer claims due messages with one
  ``UPDATE … FROM (SELECT … FOR UPDATE SKIP LOCKED LIMIT n)`` statement (lower
  ``priority`` first, then oldest due), never more than its queue's limit running plus
  its prefetch (by default what its jobs finish in 50 ms, up to 128); it claims again
  when a batch's worth of room is free or a running slot would idle. Runs that finished
  but whose outcome is not written yet count too, beyond one limit of slack: a process
  never holds more than ``2 × limit`` + the prefetch's ceiling rows ``consumed``. What
  the buffer would hold longer than a second (its jobs turned slow, or hang) goes back
  to the queue unblamed, down to half the limit. It wakes on NOTIFY, or the moment one
  of its jobs finishes. No advisory lock outlives the statement, so the locks held stay
  bounded at any backlog.
* **One settle path.** Every outcome of a run — done, retry with back-off, snooze,
  reject — is one statement bound to the claim it settles (``message_id`` *and* claim
  number), written by the broker's settler thread, never by the worker thread (which
  only hands the outcome over and goes on). A message is ``done`` only if its actor
  returned. What the run sent from its after-hooks (pipelines, callbacks) is enqueued
  in the same transaction. If the database is down, the message stays ``consumed``
  and the settler keeps trying; nothing is recorded that did not happen.
* **Delays live in the database** (the ``eta`` column): nothing waits in worker memory.
* **Fair rescue.** Every process heartbeats by the database's clock; it proves it is
  alive before it claims again after an outage. The messages of a process that
  stopped or fell silent go back to their queue; only a message that had *started* in a
  process that died uncleanly is blamed, and one that died beside others is re-run
  alone (with no other of that set beside it) before it can be blamed.
* **Graceful stops carry no blame.** Prefetched messages go back the moment shutdown
  starts; a job cut off at the shutdown timeout is requeued without a crash counted.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import logging
import math
import os
import re
import reprlib
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import BrokerConnectionError, QueueJoinTimeout, QueueNotFound
from dramatiq.message import Message
from dramatiq.middleware import Middleware, MiddlewareError
from dramatiq.middleware.threading import raise_thread_exception
from dramatiq.middleware.time_limit import TimeLimitExceeded

from broker import app, detach, services
from broker.backoff import Backoff
from broker.engine import sql
from broker.engine.wakeups import WakeListener
from broker.errors import (
    ConfigError,
    CutOff,
    DatabaseError,
    DeadlineExceeded,
    Deferred,
    InvalidMessage,
    MessageTooLarge,
    ResultRefused,
)
from broker.observability import tracing
from broker.pg.pool import (
    DISCONNECTS,
    TRANSACTION,
    Outage,
    close_quietly,
    connect,
    open_send_pool,
    readable,
    topology_for,
)
from broker.settings import MIB, PREFETCH_HOLD_S, PREFETCH_HORIZON_S, QueueSettings, Settings

logger = logging.getLogger("standmeet.broker")


class _QuietCutOffs(logging.Filter):
    """Dramatiq's worker logs each interrupted job with its traceback; a step-down says
    once, itself, which jobs it interrupted and that they run again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], CutOff))


logging.getLogger("dramatiq.worker.WorkerThread").addFilter(_QuietCutOffs())

#: Weight of the latest run in a queue's mean run time.
RUN_TIME_WEIGHT = 0.1
#: Shortest sleep when due messages exist but were all locked by another claimer.
MIN_WAIT_S = 0.005
#: How often a consumer that no longer claims (shutdown) returns to Dramatiq's loop.
SHUTDOWN_POLL_S = 0.05
#: How long ``join`` sleeps between two looks at a queue.
JOIN_POLL_S = 0.02
#: How long ``close`` lets the settler write what is pending.
CLOSE_FLUSH_S = 5.0
#: Longest text of an error kept on a rejected message.
MAX_ERROR_CHARS = 4000
#: Longest text of a message's call (actor and arguments) in a log line.
MAX_LOGGED_CALL_CHARS = 300

_local = threading.local()


@dataclass
class Claim:
    """One claim of a message by this process: (message id, claim number)."""

    message: Message
    number: int
    started: bool
    #: when it was claimed (wall clock, for the claim-to-start metric)
    claimed_at: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[str, int]:
        return (self.message.message_id, self.number)


class QueueState:
    """What this process holds of one queue: shared by its successive consumers.

    A claim is identified by (message id, claim number): the same message can be
    claimed again (a snooze due at once) before the previous run is settled. At most
    ``limit`` claims are *running* (handed to Dramatiq's worker); up to ``prefetch`` more
    wait in :attr:`buffer`, claimed, and start the moment a running one finishes. A claim
    is *in flight* while it runs or waits in the buffer.
    """

    def __init__(self, settings: QueueSettings) -> None:
        self.settings = settings
        self.name = settings.name
        self.limit = settings.max_workers
        self.prefetch = settings.prefetch
        self.lock = threading.Lock()
        self.in_flight: set[tuple[str, int]] = set()
        self.running: set[tuple[str, int]] = set()
        self.buffer: deque[Claim] = deque()
        #: claims taken from the buffer to give back, until the give-back is written
        self.returning: list[Claim] = []
        #: the consumer sleeps on the wake pipe (set and read under ``lock``)
        self.waiting = False
        #: a running job ended (or outcomes were written) since the consumer last looked
        self.freed = False
        #: runs that ended whose outcome the settler has not written yet: their rows
        #: are still ``consumed`` in the database, so they count against the claims
        #: beyond a slack of one more ``limit``
        self.unsettled = 0
        #: when each running claim was handed to the worker, and the mean run time since
        #: (exponentially weighted), which sizes the default prefetch
        self._handed_at: dict[tuple[str, int], float] = {}
        self.mean_run_s: float | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _free(self) -> int:
        return (self.limit + self.prefetch - len(self.in_flight)
                - max(0, self.unsettled - self.limit))

    def free(self) -> int:
        """How many more messages this process may claim now: its rows ``consumed`` in the
        database never exceed ``2 × limit`` + the prefetch's ceiling (finished ones
        included), however far the settler is behind."""
        with self.lock:
            return self._free()

    def should_claim(self) -> bool:
        """Worth a claim now: a running slot would otherwise stay idle, or enough room for a
        batch. Claiming one message each time one finishes costs a round trip per job;
        waiting for a batch's worth of room costs nothing while the buffer still holds
        messages to start."""
        with self.lock:
            free = self._free()
            if free <= 0:
                return False
            return free >= self.claim_batch or len(self.running) + len(self.buffer) < self.limit

    @property
    def claim_batch(self) -> int:
        """The room that makes a claim worth its round trip while nothing would idle."""
        return max(1, (self.prefetch + 1) // 2)

    def start_now(self) -> int:
        """How many claimed messages would start at once (free running slots)."""
        with self.lock:
            return max(0, self.limit - len(self.running) - len(self.buffer))

    def hold(self, claim: Claim) -> None:
        with self.lock:
            self.in_flight.add(claim.key)
            self.buffer.append(claim)

    def next_buffered(self) -> Claim | None:
        """The next claimed message to start, if fewer than ``limit`` are running."""
        with self.lock:
            if not self.buffer or len(self.running) >= self.limit:
                return None
            return self._take_next()

    def _take_next(self) -> Claim:
        """The first buffered claim, now running (under ``lock``, with one in the buffer)."""
        claim = self.buffer.popleft()
        self.running.add(claim.key)
        self._handed_at[claim.key] = time.monotonic()
        return claim

    def _ran(self, key: tuple[str, int]) -> None:
        """A run ended: fold its time into the mean, and size the default prefetch to hold
        what the running jobs finish within PREFETCH_HORIZON_S (under ``lock``)."""
        handed = self._handed_at.pop(key, None)
        if handed is None or not self.settings.adaptive_prefetch:
            return
        run_s = time.monotonic() - handed
        mean = run_s if self.mean_run_s is None else self.mean_run_s + RUN_TIME_WEIGHT * (run_s - self.mean_run_s)
        self.mean_run_s = mean
        wanted = self.limit * PREFETCH_HORIZON_S / max(mean, 1e-6)
        self.prefetch = int(min(self.settings.prefetch_ceiling, max(self.settings.prefetch_floor, wanted)))

    def take_excess(self) -> list[Claim]:
        """Claims to give back to the queue, for another process to start sooner: those a
        queue with the default prefetch holds that would wait in its buffer longer than
        PREFETCH_HOLD_S (by the mean run time; or because no slot has freed for that long),
        with any whose give-back is not known to have been written. The last in line go,
        down to half the limit; the prefetch shrinks to what stays, so they are not claimed
        again at once.

        A claim once offered is never started here (its give-back may have committed
        unseen): it stays counted until :meth:`release` confirms it gone."""
        with self.lock:
            keep = self._keep(time.monotonic())
            if keep < len(self.buffer):
                self.prefetch = min(self.prefetch, keep)
                while len(self.buffer) > keep:
                    self.returning.append(self.buffer.pop())
            return list(self.returning)

    def _keep(self, now: float) -> int:
        """How many buffered claims start within PREFETCH_HOLD_S (under ``lock``)."""
        if not self.buffer or not self.settings.adaptive_prefetch:
            return len(self.buffer)
        per_claim_s = self.mean_run_s or 0.0
        if len(self.running) >= self.limit and self._handed_at:
            stuck_s = now - max(self._handed_at.values())  # since a slot last freed
            if stuck_s >= PREFETCH_HOLD_S:
                per_claim_s = max(per_claim_s, stuck_s)
        if len(self.buffer) * per_claim_s <= PREFETCH_HOLD_S * self.limit:
            return len(self.buffer)
        return max(self.settings.prefetch_floor, int(self.limit * PREFETCH_HOLD_S / per_claim_s))

    def give_back_later(self, claims: Iterable[Claim]) -> None:
        """Claims whose give-back failed: offered again by :meth:`take_excess`, never started."""
        with self.lock:
            self.returning.extend(claims)

    def held(self) -> list[tuple[str, int]]:
        """Every claim this process holds of the queue: running, buffered or being given back."""
        with self.lock:
            return [*self.in_flight, *(c.key for c in self.returning if c.key not in self.in_flight)]

    def forget(self, keys: set[tuple[str, int]]) -> None:
        """Claims taken back by another process: never started here. A running one ends as
        usual, and its outcome is fenced off by its claim number."""
        if not keys:
            return
        with self.lock:
            self.buffer = deque(c for c in self.buffer if c.key not in keys)
            self.returning = [c for c in self.returning if c.key not in keys]
            for key in keys:
                if key not in self.running:
                    self.in_flight.discard(key)

    def take_buffer(self) -> list[Claim]:
        """Every claim not started here (the buffer, and those being given back)."""
        with self.lock:
            taken = [*self.buffer, *self.returning]
            self.buffer.clear()
            self.returning.clear()
            return taken

    def finished(self, key: tuple[str, int], *, hand_off: bool = False) -> Claim | None:
        """A running job has ended: its slot is free, and another may be claimed at once
        (its settle is on its way; until written, the row stays ``consumed``).

        With ``hand_off``, the next buffered claim takes the slot and is returned, for the
        thread that ran the job to start it: no consumer wake-up between two jobs. The
        consumer is then woken only for what it alone does: claiming, when there is room
        for a batch or a slot would idle."""
        with self.lock:
            self.running.discard(key)
            self.in_flight.discard(key)
            self._ran(key)
            self.unsettled += 1
            claim = None
            if hand_off and self.buffer and len(self.running) < self.limit:
                claim = self._take_next()
                free = self._free()
                if free <= 0 or (free < self.claim_batch and len(self.running) + len(self.buffer) >= self.limit):
                    return claim  # nothing for the consumer to do yet
            self.freed = True
            sleeping = self.waiting
        if sleeping:  # a busy consumer looks at ``freed`` before it sleeps: no pipe write
            self.wake()
        return claim

    def put_back(self, claim: Claim) -> None:
        """A claim taken from the buffer that could not be started here: first in line again."""
        with self.lock:
            self.running.discard(claim.key)
            self._handed_at.pop(claim.key, None)
            self.buffer.appendleft(claim)
            self.freed = True
        self.wake()

    def settled(self, count: int) -> None:
        """The settler wrote ``count`` outcomes of this queue: room to claim again."""
        with self.lock:
            self.unsettled = max(0, self.unsettled - count)
            self.freed = True  # a consumer about to sleep looks again instead
            sleeping = self.waiting
        if sleeping:
            self.wake()

    def release(self, keys: Iterable[tuple[str, int]]) -> None:
        """Settled (or given back): the claims no longer count against the queue."""
        keys = set(keys)
        with self.lock:
            if self.returning:
                self.returning = [c for c in self.returning if c.key not in keys]
            for key in keys:
                self.in_flight.discard(key)
                self.running.discard(key)
                self._handed_at.pop(key, None)
        self.wake()

    def going_to_sleep(self) -> bool:
        """The consumer is about to wait: False (and not waiting) if a job ended since it
        last looked, so it looks again instead; otherwise every later end wakes it."""
        with self.lock:
            if self.freed:
                self.freed = False
                return False
            self.waiting = True
            return True

    def awake(self) -> None:
        with self.lock:
            self.waiting = False

    def clear_freed(self) -> None:
        with self.lock:
            self.freed = False

    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full: the consumer is going to wake anyway

    def drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except OSError:
            pass

    @property
    def wake_fd(self) -> int:
        return self._wake_r


@dataclass
class Outcome:
    """How one run ended, as the settler writes it."""

    message_id: str
    claim: int
    queue_name: str
    outcome: str  # done | rejected | queued | rerun (no outcome: see sql.SETTLE)
    #: the message's options as the run left them (JSON); None when unchanged. Only they
    #: change in a run: the arguments are not sent again
    options_json: str | None
    delay_s: float = 0.0
    error: str | None = None
    followups: list[tuple[Message, float]] = field(default_factory=list)
    #: what the run was, for its attempt and the history (see sql.RECORD_RAN): done | failed
    #: | rejected | snoozed | timeout | interrupted | rerun; ``error`` is its error
    attempt: str = "done"
    actor_name: str = ""
    #: when the run started and ended, by this process's monotonic clock (placed on the
    #: database's clock by the statement that writes them)
    started_mono: float | None = None
    ended_mono: float = field(default_factory=time.monotonic)


@dataclass
class SettleContext:
    """The after-hooks of one run are running on this thread: what they send is kept."""

    proxy: MessageProxy
    requeue_delay_ms: int | None = None
    followups: list[tuple[Message, float]] = field(default_factory=list)
    returned: bool = False
    skipped: bool = False
    #: what broke in the after-hooks, when one raised (the reason of a run with no outcome)
    hook_failure: str | None = None


class Settler:
    """The broker's one writer of outcomes: batches, retries through outages, never drops.

    Worker threads :meth:`submit` and go on. The settler's thread writes everything
    pending in one statement (plus one for start marks), on a dedicated connection;
    when the database is down it keeps the outcomes, logs the outage once, and after
    reconnecting proves this process alive before writing.
    """

    def __init__(self, broker: StandmeetBroker) -> None:
        self.broker = broker
        self._cond = threading.Condition()
        self._pending: list[Outcome] = []
        self._started: list[tuple[str, int]] = []
        self._busy = False
        #: the outcomes being written now (out of ``_pending`` until written or put back)
        self._writing: list[Outcome] = []
        self._conn: psycopg.Connection[Any] | None = None
        self._thread: detach.Detached | None = None
        self.written = 0

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = detach.go(f"settler-{self.broker.worker_id[:8]}", self.run)

    def submit(self, outcome: Outcome) -> None:
        with self._cond:
            self._pending.append(outcome)
            self._cond.notify()
        self.start()

    def mark_started(self, key: tuple[str, int]) -> None:
        with self._cond:
            self._started.append(key)
            self._cond.notify()
        self.start()

    def stop(self, timeout_s: float) -> bool:
        """Stop the thread once what it holds is written (or abandoned); True if it has stopped."""
        thread = self._thread
        if thread is None:
            return True
        thread.stop_event.set()
        with self._cond:  # it may be waiting for work: wake it now, not at its next tick
            self._cond.notify_all()
        return thread.join(timeout_s)

    def pending_claims(self) -> list[tuple[tuple[str, int], str]]:
        """The claims whose outcome waits to be written, with their queue."""
        with self._cond:
            return [((o.message_id, o.claim), o.queue_name) for o in (*self._writing, *self._pending)]

    def pending(self) -> int:
        with self._cond:
            return len(self._pending) + len(self._started) + (1 if self._busy else 0)

    def flush(self, timeout_s: float) -> bool:
        """Wait until everything submitted is written; False if time ran out."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending or self._started or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        return True

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff(start_s=0.05, cap_s=2.0)
        while True:
            with self._cond:
                while not self._pending and not self._started and not stop.is_set():
                    self._cond.wait(0.5)
                if not self._pending and not self._started:
                    return  # stopped, nothing left
                outcomes, self._pending = self._pending, []
                started, self._started = self._started, []
                self._busy = True
                self._writing = outcomes
            try:
                self.settle_once(outcomes, started)
                backoff.reset()
            except Exception as exc:  # never dies: kept, retried with back-off, said once
                self.broker.outage.failed("settle", exc)
                close_quietly(self._conn)
                self._conn = None
                with self._cond:  # keep them, in order, for the next attempt
                    self._pending[:0] = outcomes
                    self._started[:0] = started
                    self._busy = False
                    self._writing = []
                    self._cond.notify_all()
                if self.broker.abandon_settles:
                    return  # closing: what is left stays consumed and runs again
                time.sleep(backoff.next_s()) if stop.is_set() else stop.wait(backoff.next_s())
                continue
            with self._cond:
                self._busy = False
                self._writing = []
                self._cond.notify_all()

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            # Synchronous: once written, an outcome is forgotten here; a settle lost in a server
            # crash would leave its message consumed by this live process, rescued by nobody.
            conn = connect(self.broker.url, application_name="standmeet-settler", at_first_use=True)
            try:
                self.broker.prove_alive(conn)
            except BaseException:
                close_quietly(conn)
                raise
            self._conn = conn
        return self._conn

    def settle_once(self, outcomes: Sequence[Outcome], started: Sequence[tuple[str, int]]) -> int:
        """Write ``outcomes`` and start marks in one round trip; return outcomes written."""
        conn = self._connection()
        settling = {(o.message_id, o.claim) for o in outcomes}
        started = [key for key in started if key not in settling]  # one update per row and statement
        plain: list[Outcome] = []
        other: list[Outcome] = []
        for o in outcomes:
            (plain if o.outcome == "done" and o.options_json is None and not o.followups else other).append(o)
        awaited = app.awaited_queues()
        # No pipeline mode: psycopg's pipeline loop spun on the always-writable socket while
        # waiting (a tenth of the process's interpreter time in a drain). The start marks go
        # with the plain settles, or alone; other outcomes (rarer) take a statement of their own.
        s_ids, s_claims = [k[0] for k in started], [k[1] for k in started]
        if plain:
            now = time.monotonic()
            conn.execute(sql.SETTLE_DONE, {"ids": [o.message_id for o in plain], "claims": [o.claim for o in plain],
                                           "worker_id": self.broker.worker_id,
                                           "s_ids": s_ids, "s_claims": s_claims, "awaited": list(awaited),
                                           **timing_params(plain, now)})
        elif started:
            conn.execute(sql.MARK_STARTED, {"ids": s_ids, "claims": s_claims, "worker_id": self.broker.worker_id})
        if other:
            conn.execute(sql.SETTLE, {**settle_params(other, awaited), "worker_id": self.broker.worker_id,
                                      "max_runs_without_outcome": self.broker.settings.max_runs_without_outcome})
        self.broker.outage.ok()
        self.written += len(outcomes)
        per_queue: dict[str, int] = {}
        for o in outcomes:
            per_queue[o.queue_name] = per_queue.get(o.queue_name, 0) + 1
        for queue_name, count in per_queue.items():
            state = self.broker.queue_states.get(queue_name)
            if state is not None:
                state.settled(count)
        return len(outcomes)

    def close(self) -> None:
        close_quietly(self._conn)
        self._conn = None


def timing_params(outcomes: Sequence[Outcome], now: float) -> dict[str, Any]:
    """The actors of ``outcomes`` and how many seconds before ``now`` (monotonic) each run
    started and ended: the parameters sql.RECORD_RAN's rows are made of."""
    return {
        "actors": [o.actor_name for o in outcomes],
        "started_ago": [now - (o.ended_mono if o.started_mono is None else o.started_mono) for o in outcomes],
        "ended_ago": [now - o.ended_mono for o in outcomes],
    }


def settle_params(outcomes: Sequence[Outcome], awaited: Sequence[str], *, now: float | None = None) -> dict[str, Any]:
    """The parameters of sql.SETTLE for ``outcomes``, timed against ``now`` (monotonic;
    default: the moment of this call, which should be just before the statement is sent)."""
    followups = [(o.message_id, m, delay) for o in outcomes for m, delay in o.followups]
    return {
        **timing_params(outcomes, time.monotonic() if now is None else now),
        "hints": [o.attempt for o in outcomes],
        "ids": [o.message_id for o in outcomes],
        "claims": [o.claim for o in outcomes],
        "outcomes": [o.outcome for o in outcomes],
        "options": [o.options_json for o in outcomes],  # None: left as it is
        "delays": [o.delay_s for o in outcomes],
        "errors": [o.error for o in outcomes],
        "f_parents": [parent for parent, _, _ in followups],
        "f_queues": [m.queue_name for _, m, _ in followups],
        "f_ids": [m.message_id for _, m, _ in followups],
        "f_messages": [message_json(m) for _, m, _ in followups],
        "f_delays": [delay for _, _, delay in followups],
        "f_priorities": [message_priority(m) for _, m, _ in followups],
        "awaited": list(awaited),
    }


class MiddlewareList(list):  # type: ignore[type-arg]
    """The broker's middleware list, with a count of its changes: the hooks cache is
    rebuilt when it moves, not checked against a copy of the list on every signal."""

    version = 0


def _counting(name: str) -> Callable[..., Any]:
    original = getattr(list, name)

    def mutate(self: MiddlewareList, *args: Any, **kwargs: Any) -> Any:
        self.version += 1
        return original(self, *args, **kwargs)

    mutate.__name__ = name
    return mutate


for _mutator in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend", "insert",
                 "pop", "remove", "clear", "sort", "reverse"):
    setattr(MiddlewareList, _mutator, _counting(_mutator))


class ClaimedMessage(MessageProxy):
    """A claimed message as the worker sees it. The message's fields and this run's
    bookkeeping are plain attributes: Dramatiq's proxy forwards each read through
    ``__getattr__`` (about sixty a job, a failed lookup first for each), and an absent
    attribute read with a default costs an exception."""

    def __init__(self, message: Message, *, claim: int, claimed_at: float) -> None:
        super().__init__(message)
        self.queue_name = message.queue_name
        self.actor_name = message.actor_name
        self.args = message.args
        self.kwargs = message.kwargs
        self.options = message.options  # the same dict: what middleware write is the message's
        #: the options as claimed: a run that returned and left them so settles without
        #: writing the message back
        self.standmeet_claimed_options = dict(message.options)
        self.message_id = message.message_id
        self.message_timestamp = message.message_timestamp
        #: travels with it to its settle
        self.standmeet_claim = claim
        #: for the claim-to-start metric
        self.standmeet_claimed_at = claimed_at
        self.standmeet_settle: SettleContext | None = None
        self.standmeet_lease: Any = None
        self.standmeet_span: Any = None
        self.standmeet_metrics_start: float | None = None
        self.standmeet_log_start: tuple[float, int] | None = None
        self.standmeet_cancel_watched = False
        #: when its run started (monotonic), for its attempt and the history
        self.standmeet_started_mono: float | None = None

    def __str__(self) -> str:
        """The call, as Dramatiq's log lines print it, cut to MAX_LOGGED_CALL_CHARS: a
        message's arguments can be a megabyte."""
        return logged_call(self._message)

    def __repr__(self) -> str:
        return f"<ClaimedMessage {self.message_id} {logged_call(self._message)}>"


class StandmeetBroker(dramatiq.Broker):
    """A Dramatiq broker on Postgres: per-queue limits, database delays, one settle path."""

    def __init__(self, *, settings: Settings, url: str, middleware: list[Any] | None = None,
                 backends: Sequence[Any] = ()) -> None:
        self.settings = settings
        #: result and rate-limiter backends this broker closes with itself
        self.backends = list(backends)
        self.url = url
        self.worker_id = str(uuid.uuid4())
        self.outage = Outage("worker")
        self.claiming = True
        #: what stands between this process and Postgres: whether consumers LISTEN on
        #: their own connection, on a listener of the process, or poll
        self.topology = topology_for(url)
        self._wakeups: WakeListener | None = None
        #: set while this process cannot prove it lives (see :meth:`guard_once`)
        self.stepped_down = False
        #: when a heartbeat was last confirmed (monotonic); None before the first
        self.confirmed_at: float | None = None
        self._guard: detach.Detached | None = None
        self._step_lock = threading.Lock()
        self._beat_conn: psycopg.Connection[Any] | None = None
        #: the worker thread running each message (thread id -> proxy), to interrupt them
        self._job_threads: dict[int, MessageProxy] = {}
        self.closing = False
        #: set on close once the settler gave up waiting for the database
        self.abandon_settles = False
        self.queue_states: dict[str, QueueState] = {}
        self.served: set[str] = set()
        self.settler = Settler(self)
        self._lock = threading.Lock()
        self._heartbeat: detach.Detached | None = None
        self._pool: Any = None
        self._close_hooks: list[Callable[[], None]] = []
        #: told what each rescue pass did: {queue: (requeued, rejected)}
        self.rescue_listeners: list[Callable[[dict[str, tuple[int, int]]], None]] = []
        self._hooks_of: tuple[int, int] = (0, -1)
        #: Dramatiq workers running on this broker (booted, not yet shutting down)
        self._workers: list[Any] = []
        self._hook_cache: dict[str, list[Any]] = {}
        refuse_non_json_encoder()
        super().__init__(middleware=middleware or [])
        self.middleware: list[Any] = MiddlewareList(self.middleware)
        # Queues are declared by the actors that name them (and by declare_queue): a
        # process serves the queues of the modules it loads, no others.

    # -- queues -------------------------------------------------------------------

    def declare_queue(self, queue_name: str) -> None:
        # No delay queues: delays live in the database (the ``eta`` column).
        if queue_name not in self.queues:
            self.emit_before("declare_queue", queue_name)
            self.queue_states[queue_name] = QueueState(self.settings.queue(queue_name))
            self.queues[queue_name] = self.queue_states[queue_name]
            self.emit_after("declare_queue", queue_name)

    def queue_settings(self, queue_name: str) -> QueueSettings:
        state = self.queue_states.get(queue_name)
        return state.settings if state is not None else self.settings.queue(queue_name)

    def get_declared_queues(self) -> set[str]:
        return set(self.queues)

    def get_declared_delay_queues(self) -> set[str]:
        return set()

    # -- connections ----------------------------------------------------------------

    @property
    def pool(self) -> Any:
        """The pool for sends, heartbeats and rescue, opened on first use."""
        if self._pool is None:
            with self._lock:
                if self._pool is None:
                    self._pool = open_send_pool(self.url, max_size=self.settings.broker_ack_connections)
        return self._pool

    def execute(self, query: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
        """One autocommit statement on the send pool; its rows (empty if none)."""
        with self.pool.connection() as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    # -- enqueue ------------------------------------------------------------------

    def enqueue(self, message: Message, *, delay: int | None = None) -> Message:
        """Write ``message`` (due after ``delay`` ms) and wake its queue's consumers.

        Sent from the after-hooks of a run on this thread (a retry, a snooze, a pipeline's
        next step, a callback), it is written with that run's settle instead: in the same
        transaction, and only if the run is settled.
        """
        if message.queue_name not in self.queues:
            raise QueueNotFound(message.queue_name)
        refuse_non_json_encoder()
        message.options.pop("eta", None)  # Dramatiq would hold an ``eta`` message in memory
        context: SettleContext | None = getattr(_local, "settling", None)
        if context is not None:
            self.emit_before("enqueue", message, delay)
            if message.message_id == context.proxy.message_id:
                context.requeue_delay_ms = int(delay_seconds(delay) * 1000)
            else:  # refused here, not in the settler: a bad message must not hold up the others
                enqueue_one_params(message, delay, max_bytes=self.settings.message_max_bytes)
                context.followups.append((as_message(message), delay_seconds(delay)))
            self.emit_after("enqueue", message, delay)
            return message
        self.emit_before("enqueue", message, delay)
        key = unique_key_of(message, self)
        if key is None:
            params = enqueue_one_params(message, delay, max_bytes=self.settings.message_max_bytes)
            try:
                self.execute(sql.ENQUEUE_ONE, params)
            except DISCONNECTS as exc:
                raise BrokerConnectionError(f"could not enqueue {message.message_id}: {exc}") from exc
        else:  # written unless its key is live: then the live message is returned
            item = unique_item(message, key, max_bytes=self.settings.message_max_bytes)
            try:
                with self.pool.connection() as conn:
                    outcome = run_steps(conn, unique_write([item], delay_seconds(delay)))
            except DISCONNECTS as exc:
                raise BrokerConnectionError(f"could not enqueue {message.message_id}: {exc}") from exc
            count_skips(outcome.skipped, self)
            message = live_messages([as_message(message)], outcome)[0]
        self.emit_after("enqueue", message, delay)
        return message

    def enqueue_many(self, messages: Sequence[Message], *, conn: psycopg.Connection[Any] | None = None,
                     delay: int | None = None) -> list[Message]:
        """Write many messages in one statement (on ``conn``, in its transaction, if given)."""
        batch = list(messages)
        if not batch:
            return batch
        # Hooks that would only add a trace carrier, with nothing to carry, are not called
        # for each message: they would leave every one as it is.
        hooked = not (self.before_enqueue_only_carries_traces() and tracing.nothing_to_carry())
        for message in batch:
            if message.queue_name not in self.queues:
                raise QueueNotFound(message.queue_name)
            message.options.pop("eta", None)
            if hooked:
                self.emit_before("enqueue", message, delay)
        keyed, keys = split_unique(batch, self)
        if keyed:  # a batch holding messages with unique keys: the others are written beside them
            batch = self._enqueue_unique(batch, keyed, keys, conn=conn, delay=delay)
        else:
            params = enqueue_params(batch, delay, max_bytes=self.settings.message_max_bytes)
            try:
                if conn is not None:
                    conn.execute(sql.ENQUEUE, params)
                else:
                    try:
                        self.execute(sql.ENQUEUE_NEW, params)
                    except psycopg.errors.UniqueViolation:  # an id exists: nothing was written
                        self.execute(sql.ENQUEUE, params)
            except DISCONNECTS as exc:
                raise BrokerConnectionError(f"could not enqueue {len(batch)} message(s): {exc}") from exc
        if self._hooks("after_enqueue"):
            for message in batch:
                self.emit_after("enqueue", message, delay)
        return batch

    def _enqueue_unique(self, batch: list[Message], keyed: list[int], keys: list[UniqueKey | None], *,
                        conn: psycopg.Connection[Any] | None, delay: int | None) -> list[Message]:
        """Write a batch some of whose messages carry a unique key, in one transaction (the
        caller's, on ``conn``); each skipped one is replaced by the live message of its key."""
        limit = self.settings.message_max_bytes
        items = [unique_item(batch[i], keys[i], max_bytes=limit) for i in keyed]  # type: ignore[arg-type]
        plain = [m for m, k in zip(batch, keys, strict=True) if k is None]
        params = enqueue_params(plain, delay, max_bytes=limit) if plain else None

        def write(c: psycopg.Connection[Any]) -> UniqueOutcome:
            if params is not None:
                c.execute(sql.ENQUEUE, params)
            return run_steps(c, unique_write(items, delay_seconds(delay)))

        try:
            if conn is not None:
                outcome = write(conn)
            else:
                with self.pool.connection() as own, own.transaction():
                    outcome = write(own)
        except DISCONNECTS as exc:
            raise BrokerConnectionError(f"could not enqueue {len(batch)} message(s): {exc}") from exc
        count_skips(outcome.skipped, self)
        written = list(batch)
        for i, live in zip(keyed, live_messages([as_message(batch[i]) for i in keyed], outcome), strict=True):
            written[i] = live
        return written

    # -- signals ----------------------------------------------------------------------

    def _hooks(self, name: str) -> list[Any]:
        """The middleware methods that really handle ``name`` (``before_enqueue`` …), in
        order: Dramatiq calls all of them, most the base class's no-ops, several times
        per message. Recomputed whenever the middleware list changes."""
        middleware = self.middleware
        if not isinstance(middleware, MiddlewareList):  # a plain list was assigned
            middleware = self.middleware = MiddlewareList(middleware)
        version = (id(middleware), middleware.version)
        if self._hooks_of != version:
            self._hooks_of, self._hook_cache = version, {}
        hooks = self._hook_cache.get(name)
        if hooks is None:
            base = getattr(Middleware, name, None)
            hooks = [(m, getattr(m, name)) for m in middleware
                     if getattr(type(m), name, None) is not base or name in vars(m)]
            self._hook_cache[name] = hooks
        return hooks

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal == "process_message":
            self._job_threads[threading.get_ident()] = args[0]
            args[0].standmeet_started_mono = time.monotonic()
        elif signal == "worker_boot" and args:
            # before its threads start: a job may end before Worker.start() returns
            self._workers = [*self._workers, args[0]]
        elif signal == "worker_shutdown" and args:
            self._workers = [w for w in self._workers if w is not args[0]]
        # As Dramatiq's: a MiddlewareError stops the operation, other errors are logged.
        for middleware, hook in self._hooks("before_" + signal):
            try:
                hook(self, *args, **kwargs)
            except MiddlewareError:
                raise
            except Exception:
                self.logger.critical("Unexpected failure in before_%s of %r.", signal, middleware, exc_info=True)

    def _emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        for middleware, hook in reversed(self._hooks("after_" + signal)):
            try:
                hook(self, *args, **kwargs)
            except Exception as exc:
                self.logger.critical("Unexpected failure in after_%s of %r.", signal, middleware, exc_info=True)
                context: SettleContext | None = getattr(_local, "settling", None)
                if context is not None and context.hook_failure is None:
                    context.hook_failure = (f"after_{signal} of {type(middleware).__name__} raised "
                                            f"{type(exc).__name__}: {exc}")

    # -- the settle path ------------------------------------------------------------

    def emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal not in ("process_message", "skip_message"):
            self._emit_after(signal, *args, **kwargs)
            return
        proxy = args[0]
        self._job_threads.pop(threading.get_ident(), None)
        exception = kwargs.get("exception")
        # A job that asked to run later (Snooze) is not a failure: report it as skipped,
        # so no retry is counted, no failure callback fires, and every middleware
        # releases what it acquired in ``after_skip_message``.
        # A job interrupted because this process stepped down (cut off from the database)
        # is not at fault either: it runs again, with no retry counted (see step_down).
        cut_off = signal == "process_message" and isinstance(exception, CutOff)
        if signal == "process_message" and (cut_off or isinstance(exception, Deferred)):
            signal, kwargs = "skip_message", {}
        if signal == "process_message" and exception is None and kwargs.get("result") is not None:
            exception = self._refused_result(proxy, kwargs["result"])
            if exception is not None:
                kwargs = {"exception": exception}
        context = getattr(proxy, "standmeet_settle", None)
        if context is None and claim_of(proxy) is not None:
            context = proxy.standmeet_settle = SettleContext(proxy)  # type: ignore[union-attr]
        if context is not None and signal == "process_message" and exception is None:
            context.returned = True
        if context is not None and signal == "skip_message":
            context.skipped = True  # acked without running, unless a middleware requeues it
        for _, disarm in self._hooks("disarm"):  # the time limit never fires in the settle path
            disarm()
        _local.settling = context
        try:
            self._emit_after(signal, *args, **kwargs)
        finally:
            _local.settling = None
        if cut_off and context is not None and context.requeue_delay_ms is None:
            context.requeue_delay_ms = 0

    def _refused_result(self, proxy: MessageProxy, result: Any) -> ResultRefused | None:
        """Ask the middleware that keep results (a ``refuse_result(broker, message, result)``
        hook returns why it cannot keep it, or None) before any after-hook sees the result.
        A refused result fails the run for good, with the reason: the after-hooks then see
        that failure (no retry, no success callback, the failure stored for waiters)."""
        for _, refuse in self._hooks("refuse_result"):
            reason = refuse(self, proxy, result)
            if reason:
                refused = ResultRefused(reason)
                logger.error("message %s failed: %s", proxy.message_id, reason)
                proxy.stuff_exception(refused)
                proxy.options["error"] = f"ResultRefused: {reason}"
                proxy.fail()
                return refused
        return None

    def settle(self, proxy: MessageProxy, *, rejected: bool) -> None:
        """Hand a finished run's outcome to the settler and free its running slot.

        Never blocks on the database: the worker thread goes on at once.
        """
        claim = claim_of(proxy)
        state = self.queue_states.get(proxy.queue_name)
        if claim is None or state is None:
            logger.debug("settle: %s was not claimed by this process", proxy.message_id)
            return
        key = (proxy.message_id, claim)
        context: SettleContext | None = getattr(proxy, "standmeet_settle", None)
        followups = context.followups if context is not None else []
        options = options_json(proxy)
        if options is None:  # what a middleware left in them cannot be stored: as they were claimed
            context = None
        exception = getattr(proxy, "_exception", None)
        if rejected:
            outcome = Outcome(proxy.message_id, claim, proxy.queue_name, "rejected", options,
                              error=rejection_reason(proxy), followups=followups,
                              attempt="timeout" if timed_out(exception) else "rejected")
        elif context is not None and context.requeue_delay_ms is not None:
            attempt = ran_as(exception)
            outcome = Outcome(proxy.message_id, claim, proxy.queue_name, "queued", options,
                              delay_s=context.requeue_delay_ms / 1000.0, followups=followups, attempt=attempt,
                              error=attempt_error(proxy, exception, attempt))
        elif context is not None and (context.returned or context.skipped):
            unchanged = getattr(proxy, "standmeet_claimed_options", None) == proxy.options
            outcome = Outcome(proxy.message_id, claim, proxy.queue_name, "done",
                              None if unchanged else options, followups=followups)
        else:
            # Neither returned, nor retried, nor rejected: a middleware failed in the middle
            # of the after-hooks (its retry logic raised). Never record it as done: run it
            # again, counted, until STANDMEET_MAX_RUNS_WITHOUT_OUTCOME rejects it with the reason.
            reason = (context.hook_failure if context is not None else None) or (
                "its options cannot be stored as JSON" if options is None else "no middleware decided its outcome")
            logger.error("message %s ended without an outcome (%s); running it again, at most %d runs so",
                         proxy.message_id, reason, self.settings.max_runs_without_outcome)
            outcome = Outcome(proxy.message_id, claim, proxy.queue_name, "rerun", None,
                              delay_s=self.settings.min_backoff_ms / 1000.0, error=storable_text(reason),
                              followups=[], attempt="rerun")
        outcome.actor_name = proxy.actor_name
        outcome.started_mono = getattr(proxy, "standmeet_started_mono", None)
        proxy.standmeet_settle = None  # type: ignore[attr-defined]
        # The slot is free: this thread hands the next buffered claim to the worker itself.
        consumer_thread = self._consumer_thread(proxy.queue_name) if self.may_claim else None
        following = state.finished(key, hand_off=consumer_thread is not None)
        if following is not None:
            self._hand_to_worker(state, following, consumer_thread)
        self.settler.submit(outcome)

    def proxy_for(self, claim: Claim) -> ClaimedMessage:
        """The proxy a worker runs for a claim leaving the buffer, marked started (in the
        database, with the settler's next statement) unless its claim already did."""
        if not claim.started:
            self.settler.mark_started(claim.key)
            claim.started = True
        return ClaimedMessage(claim.message, claim=claim.number, claimed_at=claim.claimed_at)

    def before_enqueue_only_carries_traces(self) -> bool:
        """Whether every ``before_enqueue`` hook is declared to add a trace carrier and
        nothing else: a message that carries one, or any message when there is nothing to
        carry, passes through them unchanged."""
        return all(tracing.is_carrier_only(hook) for _, hook in self._hooks("before_enqueue"))

    def _consumer_thread(self, queue_name: str) -> Any:
        """The running Dramatiq worker's consumer thread of ``queue_name``, if any."""
        for worker in self._workers:
            thread = getattr(worker, "consumers", {}).get(queue_name)
            if thread is not None and callable(getattr(thread, "handle_message", None)):
                return thread
        return None

    def _hand_to_worker(self, state: QueueState, claim: Claim, consumer_thread: Any) -> None:
        """Put a claim taken from the buffer on the worker's work queue, as its consumer
        thread would (the same method); if that fails, it goes back to the buffer."""
        try:
            consumer_thread.handle_message(self.proxy_for(claim))
        except Exception:
            logger.exception("queue %r: could not start message %s here; the consumer will",
                             state.name, claim.message.message_id)
            state.put_back(claim)

    def requeue(self, messages: Iterable[Message | MessageProxy], claims: Iterable[int] | None = None) -> int:
        """Give claimed messages that never started back to their queue, without blame."""
        messages = list(messages)
        numbers = list(claims) if claims is not None else [claim_of(m) for m in messages]
        by_queue: dict[str, list[tuple[str, int]]] = {}
        for message, number in zip(messages, numbers, strict=True):
            if number is not None:
                by_queue.setdefault(message.queue_name, []).append((message.message_id, number))
        total = 0
        for queue_name, keys in by_queue.items():
            self.execute(sql.REQUEUE, {"ids": [k[0] for k in keys], "claims": [k[1] for k in keys],
                                       "worker_id": self.worker_id})
            self.queue_states[queue_name].release(keys)
            total += len(keys)
        if total:
            logger.info("returned %d prefetched message(s) to the queue", total)
        return total

    # -- consuming ----------------------------------------------------------------

    def consume(self, queue_name: str, prefetch: int = 1, timeout: int = 30000) -> StandmeetConsumer:
        # ``prefetch`` is ignored on purpose: a queue holds at most its own limit plus its
        # own prefetch. No I/O here: the consumer proves this process alive on its first
        # connection, inside its outage handling.
        if queue_name not in self.queue_states:
            raise QueueNotFound(queue_name)
        with self._lock:
            self.served.add(queue_name)
            if not self.listens_on_claims and self.topology.listen_url is not None:
                if self._wakeups is None:
                    self._wakeups = WakeListener(self.topology.listen_url, outage=self.outage)
                state = self.queue_states[queue_name]
                self._wakeups.add(sql.ENQUEUE_CHANNEL.format(queue=queue_name), state.wake)
        return StandmeetConsumer(self, self.queue_states[queue_name], timeout_ms=timeout)

    @property
    def listens_on_claims(self) -> bool:
        """Consumers LISTEN on their own claim connection (direct or session-pooled, with no
        other listen URL); otherwise a listener of the process wakes them, or they poll."""
        topology = self.topology
        return topology.mode != TRANSACTION and topology.listen_url == self.url

    @property
    def wake_poll_s(self) -> float | None:
        """How often idle consumers look for work when no notification can reach them."""
        return None if self.topology.listen_url is not None else self.topology.poll_s

    @property
    def may_claim(self) -> bool:
        """Claiming and starting claims: not while shutting down, nor while stepped down."""
        return self.claiming and not self.stepped_down

    def stop_claiming(self) -> None:
        """Claim nothing more (shutdown), and give back at once what was prefetched."""
        self.claiming = False
        for state in self.queue_states.values():
            buffered = state.take_buffer()
            if buffered:
                try:
                    self.requeue([c.message for c in buffered], [c.number for c in buffered])
                except DISCONNECTS as exc:
                    # Still ours, never started here: offered again by the consumer if this
                    # process claims again, by the graceful stop otherwise, or by rescue.
                    state.give_back_later(buffered)
                    logger.warning("could not give back %d prefetched message(s) yet: %s", len(buffered), exc)
            state.wake()

    # -- liveness -----------------------------------------------------------------

    def prove_alive(self, conn: psycopg.Connection[Any] | None = None) -> None:
        """Record a heartbeat (registering this process if needed), on ``conn`` or the pool.

        Called before the first claim, and again before claiming or settling after an
        outage: rescue never takes back the claims of a process that proved it is alive.
        """
        params = {
            "worker_id": self.worker_id,
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "queues": sorted(self.served),
        }
        if conn is not None:
            conn.execute(sql.HEARTBEAT, params)
        else:
            self.execute(sql.HEARTBEAT, params)
        self.confirmed_at = time.monotonic()
        self.outage.ok()
        self._start_heartbeat()
        if self.stepped_down:
            self._step_up(conn)

    def ensure_registered(self) -> None:
        self.prove_alive()

    def _start_heartbeat(self) -> None:
        with self._lock:
            if self._heartbeat is None and not self.closing:
                self._heartbeat = detach.every(
                    f"heartbeat-{self.worker_id[:8]}", self.settings.heartbeat_s, self.heartbeat_once
                )
                self._guard = detach.every(
                    f"liveness-guard-{self.worker_id[:8]}", min(0.5, self.settings.heartbeat_s / 2), self.guard_once
                )
            if self._wakeups is not None:
                self._wakeups.start()

    # -- stepping down when cut off -------------------------------------------------

    def guard_once(self) -> bool:
        """Step down if no heartbeat was confirmed for ``step_down_after_s``: no I/O here, so
        a thread stuck on a dead connection cannot stop it. True if it stepped down now."""
        confirmed = self.confirmed_at
        if (self.stepped_down or confirmed is None or self.closing or not self.claiming
                or time.monotonic() - confirmed < self.settings.step_down_after_s):
            return False
        self.step_down(time.monotonic() - confirmed)
        return True

    def step_down(self, silent_s: float) -> None:
        """Stop claiming and starting claims, and interrupt the running jobs (retryable):
        another process may rescue them once this one's heartbeat is older than the rescue
        window, and a run must not go on here then. Prefetched claims are kept unstarted;
        what this process still holds when it can prove it lives again is checked then."""
        self.stepped_down = True
        running = list(self._job_threads.items())
        for thread_id, _proxy in running:
            raise_thread_exception(thread_id, CutOff)
        logger.warning(
            "stepping down: no heartbeat confirmed for %.1f s (another process may rescue this one's jobs after "
            "%g s): claiming stopped, %d running job(s) interrupted; they run again",
            silent_s, self.settings.rescue_after_s, len(running))

    def _step_up(self, conn: psycopg.Connection[Any] | None) -> None:
        """This process proved it lives again: say which of its claims were taken back
        meanwhile (their late outcomes are fenced off by the claim number), then claim again."""
        with self._step_lock:  # several threads may prove it at once: one says it
            if self.stepped_down:
                self._step_up_once(conn)

    def _step_up_once(self, conn: psycopg.Connection[Any] | None) -> None:
        held = list(dict.fromkeys([*((key, state.name) for state in self.queue_states.values()
                                     for key in state.held()), *self.settler.pending_claims()]))
        lost: list[tuple[str, int, str]] = []
        if held:
            params = {"ids": [key[0] for key, _ in held], "claims": [key[1] for key, _ in held],
                      "worker_id": self.worker_id}
            try:  # on the connection that just proved it: the pool may still be reconnecting
                rows = (conn.execute(sql.STILL_HELD, params).fetchall() if conn is not None
                        else self.execute(sql.STILL_HELD, params))
            except DISCONNECTS:
                return  # not proven after all: the next heartbeat tries again
            kept = {(row[0], int(row[1])) for row in rows}
            lost = [(key[0], key[1], queue) for key, queue in held if key not in kept]
        for message_id, number, queue_name in lost:
            logger.warning("lost claim %d of message %s (queue %r): taken back while this process was cut off; "
                           "its outcome here is not written", number, message_id, queue_name)
        if lost:  # cut off, not crashed: the blame rescue laid on this process is taken back
            params = {"ids": sorted({m for m, _, _ in lost}), "worker_id": self.worker_id}
            try:
                if conn is not None:
                    conn.execute(sql.CLEAR_BLAME, params)
                else:
                    self.execute(sql.CLEAR_BLAME, params)
            except DISCONNECTS:
                return  # not proven after all: the next heartbeat tries again
        for state in self.queue_states.values():
            state.forget({(m, n) for m, n, q in lost if q == state.name})
        self.stepped_down = False
        logger.warning("stepping up: heartbeat confirmed again; %d claim(s) lost, claiming again", len(lost))
        for state in self.queue_states.values():
            state.wake()

    def heartbeat_once(self) -> dict[str, tuple[int, int]]:
        """Prove this process alive, and rescue the messages of dead ones.

        The heartbeat has a connection of its own, kept for the process's life: behind a
        session pooler whose server connections are all taken, a heartbeat waiting for one
        would make this live process look dead to the others."""
        try:
            conn = self._beat_conn
            if conn is None or conn.closed:
                conn = self._beat_conn = connect(self.url, application_name="standmeet-heartbeat", at_first_use=True)
            try:
                self.prove_alive(conn)
            except BaseException:
                close_quietly(conn)
                self._beat_conn = None
                raise
            return self.rescue_once()
        except psycopg.Error as exc:
            self.outage.failed("heartbeat", exc)  # one line per outage, not one per beat
            return {}

    def rescue_once(self) -> dict[str, tuple[int, int]]:
        """Requeue messages whose process died; returns {queue: (requeued, rejected)}.

        A process that was itself cut off from the database judges nobody until it has
        been back for a whole rescue window: the others need that long to prove they live.
        """
        ended = self.outage.ended_at
        if self.outage.down or (ended is not None and time.monotonic() - ended < self.settings.rescue_after_s):
            return {}
        rows = self.execute(
            sql.RESCUE,
            {"after_s": self.settings.rescue_after_s, "max_crashes": self.settings.max_crashes,
             "worker_id": self.worker_id},
        )
        result = {row[0]: (int(row[1]), int(row[2])) for row in rows}
        for listener in self.rescue_listeners:  # e.g. the metrics' rescue counter
            listener(result)
        for row in rows:
            logger.warning(
                "crash rescue: %d message(s) of queue %r requeued (%d suspect), %d rejected (too many crashes, "
                "or cancelled)",
                int(row[1]), row[0], int(row[3]), int(row[2]),
            )
        return result

    # -- Dramatiq's test-support contract ---------------------------------------------

    def flush(self, queue_name: str) -> None:
        """Drop the messages of ``queue_name`` that wait (queued or delayed)."""
        if queue_name not in self.queues:
            raise QueueNotFound(queue_name)
        self.execute(sql.FLUSH, {"queues": [queue_name]})

    def flush_all(self) -> None:
        """Drop the waiting messages of every declared queue."""
        self.execute(sql.FLUSH, {"queues": sorted(self.queues)})

    def join(self, queue_name: str, *, timeout: int | None = None) -> None:
        """Wait until ``queue_name`` has nothing queued, delayed or running.

        ``timeout`` is in milliseconds; :class:`dramatiq.errors.QueueJoinTimeout` past it.
        """
        if queue_name not in self.queues:
            raise QueueNotFound(queue_name)
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        while True:
            (outstanding,) = self.execute(sql.OUTSTANDING, {"queue": queue_name})[0]
            if outstanding == 0 and self.settler.pending() == 0:
                return
            if deadline is not None and time.monotonic() >= deadline:
                raise QueueJoinTimeout(queue_name)
            time.sleep(JOIN_POLL_S)

    # -- shutdown -----------------------------------------------------------------

    def on_close(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` first when this broker closes (the process's services stop with it)."""
        self._close_hooks.append(hook)

    def close(self) -> None:
        """Stop: write what is settled, give back what this process still holds, without blame."""
        if self.closing:
            return
        self.closing = True
        for hook in self._close_hooks:  # the relay first: no new messages from this process
            try:
                hook()
            except Exception:
                logger.exception("closing a service of this process failed")
        if self.claiming:
            self.stop_claiming()
        if not self.settler.flush(CLOSE_FLUSH_S):
            logger.warning("%d outcome(s) not written before exit: their messages run again",
                           self.settler.pending())
        self.abandon_settles = True
        self.settler.stop(timeout_s=1)
        self.settler.close()
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout_s=2)
        if self._guard is not None:
            self._guard.stop(timeout_s=1)
        close_quietly(self._beat_conn)
        if self._wakeups is not None:
            self._wakeups.stop()
        if self._heartbeat is not None or self.served:
            try:
                self.execute(sql.STOP_WORKER, {"worker_id": self.worker_id})
            except DISCONNECTS as exc:
                logger.warning("could not record this worker as stopped: %s", exc)
        for backend in self.backends:
            backend.close()
        if self._pool is not None:
            self._pool.close(timeout=1.0)
        for state in self.queue_states.values():
            state.wake()


class StandmeetConsumer(Consumer):
    """Claims due messages of one queue, never more than its limit running plus prefetch."""

    def __init__(self, broker: StandmeetBroker, state: QueueState, *, timeout_ms: int) -> None:
        self.broker = broker
        self.state = state
        self.timeout_s = max(0.05, timeout_ms / 1000)
        self.conn: psycopg.Connection[Any] | None = None
        self.next_due_s: float | None = 0.0
        #: a claim found less than it asked for: when the next message is due is not known yet
        self.next_due_unknown = False
        self.backoff = Backoff(start_s=0.1, cap_s=5.0)
        #: a give-back that failed is tried again no sooner than this (monotonic)
        self.give_back_after = 0.0
        self.give_back_backoff = Backoff(start_s=0.1, cap_s=5.0)
        self.channel = sql.ENQUEUE_CHANNEL.format(queue=state.name)

    def __iter__(self) -> StandmeetConsumer:
        return self

    def __next__(self) -> MessageProxy | None:
        # Shutting down: start nothing more; the buffer went back to the queue. Stepped
        # down: start nothing until this process has proved it lives again.
        if self.broker.may_claim:
            proxy = self._hand_out()
            if proxy is not None:
                return proxy
        try:
            return self._claim_or_wait()
        except psycopg.Error as exc:  # any database error: said once, retried with back-off
            self.broker.outage.failed(f"consumer {self.state.name}", exc)
            self._drop_connection()
            self._wait_on_pipe(self.backoff.next_s())
            return None

    def _hand_out(self) -> MessageProxy | None:
        claim = self.state.next_buffered()
        if claim is None:
            return None
        return self.broker.proxy_for(claim)

    def _claim_or_wait(self) -> MessageProxy | None:
        conn = self._connection()
        if self.broker.may_claim:
            self._give_back_excess()
        if self.broker.may_claim and self._due() and self.state.should_claim():
            if self.claim_once(conn):
                return self._hand_out()
        self._wait(conn)
        return None

    def _give_back_excess(self) -> None:
        """Return to the queue, unblamed, what the buffer would hold too long. If that fails,
        they stay this process's, unstarted, and are offered again on the next pass."""
        if time.monotonic() < self.give_back_after:
            return
        excess = self.state.take_excess()
        if not excess:
            return
        try:
            self.broker.requeue([c.message for c in excess], [c.number for c in excess])
            self.give_back_backoff.reset()
            self.broker.outage.ok()
        except DISCONNECTS as exc:
            # The send pool failed, not this consumer's connection: go on claiming (other
            # claims, other keys) and offer these again after a back-off.
            self.broker.outage.failed("give back", exc)
            self.give_back_after = time.monotonic() + self.give_back_backoff.next_s()

    def _due(self) -> bool:
        return self.next_due_s is not None and self.next_due_s <= time.monotonic()

    def claim_once(self, conn: psycopg.Connection[Any]) -> int:
        """Claim up to the free slots of this queue; return how many were claimed."""
        want = self.state.free()
        if want <= 0:
            return 0
        start_now = self.state.start_now()
        rows = conn.execute(sql.CLAIM, {"queue": self.state.name, "n": want, "n_start": start_now,
                                        "worker_id": self.broker.worker_id,
                                        **claim_size_params(self.broker.settings.message_max_bytes)}).fetchall()
        rows.sort(key=lambda row: row[2])
        for text, number, rank, row_id, row_queue, refusal in rows:
            if text is None:  # rejected by the claim itself: never loaded here
                logger.error("queue %r: message %s rejected: %s", self.state.name, row_id, refusal)
                continue
            message = self._decode(conn, text, row_id, row_queue)
            if message is None:
                continue
            if message.actor_name not in self.broker.actors:
                self._bounce_unknown_actor(conn, message)
                continue
            self.state.hold(Claim(message, int(number), started=rank <= start_now))
        if len(rows) < want:
            # nothing more is due now: when to look again is asked before the consumer
            # sleeps, after what was claimed has been handed out (not before it)
            self.next_due_s = time.monotonic() + self.poll_s
            self.next_due_unknown = True
        else:
            self.next_due_s = 0.0  # there may be more: claim again when a slot frees
        self.broker.outage.ok()
        self.backoff.reset()
        return len(rows)

    def look_up_next_due(self, conn: psycopg.Connection[Any]) -> None:
        """When the queue's next message is due: look again exactly then (at the latest
        after the poll interval); due now yet not claimed (locked by another claimer):
        shortly, not in a busy loop."""
        self.next_due_unknown = False
        now = time.monotonic()  # the statement's now(): its seconds count from before the round trip
        seconds = conn.execute(sql.NEXT_DUE, {"queue": self.state.name}).fetchone()
        poll_s = self.poll_s
        if seconds is None or seconds[0] is None:
            self.next_due_s = now + poll_s
        else:
            wait_s = float(seconds[0])
            self.next_due_s = now + min(wait_s if wait_s > 0 else MIN_WAIT_S, poll_s)

    def _decode(self, conn: psycopg.Connection[Any], text: str, row_id: str, row_queue: str) -> Message | None:
        """The row's message, or None after rejecting a row that cannot be run as it is."""
        try:
            message = Message.decode(text.encode("utf-8"))
        except Exception as exc:
            self._reject_malformed(conn, row_id, f"malformed message: {exc!r}")
            return None
        if message.message_id != row_id:
            self._reject_malformed(
                conn, row_id, f"malformed message: its message_id {message.message_id!r} is not the row's {row_id!r}")
            return None
        if message.queue_name != row_queue:
            self._reject_malformed(
                conn, row_id, f"malformed message: its queue_name {message.queue_name!r} is not the row's {row_queue!r}")
            return None
        return message

    def _reject_malformed(self, conn: psycopg.Connection[Any], row_id: str, error: str) -> None:
        logger.error("queue %r: rejecting message %s: %s", self.state.name, row_id, error)
        # On the send pool, committed synchronously like every outcome: lost in a server crash,
        # the row would stay consumed under this live process, rescued by nobody.
        self.broker.execute(sql.REJECT_MALFORMED, {"message_id": row_id, "error": error})

    def _bounce_unknown_actor(self, conn: psycopg.Connection[Any], message: Message) -> None:
        settings = self.broker.settings
        error = (f"no actor {message.actor_name!r} in worker {self.broker.worker_id} "
                 f"(host {socket.gethostname()}, pid {os.getpid()}); given back every "
                 f"{settings.unknown_actor_delay_s:g} s, rejected after {settings.unknown_actor_max_claims} claims")
        logger.warning("queue %r: message %s is for an unknown actor %r; giving it back for %.0f s",
                       self.state.name, message.message_id, message.actor_name, settings.unknown_actor_delay_s)
        self.broker.execute(sql.UNKNOWN_ACTOR, {"message_id": message.message_id, "error": error,  # synchronous
                                         "delay_s": settings.unknown_actor_delay_s,
                                         "max_claims": settings.unknown_actor_max_claims})

    @property
    def poll_s(self) -> float:
        """The fallback poll: the queue's, or quicker when no notification can reach us."""
        unheard = self.broker.wake_poll_s
        return self.state.settings.poll_s if unheard is None else min(unheard, self.state.settings.poll_s)

    def _wait(self, conn: psycopg.Connection[Any]) -> None:
        if self.next_due_unknown and self.broker.may_claim:
            self.look_up_next_due(conn)
        timeout = self.timeout_s
        if not self.broker.may_claim:
            timeout = SHUTDOWN_POLL_S  # let the consumer thread see that it must stop
        elif self.next_due_s is not None and self.state.should_claim():
            # a due time matters only with room to claim; when full, a finishing job wakes us
            timeout = min(timeout, max(0.0, self.next_due_s - time.monotonic()))
        if self._heard(conn):
            return
        if not self.state.going_to_sleep():
            self.next_due_s = min(self.next_due_s or 0.0, time.monotonic())  # a slot freed
            return
        try:
            woken = readable([conn.fileno(), self.state.wake_fd], timeout)
        finally:
            self.state.awake()
        if self.state.wake_fd in woken:
            self.state.drain_wake()
            self.state.clear_freed()  # the pipe said it
            self.next_due_s = min(self.next_due_s or 0.0, time.monotonic())
        if woken:
            self._heard(conn)

    def _heard(self, conn: psycopg.Connection[Any]) -> bool:
        """Consume the notifications that arrived; True if any did (look again now)."""
        heard = False
        for _ in conn.notifies(timeout=0):
            heard = True
        if heard:
            self.next_due_s = 0.0
        return heard

    def _wait_on_pipe(self, timeout: float) -> None:
        if readable([self.state.wake_fd], timeout):
            self.state.drain_wake()

    def _connection(self) -> psycopg.Connection[Any]:
        if self.conn is not None and not self.conn.closed:
            return self.conn
        conn = connect(self.broker.url, application_name=f"standmeet-consumer-{self.state.name}"[:63],
                       at_first_use=True)
        try:
            # Before the first claim, and after every outage: rescue must know we live.
            self.broker.prove_alive(conn)
            if self.broker.listens_on_claims:  # else the process's listener wakes us, or we poll
                conn.execute('LISTEN "' + self.channel.replace('"', '""') + '"')
        except BaseException:
            close_quietly(conn)
            raise
        self.conn = conn
        self.next_due_s = 0.0  # we may have missed notifications: look now
        return conn

    def _drop_connection(self) -> None:
        close_quietly(self.conn)
        self.conn = None

    # -- settling (called from worker threads) ------------------------------------

    def ack(self, message: MessageProxy) -> None:
        self.broker.settle(message, rejected=False)

    def nack(self, message: MessageProxy) -> None:
        self.broker.settle(message, rejected=True)

    def requeue(self, messages: Iterable[MessageProxy]) -> None:
        try:
            self.broker.requeue(messages)
        except DISCONNECTS as exc:
            raise BrokerConnectionError(str(exc)) from exc

    def close(self) -> None:
        self._drop_connection()


def claim_of(message: Message | MessageProxy) -> int | None:
    """The claim number our consumer attached to this message, if it claimed it."""
    return getattr(message, "standmeet_claim", None) if isinstance(message, MessageProxy) else None


def as_message(message: Message | MessageProxy) -> Message:
    return message._message if isinstance(message, MessageProxy) else message  # type: ignore[attr-defined]


#: Dramatiq's JSONEncoder writes ``json.dumps(fields, separators=(",", ":"))``: the same
#: encoder made once (json.dumps makes a new one per call with these separators).
compact_json = json.JSONEncoder(separators=(",", ":")).encode
_MESSAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Message))


def _encoded_as_dramatiq_would(message: Message) -> bool:
    """Whether compact_json of :func:`_fields` is the text Dramatiq's encoder writes."""
    return type(message) is Message and type(dramatiq.get_encoder()) is dramatiq.JSONEncoder


def _fields(message: Message) -> dict[str, Any]:
    return {name: getattr(message, name) for name in _MESSAGE_FIELDS}


def message_json(message: Message | MessageProxy) -> str:
    """The message as JSON text, as Dramatiq encodes it."""
    plain = as_message(message)
    if _encoded_as_dramatiq_would(plain):
        return compact_json(_fields(plain))  # the same text as plain.encode().decode()
    return plain.encode().decode("utf-8")


def message_priority(message: Message | MessageProxy) -> int:
    """Lower runs first: the message's ``priority`` option, else its actor's priority."""
    value = message.options.get("priority")
    if value is None:
        broker = dramatiq.broker.global_broker
        actor = broker.actors.get(message.actor_name) if broker is not None else None
        value = actor.priority if actor is not None else 0
    return int(value)


#: Dramatiq's options whose values are numbers, with the least each may be: (minimum,
#: whole numbers only). A value of another type, not finite, below its minimum or above
#: MAX_OPTION_VALUE is refused at send: in a run it would make the retry logic raise.
NUMERIC_OPTIONS: dict[str, tuple[float, bool]] = {
    "max_retries": (0, True), "retries": (0, True), "min_backoff": (0, False), "max_backoff": (0, False),
    "time_limit": (1, False), "max_age": (1, False), "delay": (0, False), "result_ttl": (1, False),
    "priority": (-(2 ** 31), True), "max_snoozes": (0, True), "snoozes": (0, True),
    "unique_period_s": (1, False),
}
#: Longest ``unique_key`` a message may name.
MAX_UNIQUE_KEY_CHARS = 1000
#: Options that are true or false.
BOOLEAN_OPTIONS = frozenset({"store_results", "pipe_ignore", "notify_shutdown"})
#: Largest number an option may hold: ten years of milliseconds, and below ``int4``'s
#: ceiling for ``priority``.
MAX_OPTION_VALUE = 10 * 366 * 86_400_000
#: Deepest nesting of objects and lists a value may have (messages' arguments, events' payloads).
MAX_JSON_DEPTH = 32
#: In JSON text (ASCII, as Dramatiq's encoder writes it), what may be a value Postgres
#: refuses: NaN or an infinity, a ``\u0000``, a surrogate. Only options whose text holds
#: one of these are walked, to clear it (a string may hold those letters).
_SUSPECT = re.compile(r"NaN|Infinity|\\u0000|\\ud[89a-f]")
#: A surrogate code point in a Python text: a lone one (a pair is one character).
_SURROGATE = re.compile("[\ud800-\udfff]")


def _bad_text(text: str) -> str | None:
    if "\x00" in text:
        return "a \\u0000 (NUL) character, which Postgres cannot store"
    if not text.isascii() and any("\ud800" <= c <= "\udfff" for c in text):
        return "a lone surrogate (not valid Unicode)"
    return None


def check_json_value(value: Any, *, what: str, error: type[Exception] = InvalidMessage) -> None:
    """Refuse, with ``error`` naming ``what`` and where, a value Postgres' jsonb would
    refuse (in a caller's transaction, aborting it) or JSON cannot express: NaN or an
    infinity, a ``\\u0000``, a lone surrogate, a non-string key, an object that is not
    JSON, or nesting deeper than MAX_JSON_DEPTH. The one check of everything written as
    JSON: events (``emit``), messages (sends, ``enqueue``, ``enqueue_many``). Walks
    iteratively: depth cannot blow the stack. A first walk only looks; the path of what it
    found is spelt out by a second (a send pays no text per value)."""
    if _storable_json(value):
        return
    stack: list[tuple[Any, int, str]] = [(value, 1, "$")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > MAX_JSON_DEPTH:
                raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(item, dict):
                for key, inner in item.items():
                    if not isinstance(key, str):
                        raise error(f"{what} has a non-string key at {path}")
                    bad = _bad_text(key)
                    if bad:
                        raise error(f"a key of {what} at {path} holds {bad}")
                    stack.append((inner, depth + 1, f"{path}.{key[:40]}"))
            else:
                stack.extend((inner, depth + 1, f"{path}[{n}]") for n, inner in enumerate(item))
        elif isinstance(item, str):
            bad = _bad_text(item)
            if bad:
                raise error(f"{what} holds {bad} at {path}")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise error(f"{what} holds {item!r} at {path}, which JSON cannot express")
        elif item is not None and not isinstance(item, bool | int):
            raise error(f"{what} holds a {type(item).__name__} at {path}, not JSON")


def _storable_json(value: Any) -> bool:
    """Whether :func:`check_json_value` would let ``value`` pass: the same rules, no paths."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is str:
            if "\x00" in item or (not item.isascii() and _SURROGATE.search(item)):
                return False
        elif kind is int or kind is bool or item is None:
            continue
        elif kind is float:
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            if depth > MAX_JSON_DEPTH:
                return False
            for key, inner in item.items():
                if type(key) is not str or "\x00" in key or (not key.isascii() and _SURROGATE.search(key)):
                    return False
                stack.append((inner, depth + 1))
        elif isinstance(item, list | tuple):
            if depth > MAX_JSON_DEPTH:
                return False
            stack.extend((inner, depth + 1) for inner in item)
        else:
            return False  # a str, int or float subclass, or not JSON: the careful walk decides
    return True


def check_options(message: Message | MessageProxy) -> None:
    """Refuse a message whose Dramatiq options hold a value its run could not use
    (``max_retries='3'``, a negative ``time_limit``…), naming the option and the value."""
    options = message.options
    for name in options.keys() & NUMERIC_OPTIONS.keys():
        value = options[name]
        if name in ("max_retries", "priority", "delay") and value is None:
            continue  # no cap on retries; the actor's priority; no delay
        minimum, whole = NUMERIC_OPTIONS[name]
        kind = "a whole number" if whole else "a number"
        if (isinstance(value, bool) or not isinstance(value, int | float) or (whole and not isinstance(value, int))
                or not math.isfinite(value) or not minimum <= value <= MAX_OPTION_VALUE):
            raise InvalidMessage(f"option {name}={value!r} of a message to {message.actor_name!r} is not "
                                 f"{kind} from {minimum:g} to {MAX_OPTION_VALUE}")
    for name in options.keys() & BOOLEAN_OPTIONS:
        if not isinstance(options[name], bool):
            raise InvalidMessage(f"option {name}={options[name]!r} of a message to {message.actor_name!r} "
                                 "is not true or false")
    key = options.get("unique_key")
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_UNIQUE_KEY_CHARS):
        raise InvalidMessage(f"option unique_key={_short.repr(key)} of a message to {message.actor_name!r} is not "
                             f"a text of 1 to {MAX_UNIQUE_KEY_CHARS} characters")


def delay_seconds(delay: Any) -> float:
    """A send's ``delay`` (milliseconds, or None) in seconds; a clear error if it is not one."""
    if delay is None:
        return 0.0
    if (isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay)
            or not 0 <= delay <= MAX_OPTION_VALUE):
        raise InvalidMessage(f"delay={delay!r} is not a number of milliseconds from 0 to {MAX_OPTION_VALUE}")
    return delay / 1000.0


def check_message(message: Message) -> None:
    """Refuse a message whose options its run cannot use (:func:`check_options`) or whose
    arguments or options are not JSON Postgres stores (:func:`check_json_value`, as
    ``emit`` checks an event), naming the value and where it is."""
    check_options(message)
    if _storable_json((message.args, message.kwargs, message.options)):
        return
    for part, value in (("arguments", message.args), ("keyword arguments", message.kwargs),
                        ("options", message.options)):
        check_json_value(value, what=f"the {part} of a message to {message.actor_name!r}")


def check_encoded_size(size: int, actor_name: str, max_bytes: int) -> None:
    """:class:`MessageTooLarge`, naming the size and the limit, for a message to
    ``actor_name`` of ``size`` bytes encoded over ``max_bytes``."""
    if size > max_bytes:
        raise MessageTooLarge(
            f"the message to {actor_name!r} is {size} bytes encoded, over the limit of {max_bytes} "
            "(STANDMEET_MESSAGE_MAX_BYTES); store large data in a table and send its id")


def _check_size(size: int, message: Message, max_bytes: int) -> None:
    check_encoded_size(size, message.actor_name, max_bytes)


def default_max_bytes() -> int:
    """STANDMEET_MESSAGE_MAX_BYTES of the configured broker (1 MiB without one)."""
    current = dramatiq.broker.global_broker
    return current.settings.message_max_bytes if isinstance(current, StandmeetBroker) else MIB


def checked_json(message: Message | MessageProxy, *, max_bytes: int | None = None) -> str:
    """The message's JSON text, once it is known to be one Postgres stores and no larger
    than ``max_bytes`` (default: :func:`default_max_bytes`); :class:`InvalidMessage` or
    :class:`MessageTooLarge` otherwise, before anything is written."""
    plain = as_message(message)
    check_message(plain)
    text = message_json(plain)
    limit = default_max_bytes() if max_bytes is None else max_bytes
    _check_size(len(text) if text.isascii() else len(text.encode("utf-8")), plain, limit)
    return text


def claim_size_params(max_bytes: int) -> dict[str, int]:
    """What :data:`broker.engine.sql.CLAIM` refuses: a row whose text, as Postgres writes it (a
    space after each ``,`` and ``:``, so up to 1.5 times the compact text a send measured),
    is over 1.5 × ``max_bytes``: never one a send accepted. A row whose stored size is
    below a sixth of that is not measured."""
    claim_max = max_bytes * 3 // 2
    return {"claim_max_bytes": claim_max, "claim_cheap_bytes": (claim_max - 64) // 6}


#: Options as the settle writes them: what jsonb refuses raises (NaN, an infinity).
_strict_json = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def options_json(message: Message | MessageProxy) -> str | None:
    """The message's options as JSON Postgres stores (a NUL or a lone surrogate in a text,
    such as an exception's message in a traceback, replaced by U+FFFD); None when a
    middleware left in them what JSON cannot hold."""
    try:
        text = _strict_json(message.options)
    except (TypeError, ValueError, RecursionError):
        logger.error("message %s: its options cannot be stored as JSON; they are kept as claimed",
                     message.message_id)
        return None
    if _SUSPECT.search(text) is not None:
        return _strict_json(_storable(json.loads(text)))
    return text


def _storable(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value


def storable_text(text: str) -> str:
    """``text`` as Postgres stores it: a NUL or a lone surrogate becomes U+FFFD."""
    text = text.replace("\x00", "\ufffd")
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


#: Dramatiq prints a message as its call; each value shown is cut while it is written, so
#: a megabyte of arguments is never turned into text to be logged.
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 120
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 8
_short.maxlevel = 3


def logged_call(message: Message) -> str:
    """``actor(args…)`` as Dramatiq prints a message, cut to MAX_LOGGED_CALL_CHARS."""
    shown: list[str] = []
    length = 0
    values = itertools.chain(map(_short.repr, message.args),
                             (f"{k}={_short.repr(v)}" for k, v in message.kwargs.items()))
    for text in values:
        shown.append(text)
        length += len(text) + 2
        if length > MAX_LOGGED_CALL_CHARS:
            break
    call = f"{message.actor_name}({', '.join(shown)})"
    if len(call) > MAX_LOGGED_CALL_CHARS:
        call = f"{call[:MAX_LOGGED_CALL_CHARS]}… ({len(message.args)} args, {len(message.kwargs)} kwargs)"
    return call


def rejection_reason(message: MessageProxy) -> str:
    """Why a message is rejected, kept on its row: never the bare word 'failed'."""
    reason = message.options.get("error")
    if not reason:
        exc = getattr(message, "_exception", None)
        traceback_text = message.options.get("traceback")
        if traceback_text:
            reason = traceback_text
        elif exc is not None:
            reason = f"{type(exc).__name__}: {exc}"
    return storable_text(str(reason or "rejected by a middleware, with no reason given")[-MAX_ERROR_CHARS:])


def timed_out(exception: BaseException | None) -> bool:
    """Whether a run failed because its time limit passed (Dramatiq's asynchronous
    exception, the deadline's own check, or Postgres' statement timeout that enforces it)."""
    if exception is None:
        return False
    if isinstance(exception, (TimeLimitExceeded, DeadlineExceeded)):
        return True
    return isinstance(exception, psycopg.errors.QueryCanceled) and "statement timeout" in str(exception)


def ran_as(exception: BaseException | None) -> str:
    """What a run that is to run again was: interrupted (its process stepped down), snoozed
    (it asked to run later), timeout, or failed."""
    if isinstance(exception, CutOff):
        return "interrupted"
    if isinstance(exception, Deferred):
        return "snoozed"
    return "timeout" if timed_out(exception) else "failed"


def attempt_error(message: MessageProxy, exception: BaseException | None, attempt: str) -> str | None:
    """The error of one run that runs again, as its attempt keeps it: the traceback the
    retry recorded for this run, else the exception; cut to its last ATTEMPT_ERROR_CHARS."""
    if exception is None:
        return None
    text = message.options.get("traceback") if attempt in ("failed", "timeout") else None
    if not isinstance(text, str) or type(exception).__name__ not in text:  # none, or an earlier run's
        text = f"{type(exception).__name__}: {exception}"
    return storable_text(str(text)[-sql.ATTEMPT_ERROR_CHARS:])


def enqueue_params(messages: Iterable[Message | MessageProxy], delay: int | None = None, *,
                   max_bytes: int | None = None) -> dict[str, Any]:
    """Parameters of :data:`broker.engine.sql.ENQUEUE` for ``messages``, due after ``delay`` ms;
    :class:`InvalidMessage` or :class:`MessageTooLarge` (naming the message) for a batch
    holding one Postgres would refuse or one over ``max_bytes`` (default:
    :func:`default_max_bytes`), before anything is written."""
    batch = [as_message(m) for m in messages]
    delay_s = delay_seconds(delay)
    for m in batch:
        check_message(m)
    limit = default_max_bytes() if max_bytes is None else max_bytes
    priorities = [str(message_priority(m)) for m in batch]
    if all(_encoded_as_dramatiq_would(m) for m in batch):
        # one encoder call for the whole array: the same text as joining each message's
        # (a third less time for a batch of thousands)
        array = compact_json([_fields(m) for m in batch])
        if len(array) > limit:  # one of them may be too large: each one's text ends at its id
            _check_sizes(array, batch, limit)
    else:
        array = f"[{','.join(checked_json(m, max_bytes=limit) for m in batch)}]"
    return _array_params(array, priorities, delay_s=delay_s)


def _check_sizes(array: str, batch: Sequence[Message], max_bytes: int) -> None:
    """Each message's size in the JSON ``array`` of ``batch`` (ASCII, in order): the distance
    from the end of one message's id to the end of the next's (its last field but one)."""
    start = 0
    for m in batch:
        marker = f'"message_id":"{m.message_id}"'
        end = array.find(marker, start)
        if end < 0:  # not where it should be: measure it alone
            _check_size(len(message_json(m)), m, max_bytes)
            continue
        end += len(marker)
        _check_size(end - start, m, max_bytes)
        start = end


def batch_params(texts: Sequence[str], priorities: Sequence[str], *, delay_s: float = 0.0) -> dict[str, Any]:
    """Parameters of :data:`broker.engine.sql.ENQUEUE` for messages already encoded: their JSON
    texts and priorities (as decimal text), in order, all due after ``delay_s``."""
    return _array_params(f"[{','.join(texts)}]", priorities, delay_s=delay_s)


def _array_params(array: str, priorities: Sequence[str], *, delay_s: float) -> dict[str, Any]:
    return {"messages": array, "priorities": f"{{{','.join(priorities)}}}", "delay_s": delay_s}


def enqueue_one_params(message: Message | MessageProxy, delay: int | None = None, *,
                       max_bytes: int | None = None) -> dict[str, Any]:
    """Parameters of :data:`broker.engine.sql.ENQUEUE_ONE` for ``message``, due after ``delay`` ms;
    refused as :func:`checked_json` says, before anything is written."""
    delay_s = delay_seconds(delay)
    return {"queue": message.queue_name, "message_id": message.message_id,
            "message": checked_json(message, max_bytes=max_bytes),
            "delay_s": delay_s, "priority": message_priority(message)}


# -- unique jobs (migration 0021) -----------------------------------------------------

#: Bits of ``unique_states``: the states in which a message holds its unique key.
UNIQUE_QUEUED, UNIQUE_RUNNING, UNIQUE_DONE = 1, 2, 4
#: How many times a send looks again for a key whose holder finished between its insert
#: and its look-up (each time, a holder finished and the key was free again).
UNIQUE_ATTEMPTS = 10


@dataclass(frozen=True)
class UniqueBy:
    """An actor's uniqueness, ``@dramatiq.actor(unique=UniqueBy(...))`` (``unique=True`` is
    ``UniqueBy()``): a send is skipped, and returns the live message, while a message of
    this actor with the same key is queued (delayed ones too: a delayed message is a
    queued one due later) or running; with ``period_s``, also done within the period.

    ``args``: the key is the actor and its arguments (args and kwargs, canonical JSON,
    hashed); False: the actor alone (one live message per actor). ``period_s``: the key
    also holds the start of the period (by the database's clock) the send falls in, so a
    new period is a new key, and a message done in this period still holds it.
    A message's own ``unique_key`` option (any text) replaces the arguments in its key,
    and its ``unique_period_s`` option the period."""

    args: bool = True
    period_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.args, bool):
            raise ConfigError(f"UniqueBy(args={self.args!r}) is not true or false")
        period = self.period_s
        if period is not None and (isinstance(period, bool) or not isinstance(period, int | float)
                                   or not math.isfinite(period) or not 1 <= period <= MAX_OPTION_VALUE):
            raise ConfigError(f"UniqueBy(period_s={period!r}) is not a number of seconds from 1 to "
                              f"{MAX_OPTION_VALUE}")


@dataclass(frozen=True)
class UniqueKey:
    """What a send writes in ``unique_key`` and ``unique_states``: the key's digest, the
    period (seconds; the database adds the period's start) and the covered states."""

    digest: bytes
    period_s: float | None

    @property
    def states(self) -> int:
        return UNIQUE_QUEUED | UNIQUE_RUNNING | (UNIQUE_DONE if self.period_s is not None else 0)


def unique_of(actor: Any) -> UniqueBy | None:
    """The actor's ``unique`` option as a :class:`UniqueBy` (None: not unique);
    :class:`ConfigError` for a value that is neither true, false nor a UniqueBy."""
    option = actor.options.get("unique") if actor is not None else None
    if option is None or option is False:
        return None
    if option is True:
        return UniqueBy()
    if isinstance(option, UniqueBy):
        return option
    raise ConfigError(f"actor {actor.actor_name!r}: unique={option!r} is not true, false or a UniqueBy")


def _digest(parts: list[Any]) -> bytes:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def unique_key_for(actor_name: str, by: UniqueBy | None, args: Any, kwargs: Any,
                   options: dict[str, Any]) -> UniqueKey | None:
    """The unique key of a message to ``actor_name`` with these arguments and options
    (None: it has none): its ``unique_key`` option, else the actor's :class:`UniqueBy`.
    A key is the actor's own: the same ``unique_key`` on two actors is two keys."""
    given = options.get("unique_key")
    period = options.get("unique_period_s")
    if given is None and by is None and period is None:
        return None
    if given is not None:
        parts: list[Any] = [actor_name, "key", given]
    elif by is None or by.args:
        parts = [actor_name, "args", list(args), kwargs or {}]
    else:
        parts = [actor_name, "actor"]
    if period is None and by is not None:
        period = by.period_s
    return UniqueKey(_digest(parts), None if period is None else float(period))


def unique_key_of(message: Message | MessageProxy, broker: Any = None) -> UniqueKey | None:
    """The unique key of ``message`` (None for a message without one: the common case,
    two dictionary look-ups)."""
    options = message.options
    current = broker if broker is not None else dramatiq.broker.global_broker
    actor = current.actors.get(message.actor_name) if current is not None else None
    by = unique_of(actor) if actor is not None and "unique" in actor.options else None
    if by is None and "unique_key" not in options and "unique_period_s" not in options:
        return None
    return unique_key_for(message.actor_name, by, message.args, message.kwargs, options)


@dataclass(frozen=True)
class UniqueItem:
    """A message to write under its unique key: its id, queue, actor, JSON text and priority."""

    message_id: str
    queue_name: str
    actor_name: str
    text: str
    priority: str
    key: UniqueKey


@dataclass
class UniqueOutcome:
    """What a unique write did: for each item, the text of the live message that holds its
    key when the item was skipped for it (None: written, or its own id was there already),
    and the skips per (queue, actor)."""

    live: list[str | None]
    skipped: dict[tuple[str, str], int]


#: One step of a unique write: a statement and its parameters; the driver sends back its rows.
Step = tuple[str, dict[str, Any]]


def unique_item(message: Message | MessageProxy, key: UniqueKey, *, max_bytes: int | None = None) -> UniqueItem:
    """The :class:`UniqueItem` of a message, checked as every send is (:func:`checked_json`)."""
    return UniqueItem(message.message_id, message.queue_name, message.actor_name,
                      checked_json(message, max_bytes=max_bytes), str(message_priority(message)), key)


def unique_write(items: Sequence[UniqueItem], delay_s: float = 0.0) -> Generator[Step, list[Any], UniqueOutcome]:
    """The statements that write ``items``, one at a time (a generator: the sync and the
    async drivers, :func:`run_steps` and ``broker.engine.enqueue.run_steps_async``, send each
    one's rows back). INSERT … ON CONFLICT DO NOTHING (:data:`broker.engine.sql.ENQUEUE_UNIQUE`),
    then, in a new statement that sees what concurrent senders committed, the holder of
    each key not written (:data:`broker.engine.sql.UNIQUE_LIVE`); a key whose holder finished in
    between is written again, at most UNIQUE_ATTEMPTS times."""
    live: list[str | None] = [None] * len(items)
    skipped: dict[tuple[str, str], int] = {}
    todo = list(range(len(items)))
    for _ in range(UNIQUE_ATTEMPTS):
        batch = [items[i] for i in todo]
        rows = yield sql.ENQUEUE_UNIQUE, {
            **batch_params([it.text for it in batch], [it.priority for it in batch], delay_s=delay_s),
            **_unique_arrays(batch)}
        written = {row[0] for row in rows}
        rest = [i for i in todo if items[i].message_id not in written]
        if not rest:
            break
        looked = [items[i] for i in rest]
        rows = yield sql.UNIQUE_LIVE, {"ids": [it.message_id for it in looked], **_unique_arrays(looked)}
        todo = []
        for n, live_id, live_text, own_exists in rows:
            i = rest[n - 1]
            if live_id == items[i].message_id:
                continue  # it holds its own key: sent again with its own id
            if live_id is not None:
                live[i] = live_text
                where = (items[i].queue_name, items[i].actor_name)
                skipped[where] = skipped.get(where, 0) + 1
            elif not own_exists:
                todo.append(i)  # its key's holder finished in between: the key is free
            # else: its id exists, finished: left as it was, as ENQUEUE leaves one
        if not todo:
            break
    else:
        raise DatabaseError(f"could not write {len(todo)} unique message(s): their keys' holders kept "
                            f"finishing between {UNIQUE_ATTEMPTS} inserts and look-ups")
    return UniqueOutcome(live, skipped)


def _unique_arrays(items: Sequence[UniqueItem]) -> dict[str, Any]:
    return {"unique_keys": [it.key.digest for it in items],
            "unique_periods": [it.key.period_s for it in items],
            "unique_states": [it.key.states for it in items]}


def run_steps(conn: psycopg.Connection[Any], steps: Generator[Step, list[Any], UniqueOutcome]) -> UniqueOutcome:
    """Run a unique write's statements on ``conn`` (in its transaction, if one is open)."""
    try:
        step = next(steps)
        while True:
            cur = conn.execute(*step)
            step = steps.send(cur.fetchall())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


def live_messages(messages: Sequence[Message], outcome: UniqueOutcome) -> list[Message]:
    """``messages``, each skipped one replaced by the live message that holds its key."""
    return [m if text is None else Message.decode(text.encode("utf-8"))
            for m, text in zip(messages, outcome.live, strict=True)]


#: Told the skips of each write that skipped ({(queue, actor): n}): ``broker.observability.metrics``
#: adds its counter here when it is imported (it imports this module, not the reverse).
SKIP_COUNTERS: list[Callable[[dict[tuple[str, str], int]], None]] = []
#: What may keep a skip count from being written (the database refused it, or is away).
_COUNT_FAILURES: tuple[type[BaseException], ...] = (psycopg.Error, *DISCONNECTS)


def count_skips(skipped: dict[tuple[str, str], int], broker: StandmeetBroker | None = None) -> None:
    """Count skipped sends: ``standmeet_unique_skipped_total{queue,actor}`` in this process,
    and ``standmeet.unique_skips`` on the broker's own autocommit connection (never the
    caller's transaction: its row lock would be held until that ends). A count that
    cannot be written is logged, never raised: the send itself succeeded."""
    if not skipped:
        return
    for counter in SKIP_COUNTERS:
        counter(skipped)
    keys = sorted(skipped)
    try:
        (broker or services.current_broker()).execute(sql.UNIQUE_SKIPPED, {
            "queues": [k[0] for k in keys], "actors": [k[1] for k in keys], "counts": [skipped[k] for k in keys]})
    except _COUNT_FAILURES as exc:
        logger.warning("could not record %d skipped unique send(s): %s", sum(skipped.values()), exc)


def split_unique(messages: Sequence[Message], broker: Any = None) -> tuple[list[int], list[UniqueKey | None]]:
    """The places of the messages that carry a unique key, and every message's key."""
    keys = [unique_key_of(m, broker) for m in messages]
    return [i for i, k in enumerate(keys) if k is not None], keys


def refuse_non_json_encoder() -> None:
    """Messages live in a ``jsonb`` column: an encoder that does not write JSON is refused."""
    encoder = dramatiq.get_encoder()
    if not isinstance(encoder, dramatiq.JSONEncoder):
        raise ConfigError(
            f"the message encoder is {type(encoder).__name__}, but this broker stores messages as JSON "
            "(dramatiq-pg's jsonb column): use dramatiq.JSONEncoder or a subclass of it"
        )
