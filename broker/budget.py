"""The start-up connection budget.

A process may use at most half of the application pool for background work: the
sum of the max workers of the queues it serves, plus the relay. The other half is
for web requests. A configuration that breaks this fails at boot, never as
queueing in production.

The broker's own connections are counted beside it, from the queues the process
really serves: one per consumer (its LISTEN and claims), one for the settler, and the
small pool for sends, heartbeats and rescue (``STANDMEET_BROKER_ACK_CONNECTIONS``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from broker import app
from broker.errors import BudgetError
from broker.settings import RELAY_CONNECTIONS, Settings, warn_undeclared


@dataclass(frozen=True)
class Budget:
    """What a process will use, term by term, and what it may use."""

    terms: tuple[tuple[str, int], ...]
    limit: int
    pool_max_size: int
    broker_pool_size: int
    consumers: int

    @property
    def total(self) -> int:
        return sum(n for _, n in self.terms)

    def describe(self) -> str:
        parts = " + ".join(f"{name} {n}" for name, n in self.terms)
        return (
            f"{parts} = {self.total} connections; the limit is half the application pool "
            f"(STANDMEET_POOL_MAX_SIZE={self.pool_max_size}) = {self.limit}"
        )


def broker_pool_size(settings: Settings, consumers: int) -> int:
    """The broker's connections: one per consumer, the settler's, and the send pool."""
    return consumers + 1 + settings.broker_ack_connections


def compute_budget(settings: Settings, queues: Iterable[str] | None = None) -> Budget:
    names = list(queues) if queues is not None else list(settings.queues)
    terms = [(f"{name}.max_workers", settings.queue(name).max_workers) for name in names]
    terms.append(("relay", RELAY_CONNECTIONS))
    return Budget(
        terms=tuple(terms),
        limit=settings.pool_max_size // 2,
        pool_max_size=settings.pool_max_size,
        broker_pool_size=broker_pool_size(settings, len(names)),
        consumers=len(names),
    )


def check_budget(settings: Settings, queues: Iterable[str] | None = None) -> Budget:
    """Return the budget when it holds; raise :class:`BudgetError` naming every term.

    Also runs the start-up checks the loaded modules declared (``broker.app.startup_check``),
    which raise :class:`broker.errors.StartupRefused` naming the variables."""
    budget = compute_budget(settings, queues)
    if budget.total > budget.limit:
        raise BudgetError(
            "refusing to start: the connection budget is exceeded: "
            + budget.describe()
            + ". Lower a queue's STANDMEET_QUEUE_<QUEUE>_MAX_WORKERS or raise STANDMEET_POOL_MAX_SIZE."
        )
    app.run_startup_checks(settings)  # what the loaded modules declared
    warn_undeclared()  # a misspelt STANDMEET_ variable, named with the nearest declared one
    return budget
