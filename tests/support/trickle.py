"""HTTP endpoints on loopback that answer slowly on purpose, one byte at a time."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def trickling_headers_server(*, every_s: float = 0.1) -> Iterator[str]:
    """Reads the request, then sends its status line and one header byte every
    ``every_s`` seconds for a minute: each read succeeds well within any per-read
    timeout, and the headers never end."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nX-Slow: ")
                end = time.monotonic() + 60
                while not stop.is_set() and time.monotonic() < end:
                    conn.sendall(b"a")
                    stop.wait(every_s)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), name="test-trickle-conn", daemon=True).start()

    threading.Thread(target=accept, name="test-trickle", daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/hook"
    finally:
        stop.set()
        try:  # wakes the blocked accept()
            listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        listener.close()
