"""The dashboard's guards: where it may listen, who may look, which POSTs are genuine.

- **Binding.** Loopback needs nothing; any other address needs
  ``STANDMEET_DASHBOARD_PASSWORD``, or the command refuses to start.
- **Basic auth.** With a password set, every request (pages, ``/healthz``,
  ``/metrics``, static files) needs it; user and password are compared in constant time.
- **CSRF.** Every state-changing request is a POST carrying a token bound to a cookie:
  the cookie holds a random nonce, the form holds ``HMAC(process secret, nonce)``. A
  page on another site can neither read the token nor set the cookie (``SameSite=Strict``).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import secrets
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from broker.errors import ConfigError

PASSWORD_VARIABLE = "STANDMEET_DASHBOARD_PASSWORD"
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
    def set_cookie(response: Response, nonce: str) -> None:
        response.set_cookie(CSRF_COOKIE, nonce, httponly=True, samesite="strict", path="/")
