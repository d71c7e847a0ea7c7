"""The application's psycopg 3 pool, and the connection helper jobs use.

A job borrows a connection for a short piece of work and gives it back before any
network call. The helper sets ``statement_timeout`` to what remains of the
job's time limit, so a long query is stopped by Postgres where the async exception
of the time limit could not reach it.

On a connection whose session is this process's own (direct, or a session pooler) the
deadline is a session setting of the borrowed connection, which stays in autocommit.
The setting is left as it is, without a round trip, when it already stops a statement
no later than the borrower's deadline and at most :data:`STATEMENT_TIMEOUT_SLACK_MS` (1 s)
(and a tenth of what remains) before it; it is set that much under what remains, so
a job's next borrowings, and other jobs' with a deadline close to it, keep it. A
connection given back more than :data:`KEEP_SET_WITHIN_S` ago is set whatever its
timeout: that round trip also proves it alive. A borrower never changes the session's
``statement_timeout`` (``SET LOCAL`` inside a transaction is fine).
Through a transaction pooler a session setting would outlive the job on a server
connection another client gets next, so there the borrowed connection runs in one
transaction, its deadline ``SET LOCAL``: committed when the block ends, rolled back if it
raises.

An ``async def`` actor uses :func:`aconnection` instead (``async with db.aconnection() as
conn``): the same deadline on a connection of the block's own, so that no statement
blocks the event loop the process's async jobs share.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from broker import deadline, services
from broker.errors import DatabaseUnavailable, DeadlineExceeded
from broker.pg.pool import (
    SET_LOCAL_STATEMENT_TIMEOUT,
    SET_STATEMENT_TIMEOUT,
    close_quietly,
    connect_kwargs,
    open_app_pool,
    topology_for,
)

__all__ = ["aconnection", "close_quietly", "connection", "open_pool"]

open_pool = open_app_pool

#: A borrowed session's statement_timeout is kept when it stops a statement no later than
#: the borrower's deadline and at most this long before it (and at most a tenth of what
#: remains: :func:`_slack_ms`); a SET makes it that much under what remains. Concurrent
#: jobs share sessions (the pool hands them out in turn) when their deadlines are this
#: close: with 250 ms, eight jobs of ~1 s each, borrowing in turn, still SET on half
#: their borrowings.
STATEMENT_TIMEOUT_SLACK_MS = 1000
#: A connection given back longer ago than this gets its SET whatever its timeout (the
#: round trip that also proves it alive); one given back sooner was checked by the pool
#: (:func:`broker.pg.pool.check_cheaply`: a server's goodbye is seen without a round trip).
KEEP_SET_WITHIN_S = 1.0


@dataclass
class _Session:
    """What this process last set on a pooled connection's session, and when it was given back."""

    timeout_ms: int
    returned_at: float


#: The statement_timeout each pooled connection's session holds, as this module set it.
_sessions: WeakKeyDictionary[psycopg.Connection[Any], _Session] = WeakKeyDictionary()


@contextmanager
def connection(*, timeout_s: float | None = None) -> Iterator[psycopg.Connection]:
    """A pooled autocommit connection whose statements stop at the job's deadline.

    Use ``with conn.transaction():`` inside for multi-statement work. Return the
    connection (leave the ``with``) before calling the network.
    """
    found = services.current()
    pool = found.app_pool
    limit = deadline.remaining_s()
    if timeout_s is not None:
        limit = timeout_s if limit is None else min(limit, timeout_s)
    session = topology_for(found.url).session_state
    conn = _checkout(pool, _ms(limit), session=session, wait_s=limit)
    try:
        if session:
            yield conn
        else:
            with conn.transaction():
                conn.execute(SET_LOCAL_STATEMENT_TIMEOUT, (str(_ms(limit)),))
                yield conn
    finally:
        kept = _sessions.get(conn) if session else None
        if kept is not None:
            kept.returned_at = time.monotonic()
        pool.putconn(conn)


