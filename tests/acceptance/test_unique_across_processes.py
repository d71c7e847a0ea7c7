"""Unique jobs across processes: the database, not a read before the write, keeps one live
message per key, however many processes send it at once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.db import query, scalar
from tests.support.procs import ROOT

pytestmark = pytest.mark.slow

SENDERS = 8
SENDS = 1_000


def test_eight_processes_sending_one_key_a_thousand_times_each_leave_one_live_message(
        broker, database_url, subprocess_env):
    # Given eight sender processes, each ready with its broker connected
    procs = [subprocess.Popen([sys.executable, "-m", "tests.support.unique_sender", "across", str(SENDS)],
                              env=subprocess_env, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(SENDERS)]
    try:
        for proc in procs:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
        # When all of them send the same unique call a thousand times, at once
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        reports = []
        for proc in procs:
            out, _ = proc.communicate(timeout=300)
            assert proc.returncode == 0
            reports.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    # Then exactly one message was written, and every send returned its id
    rows = query(database_url, "SELECT message_id::text, state::text FROM dramatiq.queue"
                               " WHERE message->>'actor_name' = 'test.unique' AND message->'args' = '[\"across\"]'")
    assert len(rows) == 1 and rows[0][1] == "queued"
    assert [r["ids"] for r in reports] == [[rows[0][0]]] * SENDERS
    # And every other send was counted as a skip, in the processes and in the table
    assert sum(r["skipped"] for r in reports) == SENDERS * SENDS - 1
    assert scalar(database_url, "SELECT skipped FROM standmeet.unique_skips"
                                " WHERE queue_name = 'index' AND actor_name = 'test.unique'") == SENDERS * SENDS - 1
