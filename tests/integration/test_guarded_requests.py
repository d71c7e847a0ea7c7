"""Every outbound request goes through the guard: checked, pinned, capped, with a total deadline."""

from __future__ import annotations

import time

import httpx
import psycopg
import pytest

from actors import settings as app_settings
from actors import suppliers
from actors.http import ResponseTooLarge, guarded_request
from actors.netguard import UrlRefused
from broker import enqueue
from broker.settings import replace
from tests.support.db import query, wait_for
from tests.support.trickle import trickling_headers_server
from tests.support.webserver import Reply, web_server

LOOPBACK = ("127.0.0.0/8",)


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_response_trickling_its_headers_is_cut_at_the_total_deadline():
    with trickling_headers_server(every_s=0.1) as url:
        start = time.monotonic()
        with pytest.raises(httpx.TimeoutException, match="total deadline"):
            guarded_request("GET", url, allowed_networks=LOOPBACK, timeout_s=1.0, max_bytes=1024)
        took = time.monotonic() - start
    assert 0.9 <= took < 1.6, took


def test_the_body_is_read_up_to_the_cap_truncated_or_refused():
    with web_server() as site:
        site.on("GET", "/big", lambda r: Reply(200, b"x" * 300_000))
        got = guarded_request("GET", site.base + "/big", allowed_networks=LOOPBACK, timeout_s=5, max_bytes=16_384)
        assert got.status_code == 200 and got.truncated and len(got.body) == 16_384
        with pytest.raises(ResponseTooLarge, match="larger than 16384 bytes"):
            guarded_request("GET", site.base + "/big", allowed_networks=LOOPBACK, timeout_s=5, max_bytes=16_384,
                            refuse_larger=True)


def test_redirects_are_returned_not_followed_and_each_request_is_checked_again():
    with web_server() as site:
        site.on("GET", "/moved", lambda r: Reply(302, b"", {"Location": site.base + "/inside"}))
        got = guarded_request("GET", site.base + "/moved", allowed_networks=LOOPBACK, timeout_s=5, max_bytes=1024)
        assert got.status_code == 302
        assert [r.path for r in site.requests] == ["/moved"]  # /inside never asked for
        # the same URL, once loopback is no longer allowed, is refused before any byte is sent
        with pytest.raises(UrlRefused, match="loopback"):
            guarded_request("GET", site.base + "/moved", allowed_networks=(), timeout_s=5, max_bytes=1024)
        assert len(site.requests) == 1


def test_the_request_carries_the_host_name_while_going_to_the_checked_address():
    with web_server() as site:
        site.on("GET", "/h", lambda r: Reply(200, b"ok"))
        if not _localhost_is_ipv4_first():
            pytest.skip("localhost does not resolve to 127.0.0.1 first here")
        port = site.base.rsplit(":", 1)[1]
        got = guarded_request("GET", f"http://localhost:{port}/h", allowed_networks=("127.0.0.0/8", "::1/128"),
                              timeout_s=5, max_bytes=1024)
    assert got.status_code == 200 and got.target.address == "127.0.0.1"
    assert site.requests[-1].headers["host"] == f"localhost:{port}"


def _localhost_is_ipv4_first() -> bool:
    import socket

    try:
        return socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)[0][4][0] == "127.0.0.1"
    except OSError:
        return False


def test_supplier_calls_go_through_the_guard_and_keep_at_most_the_cap(broker, database_url, start_worker):
    with web_server() as api:
        api.on("POST", "/huge", lambda r: Reply(200, b"y" * 1_000_000))
        # refused when requested, before anything is written
        with psycopg.connect(database_url) as conn, conn.transaction():
            with pytest.raises(UrlRefused, match="cloud metadata"):
                suppliers.request_call(conn, "acme", "http://169.254.169.254/latest/meta-data", {"n": 0})
            kept = conn.execute("INSERT INTO test_counters (key) VALUES ('kept') RETURNING key").fetchone()
        assert kept == ("kept",) and query(database_url, "SELECT count(*) FROM standmeet.supplier_calls") == [(0,)]
        # and at each attempt: calls recorded while their URLs passed (or by other means)
        with psycopg.connect(database_url) as conn, conn.transaction():
            blocked, metadata = (conn.execute(suppliers.INSERT, ("acme", u, "{}")).fetchone()[0]
                                 for u in (api.base + "/huge", "http://169.254.169.254/latest/meta-data"))
            for call in (blocked, metadata):
                enqueue(conn, "supplier.invoke", call)
        start_worker(queues=["notify"], threads=2)
        wait_for(lambda: query(database_url, "SELECT count(*) FROM standmeet.supplier_calls"
                                             " WHERE id IN (%s, %s) AND status = 'failed'", (blocked, metadata))[0][0] == 2,
                 timeout_s=15, what="both forbidden calls to fail for good")
        assert api.requests == []  # loopback is not allowed here: nothing was sent
        rows = dict(query(database_url, "SELECT id, error FROM standmeet.supplier_calls WHERE id IN (%s, %s)",
                          (blocked, metadata)))
        assert "loopback" in rows[blocked] and "cloud metadata" in rows[metadata]
        assert query(database_url, "SELECT attempts FROM standmeet.supplier_calls WHERE id = %s", (blocked,)) == [(1,)]
        original = app_settings.current()
        app_settings.use(replace(original, allowed_networks=LOOPBACK))
        try:
            with psycopg.connect(database_url) as conn, conn.transaction():
                huge = suppliers.request_call(conn, "acme", api.base + "/huge", {"n": 3})
            wait_for(lambda: query(database_url, "SELECT status FROM standmeet.supplier_calls WHERE id = %s",
                                   (huge,)) == [("succeeded",)], timeout_s=15, what="the allowed call")
        finally:
            app_settings.use(original)
    assert query(database_url, "SELECT length(response) FROM standmeet.supplier_calls WHERE id = %s",
                 (huge,)) == [(suppliers.RESPONSE_CAP,)]