@asynccontextmanager
async def aconnection(*, timeout_s: float | None = None) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
    """For ``async def`` actors: an autocommit async connection whose statements stop at
    the job's deadline (its ``statement_timeout``, ``SET LOCAL`` in one transaction through
    a transaction pooler). One connection for the block, closed when it ends: a running
    async job holds at most the one it opened, as a sync job holds one of the pool's."""
    found = services.current()
    limit = deadline.remaining_s()
    if timeout_s is not None:
        limit = timeout_s if limit is None else min(limit, timeout_s)
    session = topology_for(found.url).session_state
    try:
        conn = await psycopg.AsyncConnection.connect(found.url, autocommit=True, **connect_kwargs(found.url))
    except psycopg.OperationalError as exc:
        raise DatabaseUnavailable(str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)) from exc
    try:
        if session:
            await conn.execute(SET_STATEMENT_TIMEOUT, (str(_ms(limit)),))
            yield conn
        else:
            async with conn.transaction():
                await conn.execute(SET_LOCAL_STATEMENT_TIMEOUT, (str(_ms(limit)),))
                yield conn
    finally:
        await conn.close()


def _checkout(pool: ConnectionPool, statement_timeout_ms: int, *, session: bool = True,
              wait_s: float | None = None) -> psycopg.Connection:
    """A pooled connection, its statement_timeout set for the session where the session is
    ours (or kept: :func:`_keeps`). The pool hands out only connections that look alive;
    the SET, when one is needed, is the real check: a connection killed while idle (server
    restart, pg_terminate_backend) is dropped and replaced once, instead of failing the job.

    It waits for a free connection the pool's checkout timeout at most, and no longer than
    ``wait_s`` (what is left of the job: a wait inside the pool is one no interruption
    reaches, so the job's time limit would land only once it ended); a wait the job's
    deadline ended raises :class:`broker.errors.DeadlineExceeded`."""
    for attempt in (1, 2):
        capped = wait_s is not None and wait_s < pool.timeout
        try:
            conn = pool.getconn(timeout=max(0.001, wait_s) if capped and wait_s is not None else None)
        except PoolTimeout as exc:
            if capped:
                raise DeadlineExceeded(f"the job's time limit passed while it waited for a database "
                                       f"connection (all {pool.max_size} were in use)") from exc
            raise DatabaseUnavailable(f"no application connection became free: {exc}") from exc
        if not session:
            return conn  # the deadline is SET LOCAL in the block's own transaction
        kept = _sessions.get(conn)
        if kept is not None and time.monotonic() - kept.returned_at < KEEP_SET_WITHIN_S \
                and _keeps(kept.timeout_ms, statement_timeout_ms):
            return conn
        target_ms = _target_ms(statement_timeout_ms)
        try:
            conn.execute(SET_STATEMENT_TIMEOUT, (str(target_ms),))
        except psycopg.OperationalError as exc:
            _sessions.pop(conn, None)
            pool.putconn(conn)  # broken: the pool discards it
            if attempt == 2:
                raise DatabaseUnavailable(str(exc)) from exc
            continue
        except BaseException:
            _sessions.pop(conn, None)  # set or not: the next borrower sets it
            pool.putconn(conn)  # never lost (a time limit's exception may land here)
            raise
        _sessions[conn] = _Session(target_ms, time.monotonic())
        return conn
    raise AssertionError("unreachable")


def _slack_ms(needed_ms: int) -> int:
    """How much earlier than ``needed_ms`` a kept statement_timeout may stop a statement:
    STATEMENT_TIMEOUT_SLACK_MS, and never more than a tenth of it."""
    return min(STATEMENT_TIMEOUT_SLACK_MS, needed_ms // 10)


def _keeps(current_ms: int, needed_ms: int) -> bool:
    """Whether a session whose statement_timeout is ``current_ms`` serves a borrower that
    needs ``needed_ms`` (0: no limit): it stops a statement no later than needed, and at
    most :func:`_slack_ms` earlier."""
    if needed_ms == 0 or current_ms == 0:
        return current_ms == needed_ms
    return needed_ms - _slack_ms(needed_ms) <= current_ms <= needed_ms


def _target_ms(needed_ms: int) -> int:
    """The statement_timeout to set for a borrower that needs ``needed_ms``: the slack
    under it, so that the job's next borrowings keep it."""
    if needed_ms == 0:
        return 0
    return max(1, needed_ms - _slack_ms(needed_ms))


#: The longest statement_timeout Postgres takes (an int4 of milliseconds, about 24.8 days):
#: a longer time limit leaves statements the most Postgres allows.
MAX_STATEMENT_TIMEOUT_MS = 2_147_483_647


def _ms(limit_s: float | None) -> int:
    if limit_s is None:
        return 0  # no limit outside a job
    return min(MAX_STATEMENT_TIMEOUT_MS, max(1, int(limit_s * 1000)))
