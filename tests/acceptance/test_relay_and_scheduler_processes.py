"""With real processes: three relays, two schedulers, no leader."""

from __future__ import annotations

import signal
import subprocess
import sys

import psycopg

from broker import emit
from tests.support.db import query, scalar, wait_for
from tests.support.procs import ROOT, running


def test_2000_events_drained_by_three_relays_become_their_messages_exactly_once(broker, database_url, subprocess_env):
    # Given an import of 2,000 documents, emitted in one transaction
    with psycopg.connect(database_url) as conn, conn.transaction():
        for i in range(1, 2001):
            emit(conn, "document.written", {"document_id": 10_000 + i})
    # When three relay processes drain the outbox in parallel
    cmd = [sys.executable, "-m", "broker.relay", "--exit-when-idle"]
    procs = [subprocess.Popen(cmd, env=subprocess_env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for _ in range(3)]
    outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    # Then every event was relayed, each became exactly one message
    assert scalar(database_url, "SELECT count(*) FROM standmeet.outbox WHERE relayed_at IS NULL") == 0
    counts = query(database_url,
                   "SELECT count(*), count(DISTINCT message->'args'->>0) FROM dramatiq.queue"
                   " WHERE message->>'actor_name' = 'corpus.index' AND (message->'args'->>0)::int > 10000")
    assert counts == [(2000, 2000)]
    # And no relay transaction claimed more than 200 rows (recorded on the rows themselves)
    per_tx = [r[0] for r in query(database_url,
              "SELECT count(*) FROM standmeet.outbox WHERE relay_txid IS NOT NULL GROUP BY relay_txid")]
    assert max(per_tx) <= 200
    assert sum(per_tx) >= 2000 and len(per_tx) >= 10
    # (each process first logs the database it uses; the count is its own line)
    relayed = sorted(int(line.split()[1]) for o in outputs for line in o.splitlines() if line.startswith("relayed"))
    assert sum(relayed) >= 2000, outputs


def test_two_schedulers_side_by_side_enqueue_each_period_once(broker, database_url, subprocess_env, tmp_path):
    cmd = [sys.executable, "-m", "periodic", "--jobs", "tests.support.periodic_jobs:JOBS"]
    with running(cmd, subprocess_env, log=tmp_path / "a.log") as a, running(cmd, subprocess_env, log=tmp_path / "b.log") as b:
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs WHERE job = 'test-every-second'") >= 5,
                 timeout_s=30, what="five periods")
        for proc in (a, b):
            proc.send_signal(signal.SIGTERM)
        assert a.wait(timeout=20) == 0, (tmp_path / "a.log").read_text()
        assert b.wait(timeout=20) == 0, (tmp_path / "b.log").read_text()
    periods = scalar(database_url, "SELECT count(*) FROM standmeet.periodic_runs WHERE job = 'test-every-second'")
    messages = query(database_url,
                     "SELECT r.period_start, count(q.message_id) FROM standmeet.periodic_runs r"
                     " LEFT JOIN dramatiq.queue q ON q.message_id = r.message_id"
                     " WHERE r.job = 'test-every-second' GROUP BY r.period_start")
    assert len(messages) == periods >= 5
    assert all(n == 1 for _, n in messages)
    total = scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message->>'actor_name' = 'test.tick'")
    assert total == periods
    assert scalar(database_url, "SELECT count(DISTINCT queue_name) FROM dramatiq.queue WHERE message->>'actor_name' = 'test.tick'") == 1
