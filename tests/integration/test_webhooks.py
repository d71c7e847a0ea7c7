"""Webhooks: signed deliveries, recorded outcomes, the lease, and no connection held during a POST."""

from __future__ import annotations

import json
import time

import psycopg
import pytest
from standardwebhooks import Webhook, WebhookVerificationError

from actors import settings as app_settings
from actors import webhooks
from broker.pg.pool import SET_STATEMENT_TIMEOUT
from tests.support.db import query, scalar, wait_for
from tests.support.http import http_server
from tests.support.webserver import Reply, web_server


def emit(database_url: str, event_type: str, payload: dict) -> int:
    with psycopg.connect(database_url) as conn, conn.transaction():
        return webhooks.emit_event(conn, event_type, payload)


def delivery(database_url: str, event_id: int, endpoint_id: int) -> tuple:
    rows = query(database_url, "SELECT id, state, attempts, last_outcome FROM standmeet.webhook_deliveries"
                               " WHERE event_id = %s AND endpoint_id = %s", (event_id, endpoint_id))
    return rows[0] if rows else (None, None, None, None)


def settled(database_url: str, event_id: int, endpoint_id: int, state: str) -> tuple:
    return wait_for(lambda: (d := delivery(database_url, event_id, endpoint_id))[1] == state and d,
                    timeout_s=15, what=f"delivery of event {event_id} to endpoint {endpoint_id} to be {state}")


def test_deliveries_verify_with_the_standard_library_before_during_and_after_rotation(
    broker, database_url, start_worker, webhook_settings
):
    with http_server() as (url, server):
        endpoint, first_secret = webhooks.add_endpoint(url, ["order.paid"])
        start_worker(queues=["webhook"], threads=8)
        e1 = emit(database_url, "order.paid", {"order": 1})
        settled(database_url, e1, endpoint, "succeeded")
        second_secret = webhooks.rotate_secret(endpoint)  # both sign during the rotation
        e2 = emit(database_url, "order.paid", {"order": 2})
        settled(database_url, e2, endpoint, "succeeded")
        webhooks.rotate_secret(endpoint, second_secret, keep_old=False)  # the old one is retired
        e3 = emit(database_url, "order.paid", {"order": 3})
        settled(database_url, e3, endpoint, "succeeded")
        bodies, headers = server.received, server.headers
    assert [json.loads(b)["data"] for b in bodies] == [{"order": 1}, {"order": 2}, {"order": 3}]
    assert Webhook(first_secret).verify(bodies[0], headers[0])["data"] == {"order": 1}
    assert Webhook(first_secret).verify(bodies[1], headers[1])["data"] == {"order": 2}
    assert Webhook(second_secret).verify(bodies[1], headers[1])["data"] == {"order": 2}
    assert Webhook(second_secret).verify(bodies[2], headers[2])["data"] == {"order": 3}
    with pytest.raises(WebhookVerificationError):
        Webhook(first_secret).verify(bodies[2], headers[2])
    assert headers[0]["webhook-id"] == f"msg_{e1}_{endpoint}"


