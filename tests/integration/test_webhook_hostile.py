"""Webhooks against hostile input and endpoints: a payload jsonb would refuse is refused
before any SQL, a malformed answer is a protocol error, a blocked delivery says so, and a
busy endpoint's waiting deliveries do not poll for its lease."""

from __future__ import annotations

import logging
import math

import psycopg
import pytest

from actors import settings as app_settings
from actors import webhooks
from broker.outbox import InvalidPayload
from broker.settings import replace
from tests.support.db import query, scalar, wait_for
from tests.support.http import http_server
from tests.support.rawhttp import raw_server

LOOPBACK = ("127.0.0.0/8",)
SECRET = "whsec_" + "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="


@pytest.mark.parametrize("payload, named", [
    ({"amount": math.nan}, "nan at $.amount"),
    ({"amount": math.inf}, "inf at $.amount"),
    ({"note": "a\u0000b"}, "NUL"),
    ({"note": "\ud800"}, "lone surrogate"),
])
def test_a_payload_jsonb_would_refuse_is_refused_in_one_line_before_any_sql_and_the_transaction_commits(
        broker, database_url, payload, named):
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(InvalidPayload) as refused:
            webhooks.emit_event(conn, "order.paid", payload)
        kept = webhooks.emit_event(conn, "order.paid", {"order": 42})  # the transaction is still usable
    assert named.lower() in str(refused.value).lower() and "'order.paid'" in str(refused.value)
    assert "\n" not in str(refused.value)
    assert query(database_url, "SELECT payload FROM standmeet.webhook_events WHERE id = %s", (kept,)) == [({"order": 42},)]
    assert scalar(database_url, "SELECT count(*) FROM standmeet.webhook_events WHERE payload ?| array['amount', 'note']") == 0


#: Answers that are not well-formed HTTP/1.1, each a protocol error, never a connection failure.
MALFORMED = {
    "status line": b"HTTP/1.1 2x0 OK\r\nContent-Length: 0\r\n\r\n",
    "chunk size": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
    "header overflow": b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"a" * 70_000 + b"\r\n\r\n",
    "header line": b"HTTP/1.1 200 OK\r\nno colon here\r\nContent-Length: 0\r\n\r\n",
    "two lengths": b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok",
}


@pytest.mark.parametrize("answer", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_answer_is_a_protocol_outcome_not_a_connect_one(answer):
    with app_settings.overridden(allowed_networks=LOOPBACK), raw_server(lambda n: (answer, True)) as (port, _):
        outcome = webhooks.post(f"http://127.0.0.1:{port}/hook", [SECRET], "msg_1", b"{}", timeout_s=5)
    assert outcome.outcome == "protocol", outcome
    assert outcome.error and "RemoteProtocolError" in outcome.error


ATTEMPTS_OF_ENDPOINT = ("SELECT a.outcome, a.response_body FROM standmeet.webhook_attempts a"
                        " JOIN standmeet.webhook_deliveries d ON d.id = a.delivery_id WHERE d.endpoint_id = %s")


def _attempts_of_one_delivery(database_url: str, start_worker, answer: bytes,
                              event_type: str) -> tuple[object, list[tuple[str, str | None]]]:
    """Deliver one event of ``event_type`` to an endpoint that answers ``answer`` (raw
    bytes) to every request; the endpoint and its recorded attempts (outcome, body)."""
    with raw_server(lambda n: (answer, True)) as (port, _):
        endpoint, _ = webhooks.add_endpoint(f"http://127.0.0.1:{port}/hook", [event_type])
        with psycopg.connect(database_url) as conn, conn.transaction():
            webhooks.emit_event(conn, event_type, {})
        start_worker(queues=["webhook"], threads=2)
        attempts = wait_for(lambda: query(database_url, ATTEMPTS_OF_ENDPOINT, (endpoint,)),
                            timeout_s=15, what="the attempt to be recorded")
    return endpoint, attempts


def test_a_delivery_answered_with_a_malformed_status_line_is_recorded_as_protocol(
        broker, database_url, start_worker, webhook_settings):
    endpoint, attempts = _attempts_of_one_delivery(database_url, start_worker, MALFORMED["status line"], "hostile")
    assert attempts[0][0] == "protocol"
    assert scalar(database_url, "SELECT state FROM standmeet.webhook_deliveries WHERE endpoint_id = %s",
                  (endpoint,)) == "pending"  # retried later, like any failure the endpoint may mend


def test_a_delivery_the_guard_blocks_is_logged_as_blocked_and_its_job_ends_rejected_not_done(
        broker, database_url, start_worker, webhook_settings, caplog):
    with http_server() as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["guarded"])  # allowed when registered
        app_settings.use(replace(app_settings.current(), allowed_networks=()))  # then no longer
        with psycopg.connect(database_url) as conn, conn.transaction():
            webhooks.emit_event(conn, "guarded", {})
        with caplog.at_level(logging.INFO, logger="standmeet"):
            start_worker(queues=["webhook"], threads=2)
            message = wait_for(lambda: scalar(
                database_url, "SELECT q.message_id::text FROM dramatiq.queue q JOIN standmeet.webhook_deliveries d"
                              " ON d.message_id = q.message_id WHERE d.endpoint_id = %s AND q.state = 'rejected'",
                (endpoint,)), timeout_s=15, what="the delivery's job to end")
            wait_for(lambda: any(message in r.getMessage() for r in caplog.records if r.name == "standmeet.jobs"),
                     timeout_s=5, what="its job log line")
    assert server.received == []
    assert query(database_url, "SELECT state, last_outcome FROM standmeet.webhook_deliveries WHERE endpoint_id = %s",
                 (endpoint,)) == [("failed", "blocked")]
    lines = [r.getMessage() for r in caplog.records if message in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["job rejected"], lines
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "blocked" in r.getMessage()]
    assert len(warned) == 1 and "request-forgery guard" in warned[0] and "127.0.0.1" in warned[0], warned
    error = scalar(database_url, "SELECT error FROM dramatiq.queue WHERE message_id = %s", (message,))
    assert error.startswith("DeliveryFailed: ") and "blocked" in error and "\n" not in error


