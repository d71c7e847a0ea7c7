"""At the database: a tick per period, whoever ticks and whatever its clock says."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

from freezegun import freeze_time

from periodic import PeriodicJob, tick, utcnow
from tests.support.db import query, scalar, wait_for

#: The start of the database's current period of ``interval_s`` seconds.
DB_PERIOD = "SELECT to_timestamp(floor(extract(epoch FROM now())::float8 / %s) * %s)"
#: Seconds until the database's next period of ``interval_s`` seconds starts.
DB_PERIOD_LEFT = "SELECT %s - mod(extract(epoch FROM now())::numeric, %s::numeric)"


def _db_period(url: str, interval_s: float) -> datetime:
    return scalar(url, DB_PERIOD, (interval_s, interval_s))


def test_schedulers_whose_clocks_differ_by_90_s_claim_a_database_period_once(broker, database_url):
    # Given a job of one-minute periods, and a database period with more than 5 s left
    job = PeriodicJob("skewed", "test.tick", interval_s=60, kwargs={"label": "skewed"})
    wait_for(lambda: float(scalar(database_url, DB_PERIOD_LEFT, (60, 60))) > 5, timeout_s=10,
             interval_s=0.2, what="a database period with 5 s left")
    period = _db_period(database_url, 60)
    real_now = datetime.now(timezone.utc)
    # When three schedulers tick in it, their clocks 90 s behind, on time and 90 s ahead:
    # by their own clocks, each is in a period of its own
    ticks, own_periods = [], set()
    for skew_s in (-90, 0, 90):
        with freeze_time(real_now + timedelta(seconds=skew_s), tick=True):
            own_periods.add(job.period_start(utcnow()))
            ticks.append(tick(job))
    assert len(own_periods) == 3
    # Then exactly one of them enqueued the job, for the database's period
    assert [t is not None for t in ticks].count(True) == 1, ticks
    assert query(database_url, "SELECT period_start, message_id::text FROM standmeet.periodic_runs WHERE job = %s",
                 (job.name,)) == [(period, next(t for t in ticks if t))]


def test_the_next_database_period_enqueues_again(broker, database_url):
    job = PeriodicJob("every-second", "test.tick", interval_s=1, kwargs={"label": "every-second"})
    first = tick(job)
    # ticks in the same period (there may be a boundary in between: then one more claims it)
    nxt = wait_for(lambda: tick(job), timeout_s=10, what="a tick in the next database period")
    assert first is not None and nxt is not None and first != nxt
    rows = query(database_url, "SELECT r.period_start, q.queue_name FROM standmeet.periodic_runs r"
                               " JOIN dramatiq.queue q ON q.message_id = r.message_id WHERE r.job = %s"
                               " ORDER BY r.period_start", (job.name,))
    assert len(rows) == 2 and {q for _, q in rows} == {"maintenance"}
    assert rows[1][0] - rows[0][0] >= timedelta(seconds=1)
