"""The relay: events/s from a backlog by one and by three relay processes, and the idle
emit-to-start latency on the index queue.

    python bench/relay.py [--runs 3] [--events 20000] [--latency 200]
    python bench/relay.py --runs 1 --events 1001 --latency 1    # the CI smoke

Rates come from the rows themselves: events relayed / (last relay transaction's
commit - first one's start), so process start-up is not counted; ``--events`` must
therefore exceed one relay pass (``STANDMEET_RELAY_BATCH``, 1,000), as a backlog that
one pass takes whole has no span to time. Each relay process
also reports the CPU it spent draining and the CPU of its Postgres backend (read from
/proc, so only on the machine that runs Postgres; 0 when unreadable): CPU per event is
steadier than a rate on a shared machine. Prints each run, the medians, and
``ratio: N.NN`` (three relays / one).

    python bench/relay.py --child   (one relay process: drain, print its CPU figures)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench.common import fresh_database, median, quiet, run_worker  # noqa: E402
from broker.settings import Settings  # noqa: E402
from tests.support import db as testdb  # noqa: E402

SPAN = """
SELECT count(*), EXTRACT(EPOCH FROM max(relayed_at) - min(relayed_at))::float8
FROM standmeet.outbox WHERE relayed_at IS NOT NULL
"""


def _backlog(url: str, n: int) -> None:
    from broker.engine import sql

    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(sql.EMIT, [{"topic": "document.written", "payload": f'{{"document_id": {i}}}',
                                    "routes": '["corpus.index"]'} for i in range(1, n + 1)])


def _cpu_of(pid: int) -> float:
    """CPU seconds (user + system) of a process on this machine, 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def child() -> int:
    """One relay process, as ``python -m broker.relay --exit-when-idle`` runs it; prints
    the events it relayed and the CPU seconds it and its backend spent draining."""
    import dramatiq

    import actors  # noqa: F401
    import broker as runtime
    from broker.engine.broker import StandmeetBroker
    from broker.outbox import Relay

    if not isinstance(dramatiq.broker.global_broker, StandmeetBroker):
        runtime.configure()
    broker = runtime.current_broker()
    relay = Relay(broker.url, batch=broker.settings.relay_batch, poll_s=broker.settings.relay_poll_s)
    backend = relay._connection().info.backend_pid
    cpu0, backend0 = time.process_time(), _cpu_of(backend)
    total = relay.drain_once()
    cpu, backend_cpu = time.process_time() - cpu0, _cpu_of(backend) - backend0
    relay.close()
    print(json.dumps({"relayed": total, "cpu_s": cpu, "backend_cpu_s": backend_cpu}))
    return 0


def relay_rate(admin_url: str, n: int, relays: int) -> tuple[float, float, float]:
    """Events/s of ``relays`` processes on a backlog of ``n``, and the relay and backend
    CPU per event (µs)."""
    url = fresh_database(admin_url, "bench_relay", ours=True)
    try:
        _backlog(url, n)
        env = {**os.environ, "DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child"]
        procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(relays)]
        reports = []
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise RuntimeError("a relay process failed")
            reports.append(json.loads(out.strip().splitlines()[-1]))
        count, span = testdb.query(url, SPAN)[0]
        if count != n:
            raise RuntimeError(f"only {count}/{n} relayed")
        if not span:
            raise RuntimeError(f"all {n} events were relayed in passes that started together: no span to time")
        batch = Settings.from_env().relay_batch  # the relays' pass size
        # relayed_at is each transaction's start: add one pass's share for the last one
        rate = n / (span + span / max(1, n / batch))
        cpu = sum(r["cpu_s"] for r in reports) / n * 1e6
        backend_cpu = sum(r["backend_cpu_s"] for r in reports) / n * 1e6
        return rate, cpu, backend_cpu
    finally:
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def emit_latency(admin_url: str, count: int) -> list[float]:
    import dramatiq

    import actors  # noqa: F401
    import broker as infra
    from broker import emit
    from broker.outbox import route
    from broker.settings import Settings

    url = fresh_database(admin_url, "bench_emit", ours=True)
    b = infra.configure(Settings.from_env(), url=url)
    started: dict[str, float] = {}
    ready = threading.Event()

    def probe(label: str) -> None:
        started[label] = time.perf_counter()
        ready.set()

    b.actors.pop("bench.emit_probe", None)  # configure() carried the last run's closure over
    dramatiq.actor(probe, broker=b, actor_name="bench.emit_probe", queue_name="index", max_retries=0)
    route("bench.ping", "bench.emit_probe", lambda event_id, payload: ((payload["label"],), {}))
    stop = run_worker(b, threads=4, queues=["index"])
    try:
        time.sleep(0.5)  # an idle worker: consumers and relay in their wait
        out = []
        with psycopg.connect(url) as conn:
            for i in range(count):
                ready.clear()
                sent = time.perf_counter()
                with conn.transaction():
                    emit(conn, "bench.ping", {"label": str(i)})
                if not ready.wait(10):
                    raise TimeoutError(f"event {i} did not start a job within 10 s")
                out.append(started[str(i)] - sent)
                time.sleep(0.005)
        return sorted(out)
    finally:
        stop()
        b.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--latency", type=int, default=200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batch = Settings.from_env().relay_batch
    if not args.child and args.events <= batch:
        parser.error(f"--events must exceed one relay pass ({batch:,} events): the rate is timed across passes")
    quiet()
    if args.child:
        return child()
    admin_url = testdb.server_url()
    one, three, p50, p99 = [], [], [], []
    cpu1, db1, cpu3, db3 = [], [], [], []
    for run in range(1, args.runs + 1):
        r1, c1, d1 = relay_rate(admin_url, args.events, 1)
        r3, c3, d3 = relay_rate(admin_url, args.events, 3)
        lat = emit_latency(admin_url, args.latency) if args.latency else [0.0]
        one.append(r1)
        three.append(r3)
        cpu1.append(c1)
        db1.append(d1)
        cpu3.append(c3)
        db3.append(d3)
        p50.append(lat[len(lat) // 2] * 1000)
        p99.append(lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1000)
        print(f"run {run}: {args.events} events: one relay {r1:,.0f} events/s, three relays {r3:,.0f} events/s;"
              f" CPU per event relay/backend: one {c1:.1f}/{d1:.1f} µs, three {c3:.1f}/{d3:.1f} µs;"
              f" idle emit->start p50/p99 {p50[-1]:.2f}/{p99[-1]:.2f} ms", flush=True)
    print(f"median: one relay {median(one):,.0f} events/s, three relays {median(three):,.0f} events/s")
    print(f"median CPU per event, relay/backend: one relay {median(cpu1):.1f}/{median(db1):.1f} µs,"
          f" three relays {median(cpu3):.1f}/{median(db3):.1f} µs")
    print(f"median idle emit->start on the index queue: p50 {median(p50):.2f} ms, p99 {median(p99):.2f} ms")
    print(f"ratio: {median(three) / median(one):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
