"""Infrastructure of standmeet-jobs: settings, Postgres, the broker, threads.

``configure()`` builds the broker from the environment and makes it Dramatiq's
global broker; ``import actors`` calls it, so ``dramatiq actors`` just works.
"""

from __future__ import annotations

import logging

import dramatiq

from broker.embedded import resolve_database_url
from broker.enqueue import enqueue
from broker.errors import BudgetError, ConfigError, StandmeetError
from broker.outbox import emit
from broker.pgbroker import StandmeetBroker, current_broker
from broker.settings import Settings

__all__ = [
    "BudgetError",
    "ConfigError",
    "Settings",
    "StandmeetBroker",
    "StandmeetError",
    "configure",
    "current_broker",
    "emit",
    "enqueue",
]

logger = logging.getLogger(__name__)


def log_database(settings: Settings, url: str) -> None:
    """Say which database this process uses (password masked), and where an embedded one lives."""
    from broker.embedded import is_embedded
    from broker.settings import masked_url

    if not is_embedded(settings, url):
        logger.info("database: %s (DATABASE_URL)", masked_url(url))
    else:
        logger.info("database: %s, the embedded Postgres in %s; it keeps running after this process "
                    "until `standmeet-jobs db stop`", masked_url(url), settings.embedded_dir)


def configure(settings: Settings | None = None, *, url: str | None = None) -> StandmeetBroker:
    """Build the broker and make it the global one; actors declared before move over.

    ``url`` overrides the database; otherwise ``DATABASE_URL`` or the embedded server.
    """
    from middleware import default_middleware

    settings = settings or Settings.from_env()
    url = url or resolve_database_url(settings)
    log_database(settings, url)
    broker = StandmeetBroker(settings=settings, url=url, middleware=default_middleware(settings))
    previous = dramatiq.broker.global_broker
    if previous is not None and previous is not broker:
        for actor in list(previous.actors.values()):
            actor.broker = broker
            if actor.queue_name not in broker.queues:
                broker.declare_queue(actor.queue_name)
            broker.declare_actor(actor)
        if isinstance(previous, StandmeetBroker):
            previous.close()
    dramatiq.set_broker(broker)
    return broker
