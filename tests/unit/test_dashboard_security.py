"""The dashboard's guards that need no server: where it may listen, and who may look."""

from __future__ import annotations

import base64

import pytest

from broker.dashboard.security import check_bind, credentials_match, is_loopback
from broker.errors import ConfigError


def basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


@pytest.mark.parametrize("host", ["127.0.0.1", "127.8.9.10", "::1", "[::1]", "localhost", "LOCALHOST"])
def test_loopback_addresses_are_loopback(host):
    assert is_loopback(host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "192.168.1.2", "example.com", ""])
def test_other_addresses_are_not(host):
    assert not is_loopback(host)


def test_binding_beyond_loopback_needs_the_password_and_says_which_variable():
    check_bind("127.0.0.1", None)
    check_bind("0.0.0.0", "s3cret")
    with pytest.raises(ConfigError, match="STANDMEET_DASHBOARD_PASSWORD"):
        check_bind("0.0.0.0", None)


def test_only_the_right_user_and_password_pass_basic_auth():
    assert credentials_match(basic("admin", "s3cret"), "admin", "s3cret")
    assert credentials_match(basic("admin", "pa:ss"), "admin", "pa:ss")  # a colon in the password
    assert not credentials_match(basic("admin", "wrong"), "admin", "s3cret")
    assert not credentials_match(basic("root", "s3cret"), "admin", "s3cret")
    assert not credentials_match("Bearer abc", "admin", "s3cret")
    assert not credentials_match("Basic not-base64!", "admin", "s3cret")
    assert not credentials_match(None, "admin", "s3cret")


def test_a_wildcard_bind_answers_to_the_machines_own_names_and_loopback():
    import socket

    from broker.dashboard.security import allowed_hosts, normal_host

    hosts = allowed_hosts("0.0.0.0", ["jobs.example.com"])
    assert normal_host(socket.gethostname()) in hosts
    assert {"127.0.0.1", "localhost", "::1", "jobs.example.com"} <= hosts
    assert "attacker.example" not in hosts and "0.0.0.0" not in hosts


def test_a_specific_address_answers_to_itself_and_the_allowed_names_only():
    from broker.dashboard.security import allowed_hosts

    assert allowed_hosts("10.1.2.3", ["Jobs.Example.com."]) == {"10.1.2.3", "jobs.example.com"}
    assert allowed_hosts("127.0.0.2") == {"127.0.0.1", "127.0.0.2", "localhost", "::1"}


@pytest.mark.parametrize("value", ["https://jobs.example.com", "jobs.example.com:443", "jobs.example.com/x",
                                   "a b", "*"])
def test_an_allowed_host_that_is_not_a_host_name_is_refused_in_one_line(value):
    from broker.dashboard.security import parse_allowed_hosts

    with pytest.raises(ConfigError) as refused:
        parse_allowed_hosts(f"ok.example.com,{value}")
    message = str(refused.value)
    assert "STANDMEET_DASHBOARD_ALLOWED_HOSTS" in message and value in message and "\n" not in message


def test_allowed_hosts_are_comma_separated_and_blanks_ignored():
    from broker.dashboard.security import parse_allowed_hosts

    assert parse_allowed_hosts(" a.example , ,B.example,::1") == ("a.example", "b.example", "::1")
    assert parse_allowed_hosts("") == ()
