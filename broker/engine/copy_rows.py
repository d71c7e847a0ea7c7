"""Messages as the rows of :data:`broker.engine.sql_enqueue.COPY_QUEUED` (COPY's text
format), a chunk at a time: how :mod:`broker.engine.enqueue`, the one writer of message
rows, writes a batch of messages without a unique key.

A :class:`CopyBatch` checks every message of its batch, as every send is checked
(:func:`broker.engine.codec.check_message`, and its encoded size against
STANDMEET_MESSAGE_MAX_BYTES): all of them when it is made, so the writer runs no
statement for a batch that holds a message Postgres or its run would refuse; or, made
with ``check_now=False`` (the writer's own transaction, which a refusal rolls back
whole), each chunk's just before its rows are made, so Postgres stores the first rows
while the rest are checked. The size needs no encoding where a bound of it is under the
limit (:func:`text_size_bound`, a walk of the message's values; the common message's are
a few scalars): the rows are made a chunk at a time, while the COPY is under way, so
Postgres stores one chunk while the next is made. The first chunk is small
(:data:`FIRST_CHUNK_MESSAGES`), so Postgres starts at once, and each is twice the one
before, up to :data:`CHUNK_MESSAGES` messages; a chunk also ends once the bound of its
rows reaches :data:`CHUNK_CHARS` characters (a message larger than that is a chunk of its
own): a batch of any length holds one chunk's rows in memory at once, beside the
caller's messages. Nothing here runs a statement.

A row is ``queue_name, message_id, "state", message, priority`` (and ``eta``, when the
writer gives one), each escaped as COPY's text format wants (a backslash, tab, newline or
carriage return spelt with a backslash): the message is its JSON text as Dramatiq
encodes it, the same text a single send writes (:func:`broker.engine.codec.message_json`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from json.encoder import encode_basestring_ascii
from typing import Any

import dramatiq
from dramatiq.message import Message

from broker.engine.codec import (
    _MESSAGE_FIELDS,
    FLOAT_JSON_CHARS,
    as_message,
    check_encoded_size,
    check_message_quickly,
    checked_json,
    compact_json,
    message_json,
    message_priority,
    quick_checked_size_bound,
)
from broker.settings import MIB

#: A chunk of rows ends after this many messages…
CHUNK_MESSAGES = 1000
#: … the first after this many (each next one twice the one before, up to CHUNK_MESSAGES:
#: Postgres stores the first rows while the next are checked and made)…
FIRST_CHUNK_MESSAGES = 100
#: … or once the bound of its rows' size reaches this many characters (a message over it
#: is a chunk alone).
CHUNK_CHARS = MIB
#: What a row adds to its message's text and its queue's field, about: the separators, the
#: id (a UUID's 36 characters), ``queued`` and the priority.
_ROW_CHARS = 80

#: What COPY's text format spells with a backslash.
_ESCAPES = str.maketrans({"\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r"})

#: A value's JSON, as a sequence of texts to join.
PartEncoder = Callable[[Any, int], "tuple[str, ...] | list[str]"]


def _part_encoder() -> PartEncoder | None:
    """``compact_json``'s C encoder, made once (``compact_json`` makes one per call): call
    it with the value and 0. It keeps no state between calls (no cycle check: a checked
    message has no cycle, as none nests deeper than ``MAX_JSON_DEPTH``), so threads share
    it. None where the C encoder is missing or does not write what ``compact_json`` writes
    (then each message is ``compact_json``'s)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:
        return None
    try:
        encoder: PartEncoder = make(None, json.JSONEncoder().default, encode_basestring_ascii, None, ":", ",",
                                    False, False, True)
        sample: Any = (1, 2.5, True, None, "é\\\"\n", [{"k": float("nan")}], {"a": {}}, 10 ** 30)
        if "".join(encoder(sample, 0)) != compact_json(sample):
            return None
    except (TypeError, ValueError):
        return None
    return encoder


_ENCODE_PART = _part_encoder()


def message_text(message: Message, prefixes: dict[tuple[str, str], str],
                 encode: PartEncoder | None = _ENCODE_PART) -> str:
    """The JSON text of a checked message of Dramatiq's own class, as Dramatiq's encoder
    writes it (the text of :func:`broker.engine.codec.message_json`), written field by
    field: its arguments encoded, the rest put in place (``prefixes``: the text before the
    arguments for each (queue, actor) seen already, filled as it goes)."""
    queue, actor, message_id, timestamp = (message.queue_name, message.actor_name, message.message_id,
                                           message.message_timestamp)
    if encode is None or type(queue) is not str or type(actor) is not str or type(message_id) is not str \
            or type(timestamp) is not int:
        return compact_json({name: getattr(message, name) for name in _MESSAGE_FIELDS})
    prefix = prefixes.get((queue, actor)) or _prefix(queue, actor, prefixes)
    kwargs, options = message.kwargs, message.options
    return (f'{prefix}{"".join(encode(message.args, 0))},"kwargs":'
            f'{"{}" if type(kwargs) is dict and not kwargs else "".join(encode(kwargs, 0))},"options":'
            f'{"{}" if type(options) is dict and not options else "".join(encode(options, 0))},"message_id":'
            f'{encode_basestring_ascii(message_id)},"message_timestamp":{timestamp}}}')


def _prefix(queue: str, actor: str, prefixes: dict[tuple[str, str], str]) -> str:
    prefix = prefixes[queue, actor] = \
        f'{{"queue_name":{encode_basestring_ascii(queue)},"actor_name":{encode_basestring_ascii(actor)},"args":'
    return prefix


#: What :func:`message_text` writes besides the prefix and the values.
_FIXED_CHARS = len(',"kwargs":,"options":,"message_id":,"message_timestamp":}')


def checked_text_size_bound(message: Message, prefixes: dict[tuple[str, str], str]) -> int | None:
    """For the common message (:func:`broker.engine.codec.quick_checked_size_bound`: one
    :func:`broker.engine.codec.check_message_quickly` lets pass unchecked), what
    :func:`text_size_bound` gives, in the same pass as that check; None for any other
    (check it, then bound it)."""
    args_size = quick_checked_size_bound(message) if _ENCODE_PART is not None else None
    if args_size is None or type(message.queue_name) is not str:
        return None
    queue, actor = message.queue_name, message.actor_name
    prefix = prefixes.get((queue, actor)) or _prefix(queue, actor, prefixes)
    # {} and {} for the keyword arguments and options; the id, a UUID, is 36 characters quoted
    return len(prefix) + args_size + 4 + 38 + len(str(message.message_timestamp)) + _FIXED_CHARS


def text_size_bound(message: Message, prefixes: dict[tuple[str, str], str]) -> int | None:
    """At least the length of :func:`message_text` of ``message`` (a checked message of
    Dramatiq's own class), without writing it: None where it holds a value
    :func:`json_size_bound` does not bound (then it is written to be measured)."""
    queue, actor, message_id, timestamp = (message.queue_name, message.actor_name, message.message_id,
                                           message.message_timestamp)
    if _ENCODE_PART is None or type(queue) is not str or type(actor) is not str or type(message_id) is not str \
            or type(timestamp) is not int:
        return None
    kwargs, options = message.kwargs, message.options
    args_size = json_size_bound(message.args)
    kwargs_size = 2 if type(kwargs) is dict and not kwargs else json_size_bound(kwargs)
    options_size = 2 if type(options) is dict and not options else json_size_bound(options)
    if args_size is None or kwargs_size is None or options_size is None:
        return None
    prefix = prefixes.get((queue, actor)) or _prefix(queue, actor, prefixes)
    return (len(prefix) + args_size + kwargs_size + options_size + len(encode_basestring_ascii(message_id))
            + len(str(timestamp)) + _FIXED_CHARS)


def json_size_bound(value: Any) -> int | None:
    """At least the length of ``compact_json(value)`` (ASCII), from a walk of ``value``: a
    text counts 2 characters for each of its characters (6 for each where one may be
    escaped as ``\\uXXXX``, 12 for each past ASCII: a surrogate pair), an int its digits,
    a float 24. None for a value of another type (a subclass too) or a dict with a key
    that is not a text: such a value is written to be measured."""
    size = 0
    stack = [value]
    while stack:
        item = stack.pop()
        kind = type(item)
        if kind is str:
            size += 2 + (2 * len(item) if item.isascii() and item.isprintable() else
                         6 * len(item) if item.isascii() else 12 * len(item))
        elif kind is int:
            size += 2 + (item.bit_length() * 78 >> 8)  # digits <= bits * log10(2) + 1, and a sign
        elif kind is float:
            size += FLOAT_JSON_CHARS
        elif item is None or kind is bool:
            size += 5
        elif kind is list or kind is tuple:
            size += 2 + len(item)
            stack.extend(item)
        elif kind is dict:
            size += 2 + 2 * len(item)
            for key, inner in item.items():
                if type(key) is not str:
                    return None
                stack.append(key)
                stack.append(inner)
        else:
            return None
    return size


def copy_text(value: str) -> str:
    """``value`` as a field of COPY's text format: a backslash, tab, newline or carriage
    return escaped (one that holds none, the common case, is returned as it is)."""
    if value.isprintable() and "\\" not in value:
        return value
    return value.translate(_ESCAPES)


class CopyBatch:
    """A batch of messages, checked, as rows of :data:`broker.engine.sql_enqueue.COPY_QUEUED`.

    Made from the messages (none with a unique key) and the size limit; raises
    :class:`broker.errors.InvalidMessage` or :class:`broker.errors.MessageTooLarge`,
    naming the message, for a batch that holds one that would be refused: when it is
    made, or, with ``check_now=False``, when the chunk that holds it is reached (by
    :meth:`spans`, :meth:`texts` or :attr:`queues`). ``queues``: the queues of its
    messages, to wake; :meth:`spans`: its chunks; :meth:`texts`: its rows, made a chunk at
    a time."""

    def __init__(self, messages: Sequence[Message], *, max_bytes: int, check_now: bool = True) -> None:
        self.messages = messages
        self.max_bytes = max_bytes
        #: Where each chunk checked so far ends (an index into ``messages``).
        self.ends: list[int] = []
        self._fast = type(dramatiq.get_encoder()) is dramatiq.JSONEncoder
        self._queue_fields: dict[str, str] = {}
        self._priorities: dict[str, str] = {}
        self._prefixes: dict[tuple[str, str], str] = {}
        if check_now:
            self.check_all()

    @property
    def queues(self) -> list[str]:
        """The queues of the batch's messages, in order of name (each message checked first)."""
        self.check_all()
        return sorted(self._queue_fields)

    def spans(self) -> Iterator[tuple[int, int]]:
        """Each chunk's (start, end) in ``messages``; a chunk not checked yet is checked
        just before it is given (raising for a refused message there)."""
        start = k = 0
        while True:
            end = self.ends[k] if k < len(self.ends) else self._check_chunk()
            if end is None:
                return
            yield start, end
            start, k = end, k + 1

    def check_first_chunk(self) -> None:
        """Check the messages of the first chunk, if not checked yet (a batch no longer
        than :data:`FIRST_CHUNK_MESSAGES` is then checked whole)."""
        if not self.ends:
            self._check_chunk()

    def check_all(self) -> None:
        """Check every message not checked yet."""
        while self._check_chunk() is not None:
            pass

    def texts(self, end_of_row: str = "\n") -> Iterator[str]:
        """The batch's rows as pieces of COPY's input, a chunk's made at a time; each row
        ends with ``end_of_row`` (a tab and the ``eta`` field before the newline, where
        the writer gives one)."""
        for start, end in self.spans():
            yield end_of_row.join(self._rows(start, end))
            yield end_of_row

    def _check_chunk(self) -> int | None:
        """Check the messages of the next chunk (each one's values, then its size: bounded,
        or measured where the bound is over the limit), ending it where its bound says;
        where it ends, or None once every message is checked."""
        messages, limit, fast, prefixes = self.messages, self.max_bytes, self._fast, self._prefixes
        queue_fields, priorities = self._queue_fields, self._priorities
        start = self.ends[-1] if self.ends else 0
        if start >= len(messages):
            return None
        count = chars = 0
        end = len(messages)
        most = min(CHUNK_MESSAGES, FIRST_CHUNK_MESSAGES << min(len(self.ends), 20))
        for i in range(start, len(messages)):
            message = messages[i]
            if type(message) is not Message:
                message = as_message(message)
            size = checked_text_size_bound(message, prefixes) if fast and type(message) is Message else None
            if size is None:
                check_message_quickly(message)
                size = text_size_bound(message, prefixes) if fast and type(message) is Message else None
            if size is None or size > limit:
                text = message_text(message, prefixes) if fast and type(message) is Message else \
                    checked_json(message, max_bytes=limit)
                size = len(text) if text.isascii() else len(text.encode("utf-8"))
                check_encoded_size(size, message.actor_name, limit)
            queue = message.queue_name
            if queue not in queue_fields:
                queue_fields[queue] = copy_text(queue)
            if message.options.get("priority") is None and message.actor_name not in priorities:
                priorities[message.actor_name] = str(message_priority(message))  # its actor's, checked
            count += 1
            chars += size + _ROW_CHARS + len(queue_fields[queue])
            if count >= most or chars >= CHUNK_CHARS:
                end = i + 1
                break
        self.ends.append(end)
        return end

    def _rows(self, start: int, end: int) -> list[str]:
        """The rows of the messages from ``start`` to ``end`` (checked already)."""
        messages, fast, prefixes = self.messages, self._fast, self._prefixes
        queue_fields, priorities = self._queue_fields, self._priorities
        rows: list[str] = []
        for i in range(start, end):
            message = messages[i]
            if type(message) is not Message:
                message = as_message(message)
            if fast and type(message) is Message:
                text = message_text(message, prefixes)
                if "\\" in text:
                    text = text.replace("\\", "\\\\")
            else:
                text = copy_text(message_json(message))
            priority: Any = message.options.get("priority")
            # the message's own, or its actor's (read and checked once, by the check)
            priority = priorities[message.actor_name] if priority is None else int(priority)
            message_id = message.message_id
            rows.append(f"{queue_fields[message.queue_name]}\t"
                        f"{copy_text(message_id if type(message_id) is str else str(message_id))}"
                        f"\tqueued\t{text}\t{priority}")
        return rows
