"""Secrets at rest (webhook signing secrets): encrypted with Fernet (AES-128-CBC + HMAC-SHA256).

The keys come from ``STANDMEET_SECRET_KEY``: one Fernet key (32 url-safe base64 bytes), or
several separated by commas (cryptography's ``MultiFernet``): the first encrypts, every
one decrypts. Keys rotate without a gap: put the new key first (``NEW,OLD``), run
``standmeet-jobs webhooks rotate-secrets`` (:func:`reseal_all`), which re-encrypts every
stored secret with the first key, then drop the old one. With the embedded database and
no key, one is created beside the embedded data folder (``secret.key``, mode 0600) and
reused. With ``DATABASE_URL`` and no key, storing a secret is refused, naming the
variable: a key kept in the same place as the data it protects would protect nothing.

Stored values look like ``fernet:<token>``; a bare ``whsec_…`` (written before
encryption existed) is still read, so an upgrade loses no endpoint, and
:func:`reseal_all` encrypts it. Errors never include a secret or a key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from cryptography.fernet import Fernet, InvalidToken, MultiFernet

from actors import settings as app_settings
from broker import current_broker
from broker.errors import ConfigError, StandmeetError
from broker.pg import db
from broker.pg.embedded import is_embedded
from broker.settings import Settings

PREFIX = "fernet:"
KEY_FILE = "secret.key"
MAKE_KEY = app_settings.MAKE_KEY
#: Endpoints re-encrypted per transaction by :func:`reseal_all`.
DEFAULT_RESEAL_BATCH = 500
MAX_RESEAL_BATCH = 100_000

#: Every column that holds secrets sealed here: webhook_endpoints.secrets (text[]).
#: Read in batches by id (a keyset, so a long rotation never holds one long transaction);
#: written back only if unchanged since read (a secret added meanwhile is never lost).
ENDPOINT_SECRETS_BATCH = """
SELECT id, secrets FROM standmeet.webhook_endpoints WHERE id > %(after)s ORDER BY id LIMIT %(limit)s
"""
ENDPOINT_SECRETS_ONE = "SELECT secrets FROM standmeet.webhook_endpoints WHERE id = %(id)s"
ENDPOINT_SECRETS_WRITE = """
UPDATE standmeet.webhook_endpoints SET secrets = %(new)s::text[]
WHERE id = %(id)s AND secrets = %(old)s::text[] RETURNING id
"""
#: Times one endpoint is re-read when its secrets changed between read and write.
RESEAL_ATTEMPTS = 5

_cache: dict[tuple[str, ...], tuple[MultiFernet, Fernet]] = {}


class UnreadableSecret(StandmeetError):
    """A stored secret that no key decrypts (named by where it is, never by its value)."""


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


def _keys(settings: Settings | None) -> tuple[MultiFernet, Fernet]:
    """Every key (to decrypt) and the first (to encrypt): STANDMEET_SECRET_KEY, else the
    embedded server's key file beside its data folder (``settings``: the runtime's,
    default the broker's)."""
    settings = settings or current_broker().settings
    keys = app_settings.current().secret_keys
    if not keys:
        if not is_embedded(settings):  # a child of `run` handed the embedded server's URL is embedded too
            raise ConfigError(
                f"{app_settings.VARIABLE} is not set: webhook secrets are stored encrypted, and with DATABASE_URL "
                f"there is no default key; set it to a Fernet key (make one with: {MAKE_KEY})")
        path = key_file(settings)
        keys = app_settings.fernet_keys(_embedded_key(path), variable=str(path))
    if keys not in _cache:
        fernets = [Fernet(key.encode("ascii")) for key in keys]  # checked by fernet_keys
        _cache[keys] = (MultiFernet(fernets), fernets[0])
    return _cache[keys]


def box(settings: Settings | None = None) -> MultiFernet:
    """The keys: the first encrypts, every one decrypts."""
    return _keys(settings)[0]


def seal(secret: str, settings: Settings | None = None) -> str:
    """The stored form of a secret, encrypted with the first key."""
    return PREFIX + box(settings).encrypt(secret.encode("utf-8")).decode("ascii")


