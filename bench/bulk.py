"""The bulk enqueue beside its floor: what ``enqueue_many`` takes for a batch, against what
Postgres alone takes to store the same rows, measured in the same minutes.

For each run, on a fresh database (our schema, migrated):

* **build**: Dramatiq making the batch's messages (``actor.message(i, t)``, as the peers'
  benchmark does before it calls ``enqueue_many``): no code of ours runs.
* **floor**: Postgres storing the batch's rows, made beforehand: one ``COPY`` of their
  text into ``dramatiq.queue`` and its commit, on a connection opened beforehand. No
  writer of this table can spend less: the rows are what every send writes, the table's
  indexes and its ``jsonb`` column are what the claim and the dashboard read.
* **ours**: ``enqueue_many`` of the messages (on the broker's pool, warmed by a first
  call): the hooks, every message's checks, its row made while the copy is under way, the
  copy, the wake of the queue and the commit. Also its own CPU (the process's), the rest
  being Postgres's and the waits.

The peers' workload A times build + ours, so its bulk rate cannot pass ``n / (build +
floor)``: printed as the bound. ``ratio: N.NN`` is ours / floor (1.00: nothing of ours).

    python bench/bulk.py --n 5000 --runs 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import dramatiq
import psycopg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages and tests
    sys.path.insert(0, str(ROOT))

from bench.common import median, quiet, spread  # noqa: E402
from tests.support import db as testdb  # noqa: E402

QUEUE = "index"
COUNT = "SELECT count(*) FROM dramatiq.queue WHERE queue_name = %s"


def noop(i: int, t: float) -> None:
    pass


def one_run(admin_url: str, n: int) -> dict[str, float]:
    """The figures of one run, in ms, on a database of its own (dropped after)."""
    from bench.throughput import _ours_broker, declare
    from broker import enqueue_many
    from broker.engine import sql_enqueue
    from broker.engine.copy_rows import CopyBatch

    url, broker = _ours_broker(admin_url, 8)
    try:
        actor = declare(broker, noop, "bench.bulk", QUEUE)
        enqueue_many([actor.message(-1, time.time())])  # the pool's connection opened, not timed
        t0 = time.perf_counter()
        messages = [actor.message(i, time.time()) for i in range(n)]
        build_s = time.perf_counter() - t0

        # The floor: the same rows (other ids), made beforehand, copied and committed.
        rows = "".join(CopyBatch([actor.message(i, time.time()) for i in range(n)],
                                 max_bytes=broker.settings.message_max_bytes).texts())
        with psycopg.connect(url) as conn:
            conn.execute("SELECT 1")
            conn.commit()
            t0 = time.perf_counter()
            with conn.cursor().copy(sql_enqueue.COPY_QUEUED) as copy:
                copy.write(rows)
            conn.commit()
            floor_s = time.perf_counter() - t0

        c0, t0 = time.process_time(), time.perf_counter()
        enqueue_many(messages)
        ours_s, ours_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        with psycopg.connect(url) as conn:
            stored = conn.execute(COUNT, (QUEUE,)).fetchone()
        if stored is None or stored[0] != 2 * n + 1:
            raise RuntimeError(f"expected {2 * n + 1} messages stored, found {stored}")
        return {"build": build_s * 1000, "floor": floor_s * 1000, "ours": ours_s * 1000,
                "ours_cpu": ours_cpu_s * 1000}
    finally:
        broker.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=5000, help="messages per batch")
    parser.add_argument("--runs", type=int, default=5, help="runs, each on a fresh database")
    args = parser.parse_args(argv)
    quiet()
    admin_url = testdb.server_url()
    runs = [one_run(admin_url, args.n) for _ in range(args.runs)]
    figures = {key: [run[key] for run in runs] for key in runs[0]}
    build, floor, ours = (median(figures[key]) for key in ("build", "floor", "ours"))
    print(f"dramatiq {dramatiq.__version__}, {args.n:,} messages a batch, {args.runs} runs (median ms, range)")
    print(f"build (Dramatiq's actor.message): {spread(figures['build'])}")
    print(f"floor (Postgres copying the rows, made beforehand, and committing): {spread(figures['floor'])}")
    print(f"ours (enqueue_many): {spread(figures['ours'])}, of which this process's CPU "
          f"{spread(figures['ours_cpu'])}")
    print(f"bulk rate, build + ours: {args.n / (build + ours) * 1000:,.0f} messages/s; "
          f"bound, build + floor: {args.n / (build + floor) * 1000:,.0f} messages/s")
    print(f"ratio: {ours / floor:.2f} (ours / floor)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
