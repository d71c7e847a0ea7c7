"""The cost curve: drain rate and Postgres CPU per job as the backlog grows.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres python bench/cost_curve.py
    python bench/cost_curve.py --sizes 5000,100000,1000000   # the million too (long)
    python bench/cost_curve.py --n 200                         # one tiny size (the CI smoke)

For each backlog size: a fresh ``bench_*`` database, the backlog queued with
``enqueue_many``, then one worker process (``python -m broker.worker``, 8 threads, limit
8) drains it. Prints, per size: jobs/s, worker and Postgres CPU per job, the table's
size and dead tuples before and after, the most locks held, the worker's memory at the
start and end of the drain; then each size's rate as a ratio to the smallest size's.
Figures on a shared machine are noisy: quote the load average printed with them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg  # noqa: E402

from bench import drain  # noqa: E402

DEFAULT_SIZES = "5000,100000"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default=DEFAULT_SIZES, help="backlog sizes, comma-separated")
    parser.add_argument("--n", type=int, default=0, help="one size only (overrides --sizes)")
    parser.add_argument("--runs", type=int, default=1, help="runs per size (medians are printed)")
    parser.add_argument("--threads", type=int, default=8)
    args = parser.parse_args(argv)
    sizes = [args.n] if args.n else [int(s) for s in args.sizes.split(",") if s]

    import broker as infra

    infra.configure()  # the producer side: enqueue_many needs the broker
    rates: dict[int, float] = {}
    print(f"cost curve: 1 worker process, {args.threads} threads, limit {args.threads}; load {drain.load_average()}")
    for size in sizes:
        runs = []
        for run in range(args.runs):
            with drain.fresh_database("cost") as url:
                enqueue_rate = drain.enqueue_backlog(url, size)
                with psycopg.connect(url, autocommit=True) as conn:
                    conn.execute("ANALYZE dramatiq.queue")
                    before = drain.table_stats(conn)
                result = drain.timed_drain(url, size, limit=args.threads, threads=args.threads)
                with psycopg.connect(url, autocommit=True) as conn:
                    after = drain.table_stats(conn)
            runs.append(result)
            print(f"  size {size:>9,} run {run + 1}: {result.rate:8,.0f} jobs/s  "
                  f"worker {result.worker_ms_per_job:.3f} ms/job  postgres {result.pg_ms_per_job:.3f} ms/job  "
                  f"table {before[0]:.1f} -> {after[0]:.1f} MB  dead tuples {before[1]:,} -> {after[1]:,}  "
                  f"max locks {result.max_locks}  claims held <= {result.max_held}  "
                  f"running <= {max(result.max_running, default=0)}  "
                  f"worker RSS {result.rss_start_mb:.0f} -> {result.rss_end_mb:.0f} MB  "
                  f"bulk enqueue {enqueue_rate:,.0f}/s  load {drain.load_average()}")
        rates[size] = drain.median([r.rate for r in runs])
        print(f"size {size:,}: median {rates[size]:,.0f} jobs/s, postgres "
              f"{drain.median([r.pg_ms_per_job for r in runs]):.3f} ms/job, worker "
              f"{drain.median([r.worker_ms_per_job for r in runs]):.3f} ms/job")
    base = sizes[0]
    for size in sizes:
        print(f"ratio rate({size:,}) / rate({base:,}): {rates[size] / rates[base]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
