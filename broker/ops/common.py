"""What every operator query shares: the limits, the error, the row base, and the
parsing of arguments (ages, job ids and their prefixes) and of values (JSON-ready rows,
the database's clock)."""

from __future__ import annotations

import dataclasses
import re
import uuid
from datetime import datetime, timedelta, timezone
from typing import Any

import psycopg

from broker.errors import StandmeetError

#: The states :func:`list_jobs`, :func:`count_jobs` and the bulk actions filter on.
JOB_STATES: tuple[str, ...] = ("queued", "delayed", "running", "done", "rejected", "cancelled")
#: Default silence after which a worker process counts as dead (STANDMEET_RESCUE_AFTER_S).
DEFAULT_RESCUE_AFTER_S = 20.0
#: Longest page :func:`list_jobs` returns.
MAX_LIMIT = 1000
#: Furthest a page of :func:`list_jobs` may start (finite, so that no typed offset overflows).
MAX_OFFSET = 100_000_000
#: Oldest age ``since`` may say (``36500d``: a hundred years, the longest retention).
MAX_SINCE_AGE_S = 36_500 * 86_400.0
#: Fewest hex digits a job id prefix needs to name a job (``status`` prints 8).
MIN_ID_PREFIX_HEX = 8
#: How many of the jobs an ambiguous id prefix matches are named.
AMBIGUOUS_SHOWN = 5
#: Largest id of an outbox event, or of any bigint row an application's view names.
MAX_BIGINT = 2 ** 63 - 1
#: Longest text the search in errors (``error``) takes. That search reads the error and
#: the last traceback of every job the other filters leave (no index holds them): a scan
#: of ``dramatiq.queue``, as listing does anyway, one case-insensitive match a row.
MAX_ERROR_SEARCH_CHARS = 200
#: The longest text searched for in jobs' arguments (each row's arguments are matched
#: against it: a long pattern costs every row, and no index holds them).
MAX_SEARCH_CHARS = 500


class OpsError(StandmeetError, ValueError):
    """A bad filter or argument, said in one line (the CLI prints it and exits 1)."""


class _Row:
    def asdict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]


_AGE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)\s*$")
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def age_seconds(value: datetime | str | None) -> float | None:
    """How long ago an age (``90s``, ``15m``, ``2h``, ``7d``) is, in seconds; None when
    ``value`` is not one. A filter takes it from the database's clock (``now()``), never
    this machine's, as its docs say."""
    if not isinstance(value, str):
        return None
    match = _AGE.match(value)
    if not match:
        return None
    seconds = float(match.group(1)) * _AGE_UNITS[match.group(2)]
    if not seconds <= MAX_SINCE_AGE_S:  # also refuses an age too long to be a number
        raise OpsError(f"since {value.strip()!r} is too long ago: give an age from 0s to "
                       f"{MAX_SINCE_AGE_S / 86_400:.0f}d, or an ISO time")
    return seconds


def parse_since(value: datetime | str | None, *, now: datetime | None = None) -> datetime | None:
    """A point in time from a datetime, an ISO time (UTC when it has no zone) or an age
    (``90s``, ``15m``, ``2h``, ``7d``: that long ago)."""
    if value is None or isinstance(value, datetime):
        if isinstance(value, datetime) and value.tzinfo is None:
            return value.replace(tzinfo=timezone.utc)
        return value
    seconds = age_seconds(value)
    if seconds is not None:
        return (now or datetime.now(timezone.utc)) - timedelta(seconds=seconds)
    try:
        parsed = datetime.fromisoformat(value.strip())
    except ValueError:
        raise OpsError(f"since {value!r} is neither an ISO time nor an age like 15m, 2h or 1d") from None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def parse_message_id(value: str) -> str:
    """A job id, normalised; a clear error when it is not a UUID."""
    try:
        return str(uuid.UUID(str(value).strip()))
    except ValueError:
        raise OpsError(f"{value!r} is not a job id (a UUID like 0b5a…-…)") from None


_HEX = frozenset("0123456789abcdef")
_UUID_SHAPE = "xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"


def id_range(prefix: str, *, min_hex: int = 1) -> tuple[str, str]:
    """The lowest and highest job id that start with ``prefix`` (hex digits, with or
    without the dashes where a UUID has them): a range the primary key's index answers.
    Refused in one line when it is not the start of a job id or has fewer than
    ``min_hex`` hex digits."""
    text = str(prefix).strip().lower()
    if "-" in text:
        shaped = len(text) <= len(_UUID_SHAPE) and all(
            (c == "-") == (shape == "-") and (c == "-" or c in _HEX) for c, shape in zip(text, _UUID_SHAPE, strict=False))
    else:
        shaped = len(text) <= 32 and all(c in _HEX for c in text)
    digits = text.replace("-", "")
    if not shaped or not digits:
        raise OpsError(f"{prefix!r} is not a job id or the start of one (hex digits, as in 0b5a1c2d)")
    if len(digits) < min_hex:
        raise OpsError(f"{prefix!r} is not a job id: a prefix needs at least {min_hex} hex digits "
                       f"(status prints {MIN_ID_PREFIX_HEX}), or give the whole id")
    return str(uuid.UUID(digits.ljust(32, "0"))), str(uuid.UUID(digits.ljust(32, "f")))


def _contains(text: str | None) -> str | None:
    """An ILIKE pattern matching ``text`` anywhere, its wildcards taken literally (None: no filter)."""
    if not text:
        return None
    return "%" + text.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_") + "%"


def jsonable(value: Any) -> Any:
    """``value`` (a dataclass of these modules, a list of them, …) with datetimes as ISO
    strings and tuples as lists: ready for ``json.dumps``."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, uuid.UUID):
        return str(value)
    return value


def _by(by: str) -> str:
    if not by or not by.strip():
        raise OpsError("say who does it (by=…)")
    return by.strip()


def _queue_name(name: str) -> str:
    if not name or not name.strip():
        raise OpsError("a queue name is required")
    return name.strip()


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def _one_line(text: str | None) -> str | None:
    if not text:
        return None
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else None


def db_now(conn: psycopg.Connection[Any]) -> datetime:
    """The database's clock: what every age and window of this module is judged by."""
    return _db_now(conn)


def _db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute(DB_NOW).fetchone()
    assert row is not None
    return row[0]


DB_NOW = "SELECT now()"
