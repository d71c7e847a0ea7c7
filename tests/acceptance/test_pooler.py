"""The runtime through PgBouncer, as production Postgres is reached: real processes, stock settings.

Debian's PgBouncer (``tests/support/pgbouncer.py``) in transaction and in session mode,
stock settings (``ignore_startup_parameters`` unset: a client that sends ``options`` is
refused), in front of the test server. Each test starts the processes it needs with
``DATABASE_URL`` naming the pooler, and reads what happened from the rows the jobs wrote
and from every process's log.

The two actors below are loaded by the worker processes of this module
(``python -m broker.worker … tests.acceptance.test_pooler``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import dramatiq
import httpx
import psycopg
import pytest

import tests.support.jobs  # noqa: F401  (configures the broker, declares the test actors)
from broker.pg import db
from tests.support.jobs import cooperative_sleep

pytestmark = pytest.mark.slow

# -- the actors of this module's workers ------------------------------------------------

RECORD_SEEN = """
INSERT INTO test_runs (actor, queue, label, pid, message_id, finished_at)
VALUES ('pooler.deadline_probe', 'index', %(label)s, %(pid)s, %(message_id)s, clock_timestamp())
"""


@dramatiq.actor(actor_name="pooler.deadline_probe", queue_name="index", max_retries=0)
def deadline_probe(n: int, limit_ms: int, rounds: int = 4) -> None:
    """What ``SHOW statement_timeout`` says inside ``broker.pg.db.connection()``, a few times,
    with the connection given back (and other jobs' statements run) in between."""
    from dramatiq.middleware import CurrentMessage

    seen = []
    for _ in range(rounds):
        with db.connection() as conn:
            row = conn.execute("SHOW statement_timeout").fetchone()
            assert row is not None
            seen.append(str(row[0]))
        cooperative_sleep(0.015)
    message = CurrentMessage.get_current_message()
    with db.connection() as conn:
        conn.execute(RECORD_SEEN, {"label": json.dumps({"n": n, "limit_ms": limit_ms, "seen": seen}),
                                   "pid": os.getpid(), "message_id": message.message_id if message else None})


# -- what the tests share -----------------------------------------------------------------

from broker.engine import sql_enqueue  # noqa: E402
from broker.engine.codec import enqueue_params  # noqa: E402
from broker.outbox import MESSAGE_NAMESPACE  # noqa: E402
from tests.conftest import configured_broker, slow_polls  # noqa: E402
from tests.support import db as testdb  # noqa: E402
from tests.support.db import query, scalar, wait_for  # noqa: E402
from tests.support.jobs import mark, noop  # noqa: E402
from tests.support.pgbouncer import PgBouncer, free_port, missing_reason, pgbouncer  # noqa: E402
from tests.support.procs import ROOT, running  # noqa: E402

MODULES = ("tests.support.contract_jobs", "tests.acceptance.test_pooler")
PAGES = ("/", "/jobs", "/jobs?state=done", "/workers", "/periodic", "/webhooks", "/healthz", "/metrics")
#: Lines that must appear in no process's log, whatever the pooler.
FORBIDDEN = ('prepared statement "', "DuplicatePreparedStatement", "InvalidSqlStatementName",
             "bind message supplies", "unsupported startup parameter",
             "canceling statement due to statement timeout", "Traceback")
#: The worker's start-up line naming what it found (the lead's format:
#: ``database connection: a pooler in transaction mode (...); no prepared statements; ...``).
TOPOLOGY = "database connection: "
STATES = "SELECT state::text, count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) GROUP BY 1"
UNITS_MS = {"ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}


@pytest.fixture(autouse=True)
def _pgbouncer_installed() -> None:
    reason = missing_reason()
    if reason:
        pytest.skip(reason)


def worker_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "broker.worker", *MODULES, *args]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "broker.cli", *args]


def stop(proc: subprocess.Popen[bytes], log: Path, *, timeout_s: float = 30, codes: tuple[int, ...] = (0,)) -> None:
    """SIGTERM, and the process must exit by itself (0) within ``timeout_s``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.args} did not stop within {timeout_s} s: {log.read_text()[-3000:]}") from None
    assert code in codes, f"{proc.args} exited with {code}: {log.read_text()[-3000:]}"


def run_cli(bouncer: PgBouncer, direct_url: str, env: dict[str, str], *args: str,
            timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """``standmeet-jobs ARGS`` through the pooler; one that does not return in time says
    who holds the pooler's server connections."""
    try:
        return subprocess.run(cli(*args), env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"`standmeet-jobs {args[0]}` did not return within {timeout_s:g} s through the "
                             f"{bouncer.mode} pooler; {who_holds(bouncer, direct_url)}") from None


