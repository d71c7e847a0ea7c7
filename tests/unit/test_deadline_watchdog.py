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


def test_arming_wakes_the_watchdog_only_for_an_alarm_earlier_than_all_the_others():
    # Given a watchdog whose wake-ups are counted
    class Counting(threading.Condition):
        notified = 0

        def notify(self, n: int = 1) -> None:
            Counting.notified += 1
            super().notify(n)

    dog = deadline._Watchdog()
    dog._cond = Counting()
    fired = threading.Event()
    try:
        # When alarms are armed: a late one, a later one, then an early one
        late = dog.arm(5.0, lambda: None)
        later = dog.arm(6.0, lambda: None)
        start = time.monotonic()
        early = dog.arm(0.1, fired.set)
        # Then only the first and the earliest woke it, and the earliest still fired on time
        assert Counting.notified == 2
        assert fired.wait(2.0) and time.monotonic() - start < 0.9
    finally:
        for alarm in (late, later, early):
            dog.cancel(alarm)
        dog._thread.stop_event.set()
        with dog._cond:
            dog._cond.notify_all()
        dog._thread.join(2.0)