def test_a_slow_endpoints_waiting_deliveries_wait_for_its_lease_without_polling(
        broker, database_url, start_worker, webhook_settings):
    """60 deliveries to an endpoint that takes 0.1 s an answer: each job holding the lease
    makes about ten (the room left for another POST ends its batch), so the lease changes
    hands about six times; a waiter is claimed again only when it is woken or its lease's
    expiry passes, never every busy snooze (50 ms here)."""
    deliveries = 60
    app_settings.use(replace(app_settings.current(), webhook_http_timeout_s=13.0))
    with http_server(delay_s=0.1) as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["slow"])
        with psycopg.connect(database_url) as conn, conn.transaction():
            events = [webhooks.emit_event(conn, "slow", {"n": n}) for n in range(deliveries)]
        for event in events:  # every delivery and its job written before a worker runs
            webhooks.fanout.fn(event)
        start_worker(queues=["webhook"], threads=8)
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.webhook_deliveries"
                                              " WHERE endpoint_id = %s AND state = 'succeeded'", (endpoint,))
                 == deliveries, timeout_s=60, what="every delivery to succeed")
        assert len(server.received) == deliveries and server.max_in_flight == 1
    claims, snoozes, holders = query(
        database_url, "SELECT sum(q.claims)::int, sum(coalesce((q.message->'options'->>'snoozes')::int, 0))::int,"
                      " count(DISTINCT q.message_id) FILTER (WHERE q.claims > 0)::int"
                      " FROM standmeet.webhook_deliveries d JOIN dramatiq.queue q ON q.message_id = d.message_id"
                      " WHERE d.endpoint_id = %s", (endpoint,))[0]
    # each message claimed about once (most are prefetched at the start, find the endpoint
    # busy and snooze until a batch makes their delivery), plus one per hand-over of the
    # lease; polling every 50 ms would claim them hundreds of times over the ~6 s
    assert claims <= deliveries + 20, (claims, snoozes, holders)
    assert snoozes <= deliveries + 20, (claims, snoozes, holders)


def test_an_answer_whose_body_holds_a_nul_byte_is_recorded_with_the_byte_replaced(
        broker, database_url, start_worker, webhook_settings):
    # Given an endpoint that answers 200 with a NUL byte in its body (Postgres text cannot hold one)
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\no\x00k\x00!"
    # When its delivery is made
    endpoint, recorded = _attempts_of_one_delivery(database_url, start_worker, answer, "nul")
    # Then the attempt is recorded (once), its body kept with each NUL replaced
    assert recorded == [("ok", "o\ufffdk\ufffd!")]
    assert scalar(database_url, "SELECT state FROM standmeet.webhook_deliveries WHERE endpoint_id = %s",
                  (endpoint,)) == "succeeded"
