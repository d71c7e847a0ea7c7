"""Dramatiq's rate-limiter backend on Postgres (``standmeet.rate_limits``).

It serves every Dramatiq limiter and synchroniser built on a ``RateLimiterBackend``:
``ConcurrentRateLimiter``, ``WindowRateLimiter``, ``BucketRateLimiter``, ``Barrier``
and so the ``GroupCallbacks`` middleware.

What it guarantees:

* A key lives until ``ttl`` milliseconds after it was last written, by the database's
  clock; an expired row counts as absent (a counter of 0, no event) for every operation,
  whether or not :func:`prune_expired_once` has deleted it yet.
* ``add``, ``incr``, ``decr`` and ``wait_notify`` are single statements
  (``INSERT … ON CONFLICT``): the bound is checked on the row as it is when the
  statement holds its lock, so concurrent callers in any number of processes never
  push a counter past its maximum (or below its minimum) and no update is lost.
* ``incr_and_sum`` locks every key it sums over (in one statement, in key order, so
  callers cannot deadlock) before it checks and increments, in one short transaction:
  the sum it checks is the sum it commits against. For the keys of Dramatiq's
  ``WindowRateLimiter`` (``<key>@<unix second>``) it also takes one lock for the whole
  limiter, and counts the :data:`FUTURE_BUCKETS` buckets after its own window: a caller
  whose clock read an earlier second than another's (the second turned between them,
  or their hosts' clocks are up to that many seconds apart) still sees what the other
  admitted, so the limit holds exactly across processes.
* ``wait`` does not poll: it reads the key once, then sleeps until a NOTIFY for that key
  (sent by ``wait_notify`` in the same statement that records the event), the listener
  reconnecting, or the timeout. An event recorded before the wait started is seen at
  once, as with Dramatiq's Redis backend. Each backend object keeps at most one LISTEN
  connection per process, on a thread started through :mod:`broker.detach`.
* The writes a job's end makes (``decr``: a limiter's release, a group member's arrival
  at its barrier; ``wait_notify``: the barrier's release) wait for a database that
  cannot be reached, trying again at growing intervals (``write_wait_s``; None, the
  default: until it is back, or the backend is closed): they are not lost in an outage.
  A decrement is repeated only when it cannot have reached the server (no connection).
  What a caller waits on (``add``, ``incr``, ``incr_and_sum``: an acquisition, a group's
  creation in a request) fails at once, as reads do.
* psycopg errors never escape: a connection problem is
  :class:`broker.errors.DatabaseUnavailable`, anything else
  :class:`broker.errors.DatabaseError`, each raised ``from`` the psycopg error.

Counters are assumed to be integers that fit a bigint; keys must be shorter than
Postgres' NOTIFY payload limit (8000 bytes) to be waited on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from dramatiq.rate_limits import RateLimiterBackend
from psycopg_pool import ConnectionPool

from broker.backends.results import (
    connect_backend,
    fetch_one,
    nothing_was_sent,
    prune_expired,
    reachable_later,
    translated_errors,
    written_when_reachable,
)

#: The NOTIFY channel events are announced on; the payload is the event's key.
RATE_LIMITS_CHANNEL = "standmeet_rate_limits"

#: How many expired rows one prune statement deletes at most.
DEFAULT_PRUNE_BATCH = 1000

#: Create the key with ``value`` unless a live one exists (an expired one is replaced).
ADD = """
INSERT INTO standmeet.rate_limits AS r (key, value, expires_at)
VALUES (%(key)s, %(value)s, now() + %(ttl_ms)s * interval '1 millisecond')
ON CONFLICT (key) DO UPDATE
    SET value = EXCLUDED.value, expires_at = EXCLUDED.expires_at
    WHERE r.expires_at <= now()
