"""A delivery attempted before (retried after a failure, or replayed by an operator) waits
for its endpoint's lease as a never-attempted one does: once its back-off has elapsed, the
job that gives the lease back wakes it (it does not wait out the lease), and a delivery
fanned out behind it is parked; before its back-off has elapsed, nothing wakes it."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest

from actors import settings as app_settings
from actors import webhooks
from middleware.keyed_lease import Held, PostgresLeases
from tests.support.db import query, scalar, wait_for
from tests.support.webserver import Reply, Request, Server, web_server

#: How soon after the lease is given back a woken delivery must be attempted: well under
#: the lease (20 s), whose expiry is when it would run if nothing woke it.
WOKEN_WITHIN_S = 5.0


def emit(database_url: str, event_type: str, count: int) -> list[int]:
    """``count`` events, emitted in one transaction (the worker's relay fans them out)."""
    with psycopg.connect(database_url) as conn, conn.transaction():
        return [webhooks.emit_event(conn, event_type, {"n": n}) for n in range(count)]


def delivery_of(database_url: str, event: int) -> tuple[Any, ...]:
    """(id, state, attempts, message id, next_attempt_at) of the event's only delivery;
    Nones until it is fanned out."""
    rows = query(database_url, "SELECT id, state, attempts, message_id::text, next_attempt_at"
                               " FROM standmeet.webhook_deliveries WHERE event_id = %s", (event,))
    return rows[0] if rows else (None,) * 5


def snoozed_until(database_url: str, message_id: str) -> datetime | None:
    """When the message, queued after a snooze, is due; None while it has not snoozed."""
    return scalar(database_url, "SELECT eta FROM dramatiq.queue WHERE message_id = %s AND state = 'queued'"
                                " AND (message->'options'->>'snoozes')::int >= 1", (message_id,))


@dataclass
class HeldEndpoint:
    """A loopback endpoint: the deliveries of ``target`` are answered from ``target_answers``
    (then 200); the first POST of any other delivery (a job that took the endpoint's lease)
    is held until :meth:`let_go`, every later one answered 200."""

    site: Server
    target: str = ""  # the webhook-id of the delivery under test
    target_answers: list[int] = field(default_factory=list)
    target_posted: list[float] = field(default_factory=list)  # monotonic times of its POSTs
    holder_posting: threading.Event = field(default_factory=threading.Event)
    _let_go: threading.Event = field(default_factory=threading.Event)

    @property
    def url(self) -> str:
        return self.site.base + "/hook"

    def let_go(self) -> None:
        self._let_go.set()

    def answer(self, request: Request) -> Reply:
        if request.headers["webhook-id"] == self.target:
            self.target_posted.append(time.monotonic())
            return Reply(self.target_answers.pop(0) if self.target_answers else 200, b"")
        if not self.holder_posting.is_set():
            self.holder_posting.set()
            # held while the lease's holder waits for its answer (under the POST's 10 s deadline)
            self._let_go.wait(timeout=app_settings.current().webhook_http_timeout_s - 1)
        return Reply(200, b"")


@contextmanager
def held_endpoint() -> Iterator[HeldEndpoint]:
    with web_server() as site:
        endpoint = HeldEndpoint(site)
        site.on("POST", "/hook", endpoint.answer)
        try:
            yield endpoint
        finally:
            endpoint.let_go()  # never leave a worker's POST waiting


@contextmanager
def one_delivery_to_a_held_endpoint(database_url: str, start_worker: Any, event_type: str, *,
                                    answers: list[int] | None = None) -> Iterator[tuple[HeldEndpoint, int, int]]:
    """A worker, an endpoint served by :class:`HeldEndpoint`, and one event of ``event_type``
    whose delivery is its target (answered from ``answers``): (the endpoint, its id, the event)."""
    with held_endpoint() as held:
        endpoint, _ = webhooks.add_endpoint(held.url, [event_type])
        start_worker(queues=["webhook"], threads=4)
        [event] = emit(database_url, event_type, 1)
        held.target, held.target_answers = f"msg_{event}_{endpoint}", list(answers or [])
        yield held, endpoint, event


def lease_held_by_a_batch(database_url: str, held: HeldEndpoint, endpoint: int, event_type: str) -> datetime:
    """Other deliveries to the endpoint, the first job of which takes the lease and posts
    (held); when that lease expires."""
    emit(database_url, event_type, 3)
    wait_for(held.holder_posting.is_set, timeout_s=15, what="a job holding the endpoint's lease to post")
    until = scalar(database_url, "SELECT busy_until FROM standmeet.webhook_endpoints WHERE id = %s", (endpoint,))
    assert until is not None
    return until  # type: ignore[no-any-return]


def test_a_retried_delivery_that_found_its_endpoint_busy_is_attempted_when_the_lease_is_given_back(
    broker, database_url, start_worker, webhook_settings
):
    # Given a delivery whose first attempt failed (500): retried after its back-off (5 s)
    with one_delivery_to_a_held_endpoint(database_url, start_worker, "retried", answers=[500]) as (
            held, endpoint, event):
        wait_for(lambda: delivery_of(database_url, event)[2] == 1, timeout_s=15, what="the first attempt")
        delivery, state, _, message, backoff_ends = delivery_of(database_url, event)
        assert state == "pending" and backoff_ends is not None
        # and a job holding the endpoint's lease, making other deliveries, when the retry comes due
        lease_expires = lease_held_by_a_batch(database_url, held, endpoint, "retried")
        # When the retry, due, finds the endpoint busy (it snoozes until the lease's expiry)
        backoff_s = webhooks.SCHEDULE[0] * 1.1
        snoozed = wait_for(lambda: snoozed_until(database_url, message), timeout_s=backoff_s + 5,
                           what="the retry to find the endpoint busy and snooze")
        assert snoozed >= lease_expires - timedelta(seconds=1), (snoozed, lease_expires)
        # and the job holding the lease gives it back
        released = time.monotonic()
        held.let_go()
        # Then the retry is woken and attempted at once, not when the lease would have expired
        wait_for(lambda: delivery_of(database_url, event)[1:3] == ("succeeded", 2), timeout_s=WOKEN_WITHIN_S,
                 what=f"the retried delivery to be made once the lease was given back (unwoken, it waits for "
                      f"the lease's expiry, {lease_expires:%H:%M:%S}, about {app_settings.current().webhook_lease_s:g} s "
                      "after the holder took it)")
        assert len(held.target_posted) == 2 and held.target_posted[1] - released < WOKEN_WITHIN_S
        # and never before its back-off had elapsed
        [(started,)] = query(database_url, "SELECT started_at FROM standmeet.webhook_attempts"
                                           " WHERE delivery_id = %s AND attempt = 2", (delivery,))
        assert backoff_ends <= started < lease_expires, (backoff_ends, started, lease_expires)
        # (and the endpoint's other deliveries are all made: the wake chain goes on)
        wait_for(lambda: query(database_url, "SELECT count(*) FROM standmeet.webhook_deliveries"
                                             " WHERE endpoint_id = %s AND state <> 'succeeded'", (endpoint,)) == [(0,)],
                 timeout_s=WOKEN_WITHIN_S, what="every delivery to the endpoint to be made")


def test_a_replayed_delivery_that_found_its_endpoint_busy_is_made_when_the_lease_is_given_back(
    broker, database_url, start_worker, webhook_settings
):
    # Given a delivery made already (200)
    with one_delivery_to_a_held_endpoint(database_url, start_worker, "replayed") as (held, endpoint, event):
        wait_for(lambda: delivery_of(database_url, event)[1] == "succeeded", timeout_s=15, what="the delivery")
        delivery = delivery_of(database_url, event)[0]
        # and a job holding the endpoint's lease, making other deliveries
        lease_expires = lease_held_by_a_batch(database_url, held, endpoint, "replayed")
        # When an operator replays it, and its new job finds the endpoint busy (it snoozes)
        message = webhooks.replay(delivery)
        wait_for(lambda: snoozed_until(database_url, message), timeout_s=10,
                 what="the replay's job to find the endpoint busy and snooze")
        # and the job holding the lease gives it back
        held.let_go()
        # Then the replay is woken and made at once, not when the lease would have expired
        wait_for(lambda: delivery_of(database_url, event)[1:3] == ("succeeded", 2), timeout_s=WOKEN_WITHIN_S,
                 what=f"the replayed delivery to be made once the lease was given back (unwoken, it waits for "
                      f"the lease's expiry, {lease_expires:%H:%M:%S})")
        assert len(held.target_posted) == 2


def retried_waiter(database_url: str, event: int, *, backoff_ends_in_s: float, due_in_s: float) -> str:
    """Make the event's delivery one retried after a failure, whose back-off ends in
    ``backoff_ends_in_s`` (negative: elapsed), its message due in ``due_in_s``; its message."""
    [(message,)] = query(
        database_url,
        "WITH d AS (UPDATE standmeet.webhook_deliveries SET attempts = 1, last_outcome = 'http',"
        " next_attempt_at = now() + make_interval(secs => %(backoff)s) WHERE event_id = %(event)s"
        " RETURNING message_id)"
        " UPDATE dramatiq.queue q SET eta = now() + make_interval(secs => %(due)s) FROM d"
        " WHERE q.message_id = d.message_id RETURNING q.message_id::text",
        {"event": event, "backoff": backoff_ends_in_s, "due": due_in_s})
    return message  # type: ignore[no-any-return]


def eta_in_s(database_url: str, message: str) -> float:
    return scalar(database_url, "SELECT extract(epoch FROM eta - now())::float8 FROM dramatiq.queue"
                                " WHERE message_id = %s", (message,))  # type: ignore[no-any-return]


def fanned_out_now(database_url: str, event_type: str, count: int) -> list[int]:
    """``count`` events fanned out at once, in this process (no worker runs)."""
    events = emit(database_url, event_type, count)
    for event in events:
        webhooks.fanout.fn(event)
    return events


@contextmanager
def answering_endpoint(database_url: str, event_type: str, count: int) -> Iterator[tuple[Server, list[int]]]:
    """An endpoint that answers every POST 200, and ``count`` events of ``event_type`` to it
    fanned out (no worker runs yet): the site and the events."""
    with web_server() as site:
        site.on("POST", "/hook", lambda request: Reply(200, b""))
        webhooks.add_endpoint(site.base + "/hook", [event_type])
        yield site, fanned_out_now(database_url, event_type, count)


def test_a_release_wakes_a_retried_delivery_whose_back_off_has_elapsed_never_one_still_in_it(
    broker, database_url, webhook_settings
):
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/hook", ["released"])
    holder_event, waiting_event, due_event = fanned_out_now(database_url, "released", 3)
    # Given two retried deliveries that found the endpoint busy and snoozed (until its
    # lease's expiry, 20 s): the older still in its back-off, the other's back-off elapsed
    lease_s = app_settings.current().webhook_lease_s
    in_backoff = retried_waiter(database_url, waiting_event, backoff_ends_in_s=3600, due_in_s=3600)
    due = retried_waiter(database_url, due_event, backoff_ends_in_s=-1, due_in_s=lease_s)
    # and a job holding the endpoint's lease (taken as the middleware takes it)
    lease = webhooks.ENDPOINT_LEASE
    holder = delivery_of(database_url, holder_event)
    taken = PostgresLeases().take(lease, holder[0])
    assert taken is not None and taken[0] is not None and taken[1] == endpoint, taken
    # When the holder gives the lease back
    PostgresLeases().release(Held(lease, taken[1], str(taken[0]), tuple(taken[2:])), holder[3])
    # Then the one whose back-off has elapsed is due now; the one still in it keeps its retry
    assert eta_in_s(database_url, due) <= 0
    assert eta_in_s(database_url, in_backoff) > 3500


def test_a_delivery_fanned_out_behind_a_due_retry_waits_parked_for_its_job_unclaimed(
    broker, database_url, webhook_settings
):
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/hook", ["behind.retry"])
    # Given a delivery whose retry is due, its job queued and due (it takes the lease when it runs)
    [retried_event] = fanned_out_now(database_url, "behind.retry", 1)
    retried_waiter(database_url, retried_event, backoff_ends_in_s=-1, due_in_s=0)
    # When another delivery to the endpoint is fanned out
    [event] = fanned_out_now(database_url, "behind.retry", 1)
    # Then its job is parked until a lease's length from now: the retry's job's batch makes
    # it, or its release wakes it; it is not claimed only to find the endpoint busy
    lease_s = app_settings.current().webhook_lease_s
    assert lease_s - 2 < eta_in_s(database_url, delivery_of(database_url, event)[3]) <= lease_s


def test_a_batch_delivery_that_fails_is_retried_after_its_back_off_not_when_its_parked_job_comes_due(
    broker, database_url, start_worker, webhook_settings
):
    with web_server() as site:
        endpoint, _ = webhooks.add_endpoint(site.base + "/hook", ["batch.retry"])
        # Given two deliveries to one endpoint, the second's job held back (parked an hour)
        # so that the first job's batch makes it; its first attempt fails (500)
        first, second = fanned_out_now(database_url, "batch.retry", 2)
        _, _, _, parked, _ = delivery_of(database_url, second)
        query(database_url, "UPDATE dramatiq.queue SET eta = now() + interval '1 hour' WHERE message_id = %s",
              (parked,))
        answers = {f"msg_{second}_{endpoint}": [500]}

        def answer(request: Request) -> Reply:
            queued = answers.get(request.headers["webhook-id"])
            return Reply(queued.pop(0) if queued else 200, b"")

        site.on("POST", "/hook", answer)
        start_worker(queues=["webhook"], threads=2)
        # When the batch records its failed attempt
        wait_for(lambda: delivery_of(database_url, second)[2] == 1, timeout_s=15, what="the batch's attempt")
        _, state, _, message, retry_at = delivery_of(database_url, second)
        assert (state, message) == ("pending", parked)
        # Then its job is due at its retry, not an hour later ...
        eta = scalar(database_url, "SELECT eta FROM dramatiq.queue WHERE message_id = %s", (message,))
        assert abs((eta - retry_at).total_seconds()) < 1, (eta, retry_at)
        # ... and it is attempted again once its back-off has elapsed
        wait_for(lambda: delivery_of(database_url, second)[1:3] == ("succeeded", 2),
                 timeout_s=webhooks.SCHEDULE[0] * 1.1 + WOKEN_WITHIN_S, what="the retry after its back-off")


def test_a_release_reads_one_due_retry_however_many_are_due(broker, database_url, webhook_settings):
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/hook", ["many.due"])
    events = fanned_out_now(database_url, "many.due", 300)
    # Given an endpoint back from an outage: 299 retried deliveries due (their back-off
    # elapsed, the oldest due first), their jobs snoozed behind the lease
    for n, event in enumerate(events[1:]):
        retried_waiter(database_url, event, backoff_ends_in_s=-1 - n, due_in_s=60)
    holder = delivery_of(database_url, events[0])
    taken = PostgresLeases().take(webhooks.ENDPOINT_LEASE, holder[0])
    assert taken is not None and taken[1] == endpoint
    # When the lease is given back
    with psycopg.connect(database_url) as conn:
        try:
            [(plan,)] = conn.execute(("EXPLAIN (ANALYZE, FORMAT JSON) " + webhooks.RELEASE_ENDPOINT).encode(),
                                     {"key": endpoint, "token": str(taken[0]), "message_id": holder[3]}).fetchall()
        finally:
            conn.rollback()
    # Then the due retries' index was read for one of them, not for every one
    read = _rows_read_through(plan, "webhook_deliveries_retry_due_idx")
    assert read and max(read) <= 2, read


def _plan_nodes(plan: Any) -> Iterator[dict]:
    """Every node of an EXPLAIN (ANALYZE, FORMAT JSON) plan."""
    import json

    def nodes(node: dict) -> Iterator[dict]:
        yield node
        for child in node.get("Plans", []):
            yield from nodes(child)

    yield from nodes((plan if isinstance(plan, list) else json.loads(plan))[0]["Plan"])


def _rows_read_through(plan: Any, index: str) -> list[int]:
    """Rows each scan of ``index`` returned in an EXPLAIN (ANALYZE, FORMAT JSON) plan, all loops."""
    return [n["Actual Rows"] * n["Actual Loops"] for n in _plan_nodes(plan) if n.get("Index Name") == index]


def _rows_scanned_of(plan: Any, table: str) -> int:
    """Rows every scan of ``table`` read in an EXPLAIN (ANALYZE, FORMAT JSON) plan (those
    its filter removed included), all loops."""
    return int(sum((n["Actual Rows"] + n.get("Rows Removed by Filter", 0)) * n["Actual Loops"]
                   for n in _plan_nodes(plan) if n.get("Relation Name") == table))


def test_parking_reads_a_few_due_retries_however_many_wait_snoozed(broker, database_url, webhook_settings):
    webhooks.add_endpoint("http://127.0.0.1:9/hook", ["park.many"])
    events = fanned_out_now(database_url, "park.many", 300)
    # Given an endpoint back from an outage: 300 retried deliveries due, their jobs snoozed
    # behind its lease (not due)
    for n, event in enumerate(events):
        retried_waiter(database_url, event, backoff_ends_in_s=-1 - n, due_in_s=60)
    [event] = emit(database_url, "park.many", 1)  # (the event of the new delivery below)
    with psycopg.connect(database_url) as conn:
        try:
            # and a few due messages of other queues, as the statistics autovacuum gathers
            # count them (all rolled back at the end)
            conn.execute("INSERT INTO dramatiq.queue (queue_name, message_id, state, message) "
                         "SELECT 'other', gen_random_uuid(), 'queued', '{}'::jsonb FROM generate_series(1, 5)")
            conn.execute("ANALYZE dramatiq.queue, standmeet.webhook_deliveries")
            # When a new delivery to it is fanned out and parked
            rows = conn.execute(webhooks.FANOUT, {"event": event, "ping_endpoint": None}).fetchall()
            ids = [int(r[0]) for r in rows]
            webhooks.enqueue_deliveries(conn, ids, named=[r[2] for r in rows])
            locked = [m for (m,) in conn.execute(webhooks.PARK_LOCK_MESSAGES, {"ids": ids}).fetchall()]
            [(plan,)] = conn.execute(("EXPLAIN (ANALYZE, FORMAT JSON) " + webhooks.PARK_BEHIND).encode(),
                                     {"ids": ids, "locked": locked, "lease_s": 20}).fetchall()
        finally:
            conn.rollback()
            # (the table's row count an ANALYZE writes outlives a rollback: counted again)
            conn.execute("ANALYZE dramatiq.queue, standmeet.webhook_deliveries")
    # Then it read a few of the due retries, not every one, and looked up their messages
    # only: none of the queue's other due messages
    read = _rows_read_through(plan, "webhook_deliveries_retry_due_idx")
    assert read and max(read) <= 8, read
    assert _rows_scanned_of(plan, "queue") <= 2 * 8


def test_a_pending_delivery_whose_job_ended_without_making_it_is_failed_for_an_operator_to_replay(
    broker, database_url, webhook_settings, caplog
):
    import logging

    from broker import ops

    webhooks.add_endpoint("http://127.0.0.1:9/hook", ["abandoned"])
    cancelled, pruned, rejected_now, waiting = fanned_out_now(database_url, "abandoned", 4)
    # Given a delivery whose job an operator cancelled two minutes ago (rejected when claimed),
    # one whose job is gone (pruned), one whose job was rejected a moment ago, and one waiting
    with psycopg.connect(database_url) as conn:
        ops.cancel_jobs(conn, message_ids=[delivery_of(database_url, cancelled)[3]], by="ops")
    query(database_url, "UPDATE dramatiq.queue SET state = 'rejected', mtime = now() - interval '2 minutes'"
                        " WHERE message_id = %s", (delivery_of(database_url, cancelled)[3],))
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (delivery_of(database_url, pruned)[3],))
    query(database_url, "UPDATE dramatiq.queue SET state = 'rejected', error = 'crashed' WHERE message_id = %s",
          (delivery_of(database_url, rejected_now)[3],))
    # When the pass of every minute runs (the last hour's rejected jobs), then the hourly one
    with caplog.at_level(logging.WARNING, logger=webhooks.logger.name):
        assert webhooks.fail_abandoned_deliveries() == 1
        assert webhooks.fail_abandoned_deliveries(everything=True) == 1
    # Then the cancelled one and the one whose job is gone are failed, each said once with why
    assert [delivery_of(database_url, e)[1] for e in (cancelled, pruned, rejected_now, waiting)] == [
        "failed", "failed", "pending", "pending"]
    assert query(database_url, "SELECT DISTINCT last_outcome FROM standmeet.webhook_deliveries WHERE id = ANY(%s)",
                 ([delivery_of(database_url, e)[0] for e in (cancelled, pruned)],)) == [(webhooks.ABANDONED,)]
    said = [r.getMessage() for r in caplog.records if "ended without making it" in r.getMessage()]
    assert len(said) == 2 and any("cancelled by ops" in line for line in said) and any(
        "its job is gone" in line for line in said), said
    # and an operator can replay them: a new job carries each again
    assert webhooks.replay(delivery_of(database_url, cancelled)[0])
    assert delivery_of(database_url, cancelled)[1] == "pending"
    assert webhooks.fail_abandoned_deliveries(everything=True) == 0


