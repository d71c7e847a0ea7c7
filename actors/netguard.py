"""The guard against server-side request forgery, for every URL the system fetches.

An allow-list, not a deny-list: a URL passes only if every address its host resolves
to is a *globally routable unicast* address. IPv6 forms that carry an IPv4 address
(IPv4-mapped ``::ffff:0:0/96``, IPv4-translated ``::ffff:0:0:0/96``, IPv4-compatible
``::/96``, 6to4 ``2002::/16``, NAT64 ``64:ff9b::/96`` and ``64:ff9b:1::/48``, Teredo
``2001::/32``) are judged by the IPv4 address they carry, so ``::ffff:127.0.0.1`` or
``2002:7f00:1::`` are loopback. Cloud metadata addresses are refused in every form,
even when the operator's allow-list (``STANDMEET_WEBHOOK_ALLOWED_NETWORKS``,
comma-separated CIDRs; the tests allow loopback) covers them.

Every malformed or forbidden URL raises :class:`UrlRefused` with the reason (bad
scheme, user info, bad port, over-long label, no answer…), never another exception.
URLs are checked when registered and again at each request; the request then goes
to the very address that was checked (no second DNS lookup for an attacker to
change the answer of), with the original Host header and TLS server name.
"""

from __future__ import annotations

import functools
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from broker.errors import StandmeetError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

#: Cloud metadata services (AWS, GCP, Azure, OpenStack, ECS, Alibaba, Oracle, Tencent…),
#: refused even if an allowed network covers them.
METADATA: frozenset[IPAddress] = frozenset(ipaddress.ip_address(a) for a in (
    "169.254.169.254",   # AWS, GCP, Azure, OpenStack, DigitalOcean…
    "169.254.169.253",   # AWS DNS resolver
    "169.254.169.123",   # AWS time sync
    "169.254.170.2",     # AWS ECS task metadata
    "169.254.170.23",    # AWS EKS pod identity
    "169.254.0.23",      # Tencent Cloud
    "100.100.100.200",   # Alibaba Cloud
    "192.0.0.192",       # Oracle Cloud (classic)
    "168.63.129.16",     # Azure wire server (a public address)
    "fd00:ec2::254",     # AWS (IPv6)
    "fd00:ec2::23",      # AWS DNS/time (IPv6)
    "fd00:ec2::123",     # AWS time sync (IPv6)
    "fd20:ce::254",      # GCP (IPv6)
))

#: The only IPv6 space that holds global unicast addresses.
GLOBAL_UNICAST_V6 = ipaddress.ip_network("2000::/3")

#: Special-purpose blocks (IANA registries) that are not globally routable unicast,
#: with the reason given. Checked most specific first.
_NOT_GLOBAL: tuple[tuple[str, str], ...] = (
    ("0.0.0.0/8", "an unspecified ('this network') address"),
    ("10.0.0.0/8", "a private address"),
    ("100.64.0.0/10", "a shared (carrier-grade NAT) address"),
    ("127.0.0.0/8", "a loopback address"),
    ("169.254.0.0/16", "a link-local address"),
    ("172.16.0.0/12", "a private address"),
    ("192.0.0.0/24", "an IETF protocol assignment"),
    ("192.0.2.0/24", "a documentation address"),
    ("192.31.196.0/24", "an AS112 address"),
    ("192.52.193.0/24", "an AMT address"),
    ("192.88.99.0/24", "a 6to4 relay anycast address"),
    ("192.168.0.0/16", "a private address"),
    ("192.175.48.0/24", "an AS112 address"),
    ("198.18.0.0/15", "a benchmarking address"),
    ("198.51.100.0/24", "a documentation address"),
    ("203.0.113.0/24", "a documentation address"),
    ("224.0.0.0/4", "a multicast address"),
    ("255.255.255.255/32", "the broadcast address"),
    ("240.0.0.0/4", "a reserved address"),
    ("::/128", "an unspecified address"),
    ("::1/128", "a loopback address"),
    ("::/8", "a reserved address"),
    ("100::/64", "a discard-only address"),
    ("2001::/23", "an IETF protocol assignment"),
    ("2001:db8::/32", "a documentation address"),
    ("2002::/16", "a 6to4 address"),
    ("3fff::/20", "a documentation address"),
    ("5f00::/16", "a segment-routing address"),
    ("fc00::/7", "a unique local (private) address"),
    ("fe80::/10", "a link-local address"),
    ("fec0::/10", "a site-local address"),
    ("ff00::/8", "a multicast address"),
)
NOT_GLOBAL = tuple((ipaddress.ip_network(n), why) for n, why in _NOT_GLOBAL)

