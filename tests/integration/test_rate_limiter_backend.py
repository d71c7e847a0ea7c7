"""The Postgres rate-limiter backend, against a real database, Dramatiq's limiters and real processes."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import dramatiq
import psycopg
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.middleware import GroupCallbacks
from dramatiq.rate_limits import Barrier, ConcurrentRateLimiter, WindowRateLimiter

from tests.integration.backends_support import (
    child_report,
    children,
    eventually,
    expired_rows_after_statistics_of_one,
    fresh_database,
    listeners,
    query,
    scalar,
    start_child,
    start_gate,
    written_through_an_outage,
)

# isort: split
# (the support module prepares the ``broker`` package's import, so it comes first)
from broker.backends.rate_limits import PostgresRateLimiterBackend, prune_expired_once
from broker.errors import DatabaseUnavailable
from tests.support.proxy import PostgresProxy

LIVE_VALUE = "SELECT value FROM standmeet.rate_limits WHERE key = %s AND expires_at > now()"
IS_LIVE = "SELECT count(*) FROM standmeet.rate_limits WHERE key = %s AND expires_at > now()"
COUNT_ROWS = "SELECT count(*) FROM standmeet.rate_limits"
NEW_PROBE = "INSERT INTO limiter_probe (key) VALUES (%s)"
PROBE = "SELECT inside, peak FROM limiter_probe WHERE key = %s"
ENTRIES_BY_PROCESS = "SELECT pid, count(*) FROM limiter_entries WHERE key = %s GROUP BY pid"
RECORD_RUN = "INSERT INTO group_runs (run, kind) VALUES (%s, %s)"
RUNS = "SELECT kind, count(*), max(at) FROM group_runs WHERE run = %s GROUP BY kind"

MINUTE_MS = 60_000


@pytest.fixture(scope="module")
def db_url() -> Iterator[str]:
    with fresh_database() as url:
        yield url


@pytest.fixture
def app_name() -> str:
    return f"limits-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def backend(db_url: str, app_name: str) -> Iterator[PostgresRateLimiterBackend]:
    backend = PostgresRateLimiterBackend(url=db_url, application_name=app_name)
    yield backend
    backend.close()


def a_key(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex}"


def live_value(url: str, key: str) -> int | None:
    rows = query(url, LIVE_VALUE, (key,))
    return rows[0][0] if rows else None


def test_add_creates_a_key_only_when_no_live_one_exists(db_url: str, backend: PostgresRateLimiterBackend) -> None:
    key = a_key("add")

    assert backend.add(key, 3, MINUTE_MS) is True
    assert backend.add(key, 9, MINUTE_MS) is False
    assert live_value(db_url, key) == 3


def test_a_key_expires_by_the_database_clock_and_can_then_be_added_again(
    db_url: str, backend: PostgresRateLimiterBackend
) -> None:
    key = a_key("expiring")
    assert backend.add(key, 1, 300)

    eventually(lambda: backend.add(key, 2, MINUTE_MS), timeout_s=10, what="the key expiring")

    assert live_value(db_url, key) == 2


def test_incr_stops_at_the_maximum_and_decr_at_the_minimum(db_url: str, backend: PostgresRateLimiterBackend) -> None:
    key = a_key("counter")

    assert [backend.incr(key, 1, 2, MINUTE_MS) for _ in range(3)] == [True, True, False]
    assert live_value(db_url, key) == 2
    assert [backend.decr(key, 1, 0, MINUTE_MS) for _ in range(3)] == [True, True, False]
    assert live_value(db_url, key) == 0


def test_a_refused_incr_of_a_missing_key_leaves_it_missing(db_url: str, backend: PostgresRateLimiterBackend) -> None:
    key = a_key("too-big")

    assert backend.incr(key, 5, 2, MINUTE_MS) is False
    assert live_value(db_url, key) is None
    assert backend.add(key, 1, MINUTE_MS) is True


def test_an_expired_counter_counts_from_zero_again(db_url: str, backend: PostgresRateLimiterBackend) -> None:
    key = a_key("restart")
    assert backend.incr(key, 2, 2, 300)
    assert backend.incr(key, 1, 2, MINUTE_MS) is False

    eventually(lambda: backend.incr(key, 1, 2, MINUTE_MS), timeout_s=10, what="the counter expiring")

    assert live_value(db_url, key) == 1


def test_a_concurrent_limiter_of_two_never_lets_three_in_across_two_worker_processes(db_url: str) -> None:
    # Given two worker processes of four threads each, 30 messages each, whose actor
    # holds a slot of one ConcurrentRateLimiter(limit=2) while it records, in the
    # database, how many holders are inside at once; both start together at a gate
    key = a_key("concurrent")
    query(db_url, NEW_PROBE, (key,))
    with start_gate(db_url, gate=4242) as open_when, children(
        [
            start_child("limited-worker", url=db_url, key=key, limit=2, threads=4, messages=30, work_ms=30, gate=4242)
            for _ in range(2)
        ]
    ) as workers:
        open_when(2)
        reports = [child_report(proc) for proc in workers]

    # Then, as the holders themselves saw it, never more than two ran at once, and two did
    inside, peak = query(db_url, PROBE, (key,))[0]
    assert peak == 2
    assert inside == 0
    # and every message of both processes got a slot in the end, while others were
    # refused meanwhile: there was contention across the two processes
    assert [report["acquired"] for report in reports] == [30, 30]
    assert sum(report["refused"] for report in reports) >= 1
    entries = dict(query(db_url, ENTRIES_BY_PROCESS, (key,)))
    assert len(entries) == 2
    assert sum(entries.values()) == sum(report["acquired"] for report in reports)
    # and every slot was given back
    assert live_value(db_url, key) == 0


def test_a_window_limiter_admits_exactly_its_limit_across_two_processes(
    db_url: str, backend: PostgresRateLimiterBackend
) -> None:
    # Given two processes that each try 20 times, at once, under a limit of 5 a minute
    key = a_key("window")
    with start_gate(db_url, gate=4343) as open_when, children(
        [
            start_child("window-tries", url=db_url, key=key, limit=5, window_s=60, tries=20, gate=4343)
            for _ in range(2)
        ]
    ) as tryers:
        open_when(2)
        reports = [child_report(proc) for proc in tryers]

    # Then exactly five tries got through between them
    assert sum(report["acquired"] for report in reports) == 5
    # and this process, sharing the window, is refused too
    limiter = WindowRateLimiter(backend, key, limit=5, window=60)
    with limiter.acquire(raise_on_failure=False) as acquired:
        assert not acquired


@pytest.mark.parametrize("window_s", [1, 60])
def test_a_window_caller_whose_clock_reads_an_earlier_second_counts_what_a_later_one_admitted(
    backend: PostgresRateLimiterBackend, window_s: int
) -> None:
    # Given a limit of 5, all taken by a caller whose clock already read second T+1
    key, now = a_key("skew"), int(time.time())

    def buckets(second: int) -> list[str]:  # what Dramatiq's WindowRateLimiter asks for
        return [f"{key}@{second - back}" for back in range(window_s)]

    later, earlier = buckets(now + 1), buckets(now)
    assert [backend.incr_and_sum(later[0], lambda: later, 1, 5, window_s * 1000) for _ in range(5)] == [True] * 5
    # When a caller whose clock still reads T (the second turned between them, or its
    # host's clock is behind) tries
    admitted = backend.incr_and_sum(earlier[0], lambda: earlier, 1, 5, window_s * 1000)
    # Then it is refused: its own window holds none of the five, but it counts them
    assert admitted is False


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_window_limiter_admits_again_once_the_window_has_slid_past(
    backend: PostgresRateLimiterBackend,
) -> None:
    limiter = WindowRateLimiter(backend, a_key("sliding"), limit=1, window=2)
    first_second = int(time.time())
    with limiter.acquire(raise_on_failure=False) as first:
        assert first
    with limiter.acquire(raise_on_failure=False) as second:
        assert not second  # still inside the two-second window of the first

    def admitted() -> bool:
        with limiter.acquire(raise_on_failure=False) as acquired:
            return bool(acquired)

    eventually(admitted, timeout_s=6, what="the window sliding")
    assert int(time.time()) >= first_second + 2


def test_a_barrier_holds_other_processes_until_the_last_party_arrives(
    db_url: str, backend: PostgresRateLimiterBackend
) -> None:
    # Given a barrier of three parties, two of which wait in other processes
    key = a_key("barrier")
    barrier = Barrier(backend, key, ttl=MINUTE_MS)
    assert barrier.create(parties=3)
    waiter_app = f"waiter-{uuid.uuid4().hex[:12]}"
    with children(
        [start_child("barrier-wait", url=db_url, key=key, app=waiter_app, timeout_ms=30_000) for _ in range(2)]
    ) as waiters:
        eventually(lambda: live_value(db_url, key) == 1, what="both waiters arriving")
        eventually(lambda: listeners(db_url, waiter_app) == 2, what="both waiters listening")
        assert all(proc.poll() is None for proc in waiters)  # still held

        # When the third party arrives
        arrived_at = time.monotonic()
        assert barrier.wait(block=False) is True
        reports = [child_report(proc) for proc in waiters]
        released_within = time.monotonic() - arrived_at

    # Then both waiting processes pass, at once rather than at their 30 s timeout
    assert [report["passed"] for report in reports] == [True, True]
    assert released_within < 5


def test_a_barrier_wait_with_parties_missing_gives_up_after_its_timeout(
    backend: PostgresRateLimiterBackend,
) -> None:
    barrier = Barrier(backend, a_key("lonely"), ttl=MINUTE_MS)
    assert barrier.create(parties=2)

    started = time.monotonic()
    assert barrier.wait(block=True, timeout=300) is False
    assert 0.3 <= time.monotonic() - started < 5


def test_an_event_notified_before_anyone_waits_is_seen_at_once(backend: PostgresRateLimiterBackend) -> None:
    key = a_key("event")
    backend.wait_notify(key, MINUTE_MS)

    started = time.monotonic()
    assert backend.wait(key, 10_000) is True
    assert time.monotonic() - started < 2


def test_a_group_completion_callback_fires_exactly_once(db_url: str, backend: PostgresRateLimiterBackend) -> None:
    # Given a worker of four threads and a group of eight members with a completion callback
    run = a_key("group")
    broker = StubBroker()
    broker.add_middleware(GroupCallbacks(backend))
    broker.emit_after("process_boot")

    @dramatiq.actor(broker=broker)
    def member(n: int) -> None:
        query(db_url, RECORD_RUN, (run, "member"))

    @dramatiq.actor(broker=broker)
    def completed() -> None:
        query(db_url, RECORD_RUN, (run, "callback"))

    worker = dramatiq.Worker(broker, worker_threads=4, worker_timeout=50)
    worker.start()
    try:
        # When the group runs
        members = dramatiq.group([member.message(n) for n in range(8)], broker=broker)
        members.add_completion_callback(completed.message())
        members.run()
        broker.join(member.queue_name, timeout=10_000, fail_fast=True)
        worker.join()
    finally:
        worker.stop()
        broker.close()

    # Then the callback ran once, after every member
    runs = {kind: (count, last) for kind, count, last in query(db_url, RUNS, (run,))}
    assert runs["member"][0] == 8
    assert runs["callback"][0] == 1
    assert runs["callback"][1] >= runs["member"][1]


def test_pruning_deletes_expired_keys_batch_by_batch_and_keeps_live_ones(
    db_url: str, backend: PostgresRateLimiterBackend
) -> None:
    # Given five keys that have expired and one that has not
    query(db_url, "DELETE FROM standmeet.rate_limits")
    expired = [a_key("old") for _ in range(5)]
    for key in expired:
        assert backend.add(key, 1, 1)
    live = a_key("live")
    assert backend.add(live, 7, MINUTE_MS)
    eventually(lambda: all(scalar(db_url, IS_LIVE, (k,)) == 0 for k in expired), what="five keys expiring")

    # When the maintenance job prunes two at a time
    deleted = [prune_expired_once(db_url, batch=2) for _ in range(4)]

    # Then the expired rows went in batches of at most two, and the live key stayed
    assert deleted == [2, 2, 1, 0]
    assert scalar(db_url, COUNT_ROWS) == 1
    assert live_value(db_url, live) == 7


#: An expired key written straight to the table (``%s``: the key).
EXPIRED_KEY = "INSERT INTO standmeet.rate_limits (key, value, expires_at) VALUES (%s, 1, now() - interval '1 minute')"


def test_a_prune_deletes_no_more_than_its_batch_whatever_plan_the_statistics_lead_to(db_url: str) -> None:
    # Given nine expired keys, with statistics gathered while the table held one
    expired_rows_after_statistics_of_one(db_url, "standmeet.rate_limits", EXPIRED_KEY)

    # When one prune of two runs
    deleted = prune_expired_once(db_url, batch=2)

    # Then it deleted two, not every expired key
    assert (deleted, scalar(db_url, COUNT_ROWS)) == (2, 7)


def test_an_unreachable_database_is_reported_as_database_unavailable() -> None:
    backend = PostgresRateLimiterBackend(
        url="postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=1", checkout_timeout_ms=500
    )
    try:  # (what a caller waits on fails at once, whatever write_wait_s: an acquisition, a group's creation)
        with pytest.raises(DatabaseUnavailable) as raised:
            ConcurrentRateLimiter(backend, a_key("unreachable"), limit=1)._acquire()
        assert isinstance(raised.value.__cause__, psycopg.Error)
        with pytest.raises(DatabaseUnavailable):
            Barrier(backend, a_key("unreachable-group"), ttl=60_000).create(2)
    finally:
        backend.close()


def test_a_barrier_passed_during_an_outage_longer_than_the_checkout_timeout_counts_once_it_ends(
    db_url: str, backend: PostgresRateLimiterBackend, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a group of two (as GroupCallbacks makes it), one member done, and a backend
    # that reaches the database through a proxy that is cut, with a fifth of a second to
    # check a connection out
    key = a_key("group")
    assert Barrier(backend, key, ttl=60_000).create(2)
    assert not Barrier(backend, key, ttl=60_000).wait(block=False)
    proxy = PostgresProxy(db_url)
    through_proxy = PostgresRateLimiterBackend(url=proxy.url, checkout_timeout_ms=200)
    try:  # When the last member passes the barrier meanwhile
        released = written_through_an_outage(proxy, caplog,
                                             lambda: Barrier(through_proxy, key, ttl=60_000).wait(block=False),
                                             what="the barrier's increment")
    finally:
        proxy.close()
        through_proxy.close()
    # Then the barrier is released once the database is back, counted once
    assert released == [True]
    assert Barrier(backend, key, ttl=60_000).wait(block=True, timeout=1_000)
