"""Bad input is refused before anything is written, and one bad row never stops the rest."""

from __future__ import annotations

import psycopg
import pytest

from actors import documents, jobboards, search
from broker import emit, enqueue
from broker.errors import InvalidPayload, OutboxError
from tests.support.db import query, scalar, wait_for


def _deep(levels: int) -> dict:
    payload: dict = {"document_id": 1}
    node = payload
    for _ in range(levels):
        node["x"] = {}
        node = node["x"]
    return payload


@pytest.mark.parametrize(
    "payload, words",
    [
        ({"document_id": 1, "score": float("nan")}, "nan"),
        ({"document_id": 1, "score": float("inf")}, "inf"),
        ({"document_id": 1, "note": "a\u0000b"}, "NUL"),
        ({"document_id": 1, "a\u0000": 1}, "NUL"),
        ({"document_id": 1, "note": "half \ud83d of a pair"}, "lone surrogate"),
        ({"document_id": 1, "list": [1, ["\udc00"]]}, "lone surrogate"),
        (_deep(40), "deeper than 32"),
        (_deep(5000), "deeper than 32"),
    ],
)
def test_emit_refuses_what_postgres_would_refuse_and_the_callers_transaction_still_commits(
    broker, database_url, payload, words
):
    title = f"kept despite {words}"
    with psycopg.connect(database_url) as conn, conn.transaction():
        doc = conn.execute("INSERT INTO standmeet.documents (title, body) VALUES (%s, 'b') RETURNING id",
                           (title,)).fetchone()[0]
        with pytest.raises(InvalidPayload, match=words) as refused:
            emit(conn, "document.written", payload)
        assert isinstance(refused.value, OutboxError)
    assert query(database_url, "SELECT title FROM standmeet.documents WHERE id = %s", (doc,)) == [(title,)]
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE payload::text LIKE %s",
                  ('%"x"%',)) == 0


def test_a_document_over_the_limit_or_holding_nul_is_refused_before_anything_is_written(broker, database_url):
    from actors import settings as app_settings
    from broker.settings import replace

    before = scalar(database_url, "SELECT count(*) FROM standmeet.documents")
    original = app_settings.current()
    app_settings.use(replace(original, document_max_bytes=1000))
    try:
        with pytest.raises(documents.DocumentRefused, match="over the limit of 1000 .STANDMEET_DOCUMENT_MAX_BYTES"):
            documents.write_document("big", "é" * 600)  # 1200 bytes in UTF-8
    finally:
        app_settings.use(original)
    with pytest.raises(documents.DocumentRefused, match="NUL"):
        documents.write_document("nul", "before\x00after")
    with pytest.raises(documents.DocumentRefused, match="NUL"):
        documents.write_document("ti\x00tle", "body")
    assert app_settings.current().document_max_bytes == 1024 * 1024  # the default: 1 MiB
    assert scalar(database_url, "SELECT count(*) FROM standmeet.documents") == before


def test_the_index_holds_a_bounded_prefix_of_a_document(broker, database_url):
    words = [f"w{n}" for n in range(60_000)]  # ~ 420 kB: past the prefix
    body = " ".join(words)
    doc = scalar(database_url, "INSERT INTO standmeet.documents (title, body) VALUES ('long', %s) RETURNING id", (body,))
    search.PostgresSearchIndex().upsert([search.Document(doc, "long", body)])
    index = search.PostgresSearchIndex()
    assert [h.document_id for h in index.search("w10")] == [doc]
    assert index.search("w59999") == []  # beyond the prefix
    cut = body[: search.BODY_PREFIX_CHARS].rsplit(" ", 1)[0].split()[-1]
    assert [h.document_id for h in index.search(cut)] == [doc]


def test_a_postgres_program_limit_fails_the_index_job_at_once_with_the_reason(
    broker, database_url, start_worker, monkeypatch
):
    monkeypatch.setattr(search, "BODY_PREFIX_CHARS", 10_000_000)  # as before the prefix existed
    body = " ".join(f"lexeme{n}" for n in range(150_000))  # a tsvector well over 1 MB
    doc = scalar(database_url, "INSERT INTO standmeet.documents (title, body) VALUES ('huge', %s) RETURNING id", (body,))
    with psycopg.connect(database_url) as conn, conn.transaction():
        message = enqueue(conn, "corpus.index", doc)
    start_worker(queues=["index"], threads=1)
    row = wait_for(lambda: query(database_url, "SELECT state::text, message->'options'->>'retries', error"
                                               " FROM dramatiq.queue WHERE message_id = %s AND state = 'rejected'",
                                 (message.message_id,)), timeout_s=30, what="the index job to be rejected")
    state, retries, error = row[0]
    assert (state, retries) == ("rejected", None)  # failed at once: no retry
    assert error.startswith("IndexRefused: Postgres refused to index document(s)") and "ProgramLimitExceeded" in error


@pytest.mark.parametrize("limit", [float("nan"), float("inf"), float("-inf"), -1.0, 0.0, 3601.0, "soon"])
def test_a_source_time_limit_must_be_finite_and_positive(broker, limit):
    with pytest.raises(jobboards.FeedError, match="time limit"):
        jobboards.add_source("http://8.8.8.8/feed", "json", time_limit_s=limit)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-1", "0"])
def test_the_database_refuses_a_bad_source_time_limit_too(broker, database_url, value):
    with pytest.raises(psycopg.errors.CheckViolation):
        query(database_url, "INSERT INTO standmeet.job_sources (url, kind, time_limit_s) VALUES (%s, 'json', %s::float8)",
              (f"http://8.8.8.8/{value}", value))


def test_one_bad_source_never_stops_the_others_from_being_fetched(broker, database_url):
    # a row written before the check existed
    query(database_url, "ALTER TABLE standmeet.job_sources DROP CONSTRAINT job_sources_time_limit_s_check")
    try:
        bad = scalar(database_url, "INSERT INTO standmeet.job_sources (url, kind, time_limit_s)"
                                   " VALUES ('http://8.8.4.4/bad', 'json', 'NaN') RETURNING id")
        good = scalar(database_url, "INSERT INTO standmeet.job_sources (url, kind, time_limit_s)"
                                    " VALUES ('http://8.8.4.4/good', 'json', 30) RETURNING id")
        assert jobboards.fetch_new() == 1
        assert query(database_url, "SELECT source_id FROM standmeet.source_fetches") == [(good,)]
        status = query(database_url, "SELECT last_status, last_error FROM standmeet.job_sources WHERE id = %s", (bad,))
        assert status[0][0] == "error" and "time limit" in status[0][1]
    finally:
        query(database_url, "DELETE FROM standmeet.job_sources WHERE url LIKE 'http://8.8.4.4/%%'")
        query(database_url, "ALTER TABLE standmeet.job_sources ADD CONSTRAINT job_sources_time_limit_s_check"
                            " CHECK (time_limit_s <> 'NaN'::float8 AND time_limit_s > 0 AND time_limit_s <= 3600)")