def _job_state(database_url: str, message: str) -> str | None:
    return scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",  # type: ignore[no-any-return]
                  (message,))


def test_a_delivery_failed_as_abandoned_is_made_when_its_job_comes_back(
    broker, database_url, start_worker, webhook_settings
):
    import uuid

    from broker import ops
    from broker.engine import sql

    with answering_endpoint(database_url, "comes.back", 2) as (site, (by_operator, by_rescue)):
        # Given two deliveries failed as abandoned: one whose job an operator cancelled,
        # one whose job rescue rejected, blamed on a worker process that was only cut off
        operators_job, rescued_job = delivery_of(database_url, by_operator)[3], delivery_of(database_url, by_rescue)[3]
        with psycopg.connect(database_url) as conn:
            assert ops.cancel_jobs(conn, message_ids=[operators_job], by="ops") == 1
        cut_off = str(uuid.uuid4())
        query(database_url, "UPDATE dramatiq.queue SET state = 'rejected', crashes = 4, blamed_worker = %s,"
                            " error = 'rejected: crashed its worker 4 times' WHERE message_id = %s",
              (cut_off, rescued_job))
        query(database_url, "UPDATE dramatiq.queue SET mtime = now() - interval '2 minutes'"
                            " WHERE message_id = ANY(%s::uuid[])", ([operators_job, rescued_job],))
        assert webhooks.fail_abandoned_deliveries() == 2
        # When the operator retries the job, and the worker process comes back and takes
        # back its blame
        with psycopg.connect(database_url) as conn:
            assert ops.retry_jobs(conn, message_ids=[operators_job], by="ops") == 1
        with psycopg.connect(database_url, autocommit=True) as conn:
            claim = conn.execute("SELECT claims FROM dramatiq.queue WHERE message_id = %s", (rescued_job,)).fetchone()[0]
            conn.execute(sql.CLEAR_BLAME, {"ids": [uuid.UUID(rescued_job)], "claims": [claim], "worker_id": cut_off})
        query(database_url, "UPDATE dramatiq.queue SET eta = now() WHERE message_id = %s AND state = 'queued'",
              (rescued_job,))  # (due now: not rescue's own delay)
        start_worker(queues=["webhook"], threads=2)
        # Then each job makes its delivery after all
        for event in (by_operator, by_rescue):
            wait_for(lambda event=event: delivery_of(database_url, event)[1:3] == ("succeeded", 1), timeout_s=15,
                     what="the delivery made by its job, back")
        # (a job's own outcome is written by its settle, just after its delivery's record)
        wait_for(lambda: {_job_state(database_url, m) for m in (operators_job, rescued_job)} == {"done"},
                 timeout_s=15, what="both jobs done")
        assert len(site.requests) == 2


