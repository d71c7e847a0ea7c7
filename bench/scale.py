"""Scale across processes: 1, 2 and 4 worker processes on one Postgres.

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/postgres python bench/scale.py
    python bench/scale.py --processes 1,2,4 --n 20000
    python bench/scale.py --n 200                     # the CI smoke

Each step: a fresh ``bench_*`` database with a backlog of ``--n`` no-op jobs, drained by
P worker processes (``python -m broker.worker``, 8 threads, queue limit 8 each). Prints
total jobs/s, Postgres and worker CPU per job, the most jobs seen running at once in any
one process (never above the limit) and the most claims any process held in the
database (running + prefetched + finished but not yet settled), then each step's rate
as a ratio to one process's. On a 2-core machine the ceiling shows early.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import drain  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", default="1,2,4", help="worker process counts, comma-separated")
    parser.add_argument("--n", type=int, default=20_000, help="backlog per step")
    parser.add_argument("--runs", type=int, default=1, help="runs per step (medians are printed)")
    parser.add_argument("--limit", type=int, default=8, help="the queue's limit (and threads) per process")
    args = parser.parse_args(argv)
    counts = [int(p) for p in args.processes.split(",") if p]

    import broker as infra

    infra.configure()
    rates: dict[int, float] = {}
    print(f"scale: backlog {args.n:,}, limit {args.limit} per process; load {drain.load_average()}")
    failed = False
    for count in counts:
        runs = []
        for run in range(args.runs):
            with drain.fresh_database("scale") as url:
                drain.enqueue_backlog(url, args.n)
                result = drain.timed_drain(url, args.n, processes=count, limit=args.limit, threads=args.limit)
            runs.append(result)
            most = max(result.max_running, default=0)
            within = most <= args.limit
            failed = failed or not within
            print(f"  {count} process(es) run {run + 1}: {result.rate:8,.0f} jobs/s total  "
                  f"postgres {result.pg_ms_per_job:.3f} ms/job  workers {result.worker_ms_per_job:.3f} ms/job  "
                  f"running at once per process <= {most} (limit {args.limit}: {'kept' if within else 'EXCEEDED'})  "
                  f"claims held per process <= {result.max_held}  load {drain.load_average()}")
        rates[count] = drain.median([r.rate for r in runs])
        print(f"{count} process(es): median {rates[count]:,.0f} jobs/s")
    base = counts[0]
    for count in counts:
        print(f"ratio rate({count}) / rate({base}): {rates[count] / rates[base]:.2f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
