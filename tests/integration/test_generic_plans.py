"""The broker's own connections plan each prepared statement once, generically, from its
first execution: Postgres would otherwise plan each of its first five executions for
their values before settling on that generic plan, so a new connection's first claims,
settles and sends each paid for a plan. The application's connections are left to the
planner's own choice."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from broker.engine import sql
from broker.engine.codec import claim_size_params
from broker.pg import db
from broker.pg.pool import connect, plans_generic, topology_for

pytestmark = pytest.mark.pooler

#: How often Postgres planned a statement of this session for its values, and generically.
PLANS = """
SELECT coalesce(sum(custom_plans), 0)::int, coalesce(sum(generic_plans), 0)::int
FROM pg_prepared_statements WHERE statement LIKE %s
"""
PLAN_CACHE_MODE = "SELECT current_setting('plan_cache_mode')"


def plans_of(conn: psycopg.Connection, starts_with: str) -> tuple[int, int]:
    """(custom plans, generic plans) of this session's prepared statements that start so."""
    row = conn.execute(PLANS, ("%" + starts_with.strip()[:40] + "%",), prepare=False).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def claim_params() -> dict:
    return {"queue": f"q_{uuid.uuid4().hex[:8]}", "n": 8, "n_start": 8, "worker_id": str(uuid.uuid4()),
            **claim_size_params(1 << 20)}


def statements_prepared_in_our_own_session(url: str) -> bool:
    topology = topology_for(url)
    return topology.prepare and topology.session_state


def test_a_consumers_connection_runs_its_first_claims_on_the_generic_plan_planned_once(database_url):
    if not statements_prepared_in_our_own_session(database_url):
        assert not plans_generic(database_url, at_first_use=True)  # nothing set for a session not ours
        pytest.skip("through a transaction pooler, statements are not prepared: each is planned for its values")
    # Given the kind of connection every consumer, the settler and the heartbeat open
    with connect(database_url, application_name="standmeet-test-consumer", at_first_use=True) as conn:
        # When it claims three times (an empty queue: the claim is planned all the same)
        for _ in range(3):
            conn.execute(sql.CLAIM, claim_params()).fetchall()
        # Then the claim was planned once, generically, and never for its values
        assert plans_of(conn, sql.CLAIM) == (0, 3)
        assert conn.execute(PLAN_CACHE_MODE).fetchone() == ("force_generic_plan",)


def test_the_brokers_pool_runs_its_statements_on_their_generic_plan_from_the_first(broker, database_url):
    if not statements_prepared_in_our_own_session(database_url):
        pytest.skip("through a transaction pooler, statements are not prepared: each is planned for its values")
    # Given the pool the broker sends, beats and rescues on
    with broker.pool.connection() as conn:
        # When a statement runs on one of its connections for the first times
        for _ in range(2):
            conn.execute(sql.OUTSTANDING, {"queue": "default"}).fetchone()
        # Then Postgres never planned it for its values
        assert plans_of(conn, sql.OUTSTANDING) == (0, 2)


def test_the_applications_connections_are_left_to_the_planners_own_choice(broker, database_url):
    if not topology_for(database_url).session_state:
        pytest.skip("through a transaction pooler, a session's setting is nobody's")
    with db.connection() as conn:
        assert conn.execute(PLAN_CACHE_MODE).fetchone() == ("auto",)
    with connect(database_url, application_name="standmeet-test-listener") as conn:
        assert conn.execute(PLAN_CACHE_MODE).fetchone() == ("auto",)
