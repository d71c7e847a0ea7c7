from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone

import pytest
from freezegun import freeze_time

from periodic import PeriodicJob, utcnow


def test_a_period_starts_on_its_interval_boundary():
    job = PeriodicJob("j", "a.b", interval_s=30)
    with freeze_time("2026-11-29 10:00:47"):
        assert job.period_start(utcnow()) == datetime(2026, 11, 29, 10, 0, 30, tzinfo=timezone.utc)


def test_two_moments_of_one_period_share_its_key_and_the_next_period_does_not():
    job = PeriodicJob("j", "a.b", interval_s=3600)
    first = job.period_start(datetime(2026, 11, 29, 10, 0, 1, tzinfo=timezone.utc))
    same = job.period_start(datetime(2026, 11, 29, 10, 59, 59, tzinfo=timezone.utc))
    nxt = job.period_start(datetime(2026, 11, 29, 11, 0, 0, tzinfo=timezone.utc))
    assert first == same
    assert nxt != first


def _fire_times(job: PeriodicJob, start: datetime, periods: int) -> list[float]:
    """The times (epoch seconds) a scheduler whose clock reads ``start`` ticks ``job``,
    over ``periods`` of its periods."""
    from periodic import trigger

    fires, previous = [], None
    schedule = trigger(job, start)
    end = start.timestamp() + periods * job.interval_s
    now = start
    while True:
        fire = schedule.get_next_fire_time(previous, now)
        if fire is None or fire.timestamp() >= end:
            return fires
        fires.append(fire.timestamp())
        previous, now = fire, fire


@pytest.mark.parametrize("interval_s", [1, 7, 30, 60, 3600])
@pytest.mark.parametrize("ahead_s", [0.001, 0.002, -0.002, 0.4])
def test_a_scheduler_whose_clock_is_a_little_off_ticks_within_every_database_period(interval_s, ahead_s):
    # Given a scheduler whose clock is ``ahead_s`` ahead of the database's, whose ticks land
    # anywhere from 1.3 ms early to 150 ms late
    job = PeriodicJob("j", "a.b", interval_s=interval_s)
    start = datetime(2026, 12, 2, 10, 0, 0, tzinfo=timezone.utc)
    periods = min(200, int(7200 / interval_s))
    fires = _fire_times(job, start, periods)
    # When each tick claims the database's period at the moment it lands (one late, the
    # next early, and so on)
    jitters = (0.15, -0.0013, 0.0)
    claimed = {int((fire - ahead_s + jitters[i % 3] - start.timestamp()) // interval_s) for i, fire in enumerate(fires)}
    # Then every period the run spans was claimed by one tick or another (a tick just
    # before the database's boundary claims the old one; a later one, the new)
    assert set(range(1, periods - 1)) <= claimed, sorted(set(range(1, periods - 1)) - claimed)[:5]


def test_an_interval_job_is_ticked_on_each_boundary_at_least_four_times_a_period_and_at_most_15_s_apart():
    from periodic import CRON_TICK_S, tick_every_s

    for interval_s in (1, 1.5, 7, 30, 45, 60, 100, 3600, 86400):
        job = PeriodicJob("j", "a.b", interval_s=interval_s)
        every = tick_every_s(job)
        assert every <= min(CRON_TICK_S, interval_s / 4)
        assert abs(interval_s / every - round(interval_s / every)) < 1e-9  # each boundary is a tick


def test_a_stepped_wall_clock_is_noticed_and_a_running_one_is_not():
    from periodic import ClockWatch

    clock = {"wall": 1_000_000.0, "mono": 50.0}
    watch = ClockWatch(wall=lambda: clock["wall"], monotonic=lambda: clock["mono"])
    clock["wall"] += 10.0
    clock["mono"] += 10.0
    assert watch.stepped_s() is None  # ten seconds passed on both
    clock["wall"] -= 180.0  # an NTP step back
    clock["mono"] += 1.0
    assert watch.stepped_s() == pytest.approx(-181.0)
    clock["wall"] += 1.0
    clock["mono"] += 1.0
    assert watch.stepped_s() is None


def test_after_the_clock_steps_back_the_ticks_are_rescheduled_from_the_new_time():
    from apscheduler.schedulers.background import BackgroundScheduler

    from periodic import ClockWatch, reschedule_if_stepped, tick_every_s, trigger

    job = PeriodicJob("every-20-s", "a.b", interval_s=20)
    scheduler = BackgroundScheduler(timezone="UTC")
    scheduler.start(paused=True)
    try:
        scheduler.add_job(print, trigger(job, utcnow()), id=job.name)
        clock = ClockWatch(wall=lambda: time.time())  # (read through freezegun's clock)
        # Given the wall clock stepped three minutes back
        with freeze_time(datetime.now(timezone.utc) - timedelta(seconds=180)):
            # When the scheduler's watch looks
            stepped = reschedule_if_stepped(scheduler, [job], clock)
            now = utcnow()
            # Then the next tick is due within a tick's interval of the new time (it was
            # three minutes away by the stepped clock)
            next_run = scheduler.get_job(job.name).next_run_time
        assert stepped is not None and stepped < -170
        assert 0 <= (next_run - now).total_seconds() <= tick_every_s(job)
    finally:
        scheduler.shutdown(wait=False)

