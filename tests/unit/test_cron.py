"""Cron expressions in a time zone: fire times, daylight-saving changes, refusals."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from freezegun import freeze_time

from broker.cron import parse_cron
from broker.errors import ConfigError
from periodic import PeriodicJob, cron_period, utcnow

BERLIN = ZoneInfo("Europe/Berlin")
UTC = timezone.utc


def berlin(*args: int, fold: int = 0) -> datetime:
    return datetime(*args, tzinfo=BERLIN, fold=fold).astimezone(UTC)  # type: ignore[misc]


def fire_times(expression: str, zone: str, start: datetime, count: int) -> list[datetime]:
    cron, times, now = parse_cron(expression, zone), [], start
    for _ in range(count):
        now = cron.next(now)
        times.append(now)
    return times


def test_a_daily_time_in_berlin_fires_at_that_wall_clock_time_in_winter_and_in_summer():
    times = fire_times("0 3 * * *", "Europe/Berlin", datetime(2026, 1, 14, tzinfo=UTC), 1)
    times += fire_times("0 3 * * *", "Europe/Berlin", datetime(2026, 7, 14, tzinfo=UTC), 1)
    assert times == [datetime(2026, 1, 14, 2, tzinfo=UTC), datetime(2026, 7, 14, 1, tzinfo=UTC)]
    assert [t.astimezone(BERLIN).hour for t in times] == [3, 3]


def test_a_time_the_clock_skips_runs_once_late_by_the_skip_and_never_is_lost():
    # Given 02:30 Berlin time, and the night of 29 March 2026 when 02:00 becomes 03:00
    times = fire_times("30 2 * * *", "Europe/Berlin", datetime(2026, 3, 27, 12, tzinfo=UTC), 4)
    # Then that night's run comes at 03:30 new time (02:30 under the old offset), once
    assert times[1] == berlin(2026, 3, 29, 3, 30) == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    assert [t.astimezone(BERLIN).date().day for t in times] == [28, 29, 30, 31]
    assert [t.astimezone(BERLIN).strftime("%H:%M") for t in times] == ["02:30", "03:30", "02:30", "02:30"]


def test_a_time_the_clock_passes_twice_runs_once_at_its_first_occurrence():
    # Given every 20 minutes in the 2 o'clock hour, and the night of 25 October 2026 when
    # 03:00 summer time becomes 02:00 winter time (02:00-02:59 happens twice)
    times = fire_times("*/20 2 * * *", "Europe/Berlin", datetime(2026, 10, 24, 12, tzinfo=UTC), 6)
    # Then each wall-clock time runs once, in the first 2 o'clock hour, and the next day's
    # runs follow
    assert times[:3] == [berlin(2026, 10, 25, 2, 0), berlin(2026, 10, 25, 2, 20), berlin(2026, 10, 25, 2, 40)]
    assert all(t.astimezone(BERLIN).utcoffset() == timedelta(hours=2) for t in times[:3])
    assert times[3:] == [berlin(2026, 10, 26, 2, 0), berlin(2026, 10, 26, 2, 20), berlin(2026, 10, 26, 2, 40)]
    # And a tick in the second 2 o'clock hour claims the first's fire time again, not a new one
    job = PeriodicJob("n", "a.b", cron="*/20 2 * * *", timezone="Europe/Berlin")
    second_hour = berlin(2026, 10, 25, 2, 25, fold=1)
    assert cron_period(job, second_hour) == berlin(2026, 10, 25, 2, 40)


def test_the_next_run_a_scheduler_shows_is_in_the_jobs_zone_whatever_its_own_clock_says():
    job = PeriodicJob("nightly", "a.b", cron="0 3 * * *", timezone="Europe/Berlin")
    with freeze_time("2026-12-01 18:00:00"):
        nxt = job.next_run(utcnow())
    assert nxt is not None and nxt.isoformat() == "2026-12-02T03:00:00+01:00"
    assert job.every == "0 3 * * * (Europe/Berlin)"


def test_weekday_names_ranges_steps_and_lists_select_the_documented_times():
    weekdays = fire_times("0 9 * * mon-fri", "UTC", datetime(2026, 12, 4, 10, tzinfo=UTC), 3)  # a Friday
    assert [t.strftime("%a %H:%M") for t in weekdays] == ["Mon 09:00", "Tue 09:00", "Wed 09:00"]
    sundays = fire_times("0 0 * * 7", "UTC", datetime(2026, 12, 1, tzinfo=UTC), 2)
    assert [t.strftime("%a") for t in sundays] == ["Sun", "Sun"]
    quarter = fire_times("5/15 * * * *", "UTC", datetime(2026, 12, 1, tzinfo=UTC), 4)
    assert [t.minute for t in quarter] == [5, 20, 35, 50]
    listed = fire_times("0 8,12-13 1 jan,jul *", "UTC", datetime(2026, 12, 1, tzinfo=UTC), 4)
    assert [t.strftime("%m-%d %H") for t in listed] == ["01-01 08", "01-01 12", "01-01 13", "07-01 08"]


def test_a_day_of_month_and_a_weekday_both_given_fire_on_either_as_cron_does():
    times = fire_times("0 0 13 * fri", "UTC", datetime(2026, 11, 1, tzinfo=UTC), 4)
    assert [t.strftime("%d %a") for t in times] == ["06 Fri", "13 Fri", "20 Fri", "27 Fri"]
    times = fire_times("0 0 13 * sat", "UTC", datetime(2026, 11, 1, tzinfo=UTC), 3)
    assert [t.strftime("%d %a") for t in times] == ["07 Sat", "13 Fri", "14 Sat"]


def test_a_day_field_that_starts_with_a_star_and_a_step_narrows_the_other_as_vixie_cron_does():
    # every other day of the month *and* a Monday: not every odd day or every Monday
    times = fire_times("0 0 */2 * mon", "UTC", datetime(2024, 1, 1, tzinfo=UTC), 3)
    assert [t.strftime("%d %a") for t in times] == ["15 Mon", "29 Mon", "05 Mon"]


def test_29_february_is_found_years_ahead():
    assert fire_times("0 0 29 2 *", "UTC", datetime(2026, 12, 1, tzinfo=UTC), 1) == [datetime(2028, 2, 29, tzinfo=UTC)]


@pytest.mark.parametrize(("expression", "zone", "said"), [
    ("61 * * * *", "UTC", "minute 61 is outside 0-59"),
    ("* * *", "UTC", "3 field(s); a cron expression has 5"),
    ("* * 30 2 *", "UTC", "is never due"),
    ("*/0 * * * *", "UTC", "step '*/0' must be at least 1"),
    ("5-1 * * * *", "UTC", "range '5-1' runs backwards"),
    ("0 3 * * moonday", "UTC", "day of week 'moonday' is not a number or a name"),
    ("0 3 * * *", "Mars/Olympus", "time zone 'Mars/Olympus' is not a known IANA zone"),
])
def test_a_malformed_expression_or_zone_is_refused_naming_what_is_wrong(expression, zone, said):
    with pytest.raises(ConfigError, match="^periodic job 'bad': .*" + said.replace("*", r"\*")
                       .replace("(", r"\(").replace(")", r"\)")):
        PeriodicJob("bad", "a.b", cron=expression, timezone=zone)


def test_a_job_takes_an_interval_or_a_cron_expression_not_both_nor_neither():
    with pytest.raises(ConfigError, match="give interval_s or cron, one of them"):
        PeriodicJob("both", "a.b", interval_s=60, cron="* * * * *")
    with pytest.raises(ConfigError, match="give interval_s or cron, one of them"):
        PeriodicJob("neither", "a.b")
    with pytest.raises(ConfigError, match="a time zone applies to cron"):
        PeriodicJob("zoned", "a.b", interval_s=60, timezone="Europe/Berlin")
    with pytest.raises(ConfigError, match="must be at least 1 and at most"):
        PeriodicJob("forever", "a.b", interval_s=float("inf"))


def test_a_fire_time_is_claimed_within_half_the_gap_to_the_next_and_no_later():
    daily = PeriodicJob("daily", "a.b", cron="0 3 * * *", timezone="Europe/Berlin")
    fired = berlin(2026, 12, 1, 3, 0)
    assert cron_period(daily, fired) == fired
    assert cron_period(daily, fired + timedelta(minutes=59)) == fired
    # a scheduler (re)started at 14:00 does not run that night's 03:00 job
    assert cron_period(daily, berlin(2026, 12, 1, 14, 0)) is None
    minutely = PeriodicJob("minutely", "a.b", cron="* * * * *")
    start = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)
    assert cron_period(minutely, start + timedelta(seconds=29)) == start
    assert cron_period(minutely, start + timedelta(seconds=31)) is None


@pytest.mark.parametrize("zone", ["Europe", "America/"])
def test_a_zone_that_names_a_folder_of_zones_is_refused_as_not_a_zone(zone):
    with pytest.raises(ConfigError, match="is not a known IANA zone"):
        PeriodicJob("folder", "a.b", cron="0 3 * * *", timezone=zone)


@pytest.mark.parametrize("interval_s", [1e12, 366 * 86400 + 1, float("inf"), float("nan"), 0, -1, 0.5, 0.999])
def test_an_interval_beyond_a_year_or_under_a_second_is_refused_in_one_line(interval_s):
    with pytest.raises(ConfigError, match="interval_s must be at least 1 and at most 31,622,400"):
        PeriodicJob("rare", "a.b", interval_s=interval_s)


@pytest.mark.parametrize("kwargs", [{"label": object()}, {"n": float("nan")}, {1: "key not text"}, ["not", "a dict"]],
                         ids=["an object", "nan", "a key not text", "a list"])
def test_a_periodic_job_whose_kwargs_a_message_cannot_carry_is_refused_as_it_is_declared(kwargs):
    with pytest.raises(ConfigError, match="^periodic job 'bad-kwargs': its kwargs are not JSON a message can carry"):
        PeriodicJob("bad-kwargs", "test.tick", interval_s=60, kwargs=kwargs)
