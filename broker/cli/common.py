"""What the command line's modules share: the last word of a command, the checks of
the worker counts ``run`` and ``check`` take, and the parser that checks every argument
as it reads it (text in UTF-8; numbers in ASCII digits)."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from broker.boot import OneLineParser
from broker.worker import check_worker_numbers

if TYPE_CHECKING:
    from broker.settings import Settings

logger = logging.getLogger("standmeet")

#: The most worker processes ``run --processes`` and ``check --processes`` take (the
#: server's connections refuse far fewer, saying how many fit).
PROCESSES_MOST = 1_000_000


def say(line: str) -> None:
    """The command's last word on stderr, after every log line written before it."""
    for handler in logging.getLogger().handlers:  # log lines are written in batches
        handler.flush()
    print(f"standmeet-jobs: {line}", file=sys.stderr)


def check_counts(threads: int, processes: int | None, *, shutdown_ms: int | None = None) -> None:
    """Refuse counts and timeouts out of range in one line naming the option, the value
    and the range, before anything else is looked at."""
    from broker.errors import ConfigError

    if processes is not None and not 1 <= processes <= PROCESSES_MOST:
        raise ConfigError(f"--processes {processes}: give 1 to {PROCESSES_MOST} worker processes")
    check_worker_numbers(threads=threads, shutdown_ms=shutdown_ms)


def threads_per_worker(settings: Settings, queues: Sequence[str], threads: int) -> int:
    return threads or sum(settings.queue(q).max_workers for q in queues)


# -- arguments ---------------------------------------------------------------------------

#: The actions that take a value from the command line (and so a ``type``).
_VALUE_ACTIONS = (None, "store", "append", "extend")


def utf8_text(value: str) -> str:
    """An argparse ``type``: text that is valid UTF-8. An argument that is not (a Latin-1
    ``é``, byte 0xe9) reaches Python as a lone surrogate, which no query can take."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(value[exc.start])
        what = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"the character U+{code:04X}"
        raise argparse.ArgumentTypeError(f"{value!r} is not valid UTF-8 text ({what} at character {exc.start + 1}): "
                                         "give it in UTF-8") from None
    return value


def filter_text(value: str) -> str:
    """An argparse ``type``: the text of a filter option, never empty (an empty one would
    silently filter nothing)."""
    if not value:
        raise argparse.ArgumentTypeError("an empty value filters nothing: give the text to filter on, or leave "
                                         "the option out")
    return value


def ascii_digits(value: str) -> str:
    """An argparse ``type``: a number (or an outbox event's id) written in ASCII only
    (Python's ``int`` and ``float`` would also take ``١`` or ``５`` for digits)."""
    if not value.isascii():
        raise argparse.ArgumentTypeError(f"{value!r} is not written in ASCII digits (0-9)")
    return value


def ascii_hex(value: str) -> str:
    """An argparse ``type``: a job id or the start of one, in ASCII only (``uuid.UUID``
    would also take ``١`` for a digit)."""
    if not value.isascii():
        raise argparse.ArgumentTypeError(f"{value!r} is not a job id: give its hex digits in ASCII (0-9, a-f)")
    return value


def ascii_number(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert`` (``int``, ``bounded_int(…)``…), given ASCII digits only."""
    @functools.wraps(convert)
    def number(text: str) -> Any:
        return convert(ascii_digits(text))
    return number


def _checked(convert: Any) -> Any:
    """``convert`` (an argparse ``type``; None: the text as it is), after :func:`utf8_text`
    and, for ``int`` and ``float``, :func:`ascii_digits`."""
    if convert is None:
        convert = str
    elif not callable(convert):
        return convert
    if convert in (int, float):
        convert = ascii_number(convert)

    @functools.wraps(convert)
    def checked(text: str) -> Any:
        return convert(utf8_text(text))
    return checked


class CommandLineParser(OneLineParser):
    """``standmeet-jobs``'s parser, its subcommands' (an application's too): every argument
    is checked as it is read, refused in one line naming the option (exit 2) when it is not
    valid UTF-8, and ``int`` and ``float`` arguments when they are not in ASCII digits."""

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        if kwargs.get("action") in _VALUE_ACTIONS:
            kwargs["type"] = _checked(kwargs.get("type"))
        return super().add_argument(*args, **kwargs)
