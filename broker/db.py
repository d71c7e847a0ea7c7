"""The application's psycopg 3 pool, and the connection helper jobs use.

A job borrows a connection for a short piece of work and gives it back before any
network call. The helper sets ``statement_timeout`` to what remains of the
job's time limit, so a long query is stopped by Postgres where the async exception
of the time limit could not reach it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from broker import deadline, services
from broker.errors import DatabaseUnavailable
from broker.pgpool import close_quietly, open_app_pool

__all__ = ["close_quietly", "connection", "open_pool"]

open_pool = open_app_pool

SET_STATEMENT_TIMEOUT = "SELECT set_config('statement_timeout', %s, false)"


@contextmanager
def connection(*, timeout_s: float | None = None) -> Iterator[psycopg.Connection]:
    """A pooled autocommit connection whose statements stop at the job's deadline.

    Use ``with conn.transaction():`` inside for multi-statement work. Return the
    connection (leave the ``with``) before calling the network.
    """
    pool = services.current().app_pool
    limit = deadline.remaining_s()
    if timeout_s is not None:
        limit = timeout_s if limit is None else min(limit, timeout_s)
    conn = _checkout(pool, _ms(limit))
    try:
        yield conn
    finally:
        pool.putconn(conn)


def _checkout(pool: ConnectionPool, statement_timeout_ms: int) -> psycopg.Connection:
    """A pooled connection with its statement_timeout set; that first statement doubles as
    the health check: a connection killed while idle (server restart,
    pg_terminate_backend) is dropped and replaced once, instead of failing the job."""
    for attempt in (1, 2):
        try:
            conn = pool.getconn()
        except PoolTimeout as exc:
            raise DatabaseUnavailable(f"no application connection became free: {exc}") from exc
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
