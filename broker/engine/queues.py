"""What one process holds of each queue: its claims (running, prefetched, being given
back) and the counts that bound them (see :class:`QueueState`)."""

from __future__ import annotations

import os
import threading
import time
from collections import deque
from collections.abc import Collection, Iterable
from typing import Any

from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from broker.engine.codec import check_actor_options
from broker.errors import ConfigError
from broker.settings import PREFETCH_HOLD_S, PREFETCH_HORIZON_S, QueueSettings, Settings

#: Weight of the latest run in a queue's mean run time.
RUN_TIME_WEIGHT = 0.1


class Claim:
    """One claim of a message by this process: (message id, claim number), its ``key``,
    made once (it is read at every step of the claim: held, handed out, ended)."""

    __slots__ = ("message", "number", "started", "claimed_at", "key")

    def __init__(self, message: Message, number: int, started: bool, claimed_at: float | None = None) -> None:
        self.message = message
        self.number = number
        self.started = started
        #: when it was claimed (wall clock, for the claim-to-start metric)
        self.claimed_at = time.time() if claimed_at is None else claimed_at
        self.key: tuple[str, int] = (message.message_id, number)

    def __repr__(self) -> str:
        return f"Claim({self.key[0]}, {self.number}, started={self.started})"


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
        #: held while a claim of the queue is made and its claims are held here, and while
        #: what the database says this process holds of it is checked against what it knows
        #: (:meth:`broker.engine.liveness.Liveness.give_back_unknown`): never a claim
        #: committed in the database but not yet known here
        self.claim_lock = threading.Lock()
        #: claims whose run has ended and whose outcome is not yet handed to the settler
        #: (:meth:`finished` to :meth:`submitted`): known neither as running nor as an
        #: outcome to write for that moment, yet this process's
        self.ending: set[tuple[str, int]] = set()
        #: how many times a consumer's claim connection of the queue failed, and how many of
        #: those a check has covered: a claim may have committed with its answer lost, so
        #: what the database says this process holds of the queue is checked on the next
        #: connection of whichever consumer of the queue, before it claims
        self.doubts = 0
        self.doubts_checked = 0
        #: when the last of those failures was seen (monotonic)
        self.doubted_at = 0.0
        #: when what this process holds of the queue is to be checked again (monotonic):
        #: a claim left running on a server session that could not be ended may commit
        #: until the claim window after the failure has passed (sql.CLAIM_WITHIN_S)
        self.recheck_at: float | None = None
        self.in_flight: set[tuple[str, int]] = set()
        self.running: set[tuple[str, int]] = set()
        self.buffer: deque[Claim] = deque()
        #: claims taken from the buffer to give back, until the give-back is written
        self.returning: list[Claim] = []
        #: the consumer sleeps on the wake pipe (set and read under ``lock``); whoever
        #: wakes it clears this, so that a sleep costs one pipe write however many runs
        #: end before the consumer is back (each sets ``freed``, which it reads then)
        self.waiting = False
        #: a running job ended (or outcomes were written) since the consumer last looked
        self.freed = False
        #: a notification for the queue (or a reason as good: this process claims again)
        #: reached the process since its consumer last looked: look for due messages now
        self.told = False
        #: runs that ended whose outcome the settler has not written yet: their rows
        #: are still ``consumed`` in the database, so they count against the claims
        #: beyond a slack of one more ``limit`` and one claim batch (:meth:`_free`)
        self.unsettled = 0
        #: when each running claim was handed to the worker, and the mean run time since
        #: (exponentially weighted), which sizes the default prefetch
        self._handed_at: dict[tuple[str, int], float] = {}
        self.mean_run_s: float | None = None
        #: what the (frozen) settings derive, read at every run's end: worked out again
        #: only when other settings take their place
        self._derived_from: QueueSettings | None = None
        self._adaptive = False
        self._prefetch_bounds = (0, 0)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    def _free(self) -> int:
        # The slack lets the settler be a claim batch behind without holding up the next
        # claim: with a slack of one limit alone, a drain of short jobs claimed only once
        # the outcomes of the last batch were written, and the worker threads ran dry
        # during each settle and claim round trip (nearly half the time, with nothing to run).
        return (self.limit + self.prefetch - len(self.in_flight)
                - max(0, self.unsettled - self.limit - self.claim_batch))

    def free(self) -> int:
        """How many more messages this process may claim now: its rows ``consumed`` in the
        database never exceed ``2 × limit`` + the prefetch + a claim batch (half the
        prefetch, at least one; finished ones included), however far the settler is behind."""
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
        self.hold_all([claim])

    def hold_all(self, claims: Iterable[Claim]) -> None:
        """Claims just made, in the order they start: buffered, under one lock."""
        with self.lock:
            for claim in claims:
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
        settings = self.settings
        if settings is not self._derived_from:
            self._derived_from = settings
            self._adaptive = settings.adaptive_prefetch
            self._prefetch_bounds = (settings.prefetch_floor, settings.prefetch_ceiling)
        if handed is None or not self._adaptive:
            return
        run_s = time.monotonic() - handed
        mean = run_s if self.mean_run_s is None else self.mean_run_s + RUN_TIME_WEIGHT * (run_s - self.mean_run_s)
        self.mean_run_s = mean
        wanted = self.limit * PREFETCH_HORIZON_S / max(mean, 1e-6)
        floor, ceiling = self._prefetch_bounds
        self.prefetch = int(min(ceiling, max(floor, wanted)))

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

    def prefetched_ids(self) -> list[str]:
        """The message ids of the claims buffered here, not started."""
        with self.lock:
            return [claim.message.message_id for claim in self.buffer]

    def give_back_buffered_of(self, message_ids: Collection[str]) -> int:
        """Take the buffered claims of ``message_ids`` out of the buffer, never to start
        here: the consumer gives them back (:meth:`take_excess`). How many were taken."""
        with self.lock:
            going = [claim for claim in self.buffer if claim.message.message_id in message_ids]
            if going:
                self.buffer = deque(claim for claim in self.buffer if claim.message.message_id not in message_ids)
                self.returning.extend(going)
        return len(going)

    def give_back_later(self, claims: Iterable[Claim]) -> None:
        """Claims whose give-back failed: offered again by :meth:`take_excess`, never started."""
        with self.lock:
            self.returning.extend(claims)

    def held(self) -> list[tuple[str, int]]:
        """Every claim this process holds of the queue: running, buffered or being given back."""
        with self.lock:
            return [*self.in_flight, *(c.key for c in self.returning if c.key not in self.in_flight)]

    def known(self) -> set[tuple[str, int]]:
        """Every claim of the queue this process holds (:meth:`held`), or whose run has
        ended with its outcome not yet handed to the settler: read before the settler's
        pending outcomes, a claim is in one or the other until its outcome is written."""
        with self.lock:
            return {*self.in_flight, *(c.key for c in self.returning), *self.ending}

    def doubt(self) -> None:
        """A claim connection of the queue failed: what this process holds is checked."""
        with self.lock:
            self.doubts += 1
            self.doubted_at = time.monotonic()

    def in_doubt(self) -> int | None:
        """The failures not yet covered by a check (pass it to :meth:`checked`), or None."""
        with self.lock:
            return self.doubts if self.doubts != self.doubts_checked else None

    def checked(self, doubts: int, *, again_after_s: float | None = None) -> None:
        """A check made after ``doubts`` failures has ended: those are covered, but for a
        claim that may still commit on a server session the check could not end, until
        ``again_after_s`` after the last failure: then the check is made again (:meth:`recheck_due`)."""
        with self.lock:
            self.doubts_checked = max(self.doubts_checked, doubts)
            if again_after_s is not None:
                at = self.doubted_at + again_after_s
                self.recheck_at = at if self.recheck_at is None else max(self.recheck_at, at)

    def recheck_due(self) -> bool:
        """Whether the check made again is due now (it is then no longer pending: a failure
        while it is made is a new doubt)."""
        at = self.recheck_at
        if at is None or time.monotonic() < at:
            return False
        with self.lock:
            if self.recheck_at != at:
                return False
            self.recheck_at = None
        return True

    def submitted(self, key: tuple[str, int]) -> None:
        """The outcome of a run that ended (:meth:`finished`) is the settler's now (or its
        hand-over failed: the claim is then no longer known here, and given back)."""
        # One operation on a set, whole under the interpreter lock: no lock taken per run.
        # (Anything that iterates ``ending`` must copy it in one operation, as ``known``
        # does: a loop over it in Python would meet a discard from another thread.)
        self.ending.discard(key)

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
            self.ending.add(key)
            self._ran(key)
            self.unsettled += 1
            claim = None
            if hand_off and self.buffer and len(self.running) < self.limit:
                claim = self._take_next()
                free = self._free()
                if free <= 0 or (free < self.claim_batch and len(self.running) + len(self.buffer) >= self.limit):
                    return claim  # nothing for the consumer to do yet
            self.freed = True
            sleeping, self.waiting = self.waiting, False
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
            sleeping, self.waiting = self.waiting, False
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

    def notified(self) -> None:
        """Messages of the queue may be due (a notification the process's listener heard,
        or the process claiming again): its consumer looks for them at once, not only
        for room."""
        with self.lock:
            self.told = True
        self.wake()

    def take_told(self) -> bool:
        """Whether :meth:`notified` was called since the last time this was asked."""
        with self.lock:
            told, self.told = self.told, False
            return told

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


