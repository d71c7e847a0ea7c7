"""A statement longer than psycopg caches is converted to Postgres's placeholders once."""

from __future__ import annotations

import pytest

from broker.engine import sql
from broker.engine.settler import _SETTLE, _SETTLE_DONE
from broker.pg.long_statement import LongStatement, array_text


def test_named_placeholders_become_numbered_ones_in_order_of_first_use_each_name_once():
    statement = LongStatement("SELECT %(b)s::int, %(a)b::text[], %(b)s::int + %(c)t::int")

    assert statement.query == b"SELECT $1::int, $2::text[], $1::int + $3::int"
    assert statement.names == ("b", "a", "c")
    assert statement.arrays == {"a"}  # a list given for it is sent as an array's text


def test_an_escaped_percent_is_one_percent_sign_for_postgres():
    statement = LongStatement("SELECT %(n)s::int %% 7, 'a%%b'")

    assert statement.query == b"SELECT $1::int % 7, 'a%b'"


def test_a_placeholder_cast_to_an_array_in_one_place_only_is_refused_when_the_statement_is_declared():
    with pytest.raises(ValueError, match=r"\['ids'\] cast to an array in one place"):
        LongStatement("SELECT %(ids)s::uuid[], cardinality(%(ids)s)")


def test_a_percent_that_is_no_placeholder_is_refused_when_the_statement_is_declared():
    with pytest.raises(ValueError, match="no named placeholder"):
        LongStatement("SELECT %(n)s::int % 7")


def test_the_settles_are_longer_than_psycopg_caches_and_are_converted_once():
    # psycopg keeps the conversion of a query of at most 4,096 bytes only
    assert len(sql.SETTLE_DONE.encode()) > 4096 and len(sql.SETTLE.encode()) > 4096
    assert _SETTLE_DONE.text is sql.SETTLE_DONE and _SETTLE.text is sql.SETTLE
    assert b"%(" not in _SETTLE_DONE.query and b"%(" not in _SETTLE.query
    assert {"ids", "claims", "worker_id", "awaited"} <= set(_SETTLE_DONE.names)


def test_an_arrays_text_quotes_every_element_escapes_backslashes_and_quotes_and_writes_null_bare():
    assert array_text(["a", 'say "hi"', "C:\\x", None, "", 2, 0.1]) \
        == '{"a","say \\"hi\\"","C:\\\\x",NULL,"","2","0.1"}'
    assert array_text([]) == "{}"


@pytest.mark.parametrize("element", [True, [1], 1j, b"x"])
def test_an_element_whose_text_postgres_would_misread_is_refused_naming_its_type(element):
    with pytest.raises(TypeError, match=type(element).__name__):
        array_text(["fine", element])


@pytest.mark.parametrize("values", [
    ["0b5a7c1e-8d2f-4c3b-9a1e-2f3d4c5b6a7e", "orders.confirm", ""],
    ['say "hi"', "plain"],
    ["C:\\x", "plain"],
    [0, 1, -7, 2**70],
    [0.1, -0.0, 1e-9, 12345.678, float("inf")],
], ids=["strings", "a string with a quote", "a string with a backslash", "ints", "floats"])
def test_a_list_of_one_kind_is_written_as_each_element_alone_would_be(values):
    # Given the text each element is written as inside a mixed list (a None beside it
    # makes the list mixed; its NULL is the last element)
    each = array_text([*values, None])

    # Then the list of that one kind is written the same, element for element
    assert array_text(values) == each.removesuffix(",NULL}") + "}"


def test_a_list_of_one_kind_that_postgres_would_misread_is_still_refused():
    with pytest.raises(TypeError, match="bool"):
        array_text([True, False])


class _EqualToStr(type):
    """A metaclass whose classes compare (and hash) equal to ``str``."""

    def __eq__(cls, other: object) -> bool:
        return other is str or type.__eq__(cls, other)

    def __hash__(cls) -> int:
        return hash(str)


class _LooksLikeStr(str, metaclass=_EqualToStr):
    pass


def test_an_element_of_a_type_that_only_compares_equal_to_str_is_still_refused():
    with pytest.raises(TypeError, match="_LooksLikeStr"):
        array_text(["fine", _LooksLikeStr("b")])
