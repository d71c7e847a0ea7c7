"""A fan-out's parking reads its deliveries and their messages by id, whatever the
statistics say: no plan of its statements can read the never-attempted deliveries'
index or the queue's claim index instead (partial indexes whose predicate the old
statements implied). With statistics behind a burst (a few queued rows counted where
thousands are), the planner took those indexes for each lookup, reading every queued
message and every waiting delivery once per delivery parked."""

from __future__ import annotations

import uuid

import psycopg

from actors import webhooks

#: Indexes a lookup by id must never read.
PARTIAL = ("queue_claim_priority_idx", "webhook_deliveries_due_idx")


def plan_without_primary_keys(database_url: str, statement: str, params: dict) -> str:
    """The plan of ``statement`` when the primary keys of the queue and of the deliveries
    are gone (in a transaction rolled back): what else it could read instead."""
    with psycopg.connect(database_url) as conn:
        try:
            conn.execute("ALTER TABLE dramatiq.queue DROP CONSTRAINT queue_pkey CASCADE")
            conn.execute("ALTER TABLE standmeet.webhook_deliveries DROP CONSTRAINT webhook_deliveries_pkey CASCADE")
            conn.execute("SET LOCAL enable_seqscan = off")  # an index if any could serve
            rows = conn.execute(("EXPLAIN " + statement).encode(), params).fetchall()
            return "\n".join(row[0] for row in rows)
        finally:
            conn.rollback()


def test_parking_reads_deliveries_and_messages_by_id_never_through_a_partial_index(broker, database_url):
    ids = {"ids": [1, 2, 3], "locked": [str(uuid.uuid4())], "lease_s": 20,
           "messages": [str(uuid.uuid4())], "until": ["2030-01-01T00:00:00+00:00"]}
    for name in ("PARK_LOCK_MESSAGES", "PARK_BEHIND", "PARK"):
        plan = plan_without_primary_keys(database_url, getattr(webhooks, name), ids)
        # the never-attempted index serves PARK_BEHIND's search of an endpoint's waiters,
        # by endpoint: only the lookups by id are at stake
        lookups = [line for line in plan.splitlines() if any(index in line for index in PARTIAL)
                   and not (name == "PARK_BEHIND" and "webhook_deliveries_due_idx" in line)]
        assert not lookups, f"{name} can read a partial index for a lookup by id:\n{plan}"
