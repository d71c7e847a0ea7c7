from __future__ import annotations

import base64
import hashlib
import hmac

import pytest
from standardwebhooks import Webhook

from actors.netguard import UrlRefused, check_url
from actors.webhooks import new_secret, sign


def test_a_checked_url_is_pinned_to_the_address_that_was_checked():
    target = check_url("http://localhost:8123/hook?x=1", allowed_networks=("127.0.0.0/8", "::1/128"))
    assert target.address in ("127.0.0.1", "::1") and target.port == 8123
    assert target.url == "http://localhost:8123/hook?x=1"  # the request target comes from it
    assert target.headers() == {"Host": "localhost:8123"}


@pytest.mark.parametrize(
    "url, words",
    [
        ("http://127.0.0.1/", "a loopback address"),
        ("http://10.1.2.3/", "a private address"),
        ("http://192.168.0.5/", "a private address"),
        ("http://169.254.10.10/", "a link-local address"),
        ("http://169.254.169.254/latest/meta-data", "a cloud metadata address"),
        ("http://[::1]/", "a loopback address"),
        ("ftp://example.test/", r"not an http\(s\) URL"),
        ("http://user:pw@example.test/", "carries credentials"),
        ("http://no-such-host.invalid/", "does not resolve"),
    ],
)
def test_forbidden_or_malformed_urls_are_refused_with_the_reason(url, words):
    with pytest.raises(UrlRefused, match=words):
        check_url(url)


def test_the_metadata_address_is_refused_even_when_its_network_is_allowed():
    with pytest.raises(UrlRefused, match="metadata"):
        check_url("http://169.254.169.254/", allowed_networks=("169.254.0.0/16",))


def test_a_signature_is_the_base64_hmac_of_id_timestamp_and_body_per_secret():
    s1, s2 = new_secret(), new_secret()
    body = b'{"a":1}'
    header = sign([s1, s2], "msg_1", 1700000000, body)
    parts = header.split(" ")
    assert len(parts) == 2 and all(p.startswith("v1,") for p in parts)
    expected = base64.b64encode(hmac.new(base64.b64decode(s1[6:]), b"msg_1.1700000000." + body,
                                         hashlib.sha256).digest()).decode()
    assert parts[0] == "v1," + expected
    headers = {"webhook-id": "msg_1", "webhook-timestamp": "1700000000", "webhook-signature": header}
    from freezegun import freeze_time

    with freeze_time("2023-11-14 22:13:20"):
        assert Webhook(s2).verify(body, headers) == {"a": 1}


def test_a_short_secret_stored_before_the_minimum_still_signs_but_a_new_one_is_refused():
    from actors.webhooks import WebhookError, check_new_secret

    legacy = "whsec_" + base64.b64encode(b"short").decode()
    assert sign([legacy], "msg_1", 1700000000, b"{}").startswith("v1,")
    with pytest.raises(WebhookError, match="at least 24 random bytes"):
        check_new_secret(legacy)
    check_new_secret(new_secret())
