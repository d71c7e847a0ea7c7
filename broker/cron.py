"""Cron expressions in a time zone: when a periodic job declared with ``cron=`` is due.

Five fields, as crontab(5) writes them: minute (0-59), hour (0-23), day of month (1-31),
month (1-12 or ``jan``-``dec``), day of week (0-7, 0 and 7 both Sunday, or ``sun``-``sat``).
Each field is ``*``, a value, a range ``a-b``, a step ``*/n`` or ``a-b/n``, or a list of
those separated by commas. When both day fields are restricted, a day matching either
one is due (as cron has always done); a day field that starts with ``*`` (``*``, ``*/2``)
does not restrict in that sense: then a day must match both, as in Vixie cron.

Times are wall-clock times in the job's zone (an IANA name: ``Europe/Berlin``), across
daylight-saving changes:

- **A time the clock skips** (02:30 on the night the clocks go forward an hour) runs once,
  at the instant that wall-clock time would have been under the old offset (03:30 new
  time): the day's run is late, never lost.
- **A time the clock passes twice** (02:30 on the night the clocks go back) runs once, at
  its first occurrence: the day's run is never doubled.

Every fire time is therefore one instant, and a job's period is keyed by it
(``periodic.tick``): schedulers that agree on the expression agree on every period.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date, datetime, time, timedelta, timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from broker.errors import ConfigError

#: Each field's name and the values it admits.
FIELDS: tuple[tuple[str, int, int], ...] = (
    ("minute", 0, 59), ("hour", 0, 23), ("day of month", 1, 31), ("month", 1, 12), ("day of week", 0, 7),
)
MONTHS = {name: number for number, name in enumerate(
    ("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"), start=1)}
WEEKDAYS = {name: number for number, name in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
#: How far back and forward a search for a due day looks: a valid expression (30 February
#: is not one) is due at least once in any eight years (29 February on a Monday, say).
SEARCH_DAYS = 8 * 366
_TERM = re.compile(r"^(?P<range>\*|[0-9a-z]+(?:-[0-9a-z]+)?)(?:/(?P<step>[0-9]+))?$")


@dataclass(frozen=True)
class Cron:
    """A parsed expression in its zone; :meth:`previous` and :meth:`next` give fire times."""

    expression: str
    zone: str
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday .. 6 = Saturday
    days_restricted: bool
    weekdays_restricted: bool

    @property
    def tz(self) -> ZoneInfo:
        return ZoneInfo(self.zone)

    def __str__(self) -> str:
        return f"{self.expression} ({self.zone})"

    def due_on(self, day: date) -> bool:
        """Whether ``day`` (a date in the job's zone) has fire times."""
        if day.month not in self.months:
            return False
        by_day = day.day in self.days
        by_weekday = (day.isoweekday() % 7) in self.weekdays
        if self.days_restricted and self.weekdays_restricted:
            return by_day or by_weekday
        return by_day and by_weekday

    def times_of_day(self) -> list[time]:
        return [time(h, m) for h in sorted(self.hours) for m in sorted(self.minutes)]

    def _instant(self, day: date, at: time) -> datetime:
        """The one instant a wall-clock time stands for (see the module's docstring)."""
        local = datetime.combine(day, at, tzinfo=self.tz)  # fold=0: the first, or the old offset
        return local.astimezone(timezone.utc)

    def previous(self, now: datetime) -> datetime | None:
        """The latest fire time at or before ``now`` (aware), in UTC; None if none in years."""
        local_day = now.astimezone(self.tz).date()
        times = self.times_of_day()
        for back in range(SEARCH_DAYS):
            day = local_day - timedelta(days=back)
            if not self.due_on(day):
                continue
            due = [instant for at in times if (instant := self._instant(day, at)) <= now]
            if due:
                return max(due)
        return None

    def next(self, now: datetime) -> datetime | None:
        """The first fire time after ``now`` (aware), in UTC; None if none in years."""
        local_day = now.astimezone(self.tz).date() - timedelta(days=1)  # a skipped time may land a day on
        times = self.times_of_day()
        for ahead in range(SEARCH_DAYS):
            day = local_day + timedelta(days=ahead)
            if not self.due_on(day):
                continue
            later = [instant for at in times if (instant := self._instant(day, at)) > now]
            if later:
                return min(later)
        return None


def parse_cron(expression: str, zone: str = "UTC") -> Cron:
    """``expression`` in ``zone``; a malformed one raises :class:`ConfigError` naming the
    field and the value that is wrong."""
    try:
        ZoneInfo(zone)
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a folder of zones, "Europe"
        raise ConfigError(f"time zone {zone!r} is not a known IANA zone (e.g. Europe/Berlin, UTC)") from None
    parts = expression.strip().lower().split()
    if len(parts) != len(FIELDS):
        raise ConfigError(f"cron {expression!r}: {len(parts)} field(s); a cron expression has 5 "
                          "(minute hour day-of-month month day-of-week)")
    sets = [_field(expression, text, *spec) for text, spec in zip(parts, FIELDS, strict=True)]
    minutes, hours, days, months, weekdays = sets
    weekdays = frozenset(d % 7 for d in weekdays)
    cron = Cron(expression=" ".join(parts), zone=zone, minutes=minutes, hours=hours, days=days, months=months,
                weekdays=weekdays, days_restricted=not parts[2].startswith("*"),
                weekdays_restricted=not parts[4].startswith("*"))
    if cron.next(datetime(2000, 1, 1, tzinfo=timezone.utc)) is None:
        raise ConfigError(f"cron {expression!r} is never due (no such day in any year)")
    return cron


def _field(expression: str, text: str, name: str, low: int, high: int) -> frozenset[int]:
    names = MONTHS if name == "month" else WEEKDAYS if name == "day of week" else {}
    values: set[int] = set()
    for term in text.split(","):
        match = _TERM.match(term)
        if match is None:
            raise ConfigError(f"cron {expression!r}: {name} {term!r} is not a value, range or step")
        if match["range"] == "*":
            start, end = low, high
        else:
            bounds = [_value(expression, name, part, names, low, high) for part in match["range"].split("-")]
            start, end = bounds[0], bounds[-1]
            if start > end:
                raise ConfigError(f"cron {expression!r}: {name} range {term!r} runs backwards")
            if match["step"] is not None and len(bounds) == 1:
                end = high  # "5/15": from 5 to the end, every 15
        step = int(match["step"]) if match["step"] is not None else 1
        if step < 1:
            raise ConfigError(f"cron {expression!r}: {name} step {term!r} must be at least 1")
        values.update(range(start, end + 1, step))
    return frozenset(values)


def _value(expression: str, name: str, text: str, names: dict[str, int], low: int, high: int) -> int:
    value = names.get(text)
    if value is None:
        if not text.isdigit():
            raise ConfigError(f"cron {expression!r}: {name} {text!r} is not a number"
                              + (f" or a name ({', '.join(names)})" if names else ""))
        value = int(text)
    if not low <= value <= high:
        raise ConfigError(f"cron {expression!r}: {name} {value} is outside {low}-{high}")
    return value
