"""The broker writes each message as exactly the JSON text Dramatiq's encoder would, and reads
a claimed one's text as ``json.loads`` does."""

from __future__ import annotations

import json

import dramatiq
import pytest
from dramatiq.broker import MessageProxy

from broker.engine.codec import loads_json, message_json


def test_a_message_is_written_as_dramatiqs_own_json_text():
    message = dramatiq.Message(queue_name="q", actor_name="a", args=(1, 'é"x', 2.5, None),
                               kwargs={"k": [1, {"z": 1}]}, options={"eta": 5, "x": "\u2603"})
    expected = message.encode().decode("utf-8")
    assert message_json(message) == expected
    assert message_json(MessageProxy(message)) == expected


def test_a_batch_is_written_as_the_array_of_each_messages_own_json_text():
    from broker.engine.codec import enqueue_params

    messages = [dramatiq.Message(queue_name="q", actor_name="a", args=(n, 'é"x'), kwargs={"k": [n]},
                                 options={"priority": n, "x": "\u2603"}) for n in range(3)]
    params = enqueue_params([messages[0], MessageProxy(messages[1]), messages[2]], delay=1500)
    assert params["messages"] == "[" + ",".join(m.encode().decode("utf-8") for m in messages) + "]"
    assert params["priorities"] == "{0,1,2}" and params["delay_s"] == 1.5


#: Texts a claimed row could hold: a message as Postgres prints it, and every way a text
#: can differ from one JSON value from its first character to its last.
LOADED_TEXTS = [
    '{"queue_name":"q","args":[1,"\\u00e9"],"options":{"x":1.5,"y":null,"z":[true,false]}}',
    '{"a": {"b": [1, 2, {"c": "d"}]}, "e": -1e-3}',
    '  {"a":1}', '{"a":1}  ', '\n{"a":1}\n', '[]', '"text"', '12', 'NaN', '-Infinity',
    '', ' ', '{"a":1}{"b":2}', '{"a":1} x', '{"a":', '{"a":1,}', "{'a':1}", '{"a":"\x01"}', 'nul', '[1,]',
]


@pytest.mark.parametrize("text", LOADED_TEXTS)
def test_a_message_text_is_loaded_as_json_loads_loads_it_or_refused_with_its_error(text):
    expected: object = None
    error: ValueError | None = None
    try:
        expected = json.loads(text)
    except ValueError as exc:
        error = exc
    if error is not None:
        with pytest.raises(type(error)) as raised:
            loads_json(text)
        assert str(raised.value) == str(error)
        assert type(raised.value.__context__) is type(error.__context__)  # nothing of ours chained to it
    else:
        loaded = loads_json(text)
        assert loaded == expected or (loaded != loaded and expected != expected)  # NaN is not NaN
        assert type(loaded) is type(expected)


def test_what_is_not_a_str_is_loaded_by_json_loads_itself():
    assert loads_json(b'{"a":[1]}') == {"a": [1]}
    with pytest.raises(TypeError) as raised:
        loads_json(None)  # type: ignore[arg-type]
    with pytest.raises(TypeError) as expected:
        json.loads(None)  # type: ignore[arg-type]
    assert str(raised.value) == str(expected.value)
