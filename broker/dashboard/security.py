"""The dashboard's guards: where it may listen, who may look, which POSTs are genuine.

- **Binding.** Loopback needs nothing; any other address needs
  ``STANDMEET_DASHBOARD_PASSWORD``, or the command refuses to start.
- **Basic auth.** With a password set, every request (pages, ``/healthz``,
  ``/metrics``, static files) needs it; user and password are compared in constant time.
- **Host.** Every request names one of the dashboard's own hosts (:class:`HostGuard`):
  the names of the address it is bound to, and ``STANDMEET_DASHBOARD_ALLOWED_HOSTS``. A
  page of another site whose name was rebound to this address (DNS rebinding) sends its
  own name, and is refused before it reads anything.
- **Origin.** A POST whose ``Origin`` is not the dashboard's own, or (without one) whose
  ``Sec-Fetch-Site`` says another site sent it, is refused whatever token it carries
  (:class:`OriginGuard`).
- **CSRF.** Every state-changing request is a POST carrying a token bound to a cookie:
  the cookie holds a random nonce, the form holds ``HMAC(process secret, nonce)``. A
  page on another site can neither read the token nor set the cookie (``SameSite=Strict``;
  ``Secure`` over https, see :func:`cookie_is_secure`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import re
import secrets
import socket
from collections.abc import Iterable
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.errors import ConfigError
from broker.settings import SecureCookieMode

PASSWORD_VARIABLE = "STANDMEET_DASHBOARD_PASSWORD"
ALLOWED_HOSTS_VARIABLE = "STANDMEET_DASHBOARD_ALLOWED_HOSTS"
CSRF_COOKIE = "standmeet_csrf"
CSRF_FIELD = "csrf_token"
REALM = "standmeet-jobs dashboard"


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (``127.0.0.0/8``, ``::1``)."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, password: str | None) -> None:
    """Refuse a non-loopback address without a password (one line, naming the variable)."""
    if not is_loopback(host) and not password:
        raise ConfigError(
            f"refusing to serve the dashboard on {host}, which is not loopback, "
            f"without {PASSWORD_VARIABLE} (set it to require HTTP basic auth)"
        )


def credentials_match(header: str | None, user: str, password: str) -> bool:
    """Whether an ``Authorization: Basic …`` header carries ``user`` and ``password``."""
    if not header or not header[:6].lower() == "basic ":
        return False
    try:
        decoded = base64.b64decode(header[6:].strip(), validate=True)
    except (binascii.Error, ValueError):
        return False
    given_user, sep, given_password = decoded.partition(b":")
    if not sep:
        return False
    # Both compared, always, so the timing says nothing about which one was wrong.
    user_ok = hmac.compare_digest(given_user, user.encode())
    password_ok = hmac.compare_digest(given_password, password.encode())
    return user_ok and password_ok


class BasicAuth:
    """ASGI middleware: every HTTP request needs the dashboard's user and password."""

    def __init__(self, app: ASGIApp, *, user: str, password: str) -> None:
        self.app = app
        self.user = user
        self.password = password

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            header = dict(scope["headers"]).get(b"authorization", b"").decode("latin-1")
            if not credentials_match(header, self.user, self.password):
                response = PlainTextResponse(
                    "authentication required\n", status_code=401,
                    headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


#: Sent with every response: no framing (a Retry button cannot be clickjacked), scripts
#: and styles from this origin only (no inline script runs), no MIME sniffing.
SECURITY_HEADERS = (
    (b"content-security-policy",
     b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
     b"frame-ancestors 'none'; form-action 'self'; base-uri 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
)


class SecurityHeaders:
    """ASGI middleware adding :data:`SECURITY_HEADERS` to every HTTP response."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *SECURITY_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)


@dataclass(frozen=True)
class Csrf:
    """Tokens for one process: a restart only means reloading the page before acting."""

    secret: bytes

    @classmethod
    def new(cls) -> Csrf:
        return cls(secrets.token_bytes(32))

    def token_for(self, nonce: str) -> str:
        return hmac.new(self.secret, nonce.encode(), hashlib.sha256).hexdigest()

    def nonce(self, request: Request) -> tuple[str, bool]:
        """The request's nonce, and whether it is new (then the response must set it)."""
        existing = request.cookies.get(CSRF_COOKIE)
        if existing and 16 <= len(existing) <= 128:
            return existing, False
        return secrets.token_urlsafe(24), True

    def valid(self, request: Request, token: object) -> bool:
        nonce = request.cookies.get(CSRF_COOKIE)
        if not nonce or not isinstance(token, str) or not token:
            return False
        return hmac.compare_digest(token.encode(), self.token_for(nonce).encode())

    @staticmethod
    def set_cookie(response: Response, nonce: str, *, secure: bool = False) -> None:
        response.set_cookie(CSRF_COOKIE, nonce, httponly=True, samesite="strict", path="/", secure=secure)


# -- which hosts the dashboard answers to ------------------------------------------------

#: The names a loopback-bound dashboard answers to, whatever loopback address it is on.
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
#: A host name as a ``Host`` header or STANDMEET_DASHBOARD_ALLOWED_HOSTS may carry it.
_HOST_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*")
#: How much of a refused value a one-line answer quotes.
QUOTE_CHARS = 80


def quoted(value: str) -> str:
    """``value`` for a one-line message: repr'd (so no newline or control character
    survives), cut to :data:`QUOTE_CHARS`."""
    return repr(value if len(value) <= QUOTE_CHARS else value[:QUOTE_CHARS] + "…")


def normal_host(host: str) -> str | None:
    """A host name or address in the form the dashboard compares: lower case, without a
    trailing dot, an IPv6 address without brackets and compressed; None when it is neither
    a host name nor an address."""
    host = host.strip().lower()
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    host = host[:-1] if host.endswith(".") else host
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    return host if len(host) <= 253 and _HOST_NAME.fullmatch(host) else None


def split_host_port(value: str) -> tuple[str, int | None] | None:
    """(host, port or None) of a ``Host`` header (``name``, ``name:port``, ``[v6]``,
    ``[v6]:port``), the host normalised; None when the header is not one."""
    value = value.strip()
    if value.startswith("["):
        end = value.find("]")
        host, rest = value[: end + 1], value[end + 1:]
        if end < 0 or ":" not in host or (rest and rest[:1] != ":"):
            return None
        port = rest[1:] if rest else None
    else:
        host, sep, after = value.partition(":")
        port = after if sep else None
    if port is not None and not _valid_port(port):
        return None
    name = normal_host(host)
    return None if name is None else (name, int(port) if port is not None else None)


def split_host_header(value: str) -> str | None:
    """The host of a ``Host`` header, normalised; None when the header is not one."""
    parts = split_host_port(value)
    return parts[0] if parts else None


def _valid_port(text: str) -> bool:
    return text.isascii() and text.isdigit() and len(text) <= 5 and 0 < int(text) <= 65535


def parse_allowed_hosts(value: str) -> tuple[str, ...]:
    """STANDMEET_DASHBOARD_ALLOWED_HOSTS: comma-separated host names (or addresses);
    one line naming the variable and the entry when one is not a host name."""
    hosts = []
    for entry in value.split(","):
        if not entry.strip():
            continue
        host = normal_host(entry)
        if host is None:
            raise ConfigError(f"{ALLOWED_HOSTS_VARIABLE}: {quoted(entry.strip())} is not a host name "
                              "(give names like jobs.example.com, comma-separated, without scheme, port or path)")
        hosts.append(host)
    return tuple(hosts)


def is_wildcard(host: str) -> bool:
    """``0.0.0.0``, ``::`` (every address of the machine)."""
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_unspecified
    except ValueError:
        return False


def machine_names() -> frozenset[str]:
    """The machine's own names and the addresses they resolve to, and the loopback names."""
    names = set(LOOPBACK_NAMES)
    for name in {socket.gethostname(), socket.getfqdn()}:
        if host := normal_host(name):
            names.add(host)
        try:
            infos = socket.getaddrinfo(name, None)
        except OSError:  # a name that does not resolve adds only itself
            continue
        names.update(h for info in infos if (h := normal_host(str(info[4][0]))))
    return frozenset(names)


def allowed_hosts(bind_host: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The hosts a dashboard bound to ``bind_host`` answers to: the loopback names for a
    loopback bind, the address itself for a specific one, the machine's names for a
    wildcard; and ``extra`` (STANDMEET_DASHBOARD_ALLOWED_HOSTS). The address a connection
    arrived on is accepted besides (see :class:`HostGuard`)."""
    bound = normal_host(bind_host)
    names: set[str] = {h for e in extra if (h := normal_host(e))}
    if is_wildcard(bind_host):
        names |= machine_names()
    elif is_loopback(bind_host):
        names |= LOOPBACK_NAMES
    if bound and not is_wildcard(bind_host):
        names.add(bound)
    return frozenset(names)


def host_refusal(header: str | None, allowed: frozenset[str], local_address: str | None) -> str | None:
    """Why a request with this ``Host`` header is refused, in one line; None when it names
    one of ``allowed`` or the address the connection arrived on."""
    if header is None:
        return f"no Host header: the dashboard answers only to the hosts it serves ({ALLOWED_HOSTS_VARIABLE})"
    host = split_host_header(header)
    if host is not None and (host in allowed or (local_address is not None and host == normal_host(local_address))):
        return None
    shown = ", ".join(sorted(h if ":" not in h else f"[{h}]" for h in allowed))
    return (f"refused Host {quoted(header)}: this dashboard answers to {shown}; "
            f"add a reverse proxy's name to {ALLOWED_HOSTS_VARIABLE}")


class HostGuard:
    """ASGI middleware: every request must name one of the dashboard's hosts (400 else)."""

    def __init__(self, app: ASGIApp, *, allowed: frozenset[str]) -> None:
        self.app = app
        self.allowed = allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            headers = [v for k, v in scope["headers"] if k == b"host"]
            header = headers[0].decode("latin-1") if len(headers) == 1 else None
            server = scope.get("server")
            reason = host_refusal(header, self.allowed, str(server[0]) if server else None)
            if len(headers) > 1:
                reason = "more than one Host header: refused"
            if reason is not None:
                await PlainTextResponse(reason + "\n", status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# -- which POSTs come from the dashboard's own pages ---------------------------------------

#: Methods that change nothing, so no origin is checked for them.
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_DEFAULT_PORTS = {"http": 80, "https": 443}


Origin = tuple[str, str, int | None]


def own_origin(scheme: str, host_header: str) -> Origin | None:
    """(scheme, host, port) of the request itself, from its scheme and ``Host``."""
    parts = split_host_port(host_header)
    if parts is None:
        return None
    scheme = scheme.lower()
    host, port = parts
    return scheme, host, port if port is not None else _DEFAULT_PORTS.get(scheme)


def parse_origin(value: str) -> Origin | None:
    """(scheme, host, port) of an ``Origin`` header; None for ``null`` or a malformed one."""
    scheme, sep, rest = value.strip().partition("://")
    if not sep or scheme.lower() not in _DEFAULT_PORTS or "/" in rest:
        return None
    return own_origin(scheme, rest)


def origin_refusal(method: str, scheme: str, host_header: str | None, origin: str | None,
                   fetch_site: str | None) -> str | None:
    """Why a request is refused as sent by another site, in one line; None when it is not.
    Only methods that change something are checked. ``Origin`` decides when present (it
    must be this request's own scheme://host[:port]); without it, a ``Sec-Fetch-Site`` of
    ``cross-site`` or ``same-site`` is refused; with neither (curl, old clients) the CSRF
    token alone decides."""
    if method.upper() in SAFE_METHODS:
        return None
    if origin is not None:
        own = own_origin(scheme, host_header) if host_header else None
        if own is None or parse_origin(origin) != own:
            return f"refused a {method.upper()} from origin {quoted(origin)}: only this dashboard's own pages may act"
        return None
    site = (fetch_site or "").strip().lower()
    if site in ("cross-site", "same-site"):
        return f"refused a {method.upper()} sent by another site (Sec-Fetch-Site: {quoted(site)})"
    return None


class OriginGuard:
    """ASGI middleware: a state-changing request from another origin gets 403."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            reason = origin_refusal(scope["method"], scope.get("scheme", "http"), headers.get("host"),
                                    headers.get("origin"), headers.get("sec-fetch-site"))
            if reason is not None:
                await PlainTextResponse(reason + "\n", status_code=403)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def cookie_is_secure(mode: SecureCookieMode, scheme: str) -> bool:
    """Whether the cookie is marked ``Secure``: ``on`` always, ``off`` never, ``auto`` when
    the request came over https (uvicorn takes that from ``X-Forwarded-Proto`` only for the
    proxies it trusts: ``--forwarded-allow-ips``, loopback by default)."""
    return mode == "on" or (mode == "auto" and scheme.lower() == "https")

