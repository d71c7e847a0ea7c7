"""The outbox relay and the scheduler as real processes: three relays, two schedulers, no leader."""

from __future__ import annotations

import signal
import subprocess
import sys
import uuid

import psycopg

from broker import emit
from broker.outbox import MESSAGE_NAMESPACE
from tests.support.db import query, scalar, wait_for
from tests.support.procs import ROOT, running

#: Every relay mark (an outbox row set relayed by a transaction) and every write of a
#: queue row, recorded as it happens: a row relayed or enqueued twice leaves two records,
#: even when the second write overwrote the first.
RECORD_WRITES = """
CREATE TABLE test_relay_marks (event_id bigint NOT NULL, txid bigint NOT NULL);
CREATE TABLE test_message_writes (message_id uuid NOT NULL, op text NOT NULL);
CREATE FUNCTION test_record_relay_mark() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_relay_marks VALUES (NEW.id, NEW.relay_txid);
    RETURN NULL;
END $$;
CREATE FUNCTION test_record_message_write() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO test_message_writes VALUES (NEW.message_id, TG_OP);
    RETURN NULL;
END $$;
CREATE TRIGGER test_relay_marks AFTER UPDATE OF relay_txid ON standmeet.outbox
    FOR EACH ROW WHEN (NEW.relay_txid IS NOT NULL) EXECUTE FUNCTION test_record_relay_mark();
CREATE TRIGGER test_message_writes AFTER INSERT OR UPDATE OF message ON dramatiq.queue
    FOR EACH ROW EXECUTE FUNCTION test_record_message_write();
"""
FORGET_WRITES = """
DROP TRIGGER test_relay_marks ON standmeet.outbox;
DROP TRIGGER test_message_writes ON dramatiq.queue;
DROP FUNCTION test_record_relay_mark();
DROP FUNCTION test_record_message_write();
DROP TABLE test_relay_marks;
DROP TABLE test_message_writes;
"""
#: Holds every relay at its first claim until all three are there.
GATE = "LOCK TABLE standmeet.outbox IN ACCESS EXCLUSIVE MODE"
RELAYS_AT_GATE = """
SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND application_name = 'standmeet-relay' AND wait_event_type = 'Lock'
"""
#: Per event: how many transactions marked it relayed, in which, and the count it recorded.
MARKS_PER_EVENT = """
SELECT o.id, o.messages, count(m.event_id), min(m.txid), max(m.txid), o.relay_txid
FROM standmeet.outbox o LEFT JOIN test_relay_marks m ON m.event_id = o.id
WHERE o.id = ANY(%s)
GROUP BY o.id
"""
WRITES_PER_MESSAGE = """
SELECT q.message_id::text, (q.message->'args'->>0)::int, count(w.message_id)
FROM dramatiq.queue q LEFT JOIN test_message_writes w ON w.message_id = q.message_id
WHERE q.message_id = ANY(%s::uuid[])
GROUP BY q.message_id
"""


def test_2000_events_drained_by_three_relays_are_each_relayed_exactly_once(broker, database_url, subprocess_env):
    # Given an import of 2,000 documents, emitted in one transaction, and every relay
    # mark and queue write recorded as it happens
    query(database_url, RECORD_WRITES)
    try:
        with psycopg.connect(database_url) as conn, conn.transaction():
            events = {emit(conn, "document.written", {"document_id": 10_000 + i}): 10_000 + i
                      for i in range(1, 2001)}
        # When three relay processes drain the outbox, all three starting at once (each
        # waits at a gate on the outbox until the other two are there)
        cmd = [sys.executable, "-m", "broker.relay", "--exit-when-idle"]
        with psycopg.connect(database_url) as gate:
            gate.execute(GATE)
            # passes of 200 rows: many transactions for three relays to interleave
            env = {**subprocess_env, "STANDMEET_RELAY_BATCH": "200"}
            procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT) for _ in range(3)]
            wait_for(lambda: scalar(database_url, RELAYS_AT_GATE) == 3, timeout_s=60,
                     what="the three relays to reach the gate")
            gate.rollback()
        outputs = [p.communicate(timeout=120)[0].decode() for p in procs]
        assert [p.returncode for p in procs] == [0, 0, 0], outputs
        # Then each event was marked relayed by exactly one transaction, which recorded one message
        marks = query(database_url, MARKS_PER_EVENT, (list(events),))
        assert len(marks) == 2000
        twice = [row for row in marks if row[2] != 1 or row[3] != row[5]]
        assert twice == [], twice[:10]
        assert {row[1] for row in marks} == {1}
        # And each event's one message (its id derived from the event's id and route) was
        # written once, carrying that event's document
        expected = {str(uuid.uuid5(MESSAGE_NAMESPACE, f"{event_id}/0")): doc for event_id, doc in events.items()}
        writes = query(database_url, WRITES_PER_MESSAGE, (list(expected),))
        assert len(writes) == 2000
        assert {message_id: doc for message_id, doc, _ in writes} == expected
        rewritten = [row for row in writes if row[2] != 1]
        assert rewritten == [], rewritten[:10]
        # And the relays' own reports add up to exactly the 2,000 events
        relayed = [int(o.split()[1]) for out in outputs for o in out.splitlines() if o.startswith("relayed ")]
        assert len(relayed) == 3 and sum(relayed) == 2000, outputs
        # And no relay transaction claimed more than 200 rows
        per_tx = [r[0] for r in query(database_url, "SELECT count(*) FROM test_relay_marks GROUP BY txid")]
        assert max(per_tx) <= 200 and len(per_tx) >= 10
        print(f"three relays: {relayed} events, {len(per_tx)} transactions")
    finally:
        query(database_url, FORGET_WRITES)


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


def test_a_scheduler_refuses_a_periodic_job_for_an_actor_no_module_declares(broker, subprocess_env, tmp_path):
    cmd = [sys.executable, "-m", "periodic", "--jobs", "tests.support.periodic_jobs:GHOST"]
    done = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    # Then it refuses to start, in one line naming the job and its actor (not a traceback at every tick)
    assert done.returncode == 78, done.stderr
    assert "Traceback" not in done.stderr
    assert "test-ghost (test.no_such_actor)" in done.stderr.strip().splitlines()[-1], done.stderr


def test_a_scheduler_refuses_a_table_that_names_a_job_twice(broker, subprocess_env, tmp_path):
    cmd = [sys.executable, "-m", "periodic", "--jobs", "tests.support.periodic_jobs:TWICE"]
    done = subprocess.run(cmd, env=subprocess_env, cwd=ROOT, capture_output=True, text=True, timeout=60)
    # Then it refuses to start, in one line naming the job
    assert done.returncode == 78, done.stderr
    assert "periodic job name(s) given more than once: test-twice" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
