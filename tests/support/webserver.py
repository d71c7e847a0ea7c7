"""A scriptable HTTP server on loopback that records every request (feeds, APIs)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Request:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, data: Any, status: int = 200, **headers: str) -> Reply:
        return cls(status, json.dumps(data).encode(), {"Content-Type": "application/json", **headers})


Route = Callable[[Request], Reply]


@dataclass
class Server:
    base: str
    requests: list[Request] = field(default_factory=list)
    routes: dict[tuple[str, str], Route] = field(default_factory=dict)

    def on(self, method: str, path: str, route: Route) -> None:
        self.routes[(method, path)] = route


@contextmanager
def web_server() -> Iterator[Server]:
    holder: dict[str, Server] = {}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: object) -> None:
            pass

        def _handle(self) -> None:
            server = holder["server"]
            length = int(self.headers.get("Content-Length") or 0)
            request = Request(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                              self.rfile.read(length) if length else b"")
            with lock:
                server.requests.append(request)
            path = self.path.split("?", 1)[0]
            route = server.routes.get((self.command, path))
            reply = route(request) if route else Reply(404, b"not found")
            self.send_response(reply.status)
            for k, v in reply.headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(reply.body)))
            self.end_headers()
            if reply.body and reply.status != 304:
                self.wfile.write(reply.body)

        do_GET = do_POST = do_DELETE = do_PUT = _handle

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    holder["server"] = Server(f"http://127.0.0.1:{httpd.server_address[1]}")
    thread = threading.Thread(target=httpd.serve_forever, name="test-web", daemon=True)
    thread.start()
    try:
        yield holder["server"]
    finally:
        httpd.shutdown()
        httpd.server_close()
