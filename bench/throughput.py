"""Throughput: our broker against vanilla dramatiq-pg, measured in the same run.

    python bench/throughput.py [--runs 3] [--drain 5000] [--sleep-jobs 2000] [--threads 8]

1. drain: N no-op messages already queued, one worker with T threads; msg/s.
2. sleeping jobs: M jobs that each sleep 100 ms at T threads; efficiency against the
   ideal M × 0.1 s / T (25 s for 2,000 at 8).
3. backlog: a 20,000-message backlog drained; msg/s and the most locks held at once.
4. latency: an idle worker, L messages sent one at a time; enqueue-to-start p50/p99.

Both brokers run the same in-process Dramatiq worker with the same thread count; our
index queue's limit is raised to T for the run, so both have T jobs in flight.
Prints each run, the medians, and a line ``ratio: N.NN`` (ours / vanilla, drain).
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import dramatiq  # noqa: E402
import psycopg  # noqa: E402

from bench.common import (  # noqa: E402
    bulk_insert_vanilla,
    fresh_database,
    median,
    pct,
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


LOCKS = "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid) WHERE a.datname = %s AND a.pid <> pg_backend_pid()"


class LockSampler:
    """Samples the locks held in a database every 50 ms; keeps the maximum."""

    def __init__(self, url: str) -> None:
        self.url, self.max, self._stop = url, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with psycopg.connect(self.url, autocommit=True) as conn:
            dbname = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
            while not self._stop.wait(0.05):
                row = conn.execute(LOCKS, (dbname,)).fetchone()
                self.max = max(self.max, int(row[0]) if row else 0)

    def __enter__(self) -> LockSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def _ours_broker(admin_url: str, threads: int):  # type: ignore[no-untyped-def]
    import broker as infra
    from broker.settings import Settings
    from broker.settings import replace as replace_settings

    url = fresh_database(admin_url, "bench_ours", ours=True)
    base = Settings.from_env()
    index = {"STANDMEET_QUEUE_INDEX_MAX_WORKERS": str(threads), "STANDMEET_QUEUE_INDEX_TIME_LIMIT_S": "600"}
    settings = replace_settings(base, queue_env={**base.queue_env, **index}, database_url=url)
    return url, infra.configure(settings, url=url)


def ours(admin_url: str, n: int, threads: int, fn_name: str, *, locks: bool = False) -> tuple[float, int]:
    """Seconds for our broker to run ``n`` queued messages of ``fn_name`` (and max locks)."""
    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    url, b = _ours_broker(admin_url, threads)
    fn = noop if fn_name == "noop" else sleeper
    actor = declare(b, fn, f"bench.{fn_name}", "index")
    with psycopg.connect(url) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params([actor.message(i) for i in range(n)]))
    return timed_drain(admin_url, url, b, "index", n, threads, locks=locks, timeout_s=max(120, n * SLEEP_S * 2))


def timed_drain(admin_url: str, url: str, b: dramatiq.Broker, queue: str, n: int, threads: int, *,
                locks: bool, timeout_s: float) -> tuple[float, int]:
    """Seconds for a worker on ``b`` to finish ``n`` queued messages, and the most locks held."""
    sampler = LockSampler(url) if locks else None
    if sampler:
        sampler.__enter__()
    stop = run_worker(b, threads=threads, queues=[queue])
    try:
        return wait_all_done(url, n, timeout_s=timeout_s), (sampler.max if sampler else 0)
    finally:
        if sampler:
            sampler.__exit__()
        stop()
        b.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def vanilla(admin_url: str, n: int, threads: int, fn_name: str, *, locks: bool = False) -> tuple[float, int]:
    url = fresh_database(admin_url, "bench_vanilla", ours=False)
    b = vanilla_broker(url)
    fn = noop if fn_name == "noop" else sleeper
    declare(b, fn, f"bench.{fn_name}", "bench")
    bulk_insert_vanilla(url, "bench", f"bench.{fn_name}", [[i] for i in range(n)])
    return timed_drain(admin_url, url, b, "bench", n, threads, locks=locks, timeout_s=max(300, n * SLEEP_S * 8))


def _latencies(broker: dramatiq.Broker, queue: str, threads: int, count: int) -> list[float]:
    started: dict[int, float] = {}
    ready = threading.Event()

    def probe(i: int) -> None:
        started[i] = time.perf_counter()
        ready.set()

    if "bench.probe" in broker.actors:
        del broker.actors["bench.probe"]  # a fresh closure each run
    actor = declare(broker, probe, "bench.probe", queue)
    stop = run_worker(broker, threads=threads, queues=[queue])
    try:
        time.sleep(0.5)  # let the consumers reach their idle wait: this measures an idle worker
        out = []
        for i in range(count):
            ready.clear()
            sent = time.perf_counter()
            actor.send(i)
            if not ready.wait(10):
                raise TimeoutError(f"message {i} did not start within 10 s")
            out.append((started[i] - sent) * 1000)  # ms
            time.sleep(0.005)
        return sorted(out)
    finally:
        stop()


def latency_ours(admin_url: str, threads: int, count: int) -> list[float]:
    url, b = _ours_broker(admin_url, threads)
    try:
        return _latencies(b, "index", threads, count)
    finally:
        b.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def latency_vanilla(admin_url: str, threads: int, count: int) -> list[float]:
    url = fresh_database(admin_url, "bench_vanilla", ours=False)
    b = vanilla_broker(url)
    try:
        return _latencies(b, "bench", threads, count)
    finally:
        b.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def declare(broker: dramatiq.Broker, fn, name: str, queue: str) -> dramatiq.Actor:  # type: ignore[no-untyped-def]
    """The actor ``name`` on ``broker`` (configure() carries actors over to a new broker)."""
    if name in broker.actors:
        return broker.actors[name]
    return dramatiq.actor(fn, broker=broker, actor_name=name, queue_name=queue, max_retries=0)



def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--drain", type=int, default=5000)
    parser.add_argument("--sleep-jobs", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--backlog", type=int, default=20_000, help="backlog size (0 to skip)")
    parser.add_argument("--latency", type=int, default=200, help="messages for the idle latency (0 to skip)")
    parser.add_argument(
        "--vanilla-backlog", type=int, default=5_000,
        help="backlog for vanilla dramatiq-pg: it takes one advisory lock per message and exhausts a stock "
        "server's lock table (64 x max_connections) near 6,400 messages, so 20,000 never drains",
    )
    args = parser.parse_args()
    quiet()
    admin_url = testdb.server_url()
    ideal = args.sleep_jobs * SLEEP_S / args.threads
    keys = ("ours_drain", "van_drain", "ours_eff", "van_eff", "ours_backlog", "van_backlog",
            "ours_locks", "van_locks", "ours_p50", "ours_p99", "van_p50", "van_p99")
    results: dict[str, list[float]] = {k: [] for k in keys}

    def add(**values: float) -> None:
        for key, value in values.items():
            results[key].append(value)

    for run in range(1, args.runs + 1):
        o = args.drain / ours(admin_url, args.drain, args.threads, "noop")[0]
        v = args.drain / vanilla(admin_url, args.drain, args.threads, "noop")[0]
        add(ours_drain=o, van_drain=v)
        line = f"run {run}: drain {args.drain}: ours {o:,.0f} msg/s, vanilla {v:,.0f} msg/s"
        if args.sleep_jobs:
            oe = ideal / ours(admin_url, args.sleep_jobs, args.threads, "sleep")[0]
            ve = ideal / vanilla(admin_url, args.sleep_jobs, args.threads, "sleep")[0]
            add(ours_eff=oe, van_eff=ve)
            line += f"; {args.sleep_jobs} x 100 ms: ours {oe:.1%}, vanilla {ve:.1%} of ideal {ideal:.1f} s"
        if args.backlog:
            ot, ol = ours(admin_url, args.backlog, args.threads, "noop", locks=True)
            vb = min(args.backlog, args.vanilla_backlog)
            vt, vl = vanilla(admin_url, vb, args.threads, "noop", locks=True)
            add(ours_backlog=args.backlog / ot, van_backlog=vb / vt, ours_locks=ol, van_locks=vl)
            line += (f"; backlog: ours {args.backlog} at {args.backlog / ot:,.0f} msg/s (max {ol} locks),"
                     f" vanilla {vb} at {vb / vt:,.0f} msg/s (max {vl} locks)")
        if args.latency:
            lo = latency_ours(admin_url, args.threads, args.latency)
            lv = latency_vanilla(admin_url, args.threads, args.latency)
            add(ours_p50=pct(lo, 0.5), ours_p99=pct(lo, 0.99), van_p50=pct(lv, 0.5), van_p99=pct(lv, 0.99))
            line += (f"; idle enqueue->start p50/p99: ours {pct(lo, .5):.2f}/{pct(lo, .99):.2f} ms,"
                     f" vanilla {pct(lv, .5):.2f}/{pct(lv, .99):.2f} ms")
        print(line, flush=True)
    m = {k: median(v) for k, v in results.items() if v}
    print(f"median drain: ours {m['ours_drain']:,.0f} msg/s, vanilla dramatiq-pg {m['van_drain']:,.0f} msg/s")
    if "ours_eff" in m:
        print(f"median sleeping-job efficiency: ours {m['ours_eff']:.1%}, vanilla dramatiq-pg {m['van_eff']:.1%}")
    if "ours_backlog" in m:
        print(f"median backlog: ours ({args.backlog}) {m['ours_backlog']:,.0f} msg/s with at most {m['ours_locks']:.0f} locks,"
              f" vanilla ({min(args.backlog, args.vanilla_backlog)}) {m['van_backlog']:,.0f} msg/s"
              f" with at most {m['van_locks']:.0f} locks")
    if "ours_p50" in m:
        print(f"median idle enqueue->start p50/p99: ours {m['ours_p50']:.2f}/{m['ours_p99']:.2f} ms,"
              f" vanilla {m['van_p50']:.2f}/{m['van_p99']:.2f} ms")
    print(f"ratio: {m['ours_drain'] / m['van_drain']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
