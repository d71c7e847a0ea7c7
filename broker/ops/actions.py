"""The audit trail of operators' actions, and the unique sends skipped."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime
from typing import Any

import psycopg

from broker.ops.common import _by, _Row, jsonable


@dataclasses.dataclass(frozen=True)
class OperatorAction(_Row):
    id: int
    at: datetime
    action: str
    target: Any
    affected: int | None
    by: str
    source: str


RECORD_ACTION = """
INSERT INTO standmeet.operator_actions (action, target, affected, by_whom, source)
VALUES (%(action)s, %(target)s::jsonb, %(affected)s, %(by)s, %(source)s)
RETURNING id
"""

LIST_ACTIONS = """
SELECT id, at, action, target, affected, by_whom, source
FROM standmeet.operator_actions
ORDER BY at DESC, id DESC
LIMIT %(limit)s
"""


def record_action(conn: psycopg.Connection[Any], *, action: str, target: Any, by: str, source: str,
                  affected: int | None = None) -> int:
    """Record what an operator did (``action``: e.g. ``jobs.retry``), to what (``target``:
    JSON, e.g. ``{"message_ids": [...]}`` or a filter), who (``by``) and from where
    (``source``: ``cli``, or the dashboard's client address); returns the record's id."""
    row = conn.execute(RECORD_ACTION, {
        "action": action, "target": json.dumps(jsonable(target)), "affected": affected,
        "by": _by(by), "source": source,
    }).fetchone()
    assert row is not None
    return int(row[0])


@dataclasses.dataclass(frozen=True)
class UniqueSkips(_Row):
    """Sends of a unique actor skipped because a live message held their key."""

    queue: str
    actor: str
    skipped: int
    last_skipped_at: datetime


#: Every actor's count of skipped unique sends, the most recent first.
UNIQUE_SKIPS = """
SELECT queue_name, actor_name, skipped, last_skipped_at FROM standmeet.unique_skips
ORDER BY last_skipped_at DESC LIMIT %(limit)s
"""


def unique_skips(conn: psycopg.Connection[Any], *, limit: int = 50) -> list[UniqueSkips]:
    """How many sends of each unique actor were skipped (a live message held the key)."""
    return [UniqueSkips(q, a, int(n), at) for q, a, n, at in conn.execute(UNIQUE_SKIPS, {"limit": limit}).fetchall()]


def recent_actions(conn: psycopg.Connection[Any], *, limit: int = 50) -> list[OperatorAction]:
    return [OperatorAction(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6])
            for r in conn.execute(LIST_ACTIONS, {"limit": limit}).fetchall()]
