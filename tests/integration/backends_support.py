"""Shared by the result- and rate-limiter-backend tests: a throw-away database, child processes.

Each test module gets its own database, ``smt_backends_<pid>_<n>``, created on the
server of ``DATABASE_URL`` (default: the local trust-auth Postgres) with the schema
``standmeet`` and migration 0009 applied, and dropped afterwards. Nothing here uses
the rest of the suite's fixtures.

The same module is the entry point of the child processes the tests start
(``python -m tests.integration.backends_support <command> …``): each child does one
thing against the database and prints one JSON line saying what it saw.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

ROOT = Path(__file__).resolve().parents[2]
MIGRATION = ROOT / "broker" / "pg" / "migrations" / "0009_results_and_rate_limits.sql"
ADMIN_URL = os.environ.get("DATABASE_URL") or "postgresql://postgres@127.0.0.1:5432/postgres"

CREATE_SCHEMA = "CREATE SCHEMA IF NOT EXISTS standmeet"
CREATE_DATABASE = sql.SQL("CREATE DATABASE {}")
DROP_DATABASE = sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)")

#: What the rate-limit children write: how many were inside the limited section, at most.
OBSERVATION_SCHEMA = """
CREATE TABLE IF NOT EXISTS limiter_probe (
    key     text PRIMARY KEY,
    inside  integer NOT NULL DEFAULT 0,
    peak    integer NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS limiter_entries (
    key     text NOT NULL,
    pid     integer NOT NULL,
    inside  integer NOT NULL
);
CREATE TABLE IF NOT EXISTS group_runs (
    run     text NOT NULL,
    kind    text NOT NULL,
    at      timestamptz NOT NULL DEFAULT clock_timestamp()
);
"""
ENTER_PROBE = """
UPDATE limiter_probe SET inside = inside + 1, peak = greatest(peak, inside + 1)
WHERE key = %(key)s RETURNING inside
"""
LEAVE_PROBE = "UPDATE limiter_probe SET inside = inside - 1 WHERE key = %(key)s"
RECORD_ENTRY = "INSERT INTO limiter_entries (key, pid, inside) VALUES (%(key)s, %(pid)s, %(inside)s)"

#: A start gate across processes: the test holds the advisory lock, children queue on it.
TAKE_GATE = "SELECT pg_advisory_lock_shared(%(gate)s)"
LEAVE_GATE = "SELECT pg_advisory_unlock_shared(%(gate)s)"
CLOSE_GATE = "SELECT pg_advisory_lock(%(gate)s)"
OPEN_GATE = "SELECT pg_advisory_unlock(%(gate)s)"
WAITING_AT_GATE = """
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND NOT granted AND objid = %(gate)s AND database = (
    SELECT oid FROM pg_database WHERE datname = current_database())
"""

#: Backends of one application name that have run LISTEN (the listener is up).
LISTENERS = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = %(app)s AND query ILIKE 'LISTEN %%'
"""

#: Did the pooled connections of ``app`` finish a read of the table after ``app``'s LISTEN?
READ_SINCE_LISTENING = """
SELECT coalesce(
    (SELECT max(state_change) FROM pg_stat_activity
     WHERE datname = current_database() AND application_name = %(app)s
       AND state = 'idle' AND query ILIKE %(table)s)
    > (SELECT max(query_start) FROM pg_stat_activity
       WHERE datname = current_database() AND application_name = %(listen)s
         AND query ILIKE 'LISTEN %%'),
    false)
"""

_counter = itertools.count(1)
T = TypeVar("T")


def with_dbname(url: str, dbname: str) -> str:
    params = conninfo_to_dict(url)
    params["dbname"] = dbname
    return make_conninfo("", **params)


def apply_migration(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(CREATE_SCHEMA)
        conn.execute(MIGRATION.read_text().encode())


@contextmanager
def fresh_database() -> Iterator[str]:
    """A new database with migration 0009 (and the observation tables); dropped afterwards."""
    name = f"smt_backends_{os.getpid()}_{next(_counter)}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
        conn.execute(DROP_DATABASE.format(sql.Identifier(name)))
        conn.execute(CREATE_DATABASE.format(sql.Identifier(name)))
    url = with_dbname(ADMIN_URL, name)
    try:
        apply_migration(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(OBSERVATION_SCHEMA)
        yield url
    finally:
        with psycopg.connect(ADMIN_URL, autocommit=True) as conn:
            conn.execute(DROP_DATABASE.format(sql.Identifier(name)))


def query(url: str, text: str, params: dict[str, Any] | Sequence[Any] | None = None) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        cur = conn.execute(text.encode(), params)
        return cur.fetchall() if cur.description else []


def scalar(url: str, text: str, params: dict[str, Any] | Sequence[Any] | None = None) -> Any:
    return query(url, text, params)[0][0]


def expired_rows_after_statistics_of_one(url: str, table: str, insert_expired: str) -> None:
    """Nine expired rows of ``table`` (``insert_expired`` writes one, its ``%s`` a key),
    with statistics gathered while it held a single one: the planner then joins a batch's
    rows in a plan that reads its subquery again for each row deleted."""
    query(url, "DELETE FROM " + table)
    query(url, insert_expired, ("nearly-empty",))
    query(url, "ANALYZE " + table)
    for n in range(8):
        query(url, insert_expired, (f"expired-{n}",))


def eventually(check: Callable[[], T], *, timeout_s: float = 10.0, what: str = "condition") -> T:
    """Call ``check`` until it returns something truthy, or fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s (last: {value!r})")
        time.sleep(0.02)


def listeners(url: str, application_name: str) -> int:
    """How many LISTEN connections the backends named ``application_name`` hold."""
    return int(scalar(url, LISTENERS, {"app": f"{application_name}-listen"}))


def read_since_listening(url: str, application_name: str, table: str) -> bool:
    """Whether a backend named ``application_name`` read ``table`` after its listener
    started listening: from then on it is asleep until a notification or its timeout."""
    return bool(
        scalar(
            url,
            READ_SINCE_LISTENING,
            {"app": application_name, "listen": f"{application_name}-listen", "table": f"%{table}%"},
        )
    )


# -- child processes ---------------------------------------------------------------------


def start_child(command: str, **args: Any) -> subprocess.Popen[str]:
    """Start ``python -m tests.integration.backends_support <command> <json args>``."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.integration.backends_support", command, json.dumps(args)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def child_report(proc: subprocess.Popen[str], *, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait for a child to exit and return the JSON line it printed."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err}"
    report: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return report


@contextmanager
def children(procs: list[subprocess.Popen[str]]) -> Iterator[list[subprocess.Popen[str]]]:
    """Kill (by pid, through the Popen object) any child still running when the block ends."""
    try:
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@contextmanager
def start_gate(url: str, gate: int) -> Iterator[Callable[[int], None]]:
    """Hold a gate closed; yield ``open_when(n)``: opens it once ``n`` processes wait at it."""
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(CLOSE_GATE, {"gate": gate})
        opened = False

        def open_when(waiting: int) -> None:
            nonlocal opened
            eventually(
                lambda: scalar(url, WAITING_AT_GATE, {"gate": gate}) >= waiting,
                what=f"{waiting} processes at the start gate",
            )
            conn.execute(OPEN_GATE, {"gate": gate})
            opened = True

        yield open_when
        if not opened:
            conn.execute(OPEN_GATE, {"gate": gate})


def _pass_gate(url: str, gate: int) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(TAKE_GATE, {"gate": gate})
        conn.execute(LEAVE_GATE, {"gate": gate})


def _wait_result(args: dict[str, Any]) -> dict[str, Any]:
    from dramatiq.message import Message
    from dramatiq.results import ResultFailure, ResultTimeout

    from broker.backends.results import PostgresResultBackend

    backend = PostgresResultBackend(url=args["url"], application_name=args["app"])
    message: Message[Any] = Message.decode(args["message"].encode())
    started = time.monotonic()
    report: dict[str, Any]
    try:
        report = {"result": message.get_result(backend=backend, block=True, timeout=args["timeout_ms"])}
    except ResultTimeout:
        report = {"timeout": True}
    except ResultFailure as exc:
        report = {"failure": [exc.orig_exc_type, exc.orig_exc_msg]}
    report["waited_s"] = time.monotonic() - started
    report["woke_at"] = time.time()
    backend.close()
    return report


def _limited_worker(args: dict[str, Any]) -> dict[str, Any]:
    """A worker process whose actor runs under a shared ConcurrentRateLimiter."""
    import dramatiq
    from dramatiq.brokers.stub import StubBroker
    from dramatiq.rate_limits import ConcurrentRateLimiter

    from broker.backends.rate_limits import PostgresRateLimiterBackend

    url, key = args["url"], args["key"]
    backend = PostgresRateLimiterBackend(url=url, pool_max_size=args["threads"])
    limiter = ConcurrentRateLimiter(backend, key, limit=args["limit"], ttl=60_000)
    stub = StubBroker()
    stub.emit_after("process_boot")
    outcomes = {"acquired": 0, "refused": 0}
    counting = threading.Lock()

    @dramatiq.actor(broker=stub, max_retries=0)
    def limited() -> None:
        # Each message tries until it gets a slot (refusals counted): both processes then
        # hold slots in turn, however the scheduler favours one of them.
        give_up = time.monotonic() + 30
        while True:
            with limiter.acquire(raise_on_failure=False) as acquired:
                if acquired:
                    with psycopg.connect(url, autocommit=True) as conn:
                        inside = conn.execute(ENTER_PROBE, {"key": key}).fetchone()
                        assert inside is not None
                        conn.execute(RECORD_ENTRY, {"key": key, "pid": os.getpid(), "inside": inside[0]})
                        # The job's work: it holds its slot long enough for the others to contend.
                        time.sleep(args["work_ms"] / 1000)
                        conn.execute(LEAVE_PROBE, {"key": key})
                    with counting:
                        outcomes["acquired"] += 1
                    return
            with counting:
                outcomes["refused"] += 1
            if time.monotonic() > give_up:
                return
            time.sleep(0.002)

    for _ in range(args["messages"]):
        limited.send()
    _pass_gate(url, args["gate"])
    worker = dramatiq.Worker(stub, worker_threads=args["threads"], worker_timeout=50)
    worker.start()
    stub.join(limited.queue_name, timeout=60_000)
    worker.join()
    worker.stop()
    backend.close()
    return outcomes


def _window_tries(args: dict[str, Any]) -> dict[str, Any]:
    from dramatiq.rate_limits import WindowRateLimiter

    from broker.backends.rate_limits import PostgresRateLimiterBackend

    backend = PostgresRateLimiterBackend(url=args["url"])
    limiter = WindowRateLimiter(backend, args["key"], limit=args["limit"], window=args["window_s"])
    _pass_gate(args["url"], args["gate"])
    acquired = 0
    for _ in range(args["tries"]):
        with limiter.acquire(raise_on_failure=False) as ok:
            acquired += bool(ok)
    backend.close()
    return {"acquired": acquired}


def _barrier_wait(args: dict[str, Any]) -> dict[str, Any]:
    from dramatiq.rate_limits import Barrier

    from broker.backends.rate_limits import PostgresRateLimiterBackend

    backend = PostgresRateLimiterBackend(url=args["url"], application_name=args["app"])
    barrier = Barrier(backend, args["key"], ttl=60_000)
    started = time.monotonic()
    passed = barrier.wait(block=True, timeout=args["timeout_ms"])
    report = {"passed": passed, "waited_s": time.monotonic() - started}
    backend.close()
    return report


COMMANDS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "wait-result": _wait_result,
    "limited-worker": _limited_worker,
    "window-tries": _window_tries,
    "barrier-wait": _barrier_wait,
}


if __name__ == "__main__":
    command, raw = sys.argv[1], sys.argv[2]
    print(json.dumps(COMMANDS[command](json.loads(raw))), flush=True)


def written_through_an_outage(proxy: Any, caplog: Any, write: Callable[[], T], *, what: str) -> list[T | BaseException]:
    """Cut ``proxy``, run ``write`` on a thread, see it wait through several checkout
    timeouts (refused connections, the backend's "trying again" warning) without ending,
    restore the proxy and let it end; what it returned or raised (one item)."""
    import logging

    ended: list[T | BaseException] = []

    def run() -> None:
        try:
            ended.append(write())
        except BaseException as exc:  # the test reads what the thread raised
            ended.append(exc)

    proxy.cut()
    with caplog.at_level(logging.WARNING, logger="standmeet.broker.backends.results"):
        writing = threading.Thread(target=run, name="test-write-through-outage")
        writing.start()
        eventually(lambda: proxy.refused >= 3 and "trying again until it is written" in caplog.text,
                   what=f"{what} to outlast several checkout timeouts")
    assert writing.is_alive() and not ended
    proxy.restore()
    writing.join(timeout=30)
    return ended
