"""The search index: one interface, a Postgres full-text implementation (the default).

The Meilisearch implementation arrives with its own issue; both are chosen by
``STANDMEET_SEARCH_BACKEND`` and used through :func:`search_index`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from broker import db

UPSERT = """
INSERT INTO standmeet.search_index (document_id, title, tsv, indexed_at)
VALUES (%(id)s, %(title)s,
        setweight(to_tsvector('simple', %(title)s), 'A') || setweight(to_tsvector('simple', %(body)s), 'B'),
        now())
ON CONFLICT (document_id) DO UPDATE
SET title = EXCLUDED.title, tsv = EXCLUDED.tsv, indexed_at = now()
"""

SEARCH = """
SELECT document_id, title, ts_rank(tsv, query) AS rank
FROM standmeet.search_index, websearch_to_tsquery('simple', %(words)s) AS query
WHERE tsv @@ query
ORDER BY rank DESC, document_id
LIMIT %(limit)s
"""

REMOVE = "DELETE FROM standmeet.search_index WHERE document_id = %(id)s"


@dataclass(frozen=True)
class Document:
    id: int
    title: str
    body: str


@dataclass(frozen=True)
class Hit:
    document_id: int
    title: str
    rank: float


class SearchIndex(Protocol):
    def upsert(self, documents: list[Document]) -> None: ...

    def remove(self, document_id: int) -> None: ...

    def search(self, words: str, *, limit: int = 20) -> list[Hit]: ...


class PostgresSearchIndex:
    """tsvector + GIN in the application's database."""

    def upsert(self, documents: list[Document]) -> None:
        with db.connection() as conn, conn.transaction():
            for doc in documents:
                conn.execute(UPSERT, {"id": doc.id, "title": doc.title, "body": doc.body})

    def remove(self, document_id: int) -> None:
        with db.connection() as conn:
            conn.execute(REMOVE, {"id": document_id})

    def search(self, words: str, *, limit: int = 20) -> list[Hit]:
        with db.connection() as conn:
            rows = conn.execute(SEARCH, {"words": words, "limit": limit}).fetchall()
        return [Hit(int(r[0]), str(r[1]), float(r[2])) for r in rows]


def search_index() -> SearchIndex:
    return PostgresSearchIndex()
