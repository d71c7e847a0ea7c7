"""What the command line's modules share: the last word of a command, and the checks of
the worker counts ``run`` and ``check`` take."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

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
