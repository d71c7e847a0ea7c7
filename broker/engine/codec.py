"""A message as the broker stores it: its JSON text (as Dramatiq encodes it), its
priority, and the checks that refuse, before anything is written, a message Postgres
would refuse or its run could not use (:func:`check_message`, :func:`checked_json`); the
same check of JSON values serves ``emit``'s events (:func:`check_json_value`); and the
parameters of the statements that write messages, made from them (:func:`enqueue_params`,
:func:`enqueue_one_params`, :func:`batch_params`), which only the writer,
:mod:`broker.engine.enqueue`, executes."""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import re
import reprlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import dramatiq
from dramatiq.broker import MessageProxy
from dramatiq.message import Message

from broker.errors import ConfigError, InvalidMessage, MessageTooLarge
from broker.settings import MIB, Settings

if TYPE_CHECKING:
    from broker.engine.unique import UniqueKey

logger = logging.getLogger("standmeet.broker")

#: Longest text of a message's call (actor and arguments) in a log line.
MAX_LOGGED_CALL_CHARS = 300


def as_message(message: Message | MessageProxy) -> Message:
    return message._message if isinstance(message, MessageProxy) else message  # type: ignore[attr-defined]


#: Dramatiq's JSONEncoder writes ``json.dumps(fields, separators=(",", ":"))``: the same
#: encoder made once (json.dumps makes a new one per call with these separators).
compact_json = json.JSONEncoder(separators=(",", ":")).encode
_MESSAGE_FIELDS = tuple(f.name for f in dataclasses.fields(Message))
#: The standard library's scanner of one JSON value (its C one where built), as json.loads
#: configures it by default, called without json.loads's two Python calls and two
#: whitespace matches around it (:func:`loads_json`).
_scan_json: Callable[[str, int], tuple[Any, int]] = json.JSONDecoder().scan_once  # type: ignore[attr-defined]  # set by its __init__; not in typeshed


def _encoded_as_dramatiq_would(message: Message) -> bool:
    """Whether compact_json of :func:`_fields` is the text Dramatiq's encoder writes."""
    return type(message) is Message and type(dramatiq.get_encoder()) is dramatiq.JSONEncoder


def _fields(message: Message) -> dict[str, Any]:
    return {name: getattr(message, name) for name in _MESSAGE_FIELDS}


def loads_json(text: str) -> Any:
    """``json.loads(text)``: the same value, or the same error. About a microsecond less
    for a claimed message's text, which Postgres prints with no whitespace around its
    object: only text that is not one JSON value from its first character to its last
    goes through ``json.loads`` (which allows whitespace around it, and names what is
    wrong otherwise), and so does anything but a ``str``. One difference: a value
    nested nearly as deep as the interpreter's recursion limit loads here two levels
    deeper than through ``json.loads`` (no message the runtime sends nests deeper than
    ``MAX_JSON_DEPTH``)."""
    if type(text) is not str:
        return json.loads(text)
    try:
        value, end = _scan_json(text, 0)
    except (StopIteration, ValueError):
        end = -1  # json.loads below says what is wrong (its error, with no other chained to it)
    if end != len(text):
        return json.loads(text)
    return value


def message_json(message: Message | MessageProxy) -> str:
    """The message as JSON text, as Dramatiq encodes it."""
    plain = as_message(message)
    if _encoded_as_dramatiq_would(plain):
        return compact_json(_fields(plain))  # the same text as plain.encode().decode()
    return plain.encode().decode("utf-8")


def message_priority(message: Message | MessageProxy) -> int:
    """Lower runs first: the message's ``priority`` option, else its actor's priority."""
    value = message.options.get("priority")
    if value is None:
        broker = dramatiq.broker.global_broker
        actor = broker.actors.get(message.actor_name) if broker is not None else None
        value = actor.priority if actor is not None else 0
        if not isinstance(value, int) or isinstance(value, bool) or not -MAX_PRIORITY - 1 <= value <= MAX_PRIORITY:
            raise InvalidMessage(f"actor {message.actor_name!r} has the priority {_short.repr(value)}, not a whole "
                                 f"number from {-MAX_PRIORITY - 1} to {MAX_PRIORITY}")
    return int(value)


