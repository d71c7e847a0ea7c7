"""Our Postgres broker: a ``dramatiq.Broker`` on psycopg 3, in dramatiq-pg's table.

What it guarantees:

* **Claims are bounded per queue.** A consumer claims due messages with one
  ``UPDATE`` statement whose rows are picked once, in a CTE (``SELECT … LIMIT n FOR
  UPDATE SKIP LOCKED``; lower ``priority`` first, then oldest due), never more than its queue's limit running plus
  its prefetch (by default what its jobs finish in 50 ms, up to 128); it claims again
  when a batch's worth of room is free or a running slot would idle. Runs that finished
  but whose outcome is not written yet count too, beyond a slack of one limit and one
  claim batch: a process never holds more than ``2 × limit`` + the prefetch's ceiling +
  a claim batch (half that ceiling, at least one) rows ``consumed``. What
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

This module holds the broker itself; it builds its parts and gives each only what it
needs: the consumer (``consumer.py``), what it holds of each queue (``queues.py``), the
settler (``settler.py``), the liveness (``liveness.py``), and the one writer of message
rows (``enqueue.py``). See ``broker/engine/__init__.py`` for where everything else is.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import dramatiq
import psycopg
from dramatiq.broker import MessageProxy
from dramatiq.errors import QueueJoinTimeout, QueueNotFound
from dramatiq.message import Message
from dramatiq.middleware import MiddlewareError

from broker.engine import enqueue as writer
from broker.engine import sql
from broker.engine.codec import options_json, refuse_non_json_encoder, storable_text
from broker.engine.consumer import ClaimedMessage, StandmeetConsumer
from broker.engine.hooks import HookTable, MiddlewareList
from broker.engine.liveness import Liveness
from broker.engine.queues import Claim, DeclaredQueues, QueueState, claim_of
from broker.engine.runs import RunningJobs, as_run, disarm, in_a_run, rejection_reason, run_signal
from broker.engine.settler import Outcome, SettleContext, Settler, attempt_error, ran_as, timed_out
from broker.engine.wakeups import WakeListener
from broker.errors import CutOff
from broker.observability import tracing
from broker.pg.pool import (
    DISCONNECTS,
    TRANSACTION,
    Outage,
    open_send_pool,
    topology_for,
)
from broker.pg.preflight import first_line
from broker.settings import QueueSettings, Settings

logger = logging.getLogger("standmeet.broker")

#: How ``_emit_after`` calls a hook: with the signal's one argument alone, with it and the
#: run's ``result``, with it and its ``exception``, or with whatever the signal came with.
_ALONE, _RESULT, _EXCEPTION, _AS_GIVEN = range(4)


class _QuietCutOffs(logging.Filter):
    """Dramatiq's worker logs each interrupted job with its traceback; a step-down says
    once, itself, which jobs it interrupted and that they run again."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info and isinstance(record.exc_info[1], CutOff))


logging.getLogger("dramatiq.worker.WorkerThread").addFilter(_QuietCutOffs())

#: How long ``join`` sleeps between two looks at a queue.
JOIN_POLL_S = 0.02
#: How long ``close`` lets the settler write what is pending.
CLOSE_FLUSH_S = 5.0

_local = threading.local()


