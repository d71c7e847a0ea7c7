"""Fixtures: a real Postgres, a fresh database per test module, in-process workers."""

from __future__ import annotations

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

#: Settings every test broker uses: quick heartbeats so rescue is testable in seconds.
TEST_OVERRIDES = {"heartbeat_s": 0.5, "rescue_after_s": 3.0, "min_backoff_ms": 10, "max_backoff_ms": 200}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Acceptance tests (real processes and signals) are slow: ``-m "not slow"`` skips them."""
    for item in items:
        if "acceptance" in item.path.parts:
            item.add_marker(pytest.mark.slow)


def pytest_configure(config: pytest.Config) -> None:
    logging.getLogger("dramatiq").setLevel(logging.WARNING)


@pytest.fixture(scope="session")
def admin_url() -> str:
    return testdb.server_url()


@pytest.fixture(scope="session")
def template_db(admin_url: str) -> Iterator[str]:
    name = testdb.unique_name("smt_template")
    testdb.create_template(admin_url, name)
    yield name
    testdb.drop_database(admin_url, name)


@pytest.fixture(scope="module")
def database_url(admin_url: str, template_db: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, migrated database for this test module, dropped after it."""
    module = request.module.__name__.rsplit(".", 1)[-1][:20]
    name = testdb.unique_name(f"smt_{module}")
    url = testdb.clone(admin_url, template_db, name)
    yield url
    testdb.drop_database(admin_url, name)


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
