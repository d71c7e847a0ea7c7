"""`dramatiq actors --queues index` consumes only the index queue and stops on SIGTERM."""

from __future__ import annotations

import signal

from actors import corpus
from tests.support.db import query, wait_for
from tests.support.jobs import SLEEP
from tests.support.procs import dramatiq_cmd, running


def _state(url: str, message_id: str) -> str | None:
    rows = query(url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s", (message_id,))
    return rows[0][0] if rows else None


def test_a_worker_for_one_queue_leaves_the_others_queued(broker, database_url, subprocess_env, tmp_path):
    # Given a document to index and a job waiting on the notify queue
    (doc_id,) = query(
        database_url, "INSERT INTO standmeet.documents (title, body) VALUES ('t', 'b') RETURNING id"
    )[0]
    index_message = corpus.index.send(doc_id)
    notify_message = SLEEP["notify"].send(1, "must-stay-queued")
    # When `dramatiq actors --queues index` runs
    cmd = dramatiq_cmd("--threads", "4", "--queues", "index", module="tests.support.jobs")
    with running(cmd, subprocess_env, log=tmp_path / "worker.log") as proc:
        wait_for(lambda: _state(database_url, index_message.message_id) == "done", timeout_s=30,
                 what="the index job to be done")
        # Then the notify job is still queued
        assert _state(database_url, notify_message.message_id) == "queued"
        # And SIGTERM stops it cleanly
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, (tmp_path / "worker.log").read_text()
    assert _state(database_url, notify_message.message_id) == "queued"
    stopped = query(database_url, "SELECT count(*) FROM standmeet.worker_processes WHERE stopped_at IS NOT NULL")
    assert stopped == [(1,)]