#: Never a unicast destination, whatever the allow-list says (with multicast and unspecified).
_NEVER_V4 = ipaddress.ip_network("240.0.0.0/4")

_MAPPED = ipaddress.ip_network("::ffff:0:0/96")
_TRANSLATED = ipaddress.ip_network("::ffff:0:0:0/96")
_COMPATIBLE = ipaddress.ip_network("::/96")
_SIXTOFOUR = ipaddress.ip_network("2002::/16")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_TEREDO = ipaddress.ip_network("2001::/32")

#: Longest URL accepted, and DNS's limits on names.
MAX_URL_LENGTH = 2048
MAX_LABEL = 63
MAX_HOSTNAME = 253


class UrlRefused(StandmeetError):
    """The URL is malformed, or points where the system must not send requests."""


class UrlUnresolved(UrlRefused):
    """The URL's host name did not resolve, this time: DNS may answer later (a temporary
    failure, a name not yet published). Refused where a URL is registered; a request
    made on a schedule tries again, as after a failed connection."""


@dataclass(frozen=True)
class Target:
    """A checked URL: where to connect, and the names to present."""

    url: str
    scheme: str
    host: str
    port: int
    address: str

    def headers(self) -> dict[str, str]:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host
        return {"Host": host if self.port == default else f"{host}:{self.port}"}


def embedded_ipv4(address: ipaddress.IPv6Address) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (none for a plain IPv6 address)."""
    value = int(address)
    if address in _MAPPED or address in _TRANSLATED:
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if address in _COMPATIBLE and value > 1:  # ::a.b.c.d (:: and ::1 are judged as IPv6)
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if address in _SIXTOFOUR:
        return [ipaddress.IPv4Address((value >> 80) & 0xFFFFFFFF)]
    if address in _NAT64:
        return [ipaddress.IPv4Address(value & 0xFFFFFFFF)]
    if address in _NAT64_LOCAL:
        # RFC 6052 /48 layout (bits 48-63, then 72-87, around the u octet), and the
        # /96 layout some networks use inside this prefix: judge both.
        # An all-zero reading means the other layout is the one in use.
        rfc6052 = (((value >> 64) & 0xFFFF) << 16) | ((value >> 40) & 0xFFFF)
        readings = [ipaddress.IPv4Address(rfc6052), ipaddress.IPv4Address(value & 0xFFFFFFFF)]
        return [r for r in readings if int(r)] or readings[:1]
    if address in _TEREDO:
        server = ipaddress.IPv4Address((value >> 64) & 0xFFFFFFFF)
        client = ipaddress.IPv4Address(~value & 0xFFFFFFFF)
        return [server, client]
    return []


def not_global_reason(address: IPAddress) -> str | None:
    """Why ``address`` is not a globally routable unicast address; None if it is one."""
    for network, why in NOT_GLOBAL:
        if address.version == network.version and address in network:
            return why
    if isinstance(address, ipaddress.IPv6Address) and address not in GLOBAL_UNICAST_V6:
        return "outside the global unicast range 2000::/3"
    if not address.is_global:
        return "not a globally routable address"
    return None


def judge(address: IPAddress, allowed_networks: tuple[str, ...] = ()) -> str | None:
    """None if a request may go to ``address``; otherwise what it is (the reason)."""
    if isinstance(address, ipaddress.IPv6Address) and address.scope_id:
        address = ipaddress.IPv6Address(str(address).split("%")[0])
    carried = embedded_ipv4(address) if isinstance(address, ipaddress.IPv6Address) else []

    def what(candidate: IPAddress, reason: str) -> str:
        return reason if candidate == address else f"an IPv6 form of {candidate}, {reason}"

    for candidate in (address, *carried):
        if candidate in METADATA:
            return what(candidate, "a cloud metadata address")
        if candidate.is_unspecified or candidate.is_multicast or candidate in _NEVER_V4:
            return what(candidate, not_global_reason(candidate) or "not a unicast address")
    allowed = [ipaddress.ip_network(n) for n in allowed_networks]
    judged: list[IPAddress] = [*carried] if carried else [address]
    for candidate in judged:  # an IPv6 form of IPv4 is judged as that IPv4 address
        if any(candidate.version == n.version and candidate in n for n in allowed):
            continue
        reason = not_global_reason(candidate)
        if reason is not None:
            return what(candidate, reason)
    return None


def _hostname(url: str, raw: str) -> str:
    """The host to resolve, checked against DNS's limits (no exception but UrlRefused)."""
    if raw.startswith("[") or ":" in raw:
        return raw.strip("[]")
    labels = raw.rstrip(".").split(".")
    if any(not label for label in labels):
        raise UrlRefused(f"{url!r}: the host name has an empty label")
    ascii_labels = []
    for label in labels:
        if len(label) > MAX_LABEL:
            raise UrlRefused(f"{url!r}: a host name label is longer than {MAX_LABEL} characters")
        try:
            ascii_labels.append(label.encode("idna").decode("ascii"))
        except UnicodeError as exc:
            raise UrlRefused(f"{url!r}: the host name label {label[:70]!r} is not valid ({exc})") from None
        if len(ascii_labels[-1]) > MAX_LABEL:
            raise UrlRefused(f"{url!r}: a host name label is longer than {MAX_LABEL} characters once encoded")
    ascii_host = ".".join(ascii_labels)
    if len(ascii_host) > MAX_HOSTNAME:
        raise UrlRefused(f"{url!r}: the host name is longer than {MAX_HOSTNAME} characters")
    return ascii_host