def test_a_running_job_whose_delivery_another_jobs_batch_made_is_woken_to_end_at_once(
    broker, database_url, start_worker, webhook_settings
):
    with answering_endpoint(database_url, "made.elsewhere", 2) as (_, (first, second)):
        # Given the second delivery's job running (claimed by this live process: the run that
        # is about to find the endpoint busy, its snooze not yet written)
        second_job = delivery_of(database_url, second)[3]
        query(database_url, "UPDATE dramatiq.queue SET state = 'consumed', worker_id = %s::uuid, claims = claims + 1"
                            " WHERE message_id = %s", (broker.worker_id, second_job))
        # When the first delivery's job takes the endpoint's lease and makes both in its batch
        start_worker(queues=["webhook"], threads=1)
        wait_for(lambda: delivery_of(database_url, second)[1:3] == ("succeeded", 1), timeout_s=15,
                 what="the second delivery made by the first job's batch")
        assert delivery_of(database_url, first)[1:3] == ("succeeded", 1)
    # Then the running job is marked woken, so its snooze's settle makes it due at once (to
    # find its delivery made and end), not a whole lease later
    assert scalar(database_url, "SELECT woken_at IS NOT NULL FROM dramatiq.queue WHERE message_id = %s",
                  (second_job,)) is True
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (second_job,))