#: Dramatiq's options whose values are numbers, with the least each may be: (minimum,
#: whole numbers only). A value of another type, not finite, below its minimum or above
#: MAX_OPTION_VALUE is refused at send: in a run it would make the retry logic raise.
NUMERIC_OPTIONS: dict[str, tuple[float, bool]] = {
    "max_retries": (0, True), "retries": (0, True), "min_backoff": (0, False), "max_backoff": (0, False),
    "time_limit": (1, False), "max_age": (1, False), "delay": (0, False), "result_ttl": (1, False),
    "priority": (-(2 ** 31), True), "max_snoozes": (0, True), "snoozes": (0, True),
    "unique_period_s": (1, False),
}
#: Longest ``unique_key`` a message may name.
MAX_UNIQUE_KEY_CHARS = 1000
#: Options that are true or false.
BOOLEAN_OPTIONS = frozenset({"store_results", "pipe_ignore", "notify_shutdown"})
#: Largest number an option may hold: ten years of milliseconds.
MAX_OPTION_VALUE = 10 * 366 * 86_400_000
#: The latest ``message_timestamp`` a message may carry (milliseconds since 1970): the year 9999.
MAX_TIMESTAMP_MS = 253_402_300_799_999
#: The longest JSON of a float, as ``repr`` writes it (``-2.2250738585072014e-308``).
FLOAT_JSON_CHARS = 24
#: A priority is stored in an ``int4`` column: from ``-2**31`` to this.
MAX_PRIORITY = 2 ** 31 - 1
#: Options with a ceiling of their own, below MAX_OPTION_VALUE.
OPTION_MAXIMA: dict[str, int] = {"priority": MAX_PRIORITY}
#: An ``int`` of at most this many bits has fewer than 4,300 digits (Python's default
#: limit for writing one as text, which JSON does): one longer is looked at closely.
SHORT_INT_BITS = 14_000
#: Deepest nesting of objects and lists a value may have (messages' arguments, events' payloads).
MAX_JSON_DEPTH = 32
#: In JSON text (ASCII, as Dramatiq's encoder writes it), what may be a value Postgres
#: refuses: NaN or an infinity, a ``\u0000``, a surrogate. Only options whose text holds
#: one of these are walked, to clear it (a string may hold those letters).
_SUSPECT = re.compile(r"NaN|Infinity|\\u0000|\\ud[89a-f]")
#: A surrogate code point in a Python text: a lone one (a pair is one character).
_SURROGATE = re.compile("[\ud800-\udfff]")


def _bad_text(text: str) -> str | None:
    if "\x00" in text:
        return "a \\u0000 (NUL) character, which Postgres cannot store"
    if not text.isascii() and any("\ud800" <= c <= "\udfff" for c in text):
        return "a lone surrogate (not valid Unicode)"
    return None


def check_json_value(value: Any, *, what: str, error: type[Exception] = InvalidMessage) -> None:
    """Refuse, with ``error`` naming ``what`` and where, a value Postgres' jsonb would
    refuse (in a caller's transaction, aborting it) or JSON cannot express: NaN or an
    infinity, a ``\\u0000``, a lone surrogate, a non-string key, an object that is not
    JSON, or nesting deeper than MAX_JSON_DEPTH. The one check of everything written as
    JSON: events (``emit``), messages (sends, ``enqueue``, ``enqueue_many``). Walks
    iteratively: depth cannot blow the stack. A first walk only looks; the path of what it
    found is spelt out by a second (a send pays no text per value)."""
    if _storable_json(value):
        return
    stack: list[tuple[Any, int, str]] = [(value, 1, "$")]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict | list | tuple):
            if depth > MAX_JSON_DEPTH:
                raise error(f"{what} nests deeper than {MAX_JSON_DEPTH} levels")
            if isinstance(item, dict):
                for key, inner in item.items():
                    if not isinstance(key, str):
                        raise error(f"{what} has a non-string key at {path}")
                    bad = _bad_text(key)
                    if bad:
                        raise error(f"a key of {what} at {path} holds {bad}")
                    stack.append((inner, depth + 1, f"{path}.{key[:40]}"))
            else:
                stack.extend((inner, depth + 1, f"{path}[{n}]") for n, inner in enumerate(item))
        elif isinstance(item, str):
            bad = _bad_text(item)
            if bad:
                raise error(f"{what} holds {bad} at {path}")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise error(f"{what} holds {item!r} at {path}, which JSON cannot express")
        elif isinstance(item, int) and not isinstance(item, bool):
            if item.bit_length() > SHORT_INT_BITS and not _writable_int(item):
                raise error(f"{what} holds an integer of more than {sys.get_int_max_str_digits()} digits at "
                            f"{path}, more than this process writes as text")
        elif item is not None and not isinstance(item, bool):
            raise error(f"{what} holds a {type(item).__name__} at {path}, not JSON")


