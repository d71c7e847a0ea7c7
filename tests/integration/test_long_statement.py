"""A long statement, converted once, runs with its parameters given by name."""

from __future__ import annotations

import json
import math
import uuid

import psycopg
import pytest

from broker.pg.long_statement import LongStatement

PADDED = LongStatement(
    "SELECT %(ids)b::uuid[], %(n)s::int * 2, %(texts)b::text[], %(n)s::int + %(m)t::int, %(floats)s::float8[],"
    " %(docs)b::jsonb[], %(ints)s::int[]" + " " * 5000 + "-- padded past what psycopg caches")

#: Text an array's element must carry as it is: quotes, backslashes, the array syntax's own
#: characters, spaces, a word Postgres would read as NULL unquoted, nothing at all, not ASCII.
AWKWARD = ['say "hi"', "C:\\temp\\", "a,b", "{x}", " padded ", "NULL", "", "snow ☃", "\\\"", "line\nbreak"]


def test_a_long_statement_runs_with_its_parameters_by_name_each_list_arriving_as_it_was(database_url):
    ids = [str(uuid.uuid4()), str(uuid.uuid4())]
    floats = [1.5, None, 1e-05, 0.1 + 0.2, -0.0, 123456789.123456789, math.inf]
    docs = [json.dumps({"q": 'a "b" \\ c', "n": [1, None]}), None]
    with psycopg.connect(database_url) as conn:
        for _ in range(7):  # past psycopg's threshold for preparing it on the server
            row = PADDED.execute(conn, {"ids": ids, "n": 21, "m": 1, "texts": AWKWARD + [None], "floats": floats,
                                        "docs": docs, "ints": (3, -4, None), "unused": "ignored"}).fetchone()
            assert row == ([uuid.UUID(i) for i in ids], 42, AWKWARD + [None], 22, floats,
                           [{"q": 'a "b" \\ c', "n": [1, None]}, None], [3, -4, None])
        # an empty list is an empty array
        row = PADDED.execute(conn, {"ids": [], "n": 0, "m": 0, "texts": [], "floats": [], "docs": [],
                                    "ints": []}).fetchone()
        assert row == ([], 0, [], 0, [], [], [])


def test_a_missing_parameter_is_named_before_anything_is_sent(database_url):
    with psycopg.connect(database_url) as conn:
        with pytest.raises(KeyError, match="texts"):
            PADDED.execute(conn, {"ids": [], "n": 1, "m": 1, "floats": [], "docs": [], "ints": []})
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