def who_holds(bouncer: PgBouncer, direct_url: str) -> str:
    """The pooler's pools and the server's connections by application: why a client waits."""
    pools = [row for row in bouncer.admin("SHOW POOLS") if row[0] != "pgbouncer"]
    held = query(direct_url, "SELECT application_name, count(*) FROM pg_stat_activity"
                             " WHERE datname = current_database() AND pid <> pg_backend_pid() GROUP BY 1 ORDER BY 2 DESC")
    return f"PgBouncer's pools (database, user, cl_active, cl_waiting, …, sv_active, sv_idle, …): {pools}; " \
           f"server connections by application: {held}"


def clean(name: str, text: str) -> None:
    """No prepared-statement error, refused startup parameter, leaked timeout or traceback."""
    for needle in FORBIDDEN:
        found = [line for line in text.splitlines() if needle.lower() in line.lower()]
        assert not found, f"{name}'s log has {needle!r}: {found[:5]}\n{text[-3000:]}"


def topology_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if TOPOLOGY in line]


def shown_ms(value: str) -> int:
    """``SHOW statement_timeout``'s text (``0``, ``250ms``, ``29s``, ``2min``) in ms."""
    found = re.fullmatch(r"(\d+)\s*([a-z]*)", value.strip())
    assert found, value
    return int(found[1]) * UNITS_MS.get(found[2] or "ms", 0)


def done(url: str, ids: list[str]) -> bool:
    return dict(query(url, STATES, (ids,))).get("done", 0) == len(ids)


def states(url: str, ids: list[str]) -> dict[str, int]:
    return dict(query(url, STATES, (ids,)))


@pytest.fixture
def fresh_database(admin_url: str) -> Iterator[str]:
    """An empty database on the test server (its direct URL): migrated through the pooler
    by the test itself, dropped after."""
    name = testdb.unique_name("smt_pooled")
    testdb.drop_database(admin_url, name)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"'.encode())
    try:
        yield testdb.with_dbname(admin_url, name)
    finally:
        testdb.drop_database(admin_url, name)


@pytest.fixture
def env_for(subprocess_env: dict[str, str]) -> Callable[..., dict[str, str]]:
    """The child processes' environment with ``DATABASE_URL`` and, when given,
    ``STANDMEET_LISTEN_DATABASE_URL``; no pooler setting is passed: the runtime finds out."""

    def make(url: str, *, listen_url: str | None = None, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in subprocess_env.items()
               if k not in ("STANDMEET_LISTEN_DATABASE_URL", "STANDMEET_POOLER", "STANDMEET_PREPARED_STATEMENTS")}
        env["DATABASE_URL"] = url
        if listen_url is not None:
            env["STANDMEET_LISTEN_DATABASE_URL"] = listen_url
        return {**env, **extra}

    return make


# -- everything works -----------------------------------------------------------------