def _writable_int(value: int) -> bool:
    """Whether ``value`` can be written as text here (``sys.set_int_max_str_digits``)."""
    try:
        int.__repr__(value)
    except ValueError:
        return False
    return True


def _storable_json(value: Any) -> bool:
    """Whether :func:`check_json_value` would let ``value`` pass: the same rules, no paths."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind is str:
            if "\x00" in item or (not item.isascii() and _SURROGATE.search(item)):
                return False
        elif kind is int:
            if item.bit_length() > SHORT_INT_BITS:
                return False  # the careful walk writes it to see
        elif kind is bool or item is None:
            continue
        elif kind is float:
            if not math.isfinite(item):
                return False
        elif isinstance(item, dict):
            if depth > MAX_JSON_DEPTH:
                return False
            for key, inner in item.items():
                if type(key) is not str or "\x00" in key or (not key.isascii() and _SURROGATE.search(key)):
                    return False
                stack.append((inner, depth + 1))
        elif isinstance(item, list | tuple):
            if depth > MAX_JSON_DEPTH:
                return False
            stack.extend((inner, depth + 1) for inner in item)
        else:
            return False  # a str, int or float subclass, or not JSON: the careful walk decides
    return True


def numeric_option_wanted(name: str, value: Any) -> str | None:
    """What the numeric option ``name`` must be (``a whole number from 0 to …``) when
    ``value`` is not that, or None when its runs can use it: its kind and bounds are
    :data:`NUMERIC_OPTIONS`' (and :data:`OPTION_MAXIMA`'). A message's options and an
    actor's are judged by it alike."""
    minimum, whole = NUMERIC_OPTIONS[name]
    maximum = OPTION_MAXIMA.get(name, MAX_OPTION_VALUE)
    if (isinstance(value, bool) or not isinstance(value, int | float) or (whole and not isinstance(value, int))
            or not math.isfinite(value) or not minimum <= value <= maximum):
        return f"{'a whole number' if whole else 'a number'} from {minimum} to {maximum}"
    return None


def check_options(message: Message | MessageProxy) -> None:
    """Refuse a message whose Dramatiq options hold a value its run could not use
    (``max_retries='3'``, a negative ``time_limit``…), naming the option and the value."""
    options = message.options
    for name in options.keys() & NUMERIC_OPTIONS.keys():
        value = options[name]
        if name in ("max_retries", "priority", "delay") and value is None:
            continue  # no cap on retries; the actor's priority; no delay
        wanted = numeric_option_wanted(name, value)
        if wanted is not None:
            raise InvalidMessage(f"option {name}={_short.repr(value)} of a message to {message.actor_name!r} is not "
                                 f"{wanted}")
    for name in options.keys() & BOOLEAN_OPTIONS:
        if not isinstance(options[name], bool):
            raise InvalidMessage(f"option {name}={options[name]!r} of a message to {message.actor_name!r} "
                                 "is not true or false")
    key = options.get("unique_key")
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= MAX_UNIQUE_KEY_CHARS):
        raise InvalidMessage(f"option unique_key={_short.repr(key)} of a message to {message.actor_name!r} is not "
                             f"a text of 1 to {MAX_UNIQUE_KEY_CHARS} characters")


#: The options an actor may declare that :data:`NUMERIC_OPTIONS` bounds (a message's
#: progress, ``retries`` and ``snoozes``, and its own ``delay``, are not an actor's).
ACTOR_NUMERIC_OPTIONS = frozenset({"max_retries", "min_backoff", "max_backoff", "time_limit", "max_age",
                                   "result_ttl", "priority", "max_snoozes", "unique_period_s"})


