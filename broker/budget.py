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

from broker.errors import BudgetError, StartupRefused
from broker.settings import RELAY_CONNECTIONS, Settings


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
    """Return the budget when it holds; raise :class:`BudgetError` naming every term."""
    budget = compute_budget(settings, queues)
    if budget.total > budget.limit:
        raise BudgetError(
            "refusing to start: the connection budget is exceeded: "
            + budget.describe()
            + ". Lower a queue's STANDMEET_QUEUE_<QUEUE>_MAX_WORKERS or raise STANDMEET_POOL_MAX_SIZE."
        )
    webhook_limit = settings.queue("webhook").time_limit_s
    if not settings.webhook_http_timeout_s < webhook_limit < settings.webhook_lease_s:
        raise StartupRefused(
            "refusing to start: webhook timings must be HTTP timeout < job limit < endpoint lease "
            f"(STANDMEET_WEBHOOK_HTTP_TIMEOUT_S={settings.webhook_http_timeout_s:g} < "
            f"STANDMEET_QUEUE_WEBHOOK_TIME_LIMIT_S={webhook_limit:g} < STANDMEET_WEBHOOK_LEASE_S="
            f"{settings.webhook_lease_s:g}), so a slow endpoint times out before its job is killed "
            "and a dead worker's lease expires by itself"
        )
    return budget
