"""The application's psycopg 3 pool, and the connection helper jobs use.

A job borrows a connection for a short piece of work and gives it back before any
network call. The helper sets ``statement_timeout`` to what remains of the
job's time limit, so a long query is stopped by Postgres where the async exception
of the time limit could not reach it.

On a connection whose session is this process's own (direct, or a session pooler) the
deadline is a session setting of the borrowed connection, which stays in autocommit.
Through a transaction pooler a session setting would outlive the job on a server
connection another client gets next, so there the borrowed connection runs in one
transaction, its deadline ``SET LOCAL``: committed when the block ends, rolled back if it
raises.

An ``async def`` actor uses :func:`aconnection` instead (``async with db.aconnection() as
conn``): the same deadline on a connection of the block's own, so that no statement
blocks the event loop the process's async jobs share.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from broker import deadline, services
from broker.errors import DatabaseUnavailable
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
    conn = _checkout(pool, _ms(limit), session=session)
    try:
        if session:
            yield conn
        else:
            with conn.transaction():
                conn.execute(SET_LOCAL_STATEMENT_TIMEOUT, (str(_ms(limit)),))
                yield conn
    finally:
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


def _checkout(pool: ConnectionPool, statement_timeout_ms: int, *, session: bool = True) -> psycopg.Connection:
    """A pooled connection, its statement_timeout set for the session where the session is
    ours. The pool hands out only connections that look alive; the first statement is
    the real check: a connection killed while idle (server restart, pg_terminate_backend)
    is dropped and replaced once, instead of failing the job."""
    for attempt in (1, 2):
        try:
            conn = pool.getconn()
        except PoolTimeout as exc:
            raise DatabaseUnavailable(f"no application connection became free: {exc}") from exc
        if not session:
            return conn  # the deadline is SET LOCAL in the block's own transaction
        try:
            conn.execute(SET_STATEMENT_TIMEOUT, (str(statement_timeout_ms),))
            return conn
        except psycopg.OperationalError as exc:
            pool.putconn(conn)  # broken: the pool discards it
            if attempt == 2:
                raise DatabaseUnavailable(str(exc)) from exc
    raise AssertionError("unreachable")


def _ms(limit_s: float | None) -> int:
    if limit_s is None:
        return 0  # no limit outside a job
    return max(1, int(limit_s * 1000))