RETURNING true
"""

# INCREMENT and DECREMENT: the live value (0 if absent or expired) moves by
# %(delta)s when the result stays within the bound; the key's TTL restarts. A key that
# did not exist and would break the bound is written as an expired 0, which every
# operation reads as absent: the statement never needs to read before it writes.
# The returned flag says whether the value moved.

#: Add ``delta`` unless the result would exceed ``maximum``.
INCREMENT = """
INSERT INTO standmeet.rate_limits AS r (key, value, expires_at)
VALUES (%(key)s,
        CASE WHEN %(delta)s <= %(maximum)s THEN %(delta)s ELSE 0 END,
        CASE WHEN %(delta)s <= %(maximum)s
             THEN now() + %(ttl_ms)s * interval '1 millisecond'
             ELSE '-infinity' END)
ON CONFLICT (key) DO UPDATE
    SET value = CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + %(delta)s,
        expires_at = now() + %(ttl_ms)s * interval '1 millisecond'
    WHERE CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + %(delta)s <= %(maximum)s
RETURNING r.expires_at > now()
"""

#: Subtract ``amount`` (``delta`` is its negation) unless the result would drop below ``minimum``.
DECREMENT = """
INSERT INTO standmeet.rate_limits AS r (key, value, expires_at)
VALUES (%(key)s,
        CASE WHEN %(delta)s >= %(minimum)s THEN %(delta)s ELSE 0 END,
        CASE WHEN %(delta)s >= %(minimum)s
             THEN now() + %(ttl_ms)s * interval '1 millisecond'
             ELSE '-infinity' END)
ON CONFLICT (key) DO UPDATE
    SET value = CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + %(delta)s,
        expires_at = now() + %(ttl_ms)s * interval '1 millisecond'
    WHERE CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + %(delta)s >= %(minimum)s
RETURNING r.expires_at > now()
"""

#: First step of incr_and_sum: make a row exist for every key (absent ones are written
#: expired, i.e. still absent) and lock them all, in key order. ``DO UPDATE … WHERE false``
#: locks an existing row without writing a new version of it.
LOCK_KEYS = """
INSERT INTO standmeet.rate_limits AS r (key, value, expires_at)
SELECT k, 0, '-infinity' FROM unnest(%(keys)s::text[]) AS k ORDER BY k
ON CONFLICT (key) DO UPDATE SET value = r.value WHERE false
"""

#: The lock class of a window limiter's lock (``pg_advisory_xact_lock(class, hash)``): the
#: two-integer lock space, apart from the runtime's single-bigint locks.
WINDOW_LOCK_CLASS = 0x524C  # "RL"

#: First step for a window limiter's keys: one lock for every bucket of the limiter, so
#: callers whose windows do not overlap (a one-second window, clocks a second apart) queue too.
LOCK_WINDOW = "SELECT pg_advisory_xact_lock(%(lock_class)s, hashtext(%(window)s))"

#: How many seconds after its own window a window limiter's caller counts: the clock
#: difference between two callers (hosts) under which the limit still holds exactly.
FUTURE_BUCKETS = 60

#: Second step: increment ``key`` if both it and the sum of the (locked) keys stay in bound;
#: for a window limiter the sum also counts its live buckets in ``future``.
INCREMENT_IF_SUM_ALLOWS = """
UPDATE standmeet.rate_limits AS r
SET value = CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + %(amount)s,
    expires_at = now() + %(ttl_ms)s * interval '1 millisecond'
WHERE r.key = %(key)s
  AND CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + %(amount)s <= %(maximum)s
  AND %(amount)s + (SELECT coalesce(sum(s.value), 0) FROM standmeet.rate_limits AS s
                    WHERE s.key = ANY(%(keys)s::text[] || %(future)s::text[])
                      AND s.expires_at > now()) <= %(maximum)s
