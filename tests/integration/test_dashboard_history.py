"""The dashboard's view of the past: history charts, every attempt of a job, the search in
errors, row selection and the history gauges, against a real database and a real
(in-process) worker."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import dramatiq
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from broker.dashboard import DashboardConfig, create_app
from broker.dashboard.security import CSRF_FIELD
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import bump

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QUEUE = "dash_hist"
TOKEN = re.compile(rf'name="{CSRF_FIELD}" value="([0-9a-f]+)"')
FINAL = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state IN ('done', 'rejected')"


def _ok(label: str = "") -> None:
    pass


def _fail(label: str = "") -> None:
    raise ValueError(f"{label}: the ledger does not balance")


def _twice(key: str) -> None:
    n = bump(key)
    if n == 1:
        raise KeyError(f"{key}: first, a missing key")
    if n == 2:
        raise TimeoutError(f"{key}: second, the upstream timed out")


OK = dramatiq.actor(_ok, actor_name=f"{QUEUE}.ok", queue_name=QUEUE, max_retries=0)
FAIL = dramatiq.actor(_fail, actor_name=f"{QUEUE}.fail", queue_name=QUEUE, max_retries=0)
TWICE = dramatiq.actor(_twice, actor_name=f"{QUEUE}.twice", queue_name=QUEUE, max_retries=3, min_backoff=10,
                       max_backoff=20)


@pytest.fixture
def dashboard(database_url: str) -> Callable[..., Iterator[TestClient]]:
    @contextmanager
    def open_dashboard(**overrides: object) -> Iterator[TestClient]:
        config = replace(DashboardConfig(database_url=database_url, queues=("index", QUEUE)), **overrides)
        with TestClient(create_app(config), base_url="http://127.0.0.1:8420") as client:
            yield client

    return open_dashboard  # type: ignore[return-value]


def _drain(url: str, messages: list[dramatiq.Message]) -> None:
    ids = [m.message_id for m in messages]
    wait_for(lambda: scalar(url, FINAL, (ids,)) == len(ids), timeout_s=30, what="the jobs to finish")


def _series(svg_page: str, chart_id: str) -> dict[str, list[float]]:
    """series name -> values of the chart ``chart_id`` on a page."""
    chart = re.search(rf'<svg class="chart" id="{chart_id}".*?</svg>', svg_page, re.S)
    assert chart, f"no chart {chart_id}"
    return {name: [float(v) for v in values.split(",")]
            for name, values in re.findall(r'<polyline class="line" data-series="([^"]+)" data-values="([^"]*)"',
                                           chart.group(0))}


def _csrf(client: TestClient, page: str = "/jobs") -> str:
    match = TOKEN.search(client.get(page).text)
    assert match
    return match.group(1)


@pytest.fixture(scope="module")
def drained(broker, database_url) -> dict[str, list[str]]:
    """A drain of the queue: 6 done at once, 3 rejected, and 1 done after two failed runs."""
    worker = dramatiq.Worker(broker, queues=[QUEUE], worker_threads=2, worker_timeout=100)
    worker.start()
    try:
        ok = [OK.send(f"ok-{i}") for i in range(6)]
        failed = [FAIL.send(f"order-{i}") for i in range(3)]
        twice = [TWICE.send("twice")]
        _drain(database_url, ok + failed + twice)
    finally:
        worker.stop(timeout=10_000)
        broker.middleware[:] = [m for m in broker.middleware if type(m).__name__ != "_WorkerMiddleware"]
    return {"ok": [m.message_id for m in ok], "failed": [m.message_id for m in failed],
            "twice": [m.message_id for m in twice]}


def test_the_history_page_charts_throughput_failures_wait_and_run_of_a_queue_from_the_history_alone(
        broker, database_url, dashboard, drained):
    # Given the drain's jobs gone from dramatiq.queue: only the history remembers them
    query(database_url, "CREATE TABLE saved_jobs AS SELECT * FROM dramatiq.queue WHERE queue_name = %s", (QUEUE,))
    try:
        assert len(query(database_url, "DELETE FROM dramatiq.queue WHERE queue_name = %s RETURNING 1",
                         (QUEUE,))) == 10
        with dashboard() as client:
            hour = client.get("/history", params={"queue": QUEUE, "window": "1h"})
            day = client.get("/history", params={"queue": QUEUE, "window": "24h"})
    finally:
        query(database_url, "INSERT INTO dramatiq.queue SELECT * FROM saved_jobs; DROP TABLE saved_jobs")
    assert hour.status_code == 200 and day.status_code == 200
    for page, buckets, per in ((hour.text, 61, "minute"), (day.text, 97, "15 min")):
        throughput = _series(page, "chart-0-throughput")
        failures = _series(page, "chart-0-failures")
        wait = _series(page, "chart-0-wait")
        run = _series(page, "chart-0-run")
        # Then throughput counts the 7 jobs done, failures the 3 rejected and the 2 retried runs
        assert sum(throughput["done"]) == 7 and sum(failures["failures"]) == 5
        # every bucket is a point (an empty one at zero, not a gap)
        for series in (throughput, failures, wait, run):
            assert all(len(values) == buckets for values in series.values())
        assert throughput["done"].count(0) >= buckets - 2
        assert set(wait) == {"wait_p50", "wait_p95"} and set(run) == {"run_p50", "run_p95"}
        assert max(run["run_p95"]) >= max(run["run_p50"]) >= 0
        # and each chart says what it is: a title, a description, the axes' units, a legend
        assert f"<title id=\"chart-0-throughput-title\">Throughput of {QUEUE}" in page
        assert 'aria-labelledby="chart-0-throughput-title chart-0-throughput-desc"' in page
        assert f">jobs done per {per}<" in page and ">milliseconds<" in page
        assert f"time (UTC), one point per {per}" in page
        assert re.search(r'class="legend-item" data-series="failures">.*?failed \+ rejected \+ crashed', page)
    assert "7 done · 5 failures (2 retried, 3 rejected, 0 crashed)" in hour.text


def test_the_history_page_of_every_queue_and_bad_windows_and_queues_are_refused_with_the_reason(
        broker, database_url, dashboard, drained):
    with dashboard() as client:
        every = client.get("/history")
        bad_window = client.get("/history", params={"window": "7d"})
        unknown = client.get("/history", params={"queue": "no_such_queue"})
        control = client.get("/history", params={"queue": "bad\x01name"})
        declared_quiet = client.get("/history", params={"queue": "index"})
    assert every.status_code == 200 and f'data-queue="{QUEUE}"' in every.text
    assert bad_window.status_code == 400 and bad_window.text.strip() == "window must be one of 1h, 24h, not '7d'"
    assert unknown.status_code == 400 and len(unknown.text.strip().splitlines()) == 1
    assert "no_such_queue" in unknown.text and QUEUE in unknown.text  # the known ones, named
    assert control.status_code == 400
    # a declared queue with no history charts zeros
    assert declared_quiet.status_code == 200
    assert set(_series(declared_quiet.text, "chart-0-throughput")["done"]) == {0.0}


def test_the_overview_draws_each_queues_last_hour_as_a_sparkline_linked_to_its_history(
        broker, database_url, dashboard, drained):
    with dashboard() as client:
        page = client.get("/").text
    row = re.search(rf'<tr id="queue-{QUEUE}">(.*?)</tr>', page, re.S)
    assert row, page
    spark = re.search(r'<td class="spark"><a href="/history\?queue=dash_hist&amp;window=1h"[^>]*>(<svg .*?</svg>)',
                      row.group(1), re.S)
    assert spark, row.group(1)
    done = re.search(r'data-series="done" data-values="([^"]*)"', spark.group(1))
    failures = re.search(r'data-series="failures" data-values="([^"]*)"', spark.group(1))
    assert done and sum(map(int, done.group(1).split(","))) == 7
    assert failures and sum(map(int, failures.group(1).split(","))) == 5
    assert 'role="img"' in spark.group(1) and "7 done" in spark.group(1)


def test_a_jobs_page_lists_every_attempt_newest_last_with_its_own_error_and_says_how_long_it_took(
        broker, database_url, dashboard, drained):
    (message_id,) = drained["twice"]
    with dashboard() as client:
        page = client.get(f"/jobs/{message_id}").text
    rows = re.findall(r'<tr class="attempt" data-attempt="(\d+)" data-outcome="([a-z_]+)">(.*?)</tr>', page, re.S)
    assert [outcome for _, outcome, _ in rows] == ["failed", "failed", "done"]
    assert [int(n) for n, _, _ in rows] == sorted(int(n) for n, _, _ in rows)
    assert "first, a missing key" in rows[0][2] and "second" not in rows[0][2]
    assert "TimeoutError" in rows[1][2] and "first" not in rows[1][2]
    assert rows[2][2].count('class="error"></td>') == 1  # the run that was done has no error
    assert all(re.search(r'<td class="n">[\d.]+ (µs|ms|s)</td>', r[2]) for r in rows)  # each its run time
    assert re.search(r'id="job-last-run">[\d.]+ (µs|ms|s) <span class="muted">\(start to end\)', page)
    assert re.search(r'id="job-total">[\d.]+ (ms|s) <span class="muted">\(enqueue to end\)', page)


def test_jobs_are_found_by_text_in_their_error_or_last_traceback_and_a_bulk_action_keeps_that_filter(
        broker, database_url, dashboard, start_worker):
    # Given a job rejected with an error, and one still retrying whose traceback says why
    start_worker(queues=[QUEUE], threads=2)
    rejected = FAIL.send("needle-order")
    other = FAIL.send("other-order")
    _drain(database_url, [rejected, other])
    retrying = OK.send_with_options(args=("retrying",), delay=600_000)
    query(database_url, "UPDATE dramatiq.queue SET message = jsonb_set(message, '{options,traceback}',"
                        " to_jsonb('Traceback (most recent call last):\n  ...\nConnectionError: NEEDLE refused'::text))"
                        " WHERE message_id = %s", (retrying.message_id,))
    with dashboard() as client:
        found = client.get("/jobs", params={"error": "needle"}).text
        literal = client.get("/jobs", params={"error": "needle_order"}).text  # _ is no wildcard
        too_long = client.get("/jobs", params={"error": "x" * 201})
        confirm = client.get("/jobs/bulk", params={"error": "needle-order: the ledger", "action": "retry"})
    ids = re.findall(r'data-job-id="([^"]+)"', found)
    assert set(ids) == {rejected.message_id, retrying.message_id}
    assert 'name="error" id="filter-error-text" value="needle"' in found
    assert not re.findall(r'data-job-id="([^"]+)"', literal)
    assert too_long.status_code == 400 and "at most 200 characters" in too_long.text
    assert 'id="bulk-count">1<' in confirm.text
    assert '<input type="hidden" name="error" value="needle-order: the ledger">' in confirm.text


def test_retry_selected_and_cancel_selected_act_on_the_ticked_rows_and_retry_leaves_cancelled_ones(
        broker, database_url, dashboard, start_worker):
    start_worker(queues=[QUEUE], threads=2)
    failed = [FAIL.send(f"selected-{i}") for i in range(2)]
    _drain(database_url, failed)
    waiting = [OK.send_with_options(args=(f"waiting-{i}",), delay=600_000) for i in range(3)]
    cancelled = OK.send_with_options(args=("cancelled",), delay=600_000)
    query(database_url, "UPDATE dramatiq.queue SET state = 'rejected', cancelled_at = now(), cancelled_by = 'test'"
                        " WHERE message_id = %s", (cancelled.message_id,))
    with dashboard() as client:
        listing = client.get("/jobs", params={"queue": QUEUE}).text
        assert 'id="retry-selected"' in listing and 'id="cancel-selected"' in listing and 'id="select-all"' in listing
        assert f'name="selected" value="{waiting[0].message_id}"' in listing
        token = _csrf(client)
        # retry: the two failed jobs and the cancelled one ticked
        retried = client.post("/jobs/selected", data={CSRF_FIELD: token, "action": "retry", "queue": QUEUE,
                                                      "selected": [m.message_id for m in failed]
                                                      + [cancelled.message_id]}, follow_redirects=False)
        # cancel: two of the three waiting ones
        cancel = client.post("/jobs/selected", data={CSRF_FIELD: token, "action": "cancel",
                                                     "selected": [m.message_id for m in waiting[:2]]},
                             follow_redirects=False)
        notice = client.get(retried.headers["location"]).text
        none = client.post("/jobs/selected", data={CSRF_FIELD: token, "action": "cancel"}, follow_redirects=False)
        bad = client.post("/jobs/selected", data={CSRF_FIELD: token, "action": "cancel", "selected": "nope"})
        bad_action = client.post("/jobs/selected", data={CSRF_FIELD: token, "action": "explode",
                                                         "selected": waiting[2].message_id})
        unsigned = client.post("/jobs/selected", data={"action": "cancel", "selected": waiting[2].message_id})
    assert retried.status_code == 303 and retried.headers["location"].startswith("/jobs?queue=dash_hist&")
    assert "notice=selected_cancel_final" in retried.headers["location"]
    assert "cancel is final" in notice
    assert cancel.status_code == 303 and "notice=selected_cancel" in cancel.headers["location"]
    states = dict(query(database_url, "SELECT message_id::text, state::text FROM dramatiq.queue"
                                      " WHERE message_id = ANY(%s::uuid[])",
                        ([m.message_id for m in [*failed, *waiting, cancelled]],)))
    retried_ids = {r[0] for r in query(database_url, "SELECT message_id::text FROM dramatiq.queue"
                                                      " WHERE retried_at IS NOT NULL AND queue_name = %s", (QUEUE,))}
    assert retried_ids == {m.message_id for m in failed}  # cancel is final: the cancelled one left alone
    assert states[cancelled.message_id] == "rejected"
    assert [states[m.message_id] for m in waiting] == ["rejected", "rejected", "queued"]
    assert "notice=none_selected" in none.headers["location"]
    assert bad.status_code == 400 and len(bad.text.strip().splitlines()) == 1 and "not a job id" in bad.text
    assert bad_action.status_code == 400 and unsigned.status_code == 403
    target, affected = query(database_url, "SELECT target, affected FROM standmeet.operator_actions"
                                           " WHERE action = 'jobs.retry' ORDER BY id DESC LIMIT 1")[0]
    assert target["selected"] is True and affected == 2 and len(target["message_ids"]) == 3


def test_read_only_lists_jobs_without_checkboxes(broker, dashboard, drained):
    with dashboard(read_only=True) as client:
        page = client.get("/jobs", params={"queue": QUEUE}).text
    assert 'name="selected"' not in page and 'id="retry-selected"' not in page and 'method="post"' not in page


def test_metrics_give_each_queues_last_hour_from_one_summary(broker, database_url, dashboard, drained):
    with dashboard() as client:
        text = client.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    done = scalar(database_url, "SELECT sum(done) FROM standmeet.queue_history WHERE queue_name = %s", (QUEUE,))
    assert samples[("standmeet_queue_throughput_per_second", (("queue_name", QUEUE),))] == pytest.approx(
        float(done) / 3600, abs=0.001)
    assert samples[("standmeet_queue_failures_last_hour", (("queue_name", QUEUE),))] >= 5
    for name in ("standmeet_queue_wait_seconds", "standmeet_queue_run_seconds"):
        p50 = samples[(name, (("quantile", "0.5"), ("queue_name", QUEUE)))]
        p95 = samples[(name, (("quantile", "0.95"), ("queue_name", QUEUE)))]
        assert 0 <= p50 <= p95
