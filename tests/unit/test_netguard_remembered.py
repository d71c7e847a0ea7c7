"""What the request-forgery guard remembers between checks (a URL's form, an address's
verdict) and what it never does (a name's answer): a name that answers with another
address at the next request is judged by that address."""

from __future__ import annotations

import socket

import pytest

from actors import netguard
from actors.netguard import UrlRefused, check_url

LOOPBACK = ("127.0.0.0/8",)


def answering(*addresses: str):
    """A resolver (socket.getaddrinfo's shape) that gives each address in turn, one per call."""
    answers = list(addresses)
    calls: list[str] = []

    def getaddrinfo(host, port, *args, **kwargs):
        calls.append(host)
        address = answers.pop(0) if len(answers) > 1 else answers[0]
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        return [(family, socket.SOCK_STREAM, 6, "", (address, port))]

    getaddrinfo.calls = calls  # type: ignore[attr-defined]
    return getaddrinfo


def test_a_name_is_resolved_again_at_every_check_and_a_changed_answer_is_judged(monkeypatch):
    # Given a name that answers with a public address, then with the metadata address
    resolver = answering("93.184.216.34", "169.254.169.254")
    monkeypatch.setattr(netguard.socket, "getaddrinfo", resolver)
    url = "http://rebinding.example.test/hook"
    # When the same URL is checked twice
    first = check_url(url)
    with pytest.raises(UrlRefused, match="metadata") as second:
        check_url(url)
    # Then the second check resolved the name again and refused the new answer
    assert first.address == "93.184.216.34"
    assert resolver.calls == ["rebinding.example.test", "rebinding.example.test"]
    assert "169.254.169.254" in str(second.value)


def test_an_address_written_out_is_judged_without_a_lookup(monkeypatch):
    resolver = answering("93.184.216.34")
    monkeypatch.setattr(netguard.socket, "getaddrinfo", resolver)
    assert check_url("http://127.0.0.1:8123/hook", allowed_networks=LOOPBACK).address == "127.0.0.1"
    with pytest.raises(UrlRefused, match="loopback"):
        check_url("http://[::1]:8123/hook")
    assert resolver.calls == []
    # a short form is not an address written out: it is resolved (and judged by its answer)
    assert check_url("http://127.1:8123/hook").address == "93.184.216.34"
    assert resolver.calls == ["127.1"]


def test_a_remembered_verdict_follows_the_allowed_networks_given():
    url = "http://127.0.0.1:8123/hook"
    assert check_url(url, allowed_networks=LOOPBACK).address == "127.0.0.1"
    with pytest.raises(UrlRefused, match="loopback"):
        check_url(url)
    assert check_url(url, allowed_networks=LOOPBACK).address == "127.0.0.1"


def test_a_refused_url_is_refused_again_with_the_same_reason():
    for _ in range(2):
        with pytest.raises(UrlRefused, match="carries credentials"):
            check_url("http://user:pw@example.test/")
