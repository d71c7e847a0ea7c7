"""Jobs written straight into the broker's table, in the states operators' commands read:
no worker needed, and each test picks its own queue (and, where it matters, its ids)."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

from dramatiq.message import Message

from broker.engine import sql_enqueue
from broker.engine.codec import enqueue_params
from tests.support.db import query

#: Reject rows as the broker does: state, reason, when.
REJECT = "UPDATE dramatiq.queue SET \"state\" = 'rejected', error = %s, mtime = now() WHERE message_id = ANY(%s::uuid[])"
DELETE_QUEUE = "DELETE FROM dramatiq.queue WHERE queue_name = %s"


def put_jobs(url: str, queue: str, count: int = 1, *, actor: str = "job_rows.none", ids: Sequence[str] = (),
             args: Sequence[Any] = (), options: dict[str, Any] | None = None, delay_ms: int | None = None,
             rejected_with: str | None = None) -> list[str]:
    """``count`` jobs of ``queue`` (or one per id of ``ids``), queued (due after
    ``delay_ms``), or rejected with the error ``rejected_with``; their ids."""
    ids = list(ids) or [str(uuid.uuid4()) for _ in range(count)]
    messages = [Message(queue_name=queue, actor_name=actor, args=tuple(args), kwargs={}, options=dict(options or {}),
                        message_id=i) for i in ids]
    query(url, sql_enqueue.ENQUEUE, enqueue_params(messages, delay=delay_ms))
    if rejected_with is not None:
        query(url, REJECT, (rejected_with, ids))
    return ids


def drop_queue(url: str, queue: str) -> None:
    query(url, DELETE_QUEUE, (queue,))
