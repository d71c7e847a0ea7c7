"""What the drain benchmarks share: a fresh database, real worker processes, and one
sampling loop (no threads) that watches the queue, the CPU of the worker processes and
of their Postgres backends, the locks held and the claims each process holds.

CPU is read from ``/proc`` (Linux, Postgres on this machine), in clock ticks turned
into milliseconds; a backend is counted from its first sample to its last.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

ROOT = Path(__file__).resolve().parent.parent
TICK_MS = 1000.0 / os.sysconf("SC_CLK_TCK")
QUEUE = "index"
ACTOR = "bench.noop"
#: Enqueued per statement when a backlog is built.
ENQUEUE_CHUNK = 10_000

#: Whether anything is still queued or running, and whether anything was claimed yet. Index
#: probes, not counts: counting a million rows every 50 ms made the sampler itself the
#: busiest backend of the run (and its parallel workers were counted as the drain's CPU).
OUTSTANDING = """
SELECT EXISTS (SELECT 1 FROM dramatiq.queue WHERE queue_name = %s AND state = 'queued'),
       EXISTS (SELECT 1 FROM dramatiq.queue WHERE state = 'consumed')
"""
DONE = "SELECT count(*) FROM dramatiq.queue WHERE queue_name = %s AND state = 'done'"
BACKENDS = """
SELECT pid FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid()
  AND (leader_pid IS NULL OR leader_pid <> pg_backend_pid())
"""
LOCKS = """
SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)
WHERE a.datname = current_database() AND a.pid <> pg_backend_pid()
"""
HELD = """
SELECT count(*) FROM dramatiq.queue WHERE state = 'consumed' AND worker_id IS NOT NULL GROUP BY worker_id
"""
TABLE = """
SELECT pg_total_relation_size('dramatiq.queue'), coalesce(n_dead_tup, 0), coalesce(n_live_tup, 0)
FROM pg_stat_user_tables WHERE relid = 'dramatiq.queue'::regclass
"""


def cpu_ms(pid: int) -> float | None:
    """User + system CPU of a process so far, in ms (None if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) * TICK_MS


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def admin_url() -> str:
    url = os.environ.get("DATABASE_URL")
    if not url:
        raise SystemExit("set DATABASE_URL to a server where bench_* databases may be created and dropped")
    return url


def with_dbname(url: str, dbname: str) -> str:
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    params = conninfo_to_dict(url)
    params["dbname"] = dbname
    return make_conninfo(**params)


@contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """A new migrated database named ``bench_<prefix>_…``, dropped afterwards."""
    from psycopg import sql

    from broker.pg.migrate import migrate

    admin = admin_url()
    name = f"bench_{prefix}_{os.getpid()}_{uuid.uuid4().hex[:6]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = with_dbname(admin, name)
    try:
        migrate(url)
        yield url
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def enqueue_backlog(url: str, n: int) -> float:
    """Queue ``n`` no-op messages with the public bulk enqueue; returns messages/s."""
    from dramatiq.message import Message

    from broker import enqueue_many
    from broker.services import current_broker

    b = current_broker()
    if QUEUE not in b.queues:
        b.declare_queue(QUEUE)
    started = time.perf_counter()
    with psycopg.connect(url, autocommit=True) as conn:
        for first in range(0, n, ENQUEUE_CHUNK):
            batch = [Message(queue_name=QUEUE, actor_name=ACTOR, args=(i,), kwargs={}, options={})
                     for i in range(first, min(n, first + ENQUEUE_CHUNK))]
            enqueue_many(batch, conn=conn)
    return n / (time.perf_counter() - started)


def table_stats(conn: psycopg.Connection[Any]) -> tuple[float, int, int]:
    """(table + index size in MB, dead tuples, live tuples) of ``dramatiq.queue``."""
    row = conn.execute(TABLE).fetchone()
    assert row is not None
    return row[0] / 1e6, int(row[1]), int(row[2])


