"""The request-forgery guard: only globally routable unicast addresses, in every IPv6 disguise."""

from __future__ import annotations

import ipaddress

import pytest

from actors.netguard import UrlRefused, check_url, embedded_ipv4, judge


@pytest.mark.parametrize(
    "address, words",
    [
        ("0.0.0.0", "unspecified"),
        ("10.1.2.3", "private"),
        ("100.64.0.1", "shared (carrier-grade NAT)"),
        ("100.127.255.254", "shared (carrier-grade NAT)"),
        ("100.100.100.200", "cloud metadata"),
        ("127.0.0.1", "loopback"),
        ("169.254.10.10", "link-local"),
        ("169.254.169.254", "cloud metadata"),
        ("169.254.170.2", "cloud metadata"),
        ("172.16.5.4", "private"),
        ("192.0.0.8", "IETF protocol assignment"),
        ("192.0.0.192", "cloud metadata"),
        ("192.0.2.1", "documentation"),
        ("192.88.99.1", "6to4 relay anycast"),
        ("192.168.1.1", "private"),
        ("198.18.0.1", "benchmarking"),
        ("198.51.100.7", "documentation"),
        ("203.0.113.9", "documentation"),
        ("224.0.0.1", "multicast"),
        ("239.255.255.250", "multicast"),
        ("240.0.0.1", "reserved"),
        ("255.255.255.255", "broadcast"),
        ("168.63.129.16", "cloud metadata"),
        ("::", "unspecified"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("fec0::1", "site-local"),
        ("fc00::1", "unique local"),
        ("fd12:3456::1", "unique local"),
        ("fd00:ec2::254", "cloud metadata"),
        ("fd20:ce::254", "cloud metadata"),
        ("ff02::1", "multicast"),
        ("100::1", "discard-only"),
        ("2001:db8::1", "documentation"),
        ("3fff::1", "documentation"),
        ("4000::1", "outside the global unicast range"),
        # IPv6 forms that carry an IPv4 address are judged by it
        ("::ffff:127.0.0.1", "IPv6 form of 127.0.0.1, a loopback"),
        ("::ffff:169.254.169.254", "IPv6 form of 169.254.169.254, a cloud metadata"),
        ("::ffff:0:10.0.0.1", "IPv6 form of 10.0.0.1, a private"),
        ("::127.0.0.1", "IPv6 form of 127.0.0.1, a loopback"),
        ("2002:7f00:1::", "IPv6 form of 127.0.0.1, a loopback"),
        ("2002:a9fe:a9fe::1", "IPv6 form of 169.254.169.254, a cloud metadata"),
        ("2002:6464:64c8::", "IPv6 form of 100.100.100.200, a cloud metadata"),
        ("64:ff9b::7f00:1", "IPv6 form of 127.0.0.1, a loopback"),
        ("64:ff9b::a9fe:a9fe", "IPv6 form of 169.254.169.254, a cloud metadata"),
        ("64:ff9b:1::a00:1", "IPv6 form of 10.0.0.1, a private"),
        ("64:ff9b:1:7f00:0:100::", "IPv6 form of 127.0.0.1, a loopback"),
        # Teredo: server 65.54.227.120, client 192.168.0.1 (stored inverted)
        ("2001:0:4136:e378:8000:63bf:3f57:fffe", "IPv6 form of 192.168.0.1, a private"),
    ],
)
def test_every_non_global_address_class_is_refused_with_what_it_is(address, words):
    reason = judge(ipaddress.ip_address(address))
    assert reason is not None and words in reason, reason


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "2a00:1450:4001:80b::200e",
                                     "::ffff:8.8.8.8", "2002:808:808::1", "64:ff9b::808:808"])
def test_globally_routable_unicast_addresses_pass(address):
    assert judge(ipaddress.ip_address(address)) is None


def test_embedded_ipv4_is_read_from_every_form():
    def carried(a: str) -> list[str]:
        return [str(x) for x in embedded_ipv4(ipaddress.IPv6Address(a))]

    assert carried("::ffff:1.2.3.4") == ["1.2.3.4"]
    assert carried("::1.2.3.4") == ["1.2.3.4"]
    assert carried("2002:102:304::") == ["1.2.3.4"]
    assert carried("64:ff9b::102:304") == ["1.2.3.4"]
    assert "1.2.3.4" in carried("64:ff9b:1:102:3:400::")
    assert carried("2001:0:4136:e378:8000:63bf:3f57:fffe") == ["65.54.227.120", "192.168.0.1"]
    assert carried("2606:4700::1") == []


def test_metadata_is_refused_in_every_form_even_when_an_allowed_network_covers_it():
    everything = ("0.0.0.0/0", "::/0")
    for address in ("169.254.169.254", "::ffff:169.254.169.254", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::",
                    "100.100.100.200", "fd00:ec2::254", "169.254.170.2"):
        reason = judge(ipaddress.ip_address(address), everything)
        assert reason is not None and "cloud metadata" in reason, address


def test_an_allowed_network_lets_its_addresses_through_judged_as_ipv4():
    assert judge(ipaddress.ip_address("127.0.0.1"), ("127.0.0.0/8",)) is None
    assert judge(ipaddress.ip_address("::ffff:127.0.0.1"), ("127.0.0.0/8",)) is None
    # an IPv6 allow-list does not let an IPv6 form of a private IPv4 address through
    assert judge(ipaddress.ip_address("::ffff:10.0.0.1"), ("::/0",)) is not None
    assert judge(ipaddress.ip_address("100.64.0.1"), ("10.0.0.0/8",)) is not None


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://" + "a" * 70 + ".example/", "label is longer than 63"),
        ("http://" + "ü" * 60 + ".example/", "host name label"),
        ("http://" + ".".join(["abcdefghij"] * 30) + "/", "longer than 253"),
        ("http://a..b/", "empty label"),
        ("http://example.test:99999/", "not a valid URL"),
        ("http://example.test:0/", "port 0"),
        ("http://example.test:/", "empty port"),
        ("http://example.test:http/", "not a valid URL"),
        ("gopher://example.test/", r"not an http\(s\) URL"),
        ("file:///etc/passwd", r"not an http\(s\) URL"),
        ("javascript:alert(1)", r"not an http\(s\) URL"),
        ("http:///path", "has no host"),
        ("http://user@example.test/", "user info"),
        ("http://user:pw@example.test/", "user info"),
        ("http://exa mple.test/", "spaces or control characters"),
        ("http://example.test/\r\nX-Evil: 1", "spaces or control characters"),
        ("http://[::1/", "not a valid URL"),
        ("", "empty"),
        ("http://x/" + "a" * 3000, "longer than 2048"),
        ("http://127.1/", "loopback"),
        ("http://0x7f000001/", "loopback"),
        ("http://2130706433/", "loopback"),
        ("http://[::ffff:7f00:1]/", "loopback"),
        ("http://100.100.100.200/latest/meta-data", "cloud metadata"),
        ("http://[fd00:ec2::254]/", "cloud metadata"),
    ],
)
def test_every_bad_url_is_refused_with_a_reason_never_another_exception(url, words):
    with pytest.raises(UrlRefused, match=words):
        check_url(url, allowed_networks=())


def test_a_pinned_target_keeps_the_host_name_for_host_and_tls():
    target = check_url("https://localhost:8443/p?q=1", allowed_networks=("127.0.0.0/8", "::1/128"))
    assert (target.scheme, target.host, target.port) == ("https", "localhost", 8443)  # TLS verifies the name
    assert target.address in ("127.0.0.1", "::1")  # the connection goes to the address
    assert target.headers() == {"Host": "localhost:8443"}