RETURNING true
"""


def window_of(keys: Iterable[str]) -> tuple[str, list[str]] | None:
    """``(limiter, future)`` when every key is a bucket ``<limiter>@<unix second>`` of one
    window limiter: ``future`` names its :data:`FUTURE_BUCKETS` buckets after the newest
    of ``keys``. Otherwise None."""
    limiters: set[str] = set()
    newest = -1
    for key in keys:
        limiter, at, second = key.rpartition("@")
        if not at or not second.isascii() or not second.isdigit():
            return None
        limiters.add(limiter)
        newest = max(newest, int(second))
    if len(limiters) != 1:
        return None
    limiter = limiters.pop()
    return limiter, [f"{limiter}@{newest + ahead}" for ahead in range(1, FUTURE_BUCKETS + 1)]

#: Record one more occurrence of the event ``key`` (for ``ttl_ms``) and announce it.
NOTIFY_EVENT = """
WITH event AS (
    INSERT INTO standmeet.rate_limits AS r (key, value, expires_at)
    VALUES (%(key)s, 1, now() + %(ttl_ms)s * interval '1 millisecond')
    ON CONFLICT (key) DO UPDATE
        SET value = CASE WHEN r.expires_at > now() THEN r.value ELSE 0 END + 1,
            expires_at = EXCLUDED.expires_at
    RETURNING r.key
)
SELECT pg_notify(%(channel)s, key) FROM event
"""

#: Whether the event ``key`` has occurred and not expired.
EVENT_OCCURRED = """
SELECT EXISTS (
    SELECT 1 FROM standmeet.rate_limits
    WHERE key = %(key)s AND value > 0 AND expires_at > now()
)
"""

#: Delete one batch of expired keys (re-checked on rows written concurrently). The batch
#: is picked once, in a CTE: as a subquery, a plan may read it again for each row
#: deleted, skip the rows it just locked and deleted, and take the next batch, and the next.
PRUNE_EXPIRED_RATE_LIMITS = """
WITH batch AS MATERIALIZED (
    SELECT key FROM standmeet.rate_limits
    WHERE expires_at <= now()
    ORDER BY expires_at
    LIMIT %(batch)s
    FOR UPDATE SKIP LOCKED
)
DELETE FROM standmeet.rate_limits t
USING batch
WHERE t.key = batch.key
  AND t.expires_at <= now()
