"""Webhooks: deliveries/s to 20 fast local endpoints, and index latency while slow endpoints
fill the webhook queue, against an idle run in the same invocation.

    python bench/webhooks.py [--events 25] [--writes 200] [--runs 1] [--endpoints-in-process]

The fast endpoints run in a process of their own (``bench/endpoints.py``: HTTP/1.1,
keep-alive), so the rate and the CPU per delivery are the worker process's own; a
delivery counts once its outcome is recorded. ``--endpoints-in-process`` measures the
earlier way: the test suite's threaded HTTP/1.0 servers inside the worker process,
counted as they receive. ``BENCH_VERBOSE=1`` also prints, per delivery, the CPU of the
worker's threads, of the database's server processes (by application name: on this
machine the server is local) and of the endpoint process.

With the per-endpoint lease one slow endpoint holds at most one webhook worker (its
other deliveries snooze), so the saturated run uses 8 slow endpoints (the queue's
limit) that hold every request open. Prints ``ratio: N.NN`` (index p50 saturated / idle).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
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


def _thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's live threads, by name (numbers stripped)."""
    import threading

    names = {t.native_id: type(t).__name__ + ":" + re.sub(r"[-_ ]?[0-9a-f]*\d[0-9a-f]*$", "", t.name)
             for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        name = names.get(int(tid), "?")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def _process_cpu(pid: int) -> float:
    """CPU seconds of a process (0 once it is gone)."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


#: The server processes of the benchmark's database (on this machine: a local server).
BACKENDS = ("SELECT pid, application_name FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid()")
SUCCEEDED = "SELECT count(*) FROM standmeet.webhook_deliveries WHERE state = 'succeeded'"
#: Transactions the server counted in this database: with autocommit statements, about one
#: per round trip (the counters reach the view within a second or so of each commit).
TRANSACTIONS = ("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()")


class _Poller:
    """One kept connection that polls, counting its own statements (each one a transaction
    of its own, subtracted from the database's count)."""

    def __init__(self, conn: psycopg.Connection) -> None:
        self.conn, self.statements = conn, 0

    def value(self, sql: str) -> int:
        self.statements += 1
        row = self.conn.execute(sql).fetchone()
        return int(row[0]) if row else 0

    def transactions(self) -> int:
        self.value("SELECT 0 FROM pg_stat_clear_snapshot()")
        return self.value(TRANSACTIONS) - self.statements


def _settled_transactions(poll: _Poller, *, within_s: float = 5.0) -> int:
    """The transaction count once the other backends' counters have reached the view
    (unchanged across 1.5 s, the longest a backend holds them back), at most ``within_s``."""
    end = time.monotonic() + within_s
    last, since = poll.transactions(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.1)
        now = poll.transactions()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since > 1.5:
            break
    return last


def deliveries_per_s(url: str, events: int, *, in_process: bool = False,
                     counters_within_s: float = 5.0) -> tuple[float, float, float]:
    """(deliveries/s, the worker process's CPU ms per delivery, database transactions per
    delivery) for ``events`` events to 20 fast endpoints, from the worker's start to the
    last delivery."""
    from actors import webhooks
    from tests.support.http import http_server

    with ExitStack() as stack:
        if in_process:
            servers = [stack.enter_context(http_server()) for _ in range(20)]
            urls = [u for u, _ in servers]
        else:
            endpoints = stack.enter_context(subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "endpoints.py"), "20"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
            assert endpoints.stdout is not None and endpoints.stdin is not None
            stack.callback(endpoints.stdin.close)
            urls = []
            while (line := endpoints.stdout.readline().strip()) != "ready":
                if not line:
                    raise RuntimeError("the endpoint process did not start")
                urls.append(line)
        for endpoint_url in urls:
            webhooks.add_endpoint(endpoint_url, ["bench.fast"])
        with psycopg.connect(url) as conn, conn.transaction():
            for i in range(events):
                webhooks.emit_event(conn, "bench.fast", {"i": i})
        total = events * len(urls)

        # one kept connection polls (a new one per poll cost the worker process ~0.4 ms of
        # CPU per delivery: this process is the worker)
        poll = _Poller(stack.enter_context(psycopg.connect(url, autocommit=True)))

        def done() -> int:
            if in_process:
                return sum(len(s.received) for _, s in servers)
            return poll.value(SUCCEEDED)

        xacts0 = _settled_transactions(poll, within_s=counters_within_s)

        names: dict[int, str] = {}

        def backends() -> dict[int, float]:
            rows = poll.conn.execute(BACKENDS).fetchall()
            poll.statements += 1
            names.update({int(pid): str(name) for pid, name in rows})
            return {int(pid): _process_cpu(int(pid)) for pid, _ in rows}

        served0 = 0.0 if in_process else _process_cpu(endpoints.pid)
        backends0 = backends()
        threads0 = _thread_cpu()
        cpu0, start = os.times(), time.monotonic()
        stop = run_worker(__import__("broker").current_broker(), threads=16, queues=["webhook"])
        try:
            while done() < total:
                if time.monotonic() - start > 300:
                    raise TimeoutError("deliveries did not finish")
                time.sleep(0.02)
            elapsed, cpu1 = time.monotonic() - start, os.times()
            backends1 = backends()  # (a backend that came and went meanwhile is not counted)
            served1 = 0.0 if in_process else _process_cpu(endpoints.pid)
            cpu_ms = ((cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)) * 1000 / total
            xacts = (_settled_transactions(poll, within_s=counters_within_s) - xacts0) / total
            if os.environ.get("BENCH_VERBOSE"):
                threads1 = _thread_cpu()
                per = {k: (v - threads0.get(k, 0.0)) * 1000 / total for k, v in threads1.items()}
                print("  per thread, ms per delivery:", {k: round(v, 2) for k, v in sorted(per.items(), key=lambda kv: -kv[1])[:8]})
                print(f"  user {(cpu1.user - cpu0.user) * 1000 / total:.2f} ms, system"
                      f" {(cpu1.system - cpu0.system) * 1000 / total:.2f} ms per delivery")
                by_name: dict[str, float] = {}
                for pid, v in backends1.items():
                    name = re.sub(r"[-_ ]?[0-9a-f]*\d[0-9a-f]*$", "", names[pid]) or "?"
                    by_name[name] = by_name.get(name, 0.0) + (v - backends0.get(pid, 0.0)) * 1000 / total
                print(f"  Postgres backends {sum(by_name.values()):.2f} ms of CPU per delivery:",
                      {k: round(v, 2) for k, v in sorted(by_name.items(), key=lambda kv: -kv[1])})
                print(f"  the endpoint process {(served1 - served0) * 1000 / total:.2f} ms of CPU per delivery")
            return total / elapsed, cpu_ms, xacts
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
    parser.add_argument("--runs", type=int, default=1, help="delivery runs (the median is printed)")
    parser.add_argument("--counters-within-s", type=float, default=5.0,
                        help="the longest wait for the server's transaction counters to settle, "
                             "before and after each run (0: read them once, for a smoke run)")
    parser.add_argument("--deliveries-only", action="store_true", help="skip the index latency runs")
    parser.add_argument("--endpoints-in-process", action="store_true",
                        help="serve the fast endpoints from threads of the worker process (the earlier way)")
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
        where = "in the worker process" if args.endpoints_in_process else "in their own process"
        rates, cpus, trips = [], [], []
        for run in range(1, args.runs + 1):
            # the last run's leftover messages (deliveries made by a batch while their job was
            # claimed) would otherwise run in this one, on deliveries that no longer exist
            testdb.query(url, "TRUNCATE standmeet.webhook_endpoints, standmeet.webhook_events, dramatiq.queue CASCADE")
            rate, cpu_ms, xacts = deliveries_per_s(url, args.events, in_process=args.endpoints_in_process,
                                                     counters_within_s=args.counters_within_s)
            rates.append(rate)
            cpus.append(cpu_ms)
            trips.append(xacts)
            print(f"run {run}: deliveries: {args.events * 20} to 20 fast endpoints ({where}) at {rate:,.0f}"
                  f" deliveries/s, worker CPU {cpu_ms:.2f} ms, {xacts:.2f} database transactions per delivery",
                  flush=True)
        print(f"median deliveries/s: {statistics.median(rates):,.0f} (range {min(rates):,.0f}-{max(rates):,.0f}),"
              f" worker CPU {statistics.median(cpus):.2f} ms, {statistics.median(trips):.2f} database"
              " transactions per delivery", flush=True)
        if args.deliveries_only:
            return 0
        testdb.query(url, "TRUNCATE standmeet.webhook_endpoints, standmeet.webhook_events CASCADE")
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
