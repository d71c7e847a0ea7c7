"""A delivery job holding its endpoint's lease also makes the endpoint's waiting deliveries."""

from __future__ import annotations

import json
import logging
import threading

import psycopg
from dramatiq.middleware import CurrentMessage
from dramatiq.worker import WorkerThread
from standardwebhooks import Webhook

from actors import webhooks
from broker.pg.pool import SET_STATEMENT_TIMEOUT
from tests.support.db import query, wait_for
from tests.support.http import http_server
from tests.support.webserver import Reply, web_server


def fanned_out(database_url: str, event_type: str, count: int) -> list[int]:
    """``count`` events, each fanned out (its deliveries and their jobs written) before any
    worker runs, so the first delivery job finds the others waiting."""
    with psycopg.connect(database_url) as conn, conn.transaction():
        events = [webhooks.emit_event(conn, event_type, {"n": n}) for n in range(count)]
    for event in events:
        webhooks.fanout.fn(event)
    return events


#: Webhook jobs still to run now: queued and due within a second, or running.
RAN_OR_READY = ("SELECT count(*) FROM dramatiq.queue WHERE queue_name = 'webhook'"
                " AND (state = 'consumed' OR (state = 'queued' AND eta <= now() + interval '1 second'))")


def states(database_url: str, endpoint: int) -> list[tuple]:
    return query(database_url, "SELECT event_id, state, attempts FROM standmeet.webhook_deliveries"
                               " WHERE endpoint_id = %s ORDER BY id", (endpoint,))


def test_one_job_makes_the_endpoints_waiting_deliveries_oldest_first_each_signed_and_recorded_once(
    broker, database_url, start_worker, webhook_settings, monkeypatch
):
    made_by: list[str] = []  # the message of the job that made each POST (a spy: the POST still runs)
    real_post = webhooks.post

    def post(*args, **kwargs):
        message = CurrentMessage.get_current_message()
        made_by.append(message.message_id if message is not None else "")
        return real_post(*args, **kwargs)

    monkeypatch.setattr(webhooks, "post", post)
    with http_server() as (url, server):
        endpoint, secret = webhooks.add_endpoint(url, ["batched"])
        events = fanned_out(database_url, "batched", 6)
        start_worker(queues=["webhook"], threads=1)  # one thread: the first job runs alone
        wait_for(lambda: all(s == "succeeded" for _, s, _ in states(database_url, endpoint))
                 and len(states(database_url, endpoint)) == 6, timeout_s=15, what="every delivery to succeed")
        bodies, headers = list(server.received), list(server.headers)
    # every delivery was made once, by one job: its own first, then the others in the
    # order of their events (which claimed message the worker thread takes first is the
    # work queue's choice among messages of the same priority)
    assert [a for _, _, a in states(database_url, endpoint)] == [1] * 6
    assert len(set(made_by)) == 1 and len(made_by) == 6, made_by
    [(own_event,)] = query(database_url, "SELECT event_id FROM standmeet.webhook_deliveries WHERE message_id = %s",
                           (made_by[0],))
    order = [own_event] + [e for e in events if e != own_event]
    assert [json.loads(b)["data"] for b in bodies] == [{"n": events.index(e)} for e in order]
    # each signed for itself: its own webhook-id, verifying with the endpoint's secret
    assert [h["webhook-id"] for h in headers] == [f"msg_{e}_{endpoint}" for e in order]
    for body, sent in zip(bodies, headers, strict=True):
        Webhook(secret).verify(body, sent)
    assert query(database_url, "SELECT count(*) FROM standmeet.webhook_attempts a"
                               " JOIN standmeet.webhook_deliveries d ON d.id = a.delivery_id"
                               " WHERE d.endpoint_id = %s AND a.outcome = 'ok'", (endpoint,)) == [(6,)]
    assert query(database_url, "SELECT busy_until, lease_token FROM standmeet.webhook_endpoints WHERE id = %s",
                 (endpoint,)) == [(None, None)]


