"""What operators observe: one log line per finished job (text or JSON), and one
Prometheus /metrics for all the worker processes of ``standmeet-jobs run``."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import uuid
from collections.abc import Iterator

import dramatiq
import httpx
import pytest
from dramatiq.message import Message
from prometheus_client.parser import text_string_to_metric_families

from broker import services
from broker.observability.logs import JsonFormatter, masked_url
from middleware.job_log import JobLog
from middleware.retries import Retries
from tests.support.db import scalar, wait_for
from tests.support.jobs import SLEEP, noop, raise_once, snooze_n
from tests.support.procs import running


@pytest.fixture
def job_log(broker) -> Iterator[None]:
    """The broker's default stack logs each finished job, just before the retry policy."""
    kinds = [type(m) for m in broker.middleware]
    assert kinds.count(JobLog) == 1 and kinds.index(JobLog) < kinds.index(Retries)
    yield


def _done(url: str, message_id: str) -> str:
    return wait_for(lambda: (s := scalar(url, "SELECT state FROM dramatiq.queue WHERE message_id = %s",
                                         (message_id,))) in ("done", "rejected") and s,
                    timeout_s=20, what=f"job {message_id} to finish")


def _job_lines(caplog: pytest.LogCaptureFixture, message_id: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "standmeet.jobs" and getattr(r, "message_id", None) == message_id]


@dramatiq.actor(actor_name="observed.fail", queue_name="index", max_retries=0)
def fail(label: str = "") -> None:
    """The same actor as in tests.support.observed_jobs (which worker processes import)."""
    raise ValueError(f"{label} cannot be done")


def _failing(label: str) -> Message:
    return Message(queue_name="index", actor_name="observed.fail", args=(label,), kwargs={}, options={})


def test_each_finished_job_logs_one_line_with_its_outcome_duration_and_attempt(
        broker, database_url, start_worker, job_log, caplog):
    caplog.set_level(logging.INFO, logger="standmeet.jobs")
    start_worker(queues=["index"], threads=4)
    ok = noop.send("logged")
    flaky = raise_once.send("logged-flaky")
    snoozer = snooze_n.send("logged-snooze", 1)
    for message in (ok, flaky, snoozer):
        assert _done(database_url, message.message_id) == "done"
    wait_for(lambda: len(_job_lines(caplog, snoozer.message_id)) == 2, timeout_s=5, what="the snoozer's lines")

    (line,) = _job_lines(caplog, ok.message_id)
    assert line.levelno == logging.INFO
    assert (line.actor, line.queue, line.outcome, line.attempt) == ("test.noop", "index", "done", 1)
    assert line.duration_ms >= 0 and ok.message_id in line.getMessage()
    assert [(r.outcome, r.attempt) for r in _job_lines(caplog, flaky.message_id)] == [("retry", 1), ("done", 2)]
    assert [r.outcome for r in _job_lines(caplog, snoozer.message_id)] == ["snoozed", "done"]


def test_a_job_that_fails_for_good_logs_rejected(broker, database_url, start_worker, job_log, caplog):
    caplog.set_level(logging.INFO, logger="standmeet.jobs")
    start_worker(queues=["index"], threads=2)
    message = broker.enqueue(_failing("log-rejected"))
    assert _done(database_url, message.message_id) == "rejected"
    wait_for(lambda: _job_lines(caplog, message.message_id), timeout_s=5, what="its line")
    assert [r.outcome for r in _job_lines(caplog, message.message_id)] == ["rejected"]


def test_the_json_log_format_is_one_object_a_line_with_the_job_fields():
    record = logging.LogRecord("standmeet.jobs", logging.INFO, __file__, 1, "job %s", ("done",), None)
    record.outcome, record.attempt = "done", 2
    doc = json.loads(JsonFormatter().format(record))
    assert (doc["message"], doc["level"], doc["logger"], doc["outcome"], doc["attempt"]) == (
        "job done", "INFO", "standmeet.jobs", "done", 2)
    assert "\n" not in JsonFormatter().format(record)


def test_the_database_url_is_logged_with_its_password_masked():
    assert "s3cret" not in masked_url("postgresql://app:s3cret@db.internal:5432/app")
    assert "password=***" in masked_url("postgresql://app:s3cret@db.internal:5432/app")
    assert "s3cret" not in masked_url("host=db user=app password=s3cret dbname=app")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(url: str) -> dict[str, list]:
    text = httpx.get(url, timeout=10).text
    return {family.name: family.samples for family in text_string_to_metric_families(text)}


def _value(families: dict[str, list], sample: str, **labels: str) -> float:
    name = sample.removesuffix("_total").removesuffix("_count").removesuffix("_bucket")
    return sum(s.value for s in families.get(name, []) if s.name == sample
               and all(s.labels.get(k) == v for k, v in labels.items()))


