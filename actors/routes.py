"""The routing table of the outbox: which actors each topic's events become.

One ``route(topic, actor, args)`` line per pair. ``args(event_id, payload)`` returns
the actor's ``(args, kwargs)``; it is also called at emit time, so a payload that
does not fit its route is refused before anything is written.
"""

from __future__ import annotations

from typing import Any

from broker.outbox import route


def _document(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (int(payload["document_id"]),), {}


#: A document was written → index it.
route("document.written", "corpus.index", _document)


def _rebuilt(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (int(payload["run_id"]), int(payload["documents"])), {}


#: An index rebuild completed → its subscribers, each a job of its own on the index queue.
route("index.rebuilt", "corpus.rebuilt", _rebuilt)


def _event(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (int(payload["event_id"]),), {}


#: A webhook event was stored → fan it out to the subscribed endpoints.
route("webhook.event", "webhook.fanout", _event)


def _notice(event_id: int, payload: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (str(payload["to"]), str(payload["name"]), str(payload["subject"]), str(payload["text"])), {}


#: Something an owner must hear about → a mail on the notify queue.
route("owner.notice", "owner.notify", _notice)