#: What a consumer's claim can take of a message now: the claim's own test of a row
#: (queued, due) and its lock (``FOR UPDATE SKIP LOCKED``: a row locked elsewhere is
#: passed over, not waited for), for that one message.
CLAIMABLE = ("SELECT message_id::text FROM dramatiq.queue WHERE message_id = %s AND state = 'queued'"
             " AND eta <= now() FOR UPDATE SKIP LOCKED")


def test_a_due_waiter_is_not_claimed_while_the_release_commits_so_its_run_finds_the_lease_free(
    broker, database_url, webhook_settings
):
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/hook", ["release.race"])
    holder_event, waiting_event = fanned_out_now(database_url, "release.race", 2)
    holder, waiting = delivery_of(database_url, holder_event), delivery_of(database_url, waiting_event)
    # Given a job holding the endpoint's lease (running), and the next delivery replayed by
    # an operator: its new job queued and due now
    lease = webhooks.ENDPOINT_LEASE
    taken = PostgresLeases().take(lease, holder[0])
    assert taken is not None and taken[0] is not None and taken[1] == endpoint, taken
    query(database_url, "UPDATE dramatiq.queue SET state = 'consumed', claims = claims + 1 WHERE message_id = %s",
          (holder[3],))
    replayed = webhooks.replay(waiting[0])
    assert eta_in_s(database_url, replayed) <= 0
    try:
        with psycopg.connect(database_url) as releasing, psycopg.connect(database_url, autocommit=True) as consumer:
            [(channel,)] = consumer.execute("SELECT standmeet.enqueue_channel('webhook')").fetchall()
            consumer.execute(psycopg.sql.SQL("LISTEN {}").format(psycopg.sql.Identifier(channel)))
            # When the holder gives the lease back: its statement has run, its commit not yet
            # come (the wake read the waiter's job queued and due)
            releasing.execute(webhooks.LOCK_ENDPOINT, {"key": endpoint})
            releasing.execute(webhooks.RELEASE_ENDPOINT,
                              {"key": endpoint, "token": str(taken[0]), "message_id": holder[3]})
            # Then no claim takes the waiter's job meanwhile: its run would find the lease
            # still held and snooze until the lease's expiry (20 s)
            with consumer.transaction():
                assert consumer.execute(CLAIMABLE, (replayed,)).fetchall() == []
                assert consumer.execute(webhooks.TAKE_ENDPOINT, {"key": waiting[0], "lease_s": 20.0}).fetchone()[2] \
                    == "busy"
                raise psycopg.Rollback()
            releasing.commit()
            # and once the release commits, the queue's consumers are told, a claim takes
            # the job, and its run takes the lease
            told = list(consumer.notifies(timeout=5.0, stop_after=1))
            assert [n.channel for n in told] == [channel]
            assert consumer.execute(CLAIMABLE, (replayed,)).fetchall() == [(replayed,)]
        retaken = PostgresLeases().take(lease, waiting[0])
        assert retaken is not None and retaken[0] is not None, retaken
    finally:
        query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
              ([holder[3], waiting[3], replayed],))