def claim_of(message: Message | MessageProxy) -> int | None:
    """The claim number our consumer attached to this message, if it claimed it."""
    return getattr(message, "standmeet_claim", None) if isinstance(message, MessageProxy) else None


#: Channel a consumer of queue Q listens on; a NOTIFY on it means "look again".
ENQUEUE_CHANNEL = "dramatiq.{queue}.enqueue"
#: Channel a final settle on an awaited queue notifies, with '<message id>:<state>'.
RECEIPT_CHANNEL = "standmeet_receipts_{queue}"
#: Postgres's longest channel name, in bytes (NAMEDATALEN - 1): a NOTIFY on a longer one fails.
MAX_CHANNEL_BYTES = 63


def check_queue_name(queue_name: Any) -> None:
    """Refuse a queue whose name its channels could not carry (Dramatiq's actors already
    refuse names that are not letters, digits, ``.``, ``-`` and ``_``), naming the limit."""
    if type(queue_name) is not str or not queue_name or "\x00" in queue_name:
        raise ConfigError(f"queue name {queue_name!r} is not a text of letters, digits, '.', '-' and '_'")
    longest = max(len(channel.format(queue=queue_name).encode()) for channel in (ENQUEUE_CHANNEL, RECEIPT_CHANNEL))
    if longest > MAX_CHANNEL_BYTES:
        limit = len(queue_name.encode()) - (longest - MAX_CHANNEL_BYTES)
        raise ConfigError(f"queue name {queue_name[:80]!r} is {len(queue_name.encode())} bytes long; at most {limit} "
                          f"(its Postgres notification channels are {MAX_CHANNEL_BYTES} bytes at most)")


