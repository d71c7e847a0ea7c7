"""At the database: a tick per period, whoever ticks."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from periodic import PeriodicJob, tick
from tests.support.db import query


def test_ticks_in_one_period_enqueue_once_and_the_next_period_enqueues_again(broker, database_url):
    job = PeriodicJob("clocked", "test.tick", interval_s=60, kwargs={"label": "clocked"})
    t0 = datetime(2026, 11, 29, 12, 0, 5, tzinfo=timezone.utc)
    first = tick(job, clock=lambda: t0)
    again = tick(job, clock=lambda: t0 + timedelta(seconds=50))  # another scheduler, same period
    nxt = tick(job, clock=lambda: t0 + timedelta(seconds=60))
    assert first is not None and nxt is not None and first != nxt
    assert again is None
    rows = query(database_url, "SELECT queue_name FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", ([first, nxt],))
    assert rows == [("maintenance",), ("maintenance",)]