def test_a_release_that_deadlocks_with_an_operators_locks_is_run_again_and_records_its_attempt(
    broker, database_url, webhook_settings
):
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/hook", ["release.deadlock"])
    events = fanned_out_now(database_url, "release.deadlock", 3)
    holder, made, waiter = (delivery_of(database_url, e) for e in events)
    # Given a job holding the endpoint's lease that has just posted the second delivery of
    # its batch (its last), and the third delivery's job queued and due (to be woken)
    query(database_url, "UPDATE dramatiq.queue SET eta = now() WHERE message_id = ANY(%s::uuid[])",
          ([made[3], waiter[3]],))
    taken = PostgresLeases().take(webhooks.ENDPOINT_LEASE, holder[0])
    assert taken is not None and taken[0] is not None and taken[1] == endpoint, taken
    [(event_id, created_at)] = query(database_url, "SELECT ev.id, ev.created_at FROM standmeet.webhook_deliveries d"
                                                   " JOIN standmeet.webhook_events ev ON ev.id = d.event_id"
                                                   " WHERE d.id = %s", (made[0],))
    due = webhooks._Due(made[0], 0, event_id, "release.deadlock", {}, created_at, made[3])
    attempt = webhooks._attempt(due, datetime.now(timezone.utc), time.monotonic(), webhooks.Outcome("ok", 200))
    outcome: list[BaseException | None] = []

    def record_and_release() -> None:
        try:
            webhooks._settle(SimpleNamespace(message_id=holder[3]), endpoint, str(taken[0]), attempt)
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            outcome.append(exc)

    with psycopg.connect(database_url) as operator:
        # (the operator's side waits long before it looks for a deadlock: the release finds it)
        operator.execute("SET deadlock_timeout = '60s'")
        # and an operator's transaction (a cancel of several jobs, locking them in id order)
        # holding the made delivery's message
        operator.execute("SELECT 1 FROM dramatiq.queue WHERE message_id = %s FOR UPDATE", (made[3],))
        releasing = threading.Thread(target=record_and_release, name="record-and-release")
        releasing.start()
        try:
            # When the holder records its attempt and gives the lease back (it locks the
            # waiter's job, woken, then waits for the made one's), and the operator then
            # asks for the waiter's job: each waits for the other
            wait_for(lambda: scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                                                  " current_database() AND wait_event_type = 'Lock'"),
                     timeout_s=10, what="the release to wait for the operator's lock")
            operator.execute("SELECT 1 FROM dramatiq.queue WHERE message_id = %s FOR UPDATE", (waiter[3],))
            operator.commit()
        finally:
            operator.rollback()
            releasing.join(timeout=30)
    # Then Postgres rolled the release back whole, and it ran again once the operator was
    # done: the attempt is recorded, the made message done, the lease given back
    assert outcome == [None], outcome
    assert delivery_of(database_url, events[1])[1:3] == ("succeeded", 1)
    assert scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s", (made[3],)) == "done"
    assert query(database_url, "SELECT busy_until, lease_token FROM standmeet.webhook_endpoints WHERE id = %s",
                 (endpoint,)) == [(None, None)]
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
          ([holder[3], made[3], waiter[3]],))


