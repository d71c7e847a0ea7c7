"""Fast webhook endpoints in a process of their own: ``python bench/endpoints.py N``.

Serves N HTTP/1.1 endpoints on loopback (ephemeral ports, keep-alive, ``200 ok`` to
every request), prints their URLs one a line, then ``ready``, and serves until stdin
closes. The deliveries benchmark runs them beside the worker so the figure is the
worker process's own: endpoints served by threads of the worker itself (the test
suite's ``http_server``) spent as much of its CPU as the deliveries did.
"""

from __future__ import annotations

import asyncio
import sys

REPLY = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\n\r\nok"
CLOSE = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


async def serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length, close = 0, False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"content-length":
                    length = int(value)
                elif name == b"connection" and value.strip().lower() == b"close":
                    close = True
            if length:
                await reader.readexactly(length)
            writer.write(CLOSE if close else REPLY)
            await writer.drain()
            if close:
                break
    except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


async def main(count: int) -> None:
    servers = [await asyncio.start_server(serve_one, "127.0.0.1", 0) for _ in range(count)]
    for server in servers:
        print(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/hook", flush=True)
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, sys.stdin.read)  # until the benchmark closes our stdin
    for server in servers:
        server.close()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 20))