def unseal(stored: str, settings: Settings | None = None) -> str:
    """A secret from its stored form (a legacy plaintext ``whsec_…`` is returned as is)."""
    if not stored.startswith(PREFIX):
        return stored
    try:
        return box(settings).decrypt(stored.removeprefix(PREFIX).encode("ascii")).decode("utf-8")
    except (InvalidToken, UnicodeError):
        raise ConfigError(f"a stored webhook secret cannot be decrypted: no key of {app_settings.VARIABLE} "
                          "is the one it was stored with") from None


def reseal(stored: str, settings: Settings | None = None) -> str | None:
    """``stored`` encrypted with the first key, or None when it already is (idempotent).

    A legacy plaintext secret is encrypted; one that no key decrypts raises
    :class:`UnreadableSecret`.
    """
    every, first = _keys(settings)
    if not stored.startswith(PREFIX):
        return seal(stored, settings)
    token = stored.removeprefix(PREFIX).encode("ascii")
    try:
        first.decrypt(token)
        return None
    except InvalidToken:
        pass
    try:
        return PREFIX + every.rotate(token).decode("ascii")
    except InvalidToken:
        raise UnreadableSecret("no key decrypts it") from None


@dataclass
class ResealReport:
    """What :func:`reseal_all` did: how many secrets it re-encrypted, and where it could not."""

    resealed: int = 0
    current: int = 0
    unreadable: list[str] = field(default_factory=list)


def _resealed(stored: Sequence[str], where: str, report: ResealReport,
              settings: Settings | None) -> list[str] | None:
    """The secrets of one row with each re-encrypted (None: nothing to write)."""
    new, changed, unreadable = [], 0, []
    for position, secret in enumerate(stored, start=1):
        try:
            sealed = reseal(secret, settings)
        except UnreadableSecret:
            unreadable.append(f"{where}: secret {position} of {len(stored)}")
            sealed = None
        new.append(secret if sealed is None else sealed)
        changed += sealed is not None
    report.unreadable.extend(unreadable)
    report.resealed += changed
    report.current += len(stored) - changed - len(unreadable)
    return new if changed else None


def reseal_all(*, batch_size: int = DEFAULT_RESEAL_BATCH, settings: Settings | None = None,
               on_unreadable: Callable[[str], object] | None = None) -> ResealReport:
    """Re-encrypt every stored secret with the first key, ``batch_size`` rows a transaction.

    Idempotent: a secret already under the first key is left as it is, so a second run
    re-encrypts nothing. A secret no key decrypts is left untouched and named in the
    report (``endpoint 7: secret 2 of 2``); the others go on.
    """
    if not 1 <= batch_size <= MAX_RESEAL_BATCH:
        raise ConfigError(f"the batch size {batch_size} must be from 1 to {MAX_RESEAL_BATCH}")
    _keys(settings)  # no key: one line before anything is read
    report = ResealReport()
    after = 0
    while True:
        with db.connection() as conn, conn.transaction():
            rows = conn.execute(ENDPOINT_SECRETS_BATCH, {"after": after, "limit": batch_size}).fetchall()
            for endpoint_id, stored in rows:
                before = len(report.unreadable)
                _reseal_endpoint(conn, int(endpoint_id), list(stored), report, settings)
                if on_unreadable is not None:
                    for line in report.unreadable[before:]:
                        on_unreadable(line)
        if len(rows) < batch_size:
            return report
        after = int(rows[-1][0])


def _reseal_endpoint(conn: psycopg.Connection[Any], endpoint_id: int, stored: list[str], report: ResealReport,
                     settings: Settings | None) -> None:
    where = f"webhook endpoint {endpoint_id}"
    for _ in range(RESEAL_ATTEMPTS):
        attempt = ResealReport()
        new = _resealed(stored, where, attempt, settings)
        if new is None or conn.execute(ENDPOINT_SECRETS_WRITE, {"id": endpoint_id, "new": new,
                                                                "old": stored}).fetchone() is not None:
            report.resealed += attempt.resealed
            report.current += attempt.current
            report.unreadable.extend(attempt.unreadable)
            return
        row = conn.execute(ENDPOINT_SECRETS_ONE, {"id": endpoint_id}).fetchone()
        if row is None:  # deleted meanwhile: nothing left to re-encrypt
            return
        stored = list(row[0])
    report.unreadable.append(f"{where}: its secrets kept changing during the rotation; run it again")
