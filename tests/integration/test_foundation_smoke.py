from __future__ import annotations

from actors import corpus
from actors.search import search_index
from tests.support.db import query, wait_for


def test_an_indexed_document_is_found_by_its_words(broker, database_url, start_worker):
    # Given a stored document
    (doc_id,) = query(
        database_url,
        "INSERT INTO standmeet.documents (title, body) VALUES ('Quarterly report', 'revenue grew in spring') RETURNING id",
    )[0]
    # When corpus.index runs for it
    start_worker(queues=["index"])
    message = corpus.index.send(doc_id)
    wait_for(
        lambda: query(database_url, "SELECT state FROM dramatiq.queue WHERE message_id = %s", (message.message_id,))
        == [("done",)],
        timeout_s=10,
        what="the index job to be done",
    )
    # Then the Postgres full-text index finds it by its words
    hits = search_index().search("revenue spring")
    assert [h.document_id for h in hits] == [doc_id]
    assert search_index().search("winter") == []
