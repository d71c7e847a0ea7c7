"""The wall-clock watchdog: it fires once its time has passed, never after a cancel, and
shutting a socket down from it unblocks a read that no timeout bounds."""

from __future__ import annotations

import socket
import threading
import time

from broker import deadline


def test_the_watchdog_fires_after_its_time_and_not_once_cancelled():
    fired = threading.Event()
    start = time.monotonic()
    with deadline.watchdog(0.2, fired.set) as alarm:
        assert fired.wait(2.0)
    assert 0.18 <= time.monotonic() - start < 1.0 and alarm.fired
    cancelled = threading.Event()
    with deadline.watchdog(0.1, cancelled.set) as early:
        pass
    later = threading.Event()
    with deadline.watchdog(0.3, later.set):
        assert later.wait(2.0)  # an alarm due after the cancelled one has fired, so that one had its chance
    assert not cancelled.is_set() and not early.fired


def test_a_read_blocked_without_any_timeout_is_unblocked_by_the_watchdog():
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    server_side, _ = listener.accept()
    try:
        client.settimeout(None)  # a peer that sends nothing: this read would wait for ever
        start = time.monotonic()
        with deadline.watchdog(0.3, lambda: socket.socket.shutdown(client, socket.SHUT_RDWR)):
            data = client.recv(1)
        assert data == b"" and 0.28 <= time.monotonic() - start < 2.0
    finally:
        for s in (client, server_side, listener):
            s.close()