def test_a_failure_ends_the_batch_and_the_failed_delivery_keeps_its_retry_schedule(
    broker, database_url, start_worker, webhook_settings
):
    answered: list[int] = []
    seen: list[str] = []

    def first_ok_then_failing(request):
        answered.append(200 if not answered else 500)
        seen.append(request.headers["webhook-id"])
        return Reply(answered[-1], b"")

    with web_server() as site:
        site.on("POST", "/hook", first_ok_then_failing)
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["failing"])
        fanned_out(database_url, "failing", 3)
        start_worker(queues=["webhook"], threads=1)  # jobs run one at a time, oldest first
        # the first job made its own delivery (200) and one more (500), then stopped; the
        # third's own job made it (500); the second's own job found its retry not yet due
        wait_for(lambda: [a for _, _, a in states(database_url, endpoint)] == [1, 1, 1], timeout_s=15,
                 what="one attempt each")
        wait_for(lambda: query(database_url, RAN_OR_READY) == [(0,)], timeout_s=15,
                 what="every job to have run, its retry or snooze not yet due")
        rows = states(database_url, endpoint)
        due = query(database_url, "SELECT id, next_attempt_at - updated_at FROM standmeet.webhook_deliveries"
                                  " WHERE endpoint_id = %s AND state = 'pending' ORDER BY id", (endpoint,))
    # no delivery was tried again before its retry was due (5 s with jitter), whichever job
    # made its first attempt
    assert answered == [200, 500, 500], seen  # each delivery once, by its webhook-id
    assert sorted(s for _, s, _ in rows) == ["pending", "pending", "succeeded"]
    assert len(due) == 2 and all(wait.total_seconds() >= 4.4 for _, wait in due), due


def test_a_job_whose_delivery_a_batch_already_made_ends_on_the_lease_statement_alone(
    broker, database_url, start_worker, webhook_settings, monkeypatch
):

    # Given a delivery made already (by another job's batch) whose own job is still queued
    with http_server() as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["made.already"])
        [event] = fanned_out(database_url, "made.already", 1)
        query(database_url, "UPDATE standmeet.webhook_deliveries SET state = 'succeeded', attempts = 1"
                            " WHERE event_id = %s", (event,))
        # When its job runs (each statement on a worker thread counted; they still run)
        counted: list[str] = []
        real_execute, real_emit_before = psycopg.Connection.execute, broker.emit_before
        current = threading.local()  # per worker thread: is it running a delivery?

        def execute(self, statement, *args, **kwargs):
            if isinstance(threading.current_thread(), WorkerThread) and getattr(current, "deliver", False):
                counted.append("set_config" if statement == SET_STATEMENT_TIMEOUT else " ".join(str(statement).split()[:2]))
            return real_execute(self, statement, *args, **kwargs)

        def emit_before(signal, *args, **kwargs):
            if signal == "process_message":
                current.deliver = args[0].actor_name == "webhook.deliver"
            return real_emit_before(signal, *args, **kwargs)

        monkeypatch.setattr(psycopg.Connection, "execute", execute)
        monkeypatch.setattr(broker, "emit_before", emit_before)
        start_worker(queues=["webhook"], threads=2)
        wait_for(lambda: query(database_url, RAN_OR_READY)[0][0] == 0, timeout_s=10, what="the job to end")
        monkeypatch.undo()
    # Then nothing was posted, and the job read nothing after the statement that would have leased
    assert server.received == []
    # (and its statement_timeout, unless its session already held one close enough)
    assert [c for c in counted if c != "set_config"] == ["WITH target"], counted  # the lease statement
    assert counted.count("set_config") <= 1, counted
    assert states(database_url, endpoint) == [(event, "succeeded", 1)]


def test_the_messages_of_deliveries_a_batch_made_are_done_without_running_and_a_retried_one_keeps_its(
    broker, database_url, start_worker, webhook_settings
):
    answered: list[int] = []

    def ok_ok_then_failing(request):
        answered.append(200 if len(answered) < 2 else 500)
        return Reply(answered[-1], b"")

    with web_server() as site:
        site.on("POST", "/hook", ok_ok_then_failing)
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["finished"])
        # Given four deliveries whose jobs are queued, all but the first held back an hour
        # (so no consumer claims them before the first job's batch is recorded)
        fanned_out(database_url, "finished", 4)
        deliveries = query(database_url, "SELECT id, message_id::text FROM standmeet.webhook_deliveries"
                                         " WHERE endpoint_id = %s ORDER BY id", (endpoint,))
        assert all(m is not None for _, m in deliveries), deliveries  # each names its message
        query(database_url, "UPDATE dramatiq.queue SET eta = now() + interval '1 hour'"
                            " WHERE message_id = ANY(%s::uuid[])", ([m for _, m in deliveries[1:]],))
        # When the first job runs: 200 for its own, 200 for the second, 500 for the third
        # (which ends its batch); giving the lease back wakes the fourth's message (the
        # endpoint's next never-tried delivery), which runs at once and gets a 500 too
        start_worker(queues=["webhook"], threads=1)
        wait_for(lambda: len(answered) == 4 and query(database_url, RAN_OR_READY) == [(0,)], timeout_s=15,
                 what="the first job's batch to be recorded and the woken fourth job to end")
    messages = {m: (state, claims) for m, state, claims in query(
        database_url, "SELECT message_id::text, state::text, claims FROM dramatiq.queue"
                      " WHERE message_id = ANY(%s::uuid[])", ([m for _, m in deliveries],))}
    # Then the second delivery's message is done without ever being claimed; the third's
    # (its retry) is still queued, never claimed; the fourth's ran once and waits for its retry
    assert [messages[m] for _, m in deliveries] == [("done", 1), ("done", 0), ("queued", 0), ("queued", 1)]
    assert [(s, a) for _, s, a in states(database_url, endpoint)] == [
        ("succeeded", 1), ("succeeded", 1), ("pending", 1), ("pending", 1)]


