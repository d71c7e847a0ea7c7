"""A settle finds each claim's row by its message id, whatever the statistics say: no
plan of the statements that settle, mark started or give back claims can read the
claimed rows' index (every process's claims) instead. With statistics that counted few
claimed rows, the planner scanned them all for each outcome of a batch and compared
each with every outcome: quadratic in the batch, and growing with each process beside it."""

from __future__ import annotations

import re
import time
import uuid

import psycopg
import pytest

from broker.engine import sql
from broker.engine.settler import Outcome, timing_params

CLAIMED_INDEX = "queue_consumed_idx"


def plan_without_the_primary_key(database_url: str, statement: str, params: dict | None = None) -> str:
    """The plan of ``statement`` with the queue's primary key gone (in a transaction
    rolled back) and sequential scans discouraged: what else it could read to find a row.
    For ``params``' values; without them, the plan made for any values (``EXPLAIN
    (GENERIC_PLAN)``): the one Postgres keeps for a prepared statement after its first
    five runs when it costs no more than theirs (the settler's statements, in a drain and
    one job at a time alike)."""
    names: list[str] = []

    def placeholder(match: re.Match[str]) -> str:
        if match.group(1) not in names:
            names.append(match.group(1))
        return f"${names.index(match.group(1)) + 1}"

    explain = ("EXPLAIN " + statement if params is not None
               else "EXPLAIN (GENERIC_PLAN) " + re.sub(r"%\((\w+)\)[sb]", placeholder, statement).replace("%%", "%"))
    with psycopg.connect(database_url) as conn:
        if params is None and conn.info.server_version < 160000:
            pytest.skip("EXPLAIN (GENERIC_PLAN) needs Postgres 16 or later")
        try:
            conn.execute("ALTER TABLE dramatiq.queue DROP CONSTRAINT queue_pkey CASCADE")
            conn.execute("SET LOCAL enable_seqscan = off")
            return "\n".join(row[0] for row in conn.execute(explain.encode(), params).fetchall())
        finally:
            conn.rollback()


def _outcomes(kind: str) -> list[Outcome]:
    now = time.monotonic()
    return [Outcome(str(uuid.uuid4()), 1, "index", kind, None, actor_name="probe", started_mono=now - 0.01,
                    ended_mono=now) for _ in range(3)]


WORKER = str(uuid.uuid4())


def _settle_done() -> dict:
    done = _outcomes("done")
    return {"ids": [o.message_id for o in done], "claims": [1] * 3, "worker_id": WORKER,
            "s_ids": [str(uuid.uuid4())], "s_claims": [1], "awaited": ["index"],
            **timing_params(done, time.monotonic())}


#: (SETTLE, which finds its rows by the same condition, ``sql.STILL_CLAIMED``, cannot be
#: planned without the primary key: the messages it sends from a run insert ON CONFLICT
#: of it.)
STATEMENTS = {
    "SETTLE_DONE": _settle_done,
    "MARK_STARTED": lambda: {"ids": [str(uuid.uuid4())], "claims": [1], "worker_id": WORKER},
    "REQUEUE": lambda: {"ids": [str(uuid.uuid4())], "claims": [1], "worker_id": WORKER},
}


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_a_claim_is_found_by_its_message_id_never_through_the_index_of_every_claim(broker, database_url, name):
    plan = plan_without_the_primary_key(database_url, getattr(sql, name), STATEMENTS[name]())
    assert CLAIMED_INDEX not in plan, plan


@pytest.mark.parametrize("name", sorted(STATEMENTS))
def test_the_plan_made_for_any_claim_finds_it_by_its_message_id_never_through_the_index_of_every_claim(
        broker, direct_database_url, name):
    plan = plan_without_the_primary_key(direct_database_url, getattr(sql, name))
    assert CLAIMED_INDEX not in plan, plan
