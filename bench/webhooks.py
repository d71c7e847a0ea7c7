"""Webhooks: deliveries/s to 20 fast local endpoints, and index latency while slow endpoints
fill the webhook queue, against an idle run in the same invocation.

    python bench/webhooks.py [--events 25] [--writes 200]

With the per-endpoint lease one slow endpoint holds at most one webhook worker (its
other deliveries snooze), so the saturated run uses 8 slow endpoints (the queue's
limit) that hold every request open. Prints ``ratio: N.NN`` (index p50 saturated / idle).
"""

from __future__ import annotations

import argparse
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from broker.settings import replace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.common import fresh_database, pct, quiet, run_worker  # noqa: E402
from tests.support import db as testdb  # noqa: E402


def deliveries_per_s(url: str, events: int) -> float:
    from actors import webhooks
    from tests.support.http import http_server

    with ExitStack() as stack:
        servers = [stack.enter_context(http_server()) for _ in range(20)]
        for endpoint_url, _ in servers:
            webhooks.add_endpoint(endpoint_url, ["bench.fast"])
        with psycopg.connect(url) as conn, conn.transaction():
            for i in range(events):
                webhooks.emit_event(conn, "bench.fast", {"i": i})
        total = events * len(servers)
        start = time.monotonic()
        stop = run_worker(__import__("broker").current_broker(), threads=16, queues=["webhook"])
        try:
            while sum(len(s.received) for _, s in servers) < total:
                if time.monotonic() - start > 300:
                    raise TimeoutError("deliveries did not finish")
                time.sleep(0.01)
            return total / (time.monotonic() - start)
        finally:
            stop()


def index_latencies(writes: int, *, slow_endpoints: int) -> list[float]:
    from actors import webhooks
    from actors.documents import write_document
    from tests.support.http import http_server

    b = __import__("broker").current_broker()
    with ExitStack() as stack:
        servers = [stack.enter_context(http_server(hold=True)) for _ in range(slow_endpoints)]
        for endpoint_url, _ in servers:
            webhooks.add_endpoint(endpoint_url, ["bench.slow"])
        if servers:
            with psycopg.connect(b.url) as conn, conn.transaction():
                for i in range(4):
                    webhooks.emit_event(conn, "bench.slow", {"i": i})
        stop = run_worker(b, threads=16, queues=["index", "webhook"])
        try:
            end = time.monotonic() + 10
            while servers and sum(s.current() for _, s in servers) < min(8, len(servers)):
                if time.monotonic() > end:
                    raise TimeoutError("the webhook queue did not fill")
                time.sleep(0.01)
            out = []
            for i in range(writes):
                t0 = time.perf_counter()
                if not write_document(f"w{i}", "bench words", wait_s=2.0)["indexed"]:
                    raise RuntimeError(f"write {i} not indexed within 2 s")
                out.append((time.perf_counter() - t0) * 1000)
            return sorted(out)
        finally:
            for _, s in servers:
                s.release.set()
            stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--events", type=int, default=25, help="events, each delivered to 20 endpoints")
    parser.add_argument("--writes", type=int, default=200)
    args = parser.parse_args()
    quiet()
    import actors  # noqa: F401  (configures a broker first; ours replaces it below)
    import broker as infra
    from broker.settings import Settings

    admin_url = testdb.server_url()
    url = fresh_database(admin_url, "bench_webhooks", ours=True)
    from cryptography.fernet import Fernet

    from actors import settings as app_settings

    mine = app_settings.current()
    # secrets are stored encrypted: a throwaway key for this throwaway database, unless one is set
    key = mine.secret_key or Fernet.generate_key().decode()
    app_settings.use(replace(mine, allowed_networks=("127.0.0.0/8",), secret_key=key))
    infra.configure(Settings.from_env(), url=url)
    try:
        rate = deliveries_per_s(url, args.events)
        print(f"deliveries: {args.events * 20} to 20 fast endpoints at {rate:,.0f} deliveries/s", flush=True)
        idle = index_latencies(args.writes, slow_endpoints=0)
        busy = index_latencies(args.writes, slow_endpoints=8)
    finally:
        infra.current_broker().close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


    print(f"write->indexed idle: p50 {pct(idle, .5):.1f} ms, p95 {pct(idle, .95):.1f} ms")
    print(f"write->indexed with 8 slow endpoints holding the webhook queue: p50 {pct(busy, .5):.1f} ms,"
          f" p95 {pct(busy, .95):.1f} ms")
    print(f"ratio: {pct(busy, .5) / pct(idle, .5):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
