"""Fast webhook endpoints in a process of their own: ``python bench/endpoints.py N``.

Serves N HTTP/1.1 endpoints on loopback (ephemeral ports, keep-alive, ``200 ok`` to
every request), prints their URLs one a line, then ``ready``, and serves until stdin
closes. The deliveries benchmark runs them beside the worker so the figure is the
worker process's own: endpoints served by threads of the worker itself (the test
suite's ``http_server``) spent as much of its CPU as the deliveries did.

Each connection is an asyncio protocol that frames requests itself (the head up to its
blank line, then ``Content-Length`` bytes of body): ~70 µs of CPU per request where
asyncio's streams took ~90, on a machine whose two cores the worker and Postgres share.
"""

from __future__ import annotations

import asyncio
import sys

REPLY = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"
#: A request head larger than this ends the connection.
MAX_HEAD = 64 * 1024


class Endpoint(asyncio.Protocol):
    """One keep-alive connection: answers each whole request (head and body) in turn."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.body_left = -1  # bytes of the current request's body still to come; -1: reading a head
        self.close_after = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        assert self.transport is not None
        self.buffer += data
        while True:
            if self.body_left < 0:
                end = self.buffer.find(b"\r\n\r\n")
                if end < 0:
                    if len(self.buffer) > MAX_HEAD:
                        self.transport.close()
                    return
                self.body_left, self.close_after = _framing(bytes(self.buffer[:end]))
                del self.buffer[:end + 4]
            if len(self.buffer) < self.body_left:
                return
            del self.buffer[:self.body_left]
            self.body_left = -1
            self.transport.write(CLOSE if self.close_after else REPLY)
            if self.close_after:
                self.transport.close()
                return


def _framing(head: bytes) -> tuple[int, bool]:
    """The body's length and whether the client asked to close, from a request head."""
    length, close = 0, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"connection" and value.strip().lower() == b"close":
            close = True
    return length, close


async def main(count: int) -> None:
    loop = asyncio.get_running_loop()
    servers = [await loop.create_server(Endpoint, "127.0.0.1", 0) for _ in range(count)]
    for server in servers:
        print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook", flush=True)
    print("ready", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # until the benchmark closes our stdin
    for server in servers:
        server.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
