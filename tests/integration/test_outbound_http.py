"""Outbound HTTP/1.1 as the guarded request speaks it: framing, keep-alive, TLS, refusals."""

from __future__ import annotations

import httpx
import pytest

from actors import http
from actors.http import ResponseTooLarge, guarded_request
from actors.http1 import MAX_HEAD_BYTES, request_line_target
from actors.webhooks import _classify
from tests.support.rawhttp import make_authority, raw_server, reply

LOOPBACK = ("127.0.0.0/8",)


def get(url: str, **kwargs):
    return guarded_request("GET", url, allowed_networks=LOOPBACK, timeout_s=5, max_bytes=1024, **kwargs)


@pytest.fixture(autouse=True)
def empty_pool():
    """Each test starts with no kept-alive connection (ports are reused across tests)."""
    http.POOL.close()
    yield
    http.POOL.close()


def test_a_kept_alive_connection_carries_the_next_request():
    with raw_server(lambda n: (reply(b"n%d" % n), False)) as (port, seen):
        bodies = [get(f"http://127.0.0.1:{port}/a").body for _ in range(3)]
    assert bodies == [b"n0", b"n1", b"n2"]
    assert seen.connections == 1 and [c for c, _ in seen.heads] == [1, 1, 1]


def test_a_post_sends_its_body_its_length_and_the_host_it_was_given():
    with raw_server(lambda n: (reply(), False)) as (port, seen):
        got = guarded_request("POST", f"http://127.0.0.1:{port}/hook?x=1", allowed_networks=LOOPBACK,
                              timeout_s=5, max_bytes=1024, headers={"webhook-id": "msg_1"}, content=b'{"a": 1}')
    assert got.status_code == 200
    head = seen.heads[0][1].decode()
    assert head.startswith("POST /hook?x=1 HTTP/1.1\r\n")
    assert f"\r\nHost: 127.0.0.1:{port}" in head and "\r\nContent-Length: 8" in head and "\r\nwebhook-id: msg_1" in head


def test_a_chunked_response_is_read_whole_and_its_connection_kept():
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"5;ext=1\r\nhello\r\n6\r\n world\r\n0\r\nX-Trailer: t\r\n\r\n")
    with raw_server(lambda n: (chunked, False)) as (port, seen):
        first, second = get(f"http://127.0.0.1:{port}/"), get(f"http://127.0.0.1:{port}/")
    assert first.body == second.body == b"hello world" and not first.truncated
    assert seen.connections == 1


def test_an_interim_response_is_skipped_for_the_final_one():
    with raw_server(lambda n: (b"HTTP/1.1 100 Continue\r\n\r\n" + reply(b"final", status="201 Created"), False)) \
            as (port, _):
        got = get(f"http://127.0.0.1:{port}/")
    assert (got.status_code, got.body) == (201, b"final")


def test_a_connection_the_server_closed_while_idle_is_not_reused():
    # Given a server that closes each connection after its response, announcing nothing
    with raw_server(lambda n: (reply(b"n%d" % n), True)) as (port, seen):
        assert get(f"http://127.0.0.1:{port}/").body == b"n0"
        assert seen.closed.acquire(timeout=5), "the server did not close the connection"
        # When the next request is made, Then it goes on a new connection
        assert get(f"http://127.0.0.1:{port}/").body == b"n1"
    assert seen.connections == 2 and len(seen.heads) == 2


def test_a_request_the_peer_dropped_on_a_kept_alive_connection_is_sent_once_more_on_a_new_one():
    # Given a kept-alive connection that the server closes as the next request arrives
    # (it reads it and answers nothing), then a server that answers on a new connection
    script = {0: (reply(b"first"), False), 1: (b"", True), 2: (reply(b"again"), False)}
    with raw_server(lambda n: script[n]) as (port, seen):
        assert get(f"http://127.0.0.1:{port}/").body == b"first"
        # When the next request meets the close, Then it is made again on a new connection
        assert get(f"http://127.0.0.1:{port}/").body == b"again"
    assert seen.connections == 2 and [c for c, _ in seen.heads] == [1, 1, 2]


def test_a_new_connection_that_gets_no_answer_is_not_tried_again():
    with raw_server(lambda n: (b"", True)) as (port, seen):
        with pytest.raises(httpx.RemoteProtocolError, match="Server disconnected without sending a response"):
            get(f"http://127.0.0.1:{port}/")
    assert seen.connections == 1 and len(seen.heads) == 1


