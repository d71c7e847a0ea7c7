"""This process's liveness: it heartbeats by the database's clock, proves it is alive
before it claims or settles after an outage, steps down (interrupting its running jobs)
when it cannot prove it for ``step_down_after_s``, steps up when it can again, and rescues
the messages of processes that died or fell silent.

:class:`Liveness` knows nothing of the broker: it is given the worker id, the URL its own
heartbeat connection opens, a way to run a statement on the pool, the process's outage,
and what it must see or touch of the claims: the queues' states, the claims whose outcome
waits to be written, the worker threads running jobs, and whether the process claims.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from typing import Any

import psycopg

from broker import detach
from broker.engine import sql
from broker.engine.queues import QueueState
from broker.engine.runs import RunningJobs
from broker.errors import CutOff, DatabaseUnavailable
from broker.pg.pool import DISCONNECTS, Outage, close_quietly, connect
from broker.settings import Settings

logger = logging.getLogger("standmeet.broker")

#: Runs one autocommit statement on the process's pool; returns its rows.
Execute = Callable[[str, dict[str, Any]], list[tuple[Any, ...]]]


#: A heartbeat whose round trip took longer does not set the server's clock again (the
#: clock is taken as read at its end: a claim's deadline would come that much early).
CLOCK_READ_MAX_S = 0.5


class Liveness:
    """Heartbeat, step down and up, rescue: what keeps this process's claims its own."""

    def __init__(self, *, worker_id: str, url: str, settings: Settings, outage: Outage, execute: Execute,
                 served: set[str], queue_states: Mapping[str, QueueState],
                 pending_claims: Callable[[], list[tuple[tuple[str, int], str]]],
                 running: RunningJobs, claiming: Callable[[], bool],
                 on_proven: Callable[[], None]) -> None:
        """``served``: the queues this process serves (it grows); ``queue_states``: what it
        holds of each; ``pending_claims``: the settler's claims whose outcome waits to be
        written; ``running``: the worker threads running jobs, interrupted on a step-down;
        ``claiming``: whether the process still claims (not shutting down); ``on_proven``:
        called each time it proved it lives."""
        self.worker_id = worker_id
        self.url = url
        self.settings = settings
        self.outage = outage
        self.execute = execute
        self.served = served
        self.queue_states = queue_states
        self.pending_claims = pending_claims
        self.running = running
        self.claiming = claiming
        self.on_proven = on_proven
        #: set while this process cannot prove it lives (see :meth:`guard_once`)
        self.stepped_down = False
        #: when a heartbeat was last confirmed (monotonic); None before the first
        self.confirmed_at: float | None = None
        #: set once the process closes: no heartbeat starts after it
        self.closing = False
        #: set by :meth:`stop`: no connection proves the process alive after it
        self.stopped = False
        #: told what each rescue pass did: {queue: (requeued, rejected)}
        self.rescue_listeners: list[Callable[[dict[str, tuple[int, int]]], None]] = []
        self._lock = threading.Lock()
        self._step_lock = threading.Lock()
        #: held while the process steps down (the flag, then its running jobs interrupted)
        #: and while it steps up (the flag cleared, jobs allowed again): one never lands
        #: inside the other, which would leave a stepped-up process cutting off every job
        self._down_lock = threading.Lock()
        self._heartbeat: detach.Detached | None = None
        self._guard: detach.Detached | None = None
        self._beat_conn: psycopg.Connection[Any] | None = None
        #: since when the server has been the database's, as last seen (its change: a
        #: restart or a failover)
        self._epoch: Any = None
        #: the server's clock (seconds since the epoch) minus this process's monotonic
        #: clock, as the last heartbeat read it (None before the first)
        self._server_clock_s: float | None = None

    @property
    def started(self) -> bool:
        """Whether the heartbeat runs (it starts when the process first proves it lives)."""
        return self._heartbeat is not None

    def connect_proven(self, application_name: str) -> psycopg.Connection[Any]:
        """A new connection on which this process has just proved it lives (closed if it could
        not). Refused once the process has stopped (:meth:`stop`): a connection that took
        that long to open must not record a heartbeat after the process was recorded as
        stopped."""
        conn = connect(self.url, application_name=application_name, at_first_use=True)
        try:
            if self.stopped:
                raise DatabaseUnavailable(f"{application_name}: this process has stopped; its new connection is closed")
            self.prove_alive(conn)
        except BaseException:
            close_quietly(conn)
            raise
        return conn

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
            "rescue_after_s": self.settings.rescue_after_s,
        }
        sent = time.monotonic()
        if conn is not None:
            row = conn.execute(sql.HEARTBEAT, params).fetchone()
        else:
            rows = self.execute(sql.HEARTBEAT, params)
            row = rows[0] if rows else None
        epoch = row[0] if row is not None else None
        got = time.monotonic()
        if row is not None and row[1] is not None and (got - sent < CLOCK_READ_MAX_S or self._server_clock_s is None):
            # read between sent and got: taken as read at got, the server's clock is never
            # overestimated (a claim's deadline comes early, by the round trip at most)
            self._server_clock_s = float(row[1]) - got
        self.confirmed_at = got
        self.outage.ok()
        self._start_heartbeat()
        if self.stepped_down:
            self._step_up(conn)  # its check covers a changed server too
        elif self._epoch is not None and epoch != self._epoch:
            # Restarted, or failed over (behind a pooler, maybe with no connection of ours
            # seen to fail): an outcome this process wrote may have been lost with it.
            logger.warning("the database server restarted or failed over: checking what this process holds")
            self.give_back_unknown(conn)
        self._epoch = epoch

    def server_time_s(self, after_s: float) -> float | None:
        """The server's clock ``after_s`` from now, in seconds since the epoch (None before
        the first heartbeat)."""
        offset = self._server_clock_s
        return None if offset is None else time.monotonic() + offset + after_s

    def _start_heartbeat(self) -> None:
        with self._lock:
            if self._heartbeat is None and not self.closing:
                self._heartbeat = detach.every(
                    f"heartbeat-{self.worker_id[:8]}", self.settings.heartbeat_s, self.heartbeat_once
                )
                self._guard = detach.every(
                    f"liveness-guard-{self.worker_id[:8]}", min(0.5, self.settings.heartbeat_s / 2), self.guard_once
                )
        if not self.closing:  # what waits for the proof (the wake-ups) does not start in a closing process
            self.on_proven()

    # -- stepping down when cut off -------------------------------------------------

    def guard_once(self) -> bool:
        """Step down if no heartbeat was confirmed for ``step_down_after_s``: no I/O here, so
        a thread stuck on a dead connection cannot stop it. True if it stepped down now."""
        if self._confirmed_recently() or self.closing or not self.claiming():
            return False
        with self._down_lock:
            if self._confirmed_recently():  # a heartbeat confirmed since: nothing to do
                return False
            self._step_down(time.monotonic() - (self.confirmed_at or 0.0))
        return True

    def _confirmed_recently(self) -> bool:
        """Stepped down already, or a heartbeat was confirmed within ``step_down_after_s``
        (or none yet: nothing to judge)."""
        confirmed = self.confirmed_at
        return (self.stepped_down or confirmed is None
                or time.monotonic() - confirmed < self.settings.step_down_after_s)

    def step_down(self, silent_s: float) -> None:
        """Stop claiming and starting claims, and interrupt the running jobs (retryable):
        another process may rescue them once this one's heartbeat is older than the rescue
        window, and a run must not go on here then. Prefetched claims are kept unstarted;
        what this process still holds when it can prove it lives again is checked then."""
        with self._down_lock:
            self._step_down(silent_s)

    def _step_down(self, silent_s: float) -> None:
        self.stepped_down = True
        interrupted = self.running.interrupt_all(CutOff)  # never a run that has ended
        logger.warning(
            "stepping down: no heartbeat confirmed for %.1f s (another process may rescue this one's jobs after "
            "%g s): claiming stopped, %d running job(s) interrupted; they run again",
            silent_s, self.settings.rescue_after_s, interrupted)

    def _step_up(self, conn: psycopg.Connection[Any] | None) -> None:
        """This process proved it lives again: say which of its claims were taken back
        meanwhile (their late outcomes are fenced off by the claim number), then claim again."""
        with self._step_lock:  # several threads may prove it at once: one says it
            if self.stepped_down:
                self._step_up_once(conn)

    def _step_up_once(self, conn: psycopg.Connection[Any] | None) -> None:
        held = self._held()
        lost: list[tuple[str, int, str]] = []
        if held:
            params = {"ids": [key[0] for key, _ in held], "claims": [key[1] for key, _ in held],
                      "worker_id": self.worker_id}
            try:
                rows = self._on(conn, sql.STILL_HELD, params)
            except DISCONNECTS:
                return  # not proven after all: the next heartbeat tries again
            kept = {(row[0], int(row[1])) for row in rows}
            lost = [(key[0], key[1], queue) for key, queue in held if key not in kept]
        for message_id, number, queue_name in lost:
            logger.warning("lost claim %d of message %s (queue %r): taken back while this process was cut off; "
                           "its outcome here is not written", number, message_id, queue_name)
        if lost:  # cut off, not crashed: the blame rescue laid on this process is taken back
            params = {"ids": [m for m, _, _ in lost], "claims": [n for _, n, _ in lost], "worker_id": self.worker_id}
            try:
                self._on(conn, sql.CLEAR_BLAME, params)
            except DISCONNECTS:
                return  # not proven after all: the next heartbeat tries again
        for state in self.queue_states.values():
            state.forget({(m, n) for m, n, q in lost if q == state.name})
        try:
            self.give_back_unknown(conn)
        except DISCONNECTS:
            return  # not proven after all: the next heartbeat tries again
        with self._down_lock:
            self.stepped_down = False
            self.running.resume()
        logger.warning("stepping up: heartbeat confirmed again; %d claim(s) lost, claiming again", len(lost))
        for state in self.queue_states.values():
            state.notified()

    def _on(self, conn: psycopg.Connection[Any] | None, query: str, params: dict[str, Any]) -> list[tuple[Any, ...]]:
        """One statement's rows, on the connection that just proved this process alive (the
        pool may still be reconnecting), or on the pool."""
        if conn is None:
            return self.execute(query, params)
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []

    def _held(self) -> list[tuple[tuple[str, int], str]]:
        """Every claim this process knows it holds, with its queue: held by a queue (running,
        buffered, given back), ended with its outcome not yet handed to the settler, or
        waiting for it to be written (the queues read first: a claim moves from them to
        the settler)."""
        return list(dict.fromkeys([*((key, state.name) for state in self.queue_states.values()
                                     for key in state.known()), *self.pending_claims()]))

    def give_back_unknown(self, conn: psycopg.Connection[Any] | None, *, queue: str | None = None) -> int:
        """Give back, unblamed, what the database says this process holds (of ``queue``, or
        of every queue) and it does not know: the server it was cut off from may have lost,
        in a failover, the outcome this process wrote (replicated too late), or sent the
        answer to a claim that never arrived. Nobody else takes a claim back from a live
        process: those messages would stay claimed until it stops. Returns how many.

        No claim of those queues is made meanwhile (their claim locks are held), and a claim
        is known while it is held here, from its run's end until its outcome is handed to
        the settler (:meth:`broker.engine.queues.QueueState.known`), and while its outcome
        waits to be written; what ended as the database answered is looked up again then."""
        states = sorted((s for s in self.queue_states.values() if queue is None or s.name == queue),
                        key=lambda s: s.name)
        with ExitStack() as locks:
            for state in states:
                locks.enter_context(state.claim_lock)
            known = self._known(states)
            rows = self._on(conn, sql.HELD_HERE, {"worker_id": self.worker_id})
            names = {state.name for state in states}  # (a queue declared meanwhile is not checked)
            unknown = [(str(m), int(n), str(q)) for m, n, q in rows if q in names and (str(m), int(n)) not in known]
            if unknown:
                now_known = self._known(states)
                unknown = [(m, n, q) for m, n, q in unknown if (m, n) not in now_known]
            if not unknown:
                return 0
            self._on(conn, sql.REQUEUE, {"ids": [m for m, _, _ in unknown], "claims": [n for _, n, _ in unknown],
                                         "worker_id": self.worker_id})
        for message_id, number, queue_name in unknown:
            logger.warning("message %s (queue %r, claim %d) was held by this process in the database but not here "
                           "(an outcome or a claim lost with the server it was written to, or a claim's answer "
                           "lost with its connection): given back, it runs again",
                           message_id, queue_name, number)
        return len(unknown)

    def _known(self, states: list[QueueState]) -> set[tuple[str, int]]:
        """The claims this process knows of ``states``' queues: held, ending, or waiting for
        their outcome to be written (the queues read first: a claim moves from them to the
        settler)."""
        names = {state.name for state in states}
        known: set[tuple[str, int]] = set()
        for state in states:
            known |= state.known()
        known.update(key for key, queue in self.pending_claims() if queue in names)
        return known

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

    def stop(self) -> None:
        """Stop the heartbeat and the guard, and close the heartbeat's connection."""
        self.closing = True
        self.stopped = True
        if self._heartbeat is not None:
            self._heartbeat.stop(timeout_s=2)
        if self._guard is not None:
            self._guard.stop(timeout_s=1)
        close_quietly(self._beat_conn)
