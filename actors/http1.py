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
  (``left_s()``), and the socket is handed to ``on_socket`` (from before the TLS
  handshake) so a watchdog can shut it down whatever the exchange is blocked in;
* nothing a server sends is held without bound: the response head is refused over
  :data:`MAX_HEAD_BYTES` (trailers too), a chunk-size line over :data:`MAX_CHUNK_LINE_BYTES`,
  more than :data:`MAX_INTERIM` interim responses; the body is read up to ``max_bytes``;
* header lines holding CR, LF or NUL, a Content-Length that is not one decimal number,
  and a chunk size that is not hexadecimal are protocol errors, never guessed at;
* a connection goes back to the pool only when its HTTP/1.1 response was read whole,
  framed unambiguously (a Content-Length, or chunked without one), and neither side
  asked to close; a pooled connection is reused only while younger than
  :data:`KEEPALIVE_S` idle and with nothing to read;
* one the peer closes as the request goes out (no byte of a response came back) is
  replaced by a new connection once: the receiver may then see the request twice, as
  at-least-once delivery allows, rather than a failure recorded for a race;
* a response the server sends before it has read the whole request (a 413, say) is
  returned, not hidden behind the error of the write it cut short.

Errors are httpx's (``httpx.ConnectError``, ``httpx.ConnectTimeout``,
``httpx.ReadTimeout``, ``httpx.WriteTimeout``, ``httpx.ReadError``,
``httpx.WriteError``, ``httpx.RemoteProtocolError``, ``httpx.LocalProtocolError``):
the one vocabulary the actors already classify.
"""

from __future__ import annotations

import functools
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import quote, urlsplit

import httpx

from broker.errors import StandmeetError

#: A response head (status line and headers) larger than this is refused; so are
#: trailers larger than this in all.
MAX_HEAD_BYTES = 64 * 1024
#: A chunk-size line longer than this is refused.
MAX_CHUNK_LINE_BYTES = 1024
#: More interim (1xx) responses than this before the final one are refused.
MAX_INTERIM = 16
#: A pooled connection idle longer than this is closed rather than reused (below the
#: 5 s keep-alive timeout common servers apply, so the peer rarely closes it first).
KEEPALIVE_S = 4.0
#: Idle connections kept, in all.
MAX_IDLE = 32
#: Bytes asked of the socket per read.
READ_BYTES = 65536

#: Characters left as they are in a request's path and query; anything else (spaces,
#: control characters, quotes, angle brackets, non-ASCII) is percent-encoded, so a URL
#: can never split the request line.
_PATH_SAFE = "/%:@!$&'()*+,;=-._~[]"
_QUERY_SAFE = _PATH_SAFE + "?"
#: RFC 9110 tokens: a method, a header name.
_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_HEX = re.compile(rb"[0-9A-Fa-f]{1,15}")
_BAD_IN_VALUE = re.compile(r"[\r\n\0]")
_BAD_IN_LINE = re.compile(rb"[\r\n\0]")
#: Request headers this module writes itself from what it sends; a caller's are dropped.
_FRAMING = frozenset({"content-length", "transfer-encoding"})
#: How an idle connection is checked for a peer's close: poll(2) where the platform has
#: it (no descriptor limit, nothing to create in the kernel), select(2) elsewhere (Windows).
_HAS_POLL = hasattr(select, "poll")


class Key(NamedTuple):
    """Where a connection goes: a checked address, and the name TLS verifies."""

    scheme: str
    address: str
    port: int
    server_name: str


@dataclass(frozen=True)
class Reply:
    """A response: status, headers (raw, in order, as received), body up to the cap, and
    the HTTP version of its status line (``"1.1"`` or ``"1.0"``)."""

    status_code: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    truncated: bool
    version: str = "1.1"


class ResponseTooLarge(StandmeetError):
    """The response body is over the cap the caller asked to refuse beyond."""


class _Connection:
    """One socket to one checked address (TLS-wrapped for https) and what it has read ahead."""

    __slots__ = ("key", "sock", "buffer", "idle_since", "answered")

    def __init__(self, key: Key, sock: socket.socket) -> None:
        self.key, self.sock = key, sock
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
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return False
        try:
            if _HAS_POLL:  # (a poll object directly: a selector's bookkeeping cost as much again)
                check = select.poll()
                check.register(self.sock, select.POLLIN)
                return not check.poll(0)
            return not select.select([self.sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False


class Pool:
    """Idle keep-alive connections, by (scheme, address, port, server name)."""

    def __init__(self, *, max_idle: int = MAX_IDLE) -> None:
        self._idle: dict[Key, list[_Connection]] = {}
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
                if not stack:
                    del self._idle[key]
            if conn.fresh(now):
                return conn
            conn.close()

    def give(self, conn: _Connection) -> None:
        conn.idle_since, conn.answered = time.monotonic(), False
        evicted: _Connection | None = None
        with self._lock:
            if self._idle_count() >= self._max_idle:
                evicted = self._oldest()
            self._idle.setdefault(conn.key, []).append(conn)
        if evicted is not None:
            evicted.close()

    def _oldest(self) -> _Connection | None:
        """Remove and return the connection idle the longest (the lock is held; only keys
        that hold a connection are kept, so there are at most ``max_idle``)."""
        oldest_key = min(self._idle, key=lambda k: self._idle[k][0].idle_since, default=None)
        if oldest_key is None:
            return None
        stack = self._idle[oldest_key]
        conn = stack.pop(0)
        if not stack:
            del self._idle[oldest_key]
        return conn

    def _idle_count(self) -> int:
        return sum(map(len, self._idle.values()))  # at most max_idle connections

    def idle(self) -> int:
        with self._lock:
            return self._idle_count()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for stack in idle.values():
            for conn in stack:
                conn.close()


@functools.lru_cache(maxsize=1024)
def request_line_target(url: str) -> str:
    """The request target of ``url`` (path and query, percent-encoded where needed)."""
    parts = urlsplit(url)
    target = quote(parts.path or "/", safe=_PATH_SAFE)
    if parts.query:
        target += "?" + quote(parts.query, safe=_QUERY_SAFE)
    return target


def _head_bytes(method: str, target: str, headers: dict[str, str], content: bytes | None) -> tuple[bytes, bool]:
    """The request head, and whether the caller asked to close the connection after it.
    Headers are taken once per name whatever its case (the last given wins); the framing
    headers are this module's own."""
    if not _TOKEN.fullmatch(method):
        raise httpx.LocalProtocolError(f"the method {method!r} cannot be sent: not an HTTP token")
    unique: dict[str, tuple[str, str]] = {}
    for name, value in headers.items():
        lower = _header_name(name)
        if lower is None:
            raise httpx.LocalProtocolError(f"the header name {name!r} cannot be sent: not an HTTP token")
        if _BAD_IN_VALUE.search(value):
            raise httpx.LocalProtocolError(f"the header {name!r} cannot be sent: its value holds CR, LF or NUL")
        if not value.isascii():
            raise httpx.LocalProtocolError(f"the header {name!r} cannot be sent: its value holds a character "
                                           "outside ASCII")
        if lower not in _FRAMING:
            unique[lower] = (name, value)
    close = "close" in unique.get("connection", ("", ""))[1].lower()
    lines = [f"{method} {target} HTTP/1.1", *(f"{name}: {value}" for name, value in unique.values())]
    if content is not None or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(content or b'')}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii"), close


