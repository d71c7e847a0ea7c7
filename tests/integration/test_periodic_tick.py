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


def test_a_tick_that_finds_the_database_gone_says_it_once_and_claims_the_period_when_it_is_back(
    broker, database_url, admin_url, caplog
):
    import logging

    import psycopg
    from psycopg import sql as pgsql

    from periodic import tick_or_say
    from tests.support.db import conninfo_dbname

    job = PeriodicJob("through-an-outage", "test.tick", interval_s=3600, kwargs={"label": "outage"})
    name = pgsql.Identifier(conninfo_dbname(database_url))
    with caplog.at_level(logging.WARNING, logger="standmeet.broker"):
        # Given the database ending this process's sessions and refusing new ones
        with psycopg.connect(admin_url, autocommit=True) as admin:
            admin.execute(pgsql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS false").format(name))
            try:
                admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                              (conninfo_dbname(database_url),))
                # When the scheduler ticks
                outcome = tick_or_say(job)
            finally:
                admin.execute(pgsql.SQL("ALTER DATABASE {} WITH ALLOW_CONNECTIONS true").format(name))
        # Then nothing is raised, and the outage is said in one line
        assert outcome is None
        assert sum("database unreachable" in r.getMessage() for r in caplog.records) == 1
        # And once the database is back, the next tick claims the period
        assert tick_or_say(job) is not None
    assert scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs WHERE job = %s", (job.name,)) == 1


def _daily_cron_at(url: str, minutes_ago: int) -> str:
    """A daily cron expression (UTC) whose fire time was ``minutes_ago`` by the database's clock."""
    fired = scalar(url, "SELECT now() - make_interval(mins => %s)", (minutes_ago,)).astimezone(timezone.utc)
    return f"{fired.minute} {fired.hour} * * *"


def test_eight_schedulers_ticking_at_once_enqueue_a_cron_fire_time_once(broker, database_url):
    import threading

    # Given a daily cron job whose fire time came a minute ago by the database's clock
    job = PeriodicJob("cron-once", "test.tick", cron=_daily_cron_at(database_url, 1), kwargs={"label": "cron"})
    # When eight schedulers tick it at the same moment, twice each
    barrier, outcomes, lock = threading.Barrier(8), [], threading.Lock()

    def scheduler() -> None:
        barrier.wait(timeout=30)
        for _ in range(2):
            enqueued = tick(job)
            with lock:
                outcomes.append(enqueued)

    threads = [threading.Thread(target=scheduler) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    # Then exactly one tick enqueued it, for that fire time
    assert len(outcomes) == 16 and sum(o is not None for o in outcomes) == 1, outcomes
    rows = query(database_url, "SELECT period_start, message_id::text FROM standmeet.periodic_runs WHERE job = %s",
                 (job.name,))
    assert rows == [(job.period_start(rows[0][0] + timedelta(seconds=1)), next(o for o in outcomes if o))]
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = %s::uuid", (rows[0][1],)) == 1


def test_a_scheduler_started_hours_after_a_cron_fire_time_does_not_run_it(broker, database_url):
    # Given a daily cron job whose fire time was three hours ago by the database's clock
    job = PeriodicJob("cron-long-past", "test.tick", cron=_daily_cron_at(database_url, 180), kwargs={"label": "late"})
    # When a scheduler that was not running then ticks it now
    # Then nothing is enqueued: that night's run was missed, not run in the afternoon
    assert tick(job) is None
    assert scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs WHERE job = %s", (job.name,)) == 0


def test_schedules_given_as_whole_and_fractional_seconds_are_all_recorded(broker, database_url):
    from periodic import publish_schedules

    # Given jobs whose intervals are written 60.0 and 30 (a float beside an int)
    jobs = [PeriodicJob("float-minute", "test.tick", interval_s=60.0), PeriodicJob("int-half", "test.tick", interval_s=30)]
    # When a scheduler records them
    publish_schedules(jobs)
    # Then both are shown
    assert query(database_url, "SELECT job, interval_s FROM standmeet.periodic_schedules"
                               " WHERE job IN ('float-minute', 'int-half') ORDER BY job") == [("float-minute", 60.0), ("int-half", 30.0)]


def test_claimed_periods_past_the_retention_are_pruned_and_each_jobs_latest_is_kept(broker, database_url):
    from broker.maintenance import prune_messages

    # Given a job's periods claimed over 40 days, and another job that last ran 30 days ago
    query(database_url, "INSERT INTO standmeet.periodic_runs (job, period_start, message_id)"
                        " SELECT 'pruned-daily', now() - make_interval(days => d), gen_random_uuid()"
                        " FROM generate_series(0, 40) AS d")
    query(database_url, "INSERT INTO standmeet.periodic_runs (job, period_start, message_id)"
                        " VALUES ('pruned-gone', now() - interval '30 days', gen_random_uuid()),"
                        "        ('pruned-gone', now() - interval '31 days', gen_random_uuid())")
    # When the retention job runs (history kept 14 days)
    prune_messages()
    # Then the first job keeps its last 14 days of periods, the other its latest alone
    days = [d for (d,) in query(database_url, "SELECT extract(day FROM now() - period_start)::int FROM standmeet.periodic_runs"
                                              " WHERE job = 'pruned-daily' ORDER BY period_start DESC")]
    assert days == list(range(0, 15)) or days == list(range(0, 14)), days
    assert scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs WHERE job = 'pruned-gone'") == 1


def test_a_period_of_a_changed_interval_is_kept_while_it_can_be_claimed_again(broker, database_url):
    from broker.maintenance import prune_messages

    # Given a job whose interval changed to 25 days: its current period started 20 days
    # ago, before the period the old interval claimed yesterday (its latest)
    query(database_url, "INSERT INTO standmeet.periodic_schedules (job, actor, interval_s)"
                        " VALUES ('interval-changed', 'test.tick', 25 * 86400)"
                        " ON CONFLICT (job) DO UPDATE SET interval_s = EXCLUDED.interval_s, cron = NULL")
    query(database_url, "INSERT INTO standmeet.periodic_runs (job, period_start, message_id)"
                        " VALUES ('interval-changed', now() - interval '20 days', gen_random_uuid()),"
                        "        ('interval-changed', now() - interval '1 day', gen_random_uuid())")
    # When the retention job runs (history kept 14 days)
    prune_messages()
    # Then the current period's claim is kept (deleted, the next tick would claim it again)
    assert scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs WHERE job = 'interval-changed'"
                                " AND period_start < now() - interval '19 days'") == 1


def test_a_period_a_unique_key_folded_into_a_live_message_names_that_message(broker, database_url):
    from tests.support import unique_jobs  # noqa: F401  (declares test.unique)

    # Given two periodic jobs of a unique actor with the same arguments (one key)
    first = PeriodicJob("unique-first", "test.unique", interval_s=3600, kwargs={"label": "periodic-key"})
    second = PeriodicJob("unique-second", "test.unique", interval_s=3600, kwargs={"label": "periodic-key"})
    # When both tick: the second's message is folded into the first's
    enqueued, folded = tick(first), tick(second)
    # Then both periods name the one message that exists, and the tick says which
    assert folded == enqueued
    rows = query(database_url, "SELECT r.job, r.message_id::text, q.message_id IS NOT NULL FROM standmeet.periodic_runs r"
                               " LEFT JOIN dramatiq.queue q ON q.message_id = r.message_id"
                               " WHERE r.job IN ('unique-first', 'unique-second') ORDER BY r.job")
    assert rows == [("unique-first", enqueued, True), ("unique-second", enqueued, True)]
    broker.flush("index")