@dataclass
class Drain:
    """What one timed drain measured."""

    n: int
    processes: int
    seconds: float = 0.0
    worker_cpu_ms: float = 0.0
    pg_cpu_ms: float = 0.0
    max_locks: int = 0
    max_held: int = 0
    max_running: list[int] = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0

    @property
    def rate(self) -> float:
        return self.n / self.seconds if self.seconds else 0.0

    @property
    def worker_ms_per_job(self) -> float:
        return self.worker_cpu_ms / self.n

    @property
    def pg_ms_per_job(self) -> float:
        return self.pg_cpu_ms / self.n


def worker_env(url: str, *, limit: int, stats_dir: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "DATABASE_URL": url,
        "STANDMEET_QUEUE_INDEX_MAX_WORKERS": str(limit),
        "BENCH_STATS_DIR": stats_dir,
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
    })
    return env


def timed_drain(url: str, n: int, *, processes: int = 1, limit: int = 8, threads: int = 8,
                timeout_s: float = 3600.0) -> Drain:
    """Start ``processes`` workers on a queued backlog of ``n``; sample until it is drained.

    The clock starts when the first message leaves the queue, and stops when nothing is
    queued or running.
    """
    result = Drain(n=n, processes=processes)
    stats_dir = tempfile.mkdtemp(prefix="bench-drain-")
    cmd = [sys.executable, "-m", "broker.worker", "bench.drain_actors", "--queues", QUEUE,
           "--threads", str(threads)]
    env = worker_env(url, limit=limit, stats_dir=stats_dir)
    logs = [open(os.path.join(stats_dir, f"worker{i}.log"), "wb") for i in range(processes)]
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT) for log in logs]
    first_cpu: dict[int, float] = {}
    last_cpu: dict[int, float] = {}
    worker_start = {p.pid: cpu_ms(p.pid) or 0.0 for p in procs}
    worker_end = dict(worker_start)
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("SET max_parallel_workers_per_gather = 0")  # the sampler stays one backend
            t0 = None
            deadline = time.monotonic() + timeout_s
            result.rss_start_mb = 0.0
            while True:
                queued, running = conn.execute(OUTSTANDING, (QUEUE,)).fetchone()  # type: ignore[misc]
                now = time.monotonic()
                for (pid,) in conn.execute(BACKENDS).fetchall():
                    value = cpu_ms(pid)
                    if value is not None:
                        if t0 is None:
                            first_cpu[pid] = value  # counted from the drain's start
                        else:
                            first_cpu.setdefault(pid, value)
                        last_cpu[pid] = value
                for p in procs:
                    value = cpu_ms(p.pid)
                    if value is not None:
                        if t0 is None:
                            worker_start[p.pid] = value  # not the start-up's imports
                        worker_end[p.pid] = value
                if t0 is None and running:
                    t0 = now
                    result.rss_start_mb = sum(rss_mb(p.pid) for p in procs)
                if t0 is not None:
                    result.max_locks = max(result.max_locks, conn.execute(LOCKS).fetchone()[0])  # type: ignore[index]
                    held = [row[0] for row in conn.execute(HELD).fetchall()]
                    result.max_held = max([result.max_held, *held])
                if not queued and not running:
                    result.seconds = now - (t0 or now)
                    result.rss_end_mb = sum(rss_mb(p.pid) for p in procs)
                    (done,) = conn.execute(DONE, (QUEUE,)).fetchone()  # type: ignore[misc]
                    if done != n:
                        raise RuntimeError(f"the queue drained with {done} of {n} jobs done")
                    break
                for p in procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"worker {p.pid} exited with {p.returncode}; log in {stats_dir}")
                if now > deadline:
                    raise TimeoutError(f"jobs still outstanding after {timeout_s} s")
                time.sleep(0.05 if t0 is not None else 0.01)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    # the backends' CPU from their first sample (the consumers' were idle until then)
    result.pg_cpu_ms = sum(last_cpu[pid] - first_cpu[pid] for pid in last_cpu)
    result.worker_cpu_ms = sum(worker_end[pid] - worker_start[pid] for pid in worker_start)
    for name in os.listdir(stats_dir):
        if name.endswith(".max"):
            with open(os.path.join(stats_dir, name)) as f:
                result.max_running.append(int(f.read() or 0))
    return result


def median(values: list[float]) -> float:
    return statistics.median(values)
