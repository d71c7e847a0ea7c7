"""Throughput: our broker against vanilla dramatiq-pg, measured in the same run.

    python bench/throughput.py [--runs 3] [--drain 5000] [--sleep-jobs 2000] [--threads 8]

1. drain: N no-op messages already queued, one worker with T threads; msg/s.
2. sleeping jobs: M jobs that each sleep 100 ms at T threads; efficiency against the
   ideal M × 0.1 s / T (25 s for 2,000 at 8).

Both brokers run the same in-process Dramatiq worker with the same thread count; our
index queue's limit is raised to T for the run, so both have T jobs in flight.
Prints each run, the medians, and a line ``ratio: N.NN`` (ours / vanilla, drain).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dramatiq  # noqa: E402
import psycopg  # noqa: E402

from bench.common import (  # noqa: E402
    bulk_insert_vanilla,
    fresh_database,
    median,
    quiet,
    run_worker,
    vanilla_broker,
    wait_all_done,
)
from tests.support import db as testdb  # noqa: E402

SLEEP_S = 0.1


def noop(i: int) -> None:
    pass


def sleeper(i: int) -> None:
    time.sleep(SLEEP_S)


def ours(admin_url: str, n: int, threads: int, fn_name: str) -> float:
    """Seconds for our broker to run ``n`` queued messages of ``fn_name``."""
    import broker as infra
    from broker import sql
    from broker.pgbroker import enqueue_params
    from broker.settings import Settings

    url = fresh_database(admin_url, "bench_ours", ours=True)
    base = Settings.from_env()
    queues = dict(base.queues)
    queues["index"] = replace(queues["index"], max_workers=threads, time_limit_s=600)
    settings = replace(base, queues=queues, database_url=url)
    b = infra.configure(settings, url=url)
    fn = noop if fn_name == "noop" else sleeper
    actor = dramatiq.actor(fn, broker=b, actor_name=f"bench.{fn_name}", queue_name="index", max_retries=0)
    params = [enqueue_params(actor.message(i), None) for i in range(n)]
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(sql.ENQUEUE, params)
    stop = run_worker(b, threads=threads, queues=["index"])
    try:
        return wait_all_done(url, n, timeout_s=max(120, n * SLEEP_S * 2))
    finally:
        stop()
        b.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def vanilla(admin_url: str, n: int, threads: int, fn_name: str) -> float:
    url = fresh_database(admin_url, "bench_vanilla", ours=False)
    b = vanilla_broker(url)
    fn = noop if fn_name == "noop" else sleeper
    dramatiq.actor(fn, broker=b, actor_name=f"bench.{fn_name}", queue_name="bench", max_retries=0)
    bulk_insert_vanilla(url, "bench", f"bench.{fn_name}", [[i] for i in range(n)])
    stop = run_worker(b, threads=threads, queues=["bench"])
    try:
        return wait_all_done(url, n, timeout_s=max(300, n * SLEEP_S * 8))
    finally:
        stop()
        b.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--drain", type=int, default=5000)
    parser.add_argument("--sleep-jobs", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args()
    quiet()
    admin_url = testdb.server_url()
    ideal = args.sleep_jobs * SLEEP_S / args.threads
    results: dict[str, list[float]] = {k: [] for k in ("ours_drain", "van_drain", "ours_eff", "van_eff")}
    for run in range(1, args.runs + 1):
        o = args.drain / ours(admin_url, args.drain, args.threads, "noop")
        v = args.drain / vanilla(admin_url, args.drain, args.threads, "noop")
        oe = ideal / ours(admin_url, args.sleep_jobs, args.threads, "sleep") if args.sleep_jobs else 0.0
        ve = ideal / vanilla(admin_url, args.sleep_jobs, args.threads, "sleep") if args.sleep_jobs else 0.0
        for key, value in zip(results, (o, v, oe, ve), strict=True):
            results[key].append(value)
        print(
            f"run {run}: drain {args.drain}: ours {o:,.0f} msg/s, vanilla {v:,.0f} msg/s; "
            f"{args.sleep_jobs} x 100 ms at {args.threads} threads: ours {oe:.1%}, vanilla {ve:.1%} of ideal {ideal:.1f} s",
            flush=True,
        )
    m = {k: median(v) for k, v in results.items()}
    print(f"median drain: ours {m['ours_drain']:,.0f} msg/s, vanilla dramatiq-pg {m['van_drain']:,.0f} msg/s")
    print(f"median sleeping-job efficiency: ours {m['ours_eff']:.1%}, vanilla dramatiq-pg {m['van_eff']:.1%}")
    print(f"ratio: {m['ours_drain'] / m['van_drain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