def test_run_serves_one_metrics_endpoint_for_all_its_worker_processes(
        broker, database_url, subprocess_env, tmp_path):
    port = _free_port()
    env = {**subprocess_env, "STANDMEET_METRICS_PORT": str(port)}
    cmd = [sys.executable, "-m", "broker.cli", "run", "--processes", "2", "--queues", "index", "--no-scheduler",
           "--module", "tests.support.observed_jobs", "--log-format", "json"]
    metrics_url = f"http://127.0.0.1:{port}/metrics"
    with running(cmd, env, log=tmp_path / "run.log") as run:
        wait_for(lambda: _reachable(metrics_url), timeout_s=20, what="/metrics to answer")
        wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.worker_processes"
                                              " WHERE stopped_at IS NULL AND pid <> %s", (os.getpid(),)) == 2,
                 timeout_s=20, what="both worker processes to register")
        sleeps = [SLEEP["index"].send(40, f"metered-{n}") for n in range(16)]
        flaky = raise_once.send("metered-flaky")
        failed = broker.enqueue(_failing("metered-fail"))
        for message in [*sleeps, flaky]:
            assert _done(database_url, message.message_id) == "done"
        assert _done(database_url, failed.message_id) == "rejected"
        families = wait_for(lambda: (f := _scrape(metrics_url)) and _value(
            f, "dramatiq_messages_total", actor_name="test.sleep.index") == 16 and f, timeout_s=10,
            what="the sleeps counted")
        run.send_signal(signal.SIGTERM)
        assert run.wait(timeout=30) == 0
    # the jobs ran in both processes, and one endpoint counts them all
    assert scalar(database_url, "SELECT count(DISTINCT pid) FROM test_runs WHERE label LIKE 'metered-%%'") == 2
    index = {"queue_name": "index"}
    assert _value(families, "dramatiq_messages_total", actor_name="test.raise_once", **index) == 2
    assert _value(families, "dramatiq_message_errors_total", actor_name="test.raise_once", **index) == 1
    assert _value(families, "dramatiq_message_retries_total", actor_name="test.raise_once", **index) == 1
    assert _value(families, "dramatiq_message_rejects_total", actor_name="observed.fail", **index) == 1
    assert _value(families, "dramatiq_message_duration_milliseconds_count", actor_name="test.sleep.index") == 16
    assert _value(families, "dramatiq_message_duration_milliseconds_bucket", actor_name="test.sleep.index",
                  le="25.0") == 0  # each slept 40 ms
    assert _value(families, "dramatiq_messages_inprogress", actor_name="test.sleep.index") == 0
    # the database gauges, once (not once per process)
    (alive,) = families["standmeet_workers_alive"]
    assert alive.value >= 2  # both of run's, and this test process's broker
    assert _value(families, "standmeet_queue_depth", queue_name="index", state="queued") == 0
    assert len([s for s in families["standmeet_queue_depth"]
                if s.labels == {"queue_name": "index", "state": "queued"}]) == 1
    assert len(families["standmeet_outbox_lag_seconds"]) == 1
    assert "standmeet_oldest_queued_age_seconds" in families
    # and each finished job logged one JSON line
    lines = [json.loads(line) for line in (tmp_path / "run.log").read_text().splitlines() if line.startswith("{")]
    finished = [d for d in lines if d.get("logger") == "standmeet.jobs"]
    assert {d["message_id"] for d in finished if d["outcome"] == "done"} >= {m.message_id for m in sleeps}
    assert [d["outcome"] for d in finished if d["message_id"] == failed.message_id] == ["rejected"]
    assert any(d.get("message", "").startswith("database: ") for d in lines)


def _reachable(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_receipt_waiters_are_counted_while_they_wait_and_refusals_when_a_channel_is_full(broker, database_url):
    from prometheus_client import REGISTRY

    from broker.outbox.receipts import channel_for

    channel = channel_for("notify")
    listener = services.current().waiters.listener(channel)
    listener.max_waiters = 2

    def sample(name: str) -> float:
        return REGISTRY.get_sample_value(name, {"channel": channel}) or 0.0

    refused_before = sample("standmeet_receipt_waiters_refused_total")
    a, b, c = (str(uuid.UUID(int=n)) for n in (1, 2, 3))  # message ids, as a receipt names them
    first, second = listener.add([a]), listener.add([b])
    assert sample("standmeet_receipt_waiters") == 2
    assert listener.add([c]) is None
    assert sample("standmeet_receipt_waiters_refused_total") == refused_before + 1
    listener.remove(first)
    listener.remove(first)  # twice: counted once
    listener.remove(second)
    assert sample("standmeet_receipt_waiters") == 0