@pytest.mark.parametrize("mode", ["transaction", "session"])
def test_through_pgbouncer_migrate_enqueue_emit_workers_scheduler_relay_receipts_results_limits_and_dashboard_work(
    mode, admin_url, fresh_database, env_for, tmp_path
):
    with ExitStack() as stack:
        # Given PgBouncer in `mode` with its stock settings in front of an empty database
        # (in session mode, a pool with a server connection for each of the processes'
        # connections: each holds one for its life)
        bouncer = stack.enter_context(pgbouncer(admin_url, mode=mode,
                                                default_pool_size=20 if mode == "transaction" else SESSION_POOL))
        url = bouncer.url(fresh_database)
        env = env_for(url)
        logs: dict[str, Path] = {}
        # When the schema is migrated through it
        migrated = run_cli(bouncer, fresh_database, env, "migrate")
        logs["migrate"] = tmp_path / "migrate.log"
        logs["migrate"].write_text(migrated.stdout + migrated.stderr)
        assert migrated.returncode == 0, migrated.stdout + migrated.stderr
        assert "applied 0001" in migrated.stdout, migrated.stdout
        query(fresh_database, testdb.TEST_SCHEMA)
        # And a worker, a scheduler (one periodic job a second) and the dashboard run through it
        procs = {}
        for name, cmd in {
            "worker": worker_command(),
            "scheduler": [sys.executable, "-m", "periodic", *MODULES, "--jobs", "tests.support.periodic_jobs:JOBS"],
            "dashboard": cli("dashboard", "--port", str(port := free_port())),
        }.items():
            logs[name] = tmp_path / f"{name}.log"
            procs[name] = stack.enter_context(running(cmd, env, log=logs[name]))
        wait_for(lambda: scalar(fresh_database, "SELECT count(*) FROM standmeet.worker_processes"
                                               " WHERE stopped_at IS NULL") >= 1,
                 timeout_s=60, what=f"the worker to register through the pooler: {logs['worker'].read_text()[-2000:]}")
        with configured_broker(url) as broker:
            from dramatiq.rate_limits import ConcurrentRateLimiter

            from broker import PostgresRateLimiterBackend, emit
            from tests.support.contract_jobs import add, limited

            # And jobs are enqueued, an event is emitted, a result is awaited, a limited
            # actor runs beside others, and a document is written (a write that waits)
            sent = [noop.send(f"pooled-{mode}-{i}") for i in range(30)]
            with psycopg.connect(url) as conn, conn.transaction():
                emit(conn, "test.ping", {"label": f"emitted-{mode}"})
            emitted = run_cli(bouncer, fresh_database, env, "emit", "document.written",
                              "--payload", '{"document_id": 999999}')
            assert emitted.returncode == 0, emitted.stderr
            cli_event = int(emitted.stdout.strip().splitlines()[-1])
            result = add.send(2, 3).get_result(block=True, timeout=30_000)
            limited_ids = [limited.send(f"limited-{mode}-{i}", 20).message_id for i in range(6)]
            doc = tmp_path / "doc.txt"
            doc.write_text(f"Pooled {mode}\nA document written through PgBouncer in {mode} mode.\n")
            written = run_cli(bouncer, fresh_database, env, "write", str(doc), "--wait-s", "15")
            backend = PostgresRateLimiterBackend(url=url, pool_max_size=2)
            try:
                mutex = ConcurrentRateLimiter(backend, f"pooled-{mode}", limit=1)
                with mutex.acquire(raise_on_failure=False) as first:
                    with mutex.acquire(raise_on_failure=False) as held_twice:
                        pass
                with mutex.acquire(raise_on_failure=False) as free_again:
                    pass
            finally:
                backend.close()
            assert broker.url == url
        # Then every part did its work
        assert result == 5
        assert (first, held_twice, free_again) == (True, False, True)
        assert written.returncode == 0, written.stdout + written.stderr
        assert json.loads(written.stdout.strip().splitlines()[-1])["indexed"] is True, written.stdout
        ids = [m.message_id for m in sent]
        wait_for(lambda: done(fresh_database, ids + limited_ids), timeout_s=60,
                 what=f"the jobs sent through the pooler to be done ({mode})")
        wait_for(lambda: scalar(fresh_database, "SELECT count(*) FROM test_runs WHERE actor = 'test.noop'"
                                                " AND label = %s", (f"emitted-{mode}",)) == 1,
                 timeout_s=60, what="the emitted event relayed and its job run")
        cli_job = str(uuid.uuid5(MESSAGE_NAMESPACE, f"{cli_event}/0"))
        wait_for(lambda: done(fresh_database, [cli_job]), timeout_s=60,
                 what="the event emitted by the command line relayed and its job done")
        wait_for(lambda: scalar(fresh_database, "SELECT count(*) FROM test_runs WHERE actor = 'test.tick'") >= 2,
                 timeout_s=30, what="the scheduler's periodic job to run twice")
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(base), timeout_s=30, what="the dashboard to answer")
        for path in PAGES:
            page = httpx.get(base + path, timeout=15)
            assert page.status_code == 200, (path, page.status_code, page.text[:500])
        assert scalar(fresh_database, "SELECT count(*) FROM dramatiq.queue WHERE state = 'rejected'") == 0
        for name in ("worker", "scheduler"):
            stop(procs[name], logs[name])
        stop(procs["dashboard"], logs["dashboard"], codes=(0, -signal.SIGTERM))  # uvicorn's own exit
    texts = {name: path.read_text() for name, path in logs.items()}
    for name, text in texts.items():
        clean(name, text)
    # And the worker said once, at start-up, that it found a pooler and what that implies
    lines = topology_lines(texts["worker"])
    assert len(lines) == 1, lines or texts["worker"][-3000:]
    if mode == "transaction":
        assert "pooler in transaction mode" in lines[0] and "no prepared statements" in lines[0], lines
    else:
        assert "pooler in session mode" in lines[0] and "LISTEN on the same connection" in lines[0], lines
    print(f"{mode}: {lines[0].split(TOPOLOGY, 1)[1]}")


