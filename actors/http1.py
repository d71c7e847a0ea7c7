"""One HTTP/1.1 exchange over a connection to an address already checked, kept alive between calls.

The guarded request (:mod:`actors.http`) needs little of a general HTTP client: one
request to a pinned address, the body read up to a cap, no redirects, no cookies, no
proxies, no compression. httpx and httpcore did that with a request model, a state
machine and a pool lock per call, several times the CPU of the exchange itself; this
module writes the request as bytes and reads the response framing (RFC 9112) itself.

What it guarantees:

* it connects to the given address only (never resolves a name), presenting the given
  Host header and, for https, verifying the certificate against the given server name;
* every socket operation waits at most for what remains of the caller's deadline
  (``left_s()``), and the raw socket is handed to ``on_socket`` so a watchdog can shut it
  down whatever the exchange is blocked in;
* the response head is refused over :data:`MAX_HEAD_BYTES`, the body is read up to
  ``max_bytes`` and no further; a connection goes back to the pool only when its
  response was read whole, framed by length or chunks, and neither side asked to close;
* a pooled connection is reused only while it is younger than :data:`KEEPALIVE_S` idle
  and has nothing to read (a peer that closed it is noticed before the request is sent);
  one the peer closes as the request goes out (no byte of a response came back) is
  replaced by a new connection once: the receiver may then see the request twice, as
  at-least-once delivery allows, rather than a failure recorded for a race.

Errors are httpx's (``httpx.ConnectError``, ``httpx.ConnectTimeout``,
``httpx.ReadTimeout``, ``httpx.WriteTimeout``, ``httpx.ReadError``,
``httpx.WriteError``, ``httpx.RemoteProtocolError``, ``httpx.LocalProtocolError``):
the one vocabulary the actors already classify.
"""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

import httpx

#: A response head (status line and headers) larger than this is refused.
MAX_HEAD_BYTES = 64 * 1024
#: A chunk-size line longer than this is refused.
MAX_CHUNK_LINE = 1024
#: A pooled connection idle longer than this is closed rather than reused (below the
#: 5 s keep-alive timeout common servers apply, so the peer rarely closes it first).
KEEPALIVE_S = 4.0
#: Idle connections kept, in all.
MAX_IDLE = 32
#: Bytes asked of the socket per read.
READ_SIZE = 65536

#: Characters left as they are in a request's path and query; anything else (spaces,
#: control characters, non-ASCII) is percent-encoded, so a URL can never split the
#: request line.
_PATH_SAFE = "/%:@!$&'()*+,;=-._~"
_QUERY_SAFE = _PATH_SAFE + "?"

Key = tuple[str, str, int, str]


@dataclass(frozen=True)
class Reply:
    """A response: status, headers (in order, as received), body up to the cap."""

    status_code: int
    headers: list[tuple[str, str]]
    body: bytes
    truncated: bool


class BodyTooLarge(Exception):
    """The body is over the cap and the caller asked to refuse it."""


class _Connection:
    """One socket to one checked address (TLS-wrapped for https) and what it has read ahead."""

    __slots__ = ("key", "raw", "sock", "buffer", "idle_since", "answered")

    def __init__(self, key: Key, raw: socket.socket, sock: socket.socket) -> None:
        self.key, self.raw, self.sock = key, raw, sock
        self.buffer = bytearray()
        self.idle_since = 0.0
        self.answered = False  # a byte of the current response has arrived

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def fresh(self, now: float) -> bool:
        """Young enough to reuse, and nothing to read: a readable idle socket is a peer's
        close (or bytes no request asked for)."""
        if now - self.idle_since > KEEPALIVE_S or self.buffer:
            return False
        try:
            readable, _, _ = select.select([self.raw], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable


class Pool:
    """Idle keep-alive connections, by (scheme, address, port, server name)."""

    def __init__(self, *, max_idle: int = MAX_IDLE) -> None:
        self._idle: dict[Key, list[_Connection]] = {}
        self._count = 0
        self._max_idle = max_idle
        self._lock = threading.Lock()

    def take(self, key: Key) -> _Connection | None:
        now = time.monotonic()
        while True:
            with self._lock:
                stack = self._idle.get(key)
                if not stack:
                    return None
                conn = stack.pop()  # the most recently used: the least likely to be closed
                self._count -= 1
            if conn.fresh(now):
                return conn
            conn.close()

    def give(self, conn: _Connection) -> None:
        conn.idle_since, conn.answered = time.monotonic(), False
        evicted: _Connection | None = None
        with self._lock:
            if self._count >= self._max_idle:
                evicted = self._oldest()
            self._idle.setdefault(conn.key, []).append(conn)
            self._count += 1
        if evicted is not None:
            evicted.close()

    def _oldest(self) -> _Connection | None:
        """Remove and return the connection idle the longest (the lock is held)."""
        oldest_key = min((k for k, v in self._idle.items() if v), key=lambda k: self._idle[k][0].idle_since,
                         default=None)
        if oldest_key is None:
            return None
        stack = self._idle[oldest_key]
        conn = stack.pop(0)
        if not stack:
            del self._idle[oldest_key]
        self._count -= 1
        return conn

    def close(self) -> None:
        with self._lock:
            idle, self._idle, self._count = self._idle, {}, 0
        for stack in idle.values():
            for conn in stack:
                conn.close()


def request_line_target(url: str) -> str:
    """The request target of ``url`` (path and query, percent-encoded where needed)."""
    parts = urlsplit(url)
    target = quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=_QUERY_SAFE)
    return target


