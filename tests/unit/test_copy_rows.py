"""A batch's rows for COPY: each message's text is the one Dramatiq's encoder writes, the
quick check refuses exactly what the full check refuses, a field is escaped as COPY's
text format wants, and a batch over one chunk is checked whole and then made a chunk at
a time, the same rows."""

from __future__ import annotations

import math
import random
from itertools import pairwise

import dramatiq
import pytest
from dramatiq.broker import MessageProxy

from broker.engine import copy_rows
from broker.engine.codec import check_message, check_message_quickly, compact_json, message_json
from broker.engine.copy_rows import (
    CopyBatch,
    checked_text_size_bound,
    copy_text,
    json_size_bound,
    message_text,
    text_size_bound,
)
from broker.errors import InvalidMessage, MessageTooLarge


def _message(*args: object, kwargs: dict[str, object] | None = None, **options: object) -> dramatiq.Message:
    return dramatiq.Message(queue_name="q", actor_name="a", args=args, kwargs=kwargs or {}, options=options)


class _Text(str):
    pass


def _nested(depth: int) -> list[object]:
    value: list[object] = ["deep"]
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("message", [
    _message(),
    _message(1, 2.5, -0.0, 10 ** 40, True, None, "plain"),
    _message('é"x\\', "tab\there", "line\nfeed", "\u2603", "\U0001f600", kwargs={"k": [1, {"z": None}]}),
    _message([1, [2, [3]]], {"nested": {"deep": "x"}}, priority=7, unique_key="k", x="\u2603"),
    _message(float("nan"), float("inf"), "\ud800"),  # refused by the check, encoded all the same
    dramatiq.Message(queue_name="q\t1", actor_name='a"b', args=(), kwargs={}, options={}, message_id="id",
                     message_timestamp=True),  # not an int: the whole message goes through the encoder
])
def test_a_message_is_written_as_the_text_dramatiqs_encoder_writes(message):
    assert message_text(message, {}) == message_json(message) == message.encode().decode("utf-8")


def test_without_the_c_encoder_the_text_is_the_same():
    message = _message(1, "x", kwargs={"k": 2}, priority=3)
    assert message_text(message, {}, encode=None) == message_json(message)


@pytest.mark.parametrize("args, kwargs, options", [
    ((1, 2.5, "x", None, True), {}, {}),
    ((float("nan"),), {}, {}),
    ((math.inf,), {}, {}),
    ((-math.inf,), {}, {}),
    (("nul\x00",), {}, {}),
    (("lone \ud800",), {}, {}),
    ((_Text("sub\x00class"),), {}, {}),
    ((_Text("subclass"),), {}, {}),
    (([1, float("nan")],), {}, {}),
    (({1: "int key"},), {}, {}),
    ((object(),), {}, {}),
    ((_nested(40),), {}, {}),
    ((1,), {"k": float("nan")}, {}),
    ((1,), {}, {"max_retries": "3"}),
    ((1,), {}, {"priority": 2}),
])
def test_the_quick_check_refuses_what_the_full_check_refuses_with_the_same_words(args, kwargs, options):
    message = _message(*args, kwargs=kwargs, **options)
    try:
        check_message(message)
        expected = None
    except InvalidMessage as exc:
        expected = str(exc)
    try:
        check_message_quickly(message)
        got = None
    except InvalidMessage as exc:
        got = str(exc)
    assert got == expected