@pytest.mark.parametrize("answer", [200, 500])
def test_a_batch_record_of_a_delivery_whose_job_is_settling_its_snooze_still_reaches_that_job(
    broker, database_url, webhook_settings, answer
):
    event_type = f"snooze.settling.{answer}"
    webhooks.add_endpoint("http://127.0.0.1:9/hook", [event_type])
    events = fanned_out_now(database_url, event_type, 2)
    holder, made = (delivery_of(database_url, e) for e in events)
    # Given the second delivery's job running (it found the endpoint busy)
    query(database_url, "UPDATE dramatiq.queue SET state = 'consumed', worker_id = %s::uuid, claims = claims + 1,"
                        " eta = now() WHERE message_id = %s", (broker.worker_id, made[3]))
    [(endpoint, event_id, created_at)] = query(
        database_url, "SELECT d.endpoint_id, ev.id, ev.created_at FROM standmeet.webhook_deliveries d"
                      " JOIN standmeet.webhook_events ev ON ev.id = d.event_id WHERE d.id = %s", (made[0],))
    due = webhooks._Due(made[0], 0, event_id, event_type, {}, created_at, made[3])
    outcome = webhooks.Outcome("ok", 200) if answer == 200 else webhooks.Outcome("http", 500)
    attempt = webhooks._attempt(due, datetime.now(timezone.utc), time.monotonic(), outcome)
    recorded: list[BaseException | None] = []

    def record() -> None:
        try:
            webhooks._settle(SimpleNamespace(message_id=holder[3]), endpoint, None, attempt)
            recorded.append(None)
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            recorded.append(exc)

    with psycopg.connect(database_url) as settling:
        # and its snooze being settled: its row written queued, due when the lease expires
        # (20 s), not yet committed
        settling.execute("UPDATE dramatiq.queue SET state = 'queued', worker_id = NULL,"
                         " eta = now() + interval '20 seconds' WHERE message_id = %s", (made[3],))
        # When the batch of the job holding the lease records the delivery's attempt (it
        # waits for that row), and the snooze then commits
        recording = threading.Thread(target=record, name="batch-record")
        recording.start()
        try:
            wait_for(lambda: recorded or scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE datname ="
                                                              " current_database() AND wait_event_type = 'Lock'"),
                     timeout_s=10, what="the record to wait for the snooze's row (or to end without it)")
            settling.commit()
        finally:
            settling.rollback()
            recording.join(timeout=30)
    assert recorded == [None], recorded
    # Then the record reaches the job as its row is now: made, the job is done (not left
    # queued until the snooze ends); retried, the job is due at the delivery's retry
    state, eta_s = query(database_url, "SELECT q.state::text, extract(epoch FROM q.eta - d.next_attempt_at)::float8"
                                       " FROM dramatiq.queue q JOIN standmeet.webhook_deliveries d"
                                       " ON d.message_id = q.message_id WHERE q.message_id = %s", (made[3],))[0]
    if answer == 200:
        assert (state, delivery_of(database_url, events[1])[1]) == ("done", "succeeded")
    else:
        assert state == "queued" and delivery_of(database_url, events[1])[1] == "pending"
        assert abs(eta_s) < 0.5, eta_s
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])", ([holder[3], made[3]],))


