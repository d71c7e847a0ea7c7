"""Webhook signing secrets: long enough, encrypted at rest, never in the database's text."""

from __future__ import annotations

import base64
import stat

import pytest
from psycopg import sql

from actors import secretbox, webhooks
from actors import settings as app_settings
from broker.errors import ConfigError
from broker.settings import replace
from tests.support.db import query

LOOPBACK = ("127.0.0.0/8",)


def database_text(url: str) -> str:
    """Every row of every table of the database as text: what a dump would show."""
    tables = query(url, "SELECT table_schema, table_name FROM information_schema.tables"
                        " WHERE table_type = 'BASE TABLE' AND table_schema NOT IN ('pg_catalog', 'information_schema')")
    parts = []
    for schema, table in tables:
        statement = sql.SQL("SELECT t::text FROM {}.{} t").format(sql.Identifier(schema), sql.Identifier(table))
        parts.extend(row[0] for row in query(url, statement.as_string(None)))
    return "\n".join(parts)


@pytest.fixture
def loopback(broker):
    with app_settings.overridden(allowed_networks=LOOPBACK) as changed:
        yield changed


@pytest.fixture
def no_key():
    """STANDMEET_SECRET_KEY unset (the tests' processes all have one)."""
    with app_settings.overridden(secret_key=None) as changed:
        yield changed


def test_generated_secrets_hold_32_random_bytes_and_short_ones_are_refused(loopback):
    _, secret = webhooks.add_endpoint("http://127.0.0.1:9/a", ["x"])
    assert len(base64.b64decode(secret.removeprefix("whsec_"))) == 32
    short = "whsec_" + base64.b64encode(b"k" * 23).decode()
    for bad in ("whsec_", "whsec_" + base64.b64encode(b"k").decode(), short):
        with pytest.raises(webhooks.WebhookError, match="at least 24 random bytes") as refused:
            webhooks.add_endpoint("http://127.0.0.1:9/b", ["x"], secret=bad)
        assert bad not in str(refused.value)
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/c", ["x"])
    with pytest.raises(webhooks.WebhookError, match="at least 24"):
        webhooks.rotate_secret(endpoint, short)


def test_secrets_are_encrypted_at_rest_and_absent_from_a_dump_of_the_database(loopback, database_url):
    given = "whsec_" + base64.b64encode(b"a very secret signing key, 40 bytes long").decode()
    endpoint, _ = webhooks.add_endpoint("http://127.0.0.1:9/d", ["x"], secret=given)
    rotated = webhooks.rotate_secret(endpoint)
    stored = query(database_url, "SELECT secrets FROM standmeet.webhook_endpoints WHERE id = %s", (endpoint,))[0][0]
    assert all(s.startswith(secretbox.PREFIX) for s in stored)
    assert webhooks.open_secrets(stored) == [given, rotated]
    dump = database_text(database_url)
    for secret in (given, rotated):
        assert secret not in dump and secret.removeprefix("whsec_") not in dump
    assert "a very secret" not in dump


def test_without_a_key_a_server_database_refuses_to_store_a_secret_naming_the_variable(broker, no_key):
    settings = replace(broker.settings, database_url="postgresql://db.example.test/app")
    with pytest.raises(ConfigError, match="STANDMEET_SECRET_KEY is not set"):
        secretbox.seal(webhooks.new_secret(), settings)
    with pytest.raises(ConfigError, match="^STANDMEET_SECRET_KEY: key 1 of 1 is not a Fernet key"):
        replace(app_settings.current(), secret_key="not-a-fernet-key")


def test_the_embedded_default_key_is_made_once_beside_the_data_with_mode_0600(broker, no_key, tmp_path):
    settings = replace(broker.settings, database_url=None, embedded_dir=tmp_path / "pgdata")
    sealed = secretbox.seal("whsec_abc", settings)
    key = tmp_path / "secret.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    first = key.read_text()
    assert secretbox.unseal(sealed, settings) == "whsec_abc"  # the same key, read back
    assert key.read_text() == first
    other = replace(settings, embedded_dir=tmp_path / "elsewhere" / "pgdata")
    with pytest.raises(ConfigError, match="cannot be decrypted"):
        secretbox.unseal(sealed, other)


def test_a_child_of_run_handed_the_embedded_servers_url_uses_the_embedded_key(broker, no_key, tmp_path):
    data = tmp_path / "pgdata"
    embedded = replace(broker.settings, database_url=None, embedded_dir=data)
    child = replace(embedded, database_url=f"postgresql://postgres:@/standmeet?host={data.resolve()}")
    assert secretbox.unseal(secretbox.seal("whsec_abc", embedded), child) == "whsec_abc"
    elsewhere = replace(child, database_url="postgresql://postgres@db.example.test/standmeet")
    with pytest.raises(ConfigError, match="STANDMEET_SECRET_KEY is not set"):
        secretbox.seal("whsec_abc", elsewhere)
