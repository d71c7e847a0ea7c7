"""A TCP proxy in front of Postgres that a test can cut: a database outage on demand.

``cut()`` closes every proxied connection and refuses new ones (accepts and closes
them at once, as a server that is down behind a load balancer does); ``restore()``
lets connections through again; ``connect_delay_s`` makes new connections wait (a
server slow to accept). Works in front of a TCP server or the embedded
server's Unix socket. Tests may own threads; this one runs the proxy.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from broker.pg.pool import readable


class PostgresProxy:
    def __init__(self, url: str) -> None:
        params = conninfo_to_dict(url)
        host = str(params.get("host") or "127.0.0.1")
        port = int(params.get("port") or 5432)
        self._upstream: tuple[int, Any] = (
            (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}") if host.startswith("/") else (socket.AF_INET, (host, port))
        )
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        params.update(host="127.0.0.1", port=str(self.port))
        self.url = make_conninfo(**params)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._down = False
        self._stopped = False
        self.refused = 0
        #: each new connection reaches the server only this long after it was accepted
        self.connect_delay_s = 0.0
        threading.Thread(target=self._accept_loop, name="pg-proxy", daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self._down = True
            sockets, self._open = list(self._open), set()
        for s in sockets:
            _close(s)

    def restore(self) -> None:
        with self._lock:
            self._down = False

    def close(self) -> None:
        self._stopped = True
        self.cut()
        _close(self._listener)

    def _accept_loop(self) -> None:
        while not self._stopped:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                down = self._down
            if down:
                self.refused += 1
                _close(client)
                continue
            if self.connect_delay_s > 0:  # a server slow to accept: this one waits, not the others
                threading.Thread(target=self._link_later, args=(client, self.connect_delay_s),
                                 name="pg-proxy-delay", daemon=True).start()
            else:
                self._link(client)

    def _link_later(self, client: socket.socket, delay_s: float) -> None:
        time.sleep(delay_s)
        self._link(client)

    def _link(self, client: socket.socket) -> None:
        family, address = self._upstream
        server = socket.socket(family, socket.SOCK_STREAM)
        try:
            server.connect(address)
        except OSError:
            _close(client)
            _close(server)
            return
        with self._lock:
            self._open.update((client, server))
        threading.Thread(target=self._pump, args=(client, server), name="pg-proxy-pump", daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        peers = {a: b, b: a}
        by_fd = {sock.fileno(): sock for sock in peers}
        try:
            while True:
                # poll, not select: the suite's process may hold over 1024 descriptors
                ready = [by_fd[fd] for fd in readable(list(by_fd), 1.0)]
                with self._lock:
                    if a not in self._open:
                        return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    peers[sock].sendall(data)
        except OSError:
            return
        finally:
            with self._lock:
                self._open.discard(a)
                self._open.discard(b)
            _close(a)
            _close(b)


def _close(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
