"""Statements longer than psycopg caches, their placeholders converted once.

psycopg turns a query's named placeholders (``%(ids)s``) into Postgres's own (``$1``) at
every execute, and keeps the result only for queries of at most 4,096 bytes. The settles
are longer (with the history's roll-up, the common one is ~7.9 kB): psycopg parsed each
again per batch, 25-45 µs of the settler's interpreter time, which the worker threads
wait for. A :class:`LongStatement` is converted once, when its module is imported, and
executed as Postgres's own text (psycopg's ``RawCursor``), its parameters still given by
name.

A list given for a placeholder the statement casts to an array (``%(ids)s::uuid[]``) is
sent as Postgres's text of the array, made here in one pass (``{"a","b"}``: every
element quoted, ``NULL`` for None), which Postgres reads with the cast's type: psycopg's
dumpers of lists find each list's element type and escape element by element, ~70 % of
a settle's interpreter time. Every other parameter is dumped by psycopg in its automatic
format (a ``%(x)b`` is taken as ``%(x)s``); what the statement says of a value (its
casts) is unchanged.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any
from uuid import UUID

import psycopg

#: A named placeholder (``%(name)s``, ``%(name)b``, ``%(name)t``) and the array type it is
#: cast to, if any (``::uuid[]``), or an escaped ``%%``.
_PLACEHOLDER = re.compile(r"%\((\w+)\)[sbt](?:::([\w\".]+)\[\])?|%%")


def array_text(values: Iterable[Any]) -> str:
    """The text Postgres reads as an array of ``values`` (one dimension): each element
    quoted (its ``\\`` and ``"`` escaped), ``NULL`` for None, a float as Python writes it
    back exactly. An element that is not a str, an int, a float or a UUID (a bool, a
    list, an enum...) raises TypeError: its text would not be what Postgres should read.

    A list of one kind (the settle's ids, claims, actors and times) is joined whole, with
    no step per element in Python: the same text, in a third of the time for ids, a fifth
    less for times (their ``repr`` is most of it)."""
    if type(values) is list and values:
        # the types' identities: a type that only compares equal to str is not str
        if len(set(map(id, map(type, values)))) == 1:
            kind = type(values[0])
            if kind is str:
                bare = "".join(values)
                if "\\" not in bare and '"' not in bare:
                    return '{"' + '","'.join(values) + '"}'
            elif kind is int:
                return '{"' + '","'.join(map(str, values)) + '"}'
            elif kind is float:
                return '{"' + '","'.join(map(repr, values)) + '"}'
    parts = []
    for value in values:
        kind = type(value)
        if kind is str:
            text = value
        elif value is None:
            parts.append("NULL")
            continue
        elif kind is float:
            text = repr(value)
        elif kind is int or kind is UUID:
            text = str(value)
        else:
            raise TypeError(f"an array's element is a {kind.__name__} ({value!r:.40}): "
                            "give a str, an int, a float, a UUID or None")
        if "\\" in text or '"' in text:
            text = text.replace("\\", "\\\\").replace('"', '\\"')
        parts.append('"' + text + '"')
    return "{" + ",".join(parts) + "}"


class LongStatement:
    """A statement written with named placeholders, converted once to ``$n`` ones."""

    __slots__ = ("text", "query", "names", "arrays")

    def __init__(self, text: str) -> None:
        names: list[str] = []
        arrays: set[str] = set()
        scalars: set[str] = set()

        def numbered(match: re.Match[str]) -> str:
            name, array_of = match.group(1), match.group(2)
            if name is None:
                return "%"
            if name not in names:
                names.append(name)
            (scalars if array_of is None else arrays).add(name)
            return f"${names.index(name) + 1}" + ("" if array_of is None else f"::{array_of}[]")

        converted = _PLACEHOLDER.sub(numbered, text)
        if arrays & scalars:
            raise ValueError(f"placeholder(s) {sorted(arrays & scalars)} cast to an array in one place and not in "
                             "another: one value is sent for every place, so cast it to the array everywhere")
        stray = _PLACEHOLDER.sub("", text)
        if "%" in stray:
            at = stray.index("%")
            raise ValueError(f"a '%' that is no named placeholder (write '%%' for the operator): "
                             f"...{stray[max(at - 20, 0):at + 20]!r}")
        #: The statement as written (what tests and ``EXPLAIN`` read).
        self.text = text
        #: The statement as Postgres reads it.
        self.query = converted.encode()
        #: The parameters' names, in the order of ``$1``, ``$2``...
        self.names = tuple(names)
        #: The parameters cast to an array: a list given for one is sent as its text.
        self.arrays = frozenset(arrays)

    def execute(self, conn: psycopg.Connection[Any], params: Mapping[str, Any]) -> psycopg.RawCursor[Any]:
        """Execute on ``conn`` (in its transaction, if one is open) with ``params`` by name;
        the cursor, to fetch from. A missing parameter raises KeyError before anything is sent."""
        arrays = self.arrays
        args = [array_text(value) if name in arrays and isinstance(value, list | tuple) else value
                for name, value in ((name, params[name]) for name in self.names)]
        cursor: psycopg.RawCursor[Any] = psycopg.RawCursor(conn)
        return cursor.execute(self.query, args)