def test_a_body_read_until_close_or_a_connection_close_answer_is_never_reused():
    until_close = b"HTTP/1.1 200 OK\r\n\r\nall of it"
    with raw_server(lambda n: (until_close, True) if n == 0 else (reply(headers="Connection: close\r\n"), False)) \
            as (port, seen):
        assert get(f"http://127.0.0.1:{port}/").body == b"all of it"
        assert get(f"http://127.0.0.1:{port}/").body == b"ok"
        assert get(f"http://127.0.0.1:{port}/").status_code == 200
    assert seen.connections == 3


def test_a_body_over_the_cap_is_truncated_or_refused_in_every_framing():
    big = b"x" * 5000
    framings = {  # (the response, the server closes after it)
        "length": (reply(big), False),
        "chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1388\r\n" + big + b"\r\n0\r\n\r\n",
                    False),
        "close": (b"HTTP/1.1 200 OK\r\n\r\n" + big, True),
    }
    for name, answer in framings.items():
        with raw_server(lambda n, answer=answer: answer) as (port, seen):
            got = get(f"http://127.0.0.1:{port}/")
            assert (len(got.body), got.truncated) == (1024, True), name
            with pytest.raises(ResponseTooLarge, match="larger than 1024 bytes"):
                get(f"http://127.0.0.1:{port}/", refuse_larger=True)
        assert seen.connections == 2, name  # a cut body's connection is not reused