def test_each_failure_gives_its_recorded_outcome_and_the_other_endpoints_keep_receiving(
    broker, database_url, start_worker, webhook_settings
):
    with web_server() as site, http_server() as (good_url, good):
        site.on("POST", "/error", lambda r: Reply(500, b"boom"))
        site.on("POST", "/moved", lambda r: Reply(302, b"", {"Location": "https://elsewhere.test/"}))
        site.on("POST", "/gone", lambda r: Reply(410, b"gone"))
        error, _ = webhooks.add_endpoint(site.base + "/error", ["t"])
        moved, _ = webhooks.add_endpoint(site.base + "/moved", ["t"])
        gone, _ = webhooks.add_endpoint(site.base + "/gone", ["t"])
        private, _ = webhooks.add_endpoint(site.base + "/never", ["t"])
        unresolved, _ = webhooks.add_endpoint(site.base + "/renamed", ["t"])
        ok, _ = webhooks.add_endpoint(good_url, ["t"])
        # an endpoint whose URL now points at a private address: refused at attempt time too
        query(database_url, "UPDATE standmeet.webhook_endpoints SET url = 'http://10.0.0.1/hook' WHERE id = %s", (private,))
        # and one whose host name no longer resolves (DNS may answer later: not blocked)
        query(database_url, "UPDATE standmeet.webhook_endpoints SET url = 'http://no-such-host.invalid/hook'"
                            " WHERE id = %s", (unresolved,))
        start_worker(queues=["webhook"], threads=8)
        event = emit(database_url, "t", {"n": 1})
        settled(database_url, event, ok, "succeeded")
        settled(database_url, event, gone, "failed")
        settled(database_url, event, private, "failed")
        wait_for(lambda: all(delivery(database_url, event, e)[2] == 1 for e in (error, moved, unresolved)),
                 timeout_s=15, what="first attempts of the failing endpoints")
    outcomes = dict(query(database_url,
                          "SELECT d.endpoint_id, a.outcome || ':' || coalesce(a.status_code::text, '-')"
                          " FROM standmeet.webhook_attempts a JOIN standmeet.webhook_deliveries d ON d.id = a.delivery_id"
                          " WHERE d.event_id = %s", (event,)))
    assert outcomes == {error: "http:500", moved: "redirect:302", gone: "gone:410", private: "blocked:-",
                        unresolved: "dns:-", ok: "ok:200"}
    # a 500, or a name that did not resolve, is retried later (5 s ± jitter), not lost
    for retried in (error, unresolved):
        state, next_at = query(database_url, "SELECT state, next_attempt_at IS NOT NULL FROM standmeet.webhook_deliveries"
                                             " WHERE event_id = %s AND endpoint_id = %s", (event, retried))[0]
        assert (state, next_at) == ("pending", True)
    # 410 disabled its endpoint, with the reason; the failing one is marked as failing
    assert query(database_url, "SELECT enabled, disabled_reason FROM standmeet.webhook_endpoints WHERE id = %s",
                 (gone,)) == [(False, "the endpoint answered 410 Gone")]
    assert scalar(database_url, "SELECT failing_since IS NOT NULL FROM standmeet.webhook_endpoints WHERE id = %s", (error,))
    assert scalar(database_url, "SELECT failing_since IS NULL FROM standmeet.webhook_endpoints WHERE id = %s", (ok,))
    assert len(good.received) == 1


def test_a_delivery_whose_secret_no_key_opens_records_the_attempt_with_the_reason(
    broker, database_url, start_worker, webhook_settings
):
    # Given an endpoint whose stored secret was sealed with a key this process no longer has
    from actors import secretbox

    with http_server() as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["t"])
        query(database_url, "UPDATE standmeet.webhook_endpoints SET secrets = ARRAY[%s] WHERE id = %s",
              (secretbox.PREFIX + "sealed-with-a-key-long-gone", endpoint))
        start_worker(queues=["webhook"], threads=2)
        # When a delivery to it is attempted
        event = emit(database_url, "t", {"n": 1})
        wait_for(lambda: delivery(database_url, event, endpoint)[2] == 1, timeout_s=15, what="the first attempt")
        received = list(server.received)
    # Then the attempt is recorded, saying why, and nothing unsigned was posted
    (outcome, error) = query(database_url, "SELECT a.outcome, a.error FROM standmeet.webhook_attempts a"
                                           " JOIN standmeet.webhook_deliveries d ON d.id = a.delivery_id"
                                           " WHERE d.event_id = %s AND d.endpoint_id = %s", (event, endpoint))[0]
    assert outcome == "error" and "cannot be decrypted" in error
    assert received == []


class _HourBehind:
    """The ``time`` module of a worker host whose clock is an hour behind the database's."""

    def __getattr__(self, name: str) -> object:
        return getattr(time, name)

    @staticmethod
    def time() -> float:
        return time.time() - 3600


