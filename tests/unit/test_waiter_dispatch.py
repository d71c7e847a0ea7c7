"""Receipt waiters: each notification reaches exactly the requests waiting for its
message; a failure answers at once; a full channel refuses the next waiter."""

from __future__ import annotations

import uuid

import pytest

from broker.errors import InvalidMessage
from broker.outbox.receipts import Listener

URL = "postgresql://nobody.invalid/none"  # never connected: dispatch needs no database
#: message ids, as Postgres writes them in a receipt
a, b, c, m, x, unknown = (str(uuid.UUID(int=n)) for n in range(1, 7))


def test_a_waiter_is_answered_true_once_every_message_it_awaits_is_done():
    listener = Listener(URL, "standmeet_receipts_index")
    waiter = listener.add([a, b])
    assert waiter is not None
    listener.dispatch(a, "done")
    assert not waiter.event.is_set()
    listener.dispatch(b, "done")
    assert waiter.wait(0) is True


def test_a_message_that_failed_answers_its_waiter_false_at_once():
    listener = Listener(URL, "standmeet_receipts_index")
    waiter = listener.add([a, b])
    assert waiter is not None
    listener.dispatch(a, "rejected")
    assert waiter.event.is_set() and waiter.wait(0) is False


def test_one_notification_reaches_every_waiter_of_that_message_and_no_other():
    listener = Listener(URL, "standmeet_receipts_index")
    first, second, other = listener.add([m]), listener.add([m]), listener.add([x])
    assert first is not None and second is not None and other is not None
    listener.dispatch(m, "done")
    assert first.wait(0) and second.wait(0)
    assert not other.event.is_set()
    listener.dispatch(unknown, "done")  # nobody waits for it: nothing happens
    assert not other.event.is_set()


def test_a_full_channel_refuses_the_next_waiter_and_has_room_again_once_one_leaves():
    listener = Listener(URL, "standmeet_receipts_index", max_waiters=2)
    first, second = listener.add([a]), listener.add([b])
    assert first is not None and second is not None
    assert listener.add([c]) is None
    listener.remove(first)
    assert listener.waiting == 1
    assert listener.add([c]) is not None


def test_a_waiter_removed_before_its_receipt_is_not_answered_and_leaves_nothing_behind():
    listener = Listener(URL, "standmeet_receipts_index")
    waiter = listener.add([a])
    assert waiter is not None
    listener.remove(waiter)
    listener.dispatch(a, "done")
    assert not waiter.event.is_set()
    assert listener.waiting == 0


def test_a_waiter_for_no_message_is_answered_at_once():
    listener = Listener(URL, "standmeet_receipts_index")
    waiter = listener.add([])
    assert waiter is not None and waiter.wait(0) is True


def test_an_id_that_is_no_message_id_is_refused_and_an_upper_case_one_is_heard():
    listener = Listener(URL, "standmeet_receipts_index")
    with pytest.raises(InvalidMessage, match="'order-17' is not one"):
        listener.add([a, "order-17"])
    assert listener.waiting == 0
    waiter = listener.add([a.upper()])
    assert waiter is not None
    listener.dispatch(a, "done")
    assert waiter.wait(0) is True