@pytest.mark.parametrize("raw, named", [
    (b"HTTP/2 200 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 2000 OK\r\n\r\n", "not an HTTP/1.x status line"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n0x5\r\nhello\r\n0\r\n\r\n", "invalid chunk size"),
    (b"HTTP/1.1 200 OK\r\n folded: no\r\n\r\n", "malformed response header"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"y" * MAX_HEAD_BYTES + b"\r\n\r\n", "response's head is over"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", "inside the response's body"),
    (b"", "Server disconnected without sending a response"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: \xb2\r\n\r\n", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok", "invalid Content-Length"),
    (b"HTTP/1.1 200 OK\r\nX: a\nContent-Length: 0\r\n\r\n", "malformed response header"),
    (b"HTTP/1.1 200 OK\r\nETag: \"v1\"\rX\r\n\r\n", "malformed response header"),
    (b"HTTP/1.1 200 OK\r\nLast-Modified: Mon\x00day\r\n\r\n", "malformed response header"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1;" + b"e" * 2000 + b"\r\nx\r\n0\r\n\r\n",
     "chunk size is over"),
    (b"HTTP/1.1 100 Continue\r\n\r\n" * 20 + reply(), "more than 16 interim responses"),
    (b"HTTP/1.1 099 Odd\r\n\r\n", "unexpected status 99"),
], ids=["version", "status", "two-lengths", "negative-length", "chunk-size", "folded", "huge-head", "short-body",
        "nothing", "non-ascii-digit-length", "huge-length", "listed-length", "bare-lf", "bare-cr", "nul",
        "chunk-line", "interim-flood", "status-below-100"])
def test_a_malformed_response_is_a_protocol_error_that_names_what_was_wrong(raw, named):
    with raw_server(lambda n: (raw, True)) as (port, _):
        with pytest.raises(httpx.RemoteProtocolError, match=named):
            get(f"http://127.0.0.1:{port}/")


def test_a_response_header_outside_ascii_is_kept_as_sent_and_readable():
    with raw_server(lambda n: (reply(headers="X-Name: caf\u00e9\r\nETag: \"\u00e9\"\r\n").replace(b"\xc3\xa9", b"\xe9"),
                               False)) as (port, _):
        got = get(f"http://127.0.0.1:{port}/")
    assert got.status_code == 200 and got.headers["x-name"] == "caf\u00e9" and got.headers["etag"] == '"\u00e9"'


@pytest.mark.parametrize("head", [
    "HTTP/1.0 200 OK\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
    "HTTP/1.1 200 OK\r\nConnection: close\r\nConnection: keep-alive\r\nContent-Length: 2\r\n\r\nok",
    "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "HTTP/1.1 204 No Content\r\nTransfer-Encoding: chunked\r\nContent-Length: 0\r\n\r\n",
], ids=["http-1.0", "close-then-keep-alive", "both-framings", "204-both-framings"])
def test_a_connection_whose_response_was_not_plainly_http_1_1_keep_alive_is_not_reused(head):
    with raw_server(lambda n: (head.encode(), False)) as (port, seen):
        for _ in range(2):
            get(f"http://127.0.0.1:{port}/")
    assert seen.connections == 2


def test_an_answer_sent_before_the_request_was_read_whole_is_the_outcome():
    # Given a server that refuses a large body after its head, and closes
    big = b"x" * (8 * 1024 * 1024)
    with raw_server(lambda n: (reply(b"big", status="413 Payload Too Large", headers="Connection: close\r\n"), True),
                    read_body=False) as (port, _):
        got = guarded_request("POST", f"http://127.0.0.1:{port}/", allowed_networks=LOOPBACK, timeout_s=5,
                              max_bytes=1024, content=big)
    assert (got.status_code, got.body) == (413, b"big")


def test_the_pool_keeps_no_trace_of_hosts_it_holds_no_connection_for():
    answers = [(reply(), False), (reply(headers="Connection: close\r\n"), False)]
    with raw_server(lambda n: answers[n]) as (port, _):
        get(f"http://127.0.0.1:{port}/")
        assert http.POOL.idle() == 1  # kept alive
        get(f"http://127.0.0.1:{port}/")  # taken, then closed as the answer asked
    assert http.POOL.idle() == 0 and http.POOL._idle == {}


def test_the_framing_and_host_headers_are_the_requests_own_whatever_the_caller_passes():
    with raw_server(lambda n: (reply(), False)) as (port, seen):
        guarded_request("POST", f"http://127.0.0.1:{port}/", allowed_networks=LOOPBACK, timeout_s=5, max_bytes=1024,
                        headers={"host": "evil.test", "content-length": "0", "Transfer-Encoding": "chunked"},
                        content=b"abc")
    lines = [line.lower() for line in seen.heads[0][1].split(b"\r\n")[1:]]
    framing = sorted(line for line in lines if line.startswith((b"host:", b"content-length:", b"transfer-encoding:")))
    assert framing == [b"content-length: 3", f"host: 127.0.0.1:{port}".encode()]


def test_a_header_that_would_split_the_request_is_refused_before_anything_is_sent():
    with raw_server(lambda n: (reply(), False)) as (port, seen):
        with pytest.raises(httpx.LocalProtocolError, match="'X-Note' cannot be sent: its value holds CR, LF or NUL"):
            get(f"http://127.0.0.1:{port}/", headers={"X-Note": "a\r\nInjected: yes"})
        with pytest.raises(httpx.LocalProtocolError, match="header name 'X Note' cannot be sent"):
            get(f"http://127.0.0.1:{port}/", headers={"X Note": "a"})
    assert seen.heads == []


def test_the_request_target_is_percent_encoded_so_a_url_cannot_split_the_request_line():
    assert request_line_target("http://h/a b/\x01X: y?q=1 2&r=\u00e9") == "/a%20b/%01X:%20y?q=1%202&r=%C3%A9"
    assert "\n" not in request_line_target("http://h/a\r\nInjected: yes")
    assert request_line_target("http://h") == "/"
    assert request_line_target("http://h/p%20q?x=%41#frag") == "/p%20q?x=%41"


def test_tls_is_verified_against_the_name_the_url_gave(tmp_path, monkeypatch):
    authority = make_authority(tmp_path, names=["127.0.0.1"])

    def answer(n: int) -> tuple[bytes, bool]:
        return reply(b"secure"), False

    with raw_server(answer, tls=authority.server) as (port, seen):
        url = f"https://127.0.0.1:{port}/"
        # a certificate from an authority the process does not trust is refused, as a TLS error
        with pytest.raises(httpx.ConnectError) as refused:
            get(url)
        assert _classify(refused.value) == "tls"
        # trusted, and naming the address asked for: the exchange goes through, and the
        # connection is kept alive for the next one
        monkeypatch.setattr(http, "TLS", authority.client())
        assert [get(url).body for _ in range(3)] == [b"secure"] * 3
        assert seen.connections == 2  # the refused one, then one for all three
    other = make_authority(tmp_path, names=["elsewhere.test"])
    monkeypatch.setattr(http, "TLS", other.client())
    with raw_server(answer, tls=other.server) as (port, _):
        # trusted, but naming another host: refused
        with pytest.raises(httpx.ConnectError, match="(?i)certificate|match|hostname") as mismatch:
            get(f"https://127.0.0.1:{port}/")
        assert _classify(mismatch.value) == "tls"
