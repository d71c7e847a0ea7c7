"""Unique jobs (migration 0021): an actor's ``unique=`` (:class:`UniqueBy`) or a message's
``unique_key`` option makes a message's key; a send is skipped while a message of its key
is live. The statements that write under a key are the writer's
(:func:`broker.engine.enqueue.unique_write`); the skips are counted here."""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from broker.engine.codec import (
    MAX_OPTION_VALUE,
    as_message,
    check_message,
    checked_json,
    message_priority,
)
from broker.errors import ConfigError

#: Bits of ``unique_states``: the states in which a message holds its unique key.
UNIQUE_QUEUED, UNIQUE_RUNNING, UNIQUE_DONE = 1, 2, 4


@dataclass(frozen=True)
class UniqueBy:
    """An actor's uniqueness, ``@dramatiq.actor(unique=UniqueBy(...))`` (``unique=True`` is
    ``UniqueBy()``): a send is skipped, and returns the live message, while a message of
    this actor with the same key is queued (delayed ones too: a delayed message is a
    queued one due later) or running; with ``period_s``, also done within the period.

    ``args``: the key is the actor and its arguments (args and kwargs, canonical JSON,
    hashed); False: the actor alone (one live message per actor). ``period_s``: the key
    also holds the start of the period (by the database's clock) the send falls in, so a
    new period is a new key, and a message done in this period still holds it.
    A message's own ``unique_key`` option (any text) replaces the arguments in its key,
    and its ``unique_period_s`` option the period."""

    args: bool = True
    period_s: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.args, bool):
            raise ConfigError(f"UniqueBy(args={self.args!r}) is not true or false")
        period = self.period_s
        if period is not None and (isinstance(period, bool) or not isinstance(period, int | float)
                                   or not math.isfinite(period) or not 1 <= period <= MAX_OPTION_VALUE):
            raise ConfigError(f"UniqueBy(period_s={period!r}) is not a number of seconds from 1 to "
                              f"{MAX_OPTION_VALUE}")


@dataclass(frozen=True)
class UniqueKey:
    """What a send writes in ``unique_key`` and ``unique_states``: the key's digest, the
    period (seconds; the database adds the period's start) and the covered states."""

    digest: bytes
    period_s: float | None

    @property
    def states(self) -> int:
        return UNIQUE_QUEUED | UNIQUE_RUNNING | (UNIQUE_DONE if self.period_s is not None else 0)


def unique_of(actor: Any) -> UniqueBy | None:
    """The actor's ``unique`` option as a :class:`UniqueBy` (None: not unique);
    :class:`ConfigError` for a value that is neither true, false nor a UniqueBy."""
    option = actor.options.get("unique") if actor is not None else None
    if option is None or option is False:
        return None
    if option is True:
        return UniqueBy()
    if isinstance(option, UniqueBy):
        return option
    raise ConfigError(f"actor {actor.actor_name!r}: unique={option!r} is not true, false or a UniqueBy")


def _digest(parts: list[Any]) -> bytes:
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def unique_key_for(actor_name: str, by: UniqueBy | None, args: Any, kwargs: Any,
                   options: dict[str, Any]) -> UniqueKey | None:
    """The unique key of a message to ``actor_name`` with these arguments and options
    (None: it has none): its ``unique_key`` option, else the actor's :class:`UniqueBy`.
    A key is the actor's own: the same ``unique_key`` on two actors is two keys."""
    given = options.get("unique_key")
    period = options.get("unique_period_s")
    if given is None and by is None and period is None:
        return None
    if given is not None:
        parts: list[Any] = [actor_name, "key", given]
    elif by is None or by.args:
        parts = [actor_name, "args", list(args), kwargs or {}]
    else:
        parts = [actor_name, "actor"]
    if period is None and by is not None:
        period = by.period_s
    return UniqueKey(_digest(parts), None if period is None else float(period))


def unique_key_of(message: Message | MessageProxy, broker: Any = None) -> UniqueKey | None:
    """The unique key of ``message`` (None for a message without one: the common case,
    two dictionary look-ups)."""
    options = message.options
    current = broker if broker is not None else dramatiq.broker.global_broker
    actor = current.actors.get(message.actor_name) if current is not None else None
    by = unique_of(actor) if actor is not None and "unique" in actor.options else None
    if by is None and "unique_key" not in options and "unique_period_s" not in options:
        return None
    try:
        return unique_key_for(message.actor_name, by, message.args, message.kwargs, options)
    except (TypeError, ValueError):  # arguments JSON cannot write: the message's own check names them
        check_message(as_message(message))
        raise


def any_unique_key(messages: Sequence[Message | MessageProxy], broker: Any = None) -> bool:
    """Whether any of ``messages`` carries a unique key (:func:`unique_key_of` is not None
    for it), in one pass: each actor's ``unique`` option read once, each message's
    options read twice."""
    current = broker if broker is not None else dramatiq.broker.global_broker
    actors = current.actors if current is not None else {}
    unique_actor: dict[str, bool] = {}
    for message in messages:
        name = message.actor_name
        unique = unique_actor.get(name)
        if unique is None:
            actor = actors.get(name)
            unique = unique_actor[name] = (actor is not None and "unique" in actor.options
                                           and unique_of(actor) is not None)
        if unique:
            return True
        options = message.options
        if options.get("unique_key") is not None or options.get("unique_period_s") is not None:
            return True
    return False


@dataclass(frozen=True)
class UniqueItem:
    """A message to write under its unique key: its id, queue, actor, JSON text and priority."""

    message_id: str
    queue_name: str
    actor_name: str
    text: str
    priority: str
    key: UniqueKey


@dataclass
class UniqueOutcome:
    """What a unique write did: for each item, the text of the live message that holds its
    key when the item was skipped for it (None: written, or its own id was there already),
    and the skips per (queue, actor)."""

    live: list[str | None]
    skipped: dict[tuple[str, str], int]


#: One step of a unique write: a statement and its parameters; the driver sends back its rows.
Step = tuple[str, dict[str, Any]]


def unique_item(message: Message | MessageProxy, key: UniqueKey, *, max_bytes: int | None = None) -> UniqueItem:
    """The :class:`UniqueItem` of a message, checked as every send is (:func:`checked_json`)."""
    return UniqueItem(message.message_id, message.queue_name, message.actor_name,
                      checked_json(message, max_bytes=max_bytes), str(message_priority(message)), key)


def live_messages(messages: Sequence[Message], outcome: UniqueOutcome) -> list[Message]:
    """``messages``, each skipped one replaced by the live message that holds its key."""
    return [m if text is None else Message.decode(text.encode("utf-8"))
            for m, text in zip(messages, outcome.live, strict=True)]


def split_unique(messages: Sequence[Message], broker: Any = None) -> tuple[list[int], list[UniqueKey | None]]:
    """The places of the messages that carry a unique key, and every message's key."""
    keys = [unique_key_of(m, broker) for m in messages]
    return [i for i, k in enumerate(keys) if k is not None], keys
