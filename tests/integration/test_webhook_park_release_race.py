"""A delivery parked behind its endpoint's lease at the very moment the lease is given back
is woken, never left to wait out the lease: the release locks the endpoint's row first
(``LOCK_ENDPOINT``), which the parking reads locked, so the release waits for the
parking's commit and then reads what it parked. Played step by step against the real
server: the parking's statements held open in one transaction, the real release of the
lease started beside it, seen waiting, and the parking committed."""

from __future__ import annotations

import threading
from typing import Any

import psycopg

from actors import settings as app_settings
from actors import webhooks
from middleware.keyed_lease import Held, PostgresLeases
from tests.support.db import scalar, wait_for

#: The release seen waiting for a lock (the endpoint's row, which the parking holds).
RELEASE_WAITING = """
SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'
"""


def fan_out(database_url: str, event_type: str) -> tuple[int, str]:
    """One event fanned out to the test's endpoint: its delivery's (id, message id)."""
    with psycopg.connect(database_url) as conn, conn.transaction():
        event = webhooks.emit_event(conn, event_type, {})
    webhooks.fanout.fn(event)
    row = scalar(database_url, "SELECT array[id::text, message_id::text] FROM standmeet.webhook_deliveries"
                               " WHERE event_id = %s", (event,))
    return int(row[0]), row[1]


def is_due(database_url: str, message_id: str) -> bool:
    return bool(scalar(database_url, "SELECT eta <= now() FROM dramatiq.queue WHERE message_id = %s"
                                     " AND state = 'queued'", (message_id,)))


def test_a_delivery_parked_as_the_lease_is_given_back_is_woken(broker, database_url, webhook_settings):
    # Given an endpoint whose lease a running job holds for its delivery
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/hook", ["raced"])
    holder, holder_message = fan_out(database_url, "raced")
    leases = PostgresLeases()
    taken: Any = leases.take(webhooks.ENDPOINT_LEASE, holder)
    assert taken is not None and taken[0] is not None, taken
    scalar(database_url, "UPDATE dramatiq.queue SET state = 'consumed' WHERE message_id = %s RETURNING 1",
           (holder_message,))
    # and a new delivery to it, still due (fanned out while its endpoint's row was locked,
    # so that its own parking gave up)
    with psycopg.connect(database_url) as lock, lock.transaction():
        lock.execute(webhooks.LOCK_ENDPOINT, {"key": endpoint})
        waiting, waiting_message = fan_out(database_url, "raced")
    assert is_due(database_url, waiting_message)

    released = threading.Event()
    failures: list[BaseException] = []

    def give_back() -> None:
        try:
            leases.release(Held(webhooks.ENDPOINT_LEASE, endpoint, str(taken[0])), holder_message)
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            failures.append(exc)
        finally:
            released.set()

    # When the parking's statements have run, uncommitted, and the lease is given back then
    with psycopg.connect(database_url) as park:
        with park.transaction():
            locked = [m for (m,) in park.execute(webhooks.PARK_LOCK_MESSAGES, {"ids": [waiting]}).fetchall()]
            assert [str(m) for m in locked] == [waiting_message]
            parked = park.execute(webhooks.PARK_BEHIND, {
                "ids": [waiting], "locked": locked,
                "lease_s": app_settings.current().webhook_lease_s}).fetchall()
            assert len(parked) == 1, "the new delivery is parked behind the held lease"
            park.execute(webhooks.PARK, {"messages": [m for m, _ in parked], "until": [u for _, u in parked]})
            giver = threading.Thread(target=give_back, name="lease-giver")
            giver.start()
            wait_for(lambda: scalar(database_url, RELEASE_WAITING) == 1, timeout_s=15,
                     what="the release to wait for the parking's lock on the endpoint's row")
            assert not released.is_set()
        # (the parking commits here)
    giver.join(timeout=30)

    # Then the release went on after the parking and woke the parked delivery: due now
    assert released.is_set() and failures == []
    assert scalar(database_url, "SELECT busy_until FROM standmeet.webhook_endpoints WHERE id = %s",
                  (endpoint,)) is None
    assert is_due(database_url, waiting_message), "the parked delivery was left to wait out the lease"
