"""The /metrics endpoint `run` serves: a client that idles holds none of the other
scrapes, and scrapes that come together read the database once, on one connection."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import psycopg
from prometheus_client import CollectorRegistry, generate_latest

from broker.observability.metrics import DatabaseCollector, registry_for, serve
from tests.support.db import scalar, wait_for


def test_a_client_that_sends_half_a_request_and_idles_holds_no_other_scrape(broker, database_url):
    # Given the endpoint, and a client that sent half a request line and went quiet
    server = serve(registry_for(database_url, multiprocess_dir=None, rescue_after_s=20), "127.0.0.1", 0)
    idle = socket.create_connection(("127.0.0.1", server.port))
    try:
        idle.sendall(b"GET /metrics HTTP/1.1\r\n")
        # When another client scrapes
        started = time.monotonic()
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        # Then it has its answer at once, the database read
        assert time.monotonic() - started < 5
        assert "standmeet_database_up 1.0" in body
    finally:
        idle.close()
        server.stop()


def test_scrapes_made_together_while_the_database_is_slow_read_it_on_one_connection(broker, database_url):
    # Given a queue table locked by another session, so a reading waits for it
    def scrape() -> None:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(DatabaseCollector(database_url, timeout_s=30))
        generate_latest(registry)

    with psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE dramatiq.queue IN ACCESS EXCLUSIVE MODE")
        # When ten scrapes come together (as a dashboard's refreshes or several scrapers)
        scrapes = [threading.Thread(target=scrape) for _ in range(10)]
        for thread in scrapes:
            thread.start()
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM pg_stat_activity"
                                              " WHERE application_name = 'standmeet-metrics'") >= 1,
                 timeout_s=10, what="a reading to wait for the lock")
        # Then only one connection reads at a time
        readers = scalar(database_url, "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'standmeet-metrics'")
        locker.rollback()
    for thread in scrapes:
        thread.join(timeout=30)
    assert readers == 1
    assert not any(thread.is_alive() for thread in scrapes)


def test_requests_that_could_get_no_thread_give_their_slot_back(broker, database_url, monkeypatch):
    from broker.observability import metrics

    # Given the endpoint, while no thread can be started for a request
    server = serve(registry_for(database_url, multiprocess_dir=None, rescue_after_s=20), "127.0.0.1", 0)
    real_go = metrics.detach.go

    def no_thread(name, fn):
        if name == "metrics-request":
            raise RuntimeError("can't start new thread")
        return real_go(name, fn)

    try:
        monkeypatch.setattr(metrics.detach, "go", no_thread)
        for _ in range(metrics.MOST_REQUESTS + 2):  # more than it has slots
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read()
            except OSError:
                pass  # hung up on: no thread to answer
        # When threads can be had again
        monkeypatch.setattr(metrics.detach, "go", real_go)
        # Then a scrape is answered: no slot stayed taken
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=5).read().decode()
        assert "standmeet_database_up" in body
    finally:
        server.stop()


def test_a_client_that_trickles_its_request_is_hung_up_on_at_the_requests_deadline(broker, database_url, monkeypatch):
    from broker.observability import metrics

    # Given the endpoint with a one-second deadline a request
    monkeypatch.setattr(metrics, "REQUEST_MOST_S", 1.0)
    server = serve(registry_for(database_url, multiprocess_dir=None, rescue_after_s=20), "127.0.0.1", 0)
    client = socket.create_connection(("127.0.0.1", server.port))
    try:
        # When a client sends its request a byte at a time, each well within the read timeout
        started = time.monotonic()
        closed = False
        for byte in b"GET /metrics HTTP/1.1\r\nHost: x\r\n" * 10:
            try:
                client.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            client.settimeout(0.2)  # the trickle's pace: the client waits for an answer meanwhile
            try:
                if client.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
            except OSError:
                closed = True
                break
            if time.monotonic() - started > 10:
                break
        # Then the server hung up on it at about its deadline, not after its whole trickle
        assert closed and time.monotonic() - started < 5
    finally:
        client.close()
        server.stop()
