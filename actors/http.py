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
* the response body is read up to a cap (truncated, or refused), never whole.
"""

from __future__ import annotations

import socket
import ssl
import threading
import time
from dataclasses import dataclass, field

import certifi
import httpx

from actors import http1
from actors.netguard import Target, check_url
from broker import deadline


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
    key = http1.Key(target.scheme, target.address, target.port, target.host)
    previous = _budget()
    _local.budget = budget
    try:
        with deadline.watchdog(total, budget.expire):
            try:
                reply = EXCHANGE.send(method.upper(), key, http1.request_line_target(target.url), sent, content,
                                      max_bytes=max_bytes, refuse_larger=refuse_larger)
                return Response(reply.status_code, httpx.Headers(reply.headers), reply.body, reply.truncated, target)
            except httpx.HTTPError as exc:
                if budget.expired or budget.left() <= 0:
                    raise httpx.ReadTimeout(f"the total deadline of {total:.3g} s passed "
                                            f"({type(exc).__name__}: {exc})") from exc
                raise
    finally:
        _local.budget = previous