@functools.lru_cache(maxsize=256)
def _header_name(name: str) -> str | None:
    """A header name in lower case; None when it is not an HTTP token (remembered: requests
    send the same few names)."""
    return name.lower() if _TOKEN.fullmatch(name) else None


class Exchange:
    """One request and its response on one connection, every wait capped by ``left_s()``."""

    def __init__(self, *, pool: Pool, tls: Callable[[], ssl.SSLContext], left_s: Callable[[], float],
                 on_socket: Callable[[socket.socket | None], None]) -> None:
        self._pool, self._tls, self._left_s, self._on_socket = pool, tls, left_s, on_socket

    def _left(self, error: type[httpx.TimeoutException]) -> float:
        """What remains of the deadline; ``error`` once nothing does."""
        left = self._left_s()
        if left <= 0:
            raise error("the request's total deadline has passed")
        return left

    def _wait(self, sock: socket.socket, error: type[httpx.TimeoutException]) -> None:
        sock.settimeout(self._left(error))

    def _connect(self, key: Key) -> _Connection:
        scheme, address, port, server_name = key
        left = self._left(httpx.ConnectTimeout)
        try:
            raw = socket.create_connection((address, port), timeout=left)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {address}:{port} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        sock = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if scheme == "https":
                # wrapped first, handshaken after: the watchdog holds the socket that the
                # handshake blocks in (wrapping detaches the plain one)
                tls_sock = self._tls().wrap_socket(raw, server_hostname=server_name, do_handshake_on_connect=False)
                sock = tls_sock
                self._on_socket(tls_sock)
                self._wait(tls_sock, httpx.ConnectTimeout)
                tls_sock.do_handshake()
        except TimeoutError as exc:
            sock.close()
            raise httpx.ConnectTimeout(f"the TLS handshake with {address}:{port} timed out") from exc
        except httpx.HTTPError:
            sock.close()
            raise
        except (OSError, ssl.SSLError, ValueError) as exc:  # ssl.CertificateError is a ValueError too
            sock.close()
            raise httpx.ConnectError(str(exc) or type(exc).__name__) from exc
        return _Connection(key, sock)

    def send(self, method: str, key: Key, target: str, headers: dict[str, str], content: bytes | None, *,
             max_bytes: int, refuse_larger: bool = False) -> Reply:
        """Send the request on a pooled connection or a new one; read the response. A pooled
        connection that fails before a byte of the response arrives (the peer closed it as
        it was taken) is replaced by a new one, once."""
        head, close = _head_bytes(method, target, headers, content)
        pooled = self._pool.take(key)
        if pooled is not None:
            try:
                return self._exchange(pooled, method, head, content, close, max_bytes, refuse_larger)
            except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                if pooled.answered:
                    raise
        return self._exchange(self._connect(key), method, head, content, close, max_bytes, refuse_larger)

    def _exchange(self, conn: _Connection, method: str, head: bytes, content: bytes | None, close: bool,
                  max_bytes: int, refuse_larger: bool) -> Reply:
        self._on_socket(conn.sock)
        keep = False
        try:
            try:
                self._write(conn, head + content if content and len(content) < READ_BYTES else head)
                if content and len(content) >= READ_BYTES:
                    self._write(conn, content)
            except httpx.WriteError as exc:
                # the server may have answered before reading it all (a 413, say): that
                # answer, if there is one, is the outcome; the connection is not kept
                try:
                    return self._read_response(conn, method, max_bytes, refuse_larger)[0]
                except httpx.HTTPError:
                    raise exc from None
            reply, keep = self._read_response(conn, method, max_bytes, refuse_larger)
            keep = keep and not close
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
            data = conn.sock.recv(READ_BYTES)
        except TimeoutError as exc:
            raise httpx.ReadTimeout("reading the response timed out") from exc
        except OSError as exc:
            raise httpx.ReadError(str(exc)) from exc
        if data:
            conn.buffer += data
            conn.answered = True
        return bool(data)

    def _until(self, conn: _Connection, separator: bytes, limit: int, what: str) -> bytes:
        """The buffered bytes up to ``separator`` (both taken), refused beyond ``limit``
        bytes; each read is searched once (from just before it)."""
        start = 0
        while True:
            end = conn.buffer.find(separator, start)
            if end >= 0:
                if end > limit:
                    break
                taken = bytes(conn.buffer[:end])
                del conn.buffer[:end + len(separator)]
                return taken
            if len(conn.buffer) > limit:
                break
            start = max(0, len(conn.buffer) - len(separator) + 1)
            if not self._fill(conn):
                if what == "head" and not conn.buffer:
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.")
                raise httpx.RemoteProtocolError(f"the server closed the connection inside the response's {what}")
        raise httpx.RemoteProtocolError(f"the response's {what} is over {limit} bytes")

    def _head(self, conn: _Connection) -> tuple[bytes, int, list[tuple[bytes, bytes]]]:
        head = self._until(conn, b"\r\n\r\n", MAX_HEAD_BYTES, "head")
        status_line, *lines = head.split(b"\r\n")
        version, _, rest = status_line.partition(b" ")
        code = rest[:3]
        if version not in (b"HTTP/1.1", b"HTTP/1.0") or not _DIGITS.fullmatch(code) or len(code) != 3 \
                or rest[3:4] not in (b"", b" ") or _BAD_IN_LINE.search(status_line):
            raise httpx.RemoteProtocolError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        return version, int(code), [self._header(line) for line in lines]

    @staticmethod
    def _header(line: bytes) -> tuple[bytes, bytes]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name.decode("latin-1")) or _BAD_IN_LINE.search(line):
            raise httpx.RemoteProtocolError(f"a malformed response header line: {line[:80]!r}")
        return name, value.strip(b" \t")

    def _read_response(self, conn: _Connection, method: str, max_bytes: int,
                       refuse_larger: bool) -> tuple[Reply, bool]:
        """The response, and whether its connection may carry another request."""
        for _ in range(MAX_INTERIM + 1):
            version, status, headers = self._head(conn)
            if status == 101 or status < 100:
                raise httpx.RemoteProtocolError(f"an unexpected status {status}")
            if status >= 200:
                break  # an interim 1xx response is skipped
        else:
            raise httpx.RemoteProtocolError(f"more than {MAX_INTERIM} interim responses")
        spoken = version[5:].decode("ascii")  # "1.1" or "1.0", as its status line said
        lengths: set[bytes] = set()
        codings: list[bytes] = []
        close = version != b"HTTP/1.1"  # an HTTP/1.0 connection is never kept
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                lengths.add(value)
            elif lower == b"transfer-encoding":
                codings += [c.strip(b" \t").lower() for c in value.split(b",")]
            elif lower == b"connection":
                close = close or b"close" in {t.strip(b" \t").lower() for t in value.split(b",")}
        if lengths and (len(lengths) > 1 or not _DIGITS.fullmatch(next(iter(lengths)))):
            raise httpx.RemoteProtocolError(f"an invalid Content-Length: {sorted(lengths)!r:.80}")
        keep = not close and not (codings and lengths)  # both framings: never trusted for another
        if method == "HEAD" or status in (204, 304):
            return Reply(status, headers, b"", False, spoken), keep
        if codings:
            if codings[-1] == b"chunked":
                body, truncated = self._chunked(conn, max_bytes, refuse_larger)
                return Reply(status, headers, body, truncated, spoken), keep and not truncated
            body, truncated = self._until_close(conn, max_bytes, refuse_larger)
            return Reply(status, headers, body, truncated, spoken), False
        if lengths:
            body, truncated = self._sized(conn, int(next(iter(lengths))), max_bytes, refuse_larger)
            return Reply(status, headers, body, truncated, spoken), keep and not truncated
        body, truncated = self._until_close(conn, max_bytes, refuse_larger)
        return Reply(status, headers, body, truncated, spoken), False

    @staticmethod
    def _over(refuse_larger: bool, max_bytes: int) -> None:
        if refuse_larger:
            raise ResponseTooLarge(f"the response is larger than {max_bytes} bytes")

    def _exactly(self, conn: _Connection, size: int, what: str) -> bytes:
        while len(conn.buffer) < size:
            if not self._fill(conn):
                raise httpx.RemoteProtocolError(f"the server closed the connection inside the response's {what}")
        data = bytes(conn.buffer[:size])
        del conn.buffer[:size]
        return data

    def _sized(self, conn: _Connection, length: int, max_bytes: int, refuse_larger: bool) -> tuple[bytes, bool]:
        if length > max_bytes:
            self._over(refuse_larger, max_bytes)
        return self._exactly(conn, min(length, max_bytes), "body"), length > max_bytes

    def _until_close(self, conn: _Connection, max_bytes: int, refuse_larger: bool) -> tuple[bytes, bool]:
        while len(conn.buffer) <= max_bytes:
            if not self._fill(conn):
                return bytes(conn.buffer), False
        self._over(refuse_larger, max_bytes)
        return bytes(conn.buffer[:max_bytes]), True

    def _chunked(self, conn: _Connection, max_bytes: int, refuse_larger: bool) -> tuple[bytes, bool]:
        body = bytearray()
        while True:
            size_text = self._until(conn, b"\r\n", MAX_CHUNK_LINE_BYTES, "chunk size").split(b";", 1)[0].strip(b" \t")
            if not _HEX.fullmatch(size_text):
                raise httpx.RemoteProtocolError(f"an invalid chunk size: {size_text[:40]!r}")
            size = int(size_text, 16)
            if size == 0:
                trailers = 0
                while line := self._until(conn, b"\r\n", max(0, MAX_HEAD_BYTES - trailers), "trailer section"):
                    trailers += len(line) + 2
                return bytes(body), False
            if len(body) + size > max_bytes:
                self._over(refuse_larger, max_bytes)
                body += self._exactly(conn, max_bytes - len(body), "body")
                return bytes(body), True
            body += self._exactly(conn, size, "body")
            if self._exactly(conn, 2, "body") != b"\r\n":
                raise httpx.RemoteProtocolError("a chunk not followed by CRLF")
