"""One process's services, owned in one place: settings, pools, broker, relay, receipts.

    from broker import services
    services.current().settings       # resolved once, at configure()
    services.current().broker         # the Dramatiq broker (only a broker)
    services.current().app_pool       # the application's psycopg 3 pool (opened on first use)
    services.current().waiters        # receipt listeners: one LISTEN connection a channel
    services.current().start_relay()  # every worker process and scheduler runs one

``broker.configure()`` builds the services and installs them; closing the broker (at
the end of a worker, by Dramatiq's CLI or ours) closes them: the relay first, then the
listeners and the pool.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import dramatiq

from broker.errors import ConfigError
from broker.settings import Settings

if TYPE_CHECKING:  # the lookup every part uses imports none of them: configure() gives it its factories
    from psycopg_pool import ConnectionPool

    from broker.engine.broker import StandmeetBroker
    from broker.outbox import Relay
    from broker.outbox.receipts import Waiters


class Services:
    """What every part of one process shares."""

    def __init__(self, *, settings: Settings, url: str, broker: StandmeetBroker,
                 open_app_pool: Callable[[], ConnectionPool], open_waiters: Callable[[], Waiters],
                 start_relay: Callable[[], Relay]) -> None:
        self.settings = settings
        self.url = url
        self.broker = broker
        self._open_app_pool = open_app_pool
        self._open_waiters = open_waiters
        self._start_relay = start_relay
        self._lock = threading.Lock()
        self._app_pool: ConnectionPool | None = None
        self._waiters: Waiters | None = None
        self.relay: Relay | None = None
        broker.on_close(self.close)

    @property
    def app_pool(self) -> ConnectionPool:
        """The application's psycopg 3 pool, opened on first use."""
        with self._lock:
            if self._app_pool is None:
                self._app_pool = self._open_app_pool()
            return self._app_pool

    @property
    def waiters(self) -> Waiters:
        """This process's receipt listeners and waiters (one LISTEN connection a channel)."""
        with self._lock:
            if self._waiters is None:
                self._waiters = self._open_waiters()
            return self._waiters

    def start_relay(self) -> None:
        """Run the outbox relay in this process (every worker process runs one)."""
        with self._lock:
            if self.relay is None:
                self.relay = self._start_relay()

    def stop_relay(self) -> None:
        """Stop the relay first on shutdown: no new messages from this process."""
        with self._lock:
            relay, self.relay = self.relay, None
        if relay is not None:
            relay.stop()

    def close(self) -> None:
        self.stop_relay()
        with self._lock:
            waiters, self._waiters = self._waiters, None
            pool, self._app_pool = self._app_pool, None
        if waiters is not None:
            waiters.close()
        if pool is not None:
            pool.close(timeout=1.0)  # a job still running past shutdown keeps its own


_current: Services | None = None


def install(services: Services) -> Services:
    global _current
    _current = services
    return services


def current() -> Services:
    """This process's services; a clear error if ``broker.configure()`` was not called."""
    if _current is None:
        raise ConfigError("the broker is not configured: import actors, or call broker.configure()")
    return _current


def make_global(broker: dramatiq.Broker) -> dramatiq.Broker | None:
    """Make ``broker`` Dramatiq's global broker: the actors declared on the previous one
    (``@dramatiq.actor`` binds an actor to the global broker of the moment) move over, with
    their queues. Returns the previous broker (None, or ``broker`` itself)."""
    previous = dramatiq.broker.global_broker
    if previous is not None and previous is not broker:
        for actor in list(previous.actors.values()):
            actor.broker = broker
            if actor.queue_name not in broker.queues:
                broker.declare_queue(actor.queue_name)
            broker.declare_actor(actor)
    dramatiq.set_broker(broker)
    return previous


def installed() -> Services | None:
    return _current


def current_broker() -> StandmeetBroker:
    """The configured broker (``current().broker``); a clear error if ``broker.configure()``
    was not called."""
    return current().broker


__all__ = ["Services", "current", "current_broker", "install", "installed", "make_global"]
