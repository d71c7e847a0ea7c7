"""A real HTTP server on loopback that counts what it sees (for concurrency claims)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Observed:
    lock: threading.Lock = field(default_factory=threading.Lock)
    in_flight: int = 0
    max_in_flight: int = 0
    received: list[bytes] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    hold: bool = False
    status: int = 200
    delay_s: float = 0.0
    headers: list[dict[str, str]] = field(default_factory=list)
    started: list[float] = field(default_factory=list)

    def current(self) -> int:
        with self.lock:
            return self.in_flight


class _Handler(BaseHTTPRequestHandler):
    observed: Observed

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass

    def do_POST(self) -> None:
        obs = self.observed
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length)
        with obs.lock:
            obs.in_flight += 1
            obs.max_in_flight = max(obs.max_in_flight, obs.in_flight)
            obs.received.append(body)
            obs.headers.append({k.lower(): v for k, v in self.headers.items()})
            obs.started.append(time.monotonic())
        try:
            if obs.hold:
                obs.release.wait(60)
            elif obs.delay_s:
                time.sleep(obs.delay_s)
            self.send_response(obs.status)
            self.send_header("Content-Length", "2")
            self.end_headers()
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            # no longer in flight before the response's last bytes go out: a client that has
            # the whole response may send its next request at once, and that one must not
            # look concurrent with this one
            with obs.lock:
                obs.in_flight -= 1
        try:
            self.wfile.write(b"ok")
        except (BrokenPipeError, ConnectionResetError):
            pass


@contextmanager
def http_server(*, hold: bool = False, status: int = 200, delay_s: float = 0.0) -> Iterator[tuple[str, Observed]]:
    """Serve on 127.0.0.1 (an ephemeral port); yields (url, what it observed)."""
    observed = Observed(hold=hold, status=status, delay_s=delay_s)
    handler = type("Handler", (_Handler,), {"observed": observed})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="test-http", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/hook", observed
    finally:
        observed.release.set()
        server.shutdown()
        server.server_close()
