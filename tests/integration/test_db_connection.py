"""``broker.pg.db.connection()``, the connection a job borrows: Postgres stops a statement
at the job's deadline; a session whose statement_timeout is already close enough to it
is kept without a round trip, never later than the deadline and never more than the
slack before it; a connection killed while idle is replaced instead of failing the job;
through a transaction pooler the deadline is ``SET LOCAL`` and reaches no other client.
Against the real server (and a real PgBouncer)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import dramatiq
import psycopg
import pytest
from psycopg_pool import ConnectionPool

from broker import deadline, services
from broker.errors import DeadlineExceeded
from broker.pg import db
from broker.pg.pool import SET_STATEMENT_TIMEOUT, topology_for, use_settings
from tests.conftest import configured_broker
from tests.support.db import scalar, wait_for
from tests.support.pgbouncer import missing_reason, pgbouncer

pytestmark = pytest.mark.pooler

SHOW_MS = "SELECT setting::int FROM pg_settings WHERE name = 'statement_timeout'"
APP_BACKENDS = """
SELECT array_agg(pid) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-app' AND pid <> pg_backend_pid()
"""
KILL = "SELECT count(pg_terminate_backend(pid)) FROM unnest(%s::int[]) AS pid"
ALIVE = "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY(%s::int[])"


@pytest.fixture
def job() -> Iterator[Callable[[float | None], None]]:
    """This thread runs a job whose deadline is the given number of seconds away."""
    yield deadline.set_deadline
    deadline.clear()


@pytest.fixture
def sets(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The statement_timeout each SET of this test asked for (the SETs still run)."""
    seen: list[int] = []
    real_execute = psycopg.Connection.execute

    def execute(self: psycopg.Connection[Any], query: Any, params: Any = None, **kwargs: Any) -> Any:
        if query == SET_STATEMENT_TIMEOUT:
            seen.append(int(params[0]))
        return real_execute(self, query, params, **kwargs)

    monkeypatch.setattr(psycopg.Connection, "execute", execute)
    return seen


@contextmanager
def own_services(url: str, **overrides: object) -> Iterator[dramatiq.Broker]:
    """A broker (and application pool) of the test's own on ``url``; the module's back after."""
    previous = services.current()
    try:
        with configured_broker(url, **overrides) as configured:
            yield configured
    finally:
        services.install(previous)
        dramatiq.set_broker(previous.broker)
        use_settings(previous.settings)


def session_is_ours(url: str) -> bool:
    return topology_for(url).session_state


def test_a_statement_past_the_jobs_deadline_is_stopped_by_postgres(broker, job):
    # Given a job with 0.5 s left, which has borrowed a connection moments before
    job(0.5)
    with db.connection() as conn:
        conn.execute("SELECT 1")
    for _ in range(2):  # the second borrowing keeps the session's timeout where it is ours
        # When a statement would run for 30 s
        with db.connection() as conn:
            started = time.monotonic()
            with pytest.raises(psycopg.errors.QueryCanceled) as stopped:
                conn.execute("SELECT pg_sleep(30)")
            took = time.monotonic() - started
        # Then Postgres stopped it at the deadline, not 30 s later
        assert "statement timeout" in str(stopped.value)
        assert took < 0.5 + 2.0, took  # the deadline, and a loaded machine's delay at most
        job(0.5)


def test_a_time_limit_longer_than_postgres_takes_leaves_statements_the_most_it_allows(broker, job):
    # Given a job with thirty days left (a statement_timeout Postgres cannot hold)
    job(30 * 86_400)
    # When it borrows a connection and runs a statement
    with db.connection() as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
        # Then its statements may run as long as Postgres allows
        if session_is_ours(services.current().url):
            assert conn.execute(SHOW_MS).fetchone() == (db.MAX_STATEMENT_TIMEOUT_MS - db.STATEMENT_TIMEOUT_SLACK_MS,)


def test_a_job_waiting_for_a_connection_stops_at_its_deadline_not_the_pools_timeout(database_url, job):
    # Given an application pool of two connections, both borrowed by other jobs
    with own_services(database_url, pool_max_size=2):
        pool = services.current().app_pool
        held = [pool.getconn() for _ in range(pool.max_size)]
        try:
            # When a job with half a second left asks for one
            job(0.5)
            started = time.monotonic()
            with pytest.raises(DeadlineExceeded, match="waited for a database connection"):
                with db.connection():
                    pass
            took = time.monotonic() - started
        finally:
            for conn in held:
                pool.putconn(conn)
    # Then it stopped at its deadline, not after the pool's checkout timeout (10 s)
    assert took < 0.5 + 2.0, took


def test_a_session_close_enough_to_the_deadline_is_kept_without_a_round_trip(broker, database_url, job, sets,
                                                                              monkeypatch):
    if not session_is_ours(database_url):
        pytest.skip("through a transaction pooler the deadline is SET LOCAL in each borrowing's transaction")
    # (a wide slack and keep window, so that a loaded machine cannot make the borrowings
    # below outlive them: what is under test is that a kept session needs no SET)
    monkeypatch.setattr(db, "STATEMENT_TIMEOUT_SLACK_MS", 5_000)
    monkeypatch.setattr(db, "KEEP_SET_WITHIN_S", 60.0)
    # Given a job with 60 s left borrowing again and again, each time the connection the
    # pool hands out (more borrowings than the pool holds connections)
    job(60.0)
    backends: list[int] = []
    for _ in range(2 * broker.settings.pool_max_size + 2):
        with db.connection() as conn:
            backends.append(conn.info.backend_pid)
    # Then each connection had its statement_timeout set once, at its first borrowing
    assert len(sets) <= len(set(backends)) < len(backends), (sets, backends)
    assert all(54_000 <= ms <= 60_000 for ms in sets), sets  # 60 s left, less the (widened) slack