@pytest.mark.parametrize("args, kwargs, options, in_one_pass", [
    ((1, 2.5, "x", None, True, "é", "tab\t", -(2 ** 60)), {}, {}, True),
    ((), {}, {}, True),
    ((float("nan"),), {}, {}, False),
    ((math.inf,), {}, {}, False),
    (("nul\x00",), {}, {}, False),
    (("lone \ud800",), {}, {}, False),
    ((_Text("subclass"),), {}, {}, False),
    ((2 ** 20_000,), {}, {}, False),
    (([1],), {}, {}, False),
    ((1,), {"k": 1}, {}, False),
    ((1,), {}, {"priority": 2}, False),
])
def test_the_one_pass_check_and_bound_takes_only_plain_messages_and_bounds_them_as_the_walk_does(
        args, kwargs, options, in_one_pass):
    message = _message(*args, kwargs=kwargs, **options)
    bound = checked_text_size_bound(message, {})
    assert (bound is not None) == in_one_pass  # any other is checked and bounded apart, as before
    if bound is not None:
        check_message(message)  # the full check lets it pass too
        assert bound == text_size_bound(message, {}) and bound >= len(message_json(message))


def test_the_one_pass_bound_of_a_message_as_dramatiq_makes_it_is_the_bound_of_the_walk():
    rng = random.Random(20261203)
    for _ in range(2000):
        args = tuple(rng.choice([None, True, rng.getrandbits(rng.randrange(1, 200)) * rng.choice([1, -1]),
                                 rng.random() * 10 ** rng.randrange(-30, 30), "x" * rng.randrange(30), "é☃"])
                     for _ in range(rng.randrange(5)))
        message = _message(*args)
        assert checked_text_size_bound(message, {}) == text_size_bound(message, {}), message
        assert text_size_bound(message, {}) >= len(message_json(message))  # type: ignore[operator]


def test_a_field_is_escaped_as_copys_text_format_wants():
    assert copy_text("plain-id") == "plain-id"
    assert copy_text("a\\b\tc\nd\re") == "a\\\\b\\tc\\nd\\re"
    assert copy_text("é\u2603") == "é\u2603"


def _batch_texts(batch: CopyBatch, end_of_row: str = "\n") -> str:
    return "".join(batch.texts(end_of_row))


def test_a_batch_over_one_chunk_is_checked_whole_then_made_a_chunk_at_a_time_with_the_same_rows(monkeypatch):
    messages = [_message(n, "x" * n) for n in range(25)]
    whole = _batch_texts(CopyBatch(messages, max_bytes=1 << 20), "\t2026-01-01 00:00:00+00\n")
    # Given chunks of 10 messages, or of 600 characters
    monkeypatch.setattr(copy_rows, "CHUNK_MESSAGES", 10)
    by_count = CopyBatch(messages, max_bytes=1 << 20)
    monkeypatch.setattr(copy_rows, "CHUNK_CHARS", 600)
    by_chars = CopyBatch(messages, max_bytes=1 << 20)
    # Then each covers the batch in order, in chunks within the bounds, with the same rows
    assert list(by_count.spans()) == [(0, 10), (10, 20), (20, 25)]
    spans = list(by_chars.spans())
    assert spans[0][0] == 0 and spans[-1][1] == 25 and all(a[1] == b[0] for a, b in pairwise(spans))
    assert len(spans) > 3
    for batch in (by_count, by_chars):
        assert _batch_texts(batch, "\t2026-01-01 00:00:00+00\n") == whole
    rows = whole.splitlines()
    assert len(rows) == 25
    assert rows[3].split("\t") == ["q", messages[3].message_id, "queued", message_json(messages[3]), "0",
                                   "2026-01-01 00:00:00+00"]


def test_a_row_carries_the_options_priority_and_escapes_what_copy_would_read_as_a_separator():
    message = _message("back\\slash", "tab\t", priority=-4)
    proxy = MessageProxy(_message("proxied"))
    batch = CopyBatch([message, proxy], max_bytes=1 << 20)
    first, second = _batch_texts(batch).splitlines()
    fields = first.split("\t")
    assert fields[3] == message_json(message).replace("\\", "\\\\") and fields[4] == "-4"
    assert second.split("\t")[1] == proxy.message_id


def test_a_batch_with_a_refused_message_in_its_last_chunk_is_refused_when_it_is_made(monkeypatch):
    monkeypatch.setattr(copy_rows, "CHUNK_MESSAGES", 10)
    with pytest.raises(InvalidMessage, match="holds nan at"):
        CopyBatch([_message(n) for n in range(25)] + [_message(float("nan"))], max_bytes=1 << 20)
    with pytest.raises(MessageTooLarge, match="over the limit of 2000"):
        CopyBatch([_message(n) for n in range(25)] + [_message("x" * 3000)], max_bytes=2000)