def test_a_retry_is_scheduled_by_the_databases_clock_whatever_the_worker_hosts_clock_says(
    broker, database_url, start_worker, webhook_settings, monkeypatch
):
    # Given a worker host whose clock is an hour behind the database's, and an endpoint answering 500
    monkeypatch.setattr(webhooks, "time", _HourBehind())
    with web_server() as site:
        site.on("POST", "/error", lambda r: Reply(500, b"boom"))
        endpoint, _ = webhooks.add_endpoint(site.base + "/error", ["t"])
        start_worker(queues=["webhook"], threads=2)
        event = emit(database_url, "t", {"n": 1})
        # When its first attempt fails
        wait_for(lambda: delivery(database_url, event, endpoint)[2] == 1, timeout_s=15, what="the first attempt")
    # Then its next attempt is due its back-off (5 s, ± 10 %) after now by the database's clock
    due_in = scalar(database_url, "SELECT extract(epoch FROM next_attempt_at - now()) FROM standmeet.webhook_deliveries"
                                  " WHERE event_id = %s AND endpoint_id = %s", (event, endpoint))
    assert 0 < due_in <= 5.5


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_busy_endpoint_makes_deliveries_snooze_until_its_lease_expires_without_using_attempts(
    broker, database_url, start_worker, webhook_settings
):
    with http_server() as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["busy"])
        # Given a delivery whose job is due now (fanned out while the endpoint was free)
        event = emit(database_url, "busy", {})
        webhooks.fanout.fn(event)
        # and another worker that then took the endpoint's lease, for 1 s more (and dies: it
        # never gives it back, so no release wakes the delivery)
        expiry = scalar(database_url, "UPDATE standmeet.webhook_endpoints SET busy_until = now() + interval '1 second',"
                                      " lease_token = gen_random_uuid() WHERE id = %s RETURNING busy_until", (endpoint,))
        start_worker(queues=["webhook"], threads=8)
        delivery_id, *_ = settled(database_url, event, endpoint, "succeeded")
    # Then the delivery snoozed until the lease expired (once, not every 50 ms of
    # STANDMEET_WEBHOOK_BUSY_SNOOZE_S), and made a single attempt after it
    options = scalar(database_url, "SELECT message->'options' FROM dramatiq.queue WHERE message->>'actor_name' = 'webhook.deliver'"
                                   " AND (message->'args'->>0)::bigint = %s", (delivery_id,))
    assert 1 <= options.get("snoozes", 0) <= 2, options
    assert options.get("retries", 0) == 0
    assert delivery(database_url, event, endpoint)[2] == 1
    assert query(database_url, "SELECT started_at >= %s FROM standmeet.webhook_attempts WHERE delivery_id = %s",
                 (expiry, delivery_id)) == [(True,)]
    assert len(server.received) == 1


def test_a_delivery_fanned_out_while_its_endpoint_is_busy_waits_for_the_lease_unclaimed(
    broker, database_url, start_worker, webhook_settings
):
    with http_server() as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["held"])
        # Given another worker holds the endpoint's lease for 1 s more (and dies: it never
        # gives it back, so no release wakes the delivery)
        expiry = scalar(database_url, "UPDATE standmeet.webhook_endpoints SET busy_until = now() + interval '1 second',"
                                      " lease_token = gen_random_uuid() WHERE id = %s RETURNING busy_until", (endpoint,))
        # When an event for it is fanned out
        event = emit(database_url, "held", {})
        webhooks.fanout.fn(event)
        delivery_id, _, _, _ = delivery(database_url, event, endpoint)
        eta = scalar(database_url, "SELECT q.eta FROM dramatiq.queue q JOIN standmeet.webhook_deliveries d"
                                   " ON d.message_id = q.message_id WHERE d.id = %s", (delivery_id,))
        start_worker(queues=["webhook"], threads=8)
        settled(database_url, event, endpoint, "succeeded")
    # Then its job was written due when the lease expires, and ran once, after it: never
    # claimed only to find the endpoint busy (no snooze), one attempt
    assert abs((eta - expiry).total_seconds()) < 0.5, (eta, expiry)
    options = scalar(database_url, "SELECT message->'options' FROM dramatiq.queue WHERE message->>'actor_name' = 'webhook.deliver'"
                                   " AND (message->'args'->>0)::bigint = %s", (delivery_id,))
    assert options.get("snoozes", 0) == 0 and options.get("retries", 0) == 0, options
    assert scalar(database_url, "SELECT claims FROM dramatiq.queue q JOIN standmeet.webhook_deliveries d"
                                " ON d.message_id = q.message_id WHERE d.id = %s", (delivery_id,)) == 1
    assert query(database_url, "SELECT started_at >= %s FROM standmeet.webhook_attempts WHERE delivery_id = %s",
                 (expiry, delivery_id)) == [(True,)]
    assert len(server.received) == 1


