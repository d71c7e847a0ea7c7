"""The consumer side of the broker: :class:`StandmeetConsumer` claims due messages of one
queue (never more than its limit running plus its prefetch) and hands them to Dramatiq's
worker as :class:`ClaimedMessage` proxies; it waits on NOTIFY, a finishing job, or its
queue's next due time."""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import psycopg
from dramatiq.broker import Consumer, MessageProxy
from dramatiq.errors import BrokerConnectionError
from dramatiq.message import Message

from broker.backoff import Backoff
from broker.engine import sql
from broker.engine.codec import claim_size_params, loads_json, logged_call
from broker.engine.queues import Claim, QueueState
from broker.pg.pool import DISCONNECTS, close_quietly, connect, readable

if TYPE_CHECKING:
    from broker.engine.broker import StandmeetBroker
    from broker.engine.settler import SettleContext

logger = logging.getLogger("standmeet.broker")

#: The fields of a Dramatiq message, as its JSON has them.
MESSAGE_FIELDS = frozenset(field.name for field in dataclasses.fields(Message))
#: Shortest sleep when due messages exist but were all locked by another claimer.
MIN_WAIT_S = 0.005
#: How often a consumer that no longer claims (shutdown) returns to Dramatiq's loop.
SHUTDOWN_POLL_S = 0.05
#: How long a consumer waits for its abandoned claim session to end before it checks what
#: this process holds (the check goes on either way).
ABANDONED_SESSION_WAIT_MS = 5000
#: How long after a claim's window (sql.CLAIM_WITHIN_S) has passed since a claim connection
#: failed the check of what this process holds is made again, where the abandoned server
#: session could not be ended: room for the commit of a claim made at the window's end.
RECHECK_MARGIN_S = 1.0


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
        self.standmeet_metrics_children: Any = None
        self.standmeet_log_start: tuple[float, int] | None = None
        self.standmeet_cancel_run: Any = None
        #: when its run started (monotonic), for its attempt and the history
        self.standmeet_started_mono: float | None = None

    def __str__(self) -> str:
        """The call, as Dramatiq's log lines print it, cut to MAX_LOGGED_CALL_CHARS: a
        message's arguments can be a megabyte."""
        return logged_call(self._message)

    def __repr__(self) -> str:
        return f"<ClaimedMessage {self.message_id} {logged_call(self._message)}>"


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
        #: the server session of this consumer's connection (direct connections): ended
        #: before the check of what this process holds, once the connection has failed
        self.session: tuple[int, Any] | None = None

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
            self.state.doubt()
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
        if self.state.recheck_due():  # a claim on a session not ended can no longer commit: checked again
            self.broker.give_back_unknown(conn, queue=self.state.name)
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
        """Claim up to the free slots of this queue; return how many were claimed and held.
        What a claim brings back once shutdown has begun is given back at once, unstarted."""
        with self.state.claim_lock:  # nothing checks what this process holds of the queue meanwhile
            claimed = self._claim_once(conn)
            if claimed and not self.broker.claiming:  # shutdown began while it claimed
                self.broker.give_back_buffered(self.state)
                return 0
            return claimed

    def _claim_once(self, conn: psycopg.Connection[Any]) -> int:
        want = self.state.free()
        if want <= 0:
            return 0
        start_now = self.state.start_now()
        rows = conn.execute(sql.CLAIM, {"queue": self.state.name, "n": want, "n_start": start_now,
                                        "worker_id": self.broker.worker_id,
                                        "claim_until_s": self.broker.liveness.server_time_s(sql.CLAIM_WITHIN_S),
                                        **claim_size_params(self.broker.settings.message_max_bytes)}).fetchall()
        rows.sort(key=lambda row: row[2])
        claims: list[Claim] = []
        try:
            for text, number, rank, row_id, row_queue, refusal in rows:
                if text is None:  # rejected by the claim itself: never loaded here
                    logger.error("queue %r: message %s rejected: %s", self.state.name, row_id, refusal)
                    continue
                message = self._decode(conn, text, row_id, row_queue, number)
                if message is None:
                    continue
                if message.actor_name not in self.broker.actors:
                    self._bounce_unknown_actor(conn, message, number)
                    continue
                claims.append(Claim(message, int(number), started=rank <= start_now))
        finally:  # held in one go (under the claim lock: nothing checks what this process holds meanwhile)
            if claims:
                self.state.hold_all(claims)
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

    def _decode(self, conn: psycopg.Connection[Any], text: str, row_id: str, row_queue: str,
                number: int) -> Message | None:
        """The row's message, or None after rejecting a row that cannot be run as it is."""
        try:  # Message.decode, without its bytes round trip (the broker's encoder is JSON)
            fields = loads_json(text)
            fields["args"] = tuple(fields["args"])
            if fields.keys() == MESSAGE_FIELDS:
                # Every field and nothing else, as every message written by Dramatiq has: the
                # object the frozen constructor would make (its only check, args a tuple, is
                # done above), without its one call per field (1.9 -> 0.7 us a message).
                message: Message[Any] = object.__new__(Message)
                message.__dict__.update(fields)
            else:  # the constructor's defaults, or its TypeError for a field it does not know
                message = Message(**fields)
        except Exception as exc:
            self._reject_malformed(conn, row_id, number, f"malformed message: {exc!r}")
            return None
        if message.message_id != row_id:
            self._reject_malformed(
                conn, row_id, number, f"malformed message: its message_id {message.message_id!r} is not the row's {row_id!r}")
            return None
        if message.queue_name != row_queue:
            self._reject_malformed(
                conn, row_id, number, f"malformed message: its queue_name {message.queue_name!r} is not the row's {row_queue!r}")
            return None
        return message

    def _reject_malformed(self, conn: psycopg.Connection[Any], row_id: str, number: int, error: str) -> None:
        logger.error("queue %r: rejecting message %s: %s", self.state.name, row_id, error)
        # On the send pool, committed synchronously like every outcome: lost in a server crash,
        # the row would stay consumed under this live process, rescued by nobody.
        self.broker.execute(sql.REJECT_MALFORMED, {"message_id": row_id, "claims": number, "error": error,
                                                   "worker_id": self.broker.worker_id})

    def _bounce_unknown_actor(self, conn: psycopg.Connection[Any], message: Message, number: int) -> None:
        settings = self.broker.settings
        error = (f"no actor {message.actor_name!r} in worker {self.broker.worker_id} "
                 f"(host {socket.gethostname()}, pid {os.getpid()}); given back every "
                 f"{settings.unknown_actor_delay_s:g} s, rejected after {settings.unknown_actor_max_claims} claims")
        logger.warning("queue %r: message %s is for an unknown actor %r; giving it back for %.0f s",
                       self.state.name, message.message_id, message.actor_name, settings.unknown_actor_delay_s)
        self.broker.execute(sql.UNKNOWN_ACTOR, {"message_id": message.message_id, "error": error,  # synchronous
                                                "claims": number, "worker_id": self.broker.worker_id,
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
        # A slot freed (a job ended, outcomes written) is room to claim, not a message due:
        # the consumer looks again, and claims only if its last claim filled the room it had
        # (``next_due_s`` 0: there may be more). After a claim that found fewer than it
        # asked, what becomes due is told by a notification (a send, a retry, a give-back),
        # or falls due at the time looked up (a delayed message, or one due but not yet
        # claimable: a suspect behind another, a row another claim had locked): a job
        # ending alone is no reason for a claim and a look-up that would find nothing.
        if self._heard(conn):
            return
        if not self.state.going_to_sleep():
            return  # a slot freed since the last look: look again (claim if room was the limit)
        try:
            woken = readable([conn.fileno(), self.state.wake_fd], timeout)
        finally:
            self.state.awake()
        if self.state.wake_fd in woken:
            self.state.drain_wake()
            self.state.clear_freed()  # the pipe said it
        if woken:
            self._heard(conn)

    def _heard(self, conn: psycopg.Connection[Any]) -> bool:
        """Consume the notifications that arrived, on this connection or through the
        process's listener (:meth:`QueueState.notified`); True if any did (look again now)."""
        heard = self.state.take_told()
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
            doubts = self.state.in_doubt()
            if doubts is not None:  # a claim's answer lost with a failed connection is given back
                ended = self._end_abandoned_session(conn)
                self.broker.give_back_unknown(conn, queue=self.state.name)
                # a claim still running on a session not ended commits, if ever, within its
                # window: checked again once that has passed
                self.state.checked(doubts, again_after_s=None if ended else sql.CLAIM_WITHIN_S + RECHECK_MARGIN_S)
            if self.broker.topology.known_direct:
                row = conn.execute(sql.SESSION_OF).fetchone()
                # (a role that may not see its own sessions' start gets NULL: nothing to end)
                self.session = (int(row[0]), row[1]) if row is not None and row[1] is not None else None
        except BaseException:
            close_quietly(conn)
            raise
        self.conn = conn
        self.next_due_s = 0.0  # we may have missed notifications: look now
        return conn

    def _end_abandoned_session(self, conn: psycopg.Connection[Any]) -> bool:
        """End this consumer's last server session, if it is still there: a claim it was
        running (waiting for a lock; or its client cut off by a partition, which the server
        learns of only much later) must not commit after the check of what this process
        holds. Direct connections only: behind a pooler, a server session outlives its
        client's, and serves others. Whether no claim of it can commit any more (False:
        none was known, or it did not end)."""
        session = self.session
        if session is None:
            return False
        pid, started = session
        try:
            row = conn.execute(sql.END_ABANDONED_SESSION, {"pid": pid, "started": started,
                                                           "timeout_ms": ABANDONED_SESSION_WAIT_MS}).fetchone()
        except psycopg.errors.InsufficientPrivilege as exc:  # the role may not end sessions: checked anyway
            self.session = None
            logger.warning("queue %r: the claim connection given up on (server process %d) could not be ended "
                           "before checking what this process holds: %s", self.state.name, pid, exc)
            return False
        self.session = None  # ended, or gone already (kept until then: a failure here tries again)
        if row is not None:
            logger.info("queue %r: the claim connection given up on (server process %d) %s before checking what "
                        "this process holds", self.state.name, pid,
                        "was ended" if row[0] else f"did not end within {ABANDONED_SESSION_WAIT_MS} ms")
        return row is None or bool(row[0])

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
