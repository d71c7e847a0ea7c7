"""Actors that keep their journal in a file, not in the database: they go on through a
database outage, and the journal says what each run really did.

The journal file is named by ``STANDMEET_TEST_JOURNAL``; each line is
``<event> <message id> <pid> <retries>``, event one of start, returned, raised, interrupted.
"""

from __future__ import annotations

import os

import dramatiq
from dramatiq.middleware import CurrentMessage

import tests.support.jobs  # noqa: F401  (configures the broker, declares the test actors)
from tests.support.jobs import cooperative_sleep


def _note(event: str) -> None:
    message = CurrentMessage.get_current_message()
    assert message is not None
    line = f"{event} {message.message_id} {os.getpid()} {message.options.get('retries', 0)}\n"
    with open(os.environ["STANDMEET_TEST_JOURNAL"], "a", encoding="utf-8") as journal:
        journal.write(line)


@dramatiq.actor(actor_name="test.journal", queue_name="index", max_retries=20, min_backoff=10, max_backoff=100)
def journal(ms: int, fail_first: bool = False, then_ms: int | None = None) -> None:
    """Runs ``ms`` milliseconds (``then_ms`` on any later run, if given); with
    ``fail_first``, its first run raises at the end. A run interrupted by its worker (a
    time limit, a step-down) is noted ``interrupted``."""
    message = CurrentMessage.get_current_message()
    if then_ms is not None and message is not None and any(
            e[0] == "start" and e[1] == message.message_id for e in read_journal(os.environ["STANDMEET_TEST_JOURNAL"])):
        ms = then_ms
    _note("start")
    try:
        cooperative_sleep(ms / 1000)
    except BaseException:
        _note("interrupted")
        raise
    message = CurrentMessage.get_current_message()
    if fail_first and message is not None and not message.options.get("retries"):
        _note("raised")
        raise RuntimeError("the first run of this job fails")
    _note("returned")


@dramatiq.actor(actor_name="test.poison", queue_name="index", max_retries=0)
def poison() -> None:
    """Kills the process that runs it, the moment it starts."""
    _note("start")
    os._exit(3)


def read_journal(path: str) -> list[tuple[str, str, int, int]]:
    """The journal's lines as (event, message id, pid, retries)."""
    try:
        with open(path, encoding="utf-8") as journal:
            lines = journal.read().splitlines()
    except FileNotFoundError:
        return []
    parsed = []
    for line in lines:
        event, message_id, pid, retries = line.split()
        parsed.append((event, message_id, int(pid), int(retries)))
    return parsed
