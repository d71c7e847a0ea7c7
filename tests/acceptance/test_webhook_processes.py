"""Across processes: ≤ 1 delivery in flight per endpoint; a dead worker's lease expires; a
worker killed mid-batch re-sends only the POST it had in flight."""

from __future__ import annotations

import os
import signal
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import psycopg

from actors import settings as app_settings
from actors import webhooks
from broker.settings import replace
from tests.support.db import scalar, wait_for
from tests.support.http import http_server
from tests.support.procs import running, worker_cmd

WEBHOOK_ENV = {
    "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8",
    "STANDMEET_WEBHOOK_BUSY_SNOOZE_S": "0.05",
}


def _emit(database_url: str, event_type: str, n: int) -> None:
    with psycopg.connect(database_url) as conn, conn.transaction():
        for i in range(n):
            webhooks.emit_event(conn, event_type, {"i": i})


def _succeeded(database_url: str, endpoint: int) -> int:
    return int(scalar(database_url, "SELECT count(*) FROM standmeet.webhook_deliveries WHERE endpoint_id = %s"
                                    " AND state = 'succeeded'", (endpoint,)))


def test_two_workers_never_post_twice_at_once_to_one_endpoint_and_endpoints_run_in_parallel(
    broker, database_url, subprocess_env, tmp_path
):
    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",)))
    env = {**subprocess_env, **WEBHOOK_ENV}
    with http_server(delay_s=0.02) as (url_a, a), http_server(delay_s=0.02) as (url_b, b):
        endpoint_a, _ = webhooks.add_endpoint(url_a, ["a"])
        endpoint_b, _ = webhooks.add_endpoint(url_b, ["b"])
        _emit(database_url, "a", 50)
        _emit(database_url, "b", 50)
        cmd = worker_cmd("--queues", "webhook")
        with running(cmd, env, log=tmp_path / "w1.log"), running(cmd, env, log=tmp_path / "w2.log"):
            wait_for(lambda: _succeeded(database_url, endpoint_a) == 50 and _succeeded(database_url, endpoint_b) == 50,
                     timeout_s=90, what="100 deliveries")
        # What each server saw: never two requests at once, and all 50
        assert a.max_in_flight == 1 and b.max_in_flight == 1
        assert len(a.received) == 50 and len(b.received) == 50
        # The two endpoints were served side by side: their request times interleave
        first_b, last_a = min(b.started), max(a.started)
        first_a, last_b = min(a.started), max(b.started)
        assert first_b < last_a and first_a < last_b
    attempts = scalar(database_url, "SELECT max(attempts) FROM standmeet.webhook_deliveries WHERE endpoint_id = ANY(%s)",
                      ([endpoint_a, endpoint_b],))
    assert attempts == 1  # waiting for the lease used no attempt


def test_a_worker_killed_during_a_post_leaves_a_lease_that_expires_and_delivery_resumes(
    broker, database_url, subprocess_env, tmp_path
):
    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",)))
    # lease 3 s > job limit 2 s > HTTP deadline 1.5 s: the same order as 20 > 15 > 10
    env = {**subprocess_env, **WEBHOOK_ENV, "STANDMEET_WEBHOOK_LEASE_S": "3",
           "STANDMEET_QUEUE_WEBHOOK_TIME_LIMIT_S": "2", "STANDMEET_WEBHOOK_HTTP_TIMEOUT_S": "1.5"}
    with http_server(hold=True) as (url, server):
        endpoint, _ = webhooks.add_endpoint(url, ["k"])
        _emit(database_url, "k", 1)
        cmd = worker_cmd("--queues", "webhook")
        with running(cmd, env, log=tmp_path / "first.log") as first:
            wait_for(lambda: server.current() == 1, timeout_s=20, what="the POST to be in flight")
            leased = scalar(database_url, "SELECT busy_until > now() FROM standmeet.webhook_endpoints WHERE id = %s",
                            (endpoint,))
            assert leased
            os.kill(first.pid, signal.SIGKILL)
        server.hold = False  # the endpoint answers from now on
        with running(cmd, env, log=tmp_path / "second.log"):
            wait_for(lambda: _succeeded(database_url, endpoint) == 1, timeout_s=30, what="the delivery to resume")
            # and the new worker released its own lease after the POST
            wait_for(lambda: scalar(database_url, "SELECT busy_until IS NULL FROM standmeet.webhook_endpoints"
                                                  " WHERE id = %s", (endpoint,)), timeout_s=10, what="the lease released")
    assert len(server.received) == 2  # the cut-off POST, and the one that succeeded


