"""The one exception tree of standmeet-jobs.

::

    StandmeetError                     base of everything we raise on purpose
    ├── ConfigError                    a setting is missing, malformed or out of range
    │   ├── StartupRefused             a start-up check failed: the process refuses to start
    │   │   └── BudgetError            the connection budget does not hold
    │   └── ModuleNotLoaded            a module named to load cannot be imported
    ├── DatabaseError                  Postgres could not be reached or answered badly
    │   └── DatabaseUnavailable        no connection could be made (server down, bad URL)
    ├── MigrationError                 a schema migration failed; nothing of it was applied
    ├── OutboxError                    an event cannot be emitted; nothing was written
    │   ├── UnknownTopic               no route for that topic
    │   ├── PayloadTooLarge            the payload is over STANDMEET_OUTBOX_MAX_PAYLOAD_BYTES
    │   └── InvalidPayload             not storable JSON (NaN, \\u0000, a lone surrogate, too deep)
    ├── MessageRefused                 a message cannot be sent or enqueued; nothing was written
    │   ├── InvalidMessage             arguments not storable JSON, or an option its run cannot use
    │   └── MessageTooLarge            over STANDMEET_MESSAGE_MAX_BYTES encoded
    ├── JobError                       raised inside jobs, by the job layer
    │   ├── DeadlineExceeded           a cooperative deadline (the job's time limit) has passed
    │   ├── JobCancelled               an operator cancelled the running job
    │   └── ResultRefused              the job's result cannot be kept (not JSON): the job fails
    └── Deferred  (also dramatiq.Retry) the job asks to run later; not a failure
        └── middleware.Snooze          run again after N seconds, retry count untouched

    dramatiq Interrupt (a BaseException: a job's ``except Exception`` cannot swallow it)
    └── CutOff                         the worker could not prove it lives, and stepped down:
                                       its running jobs stop and run again (no retry counted)

psycopg and psycopg2 errors are translated at the boundary with ``raise … from exc``,
so callers only ever see this tree (and Dramatiq's own ``ConnectionError`` inside the
consumer, which Dramatiq's worker knows how to restart from).
"""

from __future__ import annotations

from dramatiq.errors import Retry
from dramatiq.middleware import MiddlewareError
from dramatiq.middleware.threading import Interrupt


class StandmeetError(Exception):
    """Base class of every error raised on purpose by standmeet-jobs."""


class ConfigError(StandmeetError):
    """A setting is missing, malformed or out of range. The message names it."""



class StartupRefused(ConfigError, MiddlewareError):
    """A start-up check failed (the connection budget, an application's declared check).

    Also a :class:`dramatiq.middleware.MiddlewareError`, so that Dramatiq lets it
    escape from ``before_worker_boot`` and the worker process refuses to start.
    """


class BudgetError(StartupRefused):
    """The sum of the served queues' workers and the relay exceeds half the pool, or the
    processes `run` would start need more connections than the server can give."""


class ModuleNotLoaded(ConfigError):
    """A module named on the command line (or in STANDMEET_APP_MODULES) cannot be imported:
    it is missing, or its import raised. The message names it and says why, in one line."""


class DatabaseError(StandmeetError):
    """Postgres could not be reached, or answered in a way we cannot go on from."""


class DatabaseUnavailable(DatabaseError):
    """No connection could be made to Postgres."""


class MigrationError(StandmeetError):
    """A migration failed; its transaction was rolled back."""


class OutboxError(StandmeetError):
    """An event cannot be emitted. Raised before anything is written."""


class UnknownTopic(OutboxError):
    """No route is declared for the topic: an event nobody would receive."""


class PayloadTooLarge(OutboxError):
    """The event's payload is over the configured cap."""


class InvalidPayload(OutboxError):
    """The payload is not JSON Postgres can store: NaN or an infinity, a ``\\u0000``, a
    lone surrogate, a non-string key, or nesting deeper than the limit."""


class MessageRefused(StandmeetError):
    """A message cannot be sent or enqueued. Raised before anything is committed (on a
    caller's connection, before any statement), so the caller's transaction stays
    usable. The message names the value and the limit."""


class InvalidMessage(MessageRefused):
    """The message's arguments are not JSON Postgres can store (NaN or an infinity, a
    ``\\u0000``, a lone surrogate, an object that is not JSON, nesting too deep), or one
    of its options holds a value its run could not use (``max_retries='3'``)."""


class MessageTooLarge(MessageRefused):
    """The encoded message is over STANDMEET_MESSAGE_MAX_BYTES."""


class JobError(StandmeetError):
    """Raised inside a job by the job layer itself."""


class DeadlineExceeded(JobError):
    """The running job passed its time limit (checked cooperatively)."""


class JobCancelled(JobError):
    """An operator cancelled the running job (seen at its next deadline check)."""


class ResultRefused(JobError):
    """The job returned a value its result backend cannot keep (a ``set``, an object that
    is not JSON): the job fails for good with this reason, and a waiter gets it at once."""


class CutOff(Interrupt):
    """Raised in a running job when its worker could not confirm its heartbeat for long
    enough that another process may soon rescue the job: the run stops here, before it
    could overlap a second run elsewhere, and runs again (no retry is counted: the job is
    not at fault)."""


class Deferred(StandmeetError, Retry):
    """The job asks to run later. Not a failure: no retry is counted, no error logged.

    The broker turns a job that raised it into a *skipped* message, so every
    middleware releases what it acquired (``after_skip_message``) and no failure
    callback fires; the snooze policy then re-enqueues it with a delay.
    """

    def __init__(self, message: str = "", delay_ms: int | None = None) -> None:
        super().__init__(message)
        Retry.__init__(self, message, delay=delay_ms)


def first_line(exc: BaseException) -> str:
    """An error's first line (its type's name when it has no text): what a one-line
    message quotes of a psycopg or other error."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
