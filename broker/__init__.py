"""Infrastructure of standmeet-jobs: settings, Postgres, the broker, threads.

``configure()`` builds the broker from the environment and makes it Dramatiq's
global broker; ``import actors`` calls it, so ``dramatiq actors`` just works.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported on first use (below): `standmeet-jobs --help` loads none of them
    import dramatiq
    import psycopg

    from broker.backends.rate_limits import PostgresRateLimiterBackend
    from broker.backends.results import PostgresResultBackend
    from broker.engine.broker import StandmeetBroker
    from broker.engine.enqueue import enqueue, enqueue_async
    from broker.engine.unique import UniqueBy
    from broker.errors import BudgetError, ConfigError, StandmeetError
    from broker.outbox.routes import emit, emit_async
    from broker.services import current_broker
    from broker.settings import Settings

#: Where each public name lives: imported the first time it is asked for, so that
#: importing ``broker`` (every command does) costs nothing until the broker is used.
_PUBLIC = {
    "BudgetError": "broker.errors", "ConfigError": "broker.errors", "StandmeetError": "broker.errors",
    "PostgresRateLimiterBackend": "broker.backends.rate_limits", "PostgresResultBackend": "broker.backends.results",
    "Settings": "broker.settings", "StandmeetBroker": "broker.engine.broker", "UniqueBy": "broker.engine.unique",
    "current_broker": "broker.services", "emit": "broker.outbox.routes", "emit_async": "broker.outbox.routes",
    "enqueue": "broker.engine.enqueue", "enqueue_async": "broker.engine.enqueue",
}


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        if name.startswith("_") or importlib.util.find_spec(f"broker.{name}") is None:
            raise AttributeError(f"module 'broker' has no attribute {name!r}")
        return importlib.import_module(f"broker.{name}")  # a submodule (``broker.ops``)
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


__all__ = [
    "BudgetError",
    "ConfigError",
    "PostgresRateLimiterBackend",
    "PostgresResultBackend",
    "Settings",
    "StandmeetBroker",
    "StandmeetError",
    "UniqueBy",
    "configure",
    "current_broker",
    "emit",
    "emit_async",
    "enqueue",
    "enqueue_async",
    "enqueue_many",
]

logger = logging.getLogger(f"standmeet.{__name__}")


def enqueue_many(messages: Sequence[dramatiq.Message], *, conn: psycopg.Connection[Any] | None = None,
                 delay_ms: int | None = None) -> list[dramatiq.Message]:
    """Enqueue many Dramatiq messages in one statement, due after ``delay_ms``.

    With ``conn``, they are written in the caller's transaction (woken at its commit);
    without, on the broker's own connection. A message whose unique key is live (or taken
    by an earlier message of the batch) is not written: the live message stands in its
    place in the list returned.
    """
    from broker.services import current_broker

    return current_broker().enqueue_many(messages, conn=conn, delay=delay_ms)


_logged_databases: set[str] = set()


def log_database(settings: Settings, url: str) -> None:
    """Say which database this process uses (password masked), and where an embedded one
    lives: once per process and database, however many parts of it ask."""
    from broker.pg.embedded import is_embedded
    from broker.settings import masked_url

    if url in _logged_databases:
        return
    _logged_databases.add(url)
    if not is_embedded(settings, url):
        logger.info("database: %s (DATABASE_URL)", masked_url(url))
    else:
        logger.info("database: %s, the embedded Postgres in %s; it keeps running after this process "
                    "until `standmeet-jobs db stop`", masked_url(url), settings.embedded_dir)


def configure(settings: Settings | None = None, *, url: str | None = None) -> StandmeetBroker:
    """Build the broker and make it the global one; actors declared before move over.

    ``url`` overrides the database; otherwise ``DATABASE_URL`` or the embedded server.
    """
    from broker import maintenance, services
    from broker.backends.rate_limits import PostgresRateLimiterBackend
    from broker.backends.results import PostgresResultBackend
    from broker.engine.broker import StandmeetBroker
    from broker.outbox import Relay
    from broker.outbox.receipts import Waiters
    from broker.pg import pool as pgpool
    from broker.pg.budget import BACKEND_POOL_CONNECTIONS
    from broker.pg.embedded import resolve_database_url
    from broker.pg.pool import open_app_pool
    from broker.settings import Settings
    from middleware import default_middleware

    settings = settings or Settings.from_env()
    url = url or resolve_database_url(settings)
    log_database(settings, url)
    pgpool.use_settings(settings)
    # found out once, before any connection is made, and said: what it implies for LISTEN,
    # prepared statements and session state
    logger.info("database connection: %s", pgpool.topology_for(url).describe())
    results = PostgresResultBackend(url=url, pool_max_size=BACKEND_POOL_CONNECTIONS)
    rate_limiter = PostgresRateLimiterBackend(url=url, pool_max_size=BACKEND_POOL_CONNECTIONS)
    broker = StandmeetBroker(settings=settings, url=url, backends=(results, rate_limiter),
                             middleware=default_middleware(settings, results=results, rate_limiter=rate_limiter))
    previous = services.make_global(broker)  # actors declared before move over
    if isinstance(previous, StandmeetBroker) and previous is not broker:
        previous.close()
    services.install(services.Services(
        settings=settings, url=url, broker=broker,
        open_app_pool=lambda: open_app_pool(url, max_size=settings.pool_max_size),
        open_waiters=lambda: Waiters(url, max_waiters=settings.max_waiters),
        start_relay=lambda: Relay(url, batch=settings.relay_batch, poll_s=settings.relay_poll_s,
                                  outage=broker.outage).start()))
    maintenance.declare(broker)  # the runtime's own jobs, on every broker
    return broker
