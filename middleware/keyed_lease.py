"""Keyed lease: at most one message in flight per key, across processes and hosts.

An actor declares its lease with the ``lease`` option (a :class:`Lease`): how to find a
message's key, and the two statements that take and give back a row lease with a token
and a database-clock expiry. Before the actor runs, this middleware takes the lease in
one autocommit statement; no row back means the key is busy: the message **snoozes**
(a few seconds plus jitter), which never counts a retry and never fires failure
callbacks. A take that fails (the database unreachable, a statement timeout) snoozes
the message the same way: a job never runs without its lease. A message whose arguments
cannot name a key (``key`` raises :data:`MESSAGES_FAULT`) is rejected at once, saying why:
it would fail the same at every run. After the actor —
returned, raised, cancelled or skipped — the lease is
given back, only if the token is still ours. The lease outlives the job's time limit
(it is taken for ``lease_s``, or for what is left of the run's limit and
:data:`LEASE_OUTLIVES_LIMIT_S` more, whichever is longer: a holder is stopped before its
lease can expire), so a crashed worker's lease expires by itself. No transaction is held across the
actor's work: each statement commits alone.

    @dramatiq.actor(lease=Lease(key=account_of, take=TAKE, release=RELEASE,
                                lease_s=lambda: 20.0, busy_snooze_s=lambda: 2.0))
    def sync(transfer_id): ...

``take`` receives ``%(key)s`` and ``%(lease_s)s`` and returns one row when the lease
was free: the token first; then, optionally, the key it leased (when the statement
resolves the message's key to another, e.g. a transfer to its account: ``release``
gets that one) and any columns the actor needs, read in the same statement
(:attr:`Held.row`: no second round trip). A row whose token is NULL means the message
needs no lease (the actor records why, from what the row's other columns read:
:func:`read_without_lease`); no row means busy. ``release`` receives ``%(key)s``,
``%(token)s`` and ``%(message_id)s`` (the releasing message's). ``key(message)``
returns None when the message needs no lease. An actor that gives the lease back itself, in the statement that records its
outcome, says so with :func:`given_back`: the middleware then skips its own release.

Where the leases live is the middleware's ``store`` (a :class:`LeaseStore`): by default
:class:`PostgresLeases`, which runs ``take`` and ``release``; the memory broker of
``broker.testing`` gives one that keeps them in a dict (by ``key(message)`` alone).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from dramatiq import Middleware
from dramatiq.broker import MessageProxy
from dramatiq.middleware import SkipMessage

from broker import deadline
from middleware.snooze import LEASE_BUSY, snooze_before_start

#: What a lease's ``key`` raises when the message's own arguments cannot name a key (a
#: missing or malformed argument): it would raise the same at every run, so the message is
#: rejected with the reason at once. Anything else (a look-up that failed) makes it wait.
MESSAGES_FAULT: tuple[type[Exception], ...] = (TypeError, ValueError, KeyError, IndexError, AttributeError)

logger = logging.getLogger("standmeet.middleware")

Seconds = Callable[[], float]


@dataclass(frozen=True)
class Lease:
    """How an actor leases a key: at most one of its messages in flight per key."""

    key: Callable[[MessageProxy], Any]
    take: str
    release: str
    lease_s: Seconds
    busy_snooze_s: Seconds
    #: Run first, in the release's transaction (e.g. to lock the key's row, so that the
    #: release's statement, with a snapshot taken after that lock, sees what committed before).
    release_lock: str | None = None


@dataclass(frozen=True)
class Held:
    """A lease this run holds: the key leased, its token, and what ``take`` read beside it."""

    lease: Lease
    key: Any
    token: str
    row: tuple[Any, ...] = ()


def lease_of(message: Any) -> Held | None:
    """The lease this run holds, if the middleware took one for it (and it was not given back)."""
    held: Held | None = getattr(message, "standmeet_lease", None)
    return held


def read_without_lease(message: Any) -> tuple[Any, ...]:
    """What ``take`` read beside a NULL token (the message needed no lease): the columns
    after the token and the key, or () when it read nothing."""
    row: tuple[Any, ...] = getattr(message, "standmeet_lease_read", ())
    return row


def given_back(message: Any) -> None:
    """The actor released the lease itself (its outcome's statement did): the middleware
    does not release it again. Call it only once that statement has committed."""
    message.standmeet_lease = None


class LeaseStore(Protocol):
    """Where leases are taken and given back."""

    def take(self, lease: Lease, key: Any) -> tuple[Any, ...] | None:
        """The row ``lease.take`` returns for ``key`` (token first), or None when it is busy."""
        ...

    def release(self, held: Held, message_id: str) -> None:
        """Give ``held`` back, only if its token is still the holder's."""
        ...


class PostgresLeases:
    """Leases as rows: ``take`` and ``release`` run as autocommit statements."""

    def __init__(self) -> None:
        from broker.pg import db  # here, not at the top: a memory broker's store needs no database

        self._db = db

    def take(self, lease: Lease, key: Any) -> tuple[Any, ...] | None:
        with self._db.connection() as conn:
            row: tuple[Any, ...] | None = conn.execute(
                lease.take, {"key": key, "lease_s": outliving_lease_s(lease)}).fetchone()
        return row

    def release(self, held: Held, message_id: str) -> None:
        params = {"key": held.key, "token": held.token, "message_id": message_id}
        with self._db.connection() as conn:
            if held.lease.release_lock is None:
                conn.execute(held.lease.release, params)
                return
            with conn.pipeline(), conn.transaction():  # one round trip
                conn.execute(held.lease.release_lock, params)
                conn.execute(held.lease.release, params)


#: How much longer than what is left of its run's time limit a lease is taken for (the
#: run's after-hooks and settle, a loaded machine): a lease never expires under a holder
#: that still runs.
LEASE_OUTLIVES_LIMIT_S = 5.0


def outliving_lease_s(lease: Lease) -> float:
    """How long to take ``lease`` for: its ``lease_s``, or what is left of this run's time
    limit and :data:`LEASE_OUTLIVES_LIMIT_S` more, whichever is longer."""
    lease_s = float(lease.lease_s())
    left = deadline.remaining_s()
    return lease_s if left is None else max(lease_s, left + LEASE_OUTLIVES_LIMIT_S)


#: How long a message waits when its lease's own wait cannot be read.
FALLBACK_BUSY_WAIT_S = 1.0


def _busy_wait_s(lease: Lease) -> float:
    """How long a message waits for its lease: the lease's ``busy_snooze_s``, jittered up
    to half again (so waiters do not come back together); FALLBACK_BUSY_WAIT_S if that
    raises or is not a number of seconds."""
    try:
        wait = float(lease.busy_snooze_s())
    except Exception as exc:
        logger.warning("the lease's busy_snooze_s raised %s: %s; waiting %g s", type(exc).__name__, exc,
                       FALLBACK_BUSY_WAIT_S)
        wait = FALLBACK_BUSY_WAIT_S
    if not 0 <= wait < float("inf"):
        wait = FALLBACK_BUSY_WAIT_S
    return wait * (1 + random.random() / 2)


class KeyedLease(Middleware):
    #: A run of an actor without a lease costs this policy nothing (``broker.engine.hooks``).
    runs_only_with_options = frozenset({"lease"})

    def __init__(self, *, store: LeaseStore | None = None) -> None:
        self.store: LeaseStore = store if store is not None else PostgresLeases()

    @property
    def actor_options(self) -> set[str]:
        return {"lease"}

    def before_process_message(self, broker: Any, message: MessageProxy) -> None:
        lease: Lease | None = broker.get_actor(message.actor_name).options.get("lease")
        if lease is None:
            return
        # Whatever raises here (the key, the take, the wait), Dramatiq would log it and run
        # the job unleased: the message waits instead, a snooze (bounded by max_snoozes).
        try:
            key = lease.key(message)
        except MESSAGES_FAULT as exc:  # the message's arguments cannot name a key: never will
            reason = (f"{message.actor_name}: the lease key of message {message.message_id} cannot be made from "
                      f"its arguments ({type(exc).__name__}: {exc})")[:1000]
            logger.warning("%s; rejected", reason)
            message.options["error"] = reason
            message.fail()
            raise SkipMessage(reason) from None
        except Exception as exc:
            wait = _busy_wait_s(lease)
            logger.warning("%s: the lease key of message %s could not be found (%s: %s); the message waits %.1f s",
                           message.actor_name, message.message_id, type(exc).__name__, exc, wait)
            snooze_before_start(message, wait, f"{message.actor_name}: its lease key could not be found")
        if key is None:
            return  # this message needs no lease (the actor records why)
        try:
            taken = self.store.take(lease, key)
        except Exception as exc:
            wait = _busy_wait_s(lease)
            logger.warning("%s: could not take the lease of key %s (%s: %s); the message waits %.1f s",
                           message.actor_name, key, type(exc).__name__, exc, wait)
            snooze_before_start(message, wait, f"{message.actor_name}: the lease of key {key} could not be taken")
        if taken is None:
            snooze_before_start(message, _busy_wait_s(lease), f"{message.actor_name}: key {key} is busy",
                                label=LEASE_BUSY)
        if taken[0] is None:
            message.standmeet_lease_read = tuple(taken[2:])  # type: ignore[attr-defined]
            return  # the statement found nothing to lease (the actor records why)
        leased = taken[1] if len(taken) > 1 and taken[1] is not None else key
        message.standmeet_lease = Held(lease, leased, str(taken[0]), tuple(taken[2:]))  # type: ignore[attr-defined]

    def _release(self, message: MessageProxy) -> None:
        held: Held | None = getattr(message, "standmeet_lease", None)
        if held is None:
            return
        message.standmeet_lease = None  # type: ignore[attr-defined]
        try:
            self.store.release(held, message.message_id)
        except Exception as exc:  # the lease then expires by itself
            logger.warning("could not give back the lease of key %s: %s", held.key, exc)

    def after_process_message(self, broker: Any, message: MessageProxy, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        self._release(message)

    def after_skip_message(self, broker: Any, message: MessageProxy) -> None:
        self._release(message)
