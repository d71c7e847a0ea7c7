"""Outbound HTTP for the actors: one shared client, and one guarded request helper.

Building a client loads the CA bundle — tens of milliseconds of CPU under the GIL — so
actors never build one per call. Redirects are never followed (a redirect is an
outcome to record, and following one would bypass the request-forgery guard), and
proxies from the environment are ignored (a proxy would undo the address pinning).

:func:`guarded_request` is the one way actors call a URL they were given (webhooks,
supplier APIs, job feeds):

* the URL passes :func:`actors.netguard.check_url` at every call, and the request goes
  to the address that was checked (Host header and TLS server name kept);
* a **total** deadline (the given timeout, shortened to what remains of the job) holds
  against any byte pattern: every socket operation waits only for what remains, and a
  wall-clock watchdog (``broker.deadline.watchdog``) shuts the connection down when it
  passes, whatever the request is blocked in (a trickled TLS handshake included);
* the response body is read up to a cap (truncated, or refused), never whole.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import certifi
import httpcore
import httpx

from actors.netguard import Target, check_url
from broker import deadline
from broker.errors import StandmeetError


@dataclass
class _Budget:
    """The running request's total deadline, and the socket it is blocked on."""

    end: float
    sock: socket.socket | None = None
    expired: bool = False

    def left(self) -> float:
        return self.end - time.monotonic()

    def expire(self) -> None:
        """Called by the watchdog: unblock whatever the request waits in."""
        self.expired = True
        sock = self.sock
        if sock is not None:
            try:  # the plain socket's shutdown (also under TLS): the blocked read returns at once
                socket.socket.shutdown(sock, socket.SHUT_RDWR)
            except OSError:
                pass


_local = threading.local()


def _budget() -> _Budget | None:
    return getattr(_local, "budget", None)


class _DeadlineStream(httpcore.NetworkStream):
    """A network stream whose every operation waits at most for what remains of the budget."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def _cap(self, timeout: float | None, error: type[Exception]) -> float | None:
        budget = _budget()
        if budget is None:
            return timeout
        left = budget.left()
        if left <= 0 or budget.expired:
            raise error("the request's total deadline has passed")
        sock = self._inner.get_extra_info("socket")
        budget.sock = sock if isinstance(sock, socket.socket) else None
        return left if timeout is None else min(timeout, left)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._inner.read(max_bytes, self._cap(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._inner.write(buffer, self._cap(timeout, httpcore.WriteTimeout))

    def close(self) -> None:
        self._inner.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        capped = self._cap(timeout, httpcore.ConnectTimeout)
        return _DeadlineStream(self._inner.start_tls(ssl_context, server_hostname, capped))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _DeadlineBackend(httpcore.SyncBackend):
    def connect_tcp(self, host: str, port: int, timeout: float | None = None, local_address: str | None = None,
                    socket_options: Iterable[Any] | None = None) -> httpcore.NetworkStream:
        budget = _budget()
        if budget is not None:
            left = budget.left()
            if left <= 0 or budget.expired:
                raise httpcore.ConnectTimeout("the request's total deadline has passed")
            timeout = left if timeout is None else min(timeout, left)
        return _DeadlineStream(super().connect_tcp(host, port, timeout, local_address, socket_options))


class _Transport(httpx.HTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self._pool = httpcore.ConnectionPool(
            ssl_context=ssl.create_default_context(cafile=certifi.where()),
            max_connections=100, max_keepalive_connections=20, keepalive_expiry=5.0,
            network_backend=_DeadlineBackend(),
        )


#: The one connection pool: guarded requests go straight to it (a request is built once,
#: sent to the checked address, and read up to its cap; no cookies, no redirects, no
#: proxies, no auth): the client layer above it cost as much CPU as the request itself.
TRANSPORT = _Transport()
CLIENT = httpx.Client(follow_redirects=False, trust_env=False, transport=TRANSPORT)
#: The headers every guarded request carries unless the caller sets them (httpx's own).
DEFAULT_HEADERS = {"Accept": "*/*", "Connection": "keep-alive", "User-Agent": f"python-httpx/{httpx.__version__}"}


#: A request ends this long before its job's own time limit, so its outcome can be recorded.
RECORD_MARGIN_S = 1.0
#: ... but is never given less than this.
MIN_REQUEST_S = 0.05


def request_budget(timeout_s: float, *, margin_s: float = RECORD_MARGIN_S) -> float:
    """``timeout_s``, shortened to end ``margin_s`` before the running job's time limit."""
    left = deadline.remaining_s()
    if left is None:
        return timeout_s
    return max(MIN_REQUEST_S, min(timeout_s, left - margin_s))


class ResponseTooLarge(StandmeetError):
    """The response body is over the cap the caller asked to refuse beyond."""


@dataclass(frozen=True)
class Response:
    """What a guarded request got: the status, headers, and the body up to the cap."""

    status_code: int
    headers: httpx.Headers
    body: bytes
    truncated: bool
    target: Target

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def guarded_request(
    method: str,
    url: str,
    *,
    allowed_networks: tuple[str, ...],
    timeout_s: float,
    max_bytes: int,
    refuse_larger: bool = False,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
    extensions: dict[str, Any] | None = None,
) -> Response:
    """One request to ``url`` through the guard, within a total deadline, body capped.

    Raises :class:`actors.netguard.UrlRefused` (the URL may not be called),
    ``httpx.TimeoutException`` (the total deadline passed, in any phase),
    another ``httpx.HTTPError`` (connection, TLS, protocol), or
    :class:`ResponseTooLarge` when ``refuse_larger`` and the body is over ``max_bytes``.
    Holds no database connection: call it with none checked out.
    """
    target = check_url(url, allowed_networks=allowed_networks)
    total = deadline.cap_timeout(timeout_s)
    budget = _Budget(end=time.monotonic() + total)
    sent = {**DEFAULT_HEADERS, "Accept-Encoding": "identity", **(headers or {}), **target.headers()}
    request = httpx.Request(method, target.pinned_url(), headers=sent, content=content,
                            extensions={"timeout": httpx.Timeout(total).as_dict(), **target.extensions(),
                                        **(extensions or {})})
    previous = _budget()
    _local.budget = budget
    try:
        with deadline.watchdog(total, budget.expire):
            try:
                response = TRANSPORT.handle_request(request)
                try:
                    chunks: list[bytes] = []
                    size, truncated = 0, False
                    for chunk in response.stream:  # type: ignore[union-attr]
                        if size + len(chunk) > max_bytes:
                            if refuse_larger:
                                raise ResponseTooLarge(f"the response is larger than {max_bytes} bytes")
                            chunks.append(chunk[: max_bytes - size])
                            truncated = True
                            break
                        chunks.append(chunk)
                        size += len(chunk)
                    return Response(response.status_code, response.headers, b"".join(chunks), truncated, target)
                finally:
                    response.close()
            except httpx.HTTPError as exc:
                if budget.expired or budget.left() <= 0:
                    raise httpx.ReadTimeout(f"the total deadline of {total:.3g} s passed "
                                            f"({type(exc).__name__}: {exc})") from exc
                raise
    finally:
        _local.budget = previous
