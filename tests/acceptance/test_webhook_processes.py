"""Across processes: ≤ 1 delivery in flight per endpoint; a dead worker's lease expires."""

from __future__ import annotations

import os
import signal

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
