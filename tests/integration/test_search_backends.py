"""The search index: Meilisearch (an imitation of its documented HTTP API: no installable package ships the server), and the Postgres default."""

from __future__ import annotations

from itertools import count

import pytest

from actors import corpus
from actors import settings as app_settings
from actors.search import Document, MeilisearchIndex, SearchIndexError, search_index
from broker.settings import replace
from tests.support.db import query, wait_for
from tests.support.webserver import Reply, web_server


@pytest.fixture
def meili():
    """A local server answering like Meilisearch (tasks finish on their second poll)."""
    with web_server() as server:
        uids = count(1)
        polls: dict[str, int] = {}

        def enqueued(request):
            return Reply.json({"taskUid": next(uids), "indexUid": "documents", "status": "enqueued",
                               "type": "documentAdditionOrUpdate", "enqueuedAt": "2026-11-29T00:00:00Z"}, 202)

        def task(request):
            uid = request.path.rsplit("/", 1)[1]
            polls[uid] = polls.get(uid, 0) + 1
            return Reply.json({"uid": int(uid), "status": "processing" if polls[uid] == 1 else "succeeded"})

        def search(request):
            words = request.json()["q"]
            return Reply.json({"hits": [{"id": 7, "title": f"about {words}"}], "query": words,
                               "processingTimeMs": 1, "limit": 20, "offset": 0, "estimatedTotalHits": 1})

        server.on("POST", "/indexes/documents/documents", enqueued)
        server.on("DELETE", "/indexes/documents/documents/7", enqueued)
        server.on("POST", "/indexes/documents/search", search)
        for uid in range(1, 20):
            server.on("GET", f"/tasks/{uid}", task)
        yield server


def test_meilisearch_is_spoken_to_through_its_documents_api(meili):
    index = MeilisearchIndex(meili.base, key="master-key", index="documents")
    index.upsert([Document(7, "Seven", "body seven"), Document(8, "Eight", "body eight")], wait=True)
    hits = index.search("seven")
    index.remove(7)
    calls = [(r.method, r.path) for r in meili.requests]
    assert calls == [
        ("POST", "/indexes/documents/documents?primaryKey=id"),
        ("GET", "/tasks/1"), ("GET", "/tasks/1"),  # waited for the batch's task
        ("POST", "/indexes/documents/search"),
        ("DELETE", "/indexes/documents/documents/7"),
    ]
    assert all(r.headers["authorization"] == "Bearer master-key" for r in meili.requests)
    assert meili.requests[0].json() == [{"id": 7, "title": "Seven", "body": "body seven"},
                                        {"id": 8, "title": "Eight", "body": "body eight"}]
    assert meili.requests[3].json() == {"q": "seven", "limit": 20}
    assert [(h.document_id, h.title) for h in hits] == [(7, "about seven")]


def test_a_failed_meilisearch_task_is_a_clear_error(meili):
    meili.on("GET", "/tasks/1", lambda r: Reply.json({"uid": 1, "status": "failed", "error": {"code": "invalid_document_id"}}))
    with pytest.raises(SearchIndexError, match="task 1 failed.*invalid_document_id"):
        MeilisearchIndex(meili.base, key=None, index="documents").upsert([Document(1, "t", "b")], wait=True)


def test_corpus_index_uses_the_configured_backend(broker, database_url, start_worker, meili):
    (doc_id,) = query(database_url, "INSERT INTO standmeet.documents (title, body) VALUES ('Meili', 'routed') RETURNING id")[0]
    original = app_settings.current()
    app_settings.use(replace(original, search_backend="meilisearch", meili_url=meili.base, meili_key="k"))
    try:
        assert isinstance(search_index(), MeilisearchIndex)
        start_worker(queues=["index"], threads=4)
        corpus.index.send(doc_id)
        wait_for(lambda: any(r.method == "POST" and r.path.startswith("/indexes/documents/documents") for r in meili.requests),
                 timeout_s=10, what="the document posted to Meilisearch")
    finally:
        app_settings.use(original)
    posted = [r for r in meili.requests if r.method == "POST"][0].json()
    assert posted == [{"id": doc_id, "title": "Meili", "body": "routed"}]
    # the Postgres index was not written
    assert query(database_url, "SELECT count(*) FROM standmeet.search_index WHERE document_id = %s", (doc_id,)) == [(0,)]
