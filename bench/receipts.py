"""Write → indexed receipt latency, at idle and with the webhook queue saturated.

    python bench/receipts.py [--writes 500] [--runs 1]

Each write stores a document and its wiki page and enqueues two index jobs, the second
5 ms after the first (the seed's raw document and wiki page), then waits for both
receipts. The saturated run first fills the webhook queue with requests that a local
HTTP server holds open. Printed beside the seed's Go system: one poll (≤ 100 ms) plus a
250 ms completion batch, and ~0.5 s more for the second job.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import fresh_database, median, pct, quiet, run_worker  # noqa: E402
from tests.support import db as testdb  # noqa: E402

#: The seed's Go system, per write: a poll (≤ 100 ms, ~50 on average) + a 250 ms batch,
#: and ~0.5 s more when a second job follows 5 ms later.
SEED_MS = {"p50": 50 + 250 + 500, "p99": 100 + 250 + 1000}


def measure(url: str, writes: int, *, saturate: bool) -> list[float]:
    import tests.support.jobs as jobs  # noqa: F401  (actors, the test post actor)
    from actors.documents import write_document
    from tests.support.http import http_server

    latencies = []
    with http_server(hold=True) as (endpoint, server):
        if saturate:
            for i in range(24):
                jobs.post.send(endpoint, f"held-{i}")
        stop = run_worker(jobs.SLEEP["index"].broker, threads=16, queues=["index", "webhook"])
        try:
            if saturate:
                deadline = time.monotonic() + 10
                while server.current() < 8:
                    if time.monotonic() > deadline:
                        raise TimeoutError("the webhook queue did not fill")
                    time.sleep(0.01)
            for i in range(writes):
                start = time.perf_counter()
                result = write_document(f"bench {i}", f"words of write {i}", wait_s=2.0, wiki_delay_ms=5)
                if not result["indexed"]:
                    raise RuntimeError(f"write {i} was not indexed within 2 s")
                latencies.append((time.perf_counter() - start) * 1000)
            if saturate:
                running = testdb.scalar(url, "SELECT count(*) FROM dramatiq.queue WHERE queue_name = 'webhook'"
                                             " AND state = 'consumed'")
                # 8 running (+ up to 4 prefetched): the queue stayed at its limit
                assert running >= 8, f"the webhook queue should still be full ({running} claimed)"
        finally:
            server.release.set()
            stop()
    return sorted(latencies)



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--writes", type=int, default=500)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    quiet()
    import tests.support.jobs  # noqa: F401  (imports actors, which configures a broker: before ours)

    admin_url = testdb.server_url()
    rows: dict[str, list[tuple[float, float, float]]] = {"idle": [], "saturated": []}
    for run in range(1, args.runs + 1):
        import broker as infra
        from broker.settings import Settings

        url = fresh_database(admin_url, "bench_receipts", ours=True)
        testdb.query(url, testdb.TEST_SCHEMA)  # the test post actor records its runs
        b = infra.configure(Settings.from_env(), url=url)
        try:
            for name, saturate in (("idle", False), ("saturated", True)):
                lat = measure(url, args.writes, saturate=saturate)
                rows[name].append((pct(lat, 0.5), pct(lat, 0.95), pct(lat, 0.99)))
                print(f"run {run} {name}: {args.writes} writes, write->indexed p50 {rows[name][-1][0]:.1f} ms,"
                      f" p95 {rows[name][-1][1]:.1f} ms, p99 {rows[name][-1][2]:.1f} ms", flush=True)
        finally:
            b.close()
            testdb.drop_database(admin_url, testdb.conninfo_dbname(url))
    for name, values in rows.items():
        p50, p95, p99 = (median([v[i] for v in values]) for i in range(3))
        print(f"median {name}: p50 {p50:.1f} ms, p95 {p95:.1f} ms, p99 {p99:.1f} ms"
              f" (seed's Go system: ~{SEED_MS['p50']} ms typical, up to ~{SEED_MS['p99']} ms)")
    idle_p50 = median([v[0] for v in rows["idle"]])
    sat_p50 = median([v[0] for v in rows["saturated"]])
    print(f"ratio: {sat_p50 / idle_p50:.2f} (saturated / idle p50); seed / ours p50: {SEED_MS['p50'] / idle_p50:.0f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