@pytest.mark.slow  # waits out a real timer of a second or more
def test_an_endpoint_that_never_answers_times_out_at_10_s_and_no_transaction_is_held_meanwhile(
    broker, database_url, start_worker, webhook_settings
):
    with http_server(hold=True) as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["slow"])
        start_worker(queues=["webhook"], threads=8)
        event = emit(database_url, "slow", {})
        wait_for(lambda: server.current() == 1, timeout_s=10, what="the POST to be pending")
        pending_since = scalar(database_url, "SELECT clock_timestamp()")
        # (the fan-out that made the delivery ends just after it: its parking's short transaction)
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE state <> 'done'"
                                              " AND message->>'actor_name' = 'webhook.fanout'") == 0,
                 timeout_s=10, what="the fan-out to end")
        # while the POST is pending, none of our connections holds a transaction across it:
        # none is in one that began before the POST was seen pending (a statement of the
        # consumer's, the settler's or the cancellation watch's may be running at this
        # instant: it began after, and is no transaction held across the request)
        held = query(database_url, "SELECT application_name, state, xact_start, left(query, 100)"
                                   " FROM pg_stat_activity WHERE datname = current_database()"
                                   " AND application_name LIKE 'standmeet%%' AND xact_start <= %s"
                                   " AND pid <> pg_backend_pid()", (pending_since,))
        assert held == []
        delivery_id, _, attempts, _ = wait_for(lambda: (d := delivery(database_url, event, endpoint))[2] == 1 and d,
                                               timeout_s=20, what="the attempt to be recorded")
    outcome, ms = query(database_url, "SELECT outcome, duration_ms FROM standmeet.webhook_attempts a"
                                      " JOIN standmeet.webhook_deliveries d ON d.id = a.delivery_id WHERE d.event_id = %s",
                        (event,))[0]
    assert outcome == "timeout"
    # the POST's 10 s deadline ended it, not the job's 15 s limit (whatever the machine's load)
    http_timeout_ms = app_settings.current().webhook_http_timeout_s * 1000
    assert http_timeout_ms - 500 <= ms < broker.queue_settings("webhook").time_limit_s * 1000, ms
    # the job was not killed by its 15 s limit: it recorded its attempt and asked for a retry
    options = scalar(database_url, "SELECT message->'options' FROM dramatiq.queue WHERE message->>'actor_name' = 'webhook.deliver'"
                                   " AND (message->'args'->>0)::bigint = %s", (delivery_id,))
    assert options is not None
    assert "TimeLimitExceeded" not in (options.get("traceback") or "")
    assert "Retry" in (options.get("traceback") or "") or delivery(database_url, event, endpoint)[1] == "pending"


