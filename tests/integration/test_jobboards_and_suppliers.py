"""The fetch queue's job boards and the notify queue's supplier calls, against real HTTP servers."""

from __future__ import annotations

import json

import psycopg
import pytest

from actors import jobboards, suppliers
from actors import settings as app_settings
from actors.netguard import UrlRefused
from broker.settings import replace
from tests.support.db import query, scalar, wait_for
from tests.support.webserver import Reply, web_server

RSS = b"""<?xml version="1.0"?><rss version="2.0"><channel><title>Board</title>
<item><guid>r-1</guid><title>Rust engineer</title><link>https://jobs.test/r1</link></item>
<item><guid>r-2</guid><title>Postgres DBA</title><link>https://jobs.test/r2</link></item>
</channel></rss>"""
JSON_FEED = json.dumps({"jobs": [{"id": "j-1", "title": "Python developer", "url": "https://jobs.test/j1"}]}).encode()


def feed(body: bytes, etag: str, content_type: str):
    def reply(request):
        if request.headers.get("if-none-match") == etag:
            return Reply(304, b"", {"ETag": etag})
        return Reply(200, body, {"ETag": etag, "Content-Type": content_type})
    return reply


@pytest.fixture
def loopback_allowed(broker):
    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",)))
    yield
    app_settings.use(original)


def _pending_fetches(url: str, sources: list[int]) -> int:
    return int(scalar(url, "SELECT count(*) FROM dramatiq.queue WHERE message->>'actor_name' = 'jobs.fetch_source'"
                           " AND state IN ('queued', 'consumed') AND (message->'args'->>0)::bigint = ANY(%s)",
                      (sources,)))


def test_feeds_are_fetched_conditionally_one_fetch_per_source_and_a_bad_one_does_not_stop_the_others(
    broker, database_url, start_worker, loopback_allowed
):
    with web_server() as board:
        board.on("GET", "/rss", feed(RSS, '"rss-v1"', "application/rss+xml"))
        board.on("GET", "/json", feed(JSON_FEED, '"json-v1"', "application/json"))
        board.on("GET", "/broken", lambda r: Reply(200, b"{not json", {"Content-Type": "application/json"}))
        rss = jobboards.add_source(board.base + "/rss", "rss")
        js = jobboards.add_source(board.base + "/json", "json", time_limit_s=20)
        broken = jobboards.add_source(board.base + "/broken", "json")
        sources = [rss, js, broken]
        # fetch_new twice in a row queues one fetch per source
        assert jobboards.fetch_new() == 3
        assert jobboards.fetch_new() == 0
        assert _pending_fetches(database_url, sources) == 3
        assert scalar(database_url, "SELECT (message->'options'->>'time_limit')::int FROM dramatiq.queue"
                                    " WHERE message->'args'->>0 = %s", (str(js),)) == 20_000
        start_worker(queues=["fetch"], threads=3)
        wait_for(lambda: _pending_fetches(database_url, sources) == 0, timeout_s=15, what="three fetches to end")
        postings = query(database_url, "SELECT source_id, external_id, title FROM standmeet.job_postings"
                                       " WHERE source_id = ANY(%s) ORDER BY 1, 2", (sources,))
        assert postings == [(rss, "r-1", "Rust engineer"), (rss, "r-2", "Postgres DBA"), (js, "j-1", "Python developer")]
        status = {row[0]: row[1:] for row in query(database_url, "SELECT id, last_status, last_error"
                                                                 " FROM standmeet.job_sources WHERE id = ANY(%s)", (sources,))}
        assert status[rss] == ("ok: 2 posting(s)", None)
        assert status[broken][0] == "error" and "malformed JSON feed" in status[broken][1]
        # A second round: the same ETag is sent back and nothing is transferred
        before = len(board.requests)
        assert jobboards.fetch_new() == 3
        wait_for(lambda: _pending_fetches(database_url, sources) == 0, timeout_s=15, what="the second round")
        second = {r.path: r for r in board.requests[before:]}
        assert second["/rss"].headers["if-none-match"] == '"rss-v1"'
        assert status_of(database_url, rss) == "not modified"
        assert scalar(database_url, "SELECT count(*) FROM standmeet.job_postings WHERE source_id = ANY(%s)",
                      (sources,)) == 3  # idempotent


def status_of(url: str, source_id: int) -> str:
    return str(scalar(url, "SELECT last_status FROM standmeet.job_sources WHERE id = %s", (source_id,)))


def test_a_source_on_a_private_address_is_refused_unless_allowed(broker):
    with pytest.raises(UrlRefused, match="loopback address"):
        jobboards.add_source("http://127.0.0.1:9/feed", "rss")
    with pytest.raises(UrlRefused, match="metadata"):
        jobboards.add_source("http://169.254.169.254/latest", "json")


def test_supplier_calls_record_their_outcome_and_retry_only_what_may_succeed(broker, database_url, start_worker,
                                                                           loopback_allowed):
    answers = {"/ok": [200], "/bad": [422], "/flaky": [503, 200]}
    with web_server() as api:
        for path, codes in answers.items():
            api.on("POST", path, lambda r, codes=codes: Reply.json({"n": len(codes)}, codes.pop(0) if len(codes) > 1 else codes[0]))
        with psycopg.connect(database_url) as conn, conn.transaction():
            ids = {p: suppliers.request_call(conn, "acme", api.base + p, {"sku": p}) for p in answers}
        start_worker(queues=["notify"], threads=2)
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.supplier_calls WHERE status <> 'pending'"
                                              " AND id = ANY(%s)", (list(ids.values()),)) == 3,
                 timeout_s=30, what="the three calls to settle")
    rows = {r[0]: r[1:] for r in query(database_url, "SELECT id, status, status_code, attempts FROM standmeet.supplier_calls"
                                                     " WHERE id = ANY(%s)", (list(ids.values()),))}
    assert rows[ids["/ok"]] == ("succeeded", 200, 1)
    assert rows[ids["/bad"]] == ("failed", 422, 1)  # a 4xx is not retried
    assert rows[ids["/flaky"]] == ("succeeded", 200, 2)  # a 5xx is
    assert [r.json() for r in api.requests if r.path == "/ok"] == [{"sku": "/ok"}]


def test_a_supplier_call_whose_host_name_stops_resolving_is_retried_not_refused(broker, database_url, start_worker,
                                                                                loopback_allowed):
    # Given a call recorded while its host resolved, whose name no longer does
    with web_server() as api, psycopg.connect(database_url) as conn:
        with conn.transaction():
            call = suppliers.request_call(conn, "acme", api.base + "/renamed", {"sku": "dns"})
        conn.execute("UPDATE standmeet.supplier_calls SET url = 'http://no-such-host.invalid/x' WHERE id = %s", (call,))
        conn.commit()
    # When its job runs
    start_worker(queues=["notify"], threads=1)
    wait_for(lambda: scalar(database_url, "SELECT attempts FROM standmeet.supplier_calls WHERE id = %s", (call,)) >= 1,
             timeout_s=30, what="the call's first attempt")
    # Then it is pending, with the reason, and its message waits for a retry (not rejected)
    status, error = query(database_url, "SELECT status, error FROM standmeet.supplier_calls WHERE id = %s", (call,))[0]
    assert status == "pending" and "does not resolve" in error
    wait_for(lambda: scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message->'args'->>0 = %s"
                                          " AND message->>'actor_name' = 'supplier.invoke'", (str(call),)) == "queued",
             timeout_s=10, what="the call's message to wait for its retry")
