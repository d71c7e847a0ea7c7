"""Unique jobs: at most one live message per key (River's and Oban's semantics).

    @dramatiq.actor(unique=True)                        # key: the actor and its arguments
    def rebuild(doc_id): ...

    @dramatiq.actor(unique=UniqueBy(period_s=3600))     # also done within the hour
    def digest(user_id): ...

    rebuild.send_with_options(args=(17,), unique_key="doc-17")   # a key of the sender's own

A send whose key a message of the same actor holds — queued (a delayed message is a queued
one due later), running, or with a period, done within it — is not written; the send
returns the live message, whose ``message_id`` ``get_result`` waits on. The database
decides (a partial unique index, migration 0021), so it holds for any number of
processes sending at once, for ``enqueue(conn, …)`` in a caller's transaction,
``enqueue_many`` and the outbox relay. A retry or a snooze keeps its own row and key, so
it is never blocked by itself. A key frees when its message is done (unless done is
covered within its period) or rejected.

The broker applies keys when it writes; this middleware declares the actor option and
refuses, when an actor is declared, a ``unique`` value that is neither true, false nor
a :class:`UniqueBy`.

The keys are the engine's (:mod:`broker.engine.unique`, which holds no database code), so
the memory broker of ``broker.testing`` forms the same ones.
"""

from __future__ import annotations

from typing import Any

from dramatiq.middleware import Middleware

from broker.engine.unique import UniqueBy, unique_of
from broker.errors import ConfigError, StartupRefused

__all__ = ["UniqueBy", "UniqueJobs"]


class UniqueJobs(Middleware):
    """Declares the ``unique`` actor option (``True`` or a :class:`UniqueBy`)."""

    @property
    def actor_options(self) -> set[str]:
        return {"unique"}

    def before_declare_actor(self, broker: Any, actor: Any) -> None:
        option = actor.options.get("unique")
        if option is None or option is True or option is False:
            return  # nothing to check (what ``unique_of`` would accept at once)
        try:
            unique_of(actor)
        except ConfigError as exc:  # a MiddlewareError: Dramatiq lets it stop the declaration
            raise StartupRefused(str(exc)) from None
