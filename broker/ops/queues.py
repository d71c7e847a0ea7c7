"""Queues: pause and resume (every process's claim skips a paused queue)."""

from __future__ import annotations

from typing import Any

import psycopg

from broker.ops.common import _by, _queue_name

#: Pause a queue and wake its consumers (their claim skips a paused queue).
PAUSE_QUEUE = """
WITH paused AS (
    INSERT INTO standmeet.queue_pauses (queue_name, paused_by) VALUES (%(queue)s, %(by)s)
    ON CONFLICT (queue_name) DO NOTHING
    RETURNING queue_name
)
SELECT count(*), pg_notify(standmeet.enqueue_channel(%(queue)s), '') FROM paused
"""

#: Resume a queue and wake its consumers at once (not at their next poll).
RESUME_QUEUE = """
WITH resumed AS (
    DELETE FROM standmeet.queue_pauses WHERE queue_name = %(queue)s RETURNING queue_name
)
SELECT count(*), pg_notify(standmeet.enqueue_channel(%(queue)s), '') FROM resumed
"""
#: Whether any job (of any age) names the queue.
QUEUE_HAS_JOBS = "SELECT EXISTS (SELECT 1 FROM dramatiq.queue WHERE queue_name = %(queue)s)"


def pause_queue(conn: psycopg.Connection[Any], name: str, *, by: str) -> bool:
    """Stop every process claiming from ``name``; False when it was paused already.

    Jobs already running finish; nothing more is claimed until :func:`resume_queue`.
    What a process had prefetched before the pause (a few, at most what its jobs finish
    in about 50 ms) still starts as its slots free.
    """
    with conn.transaction():
        row = conn.execute(PAUSE_QUEUE, {"queue": _queue_name(name), "by": _by(by)}).fetchone()
    return bool(row and row[0])


def resume_queue(conn: psycopg.Connection[Any], name: str) -> bool:
    """Let every process claim from ``name`` again; False when it was not paused."""
    with conn.transaction():
        row = conn.execute(RESUME_QUEUE, {"queue": _queue_name(name)}).fetchone()
    return bool(row and row[0])


#: The queues ``migrate`` recorded as the application's (the 0027 migration).
DECLARED_QUEUES = "SELECT name FROM standmeet.declared_queues ORDER BY name"


def declared_queues(conn: psycopg.Connection[Any]) -> list[str]:
    """The queues the application declares, as ``migrate`` last recorded them (none on a
    database not migrated that far: what a command needs of it is no reason to fail)."""
    try:
        with conn.transaction():
            return [str(row[0]) for row in conn.execute(DECLARED_QUEUES)]
    except psycopg.errors.UndefinedTable:
        return []


def queue_has_jobs(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether any job, finished long ago included, is of queue ``name``."""
    row = conn.execute(QUEUE_HAS_JOBS, {"queue": _queue_name(name)}).fetchone()
    return bool(row and row[0])
