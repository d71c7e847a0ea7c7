"""The guard against server-side request forgery, for every URL the system fetches.

A URL whose host resolves to a private, loopback, link-local, multicast, reserved or
cloud-metadata address is refused, unless it falls in an operator's allow-list
(``STANDMEET_WEBHOOK_ALLOWED_NETWORKS``, comma-separated CIDRs; the tests allow
loopback). It is checked when the URL is registered and again at each request, and
the request then goes to the very address that was checked (no second DNS lookup
for an attacker to change the answer of).
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from broker.errors import StandmeetError

#: Addresses of cloud metadata services, refused even if a network allows them.
METADATA = {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}


class UrlRefused(StandmeetError):
    """The URL is malformed, or points where the system must not send requests."""


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect, and the names to present."""

    url: str
    scheme: str
    host: str
    port: int
    address: str

    def pinned_url(self) -> str:
        """The URL with its host replaced by the checked address (Host header kept apart)."""
        parts = urlsplit(self.url)
        host = f"[{self.address}]" if ":" in self.address else self.address
        netloc = f"{host}:{self.port}"
        return parts._replace(netloc=netloc).geturl()

    def headers(self) -> dict[str, str]:
        default = 443 if self.scheme == "https" else 80
        return {"Host": self.host if self.port == default else f"{self.host}:{self.port}"}

    def extensions(self) -> dict[str, str]:
        return {"sni_hostname": self.host} if self.scheme == "https" else {}


def _allowed(address: ipaddress.IPv4Address | ipaddress.IPv6Address, networks: tuple[str, ...]) -> bool:
    return any(address in ipaddress.ip_network(n) for n in networks)


def _forbidden(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if address in METADATA:
        return "a cloud metadata address"
    for attribute, what in (
        ("is_loopback", "a loopback address"), ("is_link_local", "a link-local address"),
        ("is_private", "a private address"), ("is_multicast", "a multicast address"),
        ("is_reserved", "a reserved address"), ("is_unspecified", "an unspecified address"),
    ):
        if getattr(address, attribute):
            return what
    return None


def check_url(url: str, *, allowed_networks: tuple[str, ...] = ()) -> Target:
    """Resolve and check ``url``; return the address to connect to, or raise UrlRefused."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UrlRefused(f"{url!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UrlRefused(f"{url!r} is not an http(s) URL with a host")
    if parts.username or parts.password:
        raise UrlRefused(f"{url!r} carries credentials in the URL; use a secret instead")
    port = port or (443 if parts.scheme == "https" else 80)
    try:
        infos = socket.getaddrinfo(parts.hostname, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise UrlRefused(f"{parts.hostname!r} does not resolve: {exc}") from None
    addresses = sorted({ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos}, key=str)
    for address in addresses:  # every answer must pass: DNS may hand out any of them
        reason = _forbidden(address)
        if address in METADATA or (reason and not _allowed(address, allowed_networks)):
            raise UrlRefused(
                f"{url!r} resolves to {address}, {reason}; allow it with STANDMEET_WEBHOOK_ALLOWED_NETWORKS"
                if address not in METADATA else f"{url!r} resolves to {address}, a cloud metadata address"
            )
    return Target(url=url, scheme=parts.scheme, host=parts.hostname, port=port, address=str(addresses[0]))