def test_a_batch_deliverys_message_is_done_as_its_attempt_is_recorded_not_when_the_batch_ends(
    broker, database_url, start_worker, webhook_settings
):
    seen: list[tuple[str, ...]] = []

    with web_server() as site:
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["recorded"])
        # Given three deliveries, the second's and third's jobs held back (so the first job's
        # batch makes them, and no consumer claims their messages)
        fanned_out(database_url, "recorded", 3)
        messages = [m for (m,) in query(database_url, "SELECT message_id::text FROM standmeet.webhook_deliveries"
                                                      " WHERE endpoint_id = %s ORDER BY id", (endpoint,))]
        query(database_url, "UPDATE dramatiq.queue SET eta = now() + interval '1 hour'"
                            " WHERE message_id = ANY(%s::uuid[])", (messages[1:],))

        def ok(request):
            # (the POST waits for this answer: what the batch has recorded so far)
            seen.append(tuple(state for (state,) in query(
                database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
                              " ORDER BY array_position(%s::uuid[], message_id)", (messages, messages))))
            return Reply(200, b"")

        site.on("POST", "/hook", ok)
        # When the first job runs its batch
        start_worker(queues=["webhook"], threads=1)
        wait_for(lambda: len(seen) == 3 and query(database_url, RAN_OR_READY) == [(0,)], timeout_s=15,
                 what="the batch to be made and recorded")
    # Then while the third delivery was being posted, the second's message was done already
    # (its attempt recorded), the third's still queued: a consumer could not claim the second
    # only to find its delivery made
    assert seen[2] == ("consumed", "done", "queued"), seen
    assert query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                 (messages,)) == [("done",)] * 3
    assert [(s, a) for _, s, a in states(database_url, endpoint)] == [("succeeded", 1)] * 3


def test_a_delivery_an_operator_replays_after_a_batch_recorded_it_is_made_again(
    broker, database_url, start_worker, webhook_settings
):
    posted: list[str] = []
    replays: list[str | None] = []

    with web_server() as site:
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["replayed"])
        # Given three deliveries, the second's and third's jobs held back so the first job's batch makes them
        fanned_out(database_url, "replayed", 3)
        (_, _), (second, second_message), (_, third_message) = query(
            database_url, "SELECT id, message_id::text FROM standmeet.webhook_deliveries"
                          " WHERE endpoint_id = %s ORDER BY id", (endpoint,))
        query(database_url, "UPDATE dramatiq.queue SET eta = now() + interval '1 hour'"
                            " WHERE message_id = ANY(%s::uuid[])", ([second_message, third_message],))

        def ok(request):
            posted.append(request.headers["webhook-id"])
            if len(posted) == 3:
                # When an operator replays the second delivery (as the dashboard's button
                # does) while the batch posts the third: the second's attempt is recorded
                # and its message done by then
                with psycopg.connect(database_url, application_name="operator") as op, op.transaction():
                    replays.append(webhooks.replay_in(op, second))
            return Reply(200, b"")

        site.on("POST", "/hook", ok)
        start_worker(queues=["webhook"], threads=1)
        wait_for(lambda: len(posted) >= 3 and query(
            database_url, "SELECT busy_until FROM standmeet.webhook_endpoints WHERE id = %s", (endpoint,)) == [(None,)],
                 timeout_s=15, what="the batch to end")
        # Then the replay is honoured: the second delivery is made once more, by its new
        # message (one that found the endpoint busy is woken by the batch's end)
        wait_for(lambda: query(database_url, "SELECT state, attempts FROM standmeet.webhook_deliveries WHERE id = %s",
                               (second,)) == [("succeeded", 2)], timeout_s=15, what="the replayed delivery to be made")
        wait_for(lambda: query(database_url, RAN_OR_READY) == [(0,)], timeout_s=10, what="every job to end")
    assert len(replays) == 1 and replays[0] not in (None, second_message)
    assert query(database_url, "SELECT message_id::text FROM standmeet.webhook_deliveries WHERE id = %s",
                 (second,)) == [(replays[0],)]
    assert query(database_url, "SELECT message_id::text, state::text FROM dramatiq.queue WHERE message_id"
                               " = ANY(%s::uuid[]) ORDER BY message_id = %s", ([second_message, replays[0]],
                                                                              second_message)) \
        == [(replays[0], "done"), (second_message, "done")]
    assert len(posted) == 4 and posted.count(posted[1]) == 2, posted