def check_actor_options(actor_name: str, options: dict[str, Any]) -> None:
    """Refuse, as the actor is declared, an option its runs could not use (``time_limit=
    'abc'``, a negative ``max_snoozes``): :class:`ConfigError` naming the actor, the option
    and the value. Unchecked, a policy's before-hook would raise at every run, and Dramatiq
    would log it and run the job without that policy."""
    for name in options.keys() & ACTOR_NUMERIC_OPTIONS:
        value = options[name]
        if name in ("max_retries", "result_ttl") and value is None:
            continue  # no cap on retries; a result kept until deleted
        wanted = numeric_option_wanted(name, value)
        if wanted is not None:
            raise ConfigError(f"actor {actor_name!r}: option {name}={_short.repr(value)} is not {wanted}")


def delay_seconds(delay: Any) -> float:
    """A send's ``delay`` (milliseconds, or None) in seconds; a clear error if it is not one."""
    if delay is None:
        return 0.0
    if (isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay)
            or not 0 <= delay <= MAX_OPTION_VALUE):
        raise InvalidMessage(f"delay={delay!r} is not a number of milliseconds from 0 to {MAX_OPTION_VALUE}")
    return delay / 1000.0


#: A message id as Dramatiq makes one (``str(uuid.uuid4())``), and as the queue's ``uuid``
#: column gives it back: a message whose id had another form would come back under another.
_MESSAGE_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _is_message_id(value: Any) -> bool:
    return type(value) is str and _MESSAGE_ID.fullmatch(value) is not None


