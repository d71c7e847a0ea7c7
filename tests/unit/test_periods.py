from __future__ import annotations

from datetime import datetime, timezone

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
