"""The Postgres result backend, against a real database, a Dramatiq worker and real processes."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Iterator

import dramatiq
import psycopg
import pytest
from dramatiq.brokers.stub import StubBroker
from dramatiq.message import Message
from dramatiq.results import ResultFailure, ResultMissing, Results, ResultTimeout
from psycopg_pool import ConnectionPool

from tests.integration.backends_support import (
    apply_migration,
    child_report,
    children,
    eventually,
    expired_rows_after_statistics_of_one,
    fresh_database,
    listeners,
    query,
    read_since_listening,
    scalar,
    start_child,
    written_through_an_outage,
)

# isort: split
# (the support module prepares the ``broker`` package's import, so it comes first)
from broker.backends.results import RESULTS_CHANNEL, PostgresResultBackend, prune_expired_once
from broker.errors import DatabaseUnavailable
from tests.support.proxy import PostgresProxy

COUNT_ROWS = "SELECT count(*) FROM standmeet.results"
COUNT_KEY = "SELECT count(*) FROM standmeet.results WHERE message_key = %s"
WRITE_WITHOUT_NOTIFY = """
INSERT INTO standmeet.results (message_key, value, expires_at)
VALUES (%s, %s, now() + interval '1 minute')
"""
NOTIFY = "SELECT pg_notify(%s, %s)"
KILL_LISTENERS = """
SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = %s
"""


@pytest.fixture(scope="module")
def db_url() -> Iterator[str]:
    with fresh_database() as url:
        yield url


@pytest.fixture
def app_name() -> str:
    return f"results-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def backend(db_url: str, app_name: str) -> Iterator[PostgresResultBackend]:
    backend = PostgresResultBackend(url=db_url, application_name=app_name)
    yield backend
    backend.close()


@pytest.fixture
def stub_broker(backend: PostgresResultBackend) -> Iterator[StubBroker]:
    broker = StubBroker()
    broker.add_middleware(Results(backend=backend))
    broker.emit_after("process_boot")
    yield broker
    broker.flush_all()
    broker.close()


@pytest.fixture
def worker(stub_broker: StubBroker) -> Iterator[dramatiq.Worker]:
    worker = dramatiq.Worker(stub_broker, worker_threads=2, worker_timeout=50)
    worker.start()
    yield worker
    worker.stop()


def a_message(actor_name: str = "nobody") -> Message[object]:
    return Message(queue_name="default", actor_name=actor_name, args=(), kwargs={}, options={})


def test_an_actors_return_value_is_stored_and_read_back(
    stub_broker: StubBroker, worker: dramatiq.Worker, backend: PostgresResultBackend
) -> None:
    @dramatiq.actor(broker=stub_broker, store_results=True)
    def add(x: int, y: int) -> int:
        return x + y

    message = add.send(2, 3)

    assert message.get_result(backend=backend, block=True, timeout=10_000) == 5
    assert message.get_result(backend=backend) == 5  # and it stays readable


def test_reading_a_result_nobody_stored_raises_result_missing(backend: PostgresResultBackend) -> None:
    with pytest.raises(ResultMissing):
        backend.get_result(a_message())


def test_an_actor_that_failed_comes_back_as_result_failure_with_its_original_type_and_message(
    stub_broker: StubBroker, worker: dramatiq.Worker, backend: PostgresResultBackend
) -> None:
    @dramatiq.actor(broker=stub_broker, store_results=True, max_retries=0)
    def refuse(n: int) -> None:
        raise ValueError(f"bad input {n}")

    message = refuse.send(7)

    with pytest.raises(ResultFailure) as failure:
        message.get_result(backend=backend, block=True, timeout=10_000)
    assert failure.value.orig_exc_type == "ValueError"
    assert failure.value.orig_exc_msg == "bad input 7"
    assert str(failure.value) == "actor raised ValueError: bad input 7"


def test_a_blocking_read_with_nothing_stored_times_out_after_its_timeout(
    backend: PostgresResultBackend,
) -> None:
    started = time.monotonic()
    with pytest.raises(ResultTimeout):
        backend.get_result(a_message(), block=True, timeout=300)
    waited = time.monotonic() - started
    assert 0.3 <= waited < 5


def test_a_result_is_missing_once_its_ttl_has_passed_though_its_row_is_still_there(
    db_url: str, backend: PostgresResultBackend
) -> None:
    message = a_message()
    backend.store_result(message, {"answer": 42}, 300)
    assert backend.get_result(message) == {"answer": 42}

    eventually(lambda: _missing(backend, message), timeout_s=10, what="the result expiring")

    key = backend.build_message_key(message)
    assert scalar(db_url, COUNT_KEY, (key,)) == 1  # expired by the clock, not yet pruned


def test_a_result_stored_with_no_ttl_is_kept_as_dramatiqs_redis_backend_keeps_it(
    db_url: str, backend: PostgresResultBackend
) -> None:
    # (Dramatiq passes a message's ``result_ttl=None`` through to the backend as it is)
    message = a_message()
    backend.store_result(message, {"answer": 42}, None)  # type: ignore[arg-type]
    assert backend.get_result(message) == {"answer": 42}
    key = backend.build_message_key(message)
    assert scalar(db_url, "SELECT expires_at = 'infinity' FROM standmeet.results WHERE message_key = %s", (key,))


def test_pruning_deletes_expired_results_batch_by_batch_and_keeps_live_ones(
    db_url: str, backend: PostgresResultBackend
) -> None:
    # Given five results that have expired and one that has not
    query(db_url, "DELETE FROM standmeet.results")
    expired = [a_message() for _ in range(5)]
    for message in expired:
        backend.store_result(message, "old", 1)
    live = a_message()
    backend.store_result(live, "fresh", 60_000)
    eventually(lambda: all(_missing(backend, m) for m in expired), what="five results expiring")

    # When the maintenance job prunes two at a time
    deleted = [prune_expired_once(db_url, batch=2) for _ in range(4)]

    # Then every expired row went, in batches of at most two, and the live one stayed
    assert deleted == [2, 2, 1, 0]
    assert scalar(db_url, COUNT_ROWS) == 1
    assert backend.get_result(live) == "fresh"


#: An expired result written straight to the table (``%s``: its key).
EXPIRED_RESULT = "INSERT INTO standmeet.results (message_key, value, expires_at) VALUES (%s, '', now() - interval '1 minute')"


def test_a_prune_deletes_no_more_than_its_batch_whatever_plan_the_statistics_lead_to(db_url: str) -> None:
    # Given nine expired results, with statistics gathered while the table held one
    expired_rows_after_statistics_of_one(db_url, "standmeet.results", EXPIRED_RESULT)

    # When one prune of two runs
    deleted = prune_expired_once(db_url, batch=2)

    # Then it deleted two, not every expired row
    assert (deleted, scalar(db_url, COUNT_ROWS)) == (2, 7)


def test_pruning_on_a_connection_in_a_transaction_commits_what_it_deleted(
    db_url: str, backend: PostgresResultBackend
) -> None:
    query(db_url, "DELETE FROM standmeet.results")
    message = a_message()
    backend.store_result(message, "old", 1)
    eventually(lambda: _missing(backend, message), what="the result expiring")

    with psycopg.connect(db_url) as conn:  # not autocommit
        assert prune_expired_once(conn, batch=10) == 1

    assert scalar(db_url, COUNT_ROWS) == 0


def test_a_process_blocked_on_get_result_is_woken_by_a_result_an_actor_stored_in_another(
    db_url: str, stub_broker: StubBroker, worker: dramatiq.Worker
) -> None:
    @dramatiq.actor(broker=stub_broker, store_results=True)
    def multiply(x: int, y: int) -> int:
        return x * y

    # Given another process blocked on the result of a message not sent yet
    message = multiply.message(6, 7)
    reader_app = f"reader-{uuid.uuid4().hex[:12]}"
    with children(
        [start_child("wait-result", url=db_url, app=reader_app, message=message.encode().decode(), timeout_ms=30_000)]
    ) as (reader,):
        eventually(lambda: read_since_listening(db_url, reader_app, "standmeet.results"),
                   what="the reader waiting on its LISTEN connection")

        # When this process's worker runs the message and stores its result
        sent_at = time.time()
        stub_broker.enqueue(message)
        report = child_report(reader)

    # Then the reader got the result at once, long before its 30 s timeout
    assert report["result"] == 42
    assert report["woke_at"] - sent_at < 2.0


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_blocked_reader_does_not_poll_it_sleeps_until_a_notification(db_url: str) -> None:
    # Given another process blocked on a result, asleep on its LISTEN connection
    message = a_message("silent")
    writer = PostgresResultBackend(url=db_url, application_name=f"writer-{uuid.uuid4().hex[:12]}")
    key = writer.build_message_key(message)
    reader_app = f"reader-{uuid.uuid4().hex[:12]}"
    with children(
        [start_child("wait-result", url=db_url, app=reader_app, message=message.encode().decode(), timeout_ms=30_000)]
    ) as (reader,):
        eventually(lambda: read_since_listening(db_url, reader_app, "standmeet.results"),
                   what="the reader waiting on its LISTEN connection")

        # When the result row appears without a notification, the reader keeps sleeping
        query(db_url, WRITE_WITHOUT_NOTIFY, (key, writer.encoder.encode({"note": "written quietly"})))
        with pytest.raises(subprocess.TimeoutExpired):
            reader.wait(timeout=1.5)

        # And when the notification for its key comes, it wakes and reads the row
        query(db_url, NOTIFY, (RESULTS_CHANNEL, key))
        report = child_report(reader, timeout_s=10)
    writer.close()

    assert report["result"] == {"note": "written quietly"}
    assert report["waited_s"] < 25


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_result_stored_while_the_readers_listen_connection_was_down_still_wakes_it(
    db_url: str, backend: PostgresResultBackend
) -> None:
    # Given another process blocked on a result, asleep on its LISTEN connection
    message = a_message("outage")
    reader_app = f"reader-{uuid.uuid4().hex[:12]}"
    with children(
        [start_child("wait-result", url=db_url, app=reader_app, message=message.encode().decode(), timeout_ms=30_000)]
    ) as (reader,):
        eventually(lambda: read_since_listening(db_url, reader_app, "standmeet.results"),
                   what="the reader waiting on its LISTEN connection")

        # When its LISTEN connection is killed and the result is stored before it is back
        assert scalar(db_url, KILL_LISTENERS, (f"{reader_app}-listen",)) == 1
        backend.store_result(message, "stored during the outage", 60_000)
        report = child_report(reader, timeout_s=20)

    # Then the reader reconnects, looks again and finds it, well before its timeout
    assert report["result"] == "stored during the outage"
    assert report["waited_s"] < 15


def test_one_backend_waits_on_one_listen_connection_however_often_it_blocks(
    db_url: str, app_name: str, backend: PostgresResultBackend
) -> None:
    for _ in range(3):
        with pytest.raises(ResultTimeout):
            backend.get_result(a_message(), block=True, timeout=100)
    stored = a_message()
    backend.store_result(stored, "here", 60_000)
    assert backend.get_result(stored, block=True, timeout=1_000) == "here"

    assert listeners(db_url, app_name) == 1

    backend.close()
    eventually(lambda: listeners(db_url, app_name) == 0, what="the LISTEN connection closing")


def test_a_backend_that_only_stores_opens_no_listen_connection(
    db_url: str, app_name: str, backend: PostgresResultBackend
) -> None:
    backend.store_result(a_message(), "fire and forget", 60_000)

    assert listeners(db_url, app_name) == 0


def test_a_given_pool_is_used_as_it_is_and_left_open(db_url: str) -> None:
    # Given the application's pool, whose connections are not autocommit
    app_name = f"given-{uuid.uuid4().hex[:12]}"
    with ConnectionPool(db_url, min_size=0, max_size=2, kwargs={"application_name": app_name}) as pool:
        backend = PostgresResultBackend(pool=pool, application_name=app_name)
        message = a_message()

        # When a result is stored and read back through it
        backend.store_result(message, "through the app pool", 60_000)
        read_back = backend.get_result(message, block=True, timeout=1_000)
        eventually(lambda: listeners(db_url, app_name) == 1, what="the LISTEN connection opening")
        backend.close()

        # Then the write was committed, the LISTEN connection came from the pool's URL,
        # and closing the backend left the pool open
        assert read_back == "through the app pool"
        assert scalar(db_url, COUNT_KEY, (backend.build_message_key(message),)) == 1
        assert not pool.closed
        with pool.connection() as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)


def test_an_unreachable_database_is_reported_as_database_unavailable() -> None:
    backend = PostgresResultBackend(
        url="postgresql://postgres@127.0.0.1:1/postgres?connect_timeout=1", checkout_timeout_ms=500, store_wait_s=0
    )
    try:
        with pytest.raises(DatabaseUnavailable) as raised:
            backend.get_result(a_message())
        assert isinstance(raised.value.__cause__, psycopg.Error)
        with pytest.raises(DatabaseUnavailable) as raised:
            backend.store_result(a_message(), "given up at once", 60_000)
        assert isinstance(raised.value.__cause__, psycopg.Error)
    finally:
        backend.close()


def test_a_result_stored_during_an_outage_longer_than_the_checkout_timeout_is_written_once_it_ends(
    db_url: str, backend: PostgresResultBackend, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a backend reaching the database through a proxy that is cut, with a checkout
    # timeout of a fifth of a second
    proxy = PostgresProxy(db_url)
    through_proxy = PostgresResultBackend(url=proxy.url, checkout_timeout_ms=200)
    message = a_message("outage-store")
    try:  # When a run's result is stored meanwhile (as Dramatiq's Results middleware does)
        stored = written_through_an_outage(
            proxy, caplog, lambda: through_proxy.store_result(message, "kept through the outage", 60_000),
            what="the store")
    finally:
        proxy.close()
        through_proxy.close()
    # Then the store returns once the database is back, and the result is there to read
    assert stored == [None]
    assert backend.get_result(message) == "kept through the outage"


def test_a_store_on_a_given_pool_the_application_closed_fails_at_once(db_url: str) -> None:
    # Given a backend on the application's pool, which the application has closed (shutting down)
    pool = ConnectionPool(db_url, min_size=1, max_size=1, open=True)
    backend = PostgresResultBackend(pool=pool, checkout_timeout_ms=200)
    pool.close()
    # When a result is stored: it is not waited for (no try will ever get a connection)
    started = time.monotonic()
    with pytest.raises(DatabaseUnavailable):
        backend.store_result(a_message("closed-pool"), "never written", 60_000)
    assert time.monotonic() - started < 5
    backend.close()



def test_the_migration_can_be_applied_again_without_harm(db_url: str, backend: PostgresResultBackend) -> None:
    message = a_message()
    backend.store_result(message, "kept", 60_000)

    apply_migration(db_url)

    assert backend.get_result(message) == "kept"


def _missing(backend: PostgresResultBackend, message: Message[object]) -> bool:
    try:
        backend.get_result(message)
    except ResultMissing:
        return True
    return False
