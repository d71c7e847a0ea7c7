"""The settle path: how a run ended (:class:`Outcome`), and the one writer of outcomes
(:class:`Settler`), which batches them, retries through outages and never drops one.

The settler knows nothing of the broker: it is given a way to open a connection that has
proved this process alive, the process's worker id and outage, and a callback told how
many outcomes of a queue it wrote (which frees room to claim)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.broker import MessageProxy
from dramatiq.message import Message
from dramatiq.middleware.time_limit import TimeLimitExceeded

from broker import app, detach
from broker.backoff import Backoff
from broker.engine import sql, sql_history
from broker.engine.codec import followup_params, storable_text
from broker.errors import CutOff, DatabaseUnavailable, DeadlineExceeded, Deferred
from broker.pg.long_statement import LongStatement
from broker.pg.pool import Outage, close_quietly
from broker.pg.preflight import first_line

if TYPE_CHECKING:
    from broker.engine.unique import UniqueKey

#: What the database refuses a settle for because of what one of its rows holds (a unique
#: or check violation, a value out of range): the batch is written again one outcome at a
#: time, and the one refused alone is set aside (:meth:`Settler.settle_apart`). Not a schema
#: that does not match (every outcome would be refused: they are kept and written again).
REFUSED_BY_A_ROW: tuple[type[BaseException], ...] = (psycopg.errors.IntegrityError, psycopg.errors.DataError)

#: A message a run sent from its after-hooks (a pipeline's next step, a callback): written
#: with the run's settle, after its delay in seconds, holding its unique key if it has one
#: and no live message holds it (a pipeline is never cut: held, it is written without).
Followup = tuple[Message, float, "UniqueKey | None"]

logger = logging.getLogger("standmeet.broker")

#: The two settles, longer than psycopg caches: converted once (:mod:`broker.pg.long_statement`).
_SETTLE_DONE = LongStatement(sql.SETTLE_DONE)
_SETTLE = LongStatement(sql.SETTLE)

#: How often an idle settler wakes to tell its batch listeners (seconds).
IDLE_TICK_S = 0.5


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
    followups: list[Followup] = field(default_factory=list)
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
    followups: list[Followup] = field(default_factory=list)
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

    def __init__(self, *, worker_id: str, connect: Callable[[], psycopg.Connection[Any]], outage: Outage,
                 max_runs_without_outcome: int, on_settled: Callable[[str, int], None]) -> None:
        """``connect`` opens a connection on which this process has proved it lives;
        ``on_settled(queue, n)`` is told each time ``n`` outcomes of ``queue`` are written."""
        self.worker_id = worker_id
        self._connect = connect
        self.outage = outage
        self.max_runs_without_outcome = max_runs_without_outcome
        self._on_settled = on_settled
        #: set on close once the settler gave up waiting for the database
        self.abandoned = False
        #: the condition's lock, taken directly where a worker thread hands work over (a
        #: ``with`` on the condition itself is two Python calls more, twice a run)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._pending: list[Outcome] = []
        self._started: list[tuple[str, int]] = []
        self._busy = False
        #: whether the settler's thread waits for work (told of new work only then)
        self._idle = False
        #: the outcomes being written now (out of ``_pending`` until written or put back)
        self._writing: list[Outcome] = []
        self._conn: psycopg.Connection[Any] | None = None
        self._connecting = threading.Lock()
        #: set when the process starts closing: a connection opened ahead of need is no
        #: longer worth opening, nor its failure worth saying
        self.closing = False
        #: set by :meth:`close`: a connection that opens after it is closed at once
        self._closed = False
        self._thread: detach.Detached | None = None
        self.written = 0
        #: called on the settler's thread before each batch is written, and at least every
        #: IDLE_TICK_S while it waits (e.g. the metrics writing what the runs counted: a
        #: run's after-hooks have counted it before its outcome is submitted, so what it
        #: counted is written before its outcome is)
        self.batch_listeners: list[Callable[[], object]] = []
        self._listener_failed: set[int] = set()

    def start(self) -> None:
        with self._cond:
            if self._thread is None:
                self._thread = detach.go(f"settler-{self.worker_id[:8]}", self.run)

    def submit(self, outcome: Outcome) -> None:
        with self._lock:
            self._pending.append(outcome)
            if self._idle:  # a busy settler takes it with what it writes next, unwoken
                self._cond.notify_all()
        if self._thread is None:
            self.start()

    def mark_started(self, key: tuple[str, int]) -> None:
        with self._lock:
            self._started.append(key)
            if self._idle:
                self._cond.notify_all()
        if self._thread is None:
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

    def _tell_listeners(self) -> None:
        for listener in self.batch_listeners:
            try:
                listener()
            except Exception:  # a listener never stops the outcomes; said once per listener
                if id(listener) not in self._listener_failed:
                    self._listener_failed.add(id(listener))
                    logger.exception("settler: a batch listener (%r) failed; outcomes are still written", listener)

    def run(self, stop: threading.Event) -> None:
        self._connect_ahead(stop)
        backoff = Backoff(start_s=0.05, cap_s=2.0)
        while True:
            with self._cond:
                if not self._pending and not self._started and not stop.is_set():
                    self._idle = True
                    self._cond.wait(IDLE_TICK_S)
                    self._idle = False
                outcomes, self._pending = self._pending, []
                started, self._started = self._started, []
                if outcomes or started:
                    self._busy = True
                    self._writing = outcomes
            self._tell_listeners()
            if not outcomes and not started:
                if stop.is_set():
                    return  # stopped, nothing left
                continue
            try:
                try:
                    self.settle_once(outcomes, started)
                except REFUSED_BY_A_ROW:
                    self.settle_apart(outcomes, started)
                backoff.reset()
            except Exception as exc:  # never dies: kept, retried with back-off, said once
                if not self._closed:  # closed: the process exits, and says what was not written
                    self.outage.failed("settle", exc)
                close_quietly(self._conn)
                self._conn = None
                with self._cond:  # keep them, in order, for the next attempt
                    self._pending[:0] = outcomes
                    self._started[:0] = started
                    self._busy = False
                    self._writing = []
                    self._cond.notify_all()
                if self.abandoned or self._closed:
                    return  # closing: what is left stays consumed and runs again
                time.sleep(backoff.next_s()) if stop.is_set() else stop.wait(backoff.next_s())
                continue
            with self._cond:
                self._busy = False
                self._writing = []
                self._cond.notify_all()

    def _connect_ahead(self, stop: threading.Event) -> None:
        """Open the connection before the first outcome needs it: a drain's first settle
        otherwise waited for a new connection (and this process's proof that it lives)
        while every claim after the first waited for that settle. If it cannot be opened,
        the outage is said (unless the process is closing by then) and the first settle
        tries again, with back-off."""
        if stop.is_set() or self.closing or self._conn is not None:
            return
        try:
            self._connection()
        except Exception as exc:
            if not (stop.is_set() or self.closing):
                self.outage.failed("settle", exc)

    def _connection(self) -> psycopg.Connection[Any]:
        conn = self._conn
        if conn is not None and not conn.closed:
            return conn
        with self._connecting:  # one connection, whoever asks while it opens
            conn = self._conn
            if conn is None or conn.closed:
                if self._closed:
                    raise DatabaseUnavailable("the settler is closed: it opens no connection")
                # Synchronous: once written, an outcome is forgotten here; a settle lost in a
                # server crash would leave its message consumed by this live process, rescued by nobody.
                conn = self._connect()
                with self._lock:
                    kept = not self._closed
                    if kept:
                        self._conn = conn
                if not kept:  # closed while it opened: nothing may hold it now
                    close_quietly(conn)
                    raise DatabaseUnavailable("the settler was closed while its connection opened")
            return conn

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
            _SETTLE_DONE.execute(conn, {"ids": [o.message_id for o in plain], "claims": [o.claim for o in plain],
                                        "worker_id": self.worker_id,
                                        "s_ids": s_ids, "s_claims": s_claims, "awaited": list(awaited),
                                        **timing_params(plain, now)})
        elif started:
            conn.execute(sql.MARK_STARTED, {"ids": s_ids, "claims": s_claims, "worker_id": self.worker_id})
        if other:
            _SETTLE.execute(conn, {**settle_params(other, awaited), "worker_id": self.worker_id,
                                   "max_runs_without_outcome": self.max_runs_without_outcome})
        self.outage.ok()
        self.written += len(outcomes)
        per_queue: dict[str, int] = {}
        for o in outcomes:
            per_queue[o.queue_name] = per_queue.get(o.queue_name, 0) + 1
        for queue_name, count in per_queue.items():
            self._on_settled(queue_name, count)
        return len(outcomes)

    def settle_apart(self, outcomes: Sequence[Outcome], started: Sequence[tuple[str, int]]) -> list[Outcome]:
        """The database refused a batch for what a row holds (:data:`REFUSED_BY_A_ROW`), not
        for a lost connection: write each outcome alone, and set aside the one it refuses
        alone (rejected with the reason: it neither blocks the process's other outcomes, a
        whole worker's, nor runs again unseen). Returns those set aside. Anything else
        raises, as a batch's failure does: what is left is kept and written again (an
        outcome written already is not written twice: its claim has moved on)."""
        if started:
            self.settle_once([], started)
        set_aside: list[Outcome] = []
        for outcome in outcomes:
            try:
                self.settle_once([outcome], [])
            except REFUSED_BY_A_ROW as exc:
                reason = storable_text(f"its outcome ({outcome.outcome}) could not be written, set aside: "
                                       f"{type(exc).__name__}: {first_line(exc)}")
                conn = self._connection()
                conn.execute(sql.SET_ASIDE_OUTCOME, {"message_id": outcome.message_id, "claims": outcome.claim,
                                                     "worker_id": self.worker_id, "error": reason})
                logger.error("message %s: %s; rejected (an operator may retry it)", outcome.message_id, reason)
                self._on_settled(outcome.queue_name, 1)
                set_aside.append(outcome)
        return set_aside

    def close(self) -> None:
        with self._lock:  # never held while a connection opens: close does not wait for one
            self._closed = True
            conn, self._conn = self._conn, None
        close_quietly(conn)


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
    return {
        **timing_params(outcomes, time.monotonic() if now is None else now),
        "hints": [o.attempt for o in outcomes],
        "ids": [o.message_id for o in outcomes],
        "claims": [o.claim for o in outcomes],
        "outcomes": [o.outcome for o in outcomes],
        "options": [o.options_json for o in outcomes],  # None: left as it is
        "delays": [o.delay_s for o in outcomes],
        "errors": [o.error for o in outcomes],
        **followup_params([(o.message_id, *followup) for o in outcomes for followup in o.followups]),
        "awaited": list(awaited),
    }


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
    return storable_text(str(text)[-sql_history.ATTEMPT_ERROR_CHARS:])