class _Counting:
    """A loopback endpoint that answers 200 to its first ``answer`` requests, holds the
    next one unanswered until ``release`` is set, and counts every webhook-id it saw."""

    def __init__(self, answer: int) -> None:
        self.answer = answer
        self.lock = threading.Lock()
        self.ids: list[str] = []
        self.holding = threading.Event()
        self.release = threading.Event()

    def handler(self) -> type[BaseHTTPRequestHandler]:
        counting = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with counting.lock:
                    counting.ids.append(self.headers["webhook-id"])
                    hold = len(counting.ids) == counting.answer + 1
                if hold:
                    counting.holding.set()
                    counting.release.wait(60)
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass

        return Handler


def test_a_worker_killed_mid_batch_re_sends_only_the_post_in_flight(broker, database_url, subprocess_env, tmp_path):
    """One job makes a batch of 20 deliveries over a kept-alive connection; the worker is
    SIGKILLed while the 11th POST is in flight. The 10 answered were recorded as they were
    answered: the next worker sends the other 10 once each, the cut one again among them."""
    app_settings.use(replace(app_settings.current(), allowed_networks=("127.0.0.0/8",)))
    # lease 6 s > job limit 5 s > HTTP deadline 3 s; the lease expires soon after the kill
    env = {**subprocess_env, **WEBHOOK_ENV, "STANDMEET_WEBHOOK_LEASE_S": "6",
           "STANDMEET_QUEUE_WEBHOOK_TIME_LIMIT_S": "5", "STANDMEET_WEBHOOK_HTTP_TIMEOUT_S": "3"}
    deliveries, answered = 20, 10
    counting = _Counting(answered)
    server = ThreadingHTTPServer(("127.0.0.1", 0), counting.handler())
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="test-counting-http", daemon=True).start()
    try:
        endpoint, _ = webhooks.add_endpoint(f"http://127.0.0.1:{server.server_address[1]}/hook", ["batch"])
        with psycopg.connect(database_url) as conn, conn.transaction():
            events = [webhooks.emit_event(conn, "batch", {"n": n}) for n in range(deliveries)]
        for event in events:  # every delivery written before the worker runs: one batch takes them all
            webhooks.fanout.fn(event)
        cmd = worker_cmd("--queues", "webhook")
        with running(cmd, env, log=tmp_path / "killed.log") as first:
            assert counting.holding.wait(30), "the 11th POST never arrived"
            os.kill(first.pid, signal.SIGKILL)
            first.wait(10)
        recorded = scalar(database_url, "SELECT count(*) FROM standmeet.webhook_attempts a JOIN"
                                        " standmeet.webhook_deliveries d ON d.id = a.delivery_id"
                                        " WHERE d.endpoint_id = %s", (endpoint,))
        counting.release.set()
        with running(cmd, env, log=tmp_path / "next.log"):
            wait_for(lambda: _succeeded(database_url, endpoint) == deliveries, timeout_s=60,
                     what="every delivery to succeed")
    finally:
        counting.release.set()
        server.shutdown()
        server.server_close()
    assert recorded == answered  # each answered POST was recorded before the next was sent
    sent = Counter(counting.ids)
    assert len(sent) == deliveries
    assert sorted(sent.values()) == [1] * (deliveries - 1) + [2], sent  # only the POST in flight, again
