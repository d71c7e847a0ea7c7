"""The process's one LISTEN connection (claims through a transaction pooler) misses no
send: a consumer it wakes looks again only once the LISTEN is in place."""

from __future__ import annotations

import psycopg

from broker.engine.wakeups import WakeListener
from broker.pg.pool import Outage

FIRST = "dramatiq.wake_listener_first.enqueue"
ADDED = "dramatiq.wake_listener_added.enqueue"


def _notify(url: str, channel: str) -> None:
    """A sender's commit: its NOTIFY reaches the sessions listening at that moment."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT pg_notify(%s, '')", (channel,))


def test_a_send_committed_as_the_listener_connects_wakes_its_consumer(database_url):
    # Given a consumer whose look, when the listener wakes it on connecting, finds nothing,
    # and a send that commits right after that look
    listener = WakeListener(database_url, outage=Outage("test"))
    woken: list[str] = []

    def wake() -> None:
        woken.append("woken")
        if len(woken) == 1:
            _notify(database_url, FIRST)

    listener.add(FIRST, wake)
    try:
        # When the listener connects and waits
        heard = listener.listen_once(timeout_s=5.0)
    finally:
        listener.stop()
    # Then it heard that send, and woke the consumer again for it
    assert (heard, woken) == (1, ["woken", "woken"])


def test_a_queue_added_while_the_listener_waits_is_woken_once_it_listens_there(database_url):
    # Given a listener already listening, and a consumer added after its LISTENs
    listener = WakeListener(database_url, outage=Outage("test"))
    listener.add(FIRST, lambda: None)
    woken: list[str] = []
    try:
        listener.listen_once(timeout_s=0.01)
        listener.add(ADDED, lambda: woken.append("woken"))
        # and a send to it before the listener listens there
        _notify(database_url, ADDED)
        # When the listener's next pass runs
        listener.listen_once(timeout_s=0.01)
    finally:
        listener.stop()
    # Then the added consumer is woken, to look for what was sent before
    assert woken == ["woken"]
