"""How the operators' commands connect and print: one connection to the database, the
tables and lines they print (every value as text a terminal shows exactly), the
argument types of their filters. An application's commands that show rows the same way
use the public ones: :func:`operator_connection`, :func:`print_table`, :func:`printable`,
:func:`when`."""

from __future__ import annotations

import argparse
import getpass
import re
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import Any

import psycopg

from broker import ops
from broker.cli.common import ascii_digits, filter_text
from broker.errors import DatabaseUnavailable, StandmeetError
from broker.pg import pool as pgpool
from broker.pg.embedded import resolve_database_url
from broker.settings import Settings, masked_url

# -- for applications' commands ------------------------------------------------------------

def operator_connection(settings: Settings) -> Any:
    """A context manager: a connection to the database ``settings`` name, as these
    commands open it (an unreachable server or an old schema said in one line)."""
    return _connect(settings)


def print_table(columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Print ``rows`` under ``columns`` as these commands print tables, every value as text."""
    t = _table(*columns)
    for values in rows:
        _row(t, *values)
    _console().print(t)


def when(value: datetime | str | None) -> str:
    """A time as these commands print it (ISO, to the second; ``-`` for none)."""
    return _when(value)


# -- helpers -----------------------------------------------------------------------------

def operator_name() -> str:
    """Who runs this command: user@host."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return f"{user}@{socket.gethostname()}"


#: How long one statement of an operator's command may run: a filter that reads too much
#: is stopped on the server, not left running after the command was killed.
STATEMENT_TIMEOUT_MS = 60_000


@contextmanager
def _connect(settings: Settings) -> Iterator[psycopg.Connection[Any]]:
    url = resolve_database_url(settings)
    try:
        conn = pgpool.connect(url, application_name="standmeet-cli")
    except psycopg.OperationalError as exc:
        from broker.pg.preflight import first_line, server_of

        raise DatabaseUnavailable(
            f"cannot reach the database at {server_of(url)} ({masked_url(url)}): {first_line(exc)}") from exc
    if pgpool.topology_for(url).session_state:  # (through a transaction pooler a session setting would leak)
        conn.execute(pgpool.SET_STATEMENT_TIMEOUT, (str(STATEMENT_TIMEOUT_MS),))
        conn.commit()
    with conn:
        try:
            yield conn
        except psycopg.errors.UndefinedTable as exc:
            first = str(exc).strip().splitlines()[0]
            raise StandmeetError(f"the schema is not up to date: run `standmeet-jobs migrate` ({first})") from exc


#: What a terminal would act on rather than show: control characters (escape sequences
#: start with one) and the marks that reorder text; newlines and tabs are kept in multi-line text.
_UNPRINTABLE_IN_A_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNPRINTABLE_IN_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(value: object, *, lines: bool = False) -> str:
    """``value`` as text a terminal shows exactly: each control character or direction
    mark written as its escape (``\\x1b``, ``\\u202e``); newlines and tabs kept only with
    ``lines``. Rich markup is another matter: print the result as :class:`rich.text.Text`."""
    pattern = _UNPRINTABLE_IN_LINES if lines else _UNPRINTABLE_IN_A_LINE
    return pattern.sub(_escaped, str(value))


def _escaped(match: re.Match[str]) -> str:
    code = ord(match.group())
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def _text(value: object, *, lines: bool = False) -> Any:
    """``value`` as rich text that is never read as markup."""
    from rich.text import Text

    return Text(printable(value, lines=lines))


def _row(table: Any, *values: object) -> None:
    """A table row of plain text (each value printable; rich text as it is)."""
    from rich.text import Text

    table.add_row(*(v if isinstance(v, Text) else _text(v) for v in values))


def _line(console: Any, line: str) -> None:
    console.print(_text(line))


def _console() -> Any:
    from rich.console import Console

    # markup and emoji codes off as well: no string this prints is read as anything but text
    return Console(width=None if sys.stdout.isatty() else 200, highlight=False, markup=False, emoji=False)


def _table(*columns: str, title: str | None = None) -> Any:
    from rich import box
    from rich.table import Table

    t = Table(*columns, title=title, box=box.SIMPLE_HEAD, title_justify="left")
    return t


def _error_text(value: str) -> str:
    """An argparse ``type``: the text to search errors for, not empty and within its length
    (exit 2 past it)."""
    filter_text(value)
    try:
        ops.job_filters(error=value)
    except ops.OpsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _since(value: str) -> str:
    """An argparse ``type``: an ISO time or an age within range, in ASCII digits (checked,
    given on as typed)."""
    ascii_digits(value)
    try:
        ops.parse_since(value)
    except ops.OpsError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m"
    if seconds < 86400:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _when(value: datetime | str | None) -> str:
    if value is None:
        return "-"
    if isinstance(value, str):
        value = datetime.fromisoformat(value)
    return value.isoformat(timespec="seconds")
