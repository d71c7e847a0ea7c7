"""The runtime's migrations as the code before the application's tables left them (24 files).

The eight that left the runtime or changed since are frozen in
``tests/acceptance/data/migrations_before_split/``; the other sixteen are the runtime's
own files, unchanged since: they are read from ``broker/pg/migrations`` and checked
against the SHA-256 of what the old code applied, so that an edit of an applied
migration fails the tests instead of passing unseen.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FROZEN = ROOT / "tests" / "acceptance" / "data" / "migrations_before_split"
RUNTIME = ROOT / "broker" / "pg" / "migrations"
#: The old migrations the runtime still has, byte for byte: name -> SHA-256 of the file.
UNCHANGED = {
    "0001_dramatiq_queue": "d58b5b3ff1eba6bca6d1abb5d2d18b4bca6008ebf02bbb316b03323af5fbf40f",
    "0002_worker_processes": "7bedfc0aba6ef4ea9c86677dcaa76188f9be8922231ef256293c4bb41a4e7180",
    "0004_periodic_runs": "b211d8c91e63627a993666e339132a4ee26639020ed11aab3bbe36f323ad5180",
    "0005_outbox": "6923571dd058923c2862fb042f1178b92173a5f637cac91fdd6067ae5b7bb9fe",
    "0008_fair_claims": "07d65465b6242a1b1eac9a7e9e7ec92f24da196628a5f5177b0ce95201eb5651",
    "0009_results_and_rate_limits": "496d6247b1acb3ad0c62a31a16e87d32804af0224950677937508586e94948c0",
    "0012_channel_functions": "111a1c8c5c81ac8e004c2b38bb9818dca7adc1f7232cc12056688f03415184e5",
    "0013_suspect_claim_index": "e273463d231754c68e8cf860f0483cb1f6a20374ada3360dc9819d230f1ceb62",
    "0014_queue_autovacuum": "4769a12cb47b44bfdc53a67cb26656a25f2ac911d9e66682613758df9124b586",
    "0017_server_epoch": "0804e0f92bc672939e39ac3f7119688dcbe0377b396bb2aebf97cb110e4a0cb9",
    "0018_relays": "ac07de855ca0c8e824a6c5dd612fa57677dc7d75804ba3f3eb4c998f441d114d",
    "0019_blamed_worker": "18f3162a3b04d2ad072bdad4ae9e541f23cbd215d6eacec36d337a1f85f142ca",
    "0020_runs_without_outcome": "9527b968397d17958692ebc863527dab44146d66bec218a407aa565d85830b26",
    "0021_unique_jobs": "294569ccb48778f3cbfb8975b2ccc120e5294d2abc4124d4094a7c59be8cc8fd",
    "0022_history_and_attempts": "f30a8ca8e8431380c4793852867f67c40287f937d320706f904750ab943abc1d",
    "0023_periodic_schedules": "dc72499fe137c21bcb2655364f73b9ba8b143d25b18142dd3b67fb920ff1c19f",
}


def old_migrations() -> list[tuple[str, str]]:
    """``(name, sql)`` of each old migration, in version order."""
    found = {path.stem: path.read_text(encoding="utf-8") for path in FROZEN.glob("*.sql")}
    for name, digest in UNCHANGED.items():
        data = (RUNTIME / f"{name}.sql").read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise AssertionError(f"broker/pg/migrations/{name}.sql changed since databases applied it: "
                                 "an applied migration is never edited; add a new one")
        found[name] = data.decode("utf-8")
    return sorted(found.items(), key=lambda item: int(item[0].split("_", 1)[0]))
