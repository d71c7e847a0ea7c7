"""A relayed event's messages have ids derived from the event: uuid5 of "<event id>/<route>"."""

from __future__ import annotations

import uuid

from broker.outbox import MESSAGE_NAMESPACE, message_id_of


def test_the_spelt_out_message_id_is_the_uuid5_of_the_event_and_route():
    for event_id in (1, 9, 200, 123_456_789, 2**40, 2**62):
        for index in (0, 1, 7):
            assert message_id_of(event_id, index) == str(uuid.uuid5(MESSAGE_NAMESPACE, f"{event_id}/{index}"))
