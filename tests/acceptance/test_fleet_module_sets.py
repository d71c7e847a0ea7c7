"""A fleet whose processes load different modules: ``actors`` (with the test actors) beside
``reports``, and a rolling deploy that adds a topic. Every event is relayed by a process
that routes it; none is failed for what another process does not understand; none is lost."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

import psycopg

from broker import emit
from broker.engine import sql
from tests.support.db import query, scalar, wait_for
from tests.support.procs import ROOT, running, worker_cmd

PING, REPORT = "test.ping", "report.requested"
REPORTS_MODULE = "tests.support.reports"

LIVE_RELAY_OF = """
SELECT id::text, topics FROM standmeet.relays
WHERE pid = %s AND stopped_at IS NULL AND heartbeat_at > now() - interval '3 seconds'
"""
#: Per event: relayed, its error, and whether the relay that took it routes its topic.
RELAYED_BY_A_ROUTER = """
SELECT o.id, o.topic, o.relayed_at IS NOT NULL, o.error, o.relayed_by::text,
       coalesce(o.topic = ANY(r.topics), false)
FROM standmeet.outbox o LEFT JOIN standmeet.relays r ON r.id = o.relayed_by
WHERE o.id = ANY(%s)
"""
#: Per label of a prefix: how many runs, in which process.
RUNS = "SELECT label, count(*), min(pid), max(pid) FROM test_runs WHERE label LIKE %s GROUP BY label"


def _reports_event(conn: psycopg.Connection[Any], label: str) -> int:
    """What the reports application's ``emit`` writes (this test process does not load it)."""
    row = conn.execute(sql.EMIT, {"topic": REPORT, "payload": json.dumps({"label": label}),
                                  "routes": '["reports.record"]'}).fetchone()
    assert row is not None
    return int(row[0])


def _live_relay(url: str, pid: int) -> tuple[str, list[str]]:
    row = wait_for(lambda: query(url, LIVE_RELAY_OF, (pid,)), timeout_s=30, what=f"the relay of pid {pid}")[0]
    return row[0], list(row[1])


def _runs(url: str, prefix: str) -> dict[str, tuple[int, int, int]]:
    return {label: (n, lo, hi) for label, n, lo, hi in query(url, RUNS, (prefix + "%",))}


def _all_ran(url: str, prefix: str, n: int) -> bool:
    return scalar(url, "SELECT count(DISTINCT label) FROM test_runs WHERE label LIKE %s", (prefix + "%",)) == n


def _status(env: dict[str, str]) -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "broker.cli", "status", "--json"], env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_1000_events_of_two_module_sets_are_each_relayed_by_a_process_that_routes_them(
        broker, database_url, subprocess_env, tmp_path):
    # Given a process of the actors' modules (serving index) beside one of the reports module
    actors_cmd = worker_cmd("--queues", "index")
    reports_cmd = [sys.executable, "-m", "broker.worker", REPORTS_MODULE]
    with running(actors_cmd, subprocess_env, log=tmp_path / "actors.log") as actors, \
            running(reports_cmd, subprocess_env, log=tmp_path / "reports.log") as reports:
        actors_relay, actors_topics = _live_relay(database_url, actors.pid)
        reports_relay, reports_topics = _live_relay(database_url, reports.pid)
        assert PING in actors_topics and REPORT not in actors_topics
        assert reports_topics == [REPORT]
        # When 1,000 events of both modules' topics are emitted, interleaved, in a few transactions
        events: dict[int, str] = {}
        with psycopg.connect(database_url) as conn:
            for batch in range(4):
                with conn.transaction():
                    for i in range(batch * 125, (batch + 1) * 125):
                        events[emit(conn, PING, {"label": f"fleet-ping-{i}"})] = PING
                        events[_reports_event(conn, f"fleet-report-{i}")] = REPORT
        # Then every job runs, once, in the process that has its actor
        wait_for(lambda: _all_ran(database_url, "fleet-ping-", 500) and _all_ran(database_url, "fleet-report-", 500),
                 timeout_s=120, what="the 1,000 events' jobs")
        doc = _status(subprocess_env)
        for proc in (actors, reports):
            proc.send_signal(signal.SIGTERM)
        assert actors.wait(timeout=30) == 0, (tmp_path / "actors.log").read_text()[-3000:]
        assert reports.wait(timeout=30) == 0, (tmp_path / "reports.log").read_text()[-3000:]
    rows = query(database_url, RELAYED_BY_A_ROUTER, (list(events),))
    assert len(rows) == 1000
    # 0 failed, 0 left behind, each relayed by a relay that routes its topic
    assert [r for r in rows if r[3] is not None] == []
    assert [r for r in rows if not r[2]] == []
    assert [r for r in rows if not r[5]] == []
    assert {r[4] for r in rows if r[1] == PING} == {actors_relay}
    assert {r[4] for r in rows if r[1] == REPORT} == {reports_relay}
    pings, reported = _runs(database_url, "fleet-ping-"), _runs(database_url, "fleet-report-")
    assert len(pings) == 500 and {v for v in pings.values()} == {(1, actors.pid, actors.pid)}
    assert len(reported) == 500 and {v for v in reported.values()} == {(1, reports.pid, reports.pid)}
    # status saw nothing unrouted nor failed, and each relay recorded itself stopped
    assert doc["outbox"]["unrouted"] == [] and doc["outbox"]["failed"] == 0
    assert set(doc["outbox"]["routed_topics"]) >= {PING, REPORT}
    assert scalar(database_url, "SELECT count(*) FROM standmeet.relays WHERE id = ANY(%s::uuid[])"
                                " AND stopped_at IS NOT NULL", ([actors_relay, reports_relay],)) == 2