class StandmeetBroker(DeclaredQueues, dramatiq.Broker):
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
        #: the worker threads running a job, to interrupt them on a step-down
        self._running = RunningJobs()
        self.closing = False
        self.queue_states: dict[str, QueueState] = {}
        self.served: set[str] = set()
        self._lock = threading.Lock()
        self._pool: Any = None
        self._close_hooks: list[Callable[[], None]] = []
        self.liveness = Liveness(
            worker_id=self.worker_id, url=url, settings=settings, outage=self.outage, execute=self.execute,
            served=self.served, queue_states=self.queue_states, pending_claims=self._pending_claims,
            running=self._running, claiming=lambda: self.claiming, on_proven=self._start_wakeups)
        self.settler = Settler(
            worker_id=self.worker_id, connect=functools.partial(self.liveness.connect_proven, "standmeet-settler"),
            outage=self.outage, max_runs_without_outcome=settings.max_runs_without_outcome,
            on_settled=functools.partial(_settled, self.queue_states))
        #: told what each rescue pass did: {queue: (requeued, rejected)}
        self.rescue_listeners = self.liveness.rescue_listeners
        #: called before each batch of outcomes is written, and while idle (Settler.batch_listeners)
        self.settle_listeners = self.settler.batch_listeners
        self._hook_table = HookTable()
        #: Dramatiq workers running on this broker (booted, not yet shutting down)
        self._workers: list[Any] = []
        refuse_non_json_encoder()
        super().__init__(middleware=middleware or [])
        self.middleware: MiddlewareList  # made one by __setattr__
        # Queues are declared by the actors that name them (and by declare_queue): a
        # process serves the queues of the modules it loads, no others.

    # -- queues -------------------------------------------------------------------

    def new_queue(self, queue_name: str, settings: QueueSettings) -> QueueState:
        # No delay queues: delays live in the database (the ``eta`` column).
        state = self.queue_states[queue_name] = QueueState(settings)
        return state

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
        transaction, and only if the run is settled. Written by :mod:`broker.engine.enqueue`,
        whose docstring says which hooks run.
        """
        if message.queue_name not in self.queues:
            raise QueueNotFound(message.queue_name)
        refuse_non_json_encoder()
        message.options.pop("eta", None)  # Dramatiq would hold an ``eta`` message in memory
        context: SettleContext | None = getattr(_local, "settling", None)
        if context is not None:
            return writer.send_from_run(self, context, message, delay)
        return writer.send(self, message, delay_ms=delay)

    def enqueue_many(self, messages: Sequence[Message], *, conn: psycopg.Connection[Any] | None = None,
                     delay: int | None = None) -> list[Message]:
        """Write many messages in one statement (on ``conn``, in its transaction, if given)."""
        return writer.send_many(self, messages, conn=conn, delay_ms=delay)

    def declare_actor(self, actor: Any) -> None:
        # Its function is bracketed as a job's body, so a step-down interrupts a job while
        # it runs and at no other moment (broker.engine.runs.as_run); called anywhere but
        # in a worker thread of this broker, the function is called as it is.
        actor.fn = as_run(actor.fn)
        super().declare_actor(actor)

    # -- signals ----------------------------------------------------------------------

    def __setattr__(self, name: str, value: Any) -> None:
        # The middleware list counts its changes (broker.engine.hooks); one assigned in
        # its place is made a counting one.
        if name == "middleware" and type(value) is not MiddlewareList:
            value = MiddlewareList(value)
        super().__setattr__(name, value)

    def _hooks(self, name: str) -> list[Any]:
        """The middleware methods that really handle ``name`` (``before_enqueue`` …), in
        order (:mod:`broker.engine.hooks`)."""
        return self._hook_table.of(self.middleware, name)

    def _run_options(self, proxy: Any) -> tuple[Mapping[str, Any], Mapping[str, Any]]:
        """The options of a run's message and of its actor: the dictionaries themselves,
        read once per signal, so what a hook adds to them is seen by the hooks after it."""
        actor = self.actors.get(proxy.actor_name)
        return proxy.options, actor.options if actor is not None else {}

    def emit_before(self, signal: str, *args: Any, **kwargs: Any) -> None:
        if signal == "process_message":
            disarms = self._hook_table.bound(self.middleware, "disarm")
            in_a_run(self._running, disarms)
            args[0].standmeet_started_mono = time.monotonic()
            try:
                self._emit_before(signal, args, kwargs)
            except BaseException:
                # The run ends here (skipped, or stopped by a hook): its time limit goes
                # now, not in the after-hooks, so that it cannot fire while Dramatiq's
                # worker reports the skip (raised there, it would end the thread before
                # any after-hook gives back what the before-hooks took).
                disarm(disarms)
                raise
            return
        if signal == "worker_boot" and args:
            # before its threads start: a job may end before Worker.start() returns
            self._workers = [*self._workers, args[0]]
        elif signal == "worker_shutdown" and args:
            self._workers = [w for w in self._workers if w is not args[0]]
        self._emit_before(signal, args, kwargs)

    def _emit_before(self, signal: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        # As Dramatiq's: a MiddlewareError stops the operation, other errors are logged.
        # A run's policy gated on options the run does not set is skipped, judged just
        # before its hook would be called, on the options the message and its actor
        # have then (broker.engine.hooks).
        # A hook of a signal with one argument and no keyword (a run's, an ack's) is called
        # with it directly: a call through ``*args, **kwargs`` builds a tuple and a dict for
        # each hook, a quarter of a microsecond each time, a dozen times a run.
        options: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None
        alone = len(args) == 1 and not kwargs
        for middleware, hook, gate in self._hook_table.calls(self.middleware, "before_" + signal):
            if gate is not None:  # applies(), inline: it is asked for a run's every gated policy
                names, configured_to_skip = gate
                if configured_to_skip is None or configured_to_skip(middleware):
                    options = options or self._run_options(args[0])
                    if names.isdisjoint(options[0]) and names.isdisjoint(options[1]):
                        continue
            try:
                if alone:
                    hook(self, args[0])
                else:
                    hook(self, *args, **kwargs)
            except MiddlewareError:
                raise
            except Exception:
                self.logger.critical("Unexpected failure in before_%s of %r.", signal, middleware, exc_info=True)

    def _emit_after(self, signal: str, *args: Any, **kwargs: Any) -> None:
        options: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None
        # As in emit_before: the usual shapes (one argument, with no keyword or with the
        # run's ``result`` or ``exception`` alone) are called directly, each hook given
        # exactly the keywords the signal came with.
        shape, value = _AS_GIVEN, None
        if len(args) == 1:
            if not kwargs:
                shape = _ALONE
            elif len(kwargs) == 1:
                if "result" in kwargs:
                    shape, value = _RESULT, kwargs["result"]
                elif "exception" in kwargs:
                    shape, value = _EXCEPTION, kwargs["exception"]
        for middleware, hook, gate in self._hook_table.calls(self.middleware, "after_" + signal):
            if gate is not None:  # applies(), inline: it is asked for a run's every gated policy
                names, configured_to_skip = gate
                if configured_to_skip is None or configured_to_skip(middleware):
                    options = options or self._run_options(args[0])
                    if names.isdisjoint(options[0]) and names.isdisjoint(options[1]):
                        continue
            try:
                if shape == _RESULT:
                    hook(self, args[0], result=value)
                elif shape == _ALONE:
                    hook(self, args[0])
                elif shape == _EXCEPTION:
                    hook(self, args[0], exception=value)
                else:
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
        # Neither a step-down's interruption nor the time limit fires in the settle path;
        # one that was raised as the job ended is dropped (broker.engine.runs). A job that
        # left its body was disarmed then; one that never started is disarmed here.
        left, late = in_a_run(None)
        if not left:
            late = disarm(self._hook_table.bound(self.middleware, "disarm")) or late
        if late is not None:
            logger.info("message %s: %s arrived after the job had ended; ignored",
                        proxy.message_id, type(late).__name__)
        # A snoozed job is a skip (broker.engine.runs); so is a job interrupted because this
        # process stepped down (cut off from the database): it runs again, with no retry
        # counted (see step_down).
        signal, kwargs, exception = run_signal(
            self, signal, proxy, kwargs, refuse_hooks=self._hook_table.bound(self.middleware, "refuse_result"),
            not_at_fault=(CutOff,))
        context = getattr(proxy, "standmeet_settle", None)
        if context is None and claim_of(proxy) is not None:
            context = proxy.standmeet_settle = SettleContext(proxy)  # type: ignore[union-attr]
        if context is not None and signal == "process_message" and exception is None:
            context.returned = True
        if context is not None and signal == "skip_message":
            context.skipped = True  # acked without running, unless a middleware requeues it
        if isinstance(exception, CutOff) and context is not None:
            # it runs again at once: known before the after-hooks, so that none takes the
            # run for one that ended (the results policy would store None for it)
            context.requeue_delay_ms = 0
        _local.settling = context
        try:
            self._emit_after(signal, *args, **kwargs)
        finally:
            _local.settling = None

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
        # A run done with its options as claimed leaves them as they are (None): no JSON to make. A
        # skip is done only if its after-hooks did not fail (a snooze not put back never ran).
        ended = context is not None and (context.returned or (context.skipped and context.hook_failure is None))
        done_as_claimed = (not rejected and context is not None and context.requeue_delay_ms is None and ended
                           and getattr(proxy, "standmeet_claimed_options", None) == proxy.options)
        options = None if done_as_claimed else options_json(proxy)
        if options is None and not done_as_claimed:  # what a middleware left cannot be stored
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
        elif context is not None and ended:
            outcome = Outcome(proxy.message_id, claim, proxy.queue_name, "done", options, followups=followups)
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
        try:
            if following is not None:
                self._hand_to_worker(state, following, consumer_thread)
            self.settler.submit(outcome)
        finally:
            state.submitted(key)

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
                self._wakeups.add(sql.ENQUEUE_CHANNEL.format(queue=queue_name), state.notified)
        self.settler.start()  # its connection opens now, not when the first run ends
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
        """Claim nothing more (shutdown), and give back at once what was prefetched. A
        claim on its way is waited for (up to its window), so that what it brings back is
        given back too, by this or by its consumer, never started."""
        self.claiming = False
        deadline = time.monotonic() + sql.CLAIM_WITHIN_S  # one window for every queue's claim, not one each
        for state in self.queue_states.values():
            waited = state.claim_lock.acquire(timeout=max(0.0, deadline - time.monotonic()))
            try:
                self.give_back_buffered(state)
            finally:
                if waited:
                    state.claim_lock.release()
            state.wake()

    def prefetched_message_ids(self) -> list[str]:
        """The message ids this process holds prefetched, not started (the cancellation
        watcher asks which of them an operator cancelled)."""
        return [message_id for state in self.queue_states.values() for message_id in state.prefetched_ids()]

    def give_back_cancelled(self, message_ids: Collection[str]) -> int:
        """Prefetched claims an operator cancelled before they started: taken out of their
        buffers, never to start here, and given back by their consumers (the give-back
        rejects them: ``cancelled by … : not run``). How many."""
        taken = [(state, state.give_back_buffered_of(message_ids)) for state in self.queue_states.values()]
        for state in (state for state, n in taken if n):
            state.wake()
        return sum(n for _, n in taken)

    def give_back_buffered(self, state: QueueState) -> None:
        """Give back, unblamed, what ``state`` holds prefetched, never started here."""
        buffered = state.take_buffer()
        if buffered:
            try:
                self.requeue([c.message for c in buffered], [c.number for c in buffered])
            except DISCONNECTS as exc:
                # Still ours, never started here: offered again by the consumer if this
                # process claims again, by the graceful stop otherwise, or by rescue.
                state.give_back_later(buffered)
                logger.warning("could not give back %d prefetched message(s) yet: %s", len(buffered), exc)

    # -- liveness (broker.engine.liveness) ---------------------------------------------

    def prove_alive(self, conn: psycopg.Connection[Any] | None = None) -> None:
        """Record a heartbeat (registering this process if needed), on ``conn`` or the pool."""
        self.liveness.prove_alive(conn)

    def give_back_unknown(self, conn: psycopg.Connection[Any] | None = None, *, queue: str | None = None) -> int:
        """Give back, unblamed, the claims the database says this process holds (of
        ``queue``) and it does not know; returns how many."""
        return self.liveness.give_back_unknown(conn, queue=queue)

    def ensure_registered(self) -> None:
        self.liveness.prove_alive()

    def heartbeat_once(self) -> dict[str, tuple[int, int]]:
        """Prove this process alive, and rescue the messages of dead ones."""
        return self.liveness.heartbeat_once()

    def rescue_once(self) -> dict[str, tuple[int, int]]:
        """Requeue messages whose process died; returns {queue: (requeued, rejected)}."""
        return self.liveness.rescue_once()

    @property
    def stepped_down(self) -> bool:
        """Cut off: no heartbeat confirmed for ``step_down_after_s``; nothing is claimed or started."""
        return self.liveness.stepped_down

    def _pending_claims(self) -> list[tuple[tuple[str, int], str]]:
        return self.settler.pending_claims()

    def _start_wakeups(self) -> None:
        with self._lock:
            if self._wakeups is not None:
                self._wakeups.start()

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
        self.liveness.closing = True
        self.settler.closing = True
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
        self.settler.abandoned = True
        self.settler.stop(timeout_s=1)
        self.settler.close()
        self.liveness.stop()
        if self._wakeups is not None:
            self._wakeups.stop()
        if self.liveness.started or self.served:
            try:
                self.execute(sql.STOP_WORKER, {"worker_id": self.worker_id})
            except psycopg.Error as exc:  # down, or a schema not (yet) migrated: the rest still closes
                logger.warning("could not record this worker as stopped: %s", first_line(exc))
        for backend in self.backends:
            backend.close()
        if self._pool is not None:
            self._pool.close(timeout=1.0)
        for state in self.queue_states.values():
            state.wake()


def _settled(queue_states: dict[str, QueueState], queue_name: str, count: int) -> None:
    """The settler wrote ``count`` outcomes of ``queue_name``: room to claim again."""
    state = queue_states.get(queue_name)
    if state is not None:
        state.settled(count)
