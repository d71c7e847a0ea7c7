"""The receipt listener's re-check after a reconnect finds each awaited message by its id,
whatever the statistics say: no plan of it reads the finished rows' index (every message
finished within the retention, days of them) instead of the primary key."""

from __future__ import annotations

import uuid

from broker.outbox import receipts
from tests.integration.test_settle_plans import plan_without_the_primary_key

FINISHED_INDEX = "queue_finished_idx"


def test_the_recheck_finds_awaited_messages_by_id_never_through_the_index_of_every_finished_one(
        broker, database_url):
    plan = plan_without_the_primary_key(database_url, receipts.FINISHED, {"ids": [str(uuid.uuid4())]})
    assert FINISHED_INDEX not in plan, plan
