"""STANDMEET_MESSAGE_MAX_BYTES: a larger message is refused at send, at ``enqueue``, at
``enqueue_many`` and by the relay; a larger row already in the table is rejected by the
claim without being loaded, so a worker's memory and log stay bounded."""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest

from broker.engine.enqueue import enqueue as enqueue_in
from broker.errors import MessageTooLarge
from broker.outbox import emit, relay_once, route
from broker.settings import MIB
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import noop
from tests.support.procs import running, worker_cmd

TOO_LARGE = "x" * (MIB + 1)
SIZE_WORDS = r"the message to 'test.noop' is 10487\d\d bytes encoded, over the limit of 1048576 .STANDMEET_MESSAGE_MAX_BYTES"
#: The rows a worker meets: 20 of 20 MB each, inserted by SQL (half compressible, half not).
BIG_ROWS, BIG_ROW_BYTES = 20, 20_000_000
#: The worker's peak resident memory meeting them (measured: 76 MB; it loaded them all, 2.0 GB).
MAX_RSS_BYTES = 200 * MIB
#: Its whole log meanwhile (measured: 5 KB; each message was written out, 2.4 GB).
MAX_LOG_BYTES = 64 * 1024
INFLATING_TOPIC = "test.size.inflating"

route(INFLATING_TOPIC, "test.noop", lambda event_id, payload: ((payload["fill"] * (MIB // 4),), {}))

INSERT_BIG_ROWS = """
INSERT INTO dramatiq.queue (queue_name, message_id, "state", message, eta)
SELECT 'index', id, 'queued',
       jsonb_build_object('queue_name', 'index', 'actor_name', 'test.noop', 'kwargs', '{}'::jsonb,
                          'options', '{}'::jsonb, 'message_id', id::text, 'message_timestamp', 0,
                          'args', jsonb_build_array(CASE WHEN n %% 2 = 0 THEN repeat('x', %(bytes)s)
                                                         ELSE (SELECT string_agg(md5((n * 1000000 + i)::text), '')
                                                               FROM generate_series(1, %(bytes)s / 32) AS i) END)),
       now()
FROM (SELECT gen_random_uuid() AS id, n FROM generate_series(1, %(rows)s) AS n) AS big
RETURNING message_id::text
"""


def test_a_message_over_the_limit_is_refused_at_send_enqueue_and_enqueue_many(broker, database_url):
    before = scalar(database_url, "SELECT count(*) FROM dramatiq.queue")
    with pytest.raises(MessageTooLarge, match=SIZE_WORDS):
        noop.send(TOO_LARGE)
    with psycopg.connect(database_url) as conn, conn.transaction():
        with pytest.raises(MessageTooLarge, match=SIZE_WORDS):
            enqueue_in(conn, noop, TOO_LARGE)
        with pytest.raises(MessageTooLarge, match=SIZE_WORDS):
            broker.enqueue_many([noop.message("small"), noop.message(TOO_LARGE)], conn=conn)
        conn.execute("SELECT 1")  # the transaction is still usable
    with pytest.raises(MessageTooLarge, match=SIZE_WORDS):
        broker.enqueue_many([noop.message("small") for _ in range(3)] + [noop.message(TOO_LARGE)])
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue") == before
    # one just under the limit goes
    fits = noop.send("x" * (MIB - 300))
    assert scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = %s", (fits.message_id,)) == 1
    query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (fits.message_id,))


def test_an_event_whose_message_is_over_the_limit_is_set_aside_by_the_relay_with_the_reason(broker, database_url):
    with psycopg.connect(database_url) as conn:
        with conn.transaction():
            big = emit(conn, INFLATING_TOPIC, {"fill": "abcdefgh"})  # its route makes a 2 MiB message
            small = emit(conn, INFLATING_TOPIC, {"fill": "a"})
        result = relay_once(conn, topics=[INFLATING_TOPIC])
    assert (result.failed, result.messages) == (1, 1)
    error = scalar(database_url, "SELECT error FROM standmeet.outbox WHERE id = %s", (big,))
    assert error.startswith("MessageTooLarge: the message to 'test.noop' is 20973") and "1048576" in error
    assert scalar(database_url, "SELECT error FROM standmeet.outbox WHERE id = %s", (small,)) is None


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmHWM for {pid}")


def test_rows_over_the_limit_are_rejected_at_claim_and_a_worker_stays_small(
        broker, database_url, subprocess_env, tmp_path):
    # Given 20 rows of 20 MB each, inserted by SQL on the index queue
    ids = [r[0] for r in query(database_url, INSERT_BIG_ROWS, {"rows": BIG_ROWS, "bytes": BIG_ROW_BYTES})]
    log = tmp_path / "worker.log"
    # When a worker process serves the queue
    with running(worker_cmd("--threads", "4", "--queues", "index"), subprocess_env, log=log) as worker:
        # Then each is rejected by the claim, with its size and the limit
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])"
                                              " AND state = 'rejected'", (ids,)) == BIG_ROWS,
                 timeout_s=120, what="the big rows to be rejected")
        # and the worker goes on: a job sent after them runs
        after = noop.send("after-the-big-rows")
        wait_for(lambda: query(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s",
                               (after.message_id,)) == [("done",)], timeout_s=30, what="a later job to run")
        peak = _peak_rss_bytes(worker.pid)
    errors = [r[0] for r in query(database_url, "SELECT error FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[])",
                                  (ids,))]
    assert all(e.startswith("rejected when claimed: its message is 200001") and "over the 1572864 a claim" in e
               for e in errors), errors[:2]
    # never loaded: the worker's memory and log stay small
    print(f"20 rows of 20 MB: worker peak RSS {peak / MIB:.0f} MiB, log {log.stat().st_size} bytes")
    assert peak < MAX_RSS_BYTES, peak
    assert log.stat().st_size < MAX_LOG_BYTES, log.read_text()[-2000:]