def _is_timestamp(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TIMESTAMP_MS


def check_message_id(message: Message | MessageProxy) -> None:
    """Refuse a message whose id is not a UUID in Dramatiq's form (8-4-4-4-12 lowercase
    hexadecimal digits), naming the id."""
    message_id = message.message_id
    if not _is_message_id(message_id):
        raise InvalidMessage(f"the message id {_short.repr(message_id)} of a message to {message.actor_name!r} is "
                             "not a UUID as Dramatiq writes one (8-4-4-4-12 lowercase hexadecimal digits)")


def check_message_fields(message: Message | MessageProxy) -> None:
    """Refuse a message whose actor name is not a text Postgres stores or whose timestamp
    is not a whole number of milliseconds (what Dramatiq writes), naming them."""
    actor_name = message.actor_name
    if type(actor_name) is not str or _bad_text(actor_name):
        raise InvalidMessage(f"the actor name {_short.repr(actor_name)} of a message is not a text Postgres "
                             "stores" + (f" (it holds {_bad_text(actor_name)})" if isinstance(actor_name, str) else ""))
    timestamp = message.message_timestamp
    if not _is_timestamp(timestamp):
        raise InvalidMessage(f"the message_timestamp {_short.repr(timestamp)} of a message to {actor_name!r} is not "
                             f"a whole number of milliseconds from 0 to {MAX_TIMESTAMP_MS}")


#: Up to this many messages, a batch's ids are compared in a set (of at most 0.5 MiB);
#: beyond, sorted in a list (a set of 100,000 ids holds 4 MiB, the sorted list of
#: references 0.8). The check of 5,000 ids, before the first row is sent: 1.4 ms sorted, 0.9 in a set.
DISTINCT_IN_A_SET = 10_000


def check_distinct_ids(messages: Sequence[Message | MessageProxy]) -> None:
    """Refuse a batch holding two messages with one id, naming it: one row per id."""
    # (an id that is not a text is refused by each message's own check)
    ids = [i for m in messages if type(i := m.message_id) is str]
    twice: str | None
    if len(ids) <= DISTINCT_IN_A_SET:
        if len(set(ids)) == len(ids):
            return
        twice = next(i for n, i in enumerate(ids) if i in ids[:n])
    else:
        ids.sort()
        twice = next((a for a, b in itertools.pairwise(ids) if a == b), None)
    del ids
    if twice is None:
        return
    actor = next(m.actor_name for m in messages if m.message_id == twice)
    raise InvalidMessage(f"the message id {_short.repr(twice)} is in this batch twice (a message to {actor!r}): "
                         "each message of a batch needs an id of its own")


def check_message(message: Message) -> None:
    """Refuse a message whose id is not a UUID (:func:`check_message_id`), whose options
    its run cannot use (:func:`check_options`) or whose arguments or options are not JSON
    Postgres stores (:func:`check_json_value`, as ``emit`` checks an event), naming the
    value and where it is."""
    check_message_id(message)
    check_message_fields(message)
    check_options(message)
    if _storable_json((message.args, message.kwargs, message.options)):
        return
    for part, value in (("arguments", message.args), ("keyword arguments", message.kwargs),
                        ("options", message.options)):
        check_json_value(value, what=f"the {part} of a message to {message.actor_name!r}")


def check_encoded_size(size: int, actor_name: str, max_bytes: int) -> None:
    """:class:`MessageTooLarge`, naming the size and the limit, for a message to
    ``actor_name`` of ``size`` bytes encoded over ``max_bytes``."""
    if size > max_bytes:
        raise MessageTooLarge(
            f"the message to {actor_name!r} is {size} bytes encoded, over the limit of {max_bytes} "
            "(STANDMEET_MESSAGE_MAX_BYTES); store large data in a table and send its id")


def _check_size(size: int, message: Message, max_bytes: int) -> None:
    check_encoded_size(size, message.actor_name, max_bytes)


def default_max_bytes() -> int:
    """STANDMEET_MESSAGE_MAX_BYTES of the configured broker (1 MiB without one)."""
    settings = getattr(dramatiq.broker.global_broker, "settings", None)
    return settings.message_max_bytes if isinstance(settings, Settings) else MIB


def checked_json(message: Message | MessageProxy, *, max_bytes: int | None = None) -> str:
    """The message's JSON text, once it is known to be one Postgres stores and no larger
    than ``max_bytes`` (default: :func:`default_max_bytes`); :class:`InvalidMessage` or
    :class:`MessageTooLarge` otherwise, before anything is written."""
    plain = as_message(message)
    check_message(plain)
    text = message_json(plain)
    limit = default_max_bytes() if max_bytes is None else max_bytes
    _check_size(len(text) if text.isascii() else len(text.encode("utf-8")), plain, limit)
    return text


def claim_size_params(max_bytes: int) -> dict[str, int]:
    """What :data:`broker.engine.sql.CLAIM` refuses: a row whose text, as Postgres writes it (a
    space after each ``,`` and ``:``, so up to 1.5 times the compact text a send measured),
    is over 1.5 × ``max_bytes``: never one a send accepted. A row whose stored size is
    below a sixth of that is not measured."""
    claim_max = max_bytes * 3 // 2
    return {"claim_max_bytes": claim_max, "claim_cheap_bytes": (claim_max - 64) // 6}


#: Options as the settle writes them: what jsonb refuses raises (NaN, an infinity).
_strict_json = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def options_json(message: Message | MessageProxy) -> str | None:
    """The message's options as JSON Postgres stores (a NUL or a lone surrogate in a text,
    such as an exception's message in a traceback, replaced by U+FFFD); None when a
    middleware left in them what JSON cannot hold."""
    try:
        text = _strict_json(message.options)
    except (TypeError, ValueError, RecursionError):
        logger.error("message %s: its options cannot be stored as JSON; they are kept as claimed",
                     message.message_id)
        return None
    if _SUSPECT.search(text) is not None:
        return _strict_json(_storable(json.loads(text)))
    return text


def _storable(value: Any) -> Any:
    if isinstance(value, str):
        return storable_text(value)
    if isinstance(value, dict):
        return {storable_text(k): _storable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_storable(v) for v in value]
    return value


def storable_text(text: str) -> str:
    """``text`` as Postgres stores it: a NUL or a lone surrogate becomes U+FFFD."""
    text = text.replace("\x00", "\ufffd")
    return text if text.isascii() else _SURROGATE.sub("\ufffd", text)


#: Dramatiq prints a message as its call; each value shown is cut while it is written, so
#: a megabyte of arguments is never turned into text to be logged.
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 120
_short.maxlist = _short.maxtuple = _short.maxdict = _short.maxset = 8
_short.maxlevel = 3


def logged_call(message: Message) -> str:
    """``actor(args…)`` as Dramatiq prints a message, cut to MAX_LOGGED_CALL_CHARS."""
    shown: list[str] = []
    length = 0
    values = itertools.chain(map(_short.repr, message.args),
                             (f"{k}={_short.repr(v)}" for k, v in message.kwargs.items()))
    for text in values:
        shown.append(text)
        length += len(text) + 2
        if length > MAX_LOGGED_CALL_CHARS:
            break
    call = f"{message.actor_name}({', '.join(shown)})"
    if len(call) > MAX_LOGGED_CALL_CHARS:
        call = f"{call[:MAX_LOGGED_CALL_CHARS]}… ({len(message.args)} args, {len(message.kwargs)} kwargs)"
    return call


def enqueue_params(messages: Iterable[Message | MessageProxy], delay: int | None = None, *,
                   max_bytes: int | None = None) -> dict[str, Any]:
    """Parameters of :data:`broker.engine.sql_enqueue.ENQUEUE` for ``messages``, due after ``delay`` ms;
    :class:`InvalidMessage` or :class:`MessageTooLarge` (naming the message) for a batch
    holding one Postgres would refuse or one over ``max_bytes`` (default:
    :func:`default_max_bytes`), before anything is written."""
    batch = [as_message(m) for m in messages]
    delay_s = delay_seconds(delay)
    for m in batch:
        check_message(m)
    limit = default_max_bytes() if max_bytes is None else max_bytes
    priorities = [str(message_priority(m)) for m in batch]
    if all(_encoded_as_dramatiq_would(m) for m in batch):
        # one encoder call for the whole array: the same text as joining each message's
        # (a third less time for a batch of thousands)
        array = compact_json([_fields(m) for m in batch])
        if len(array) > limit:  # one of them may be too large: each one's text ends at its id
            _check_sizes(array, batch, limit)
    else:
        array = f"[{','.join(checked_json(m, max_bytes=limit) for m in batch)}]"
    return _array_params(array, priorities, delay_s=delay_s)


def _check_sizes(array: str, batch: Sequence[Message], max_bytes: int) -> None:
    """Each message's size in the JSON ``array`` of ``batch`` (ASCII, in order): the distance
    from the end of one message's id to the end of the next's (its last field but one)."""
    start = 0
    for m in batch:
        marker = f'"message_id":"{m.message_id}"'
        end = array.find(marker, start)
        if end < 0:  # not where it should be: measure it alone
            _check_size(len(message_json(m)), m, max_bytes)
            continue
        end += len(marker)
        _check_size(end - start, m, max_bytes)
        start = end


#: The most characters of message text one array statement carries (a jsonb value holds at
#: most 256 MiB: a relay pass of big messages is written in several statements).
WRITE_CHARS = 64 * MIB


def within_chars(lengths: Sequence[int], most: int = WRITE_CHARS) -> Iterator[tuple[int, int]]:
    """``(start, end)`` of consecutive slices whose ``lengths`` add up to at most ``most``
    (a longer item is a slice of its own)."""
    start = total = 0
    for end, length in enumerate(lengths):
        if end > start and total + length > most:
            yield start, end
            start, total = end, 0
        total += length
    if start < len(lengths):
        yield start, len(lengths)


def batch_params(texts: Sequence[str], priorities: Sequence[str], *, delay_s: float = 0.0) -> dict[str, Any]:
    """Parameters of :data:`broker.engine.sql_enqueue.ENQUEUE` for messages already encoded: their JSON
    texts and priorities (as decimal text), in order, all due after ``delay_s``."""
    return _array_params(f"[{','.join(texts)}]", priorities, delay_s=delay_s)


def _array_params(array: str, priorities: Sequence[str], *, delay_s: float) -> dict[str, Any]:
    return {"messages": array, "priorities": f"{{{','.join(priorities)}}}", "delay_s": delay_s}


def enqueue_one_params(message: Message | MessageProxy, delay: int | None = None, *,
                       max_bytes: int | None = None) -> dict[str, Any]:
    """Parameters of :data:`broker.engine.sql_enqueue.ENQUEUE_ONE` for ``message``, due after ``delay`` ms;
    refused as :func:`checked_json` says, before anything is written."""
    delay_s = delay_seconds(delay)
    return {"queue": message.queue_name, "message_id": message.message_id,
            "message": checked_json(message, max_bytes=max_bytes),
            "delay_s": delay_s, "priority": message_priority(message)}


def refuse_non_json_encoder() -> None:
    """Messages live in a ``jsonb`` column: an encoder that does not write JSON is refused."""
    encoder = dramatiq.get_encoder()
    if not isinstance(encoder, dramatiq.JSONEncoder):
        raise ConfigError(
            f"the message encoder is {type(encoder).__name__}, but this broker stores messages as JSON "
            "(dramatiq-pg's jsonb column): use dramatiq.JSONEncoder or a subclass of it"
        )


def check_message_quickly(message: Message) -> None:
    """:func:`check_message`, with a short cut for the common message, whose arguments are
    plain scalars (None, a bool, an int, a finite float, a text without a NUL or a lone
    surrogate) and whose keyword arguments and options are empty: such a message passes
    every check. Any other is checked by :func:`check_message` itself: the same refusals,
    with the same words (a batch's writer checks thousands of messages at once)."""
    kwargs, options, actor_name = message.kwargs, message.options, message.actor_name
    if type(kwargs) is not dict or kwargs or type(options) is not dict or options or \
            not _plain_scalars(message.args) or not _is_message_id(message.message_id) \
            or type(actor_name) is not str or not actor_name.isascii() or "\x00" in actor_name \
            or not _is_timestamp(message.message_timestamp):
        check_message(message)


def _plain_scalars(values: Any) -> bool:
    """Whether ``values`` is a tuple of values :func:`_storable_json` lets pass without a walk."""
    return plain_args_size_bound(values) is not None


def plain_args_size_bound(values: Any) -> int | None:
    """For a tuple of plain scalars (what :func:`check_message_quickly` lets pass without
    :func:`check_message`: None, a bool, an int of at most ``SHORT_INT_BITS`` bits, a
    finite float, a text without a NUL or a lone surrogate), at least the length of its
    compact JSON, counted as ``broker.engine.copy_rows.json_size_bound`` counts it; None
    for anything else."""
    if type(values) is not tuple:
        return None
    size = 2 + len(values)
    for value in values:
        kind = type(value)
        if kind is str:
            if "\x00" in value:
                return None
            if value.isascii():
                size += 2 + (2 * len(value) if value.isprintable() else 6 * len(value))
            elif _SURROGATE.search(value):
                return None
            else:
                size += 2 + 12 * len(value)
        elif kind is int:
            bits = value.bit_length()
            if bits > SHORT_INT_BITS:
                return None
            size += 2 + (bits * 78 >> 8)
        elif kind is float:
            if not math.isfinite(value):
                return None
            size += FLOAT_JSON_CHARS
        elif value is None or kind is bool:
            size += 5
        else:
            return None
    return size


def quick_checked_size_bound(message: Message) -> int | None:
    """:func:`check_message_quickly`'s short cut and the bound of the arguments' JSON in one
    pass: for a message it lets pass unchecked (plain scalar arguments, no keyword
    arguments, no options, an id and a timestamp as Dramatiq makes them, a plain actor
    name), the size bound of its arguments; None for any other, which is then checked
    (and bounded) apart."""
    kwargs, options, actor_name, timestamp = message.kwargs, message.options, message.actor_name, \
        message.message_timestamp
    if type(kwargs) is not dict or kwargs or type(options) is not dict or options \
            or type(actor_name) is not str or not actor_name.isascii() or "\x00" in actor_name \
            or type(timestamp) is not int or not 0 <= timestamp <= MAX_TIMESTAMP_MS \
            or not _is_message_id(message.message_id):
        return None
    return plain_args_size_bound(message.args)


def followup_params(followups: Sequence[tuple[str, Message, float, UniqueKey | None]]) -> dict[str, Any]:
    """The parameters of ``sql_enqueue.FOLLOWUPS_OF_SETTLED`` (in the settle statement) for
    ``followups``: (the id of the run that sent it, the message, its delay in seconds, its
    unique key or None)."""
    return {
        "f_parents": [parent for parent, _, _, _ in followups],
        "f_queues": [m.queue_name for _, m, _, _ in followups],
        "f_ids": [m.message_id for _, m, _, _ in followups],
        "f_messages": [message_json(m) for _, m, _, _ in followups],
        "f_delays": [delay for _, _, delay, _ in followups],
        "f_priorities": [message_priority(m) for _, m, _, _ in followups],
        # hex: the settle's connection sends arrays of str, int, float and UUID only
        "f_unique_keys": [key.digest.hex() if key is not None else None for _, _, _, key in followups],
        "f_unique_periods": [key.period_s if key is not None else None for _, _, _, key in followups],
        "f_unique_states": [key.states if key is not None else None for _, _, _, key in followups],
    }
