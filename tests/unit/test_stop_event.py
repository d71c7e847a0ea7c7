"""A thread's stop event can be waited on among sockets: its descriptor turns readable
once it is set, so a loop sleeping on a socket notices its stop without waking to look."""

from __future__ import annotations

import select
import socket
import threading

from broker.detach import StopEvent, go
from broker.pg.pool import readable


def readable_now(fd: int) -> bool:
    # poll, not select: in a long test run this process holds descriptors past select's 1024
    return bool(readable([fd], 0))


def test_its_descriptor_turns_readable_when_it_is_set_not_before():
    stop = StopEvent()
    fd = stop.fileno()
    assert not readable_now(fd)
    stop.set()
    assert readable_now(fd) and stop.is_set()


def test_a_descriptor_asked_for_after_it_was_set_is_readable_at_once():
    stop = StopEvent()
    stop.set()
    assert readable_now(stop.fileno())


def test_a_thread_sleeping_on_a_socket_and_its_stop_wakes_when_stopped():
    # Given a thread polling a socket nobody writes to, and its stop's descriptor, with no timeout
    quiet, other_end = socket.socketpair()
    woken = threading.Event()

    def sleeper(stop: threading.Event) -> None:
        assert isinstance(stop, StopEvent)
        poller = select.poll()
        for fd in (quiet.fileno(), stop.fileno()):
            poller.register(fd, select.POLLIN)
        poller.poll()  # no timeout: only a descriptor can end it
        woken.set()

    thread = go("sleeper", sleeper)
    # When it is stopped
    assert thread.stop(timeout_s=10)
    # Then it woke from the poll
    assert woken.is_set()
    quiet.close()
    other_end.close()
