"""The index queue's actors: keep the search index in step with the documents."""

from __future__ import annotations

import logging
from typing import Any

import dramatiq
import psycopg

from actors.reasons import keeps_reason
from actors.search import Document, IndexRefused, search_index
from broker import deadline
from broker.pg import db

logger = logging.getLogger(f"standmeet.{__name__}")

READ_DOCUMENT = "SELECT id, title, body FROM standmeet.documents WHERE id = %(id)s"


def load_document(document_id: int) -> Document | None:
    with db.connection() as conn:
        row = conn.execute(READ_DOCUMENT, {"id": document_id}).fetchone()
    return None if row is None else Document(int(row[0]), str(row[1]), str(row[2]))


@dramatiq.actor(actor_name="corpus.index", queue_name="index", throws=(IndexRefused,))
@keeps_reason
def index(document_id: int) -> None:
    """Index one stored document; a document deleted since is removed from the index."""
    document = load_document(document_id)
    if document is None:
        logger.info("document %s no longer exists; removing it from the index", document_id)
        search_index().remove(document_id)
        return
    search_index().upsert([document], wait=True)  # a receipt then means "searchable"


#: Documents a rebuild indexes per batch (one short read, one index update).
REINDEX_BATCH = 500
#: A rebuild hands over to a fresh run of itself when less than this remains of its limit.
REINDEX_MARGIN_S = 5.0

OPEN_RUN = """
WITH existing AS (
    SELECT id FROM standmeet.reindex_runs WHERE finished_at IS NULL ORDER BY id LIMIT 1
), created AS (
    INSERT INTO standmeet.reindex_runs (last_document_id)
    SELECT 0 WHERE NOT EXISTS (SELECT 1 FROM existing)
    RETURNING id
)
SELECT id FROM existing UNION ALL SELECT id FROM created
"""
#: The lock two rebuilds starting together take turns on before they look for an open run
#: (``pg_advisory_xact_lock(class, 0)``, the two-integer lock space): the second then sees
#: the run the first opened, and resumes it, instead of opening a rebuild of its own.
OPEN_RUN_LOCK = "SELECT pg_advisory_xact_lock(%(lock_class)s, 0)"
OPEN_RUN_LOCK_CLASS = 0x5249  # "RI"
RUN_POSITION = "SELECT last_document_id, finished_at IS NOT NULL FROM standmeet.reindex_runs WHERE id = %s"
NEXT_BATCH = "SELECT id, title, body FROM standmeet.documents WHERE id > %s ORDER BY id LIMIT %s"
ADVANCE = """
WITH batch AS (
    INSERT INTO standmeet.reindex_batches (run_id, first_id, last_id, documents) VALUES (%(run)s, %(first)s, %(last)s, %(n)s)
)
UPDATE standmeet.reindex_runs SET last_document_id = %(last)s, indexed = indexed + %(n)s WHERE id = %(run)s
"""
FINISH_RUN = "UPDATE standmeet.reindex_runs SET finished_at = now() WHERE id = %s RETURNING indexed"


def open_run(conn: psycopg.Connection[Any]) -> int:
    """The rebuild to resume (the one not finished), or a new one; one at a time, whatever
    the processes: in a transaction of its own (within the caller's, if one is open)."""
    with conn.transaction():
        conn.execute(OPEN_RUN_LOCK, {"lock_class": OPEN_RUN_LOCK_CLASS})
        row = conn.execute(OPEN_RUN).fetchone()
    assert row is not None
    return int(row[0])


@dramatiq.actor(actor_name="corpus.reindex", queue_name="index", time_limit=600_000)
def reindex(run_id: int | None = None, batch_size: int = REINDEX_BATCH, margin_s: float = REINDEX_MARGIN_S) -> None:
    """Rebuild the whole index in batches, resuming where an interrupted run stopped.

    Between batches it checks its deadline (10 min): with less than ``margin_s`` left
    it snoozes for 0 s, so a fresh run of the same job (no retry counted) continues
    from the last finished batch. When the build completes, it emits ``index.rebuilt``
    through the outbox: the subscribers of that event run as their own jobs.
    """
    from broker import emit
    from middleware import Snooze

    if run_id is None:
        with db.connection() as conn:
            run_id = open_run(conn)
    index_ = search_index()
    progressed = False
    while True:
        left = deadline.remaining_s()
        if progressed and left is not None and left < margin_s:  # ≥ 1 batch per run: no empty loop
            raise Snooze(0, reason=f"reindex run {run_id}: continuing in a fresh job")
        with db.connection() as conn:
            position = conn.execute(RUN_POSITION, (run_id,)).fetchone()
            if position is None or position[1]:
                return  # deleted, or finished by another run of this job
            rows = conn.execute(NEXT_BATCH, (int(position[0]), batch_size)).fetchall()
        if not rows:
            break
        index_.upsert([Document(int(r[0]), str(r[1]), str(r[2])) for r in rows], wait=True)
        with db.connection() as conn:
            conn.execute(ADVANCE, {"run": run_id, "first": int(rows[0][0]), "last": int(rows[-1][0]), "n": len(rows)})
        progressed = True
    with db.connection() as conn, conn.transaction():
        done = conn.execute(FINISH_RUN, (run_id,)).fetchone()
        emit(conn, "index.rebuilt", {"run_id": run_id, "documents": int(done[0]) if done else 0})
    logger.info("reindex run %s finished", run_id)


@dramatiq.actor(actor_name="corpus.rebuilt", queue_name="index")
def rebuilt(run_id: int, documents: int) -> None:
    """A subscriber of ``index.rebuilt``: records the finished build (operators read it)."""
    logger.info("index rebuilt by run %s: %s document(s)", run_id, documents)
    with db.connection() as conn:
        conn.execute("UPDATE standmeet.reindex_runs SET announced_at = now() WHERE id = %s", (run_id,))