def test_a_delivery_makes_two_round_trips_of_its_own_beside_the_ones_that_set_its_deadline(
    broker, database_url, start_worker, webhook_settings, monkeypatch
):
    """One statement takes the endpoint's lease and reads what the POST needs; one
    pipelined transaction (its row locked, then one statement) records the attempt and
    gives the lease back. (A borrowed connection may also get its
    statement_timeout, unless its session already holds one close enough: at most two
    more.) Counted on the worker threads that run the delivery, against the real database."""
    import threading

    from dramatiq.worker import WorkerThread

    counted: list[str] = []
    real_execute, real_transaction = psycopg.Connection.execute, psycopg.Connection.transaction

    def execute(self, query, *args, **kwargs):  # a spy: the statement still runs
        if isinstance(threading.current_thread(), WorkerThread) and getattr(current, "deliver", False):
            counted.append("set_config" if query == SET_STATEMENT_TIMEOUT else str(query).split()[0])
        return real_execute(self, query, *args, **kwargs)

    def transaction(self, *args, **kwargs):  # BEGIN and COMMIT: two round trips
        if isinstance(threading.current_thread(), WorkerThread) and getattr(current, "deliver", False):
            counted.extend(["BEGIN", "COMMIT"])
        return real_transaction(self, *args, **kwargs)

    current = threading.local()  # per worker thread: is it running a delivery?
    real_emit_before = broker.emit_before

    def emit_before(signal, *args, **kwargs):
        if signal == "process_message":
            current.deliver = args[0].actor_name == "webhook.deliver"
        return real_emit_before(signal, *args, **kwargs)

    with http_server() as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["trips"])
        event = emit(database_url, "trips", {})
        monkeypatch.setattr(psycopg.Connection, "execute", execute)
        monkeypatch.setattr(psycopg.Connection, "transaction", transaction)
        monkeypatch.setattr(broker, "emit_before", emit_before)
        start_worker(queues=["webhook"], threads=2)
        settled(database_url, event, endpoint, "succeeded")
        wait_for(lambda: scalar(database_url, "SELECT busy_until IS NULL FROM standmeet.webhook_endpoints WHERE id = %s",
                                (endpoint,)), timeout_s=5, what="the lease given back")
    assert len(server.received) == 1
    # take-and-read; then record-and-release, pipelined in one transaction after the lock on
    # the endpoint's row that keeps a parked job from missing its wake (one round trip)
    assert [c for c in counted if c != "set_config"] == ["WITH", "BEGIN", "COMMIT", "SELECT", "WITH"], counted
    assert counted.count("set_config") <= 2, counted


def test_replaying_every_failed_delivery_goes_batch_by_batch_and_gives_each_a_new_message(
    broker, database_url, webhook_settings
):
    # Given five deliveries that failed, and one that succeeded, since a moment (the other
    # tests' failures are older)
    since = scalar(database_url, "SELECT clock_timestamp()")
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/replayed", ["t"])
    ids = [scalar(database_url, "INSERT INTO standmeet.webhook_deliveries (event_id, endpoint_id, state)"
                                " VALUES (%s, %s, %s) RETURNING id", (emit(database_url, "t", {"n": n}), endpoint, state))
           for n, state in enumerate(["failed"] * 5 + ["succeeded"])]
    # When they are replayed two at a time
    replayed = webhooks.replay_failed(since, batch=2)
    # Then the five failed ones are pending again, each with a new message of its own
    assert replayed == 5
    rows = query(database_url, "SELECT d.id, d.state, q.state::text FROM standmeet.webhook_deliveries d"
                               " LEFT JOIN dramatiq.queue q ON q.message_id = d.message_id WHERE d.id = ANY(%s)"
                               " ORDER BY d.id", (ids,))
    assert [r[1:] for r in rows] == [("pending", "queued")] * 5 + [("succeeded", None)]
    query(database_url, "DELETE FROM dramatiq.queue q USING standmeet.webhook_deliveries d"
                        " WHERE q.message_id = d.message_id AND d.id = ANY(%s)", (ids,))


def test_a_webhook_event_may_carry_a_trace_key_of_its_own(broker, database_url, webhook_settings):
    # (the outbox keeps "_trace" in its own events' payloads; a webhook event's payload is
    # stored beside them, and only its id goes through the outbox)
    event = emit(database_url, "t", {"_trace": "the customer's own", "n": 1})
    assert scalar(database_url, "SELECT payload->>'_trace' FROM standmeet.webhook_events WHERE id = %s",
                  (event,)) == "the customer's own"
