"""A failover under a draining fleet: the primary dies, the standby is promoted.

A primary and a streaming standby (``tests/support/standby.py``: the embedded wheel's
``initdb`` and ``pg_basebackup -R``), a multi-host URL
(``host=127.0.0.1,127.0.0.1 port=P1,P2 target_session_attrs=read-write``), two worker
processes draining 3,000 jobs while the test keeps enqueueing one job every 20 ms. Mid-drain
the primary is stopped ``-m immediate``; the standby is promoted only after a whole rescue
window (as a failover manager waits before it promotes), so that every heartbeat the new
primary holds is older than the window; a third worker starts right after the promotion.

What must hold: every process is back by itself within 10 s of the promotion; every
enqueue that returned, and was replicated, is done once the drain ends (with synchronous
replication that is every enqueue that returned); nothing stays ``consumed``; a job runs
twice only if it was in flight when the primary died, and those are counted and printed;
nobody rescues a live worker's claims (the third process, which had no outage of its own,
least of all).

Runs are counted in a file per worker process (``STANDMEET_TEST_RUNS_DIR``), not in the
database: a row written to the old primary after the last replicated point may be lost
with it in asynchronous mode. What the old primary held when it died is read from it
afterwards, started alone on another port once every worker has stopped.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import datetime
from pathlib import Path
from typing import Any

import dramatiq
import psycopg
import pytest

import tests.support.jobs  # noqa: F401  (configures the broker, declares the test actors)
from tests.support.jobs import cooperative_sleep

pytestmark = pytest.mark.slow

RUN_MS = 10


@dramatiq.actor(actor_name="failover.run", queue_name="index", max_retries=50, min_backoff=10, max_backoff=100)
def failover_run(n: int) -> None:
    """A short job that records each run that returned in its process's file."""
    from dramatiq.middleware import CurrentMessage

    cooperative_sleep(RUN_MS / 1000)
    message = CurrentMessage.get_current_message()
    folder = Path(os.environ["STANDMEET_TEST_RUNS_DIR"])
    with open(folder / f"runs-{os.getpid()}.txt", "a") as runs:
        runs.write(f"{message.message_id if message else '-'} {time.time():.3f}\n")


# -- the test ---------------------------------------------------------------------------

from broker.engine import sql_enqueue  # noqa: E402
from broker.engine.codec import enqueue_params  # noqa: E402
from broker.pg.migrate import migrate  # noqa: E402
from tests.conftest import TEST_OVERRIDES  # noqa: E402
from tests.support.db import wait_for  # noqa: E402
from tests.support.procs import running  # noqa: E402
from tests.support.standby import Pair, primary_and_standby  # noqa: E402

JOBS = 3000
DATABASE = "smt_failover"
TRICKLE_S = 0.02
#: Longer than a rescue window: when the standby is promoted, every heartbeat it holds is stale.
RESCUE_WINDOW_S = TEST_OVERRIDES["rescue_after_s"] + TEST_OVERRIDES["heartbeat_s"]
RECONNECT_BUDGET_S = 10.0
DRAIN_BUDGET_S = 240.0
STATES = "SELECT state::text, count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) GROUP BY 1"
IDS_IN = "SELECT message_id::text FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state::text = ANY(%s)"
WORKER_CMD = [sys.executable, "-m", "broker.worker", "tests.acceptance.test_failover", "--queues", "index"]


class Producer:
    """Enqueues one job every 20 ms through the multi-host URL, on one connection it
    remakes after a failure; records each enqueue that returned, where and at which WAL
    position (read after its commit, so at or past its commit record)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.returned: list[tuple[str, int, str]] = []  # (message id, port, lsn after commit)
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="failover-producer", daemon=True)
        self._n = JOBS

    def __enter__(self) -> Producer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        while not self._stop.wait(TRICKLE_S):
            message = failover_run.message(self._n)
            self._n += 1
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(self.url, autocommit=True, connect_timeout=2)
                with conn.transaction():
                    conn.execute(sql_enqueue.ENQUEUE, enqueue_params([message]))
                row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
                assert row is not None
                self.returned.append((message.message_id, int(conn.info.port), str(row[0])))
            except psycopg.Error:
                self.failed += 1
                if conn is not None:
                    conn.close()
                conn = None
        if conn is not None:
            conn.close()


def states(url: str, ids: list[str]) -> dict[str, int]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return dict(conn.execute(STATES, (ids,)).fetchall())  # type: ignore[arg-type]


def ids_in(url: str, ids: list[str], *wanted: str) -> set[str]:
    with psycopg.connect(url, autocommit=True, connect_timeout=5) as conn:
        return {row[0] for row in conn.execute(IDS_IN, (ids, list(wanted)))}


def read_runs(folder: Path) -> list[tuple[str, float]]:
    runs = []
    for path in folder.glob("runs-*.txt"):
        for line in path.read_text().splitlines():
            message_id, at = line.split()
            runs.append((message_id, float(at)))
    return runs


def log_events(path: Path) -> list[tuple[float, str, str]]:
    """(time, level, message) of each JSON line of a process's log."""
    events = []
    for line in path.read_text().splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and "ts" in doc:
            at = datetime.fromisoformat(doc["ts"]).timestamp()
            events.append((at, str(doc.get("level")), str(doc.get("message", "")) + str(doc.get("exception", ""))))
    return events


def stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{proc.args} did not stop within 60 s: {log.read_text()[-3000:]}") from None
    assert code == 0, f"{proc.args} exited with {code}: {log.read_text()[-3000:]}"


@pytest.fixture(params=["async", "sync"])
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    with primary_and_standby(synchronous=request.param == "sync") as started:
        yield started


def test_a_failover_mid_drain_loses_no_replicated_job_reruns_only_what_was_in_flight_and_rescues_no_live_worker(
    pair, subprocess_env, tmp_path
):
    mode = "sync" if pair.synchronous else "async"
    # Given a migrated database on the primary, streamed to the standby
    pair.primary.query(f"CREATE DATABASE {DATABASE}")
    migrate(pair.primary.url(DATABASE))
    url = pair.multi_host_url(DATABASE)
    primary_url, standby_url = pair.primary.url(DATABASE), pair.standby.url(DATABASE)
    # And 3,000 jobs enqueued on it and replicated
    bulk = [failover_run.message(n) for n in range(JOBS)]
    with psycopg.connect(primary_url, autocommit=True) as conn:
        conn.execute(sql_enqueue.ENQUEUE, enqueue_params(bulk))
    pair.wait_replayed()
    bulk_ids = [m.message_id for m in bulk]
    runs_dir = tmp_path / "runs"
    runs_dir.mkdir()
    env = {**subprocess_env, "DATABASE_URL": url, "STANDMEET_TEST_RUNS_DIR": str(runs_dir),
           "STANDMEET_LOG_FORMAT": "json"}
    env.pop("STANDMEET_LISTEN_DATABASE_URL", None)
    logs = {name: tmp_path / f"{name}.log" for name in ("a", "b", "c")}
    with ExitStack() as stack:
        # And two worker processes on the multi-host URL draining them, while more are enqueued
        procs = {name: stack.enter_context(running(WORKER_CMD, env, log=logs[name])) for name in ("a", "b")}
        producer = stack.enter_context(Producer(url))
        wait_for(lambda: states(primary_url, bulk_ids).get("done", 0) >= JOBS // 3, timeout_s=120, interval_s=0.05,
                 what=f"a third of the drain: {logs['a'].read_text()[-2000:]}")
        # When the primary dies (no checkpoint, no goodbye)
        stopped_at = time.time()
        pair.primary.stop("immediate")
        received = pair.standby.scalar("SELECT greatest(pg_last_wal_receive_lsn(), pg_last_wal_replay_lsn())::text")
        # (what the standby holds when it is promoted, read while it is still read-only)
        standby_done = ids_in(standby_url, bulk_ids, "done")
        standby_consumed = ids_in(standby_url, bulk_ids, "consumed")
        # And the standby is promoted a rescue window later, while the two workers are
        # slow to come back (paused), and a process that had no outage of its own judges
        # the fleet at once: a fresh broker's rescue, then a third worker
        time.sleep(max(0.0, stopped_at + RESCUE_WINDOW_S + 0.5 - time.time()))  # the failover manager's wait
        paused = [procs["a"].pid, procs["b"].pid]
        stack.callback(_resume, paused)
        for pid in paused:
            os.kill(pid, signal.SIGSTOP)
        pair.standby.promote()
        promoted_at = time.time()
        rescued = _rescue_right_after_the_promotion(url, promoted_at)
        _resume(paused)
        procs["c"] = stack.enter_context(running(WORKER_CMD, env, log=logs["c"]))
        # Then the two workers are back by themselves within 10 s of the promotion
        for name in ("a", "b"):
            wait_for(lambda n=name: any(at >= stopped_at and "reachable again" in text
                                        for at, _, text in log_events(logs[n])),
                     timeout_s=RECONNECT_BUDGET_S + 5, interval_s=0.05,
                     what=f"worker {name} to say the database is back: {logs[name].read_text()[-2000:]}")
        back_after = {name: min(at for at, _, text in log_events(logs[name])
                                if at >= stopped_at and "reachable again" in text) - promoted_at
                      for name in ("a", "b")}
        # And the drain completes: every enqueue that returned and was replicated is done
        producer.__exit__(None, None, None)
        trickled = producer.returned
        replicated = [mid for mid, port, lsn in trickled
                      if port == pair.standby.port or _lsn(lsn) <= _lsn(received)]
        expected = bulk_ids + replicated
        try:
            wait_for(lambda: states(standby_url, expected).get("done", 0) == len(expected),
                     timeout_s=DRAIN_BUDGET_S, interval_s=0.5, what=f"the {len(expected)} jobs to be done")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {states(standby_url, expected)}; "
                                 f"{[log_events(p)[-5:] for p in logs.values()]}") from None
        for name in ("a", "b", "c"):
            stop(procs[name], logs[name])
    # (what the old primary held when it died: started alone, where no worker looks)
    pair.primary.start(port=_free_port())
    old_done = ids_in(pair.primary.url(DATABASE), bulk_ids, "done")
    old_consumed = ids_in(pair.primary.url(DATABASE), bulk_ids, "consumed")
    trickled_ids = [mid for mid, _, _ in trickled]
    on_new = ids_in(standby_url, trickled_ids, "queued", "consumed", "done", "rejected")
    lost = [(mid, port, lsn) for mid, port, lsn in trickled if mid not in on_new]
    runs = read_runs(runs_dir)
    per_message = Counter(mid for mid, _ in runs)
    twice = {mid: n for mid, n in per_message.items() if n > 1}
    first_run = {}
    for mid, at in sorted(runs, key=lambda r: r[1]):
        first_run.setdefault(mid, at)
    in_flight = old_consumed | standby_consumed | (old_done - standby_done)
    texts = {name: log.read_text() for name, log in logs.items()}
    print(f"failover ({mode}): primary stopped with {len(old_done)} of {JOBS} bulk jobs done ({len(standby_done)} "
          f"on the standby: {len(old_done - standby_done)} settle(s) lost with it), {len(old_consumed)} claimed; promoted {promoted_at - stopped_at:.1f} s later; back "
          f"{', '.join(f'{n} {s:.1f} s' for n, s in back_after.items())} after the promotion; "
          f"{len(trickled)} trickled enqueues returned ({producer.failed} failed), {len(lost)} lost with the "
          f"primary; {len(twice)} job(s) ran twice ({sum(twice.values()) - len(twice)} extra run(s)); "
          f"in flight at the failover: {len(in_flight)}")
    # Then every process was back within 10 s of the promotion
    assert all(s <= RECONNECT_BUDGET_S for s in back_after.values()), back_after
    # And nothing stays consumed; every replicated enqueue is done
    assert states(standby_url, bulk_ids + trickled_ids).get("consumed", 0) == 0
    # And only an enqueue the standby never received can be lost: none with synchronous replication
    assert all(port == pair.primary.port and _lsn(lsn) > _lsn(received) for _, port, lsn in lost), lost
    if pair.synchronous:
        assert lost == [], lost
    # And a job ran twice only if it was in flight when the primary died
    after_failover = {mid: n for mid, n in twice.items() if first_run[mid] > promoted_at}
    assert after_failover == {}, f"{len(after_failover)} job(s) first run after the promotion ran twice"
    assert set(twice) <= in_flight | {mid for mid, at in first_run.items() if at >= stopped_at - 1.0}, (
        sorted(set(twice) - in_flight)[:10])
    # And nobody rescued a live worker's claims: not the fresh process right after the
    # promotion (the server's identity changed a moment ago), not any worker after
    assert rescued == [], f"rescued right after the promotion (queue: requeued, rejected): {rescued}"
    for name, text in texts.items():
        rescues = [line for line in text.splitlines() if "crash rescue" in line]
        assert rescues == [], (name, rescues[:3])
    with psycopg.connect(standby_url, autocommit=True) as conn:
        blamed = conn.execute("SELECT count(*) FROM dramatiq.queue WHERE crashes > 0").fetchone()
    assert blamed == (0,)


#: How long the fresh process keeps judging after the promotion (well inside the rescue
#: window that the promotion opens).
JUDGE_S = 1.0


def _rescue_right_after_the_promotion(url: str, promoted_at: float) -> list[dict[str, tuple[int, int]]]:
    """A broker that had no outage of its own, made right after the promotion, runs
    rescue for a second: what it requeued or rejected (nothing, if it knows better)."""
    from tests.conftest import configured_broker

    rescued = []
    with configured_broker(url) as fresh:
        while time.time() < promoted_at + JUDGE_S:
            try:
                result = fresh.rescue_once()  # type: ignore[attr-defined]
            except psycopg.Error:
                continue  # the new primary not answering yet is not a judgement
            if result:
                rescued.append(result)
            time.sleep(0.1)
    return rescued


def _resume(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _lsn(text: str) -> int:
    high, low = text.split("/")
    return (int(high, 16) << 32) + int(low, 16)


def _free_port() -> int:
    from tests.support.pgbouncer import free_port

    return free_port()
