"""This application's settings: mail, search, webhooks, documents, job sources, the secret key.

Declared like the runtime's (``broker.settings``), one field each, with the same
``STANDMEET_`` variables as before they moved here. Registered with the runtime
(``broker.app.settings``), so that its variables count as declared and every process
validates them at start-up. :func:`current` is this process's, built once and cached.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Literal

from cryptography.fernet import Fernet
from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode

from broker import app
from broker.errors import ConfigError
from broker.settings import MIB, Declared, replace, shown

#: Upper bounds of the application's numbers: finite, so that no value an operator can
#: type (1e300) passes `check` and overflows a timer, an interval or an allocation later.
HOUR_S = 3_600
#: A document is read whole into memory and stored as one Postgres value (at most 1 GiB).
MAX_DOCUMENT_BYTES = 256 * MIB
#: Ten years: far past any continuous failure worth waiting for.
MAX_DISABLE_AFTER_DAYS = 3_650
VARIABLE = "STANDMEET_SECRET_KEY"
MAKE_KEY = "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"


class AppSettings(Declared):
    """The application's settings. Build with :meth:`from_env`; the process's is :func:`current`."""

    secret_key: str | None = Field(
        None, repr=False,
        json_schema_extra=shown("(embedded: `secret.key` beside the data folder, mode 0600)"),
        description="Fernet keys, comma-separated: the first encrypts webhook secrets at rest, every one "
        "decrypts (`webhooks rotate-secrets` re-encrypts with the first); with `DATABASE_URL` it must be set, "
        "or storing a secret is refused")
    document_max_bytes: int = Field(
        1024 * 1024, ge=1, le=MAX_DOCUMENT_BYTES, description="largest document (title and body, UTF-8) `write` accepts; "
        "the search index holds a bounded prefix of each")
    smtp_host: str = Field("localhost", description="the SMTP server mail goes through")
    smtp_port: int = Field(25, ge=1, le=65535, description="its port")
    smtp_from: str = Field("standmeet@localhost", description="the sender of mail")
    smtp_starttls: bool = Field(False, description="`1`: STARTTLS before sending")
    smtp_username: str | None = Field(None, description="SMTP login (unset: none)")
    smtp_password: str | None = Field(None, repr=False, description="SMTP password")
    smtp_timeout_s: float = Field(10.0, ge=0.1, le=HOUR_S, description="SMTP's network timeout (< the 30 s job limit)")
    search_backend: Literal["postgres", "meilisearch"] = Field(
        "postgres", description="`postgres` (full-text, GIN) or `meilisearch`")
    meili_url: str = Field("http://127.0.0.1:7700", description="Meilisearch's address")
    meili_key: str | None = Field(None, repr=False, description="Meilisearch's API key")
    meili_index: str = Field("documents", description="Meilisearch's index")
    allowed_networks: Annotated[tuple[str, ...], NoDecode] = Field(
        (), validation_alias="STANDMEET_WEBHOOK_ALLOWED_NETWORKS", json_schema_extra=shown("(empty)"),
        description="comma-separated CIDRs the request-forgery guard lets through (e.g. `127.0.0.0/8` in tests)")
    webhook_lease_s: float = Field(
        20.0, ge=0.1, le=HOUR_S, description="the endpoint lease; start-up refuses unless HTTP timeout < webhook job "
        "limit (15) < lease")
    webhook_http_timeout_s: float = Field(10.0, ge=0.05, le=HOUR_S, description="a webhook POST's total deadline")
    webhook_busy_snooze_s: float = Field(
        2.0, ge=0.01, le=HOUR_S, description="how long a delivery to a busy endpoint snoozes (plus jitter)")
    webhook_disable_after_days: float = Field(
        5.0, ge=0, le=MAX_DISABLE_AFTER_DAYS, description="continuous failure before the health job disables an endpoint")

    @field_validator("secret_key", "smtp_username", "smtp_password", "meili_key", mode="before")
    @classmethod
    def _blank_is_unset(cls, raw: Any) -> Any:
        return (raw.strip() or None) if isinstance(raw, str) else raw

    @field_validator("secret_key", mode="after")
    @classmethod
    def _fernet_keys(cls, raw: str | None) -> str | None:
        if raw is not None:
            fernet_keys(raw)
        return raw

    @property
    def secret_keys(self) -> tuple[str, ...]:
        """The keys of STANDMEET_SECRET_KEY, first (the one that encrypts) first; () when unset."""
        return fernet_keys(self.secret_key) if self.secret_key else ()

    @field_validator("search_backend", mode="before")
    @classmethod
    def _lower(cls, raw: Any) -> Any:
        return raw.strip().lower() if isinstance(raw, str) else raw

    @field_validator("meili_url", mode="after")
    @classmethod
    def _no_trailing_slash(cls, url: str) -> str:
        return url.strip().rstrip("/")

    @field_validator("allowed_networks", mode="before")
    @classmethod
    def _networks(cls, raw: Any) -> tuple[str, ...]:
        parts = raw.split(",") if isinstance(raw, str) else list(raw or ())
        networks = []
        for part in (str(p).strip() for p in parts):
            if not part:
                continue
            try:
                networks.append(str(ipaddress.ip_network(part, strict=False)))
            except ValueError:
                raise ConfigError(f"STANDMEET_WEBHOOK_ALLOWED_NETWORKS: {part!r} is not a network in CIDR form "
                                  "(e.g. 127.0.0.0/8)") from None
        return tuple(networks)

    @model_validator(mode="after")
    def _webhook_timings(self) -> AppSettings:
        if not self.webhook_http_timeout_s < self.webhook_lease_s:
            raise ConfigError(
                f"STANDMEET_WEBHOOK_HTTP_TIMEOUT_S={self.webhook_http_timeout_s:g} must be below "
                f"STANDMEET_WEBHOOK_LEASE_S={self.webhook_lease_s:g}: webhook timings must be "
                "HTTP timeout < job limit < endpoint lease")
        return self


def fernet_keys(raw: str, *, variable: str = VARIABLE) -> tuple[str, ...]:
    """The comma-separated Fernet keys of ``raw``; a malformed one is refused in one line
    naming ``variable`` and its position (never the key itself)."""
    parts = [part.strip() for part in raw.split(",")]
    for position, part in enumerate(parts, start=1):
        where = f"{variable}: key {position} of {len(parts)}"
        if not part:
            raise ConfigError(f"{where} is empty (give Fernet keys separated by commas, the newest first)")
        try:
            Fernet(part.encode("ascii"))
        except (ValueError, TypeError, UnicodeError):
            raise ConfigError(f"{where} is not a Fernet key (32 url-safe base64 bytes; make one with: "
                              f"{MAKE_KEY})") from None
    return tuple(parts)


app.settings(AppSettings)


def current() -> AppSettings:
    """This process's application settings, built from the environment once and cached."""
    return AppSettings.current()


def use(settings: AppSettings | None) -> None:
    """Make ``settings`` this process's (None: rebuilt from the environment when next used)."""
    AppSettings.use(settings)


@contextmanager
def overridden(**changes: Any) -> Iterator[AppSettings]:
    """This process's settings with ``changes`` while the block runs (tests, commands)."""
    before = current()
    changed = replace(before, **changes)
    use(changed)
    try:
        yield changed
    finally:
        use(before)