def test_a_kept_timeout_never_lets_a_statement_run_past_the_deadline_nor_stops_it_more_than_the_slack_early(
        broker, database_url, job, sets):
    if not session_is_ours(database_url):
        pytest.skip("through a transaction pooler the deadline is SET LOCAL in each borrowing's transaction")
    # Given jobs whose deadlines are close to each other, farther apart, or none at all,
    # borrowing one after the other
    slack = db.STATEMENT_TIMEOUT_SLACK_MS
    for left in [15.0, 15.0, 14.9, 14.8, 14.76, 15.2, 15.0, 30.0, None, 15.0, 2.0, 1.9, 0.3, 15.0, 14.99]:
        job(left)
        before = deadline.remaining_s()
        with db.connection() as conn:
            row = conn.execute(SHOW_MS).fetchone()
        after = deadline.remaining_s()
        assert row is not None
        shown = int(row[0])
        # Then what the session held stopped a statement no later than the deadline, and
        # at most the slack (a tenth of what remains, if less) before it
        if left is None:
            assert shown == 0
            continue
        assert before is not None and after is not None
        assert shown <= before * 1000, (left, shown, before)
        assert shown >= after * 1000 - min(slack, before * 100) - 1, (left, shown, after)
    assert len(sets) < 15  # and some borrowings kept the session as it was


@pytest.mark.parametrize("keep_within_s", [60.0, 0.0], ids=["kept session", "session set again"])
def test_a_connection_killed_while_idle_is_replaced_instead_of_failing_the_job(
        direct_database_url, database_url, job, monkeypatch, keep_within_s):
    if not session_is_ours(database_url):
        pytest.skip("through a transaction pooler pg_terminate_backend ends PgBouncer's server connection")
    monkeypatch.setattr(db, "KEEP_SET_WITHIN_S", keep_within_s)
    with own_services(database_url):  # a pool of its own: it holds only the connection below
        # Given a job's connection given back to the pool, its backend then terminated
        job(15.0)
        with db.connection() as conn:
            first = conn.info.backend_pid
        killed = scalar(direct_database_url, APP_BACKENDS)
        assert first in killed
        assert scalar(direct_database_url, KILL, (killed,)) == len(killed)
        wait_for(lambda: scalar(direct_database_url, ALIVE, (killed,)) == 0, timeout_s=10,
                 what="the terminated backends to exit")
        # When the job borrows a connection again
        with db.connection() as conn:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
    # Then it got a live one, not an error
    assert row is not None and row[0] not in killed


def test_a_dead_connection_the_pool_hands_out_is_replaced_by_the_set(direct_database_url, database_url, job):
    if not session_is_ours(database_url):
        pytest.skip("through a transaction pooler pg_terminate_backend ends PgBouncer's server connection")
    # Given a pool that hands out connections unchecked, holding one whose backend was
    # terminated while it was idle
    pool = ConnectionPool(direct_database_url, min_size=0, max_size=2, open=True, timeout=10,
                          kwargs={"autocommit": True, "application_name": "standmeet-app"})
    try:
        job(15.0)
        conn = db._checkout(pool, 15_000)
        dead = conn.info.backend_pid
        pool.putconn(conn)
        assert scalar(direct_database_url, KILL, ([dead],)) == 1
        wait_for(lambda: scalar(direct_database_url, ALIVE, ([dead],)) == 0, timeout_s=10,
                 what="the terminated backend to exit")
        # When a job needs a deadline its session does not hold
        conn = db._checkout(pool, 5_000)
        try:
            row = conn.execute("SELECT pg_backend_pid()").fetchone()
        finally:
            pool.putconn(conn)
    finally:
        pool.close()
    # Then the SET found it dead and the borrower got another
    assert row is not None and row[0] != dead


def test_through_a_transaction_pooler_the_deadline_is_set_local_and_reaches_no_other_client(
        admin_url, direct_database_url, job):
    if missing_reason():
        pytest.skip(missing_reason())
    # Given a transaction pooler with a single server connection
    with pgbouncer(admin_url, mode="transaction", default_pool_size=1) as bouncer:
        url = bouncer.url(direct_database_url)
        with own_services(url, pooler="transaction"):
            # When a job with 15 s left runs statements in its borrowed connection
            job(15.0)
            with db.connection() as conn:
                inside = conn.execute(SHOW_MS).fetchone()
                in_transaction = conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
            job(None)
            # Then another client of the pooler, served by that same server connection,
            # runs without it
            with psycopg.connect(url, autocommit=True, prepare_threshold=None) as other:
                outside = other.execute(SHOW_MS).fetchone()
    assert in_transaction  # SET LOCAL: the borrowing is one transaction
    assert inside is not None and 14_000 < inside[0] <= 15_000
    assert outside == (0,)
