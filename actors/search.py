"""The search index: one interface, two implementations chosen by configuration.

``STANDMEET_SEARCH_BACKEND=postgres`` (the default): tsvector + GIN in the
application's database. ``meilisearch``: Meilisearch's documents HTTP API through
httpx (``STANDMEET_MEILI_URL``, ``STANDMEET_MEILI_KEY``), batch updates, and waiting
for the task where it matters (a rebuild's batches). Use :func:`search_index`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import psycopg

from actors import settings as app_settings
from broker import deadline
from broker.errors import StandmeetError
from broker.pg import db

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


class SearchIndexError(StandmeetError):
    """The search index refused or failed an operation."""


class IndexRefused(SearchIndexError):
    """The index refused a document for good (a Postgres program limit): retrying the same
    document cannot help, so the job fails at once, with this reason."""


#: The index holds at most this much of a title and of a body (characters): the tsvector
#: of a bounded text stays under Postgres' 1 MB limit, and a worker's memory bounded.
TITLE_PREFIX_CHARS = 1_000
BODY_PREFIX_CHARS = 256 * 1024


def indexed_text(doc: Document) -> tuple[str, str]:
    """The bounded prefixes of a document's title and body that the index holds."""
    return doc.title[:TITLE_PREFIX_CHARS], doc.body[:BODY_PREFIX_CHARS]


class SearchIndex(Protocol):
    def upsert(self, documents: list[Document], *, wait: bool = False) -> None: ...

    def remove(self, document_id: int) -> None: ...

    def search(self, words: str, *, limit: int = 20) -> list[Hit]: ...


class PostgresSearchIndex:
    """tsvector + GIN in the application's database."""

    def upsert(self, documents: list[Document], *, wait: bool = False) -> None:
        try:
            with db.connection() as conn:
                if len(documents) == 1:  # one statement is atomic alone: no BEGIN/COMMIT round trips
                    title, body = indexed_text(documents[0])
                    conn.execute(UPSERT, {"id": documents[0].id, "title": title, "body": body})
                    return
                with conn.transaction():
                    for doc in documents:
                        title, body = indexed_text(doc)
                        conn.execute(UPSERT, {"id": doc.id, "title": title, "body": body})
        except psycopg.errors.ProgramLimitExceeded as exc:
            ids = ", ".join(str(d.id) for d in documents[:10])
            raise IndexRefused(f"Postgres refused to index document(s) {ids}: "
                               f"{type(exc).__name__}: {str(exc).strip()}") from None

    def remove(self, document_id: int) -> None:
        with db.connection() as conn:
            conn.execute(REMOVE, {"id": document_id})

    def search(self, words: str, *, limit: int = 20) -> list[Hit]:
        with db.connection() as conn:
            rows = conn.execute(SEARCH, {"words": words, "limit": limit}).fetchall()
        return [Hit(int(r[0]), str(r[1]), float(r[2])) for r in rows]


#: Meilisearch's HTTP timeout: well inside the index queue's 30 s limit.
MEILI_TIMEOUT_S = 10.0
#: How long a caller that asked to wait for a Meilisearch task waits at most.
MEILI_TASK_WAIT_S = 20.0


class MeilisearchIndex:
    """Meilisearch's documents API: ``POST /indexes/{uid}/documents`` and friends."""

    def __init__(self, url: str, *, key: str | None, index: str, client: httpx.Client | None = None) -> None:
        self.url = url.rstrip("/")
        self.index = index
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.client = client or httpx.Client(base_url=self.url, headers=headers, follow_redirects=False)

    def _request(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self.client.request(method, path, timeout=deadline.cap_timeout(MEILI_TIMEOUT_S), **kwargs)
        except httpx.HTTPError as exc:
            raise SearchIndexError(f"Meilisearch at {self.url} failed: {type(exc).__name__}: {exc}") from exc
        if response.status_code >= 400:
            raise SearchIndexError(f"Meilisearch {method} {path} answered {response.status_code}: {response.text[:500]}")
        return response.json() if response.content else {}

    def wait_for_task(self, task_uid: int, *, timeout_s: float = MEILI_TASK_WAIT_S) -> dict[str, Any]:
        """Wait until the task has succeeded; a failed task is an error."""
        end = time.monotonic() + min(timeout_s, deadline.remaining_s() or timeout_s)
        pause = 0.01
        while True:
            task = self._request("GET", f"/tasks/{task_uid}")
            status = task.get("status")
            if status == "succeeded":
                return dict(task)
            if status in ("failed", "canceled"):
                raise SearchIndexError(f"Meilisearch task {task_uid} {status}: {task.get('error')}")
            if time.monotonic() > end:
                raise SearchIndexError(f"Meilisearch task {task_uid} still {status} after {timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def upsert(self, documents: list[Document], *, wait: bool = False) -> None:
        if not documents:
            return
        body = [dict(zip(("title", "body"), indexed_text(d), strict=True), id=d.id) for d in documents]
        task = self._request("POST", f"/indexes/{self.index}/documents", params={"primaryKey": "id"}, json=body)
        if wait:
            self.wait_for_task(int(task["taskUid"]))

    def remove(self, document_id: int) -> None:
        self._request("DELETE", f"/indexes/{self.index}/documents/{document_id}")

    def search(self, words: str, *, limit: int = 20) -> list[Hit]:
        result = self._request("POST", f"/indexes/{self.index}/search", json={"q": words, "limit": limit})
        hits = result.get("hits", [])
        return [Hit(int(h["id"]), str(h.get("title", "")), float(len(hits) - i)) for i, h in enumerate(hits)]


_meili: dict[tuple[str, str | None, str], MeilisearchIndex] = {}


def search_index() -> SearchIndex:
    """The configured index (``STANDMEET_SEARCH_BACKEND``)."""
    settings = app_settings.current()
    if settings.search_backend == "meilisearch":
        key = (settings.meili_url, settings.meili_key, settings.meili_index)
        if key not in _meili:
            _meili[key] = MeilisearchIndex(settings.meili_url, key=settings.meili_key, index=settings.meili_index)
        return _meili[key]
    return PostgresSearchIndex()