def test_a_replay_made_while_the_last_attempt_was_posted_is_not_undone_by_its_record(broker, database_url,
                                                                                       webhook_settings):
    # Given a delivery on its last attempt, whose job holds the endpoint's lease and is posting
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/hook", ["replayed.meanwhile"])
    [event] = emit(database_url, "replayed.meanwhile", 1)
    webhooks.fanout.fn(event)
    delivery, first_job = query(database_url, "SELECT id, message_id::text FROM standmeet.webhook_deliveries"
                                              " WHERE event_id = %s", (event,))[0]
    query(database_url, "UPDATE standmeet.webhook_deliveries SET attempts = %s WHERE id = %s",
          (len(webhooks.SCHEDULE), delivery))
    taken = PostgresLeases().take(webhooks.ENDPOINT_LEASE, delivery)
    assert taken is not None and taken[0] is not None
    started, t0 = datetime.now(timezone.utc), time.monotonic()
    # When an operator replays it meanwhile, and then the attempt fails for good and is recorded
    replayed_job = webhooks.replay(delivery)
    due = webhooks._Due(delivery, len(webhooks.SCHEDULE), event, "replayed.meanwhile", {}, started)
    made = webhooks._attempt(due, started, t0, webhooks.Outcome("http", 500, body="down"))
    assert made.state == "failed"
    webhooks._settle(SimpleNamespace(message_id=first_job, options={}), endpoint, str(taken[0]), made)
    # Then the attempt is on record, and the replay stands: pending, due now, for its own job
    assert query(database_url, "SELECT state, next_attempt_at, message_id::text, attempts"
                               " FROM standmeet.webhook_deliveries WHERE id = %s",
                 (delivery,)) == [("pending", None, replayed_job, len(webhooks.SCHEDULE) + 1)]
