"""Outbound HTTP for the actors: one guarded request helper over one pool of kept-alive connections.

The exchange itself is :mod:`actors.http1` (HTTP/1.1, written and parsed here: a
general client's request model cost several times the exchange's CPU); the CA bundle
is loaded once per process. Redirects are never followed (a redirect is an
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
* the response body is read up to a cap (truncated, or refused), never whole;
* when OpenTelemetry records spans (``broker.observability.tracing``: the API only, never the SDK),
  the request is an HTTP client span named after its method, a child of the current
  span, with the attributes of the HTTP semantic conventions (``url.full`` without its
  query or fragment); ``propagate_trace=True`` sends that span's context as
  ``traceparent``.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import certifi
import httpx

from actors import http1
from actors.netguard import Target, check_url
from broker import deadline
from broker.observability import tracing

try:
    from opentelemetry import propagate
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context
except ImportError:  # the [otel] extra is not installed: no span, nothing carried
    pass


@dataclass
class _Budget:
    """The running request's total deadline, and the socket it is blocked on."""

    end: float
    sock: socket.socket | None = None
    expired: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def left(self) -> float:
        return self.end - time.monotonic()

    def hold(self, sock: socket.socket | None) -> None:
        """The socket the request now waits on (None: none; once this returns, the watchdog
        no longer touches the one before, which may go back to the pool)."""
        with self.lock:
            self.sock = sock

    def expire(self) -> None:
        """Called by the watchdog: unblock whatever the request waits in."""
        with self.lock:
            self.expired = True
            if self.sock is not None:
                try:  # the plain socket's shutdown (also under TLS): the blocked read returns at once
                    socket.socket.shutdown(self.sock, socket.SHUT_RDWR)
                except OSError:
                    pass


_local = threading.local()


def _budget() -> _Budget | None:
    return getattr(_local, "budget", None)


def _left_s() -> float:
    budget = _budget()
    if budget is None or budget.expired:
        return 0.0
    return budget.left()


def _on_socket(sock: socket.socket | None) -> None:
    budget = _budget()
    if budget is not None:
        budget.hold(sock)


#: Certificates are checked against this context's authorities (loaded once: tens of
#: milliseconds of CPU under the GIL).
TLS = ssl.create_default_context(cafile=certifi.where())
#: The one pool of kept-alive connections, shared by every thread of the process.
POOL = http1.Pool()
EXCHANGE = http1.Exchange(pool=POOL, tls=lambda: TLS, left_s=_left_s, on_socket=_on_socket)
#: The headers every guarded request carries unless the caller sets them.
DEFAULT_HEADERS = {"Accept": "*/*", "Connection": "keep-alive", "User-Agent": "standmeet-jobs"}
#: The response body is over the cap the caller asked to refuse beyond.
ResponseTooLarge = http1.ResponseTooLarge


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


@dataclass(frozen=True)
class Response:
    """What a guarded request got: the status, headers, and the body up to the cap."""

    status_code: int
    headers: httpx.Headers
    body: bytes
    truncated: bool
    target: Target
    version: str = "1.1"

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
    propagate_trace: bool = False,
) -> Response:
    """One request to ``url`` through the guard, within a total deadline, body capped.

    Raises :class:`actors.netguard.UrlRefused` (the URL may not be called),
    ``httpx.TimeoutException`` (the total deadline passed, in any phase),
    another ``httpx.HTTPError`` (connection, TLS, protocol), or
    :class:`ResponseTooLarge` when ``refuse_larger`` and the body is over ``max_bytes``.
    ``propagate_trace``: send the W3C trace context (``traceparent``) of the request's
    client span (of the current span when none is recorded).
    Holds no database connection: call it with none checked out.
    """
    target = check_url(url, allowed_networks=allowed_networks)
    total = deadline.cap_timeout(timeout_s)
    budget = _Budget(end=time.monotonic() + total)
    sent = {**DEFAULT_HEADERS, "Accept-Encoding": "identity", **(headers or {})}
    key = http1.Key(target.scheme, target.address, target.port, target.host)
    previous = _budget()
    _local.budget = budget
    try:
        with _client_span(method.upper(), target, sent if propagate_trace else None) as span, \
                deadline.watchdog(total, budget.expire):
            try:
                reply = EXCHANGE.send(method.upper(), key, http1.request_line_target(target.url),
                                      {**sent, **target.headers()}, content,
                                      max_bytes=max_bytes, refuse_larger=refuse_larger)
            except httpx.HTTPError as exc:
                if budget.expired or budget.left() <= 0:
                    raise httpx.ReadTimeout(f"the total deadline of {total:.3g} s passed "
                                            f"({type(exc).__name__}: {exc})") from exc
                raise
            _answered(span, reply.status_code, reply.version)
            return Response(reply.status_code, httpx.Headers(reply.headers), reply.body, reply.truncated, target,
                            reply.version)
    finally:
        _local.budget = previous


def span_url(target: Target) -> str:
    """``url.full`` of a request: scheme, host, port and path, never the query, the
    fragment or user info (where tokens and secrets travel)."""
    host = f"[{target.host}]" if ":" in target.host else target.host
    return f"{target.scheme}://{host}:{target.port}{http1.request_line_target(target.url).split('?', 1)[0]}"


def _error_type(exc: BaseException) -> str:
    """``error.type``: the exception's class, named as its library exports it."""
    module = type(exc).__module__
    return f"{module.split('.', 1)[0] if module.startswith('httpx.') else module}.{type(exc).__qualname__}"


@contextmanager
def _client_span(method: str, target: Target, carrier: dict[str, str] | None) -> Iterator[Any]:
    """The request's HTTP client span (None when nothing records spans), a child of the
    current one; its context is added to ``carrier`` (the request's headers) if given.
    An exception ends it as an error, with ``error.type``."""
    if not tracing.recording():
        if carrier is not None:
            tracing.inject_headers(carrier)  # the current span's context, if there is one
        yield None
        return
    span = tracing.tracer().start_span(method, kind=SpanKind.CLIENT, attributes={
        "http.request.method": method, "url.full": span_url(target), "server.address": target.host,
        "server.port": target.port, "network.peer.address": target.address, "network.protocol.name": "http",
        "network.protocol.version": "1.1"})
    if carrier is not None:
        propagate.inject(carrier, context=set_span_in_context(span))
    try:
        yield span
    except BaseException as exc:
        span.set_attribute("error.type", _error_type(exc))
        span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:500]))
        raise
    finally:
        span.end()


def _answered(span: Any, status_code: int, version: str) -> None:
    """Record the response on the client span: its status (4xx and 5xx are errors of a
    client span) and the HTTP version it came in."""
    if span is None:
        return
    span.set_attribute("http.response.status_code", status_code)
    span.set_attribute("network.protocol.version", version)
    if status_code >= 400:
        span.set_attribute("error.type", str(status_code))
        span.set_status(Status(StatusCode.ERROR))