def test_a_rolling_deploy_that_adds_a_topic_loses_nothing(broker, database_url, subprocess_env, tmp_path):
    # Given an old release running: it does not know the reports topic yet
    old_cmd = worker_cmd("--queues", "index")
    new_cmd = [sys.executable, "-m", "broker.worker", "tests.support.jobs", REPORTS_MODULE,
               "--queues", "index", "reports"]
    with running(old_cmd, subprocess_env, log=tmp_path / "old.log") as old:
        old_relay, old_topics = _live_relay(database_url, old.pid)
        assert REPORT not in old_topics
        # When the new release's web tier already emits the new topic, before any new worker runs
        with psycopg.connect(database_url) as conn:
            with conn.transaction():
                early = [_reports_event(conn, f"deploy-early-{i}") for i in range(200)]
            with conn.transaction():  # after them: once it ran, the old relay has passed over them
                emit(conn, PING, {"label": "deploy-marker"})
        wait_for(lambda: _all_ran(database_url, "deploy-marker", 1), timeout_s=30, what="the marker's job")
        # Then the old process left them pending, untouched; status says no live process routes them
        assert query(database_url, "SELECT count(*) FROM standmeet.outbox WHERE id = ANY(%s) AND relayed_at IS NULL"
                                   " AND error IS NULL", (early,)) == [(200,)]
        (unrouted,) = _status(subprocess_env)["outbox"]["unrouted"]
        assert (unrouted["topic"], unrouted["events"]) == (REPORT, 200)
        # When the new release starts beside the old one, and both topics keep coming
        with running(new_cmd, subprocess_env, log=tmp_path / "new.log") as new:
            new_relay, new_topics = _live_relay(database_url, new.pid)
            assert {PING, REPORT} <= set(new_topics)
            late: list[int] = []
            with psycopg.connect(database_url) as conn:
                for i in range(100):
                    with conn.transaction():
                        late += [emit(conn, PING, {"label": f"deploy-ping-{i}"}),
                                 _reports_event(conn, f"deploy-late-{i}")]
            wait_for(lambda: _all_ran(database_url, "deploy-early-", 200)
                     and _all_ran(database_url, "deploy-late-", 100) and _all_ran(database_url, "deploy-ping-", 100),
                     timeout_s=120, what="every job of the deploy")
            # and the old release is stopped last
            old.send_signal(signal.SIGTERM)
            assert old.wait(timeout=30) == 0, (tmp_path / "old.log").read_text()[-3000:]
            new.send_signal(signal.SIGTERM)
            assert new.wait(timeout=30) == 0, (tmp_path / "new.log").read_text()[-3000:]
    # Then nothing was failed or lost, each relayed by a relay that routes it, each job ran once
    rows = query(database_url, RELAYED_BY_A_ROUTER, (early + late,))
    assert len(rows) == 400
    assert [r for r in rows if r[3] is not None or not r[2] or not r[5]] == []
    assert {r[4] for r in rows if r[1] == REPORT} == {new_relay}
    assert {r[4] for r in rows if r[1] == PING} <= {old_relay, new_relay}
    for prefix, n in (("deploy-early-", 200), ("deploy-late-", 100), ("deploy-ping-", 100)):
        runs = _runs(database_url, prefix)
        assert len(runs) == n and {count for count, _, _ in runs.values()} == {1}, prefix
    assert {lo for _, lo, _ in _runs(database_url, "deploy-early-").values()} == {new.pid}
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE error IS NOT NULL") == 0
