"""Webhook signing secrets at rest: encrypted with Fernet (AES-128-CBC + HMAC-SHA256).

The key comes from ``STANDMEET_SECRET_KEY`` (a Fernet key: 32 url-safe base64 bytes).
With the embedded database and no key, one is created beside the embedded data folder
(``secret.key``, mode 0600) and reused. With ``DATABASE_URL`` and no key, storing a
secret is refused, naming the variable: a key kept in the same place as the data it
protects would protect nothing.

Stored values look like ``fernet:<token>``; a bare ``whsec_…`` (written before
encryption existed) is still read, so an upgrade loses no endpoint. Errors never
include a secret.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.fernet import Fernet, InvalidToken

from actors import settings as app_settings
from broker import current_broker
from broker.embedded import is_embedded
from broker.errors import ConfigError
from broker.settings import Settings

PREFIX = "fernet:"
KEY_FILE = "secret.key"
MAKE_KEY = "python -c 'from cryptography.fernet import Fernet; print(Fernet.generate_key().decode())'"

_cache: dict[str, Fernet] = {}


def key_file(settings: Settings) -> Path:
    """Where the embedded default key lives: beside the embedded data folder."""
    return settings.embedded_dir.expanduser().resolve().parent / KEY_FILE


def _embedded_key(path: Path) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return path.read_text(encoding="ascii").strip()
    with os.fdopen(fd, "w", encoding="ascii") as out:
        out.write(Fernet.generate_key().decode() + "\n")
    return path.read_text(encoding="ascii").strip()


def fernet(settings: Settings | None = None) -> Fernet:
    """The key: STANDMEET_SECRET_KEY (the application's setting), else the embedded server's
    key file beside its data folder (``settings``: the runtime's, default the broker's)."""
    settings = settings or current_broker().settings
    secret_key = app_settings.current().secret_key
    if secret_key:
        key, origin = secret_key, "STANDMEET_SECRET_KEY"
    elif is_embedded(settings):  # also a child of `run`, handed the embedded server's URL
        path = key_file(settings)
        key, origin = _embedded_key(path), str(path)
    else:
        raise ConfigError(
            "STANDMEET_SECRET_KEY is not set: webhook secrets are stored encrypted, and with DATABASE_URL "
            f"there is no default key; set it to a Fernet key (make one with: {MAKE_KEY})")
    if key not in _cache:
        try:
            _cache[key] = Fernet(key.encode("ascii"))
        except (ValueError, TypeError, UnicodeError):
            raise ConfigError(f"the key in {origin} is not a Fernet key (make one with: {MAKE_KEY})") from None
    return _cache[key]


def seal(secret: str, settings: Settings | None = None) -> str:
    """The stored form of a secret."""
    return PREFIX + fernet(settings).encrypt(secret.encode("utf-8")).decode("ascii")


def unseal(stored: str, settings: Settings | None = None) -> str:
    """A secret from its stored form (a legacy plaintext ``whsec_…`` is returned as is)."""
    if not stored.startswith(PREFIX):
        return stored
    try:
        return fernet(settings).decrypt(stored.removeprefix(PREFIX).encode("ascii")).decode("utf-8")
    except InvalidToken:
        raise ConfigError("a stored webhook secret cannot be decrypted: STANDMEET_SECRET_KEY is not the key "
                          "it was stored with") from None
