"""What a job, a queue, an actor, an event or an endpoint says is printed by the operators'
commands as text: never read as rich markup (a `[/etc]` once made `jobs list` and
`status` exit 1, a `[link=…]` became a link), never as a terminal's escape sequence."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest

from tests.support.db import query
from tests.support.job_rows import drop_queue, put_jobs
from tests.support.procs import ROOT

QUEUE = "hostile_text"
#: Each is a markup tag, a closing tag with no opening one (rich's MarkupError), a link,
#: an emoji code, or HTML: printed exactly as it is.
ERROR = "bad path [/etc] <script>alert(1)</script>"
LINK = "[link=http://x]y[/link]"
ACTOR = "act[/b]:smile:"
TOPIC = "[red]topic[/red]"
#: A terminal would clear the screen and reverse the text that follows: shown as escapes.
ESCAPES = "\x1b[2J\u202eevil"
ESCAPED = "\\x1b[2J\\u202eevil"


def cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "broker.cli", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def shown(result: subprocess.CompletedProcess[str], *texts: str) -> str:
    """The command's output, which succeeded and shows each of ``texts`` as it is."""
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr, result.stderr
    for text in texts:
        assert text in result.stdout, (text, result.stdout)
    assert "\x1b" not in result.stdout and "\u202e" not in result.stdout, result.stdout
    return result.stdout


@pytest.fixture
def hostile(database_url: str) -> dict[str, str]:
    """Rejected jobs, a worker process, outbox events and a webhook delivery whose texts
    are hostile; removed after the test."""
    (plain,) = put_jobs(database_url, QUEUE, actor=ACTOR, rejected_with=ERROR)
    (linked,) = put_jobs(database_url, QUEUE, actor=ACTOR, rejected_with=f"{LINK} {ESCAPES}")
    (odd_queue,) = put_jobs(database_url, LINK, rejected_with=ERROR)
    worker = str(uuid.uuid4())
    query(database_url, "INSERT INTO standmeet.worker_processes (id, hostname, pid, queues) VALUES (%s, %s, 1, %s)",
          (worker, LINK, [QUEUE]))
    query(database_url, "INSERT INTO standmeet.outbox (topic, payload, error) VALUES (%s, '{}', %s), (%s, '{}', NULL)",
          (TOPIC, ERROR, TOPIC))
    (endpoint,) = query(database_url, "INSERT INTO standmeet.webhook_endpoints (url, event_types, secrets, enabled,"
                                      " disabled_reason) VALUES (%s, %s, '{}', false, %s) RETURNING id",
                        (f"http://127.0.0.1:9/{LINK}", [TOPIC], f"{ERROR}\tspilled"))[0]
    (event,) = query(database_url, "INSERT INTO standmeet.webhook_events (type, payload) VALUES (%s, '{}') RETURNING id",
                     (TOPIC,))[0]
    (delivery,) = query(database_url, "INSERT INTO standmeet.webhook_deliveries (event_id, endpoint_id, state, attempts)"
                                      " VALUES (%s, %s, 'failed', 1) RETURNING id", (event, endpoint))[0]
    query(database_url, "INSERT INTO standmeet.webhook_attempts (delivery_id, attempt, started_at, duration_ms,"
                        " status_code, outcome, error) VALUES (%s, 1, now(), 5, 500, 'http', %s)",
          (delivery, f"{ERROR} {ESCAPES}"))
    yield {"plain": plain, "linked": linked, "odd_queue": odd_queue, "endpoint": str(endpoint)}
    drop_queue(database_url, QUEUE)
    drop_queue(database_url, LINK)
    query(database_url, "DELETE FROM standmeet.worker_processes WHERE id = %s", (worker,))
    query(database_url, "DELETE FROM standmeet.outbox WHERE topic = %s", (TOPIC,))
    query(database_url, "DELETE FROM standmeet.webhook_endpoints WHERE id = %s", (endpoint,))
    query(database_url, "DELETE FROM standmeet.webhook_events WHERE id = %s", (event,))


def test_jobs_list_prints_errors_actors_and_queues_as_text(broker, subprocess_env, hostile):
    out = shown(cli(subprocess_env, "jobs", "list", "--queue", QUEUE), ERROR, LINK, ESCAPED, ACTOR)
    assert hostile["plain"] in out and hostile["linked"] in out
    shown(cli(subprocess_env, "jobs", "list", "--state", "rejected"), LINK)  # the queue's name too


def test_jobs_show_prints_the_error_and_the_actor_as_text(broker, subprocess_env, hostile):
    shown(cli(subprocess_env, "jobs", "show", hostile["plain"]), ERROR, ACTOR)
    shown(cli(subprocess_env, "jobs", "show", hostile["linked"]), LINK, ESCAPED)


def test_status_and_queues_list_print_queue_host_and_topic_names_as_text(broker, subprocess_env, hostile):
    status = shown(cli(subprocess_env, "status"), LINK, TOPIC)
    assert f"of topic {TOPIC} that no live process routes" in status
    shown(cli(subprocess_env, "queues", "list"), LINK)


def test_outbox_list_prints_topics_and_errors_as_text(broker, subprocess_env, hostile):
    shown(cli(subprocess_env, "outbox", "list"), TOPIC, ERROR)


def test_webhook_views_print_urls_events_and_errors_as_text(broker, subprocess_env, hostile):
    shown(cli(subprocess_env, "webhooks", "deliveries", hostile["endpoint"]), TOPIC, ERROR, ESCAPED)
    listed = shown(cli(subprocess_env, "webhooks", "list"), f"http://127.0.0.1:9/{LINK}", TOPIC, ERROR)
    (line,) = [ln for ln in listed.splitlines() if ln.startswith(hostile["endpoint"] + "\t")]
    # id, url, events, state, last attempt, counts: a tab in a text does not make a field of its own
    assert len(line.split("\t")) == 6 and f"{ERROR}\\x09spilled" in line, line
