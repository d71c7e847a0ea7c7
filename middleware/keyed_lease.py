"""Keyed lease: at most one message in flight per key, across processes and hosts.

An actor declares its lease with the ``lease`` option (a :class:`Lease`): how to find a
message's key, and the two statements that take and give back a row lease with a token
and a database-clock expiry. Before the actor runs, this middleware takes the lease in
one autocommit statement; no row back means the key is busy: the message **snoozes**
(a few seconds plus jitter), which never counts a retry and never fires failure
callbacks. After the actor — returned, raised, cancelled or skipped — the lease is
given back, only if the token is still ours. The lease outlives the job's time limit,
so a crashed worker's lease expires by itself. No transaction is held across the
actor's work: each statement commits alone.

    @dramatiq.actor(lease=Lease(key=endpoint_of, take=TAKE, release=RELEASE,
                                lease_s=lambda: 20.0, busy_snooze_s=lambda: 2.0))
    def deliver(delivery_id): ...

``take`` receives ``%(key)s`` and ``%(lease_s)s`` and returns the token when the lease
was free; ``release`` receives ``%(key)s`` and ``%(token)s``. ``key(message)`` may read
the database (short reads); it returns None when the message needs no lease.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dramatiq import Middleware
from dramatiq.broker import MessageProxy

from broker import db
from middleware.snooze import snooze_before_start

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


def lease_of(message: Any) -> tuple[Any, str] | None:
    """The (key, token) this run holds, if the middleware took a lease for it."""
    held = getattr(message, "standmeet_lease", None)
    return (held[1], held[2]) if held is not None else None


class KeyedLease(Middleware):
    @property
    def actor_options(self) -> set[str]:
        return {"lease"}

    def before_process_message(self, broker: Any, message: MessageProxy) -> None:
        lease: Lease | None = broker.get_actor(message.actor_name).options.get("lease")
        if lease is None:
            return
        key = lease.key(message)
        if key is None:
            return  # this message needs no lease (the actor records why)
        with db.connection() as conn:
            taken = conn.execute(lease.take, {"key": key, "lease_s": lease.lease_s()}).fetchone()
        if taken is None:
            wait = lease.busy_snooze_s() * (1 + random.random() / 2)
            snooze_before_start(message, wait, f"{message.actor_name}: key {key} is busy")
        message.standmeet_lease = (lease, key, str(taken[0]))  # type: ignore[attr-defined]

    def _release(self, message: MessageProxy) -> None:
        held = getattr(message, "standmeet_lease", None)
        if held is None:
            return
        message.standmeet_lease = None  # type: ignore[attr-defined]
        lease, key, token = held
        try:
            with db.connection() as conn:
                conn.execute(lease.release, {"key": key, "token": token})
        except Exception as exc:  # the lease then expires by itself
            logger.warning("could not give back the lease of key %s: %s", key, exc)

    def after_process_message(self, broker: Any, message: MessageProxy, *, result: Any = None,
                              exception: BaseException | None = None) -> None:
        self._release(message)

    def after_skip_message(self, broker: Any, message: MessageProxy) -> None:
        self._release(message)