def _answers(base: str) -> bool:
    try:
        return httpx.get(base + "/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


# -- deadlines ------------------------------------------------------------------------

#: Probe n's limit is 30 s + 10 s × n: another job's deadline is at least 10 s away from
#: a job's own (and jobs last well under a second), so a value seen in the window
#: (limit − 5 s, limit] can only be the job's own.
PROBES = 24
OWN_WINDOW_MS = 5_000


@pytest.mark.parametrize("mode", ["transaction", "session"])
def test_through_pgbouncer_no_job_ever_sees_another_jobs_deadline(
    mode, admin_url, direct_database_url, env_for, tmp_path
):
    # Given a worker through PgBouncer in `mode`, running four jobs at once
    log = tmp_path / "worker.log"
    with pgbouncer(admin_url, mode=mode) as bouncer:
        url = bouncer.url(direct_database_url)
        with running(worker_command("--queues", "index"), env_for(url), log=log) as worker:
            # When 24 jobs, each with a time limit of its own, read their statement_timeout
            # four times each, giving their connection back in between
            with configured_broker(url):
                limits = {n: 30_000 + 10_000 * n for n in range(PROBES)}
                ids = [deadline_probe.send_with_options(args=(n, limit), time_limit=limit).message_id
                       for n, limit in limits.items()]
            try:
                wait_for(lambda: done(direct_database_url, ids), timeout_s=90,
                         what=f"the {PROBES} probes to finish ({mode})")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {states(direct_database_url, ids)}\n{log.read_text()[-3000:]}") from None
            stop(worker, log)
    rows = query(direct_database_url, "SELECT label FROM test_runs WHERE actor = 'pooler.deadline_probe'"
                                      " AND message_id = ANY(%s::uuid[])", (ids,))
    seen = [json.loads(row[0]) for row in rows]
    # Then each job saw only its own deadline: what remained of its own limit, every time
    assert len(seen) == PROBES
    foreign = [(s["n"], s["limit_ms"], s["seen"]) for s in seen
               if not all(s["limit_ms"] - OWN_WINDOW_MS < shown_ms(v) <= s["limit_ms"] for v in s["seen"])]
    assert foreign == [], f"{len(foreign)} of {PROBES} jobs saw a deadline not their own: {foreign[:5]}"
    clean("worker", log.read_text())


# -- wake-ups -------------------------------------------------------------------------

IDLE_SAMPLES = 5
#: The idle period under test: longer than any claim loop's back-off, shorter than the
#: queue's own fallback poll (slow_polls), so only a wake-up can start a job quickly.
IDLE_S = 0.4
QUEUE_POLL_S = 30.0


def _idle_start_latencies_ms(url: str, direct_url: str, label: str) -> list[float]:
    """Enqueue one job at a time at idle; from its commit to its start (the database's clock)."""
    import time

    latencies = []
    with configured_broker(url):
        for i in range(IDLE_SAMPLES):
            time.sleep(IDLE_S)  # the idle period under test
            message = noop.message(f"{label}-{i}")
            with psycopg.connect(url, autocommit=True) as conn:
                with conn.transaction():
                    conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
                row = conn.execute("SELECT clock_timestamp()").fetchone()
                assert row is not None
                committed = row[0]
            started = wait_for(lambda m=message: scalar(direct_url, "SELECT started_at FROM test_runs"
                                                                    " WHERE message_id = %s", (m.message_id,)),
                               timeout_s=QUEUE_POLL_S / 2, what=f"idle job {i} to start")
            latencies.append((started - committed).total_seconds() * 1000)
    return latencies


#: Probes of one pooler in the test below: the probe before PROBE_ROUNDS took a busy
#: transaction pooler for a session pooler about once in fifteen here.
PROBES = 150


@pytest.mark.parametrize("mode", ["transaction", "session"])
def test_the_probe_names_the_poolers_mode_every_time_while_other_clients_keep_it_busy(
    mode, admin_url, direct_database_url
):
    from broker.pg.pool import probe

    # Given PgBouncer in `mode`, and three other clients running statements through it
    # without a pause, taking and freeing server connections while the runtime probes it
    done = threading.Event()

    def busy(url: str) -> None:
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
            while not done.is_set():
                conn.execute("SELECT 1")

    with pgbouncer(admin_url, mode=mode) as bouncer:
        url = bouncer.url(direct_database_url)
        clients = [threading.Thread(target=busy, args=(url,), daemon=True) for _ in range(3)]
        for client in clients:
            client.start()
        try:
            # When the runtime probes the pooler again and again (as each process does once)
            seen: dict[str, int] = {}
            for _ in range(PROBES):
                found, _how = probe(url)
                seen[found] = seen.get(found, 0) + 1
        finally:
            done.set()
            for client in clients:
                client.join(10)
    # Then it names the pooler's mode every time: a transaction pooler taken for a session
    # pooler would have its statements prepared, and lose them between transactions
    assert seen == {mode: PROBES}
    assert not any(client.is_alive() for client in clients)


def test_through_a_transaction_pooler_with_a_direct_listen_url_an_idle_worker_starts_a_job_within_500_ms(
    admin_url, direct_database_url, env_for, tmp_path
):
    # Given a worker through PgBouncer in transaction mode, LISTENing on the direct URL,
    # whose queue's own fallback poll is 30 s
    log = tmp_path / "worker.log"
    with pgbouncer(admin_url, mode="transaction") as bouncer:
        url = bouncer.url(direct_database_url)
        env = env_for(url, listen_url=direct_database_url, **_slow_poll_env())
        with running(worker_command("--queues", "index"), env, log=log) as worker:
            _wait_registered(direct_database_url, log)
            # When jobs are enqueued through the pooler, one at a time, at idle
            latencies = _idle_start_latencies_ms(url, direct_database_url, "listened")
            stop(worker, log)
    text = log.read_text()
    print(f"idle enqueue → start through the pooler, LISTEN direct: {[round(x, 1) for x in latencies]} ms")
    # Then each starts well under a second after its commit: woken, not polled
    assert statistics.median(latencies) < 500, latencies
    # And the worker said once which pooler it found, and that it LISTENs elsewhere
    lines = topology_lines(text)
    assert len(lines) == 1 and "pooler in transaction mode" in lines[0], lines or text[-3000:]
    assert "no prepared statements" in lines[0], lines
    clean("worker", text)


def test_through_a_transaction_pooler_without_a_listen_url_the_worker_says_it_polls_and_idle_jobs_still_start(
    admin_url, direct_database_url, env_for, tmp_path
):
    # Given a worker through PgBouncer in transaction mode with no connection that can LISTEN
    log = tmp_path / "worker.log"
    with pgbouncer(admin_url, mode="transaction") as bouncer:
        url = bouncer.url(direct_database_url)
        with running(worker_command("--queues", "index"), env_for(url, **_slow_poll_env()), log=log) as worker:
            _wait_registered(direct_database_url, log)
            # When jobs are enqueued at idle
            latencies = _idle_start_latencies_ms(url, direct_database_url, "polled")
            stop(worker, log)
    text = log.read_text()
    print(f"idle enqueue → start through the pooler, polling: {[round(x, 1) for x in latencies]} ms")
    # Then it said once, at start-up, that wake-ups fall back to polling
    lines = topology_lines(text)
    assert len(lines) == 1 and "pooler in transaction mode" in lines[0], lines or text[-3000:]
    assert "poll" in lines[0], lines
    # And idle jobs start at the documented poll, not the queue's 30 s
    assert statistics.median(latencies) < 1000, latencies
    clean("worker", text)


def _slow_poll_env() -> dict[str, str]:
    return {k: str(v) for k, v in slow_polls(QUEUE_POLL_S, "index")["queue_env"].items()  # type: ignore[union-attr]
            if k.endswith("_POLL_S")}


def _wait_registered(direct_url: str, log: Path) -> None:
    wait_for(lambda: scalar(direct_url, "SELECT count(*) FROM standmeet.worker_processes WHERE stopped_at IS NULL"
                                        " AND heartbeat_at > now() - interval '2 seconds'") >= 1,
             timeout_s=60, what=f"the worker to register: {log.read_text()[-2000:]}")


# -- a session pooler too small for every connection ------------------------------------

SESSION_JOBS = 600
#: A session pool with a server connection for every connection of the fleet below:
#: 3 workers serving one queue with 4 threads (20 connections each) and the scheduler (11).
SESSION_POOL = 75
SESSION_FLEET = ["--processes", "3", "--queues", "index", "--threads", "4"]


def test_run_refuses_a_fleet_that_needs_more_server_connections_than_a_session_pooler_gives(
    admin_url, direct_database_url, env_for, tmp_path
):
    # Given PgBouncer in session mode with its default pool of 20 server connections, which
    # the operator declared
    log = tmp_path / "run.log"
    with pgbouncer(admin_url, mode="session", default_pool_size=20) as bouncer:
        url = bouncer.url(direct_database_url)
        before = scalar(direct_database_url, "SELECT count(*) FROM standmeet.worker_processes")
        # When `run` is asked for three worker processes and the scheduler through it
        cmd = cli("run", "tests.support.jobs", *SESSION_FLEET)
        with running(cmd, env_for(url, STANDMEET_POOLER_POOL_SIZE="20"), log=log) as run:
            code = run.wait(timeout=60)
    # Then it refuses in one line naming the pooler's pool and what fits, starting nothing
    text = log.read_text()
    assert code == 78, text
    refusal = [line for line in text.splitlines() if "refusing to start" in line]
    assert len(refusal) == 1 and "session mode" in refusal[0] and "STANDMEET_POOLER_POOL_SIZE" in refusal[0], text
    assert "Traceback" not in text
    assert scalar(direct_database_url, "SELECT count(*) FROM standmeet.worker_processes") == before


def test_session_pooling_with_a_pool_for_every_connection_never_reruns_a_live_workers_jobs(
    admin_url, direct_database_url, env_for, tmp_path
):
    # Given PgBouncer in session mode with a server connection for each of the fleet's
    # connections, and 600 jobs queued
    messages = [mark.message(f"session-{i}") for i in range(SESSION_JOBS)]
    ids = [m.message_id for m in messages]
    with psycopg.connect(direct_database_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(messages))
    log = tmp_path / "run.log"
    with pgbouncer(admin_url, mode="session", default_pool_size=SESSION_POOL) as bouncer:
        url = bouncer.url(direct_database_url)
        # When `run` starts three worker processes (and the scheduler) through it
        cmd = cli("run", "tests.support.jobs", *SESSION_FLEET)
        with running(cmd, env_for(url, STANDMEET_POOLER_POOL_SIZE=str(SESSION_POOL)), log=log) as run:
            try:
                wait_for(lambda: done(direct_database_url, ids), timeout_s=180, interval_s=0.5,
                         what=f"the {SESSION_JOBS} jobs to be done")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {states(direct_database_url, ids)}; "
                                     f"{who_holds(bouncer, direct_database_url)}\n{log.read_text()[-4000:]}") from None
            stop(run, log, timeout_s=60)
    text = log.read_text()
    runs = dict(query(direct_database_url, "SELECT message_id::text, count(*) FROM test_runs"
                                           " WHERE actor = 'test.mark' AND message_id = ANY(%s::uuid[])"
                                           " GROUP BY 1", (ids,)))
    twice = {k: v for k, v in runs.items() if v > 1}
    print(f"session pooling, 3 processes, pool {SESSION_POOL}: {len(runs)} jobs ran, {len(twice)} more than once")
    # Then every job ran, none twice, and nobody rescued a live worker's claims
    assert f"of the {SESSION_POOL} server connections of the session pooler" in text, text[-3000:]
    assert len(runs) == SESSION_JOBS
    assert twice == {}, f"{len(twice)} jobs ran more than once"
    assert "crash rescue" not in text, [line for line in text.splitlines() if "crash rescue" in line][:5]
    assert scalar(direct_database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
                                       " AND crashes > 0", (ids,)) == 0
    clean("run", text)
