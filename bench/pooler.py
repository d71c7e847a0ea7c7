"""The peers benchmark's drain (workload A) through PgBouncer beside the same drain direct.

    python bench/pooler.py                               # 3 runs each way, 5,000 jobs
    python bench/pooler.py --runs 5 --n 5000 --mode transaction --listen direct
    BENCH_PG_SERVER=postgresql://postgres@127.0.0.1:5432 python bench/pooler.py
    python bench/pooler.py --runs 1 --n 200 --database bench_pooler_smoke   # the CI smoke

Starts Debian's PgBouncer (``tests/support/pgbouncer.py``: stock settings, pool mode
``--mode``) in front of the server, then alternates ``bench.py standmeet A`` of
``../shared/bench-peers`` direct and through the pooler, each run in a fresh
``--database`` (``bench_standmeet_pooler`` unless told: the peers' harness drops and
recreates it, and this script drops it when it ends; the harness itself watches the
server directly, only the system under test goes through the pooler).
``BENCH_PG_SERVER`` is a ``postgresql://`` URL of the server (any database it names is
replaced; a socket folder in its query, ``?host=/path``, is kept). With
``--listen direct`` the worker's ``STANDMEET_LISTEN_DATABASE_URL`` names the database
directly (production's setting); with ``--listen none`` wake-ups poll. Prints each run's
jobs/s, the medians, and a ``ratio: N.NN`` line (pooled / direct).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PEERS = ROOT.parent / "shared" / "bench-peers" / "bench.py"
DEFAULT_SERVER = "postgresql://postgres@127.0.0.1:5432"
DATABASE = "bench_standmeet_pooler"  # not bench_standmeet: others may bench at the same time
#: Run on the server itself when the script ends (the harness leaves its database behind).
DROP_DATABASE = "DROP DATABASE IF EXISTS {} WITH (FORCE)"


#: bench.py under one change: the harness's own connections (its monitor, which counts
#: outstanding jobs and reads pg_stat_activity for the server's CPU, and the drop and
#: create of the database) go to the server itself; only the system under test goes
#: through the pooler. (The monitor repeats one statement, which psycopg prepares at its
#: fifth run: through a transaction pooler that fails, in the harness, not in the runtime.)
#: A URL whose user, host and port are the pooler's (``BENCH_POOLER_NETLOC``) is turned
#: into the same database on the server (``BENCH_DIRECT_SERVER``, its query kept).
HARNESS = """
import os, runpy, sys
from urllib.parse import urlsplit, urlunsplit
sys.path.insert(0, os.path.dirname(sys.argv[1]))
import common
pooler, server = os.environ["BENCH_POOLER_NETLOC"], os.environ["BENCH_DIRECT_SERVER"]
original = common.connect
def connect(url):
    parts = urlsplit(url)
    if pooler and parts.netloc == pooler:
        url = urlunsplit(urlsplit(server)._replace(path=parts.path))
    return original(url)
common.connect = connect
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def with_dbname(server: str, dbname: str) -> str:
    """The ``postgresql://`` URL ``server`` naming database ``dbname`` (its query kept)."""
    return urlunsplit(urlsplit(server)._replace(path=f"/{dbname}"))


def drop_database(server: str, dbname: str) -> None:
    """Drop ``dbname`` on ``server``, whoever is still connected to it."""
    with psycopg.connect(with_dbname(server, "postgres"), autocommit=True) as conn:
        conn.execute(sql.SQL(DROP_DATABASE).format(sql.Identifier(dbname)))


def run_a(url: str, n: int, listen_url: str | None, *, monitor: tuple[str, str] = ("", "")) -> dict[str, object]:
    """One ``bench.py standmeet A`` of ``n`` jobs on ``url``; ``monitor`` is (the pooler's
    user@host:port, the server's URL) when ``url`` goes through the pooler."""
    env = {k: v for k, v in os.environ.items() if k != "STANDMEET_LISTEN_DATABASE_URL"}
    env["DATABASE_URL"] = url
    env["BENCH_POOLER_NETLOC"], env["BENCH_DIRECT_SERVER"] = monitor
    if listen_url:
        env["STANDMEET_LISTEN_DATABASE_URL"] = listen_url
    done = subprocess.run([sys.executable, "-c", HARNESS, str(PEERS), "standmeet", "A", "--n", str(n)], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT"):
            return dict(json.loads(line.split(" ", 1)[1]))
    raise RuntimeError(f"no RESULT line (exit {done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--n", type=int, default=5000)
    parser.add_argument("--mode", choices=["transaction", "session"], default="transaction")
    parser.add_argument("--listen", choices=["direct", "none"], default="direct")
    parser.add_argument("--database", default=DATABASE,
                        help="the database each run recreates (bench_*: the harness drops no other); dropped at the end")
    args = parser.parse_args(argv)
    if not args.database.startswith("bench_"):
        parser.error(f"--database {args.database!r}: the peers' harness drops and recreates only bench_* databases")
    from tests.support.pgbouncer import missing_reason, pgbouncer

    reason = missing_reason() or (None if PEERS.exists() else f"the peers' harness is not at {PEERS}")
    if reason:
        print(f"pooler bench: {reason}", file=sys.stderr)
        return 1
    server = os.environ.get("BENCH_PG_SERVER", DEFAULT_SERVER)
    direct = with_dbname(server, args.database)
    rates: dict[str, list[float]] = {"direct": [], "pooled": []}
    try:
        with pgbouncer(with_dbname(server, "postgres"), mode=args.mode) as bouncer:
            pooler_netloc = f"{bouncer.user}@127.0.0.1:{bouncer.port}"
            pooled = f"postgresql://{pooler_netloc}/{args.database}"
            listen = direct if args.listen == "direct" else None
            print(f"pooler bench: workload A, {args.n:,} jobs, {args.runs} run(s) each way; PgBouncer "
                  f"{args.mode} mode at {pooled}; LISTEN {'direct' if listen else 'none (polling)'}")
            for run in range(args.runs):
                for way, url in (("direct", direct), ("pooled", pooled)):
                    result = run_a(url, args.n, listen if way == "pooled" else None, monitor=(pooler_netloc, server))
                    if "error" in result:
                        raise RuntimeError(f"{way} run {run + 1}: {result['error']}")
                    rate = float(result.get("jobs_per_s") or 0.0)
                    rates[way].append(rate)
                    print(f"  run {run + 1} {way}: {rate:,.0f} jobs/s (worker {result.get('worker_cpu_pct')} % / "
                          f"PG {result.get('pg_cpu_pct')} % CPU; machine {result.get('machine_busy_pct')} % busy)",
                          flush=True)
    finally:
        drop_database(server, args.database)
    medians = {way: statistics.median(values) for way, values in rates.items()}
    print(f"median direct {medians['direct']:,.0f} jobs/s, through PgBouncer {medians['pooled']:,.0f} jobs/s")
    print(f"ratio: {medians['pooled'] / medians['direct']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