def test_deliveries_fanned_out_behind_a_waiting_one_are_made_by_its_batch_never_claimed(
    broker, database_url, start_worker, webhook_settings
):
    with web_server() as site:
        site.on("POST", "/hook", lambda request: Reply(200, b""))
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["behind"])
        # Given three events fanned out before any worker runs: the first delivery's job due
        # now, the two behind it written due only a lease's length later
        fanned_out(database_url, "behind", 3)
        due_in = [s for (s,) in query(
            database_url, "SELECT extract(epoch FROM q.eta - d.updated_at)::float8 FROM standmeet.webhook_deliveries d"
                          " JOIN dramatiq.queue q ON q.message_id = d.message_id WHERE d.endpoint_id = %s ORDER BY d.id",
            (endpoint,))]
        # When a worker runs
        start_worker(queues=["webhook"], threads=4)
        wait_for(lambda: [s for _, s, _ in states(database_url, endpoint)] == ["succeeded"] * 3, timeout_s=10,
                 what="the three deliveries to be made")
        wait_for(lambda: query(database_url, RAN_OR_READY) == [(0,)], timeout_s=10, what="every job to end")
    lease_s = webhooks.app_settings.current().webhook_lease_s
    assert due_in[0] < 1 and all(lease_s - 1 < s <= lease_s + 1 for s in due_in[1:]), due_in
    # Then the first job's batch made all three; the two others' jobs were never claimed
    assert [c for (c,) in query(database_url, "SELECT q.claims FROM standmeet.webhook_deliveries d JOIN dramatiq.queue q"
                                              " ON q.message_id = d.message_id WHERE d.endpoint_id = %s ORDER BY d.id",
                                (endpoint,))] == [1, 0, 0]


def test_a_delivery_fanned_out_during_a_batch_is_woken_when_the_batch_gives_the_lease_back(
    broker, database_url, start_worker, webhook_settings
):
    events: list[int] = []

    def ok(request):
        if not events:  # during the batch's POST: another event for the endpoint
            with psycopg.connect(database_url) as conn, conn.transaction():
                events.append(webhooks.emit_event(conn, "woken", {"n": 1}))
            webhooks.fanout.fn(events[0])
        return Reply(200, b"")

    with web_server() as site:
        site.on("POST", "/hook", ok)
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["woken"])
        # Given a delivery being made while its endpoint's lease is held
        fanned_out(database_url, "woken", 1)
        start_worker(queues=["webhook"], threads=4)
        # When another delivery is fanned out during its POST (its job written due at the
        # lease's expiry, 20 s away), then the batch ends and gives the lease back
        wait_for(lambda: [s for _, s, _ in states(database_url, endpoint)] == ["succeeded"] * 2, timeout_s=10,
                 what="the second delivery to be made, long before the lease would have expired")
    # Then the second's job was woken by the lease's release (it was parked until the lease's
    # expiry, 20 s away): it ran once; or, claimed in the instant between its commit and its
    # parking, it found the endpoint busy, snoozed once, and was woken all the same
    [(claims, options)] = query(database_url, "SELECT q.claims, q.message->'options' FROM standmeet.webhook_deliveries d"
                                              " JOIN dramatiq.queue q ON q.message_id = d.message_id"
                                              " WHERE d.event_id = %s", (events[0],))
    assert (claims, options.get("snoozes", 0)) in ((1, 0), (2, 1)), (claims, options)


