"""A process that sends one unique call many times: ``python -m tests.support.unique_sender
LABEL N``. It says ``ready`` once its broker is configured and connected, waits for a line
on stdin (so that every sender starts at once), sends, then prints one JSON line: the
distinct message ids its sends returned and the skips it counted in its own process.
"""

from __future__ import annotations

import json
import sys

from prometheus_client import REGISTRY

import broker
from tests.support import unique_jobs


def main(label: str, n: int) -> int:
    broker.current_broker().execute("SELECT 1")  # the send pool is open before the start
    print("ready", flush=True)
    sys.stdin.readline()
    ids = {unique_jobs.unique.send(label).message_id for _ in range(n)}
    skipped = REGISTRY.get_sample_value("standmeet_unique_skipped_total", {"queue": "index", "actor": "test.unique"})
    print(json.dumps({"ids": sorted(ids), "skipped": skipped or 0}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