def _head_bytes(method: str, target: str, headers: dict[str, str], content: bytes | None) -> bytes:
    lines = [f"{method} {target} HTTP/1.1"]
    for name, value in headers.items():
        if not name or any(c in name for c in " \t\r\n:\0") or any(c in value for c in "\r\n\0"):
            raise httpx.LocalProtocolError(f"the header {name!r} cannot be sent")
        lines.append(f"{name}: {value}")
    if content is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(content or b'')}")
    try:
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
    except UnicodeEncodeError:
        raise httpx.LocalProtocolError("a request header holds a character outside ASCII") from None


class Exchange:
    """One request and its response on one connection, every wait capped by ``left_s()``."""

    def __init__(self, pool: Pool, tls: Callable[[], ssl.SSLContext], left_s: Callable[[], float],
                 on_socket: Callable[[socket.socket | None], None]) -> None:
        self._pool, self._tls, self._left_s, self._on_socket = pool, tls, left_s, on_socket

    def _wait(self, sock: socket.socket, error: type[httpx.TimeoutException]) -> None:
        left = self._left_s()
        if left <= 0:
            raise error("the request's total deadline has passed")
        sock.settimeout(left)

    def _connect(self, key: Key) -> _Connection:
        scheme, address, port, server_name = key
        left = self._left_s()
        if left <= 0:
            raise httpx.ConnectTimeout("the request's total deadline has passed")
        try:
            raw = socket.create_connection((address, port), timeout=left)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {address}:{port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        self._on_socket(raw)
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock = raw
            if scheme == "https":
                self._wait(raw, httpx.ConnectTimeout)
                sock = self._tls().wrap_socket(raw, server_hostname=server_name)
        except TimeoutError as exc:
            raw.close()
            raise httpx.ConnectTimeout(f"the TLS handshake with {address}:{port} timed out") from exc
        except httpx.HTTPError:
            raw.close()
            raise
        except (OSError, ssl.SSLError, ValueError) as exc:  # ssl.CertificateError is a ValueError too
            raw.close()
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return _Connection(key, raw, sock)

    def send(self, method: str, key: Key, target: str, headers: dict[str, str], content: bytes | None, *,
             max_bytes: int, refuse_larger: bool = False) -> Reply:
        """Send the request on a pooled connection or a new one; read the response. A pooled
        connection that fails before a byte of the response arrives (the peer closed it as
        it was taken) is replaced by a new one, once."""
        head = _head_bytes(method, target, headers, content)
        pooled = self._pool.take(key)
        if pooled is not None:
            try:
                return self._exchange(pooled, method, head, content, max_bytes, refuse_larger)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                if pooled.answered:
                    raise
        return self._exchange(self._connect(key), method, head, content, max_bytes, refuse_larger)

    def _exchange(self, conn: _Connection, method: str, head: bytes, content: bytes | None, max_bytes: int,
                  refuse_larger: bool) -> Reply:
        self._on_socket(conn.raw)
        keep = False
        try:
            self._write(conn, head + content if content and len(content) < READ_SIZE else head)
            if content and len(content) >= READ_SIZE:
                self._write(conn, content)
            reply, keep = self._read_response(conn, method, max_bytes, refuse_larger)
            return reply
        finally:
            self._on_socket(None)
            if keep:
                self._pool.give(conn)
            else:
                conn.close()

    def _write(self, conn: _Connection, data: bytes) -> None:
        self._wait(conn.sock, httpx.WriteTimeout)
        try:
            conn.sock.sendall(data)
        except TimeoutError as exc:
            raise httpx.WriteTimeout("writing the request timed out") from exc
        except OSError as exc:
            raise httpx.WriteError(str(exc)) from exc

    def _fill(self, conn: _Connection) -> bool:
        """Read more into the connection's buffer; False at the peer's end of stream."""
        self._wait(conn.sock, httpx.ReadTimeout)
        try:
            data = conn.sock.recv(READ_SIZE)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("reading the response timed out") from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc)) from exc
        if data:
            conn.buffer += data
            conn.answered = True
        return bool(data)

    def _line(self, conn: _Connection, limit: int, what: str) -> bytes:
        """One CRLF-ended line (without it), refused beyond ``limit`` bytes."""
        while True:
            end = conn.buffer.find(b"\r\n")
            if end >= 0:
                line = bytes(conn.buffer[:end])
                del conn.buffer[:end + 2]
                return line
            if len(conn.buffer) > limit:
                raise httpx.RemoteProtocolError(f"the response's {what} is over {limit} bytes")
            if not self._fill(conn):
                raise httpx.RemoteProtocolError(f"the server closed the connection inside the response's {what}")

    def _head(self, conn: _Connection) -> tuple[bytes, int, list[tuple[str, str]]]:
        while True:
            end = conn.buffer.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(conn.buffer) > MAX_HEAD_BYTES:
                raise httpx.RemoteProtocolError(f"the response head is over {MAX_HEAD_BYTES} bytes")
            if not self._fill(conn):
                if not conn.buffer:
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
                raise httpx.RemoteProtocolError("the server closed the connection inside the response head")
        if end + 4 > MAX_HEAD_BYTES:
            raise httpx.RemoteProtocolError(f"the response head is over {MAX_HEAD_BYTES} bytes")
        head = bytes(conn.buffer[:end])
        del conn.buffer[:end + 4]
        status_line, *lines = head.split(b"\r\n")
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit() \
                or rest[3:4] not in (b"", b" "):
            raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        headers: list[tuple[str, str]] = []
        for line in lines:
            name, colon, value = line.partition(b":")
            if not colon or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
                raise httpx.RemoteProtocolError(f"a malformed response header line: {line[:80]!r}")
            headers.append((name.decode("latin-1"), value.strip(b" \t").decode("latin-1")))
        return version, int(code), headers

    def _read_response(self, conn: _Connection, method: str, max_bytes: int,
                       refuse_larger: bool) -> tuple[Reply, bool]:
        while True:
            version, status, headers = self._head(conn)
            if status == 101 or not 100 <= status < 600:
                raise httpx.RemoteProtocolError(f"an unexpected status {status}")
            if status >= 200:
                break  # an interim 1xx response is skipped
        lengths, chunked, encoded, close = set(), False, False, version == b"HTTP/1.0"
        for name, value in headers:
            lower = name.lower()
            if lower == "content-length":
                lengths.add(value)
            elif lower == "transfer-encoding":
                encoded = True
                chunked = value.lower().rsplit(",", 1)[-1].strip() == "chunked"
            elif lower == "connection":
                tokens = {t.strip().lower() for t in value.split(",")}
                close = close and "keep-alive" not in tokens or "close" in tokens
        if method == "HEAD" or status in (204, 304):
            return Reply(status, headers, b"", False), not close
        if encoded:
            if chunked:
                body, truncated = self._chunked(conn, max_bytes, refuse_larger)
                return Reply(status, headers, body, truncated), not (close or truncated or lengths)
            body, truncated = self._until_close(conn, max_bytes, refuse_larger)
            return Reply(status, headers, body, truncated), False
        if lengths:
            if len(lengths) > 1 or not next(iter(lengths)).isdigit():
                raise httpx.RemoteProtocolError(f"an invalid Content-Length: {sorted(lengths)}")
            body, truncated = self._sized(conn, int(next(iter(lengths))), max_bytes, refuse_larger)
            return Reply(status, headers, body, truncated), not (close or truncated)
        body, truncated = self._until_close(conn, max_bytes, refuse_larger)
        return Reply(status, headers, body, truncated), False

    @staticmethod
    def _over(refuse_larger: bool, max_bytes: int) -> None:
        if refuse_larger:
            raise BodyTooLarge(f"the response is larger than {max_bytes} bytes")

    def _sized(self, conn: _Connection, length: int, max_bytes: int, refuse_larger: bool) -> tuple[bytes, bool]:
        if length > max_bytes:
            self._over(refuse_larger, max_bytes)
        want = min(length, max_bytes)
        while len(conn.buffer) < want:
            if not self._fill(conn):
                raise httpx.RemoteProtocolError("the server closed the connection inside the response body")
        body = bytes(conn.buffer[:want])
        del conn.buffer[:want]
        return body, length > max_bytes

    def _until_close(self, conn: _Connection, max_bytes: int, refuse_larger: bool) -> tuple[bytes, bool]:
        while len(conn.buffer) <= max_bytes:
            if not self._fill(conn):
                return bytes(conn.buffer), False
        self._over(refuse_larger, max_bytes)
        return bytes(conn.buffer[:max_bytes]), True

    def _chunked(self, conn: _Connection, max_bytes: int, refuse_larger: bool) -> tuple[bytes, bool]:
        body = bytearray()
        while True:
            size_text = self._line(conn, MAX_CHUNK_LINE, "chunk size").split(b";", 1)[0].strip()
            if not size_text or size_text.strip(b"0123456789abcdefABCDEF"):
                raise httpx.RemoteProtocolError(f"an invalid chunk size: {size_text[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                while self._line(conn, MAX_HEAD_BYTES, "trailer"):
                    pass
                return bytes(body), False
            if len(body) + size > max_bytes:
                self._over(refuse_larger, max_bytes)
                want = max_bytes - len(body)
                while len(conn.buffer) < want:
                    if not self._fill(conn):
                        break
                body += conn.buffer[:want]
                return bytes(body), True
            while len(conn.buffer) < size + 2:
                if not self._fill(conn):
                    raise httpx.RemoteProtocolError("the server closed the connection inside a chunk")
            if conn.buffer[size:size + 2] != b"\r\n":
                raise httpx.RemoteProtocolError("a chunk not followed by CRLF")
            body += conn.buffer[:size]
            del conn.buffer[:size + 2]
