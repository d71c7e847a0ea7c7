"""`standmeet-jobs migrate` adopts a database that dramatiq-pg 0.12 created and used, in place."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from tests.support import db as testdb
from tests.support.db import scalar, wait_for
from tests.support.jobs import mark
from tests.support.procs import ROOT, running, worker_cmd

pytestmark = pytest.mark.slow

#: dramatiq-pg 0.12's schema, as its documentation gives it (schema "dramatiq").
DRAMATIQ_PG_SCHEMA = """
CREATE SCHEMA dramatiq;
CREATE TYPE dramatiq.state AS ENUM ('queued', 'consumed', 'rejected', 'done');
CREATE TABLE dramatiq.queue (
    message_id uuid PRIMARY KEY,
    queue_name text NOT NULL DEFAULT 'default',
    "state" dramatiq.state,
    mtime timestamptz DEFAULT (now() AT TIME ZONE 'UTC'),
    message jsonb,
    "result" jsonb,
    result_ttl timestamptz
);
CREATE INDEX ON dramatiq.queue ("state", mtime);
"""
#: What dramatiq-pg writes: the message as Dramatiq encodes it, on its queue (a delayed
#: one on "<queue>.DQ" with an "eta" option in epoch milliseconds).
ROW = "INSERT INTO dramatiq.queue (queue_name, message_id, state, message) VALUES (%s, %s, %s, %s)"


def _as_dramatiq_pg_wrote_it(message, *, queue: str, eta_ms: int | None = None) -> str:
    data = json.loads(message.encode())
    data["queue_name"] = queue
    if eta_ms is not None:
        data["options"]["eta"] = eta_ms
    return json.dumps(data)


def test_a_dramatiq_pg_database_is_adopted_and_every_message_runs(admin_url, subprocess_env, broker, tmp_path):
    # Given a database as dramatiq-pg 0.12 leaves it: a queued message, a delayed one due
    # in 3 s, one left consumed by a worker that died, and one already done
    name = testdb.unique_name("smt_dpg")
    testdb.drop_database(admin_url, name)
    testdb.query(admin_url, f'CREATE DATABASE "{name}"')
    url = testdb.with_dbname(admin_url, name)
    queued, delayed, orphan, finished = (mark.message(label) for label in ("dpg-queued", "dpg-delayed",
                                                                           "dpg-orphan", "dpg-done"))
    due_ms = int((time.time() + 3) * 1000)
    try:
        testdb.query(url, DRAMATIQ_PG_SCHEMA + testdb.TEST_SCHEMA)
        testdb.query(url, ROW, ("index", queued.message_id, "queued", _as_dramatiq_pg_wrote_it(queued, queue="index")))
        testdb.query(url, ROW, ("index.DQ", delayed.message_id, "queued",
                                _as_dramatiq_pg_wrote_it(delayed, queue="index.DQ", eta_ms=due_ms)))
        testdb.query(url, ROW, ("index", orphan.message_id, "consumed", _as_dramatiq_pg_wrote_it(orphan, queue="index")))
        testdb.query(url, ROW, ("index", finished.message_id, "done", _as_dramatiq_pg_wrote_it(finished, queue="index")))
        env = {**subprocess_env, "DATABASE_URL": url}
        # When `standmeet-jobs migrate` runs on it, then a worker
        migrated = subprocess.run([sys.executable, "-m", "broker.cli", "migrate"], env=env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=60)
        assert migrated.returncode == 0, migrated.stderr
        assert scalar(url, "SELECT count(*) FROM dramatiq.queue WHERE queue_name LIKE '%%.DQ'") == 0
        with running(worker_cmd("--queues", "index"), env, log=tmp_path / "worker.log"):
            # Then the queued and the orphaned messages run, the delayed one when it is due,
            # on its canonical queue, and the finished one is left alone
            wait_for(lambda: scalar(url, "SELECT count(*) FROM test_runs WHERE label LIKE 'dpg-%%'") == 3,
                     timeout_s=30, what="the three pending dramatiq-pg messages to run")
            wait_for(lambda: scalar(url, "SELECT count(*) FROM dramatiq.queue WHERE state <> 'done'") == 0,
                     timeout_s=30, what="their outcomes to be written")
        labels = {row[0]: row[1] for row in testdb.query(
            url, "SELECT label, extract(epoch FROM started_at) * 1000 FROM test_runs WHERE label LIKE 'dpg-%%'")}
        assert set(labels) == {"dpg-queued", "dpg-delayed", "dpg-orphan"}
        assert labels["dpg-delayed"] >= due_ms - 50  # not before its eta (clock rounding aside)
        states = dict(testdb.query(url, "SELECT message_id::text, state::text || ' ' || queue_name || ' ' || crashes"
                                        " FROM dramatiq.queue"))
        assert states == {m.message_id: "done index 0" for m in (queued, delayed, orphan, finished)}
        assert uuid.UUID(delayed.message_id)
    finally:
        testdb.drop_database(admin_url, name)
