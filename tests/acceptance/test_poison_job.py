"""A job that kills its worker is the only one rejected; the jobs that ran beside it are not blamed."""

from __future__ import annotations

import pytest

from tests.support.db import query, wait_for
from tests.support.journal_jobs import journal, poison, read_journal
from tests.support.procs import running, worker_cmd

pytestmark = pytest.mark.slow


def _rows(url: str, ids: list[str]) -> dict[str, tuple[str, int, str | None]]:
    return {row[0]: tuple(row[1:]) for row in query(
        url, "SELECT message_id::text, state::text, crashes, error FROM dramatiq.queue"
             " WHERE message_id = ANY(%s::uuid[])", (ids,))}


def test_a_job_that_kills_its_worker_is_rejected_alone_and_its_neighbours_complete(
    broker, database_url, subprocess_env, tmp_path
):
    # Given a poison job (it kills its process) sent together with three innocent jobs
    path = str(tmp_path / "journal.txt")
    env = {**subprocess_env, "STANDMEET_TEST_JOURNAL": path, "STANDMEET_MAX_CRASHES": "1"}
    innocent = [journal.send(1_500) for _ in range(3)]
    bad = poison.send()
    ids = [m.message_id for m in innocent] + [bad.message_id]
    cmd = worker_cmd("--queues", "index", module="tests.support.journal_jobs")

    def settled() -> bool:
        rows = _rows(database_url, ids)
        return rows[bad.message_id][0] == "rejected" and all(rows[m.message_id][0] == "done" for m in innocent)

    # When workers keep being started as they die (a supervisor's job), until it is settled
    for attempt in range(12):
        with running(cmd, env, log=tmp_path / f"worker-{attempt}.log") as worker:
            wait_for(lambda w=worker: w.poll() is not None or settled(), timeout_s=60,
                     what="the worker to die or everything to settle")
        if settled():
            break
    # Then the poison job is rejected with the reason, and no innocent job was blamed
    rows = _rows(database_url, ids)
    assert rows[bad.message_id][0] == "rejected", rows
    assert "its worker process died while running it 2 times" in rows[bad.message_id][2]
    for message in innocent:
        assert rows[message.message_id][:2] == ("done", 0), rows
    starts = [e for e in read_journal(path) if e[0] == "start" and e[1] == bad.message_id]
    assert len(starts) >= 2
