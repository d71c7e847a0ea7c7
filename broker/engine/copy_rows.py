"""Messages as the rows of :data:`broker.engine.sql_enqueue.COPY_QUEUED` (COPY's text
format), a chunk at a time: how :mod:`broker.engine.enqueue`, the one writer of message
rows, writes a batch of messages without a unique key.

A :class:`CopyBatch` checks every message of its batch when it is made, as every send
is checked (:func:`broker.engine.codec.check_message`, and its encoded size against
STANDMEET_MESSAGE_MAX_BYTES), so the writer runs no statement for a batch that holds a
message Postgres or its run would refuse. Its rows are then made again, chunk by chunk,
while they are written: a chunk ends at :data:`CHUNK_MESSAGES` messages or once its rows
hold :data:`CHUNK_CHARS` characters (a message larger than that is a chunk of its own),
so a batch of any length holds at most one chunk's rows in memory at once, beside the
caller's messages. A batch that fits in one chunk is encoded once: its rows are kept
from the check. Nothing here runs a statement.

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
    as_message,
    check_encoded_size,
    check_message_quickly,
    checked_json,
    compact_json,
    message_priority,
)
from broker.settings import MIB

#: A chunk of rows ends after this many messages…
CHUNK_MESSAGES = 10_000
#: … or once its rows hold this many characters (a message over it is a chunk alone).
CHUNK_CHARS = 4 * MIB
#: Rows joined into one piece of COPY's input (each piece is sent as it is made).
PIECE_ROWS = 1000

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
    prefix = prefixes.get((queue, actor))
    if prefix is None:
        prefix = prefixes[queue, actor] = \
            f'{{"queue_name":{encode_basestring_ascii(queue)},"actor_name":{encode_basestring_ascii(actor)},"args":'
    kwargs, options = message.kwargs, message.options
    return (f'{prefix}{"".join(encode(message.args, 0))},"kwargs":'
            f'{"{}" if type(kwargs) is dict and not kwargs else "".join(encode(kwargs, 0))},"options":'
            f'{"{}" if type(options) is dict and not options else "".join(encode(options, 0))},"message_id":'
            f'{encode_basestring_ascii(message_id)},"message_timestamp":{timestamp}}}')


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
    naming the message, for a batch that holds one that would be refused. ``queues``: the
    queues of its messages, to wake; :meth:`texts`: its rows, a chunk at a time."""

    def __init__(self, messages: Sequence[Message], *, max_bytes: int) -> None:
        self.messages = messages
        self.max_bytes = max_bytes
        #: Where each chunk ends (an index into ``messages``).
        self.ends: list[int] = []
        self._fast = type(dramatiq.get_encoder()) is dramatiq.JSONEncoder
        self._queue_fields: dict[str, str] = {}
        self._priorities: dict[str, str] = {}
        self._prefixes: dict[tuple[str, str], str] = {}
        self._kept: list[str] | None = None
        start = 0
        while start < len(messages):
            rows, start = self._rows(start)
            self.ends.append(start)
            if start == len(messages) and len(self.ends) == 1:
                self._kept = rows  # one chunk: written as it was checked

    @property
    def queues(self) -> list[str]:
        """The queues of the batch's messages, in order of name."""
        return sorted(self._queue_fields)

    def spans(self) -> Iterator[tuple[int, int]]:
        """Each chunk's (start, end) in ``messages``."""
        start = 0
        for end in self.ends:
            yield start, end
            start = end

    def texts(self, end_of_row: str = "\n") -> Iterator[str]:
        """The batch's rows as pieces of COPY's input, a chunk's rows made at a time; each
        row ends with ``end_of_row`` (a tab and the ``eta`` field before the newline,
        where the writer gives one)."""
        for start, end in self.spans():
            rows = self._kept if self._kept is not None else self._rows(start, end, checked=True)[0]
            for first in range(0, len(rows), PIECE_ROWS):
                yield end_of_row.join(rows[first:first + PIECE_ROWS])
                yield end_of_row

    def _rows(self, start: int, stop: int | None = None, *, checked: bool = False) -> tuple[list[str], int]:
        """The rows of the messages from ``start`` to the end of their chunk (``stop``,
        once known), each checked unless it was (``checked``); and where the chunk ended."""
        messages, limit, fast, prefixes = self.messages, self.max_bytes, self._fast, self._prefixes
        queue_fields, priorities = self._queue_fields, self._priorities
        last = min(len(messages), start + CHUNK_MESSAGES) if stop is None else stop
        budget = CHUNK_CHARS if stop is None else None  # made again, rows end where they ended
        rows: list[str] = []
        i = start
        while i < last:
            message = messages[i]
            i += 1
            if type(message) is not Message:
                message = as_message(message)
            if not checked:
                check_message_quickly(message)
            if fast and type(message) is Message:
                text = message_text(message, prefixes)
                if len(text) > limit:  # ASCII: its length is its size
                    check_encoded_size(len(text), message.actor_name, limit)
                if "\\" in text:
                    text = text.replace("\\", "\\\\")
            else:
                text = copy_text(checked_json(message, max_bytes=limit))
            queue = message.queue_name
            queue_field = queue_fields.get(queue)
            if queue_field is None:
                queue_field = queue_fields[queue] = copy_text(queue)
            priority: Any = message.options.get("priority")
            if priority is not None:
                priority = int(priority)
            else:  # the actor's: the same for each of its messages
                priority = priorities.get(message.actor_name)
                if priority is None:
                    priority = priorities[message.actor_name] = str(message_priority(message))
            message_id = message.message_id
            row = f"{queue_field}\t{copy_text(message_id if type(message_id) is str else str(message_id))}" \
                  f"\tqueued\t{text}\t{priority}"
            rows.append(row)
            if budget is not None:
                budget -= len(row)
                if budget <= 0:
                    break
        return rows, i
