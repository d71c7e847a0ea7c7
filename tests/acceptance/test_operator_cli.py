"""The operator's commands from issue contracts, run as real processes."""

from __future__ import annotations

import json
import subprocess
import sys

from actors import settings as app_settings
from broker.settings import replace
from tests.support.db import query, scalar, wait_for
from tests.support.procs import ROOT
from tests.support.smtp import smtp_server


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_mail_test_sends_through_the_notify_queue_and_waits_for_the_outcome(
    broker, database_url, subprocess_env, start_worker
):
    with smtp_server() as (port, mailbox):
        env = {**subprocess_env, "STANDMEET_SMTP_HOST": "127.0.0.1", "STANDMEET_SMTP_PORT": str(port)}
        # no worker yet: it says so, non-zero, once its wait is over
        waited = cli(env, "mail", "test", "nobody@example.test", "--wait-s", "0.5")
        assert waited.returncode == 1 and "is `standmeet-jobs run` running?" in waited.stderr
        app_settings.use(replace(app_settings.current(), smtp_host="127.0.0.1", smtp_port=port))
        start_worker(queues=["notify"], threads=2)
        result = cli(env, "mail", "test", "ops@example.test")
        assert result.returncode == 0, result.stderr
        assert f"sent test mail to ops@example.test through 127.0.0.1:{port}" in result.stdout
        wait_for(lambda: len(mailbox.received) == 2, timeout_s=15, what="both test mails")
    assert {m["To"] for m in mailbox.received} == {"ops@example.test", "nobody@example.test"}
    assert mailbox.received[0]["Subject"] == "StandMeet test mail"


def test_emit_write_search_reindex_and_sources_from_the_command_line(broker, database_url, subprocess_env, tmp_path, start_worker):
    # emit prints the event's id; a bad topic exits non-zero with the reason
    result = cli(subprocess_env, "emit", "document.written", "--payload", '{"document_id": 5}')
    assert result.returncode == 0, result.stderr
    event_id = int(result.stdout.strip())
    assert query(database_url, "SELECT topic FROM standmeet.outbox WHERE id = %s", (event_id,)) == [("document.written",)]
    bad = cli(subprocess_env, "emit", "nope", "--payload", "{}")
    assert bad.returncode == 1 and "no route for topic 'nope'" in bad.stderr
    # write stores, indexes (a worker runs) and prints one JSON object
    start_worker(queues=["index"], threads=4)
    doc = tmp_path / "note.txt"
    doc.write_text("Kettle report\nThe kettle boils in 90 seconds.\n")
    written = json.loads(cli(subprocess_env, "write", str(doc), "--wait-s", "5").stdout)
    assert written["indexed"] is True
    hits = [json.loads(line) for line in cli(subprocess_env, "search", "kettle", "boils").stdout.splitlines()]
    assert {h["id"] for h in hits} == {written["id"], written["wiki_id"]}
    # reindex enqueues a rebuild
    before = scalar(database_url, "SELECT coalesce(max(id), 0) FROM standmeet.reindex_runs")
    assert "queued a rebuild" in cli(subprocess_env, "reindex").stdout
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.reindex_runs WHERE finished_at IS NOT NULL"
                                          " AND id > %s", (before,)),
             timeout_s=15, what="the rebuild")
    # sources: refused without the allow-list, added with it, listed, fetched once
    refused = cli(subprocess_env, "sources", "add", "http://127.0.0.1:9/jobs", "--kind", "json")
    assert refused.returncode == 1 and "loopback address" in refused.stderr
    allowed = {**subprocess_env, "STANDMEET_WEBHOOK_ALLOWED_NETWORKS": "127.0.0.0/8"}
    source_id = int(cli(allowed, "sources", "add", "http://127.0.0.1:9/jobs", "--kind", "json").stdout)
    assert f"{source_id}\tjson\thttp://127.0.0.1:9/jobs" in cli(subprocess_env, "sources", "list").stdout
    assert cli(subprocess_env, "fetch-new").stdout.strip() == "queued 1 fetch(es)"
    assert cli(subprocess_env, "fetch-new").stdout.strip() == "queued 0 fetch(es)"