"""


def prune_expired_once(conn_or_url: psycopg.Connection[Any] | str, *, batch: int = DEFAULT_PRUNE_BATCH) -> int:
    """Delete at most ``batch`` expired keys; return how many were deleted.

    Call it again while it returns ``batch``. Safe to run from several processes at
    once. ``conn_or_url`` is a psycopg connection (committed if not autocommit) or a URL.
    """
    return prune_expired(conn_or_url, PRUNE_EXPIRED_RATE_LIMITS, batch=batch, what="pruning expired rate-limit keys")


class PostgresRateLimiterBackend(RateLimiterBackend):
    """Dramatiq rate-limiter keys in ``standmeet.rate_limits``; ``wait`` wakes on NOTIFY.

    Give either ``url`` (the backend opens its own small pool on first use) or
    ``pool`` (an existing psycopg pool; if its conninfo is not a plain string, give
    ``url`` as well for the LISTEN connection). Call :meth:`close` when done.

    The method signatures are Dramatiq's: every ``ttl`` and ``timeout`` is in
    milliseconds.
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        pool: ConnectionPool[Any] | None = None,
        pool_max_size: int = 4,
        checkout_timeout_ms: int = 10_000,
        reconnect_delay_ms: int = 1_000,
        application_name: str = "standmeet-rate-limits",
        write_wait_s: float | None = None,
    ) -> None:
        self.write_wait_s = write_wait_s
        self.database, self.listener = connect_backend(
            url=url, pool=pool, pool_max_size=pool_max_size, checkout_timeout_ms=checkout_timeout_ms,
            application_name=application_name, channel=RATE_LIMITS_CHANNEL, reconnect_delay_ms=reconnect_delay_ms,
        )

    def add(self, key: str, value: int, ttl: int) -> bool:
        """Create ``key`` with ``value`` for ``ttl`` ms unless it exists; True if created."""
        params = {"key": key, "value": int(value), "ttl_ms": int(ttl)}
        return self._flag("adding a rate-limit key", ADD, params)

    def incr(self, key: str, amount: int, maximum: int, ttl: int) -> bool:
        """Add ``amount`` unless the value would exceed ``maximum``; True if it was added."""
        params = {"key": key, "delta": int(amount), "maximum": int(maximum), "ttl_ms": int(ttl)}
        return self._flag("incrementing a rate-limit key", INCREMENT, params)

    def decr(self, key: str, amount: int, minimum: int, ttl: int) -> bool:
        """Subtract ``amount`` unless the value would drop below ``minimum``; True if it was."""
        params = {"key": key, "delta": -int(amount), "minimum": int(minimum), "ttl_ms": int(ttl)}
        return self._write("decrementing a rate-limit key", DECREMENT, params)

    def incr_and_sum(
        self,
        key: str,
        keys: Callable[[], Iterable[str]],
        amount: int,
        maximum: int,
        ttl: int,
    ) -> bool:
        """Add ``amount`` to ``key`` unless it, or ``amount`` plus the sum of ``keys()``,
        would exceed ``maximum``; True if it was added."""
        summed = sorted(set(keys()))
        locked = sorted({key, *summed})
        window = window_of(locked)
        params = {
            "key": key,
            "keys": summed,
            "amount": int(amount),
            "maximum": int(maximum),
            "ttl_ms": int(ttl),
            "future": window[1] if window else [],
        }
        with translated_errors("incrementing a rate-limit window"), self.database.connection() as conn:
            with conn.transaction():
                if window is not None:
                    conn.execute(LOCK_WINDOW, {"lock_class": WINDOW_LOCK_CLASS, "window": window[0]})
                conn.execute(LOCK_KEYS, {"keys": locked})
                row = conn.execute(INCREMENT_IF_SUM_ALLOWS, params).fetchone()
        return row is not None

    def wait(self, key: str, timeout: int | None) -> bool:
        """Wait up to ``timeout`` ms (None: for ever) until the event ``key`` has occurred."""
        deadline = None if timeout is None else time.monotonic() + timeout / 1000
        self.listener.start()
        with self.listener.watching(key) as woken:
            while True:
                if self._occurred(key):
                    return True
                if deadline is None:
                    woken.wait()
                else:
                    remaining_s = deadline - time.monotonic()
                    if remaining_s <= 0:
                        return False
                    woken.wait(remaining_s)
                woken.clear()

    def wait_notify(self, key: str, ttl: int) -> None:
        """Record that the event ``key`` occurred (for ``ttl`` ms) and wake its waiters."""
        params = {"key": key, "ttl_ms": int(ttl), "channel": RATE_LIMITS_CHANNEL}

        def notify() -> None:  # the same row and the same wake-up each time: harmless to repeat
            with translated_errors("notifying a rate-limit event"), self.database.connection() as conn:
                fetch_one(conn, NOTIFY_EVENT, params)

        written_when_reachable(f"rate-limit event {key}", notify, wait_s=self.write_wait_s,
                               repeatable=lambda exc: reachable_later(exc) and not self.database.closed)

    def close(self, *, timeout_ms: int = 5000) -> None:
        """Stop the listener and close the backend's own pool (a given pool stays open)."""
        self.listener.close(timeout_ms=timeout_ms)
        self.database.close()

    def _occurred(self, key: str) -> bool:
        return self._flag("reading a rate-limit event", EVENT_OCCURRED, {"key": key})

    def _write(self, what: str, query: str, params: dict[str, Any]) -> bool:
        return written_when_reachable(f"rate-limit key {params['key']}", lambda: self._flag(what, query, params),
                                      wait_s=self.write_wait_s,
                                      repeatable=lambda exc: nothing_was_sent(exc) and not self.database.closed)

    def _flag(self, what: str, query: str, params: dict[str, Any]) -> bool:
        with translated_errors(what), self.database.connection() as conn:
            row = fetch_one(conn, query, params)
        return bool(row is not None and row[0])
