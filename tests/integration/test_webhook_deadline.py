"""R9: the POST has a total deadline, not a per-phase one; Retry-After is honoured within bounds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from actors import webhooks


@contextmanager
def trickling_server() -> Iterator[str]:
    """Answers 200 at once, then sends one body byte every 0.2 s for 10 s."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Length", "50")
            self.end_headers()
            try:
                for _ in range(50):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.2)
            except (BrokenPipeError, ConnectionResetError):
                pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook"
    finally:
        server.shutdown()
        server.server_close()


def test_a_trickling_endpoint_is_cut_at_the_total_deadline(broker):
    original = broker.settings
    broker.settings = replace(original, allowed_networks=("127.0.0.0/8",))
    try:
        with trickling_server() as url:
            start = time.monotonic()
            outcome = webhooks.post(url, [webhooks.new_secret()], "msg_1", b"{}", timeout_s=1.0)
            took = time.monotonic() - start
    finally:
        broker.settings = original
    # each byte arrives well within a per-phase read timeout, yet the whole is cut at 1 s
    # (uncut, it would trickle for 10 s; twice the deadline leaves room for a loaded machine)
    assert outcome.outcome == "timeout", outcome
    assert 0.9 <= took < 2 * 1.0, took


@pytest.mark.parametrize("header, expected", [("120", 120.0), ("0", 1.0), ("999999", 36000.0), ("soon", None)])
def test_retry_after_is_honoured_within_bounds(header, expected):
    assert webhooks._retry_after(header) == expected


def test_an_http_date_retry_after_counts_from_now():
    from datetime import datetime, timedelta, timezone
    from email.utils import format_datetime

    value = webhooks._retry_after(format_datetime(datetime.now(timezone.utc) + timedelta(seconds=90), usegmt=True))
    assert value is not None and 85 <= value <= 90
