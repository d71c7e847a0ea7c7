"""The broker writes each message as exactly the JSON text Dramatiq's encoder would."""

from __future__ import annotations

import dramatiq
from dramatiq.broker import MessageProxy

from broker.engine.codec import message_json


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