def test_a_job_that_made_a_full_batch_goes_on_with_the_endpoints_next_deliveries_without_a_claim(
    broker, database_url, start_worker, webhook_settings
):
    with web_server() as site:
        site.on("POST", "/hook", lambda request: Reply(200, b""))
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["backlog"])
        # Given a backlog of 40 deliveries, all but the first one's job held back an hour
        fanned_out(database_url, "backlog", 40)
        messages = [m for (m,) in query(database_url, "SELECT message_id::text FROM standmeet.webhook_deliveries"
                                                      " WHERE endpoint_id = %s ORDER BY id", (endpoint,))]
        query(database_url, "UPDATE dramatiq.queue SET eta = now() + interval '1 hour'"
                            " WHERE message_id = ANY(%s::uuid[])", (messages[1:],))
        # When the first job runs
        start_worker(queues=["webhook"], threads=1)
        wait_for(lambda: [s for _, s, _ in states(database_url, endpoint)] == ["succeeded"] * 40, timeout_s=15,
                 what="the 40 deliveries to be made")
        wait_for(lambda: query(database_url, RAN_OR_READY) == [(0,)], timeout_s=10, what="every job to end")
    # Then that one job made them all, in order, oldest first: its batch of 32, then the 8
    # after it, every other job done without a claim
    claims = dict(query(database_url, "SELECT message_id::text, claims FROM dramatiq.queue"
                                      " WHERE message_id = ANY(%s::uuid[])", (messages,)))
    assert [claims[m] for m in messages] == [1] + [0] * 39
    assert query(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
                               " AND state = 'done'", (messages,)) == [(40,)]



def test_a_batch_does_not_make_a_delivery_whose_job_an_operator_cancelled(
    broker, database_url, start_worker, webhook_settings
):
    from broker import ops

    with web_server() as site:
        site.on("POST", "/hook", lambda request: Reply(200, b""))
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["cancelled.in.batch"])
        # Given three deliveries waiting, the second's job cancelled by an operator (to stop
        # that traffic)
        events = fanned_out(database_url, "cancelled.in.batch", 3)
        (first, _), (second, second_job), (third, _) = query(
            database_url, "SELECT id, message_id::text FROM standmeet.webhook_deliveries"
                          " WHERE endpoint_id = %s ORDER BY id", (endpoint,))
        with psycopg.connect(database_url) as conn:
            assert ops.cancel_jobs(conn, message_ids=[second_job], by="ops") == 1
        # When the first delivery's job takes the endpoint's lease and makes its batch
        start_worker(queues=["webhook"], threads=1)
        wait_for(lambda: [s for _, s, _ in states(database_url, endpoint)] == ["succeeded", "pending", "succeeded"],
                 timeout_s=15, what="the first and third deliveries made")
        wait_for(lambda: query(database_url, RAN_OR_READY) == [(0,)], timeout_s=10, what="every job to end")
        headers = list(site.requests)
    # Then the cancelled job's delivery was not posted: it waits, pending, to be failed as
    # abandoned (or replayed)
    assert [r.headers["webhook-id"] for r in headers] == [f"msg_{events[0]}_{endpoint}", f"msg_{events[2]}_{endpoint}"]
    assert states(database_url, endpoint)[1] == (events[1], "pending", 0)


def test_a_batch_delivery_that_fails_for_good_rejects_its_queued_job_with_the_reason_and_a_warning(
    broker, database_url, start_worker, webhook_settings, caplog
):
    # Given three deliveries waiting for one endpoint, which accepts the first POST and
    # answers every later one 410 Gone
    answers = iter([200])
    with web_server() as site:
        site.on("POST", "/hook", lambda r: Reply(next(answers, 410), b"bye"))
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["gone"])
        fanned_out(database_url, "gone", 3)
        # When one job makes them as a batch
        with caplog.at_level(logging.WARNING, logger="standmeet.actors.webhooks"):
            start_worker(queues=["webhook"], threads=1)
            wait_for(lambda: query(database_url, "SELECT count(*) FROM dramatiq.queue q"
                                                 " JOIN standmeet.webhook_deliveries d ON d.message_id = q.message_id"
                                                 " WHERE d.endpoint_id = %s AND q.state IN ('queued', 'consumed')",
                                   (endpoint,)) == [(0,)], timeout_s=20, what="every delivery's job to end")
    # Then the delivery that failed for good has its job rejected with the reason, as its
    # own job would have been, and says so once in the log
    rows = query(database_url, "SELECT d.state, d.last_outcome, q.state::text, q.error"
                               " FROM standmeet.webhook_deliveries d JOIN dramatiq.queue q ON q.message_id = d.message_id"
                               " WHERE d.endpoint_id = %s ORDER BY d.id", (endpoint,))
    # (the 410 disabled the endpoint: the delivery after it is skipped, its job done; which
    # delivery's job ran first is the work queue's choice)
    assert sorted(r[:3] for r in rows) == [("failed", "gone", "rejected"), ("skipped", "endpoint disabled", "done"),
                                           ("succeeded", "ok", "done")]
    (error,) = [r[3] for r in rows if r[0] == "failed"]
    assert error.startswith("DeliveryFailed: delivery") and "gone (410)" in error
    warned = [r.getMessage() for r in caplog.records if "gone (410)" in r.getMessage()]
    assert len(warned) == 1
