"""The POST has a total deadline, not a per-phase one; Retry-After is honoured within bounds."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from actors import settings as app_settings
from actors import webhooks
from broker.settings import replace


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


@pytest.mark.slow  # waits out a real timer of a second or more
def test_a_trickling_endpoint_is_cut_at_the_total_deadline(broker):
    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",)))
    try:
        with trickling_server() as url:
            start = time.monotonic()
            outcome = webhooks.post(url, [webhooks.new_secret()], "msg_1", b"{}", timeout_s=1.0)
            took = time.monotonic() - start
    finally:
        app_settings.use(original)
    # each byte arrives well within a per-phase read timeout, yet the whole is cut at 1 s
    # (uncut, it would trickle for 10 s; twice the deadline leaves room for a loaded machine)
    assert outcome.outcome == "timeout", outcome
    assert 0.9 <= took < 2 * 1.0, took


@pytest.mark.parametrize("header, expected", [("120", 120.0), ("0", 1.0), ("999999", 36000.0), ("soon", None),
                                              ("nan", None), ("NaN", None), ("inf", 36000.0), ("-inf", 1.0)])
def test_retry_after_is_honoured_within_bounds(header, expected):
    assert webhooks._retry_after(header) == expected


def test_an_http_date_retry_after_counts_from_now():
    from datetime import datetime, timedelta, timezone
    from email.utils import format_datetime

    value = webhooks._retry_after(format_datetime(datetime.now(timezone.utc) + timedelta(seconds=90), usegmt=True))
    assert value is not None and 85 <= value <= 90


@pytest.mark.slow  # waits out a real timer of a second or more
def test_an_endpoint_trickling_its_headers_is_cut_at_the_total_deadline(broker):
    from tests.support.trickle import trickling_headers_server

    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",)))
    try:
        with trickling_headers_server(every_s=0.1) as url:
            start = time.monotonic()
            outcome = webhooks.post(url, [webhooks.new_secret()], "msg_2", b"{}", timeout_s=1.0)
            took = time.monotonic() - start
    finally:
        app_settings.use(original)
    # every header byte comes within any per-read timeout; the whole is still cut at 1 s
    assert outcome.outcome == "timeout", outcome
    assert 0.9 <= took < 1.6, took


def test_an_attempt_cut_by_the_jobs_own_time_limit_is_recorded_as_a_timeout(broker, database_url, start_worker):
    import psycopg

    from broker.engine.enqueue import enqueue
    from tests.support.db import query, wait_for
    from tests.support.trickle import trickling_headers_server

    original = app_settings.current()
    app_settings.use(replace(original, allowed_networks=("127.0.0.0/8",)))
    try:
        with trickling_headers_server(every_s=0.1) as url:
            endpoint, _ = webhooks.add_endpoint(url, ["slow.thing"])
            with psycopg.connect(database_url) as conn, conn.transaction():
                event = conn.execute("INSERT INTO standmeet.webhook_events (type, payload) VALUES ('slow.thing', '{}')"
                                     " RETURNING id").fetchone()[0]
                delivery = conn.execute("INSERT INTO standmeet.webhook_deliveries (event_id, endpoint_id)"
                                        " VALUES (%s, %s) RETURNING id", (event, endpoint)).fetchone()[0]
                # this job may run 1.5 s, far less than the 10 s HTTP deadline
                enqueue(conn, "webhook.deliver", delivery, options={"time_limit": 1500})
            start_worker(queues=["webhook"], threads=2)
            attempts = wait_for(lambda: query(database_url, "SELECT outcome, duration_ms FROM standmeet.webhook_attempts"
                                                            " WHERE delivery_id = %s", (delivery,)),
                                timeout_s=10, what="the attempt to be recorded")
    finally:
        app_settings.use(original)
    assert attempts[0][0] == "timeout" and attempts[0][1] < 1500, attempts
    assert query(database_url, "SELECT state, attempts, last_outcome FROM standmeet.webhook_deliveries WHERE id = %s",
                 (delivery,)) == [("pending", 1, "timeout")]
