"""The settler's client CPU per settle: psycopg's own conversion beside a LongStatement.

A settle of ``--batch`` done runs (``sql.SETTLE_DONE``, rows that match nothing, so the
server's work is small and alike on both sides) is executed ``--n`` times on one
connection, the two ways alternated ``--runs`` times each: as the statement's text through
``conn.execute`` (psycopg converts its placeholders and dumps its lists at every call),
and as the settler runs it (``broker.pg.long_statement.LongStatement``: converted once,
lists sent as Postgres's text of an array). Prints this process's CPU per settle, the
medians and ranges, then ``ratio: N.NN`` (LongStatement / psycopg's own).

    python bench/settle_cpu.py --n 1500 --runs 5
"""

from __future__ import annotations

import argparse
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages and tests
    sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.common import fresh_database, median  # noqa: E402
from broker.engine import sql  # noqa: E402
from broker.pg.long_statement import LongStatement  # noqa: E402
from tests.support import db as testdb  # noqa: E402


def settle_params(batch: int) -> dict[str, Any]:
    """The parameters of one settle of ``batch`` done runs, as the settler makes them."""
    return {"ids": [str(uuid.uuid4()) for _ in range(batch)], "claims": [1] * batch,
            "worker_id": str(uuid.uuid4()), "s_ids": [], "s_claims": [], "awaited": [],
            "actors": ["bench.noop"] * batch, "started_ago": [0.001] * batch, "ended_ago": [0.0005] * batch}


def cpu_per_settle_us(conn: psycopg.Connection[Any], way: str, n: int, batch: int) -> float:
    statement = LongStatement(sql.SETTLE_DONE)
    params = [settle_params(batch) for _ in range(n)]
    c0 = time.process_time()
    if way == "psycopg":
        for p in params:
            conn.execute(sql.SETTLE_DONE, p)
    else:
        for p in params:
            statement.execute(conn, p)
    return (time.process_time() - c0) / n * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1500, help="settles per measurement")
    parser.add_argument("--runs", type=int, default=5, help="measurements of each way, alternated")
    parser.add_argument("--batch", type=int, default=6, help="runs a settle writes")
    args = parser.parse_args(argv)
    admin_url = testdb.server_url()
    url = fresh_database(admin_url, "bench_settle_cpu", ours=True)
    figures: dict[str, list[float]] = {"psycopg": [], "long": []}
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            for _ in range(args.runs):
                for way in figures:
                    figures[way].append(cpu_per_settle_us(conn, way, args.n, args.batch))
    finally:
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))
    for way, label in (("psycopg", "psycopg's own conversion and list dumpers"),
                       ("long", "LongStatement (converted once, arrays as text)")):
        values = figures[way]
        print(f"{label}: {median(values):.1f} ({min(values):.1f}-{max(values):.1f}) µs of CPU per settle "
              f"of {args.batch}")
    print(f"ratio: {median(figures['long']) / median(figures['psycopg']):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