def check_url(url: str, *, allowed_networks: tuple[str, ...] = ()) -> Target:
    """Resolve and check ``url``; return the address to connect to, or raise UrlRefused.

    The name is resolved at every call (an answer may change between two requests); what
    depends on the text alone (the URL's form, an address's verdict) is remembered
    (:func:`_parsed`, :func:`_verdict`)."""
    if not isinstance(url, str) or not url:
        raise UrlRefused("the URL is empty")
    scheme, host, port, literal = _parsed(url)
    addresses: list[IPAddress] = []
    if literal is not None:  # an address written out: nothing to resolve (getaddrinfo returns it)
        addresses.append(literal)
        infos = []
    else:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (socket.gaierror, UnicodeError, OSError) as exc:
            raise UrlUnresolved(f"{host!r} does not resolve: {exc}") from None
    for info in infos:
        try:
            address = _address(str(info[4][0]).split("%")[0])
        except ValueError:
            raise UrlRefused(f"{host!r} resolves to {info[4][0]!r}, not an IP address") from None
        if address not in addresses:
            addresses.append(address)
    if not addresses:
        raise UrlUnresolved(f"{host!r} does not resolve to any address")
    allowed = tuple(allowed_networks)
    for address in addresses:  # every answer must pass: DNS may hand out any of them
        reason = _verdict(address, allowed)
        if reason is not None:
            allowable = judge(address, ("0.0.0.0/0", "::/0")) is None
            hint = " (STANDMEET_WEBHOOK_ALLOWED_NETWORKS can allow its network)" if allowable else ""
            shown = url if len(url) <= 200 else url[:200] + "…"
            raise UrlRefused(f"{shown!r} resolves to {address}, {reason}{hint}")
    return Target(url=url, scheme=scheme, host=host, port=port, address=str(addresses[0]))


@functools.lru_cache(maxsize=1024)
def _parsed(url: str) -> tuple[str, str, int, IPAddress | None]:
    """A URL's scheme, host to resolve, port, and the address when the host is one written
    out in its standard form (no zone); or UrlRefused: a function of its text alone
    (remembered; a refusal is not, and is found again)."""
    shown = url if len(url) <= 200 else url[:200] + "…"
    if len(url) > MAX_URL_LENGTH:
        raise UrlRefused(f"{shown!r} is longer than {MAX_URL_LENGTH} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise UrlRefused(f"{shown!r} contains spaces or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
        raw_host = parts.hostname
    except ValueError as exc:
        raise UrlRefused(f"{shown!r} is not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise UrlRefused(f"{shown!r} is not an http(s) URL")
    if not raw_host:
        raise UrlRefused(f"{shown!r} has no host")
    if "@" in parts.netloc:
        raise UrlRefused(f"{shown!r} carries credentials (user info) in the URL; use a secret instead")
    if port == 0:
        raise UrlRefused(f"{shown!r} has port 0")
    if parts.netloc.endswith(":"):
        raise UrlRefused(f"{shown!r} has an empty port")
    port = port or (443 if parts.scheme == "https" else 80)
    host = _hostname(shown, raw_host)
    try:  # (a short or octal form such as 127.1 is not standard: getaddrinfo resolves it)
        literal: IPAddress | None = ipaddress.ip_address(host) if "%" not in host else None
    except ValueError:
        literal = None
    return parts.scheme, host, port, literal


#: An answer's text as an address (remembered: resolvers give the same few answers).
_address = functools.lru_cache(maxsize=4096)(ipaddress.ip_address)


@functools.lru_cache(maxsize=4096)
def _verdict(address: IPAddress, allowed_networks: tuple[str, ...]) -> str | None:
    """:func:`judge`, remembered: a function of the address and the allowed networks alone."""
    return judge(address, allowed_networks)
