"""The index queue's actors: keep the search index in step with the documents."""

from __future__ import annotations

import logging

import dramatiq

from actors.search import Document, search_index
from broker import db

logger = logging.getLogger(__name__)

READ_DOCUMENT = "SELECT id, title, body FROM standmeet.documents WHERE id = %(id)s"


def load_document(document_id: int) -> Document | None:
    with db.connection() as conn:
        row = conn.execute(READ_DOCUMENT, {"id": document_id}).fetchone()
    return None if row is None else Document(int(row[0]), str(row[1]), str(row[2]))


@dramatiq.actor(actor_name="corpus.index", queue_name="index")
def index(document_id: int) -> None:
    """Index one stored document; a document deleted since is removed from the index."""
    document = load_document(document_id)
    if document is None:
        logger.info("document %s no longer exists; removing it from the index", document_id)
        search_index().remove(document_id)
        return
    search_index().upsert([document])
