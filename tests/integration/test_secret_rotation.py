"""Rotating STANDMEET_SECRET_KEY: several keys, the first encrypts, every one decrypts, and
`reseal_all` re-encrypts every stored secret with the first, in batches, idempotently."""

from __future__ import annotations

import json

import psycopg
import pytest
from cryptography.fernet import Fernet
from standardwebhooks import Webhook

from actors import secretbox, webhooks
from actors import settings as app_settings
from broker.errors import ConfigError
from tests.support.db import query, wait_for
from tests.support.http import http_server

A, B, C = (Fernet.generate_key().decode() for _ in range(3))


def stored_secrets(database_url: str) -> dict[int, list[str]]:
    return {row[0]: list(row[1]) for row in query(database_url, "SELECT id, secrets FROM standmeet.webhook_endpoints")}


def under(key: str, stored: str) -> bool:
    """Whether ``stored`` is encrypted with ``key``."""
    try:
        Fernet(key.encode()).decrypt(stored.removeprefix(secretbox.PREFIX).encode())
        return True
    except Exception:
        return False


def test_a_full_rotation_from_key_a_to_b_keeps_every_secret_and_deliveries_still_sign(
    broker, database_url, start_worker, webhook_settings
):
    with http_server() as (url, server):
        # Given secrets written under key A alone: five endpoints (one with two secrets), and
        # one secret stored in plaintext before encryption existed
        with app_settings.overridden(secret_key=A):
            endpoints = dict(webhooks.add_endpoint(url, [f"rotation.{n}"]) for n in range(5))
            first = next(iter(endpoints))
            endpoints[first] = [endpoints[first], webhooks.rotate_secret(first)]
        legacy_secret = webhooks.new_secret()
        legacy = query(database_url, "INSERT INTO standmeet.webhook_endpoints (url, event_types, secrets)"
                                     " VALUES (%s, %s, %s) RETURNING id", (url, ["rotation.legacy"], [legacy_secret]))[0][0]
        # and one under a key nobody has any more
        with app_settings.overridden(secret_key=C):
            lost, _ = webhooks.add_endpoint(url, ["rotation.lost"])
        expected = {e: s if isinstance(s, list) else [s] for e, s in endpoints.items()} | {legacy: [legacy_secret]}

        # When the keys become "B,A": the new key encrypts, the old one still decrypts
        with app_settings.overridden(secret_key=f"{B},{A}"):
            assert under(B, secretbox.seal("whsec_x"))
            assert {e: webhooks.open_secrets(stored_secrets(database_url)[e]) for e in expected} == expected
            # and every stored secret is re-encrypted with B, two endpoints a transaction
            named: list[str] = []
            report = secretbox.reseal_all(batch_size=2, on_unreadable=named.append)
            assert (report.resealed, report.current) == (7, 0)  # six under A, one plaintext
            assert report.unreadable == named == [f"webhook endpoint {lost}: secret 1 of 1"]
            # a second run has nothing left to do
            again = secretbox.reseal_all(batch_size=2)
            assert (again.resealed, again.current, len(again.unreadable)) == (0, 7, 1)

        stored = stored_secrets(database_url)
        assert all(under(B, s) and not under(A, s) for e in expected for s in stored[e])
        assert under(C, stored[lost][0])  # left as it was, not lost

        # Then with B alone every secret still decrypts, and deliveries still sign with them
        with app_settings.overridden(secret_key=B):
            assert {e: webhooks.open_secrets(stored[e]) for e in expected} == expected
            start_worker(queues=["webhook"], threads=4)
            with psycopg.connect(database_url) as conn, conn.transaction():
                webhooks.emit_event(conn, "rotation.0", {"n": 0})
                webhooks.emit_event(conn, "rotation.legacy", {"n": "legacy"})
            wait_for(lambda: len(server.received) == 2, timeout_s=15, what="two signed deliveries")
        received = {json.loads(body)["data"]["n"]: (body, headers)
                    for body, headers in zip(server.received, server.headers, strict=True)}
    assert set(received) == {0, "legacy"}
    for secret in expected[first]:  # both secrets of the rotated endpoint sign
        assert _verifies(secret, *received[0])
    assert _verifies(legacy_secret, *received["legacy"])
    assert not _verifies(legacy_secret, *received[0])


def _verifies(secret: str, body: bytes, headers: dict[str, str]) -> bool:
    try:
        Webhook(secret).verify(body, headers)
        return True
    except Exception:
        return False


@pytest.mark.parametrize("value, position", [("not-a-key", "key 1 of 1"), (f"{A},short", "key 2 of 2"),
                                             (f"{A},,{B}", "key 2 of 3"), (f"{A},{B},{A[:-2]}", "key 3 of 3")],
                         ids=["not-a-key", "second-short", "second-empty", "third-cut"])
def test_a_malformed_key_is_refused_in_one_line_naming_the_variable_and_its_position(value, position):
    with pytest.raises(ConfigError) as refused:
        app_settings.AppSettings.from_env({"STANDMEET_SECRET_KEY": value})
    line = str(refused.value)
    assert line.startswith(f"STANDMEET_SECRET_KEY: {position} is ") and "\n" not in line
    assert A not in line and B not in line  # a key is never repeated