def test_chunks_start_small_and_double_up_to_the_most_a_chunk_holds(monkeypatch):
    # Given a first chunk of 2 messages and at most 10 a chunk
    monkeypatch.setattr(copy_rows, "FIRST_CHUNK_MESSAGES", 2)
    monkeypatch.setattr(copy_rows, "CHUNK_MESSAGES", 10)
    messages = [_message(n) for n in range(40)]
    # Then 40 messages are made in chunks of 2, 4, 8, then 10, and the rest, checked now or as they come
    spans = [(0, 2), (2, 6), (6, 14), (14, 24), (24, 34), (34, 40)]
    assert list(CopyBatch(messages, max_bytes=1 << 20).spans()) == spans
    assert list(CopyBatch(messages, max_bytes=1 << 20, check_now=False).spans()) == spans


def test_a_batch_checked_as_it_is_made_gives_its_first_chunks_rows_then_refuses_at_the_chunk_that_holds_the_refused(
        monkeypatch):
    monkeypatch.setattr(copy_rows, "CHUNK_MESSAGES", 10)
    # Given a batch of three chunks whose last message is refused, checked as it is made
    messages = [_message(n) for n in range(24)] + [_message(float("nan"))]
    batch = CopyBatch(messages, max_bytes=1 << 20, check_now=False)
    texts = batch.texts()
    # When its rows are made, the first two chunks' come out
    made = [next(texts), next(texts), next(texts), next(texts)]
    assert "".join(made).count("\n") == 20
    # Then the third chunk's check refuses the batch, naming the value
    with pytest.raises(InvalidMessage, match="holds nan at"):
        next(texts)
    # and so does asking for its queues or its chunks
    with pytest.raises(InvalidMessage, match="holds nan at"):
        batch.queues  # noqa: B018
    with pytest.raises(InvalidMessage, match="holds nan at"):
        list(batch.spans())


_CHARS = "ab \"\\\t\n\x00\x1f\x7f~é\u2028\uffff\U0001f600"


def _value(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return "".join(rng.choice(_CHARS) for _ in range(rng.randrange(12)))
    if kind == 1:
        return rng.choice([0, -1, 7, 2 ** 63, -(10 ** rng.randrange(40)), rng.getrandbits(rng.randrange(1, 300))])
    if kind == 2:
        return rng.choice([0.1, -2.2250738585072014e-308, 1.7976931348623157e308, 5e-324, -0.0, 1e16, 123456.789,
                           rng.random() * 10 ** rng.randrange(-30, 30)])
    if kind == 3:
        return rng.choice([None, True, False])
    if kind in (4, 5):
        return "x" * rng.randrange(3)
    if kind == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 7:
        return tuple(_value(rng, depth + 1) for _ in range(rng.randrange(4)))
    return {str(_value(rng, 5)): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


def test_the_size_bound_is_never_under_the_text_dramatiqs_encoder_writes():
    rng = random.Random(20261202)
    for _ in range(3000):
        value = _value(rng)
        bound = json_size_bound(value)
        assert bound is not None and bound >= len(compact_json(value)), value
        message = _message(*(value if isinstance(value, list) else [value]),
                           kwargs=value if isinstance(value, dict) else {})
        size = text_size_bound(message, {})
        assert size is not None and size >= len(message_json(message)), message


def test_a_value_the_bound_does_not_know_is_measured_instead():
    assert json_size_bound([1, {2: "int key"}]) is None
    assert json_size_bound(["x", _Text("subclass")]) is None
    assert text_size_bound(dramatiq.Message(queue_name="q", actor_name="a", args=(), kwargs={}, options={},
                                            message_id="id", message_timestamp=True), {}) is None