class DeclaredQueues:
    """How this runtime's brokers (the Postgres one and the memory one) declare queues:
    each with its settings (``STANDMEET_QUEUE_<NAME>_*`` over what ``broker.app`` declared),
    and no delay queues (a delayed message is a queued one due later). A broker mixes this
    in before ``dramatiq.Broker`` and says what a declared queue is (:meth:`new_queue`)."""

    settings: Settings
    queues: dict[str, Any]

    def new_queue(self, queue_name: str, settings: QueueSettings) -> Any:
        """What the broker keeps for a queue it declares (it has a ``settings``)."""
        raise NotImplementedError

    def declare_actor(self, actor: Any) -> None:
        """An actor whose options its runs could not use is refused as it is declared
        (:func:`broker.engine.codec.check_actor_options`)."""
        check_actor_options(actor.actor_name, actor.options)
        super().declare_actor(actor)  # type: ignore[misc]

    def declare_queue(self, queue_name: str) -> None:
        if queue_name not in self.queues:
            check_queue_name(queue_name)
            self.emit_before("declare_queue", queue_name)  # type: ignore[attr-defined]
            self.queues[queue_name] = self.new_queue(queue_name, self.settings.queue(queue_name))
            self.emit_after("declare_queue", queue_name)  # type: ignore[attr-defined]

    def queue_settings(self, queue_name: str) -> QueueSettings:
        queue = self.queues.get(queue_name)
        return queue.settings if queue is not None else self.settings.queue(queue_name)  # type: ignore[no-any-return]

    def get_declared_queues(self) -> set[str]:
        return set(self.queues)

    def get_declared_delay_queues(self) -> set[str]:
        return set()
