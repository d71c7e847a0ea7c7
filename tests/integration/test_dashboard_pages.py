"""The dashboard through Starlette's test client: every page and every action, against
this module's real database, with jobs run by a real (in-process) worker."""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import dramatiq
import psycopg
import pytest
from dramatiq.message import Message
from prometheus_client.parser import text_string_to_metric_families
from starlette.routing import Route
from starlette.testclient import TestClient

from broker import ops
from broker.dashboard import DashboardConfig, create_app
from broker.dashboard.security import CSRF_COOKIE, CSRF_FIELD
from broker.engine.enqueue import enqueue_message
from tests.support.db import query, scalar, wait_for
from tests.support.jobs import bump, record_finish, record_start

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QUEUE = "dash_pages"


def _ok(label: str = "") -> None:
    record_finish(record_start(f"{QUEUE}.ok", QUEUE, label))


def _fail(label: str = "") -> None:
    raise ValueError(f"{label} is broken")


def _fail_once(key: str) -> None:
    if bump(key) == 1:
        raise RuntimeError(f"{key} fails once")


OK = dramatiq.actor(_ok, actor_name=f"{QUEUE}.ok", queue_name=QUEUE, max_retries=0)
FAIL = dramatiq.actor(_fail, actor_name=f"{QUEUE}.fail", queue_name=QUEUE, max_retries=0)
FAIL_ONCE = dramatiq.actor(_fail_once, actor_name=f"{QUEUE}.fail_once", queue_name=QUEUE, max_retries=0)

TOKEN = re.compile(rf'name="{CSRF_FIELD}" value="([0-9a-f]+)"')


@pytest.fixture
def dashboard(database_url: str) -> Callable[..., Iterator[TestClient]]:
    """``with dashboard(read_only=True) as client:`` a client of a fresh app."""

    @contextmanager
    def open_dashboard(**overrides: object) -> Iterator[TestClient]:
        config = replace(DashboardConfig(database_url=database_url, queues=("index", QUEUE)), **overrides)
        with TestClient(create_app(config), base_url="http://127.0.0.1:8420") as client:
            yield client

    return open_dashboard  # type: ignore[return-value]


def state_of(url: str, message_id: str) -> str:
    return str(scalar(url, 'SELECT "state" FROM dramatiq.queue WHERE message_id = %s', (message_id,)))


def settled(url: str, message_id: str) -> str:
    return wait_for(lambda: (s := state_of(url, message_id)) in ("done", "rejected") and s,
                    timeout_s=15, what=f"job {message_id} to finish")


def csrf_token(client: TestClient, page: str = "/") -> str:
    match = TOKEN.search(client.get(page).text)
    assert match, f"no CSRF token on {page}"
    return match.group(1)


def post(client: TestClient, path: str, data: dict[str, str] | None = None, *, page: str = "/"):
    return client.post(path, data={**(data or {}), CSRF_FIELD: csrf_token(client, page)}, follow_redirects=False)


def actions(url: str, action: str) -> list[tuple]:
    return query(url, "SELECT target, affected, by_whom, source FROM standmeet.operator_actions"
                      " WHERE action = %s ORDER BY id", (action,))


def test_the_overview_shows_each_queue_by_state_with_throughput(broker, database_url, dashboard, start_worker):
    start_worker(queues=[QUEUE], threads=2)
    assert settled(database_url, OK.send("overview").message_id) == "done"
    assert settled(database_url, FAIL.send("overview").message_id) == "rejected"
    OK.send_with_options(args=("later",), delay=60_000)
    with dashboard() as client:
        page = client.get("/")
    assert page.status_code == 200
    row = re.search(rf'<tr id="queue-{QUEUE}">(.*?)</tr>', page.text, re.S)
    assert row, page.text
    numbers = re.findall(r'<td class="n">(?:<a [^>]*>)?([^<]*)', row.group(1))
    # queued, delayed, running, rejected (24 h), done (5 min), done (1 h), oldest due
    assert numbers[:6] == ["0", "1", "0", "1", "1", "1"]
    assert 'id="queue-index"' in page.text  # declared queues are listed even when empty
    assert "Pause" in row.group(1)


def test_the_overview_and_workers_pages_say_how_many_running_jobs_are_not_yet_started(
        broker, database_url, dashboard):
    from broker.engine import sql, sql_enqueue
    from broker.engine.codec import claim_size_params, enqueue_params
    from broker.settings import MIB

    # Given three messages claimed by this worker process: one started, two claimed ahead
    broker.prove_alive()
    messages = [Message(queue_name="dash_prefetch", actor_name="dash.none", args=(i,), kwargs={}, options={})
                for i in range(3)]
    query(database_url, sql_enqueue.ENQUEUE, enqueue_params(messages))
    query(database_url, sql.CLAIM, {"queue": "dash_prefetch", "n": 3, "n_start": 1, "worker_id": broker.worker_id,
                                    **claim_size_params(MIB), "claim_until_s": None})
    try:
        with dashboard() as client:
            page = client.get("/")
            workers = client.get("/workers").text
        row = re.search(r'<tr id="queue-dash_prefetch">(.*?)</tr>', page.text, re.S)
        # Then the queue's row shows them running, two of them prefetched
        assert row, page.text
        assert re.search(r">3</a> <span [^>]*>\(2 prefetched\)</span>", row.group(1)), row.group(1)
        # and the workers page lists the started one, and says how many are not yet started
        started = query(database_url, "SELECT message_id::text FROM dramatiq.queue"
                                      " WHERE queue_name = 'dash_prefetch' AND started_at IS NOT NULL")
        assert len(started) == 1 and started[0][0][:8] in workers
        assert not [m for m in messages if m.message_id != started[0][0] and m.message_id[:8] in workers]
        assert re.search(r"and \d+ claimed, not yet started", workers), workers
    finally:
        query(database_url, "DELETE FROM dramatiq.queue WHERE queue_name = 'dash_prefetch'")


def test_the_jobs_page_filters_by_state_queue_actor_id_and_text_in_the_arguments(broker, database_url, dashboard,
                                                                                 start_worker):
    start_worker(queues=[QUEUE], threads=2)
    failed = FAIL.send("needle-in-args")
    other = FAIL.send("haystack")
    done = OK.send("needle-done")
    for message in (failed, other, done):
        settled(database_url, message.message_id)
    with dashboard() as client:
        by_text = client.get("/jobs", params={"state": "rejected", "queue": QUEUE, "q": "needle"}).text
        by_actor = client.get("/jobs", params={"actor": f"{QUEUE}.ok"}).text
        by_id = client.get("/jobs", params={"id": failed.message_id[:13]}).text
    assert failed.message_id in by_text and other.message_id not in by_text and done.message_id not in by_text
    assert "needle-in-args is broken" in by_text  # the error's last line
    assert done.message_id in by_actor and failed.message_id not in by_actor
    assert failed.message_id in by_id and '<span id="jobs-total">1</span>' in by_id


def test_the_jobs_page_filters_by_enqueue_time_and_says_what_is_wrong_with_a_bad_filter(broker, database_url,
                                                                                          dashboard):
    message = OK.send_with_options(args=("since",), delay=600_000)
    with dashboard() as client:
        recent = client.get("/jobs", params={"actor": f"{QUEUE}.ok", "since": "1h"}).text
        future = client.get("/jobs", params={"actor": f"{QUEUE}.ok", "since": "2999-01-01T00:00:00"}).text
        bad_state = client.get("/jobs", params={"state": "exploded"})
        bad_since = client.get("/jobs", params={"since": "yesterday-ish"})
    assert message.message_id in recent and message.message_id not in future
    assert bad_state.status_code == 400 and "unknown job state &#39;exploded&#39;" in bad_state.text
    assert bad_since.status_code == 400 and 'id="filter-error"' in bad_since.text
    assert 'name="since" id="filter-since" value="yesterday-ish"' in bad_since.text  # the form keeps it


def test_the_jobs_list_pages_in_a_stable_order(broker, database_url, dashboard):
    from broker.dashboard.app import PAGE_SIZE

    sent = [OK.send_with_options(args=(f"page-{i}",), delay=600_000) for i in range(PAGE_SIZE + 5)]
    with dashboard() as client:
        params = {"actor": f"{QUEUE}.ok", "state": "delayed"}
        first = client.get("/jobs", params=params).text
        second = client.get("/jobs", params={**params, "page": "2"}).text
    ids_first = re.findall(r'data-job-id="([^"]+)"', first)
    ids_second = re.findall(r'data-job-id="([^"]+)"', second)
    assert len(ids_first) == PAGE_SIZE and len(ids_second) >= 5
    assert not set(ids_first) & set(ids_second)
    assert {m.message_id for m in sent} <= set(ids_first) | set(ids_second)
    assert 'rel="next"' in first and 'rel="prev"' in second


def test_a_failed_job_shows_its_error_and_traceback_and_its_arguments_only_when_asked(
        broker, database_url, dashboard, start_worker):
    start_worker(queues=[QUEUE], threads=2)
    failed = FAIL.send("<script>alert('x')</script>")
    settled(database_url, failed.message_id)
    with dashboard() as client:
        answer = client.get(f"/jobs/{failed.message_id}")
        page, headers = answer.text, answer.headers
        with_args = client.get(f"/jobs/{failed.message_id}", params={"show": "args"}).text
        missing = client.get("/jobs/00000000-0000-0000-0000-000000000000")
    assert 'id="job-state" class="state rejected">rejected<' in page
    assert "Traceback" in page and "ValueError" in page
    assert 'id="retry-job"' in page and 'id="cancel-job"' in page
    assert "enqueued" in page and "rejected" in page  # the timeline
    assert "<script>alert" not in page and "<script>alert" not in with_args  # escaped, always
    assert "script-src 'self'" in headers["content-security-policy"] and headers["x-frame-options"] == "DENY"
    assert 'id="job-args"' not in page and 'id="show-args"' in page
    assert "&lt;script&gt;alert(" in with_args
    assert missing.status_code == 404


def test_retry_on_a_job_page_runs_a_failed_job_again_until_done_and_is_recorded(
        broker, database_url, dashboard, start_worker):
    start_worker(queues=[QUEUE], threads=2)
    message = FAIL_ONCE.send("retry-me")
    assert settled(database_url, message.message_id) == "rejected"
    with dashboard() as client:
        answer = post(client, f"/jobs/{message.message_id}/retry", page=f"/jobs/{message.message_id}")
        assert answer.status_code == 303
        assert answer.headers["location"].startswith(f"/jobs/{message.message_id}?notice=retried")
        assert settled(database_url, message.message_id) == "done"
        page = client.get(f"/jobs/{message.message_id}").text
    assert 'class="state done">done<' in page and "retried" in page
    (target, affected, by, source) = actions(database_url, "jobs.retry")[-1]
    assert target == {"message_ids": [message.message_id]} and affected == 1
    assert by == "dashboard" and source == "dashboard testclient"


def test_a_retry_a_live_job_of_its_unique_key_holds_back_says_so_on_each_action(
        broker, database_url, dashboard, start_worker):
    from tests.support import unique_jobs

    # Given rejected unique jobs, and a live (delayed) one of each one's key
    start_worker(queues=["index"], threads=2)
    held = [unique_jobs.unique_fails.send(f"dash-held-{n}") for n in range(2)]
    assert [settled(database_url, m.message_id) for m in held] == ["rejected", "rejected"]
    live = [unique_jobs.unique_fails.send_with_options(args=(f"dash-held-{n}",), delay=600_000) for n in range(2)]
    assert {m.message_id for m in live}.isdisjoint(m.message_id for m in held)
    with dashboard() as client:
        # When it is retried from its page, or ticked on the list
        one = post(client, f"/jobs/{held[0].message_id}/retry", page=f"/jobs/{held[0].message_id}")
        ticked = post(client, "/jobs/selected", {"action": "retry", "selected": held[1].message_id}, page="/jobs")
        # Then each says the key held it back, not that nothing matched
        assert one.headers["location"].startswith(f"/jobs/{held[0].message_id}?notice=unique_held")
        assert "notice=unique_held" in ticked.headers["location"], ticked.headers["location"]
        page = client.get(one.headers["location"]).text
    assert "a live job of the same unique key holds the key" in page
    assert [state_of(database_url, m.message_id) for m in held] == ["rejected", "rejected"]
    broker.flush("index")


def test_cancel_on_a_job_page_keeps_a_queued_job_from_ever_running(broker, database_url, dashboard):
    message = OK.send_with_options(args=("cancel-me",), delay=600_000)
    with dashboard() as client:
        answer = post(client, f"/jobs/{message.message_id}/cancel")
        assert answer.status_code == 303
        page = client.get(f"/jobs/{message.message_id}").text
    assert state_of(database_url, message.message_id) == "rejected"
    assert "cancelled" in page
    assert actions(database_url, "jobs.cancel")[-1][:2] == ({"message_ids": [message.message_id]}, 1)


def test_bulk_retry_confirms_how_many_match_then_retries_them_all(broker, database_url, dashboard, start_worker):
    start_worker(queues=[QUEUE], threads=2)
    failed = [FAIL_ONCE.send(f"bulk-{i}") for i in range(3)]
    for message in failed:
        assert settled(database_url, message.message_id) == "rejected"
    filters = {"state": "rejected", "actor": f"{QUEUE}.fail_once", "q": "bulk-"}
    with dashboard() as client:
        listing = client.get("/jobs", params=filters).text
        assert 'id="bulk-retry"' in listing
        confirm = client.get("/jobs/bulk", params={**filters, "action": "retry"})
        assert confirm.status_code == 200
        assert 'id="bulk-count">3<' in confirm.text and "Retry 3 jobs" in confirm.text
        hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm.text))
        answer = client.post("/jobs/bulk", data=hidden, follow_redirects=False)
        assert answer.status_code == 303
    for message in failed:
        assert settled(database_url, message.message_id) == "done"
    (target, affected, _, _) = actions(database_url, "jobs.retry")[-1]
    assert target["filter"] == filters and affected == 3
    assert sorted(target["message_ids"]) == sorted(m.message_id for m in failed)  # which jobs, recorded


def test_bulk_cancel_of_every_job_matching_a_search_cancels_only_those(broker, database_url, dashboard):
    doomed = [OK.send_with_options(args=(f"doomed-{i}",), delay=600_000) for i in range(2)]
    spared = OK.send_with_options(args=("spared",), delay=600_000)
    filters = {"actor": f"{QUEUE}.ok", "q": "doomed-"}
    with dashboard() as client:
        confirm = client.get("/jobs/bulk", params={**filters, "action": "cancel"})
        assert 'id="bulk-count">2<' in confirm.text
        hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm.text))
        assert client.post("/jobs/bulk", data=hidden, follow_redirects=False).status_code == 303
    assert [state_of(database_url, m.message_id) for m in doomed] == ["rejected", "rejected"]
    assert state_of(database_url, spared.message_id) == "queued"
    (target, affected, _, _) = actions(database_url, "jobs.cancel")[-1]
    assert affected == 2 and sorted(target["message_ids"]) == sorted(m.message_id for m in doomed)


def test_a_bulk_retry_never_brings_back_a_cancelled_job_and_counts_exactly_what_it_retries(
        broker, database_url, dashboard, start_worker):
    # Given two failed jobs, and a delayed one an operator cancelled, all matching one search,
    # and a running job cancelled while it ran (still running)
    start_worker(queues=[QUEUE], threads=2)
    failed = [FAIL_ONCE.send(f"final-{i}") for i in range(2)]
    for message in failed:
        assert settled(database_url, message.message_id) == "rejected"
    cancelled = OK.send_with_options(args=("final-cancelled",), delay=600_000)
    with psycopg.connect(database_url) as conn:
        assert ops.cancel_jobs(conn, message_ids=[cancelled.message_id], by="ops@host") == 1
    with dashboard() as client:
        # When an operator asks for a bulk retry of the cancelled ones
        refused = client.get("/jobs/bulk", params={"state": "cancelled", "action": "retry"})
        assert refused.status_code == 400 and "cancel is final" in refused.text
        assert 'id="bulk-retry"' not in client.get("/jobs", params={"state": "cancelled"}).text
        # and of every rejected job matching the search
        confirm = client.get("/jobs/bulk", params={"q": "final-", "action": "retry"})
        assert 'id="bulk-count">2<' in confirm.text
        hidden = dict(re.findall(r'<input type="hidden" name="([^"]+)" value="([^"]*)">', confirm.text))
        assert client.post("/jobs/bulk", data=hidden, follow_redirects=False).status_code == 303
        # Then the two failed ones ran again, and the cancelled one stayed cancelled
    for message in failed:
        assert settled(database_url, message.message_id) == "done"
    assert state_of(database_url, cancelled.message_id) == "rejected"
    (target, affected, _, _) = actions(database_url, "jobs.retry")[-1]
    assert affected == 2 and sorted(target["message_ids"]) == sorted(m.message_id for m in failed)


def test_a_page_whose_query_runs_past_its_timeout_says_so_not_that_the_database_is_down(
        broker, database_url, dashboard, monkeypatch):
    from broker.dashboard import server

    # Given a dashboard whose statements may take half a second, and the job table locked
    monkeypatch.setattr(server, "STATEMENT_TIMEOUT_MS", 500)
    with dashboard() as client, psycopg.connect(database_url) as locker:
        locker.execute("LOCK TABLE dramatiq.queue IN ACCESS EXCLUSIVE MODE")
        # When the job list is asked for
        answer = client.get("/jobs")
        locker.rollback()
    # Then it says the query took too long, in one line, not that the database is unavailable
    assert answer.status_code == 504 and answer.text.startswith("the query took too long"), answer.text
    assert len(answer.text.strip().splitlines()) == 1


def test_bulk_cancel_of_nothing_says_so_and_changes_nothing(broker, database_url, dashboard):
    with dashboard() as client:
        confirm = client.get("/jobs/bulk", params={"actor": "no.such.actor", "action": "cancel"})
    assert 'id="bulk-count">0<' in confirm.text and "Nothing to do" in confirm.text
    assert 'id="confirm-bulk"' not in confirm.text


def test_pause_and_resume_a_queue_from_the_overview(broker, database_url, dashboard):
    with dashboard() as client:
        assert post(client, f"/queues/{QUEUE}/pause").status_code == 303
        paused = client.get("/").text
        assert post(client, f"/queues/{QUEUE}/resume").status_code == 303
        resumed = client.get("/").text
    row = re.search(rf'<tr id="queue-{QUEUE}">(.*?)</tr>', paused, re.S).group(1)
    assert "paused" in row and "Resume" in row
    row = re.search(rf'<tr id="queue-{QUEUE}">(.*?)</tr>', resumed, re.S).group(1)
    # (active, or "no worker" when this test runs alone: no worker process of an earlier test serves it)
    assert "paused" not in row and "Pause" in row
    assert [a[0] for a in actions(database_url, "queues.pause")][-1] == {"queue": QUEUE}
    assert "queues.pause" in resumed  # recent operator actions, on the overview


def test_the_workers_page_shows_live_and_dead_processes_and_what_each_runs(broker, database_url, dashboard,
                                                                           start_worker):
    import os

    start_worker(queues=[QUEUE], threads=1)
    wait_for(lambda: scalar(database_url, "SELECT count(*) FROM standmeet.worker_processes WHERE id = %s",
                            (broker.worker_id,)), timeout_s=10, what="the worker's registration")
    query(database_url, "INSERT INTO standmeet.worker_processes (id, hostname, pid, queues, heartbeat_at)"
                        " VALUES (gen_random_uuid(), 'gone-host', 4242, '{index}', now() - interval '1 hour')")
    with dashboard() as client:
        page = client.get("/workers").text
    live = re.search(rf'<tr class="alive">(?:(?!</tr>).)*?<td class="n">{os.getpid()}</td>.*?</tr>', page, re.S)
    assert live and "alive" in live.group(0)
    dead = re.search(r'<tr class="dead">(?:(?!</tr>).)*?gone-host.*?</tr>', page, re.S)
    assert dead and ">dead<" in dead.group(0)


def test_the_periodic_page_shows_each_jobs_schedule_last_and_next_run(broker, database_url, dashboard):
    from periodic import PeriodicJob

    query(database_url, "INSERT INTO standmeet.periodic_runs (job, period_start, message_id)"
                        " VALUES ('dash-report', '2026-01-01T10:00:00Z', gen_random_uuid())")
    # Given a job this process declares, and one only a scheduler recorded (a module the
    # dashboard does not load), a cron job in Berlin time
    query(database_url, "INSERT INTO standmeet.periodic_schedules (job, actor, cron, timezone)"
                        " VALUES ('dash-nightly', 'reports.nightly', '0 3 * * *', 'Europe/Berlin')")
    declared = (PeriodicJob("dash-report", "a.b", interval_s=3600.0), PeriodicJob("dash-never", "a.b", interval_s=60))
    with dashboard(periodic_jobs=declared) as client:
        page = client.get("/periodic").text
    report = re.search(r"<td>dash-report</td>(.*?)</tr>", page, re.S).group(1)
    assert "every 3600 s" in report
    # its last run long past: next due in its current period (overdue), not an hour after that run
    current = declared[0].period_start(scalar(database_url, "SELECT now()"))
    assert "2026-01-01 10:00:00 UTC" in report and current.strftime("%Y-%m-%d %H:%M:%S UTC") in report
    never = re.search(r"<td>dash-never</td>(.*?)</tr>", page, re.S).group(1)
    assert "never ran" in never and "every 60 s" in never
    # Then the recorded cron job shows its expression, its zone and its next run there
    nightly = re.search(r"<td>dash-nightly</td>(.*?)</tr>", page, re.S).group(1)
    assert "0 3 * * * (Europe/Berlin)" in nightly
    assert re.search(r"\(\d{4}-\d\d-\d\d 03:00 CES?T\)", nightly), nightly


WEBHOOK_ROWS = """
WITH e AS (
    INSERT INTO standmeet.webhook_endpoints (url, event_types, secrets, failing_since)
    VALUES ('http://127.0.0.1:9/dash-hook', '{order.paid}', '{whsec_dGVzdA==}', now() - interval '1 hour')
    RETURNING id
), ev AS (
    INSERT INTO standmeet.webhook_events (type, payload) VALUES ('order.paid', '{"order": 42}') RETURNING id
), d AS (
    INSERT INTO standmeet.webhook_deliveries (event_id, endpoint_id, state, attempts, last_outcome)
    SELECT ev.id, e.id, 'failed', 1, 'http' FROM e, ev RETURNING id, endpoint_id
), a AS (
    INSERT INTO standmeet.webhook_attempts (delivery_id, attempt, started_at, duration_ms, status_code, outcome, error)
    SELECT d.id, 1, now(), 12, 503, 'http', 'Service Unavailable' FROM d
)
SELECT d.endpoint_id, d.id FROM d
"""


def test_webhooks_show_why_an_endpoint_fails_and_are_disabled_enabled_and_replayed(broker, database_url, dashboard):
    ((endpoint, delivery),) = query(database_url, WEBHOOK_ROWS)
    with dashboard() as client:
        page = client.get("/webhooks").text
        row = re.search(rf'<tr id="endpoint-{endpoint}">(.*?)</tr>', page, re.S).group(1)
        assert "failing" in row and "503" in row and "Service Unavailable" in row
        detail = client.get(f"/webhooks/deliveries/{delivery}").text
        assert "Service Unavailable" in detail and "503" in detail and '"order": 42' not in detail

        assert post(client, f"/webhooks/endpoints/{endpoint}/disable", page="/webhooks").status_code == 303
        assert query(database_url, "SELECT enabled FROM standmeet.webhook_endpoints WHERE id = %s",
                     (endpoint,)) == [(False,)]
        assert post(client, f"/webhooks/endpoints/{endpoint}/enable", page="/webhooks").status_code == 303
        assert query(database_url, "SELECT enabled, failing_since FROM standmeet.webhook_endpoints WHERE id = %s",
                     (endpoint,)) == [(True, None)]

        # replay: as `webhooks replay` does, the delivery back to pending and a delivery
        # message written for it, recorded on the delivery and in the operator's action
        assert post(client, f"/webhooks/deliveries/{delivery}/replay", page="/webhooks").status_code == 303
    assert query(database_url, "SELECT state FROM standmeet.webhook_deliveries WHERE id = %s",
                 (delivery,)) == [("pending",)]
    messages = query(database_url, "SELECT message_id::text, queue_name, \"state\"::text, message->>'actor_name',"
                                   " message->'args' FROM dramatiq.queue"
                                   " WHERE message->>'actor_name' = 'webhook.deliver' AND message->'args'->>0 = %s",
                     (str(delivery),))
    assert [m[1:] for m in messages] == [("webhook", "queued", "webhook.deliver", [delivery])]
    (action,) = [a[0] for a in actions(database_url, "webhooks.replay")][-1:]
    assert action == {"delivery_id": delivery, "message_ids": [messages[0][0]]}
    assert query(database_url, "SELECT message_id::text FROM standmeet.webhook_deliveries WHERE id = %s",
                 (delivery,)) == [(messages[0][0],)]


def test_replay_of_a_finished_delivery_writes_a_new_message_and_leaves_the_old_one_finished(
        broker, database_url, dashboard):
    ((_, delivery),) = query(database_url, WEBHOOK_ROWS)
    message = Message(queue_name="webhook", actor_name="webhook.deliver", args=(delivery,), kwargs={},
                      options={"retries": 7, "traceback": "old"})
    with psycopg.connect(database_url, autocommit=True) as conn:
        enqueue_message(conn, message)
        conn.execute("UPDATE dramatiq.queue SET \"state\" = 'rejected' WHERE message_id = %s", (message.message_id,))
    with dashboard() as client:
        assert post(client, f"/webhooks/deliveries/{delivery}/replay", page="/webhooks").status_code == 303
    rows = query(database_url, "SELECT message_id::text, \"state\"::text, message->'options' FROM dramatiq.queue"
                               " WHERE message->>'actor_name' = 'webhook.deliver' AND message->'args'->>0 = %s"
                               " ORDER BY enqueued_at", (str(delivery),))
    assert [(m, state) for m, state, _ in rows][0] == (message.message_id, "rejected")
    ((new_id, new_state, new_options),) = rows[1:]
    assert new_state == "queued" and "retries" not in new_options and "traceback" not in new_options
    assert query(database_url, "SELECT message_id::text FROM standmeet.webhook_deliveries WHERE id = %s",
                 (delivery,)) == [(new_id,)]


def test_every_state_changing_request_is_a_post_refused_without_a_csrf_token(broker, database_url, dashboard):
    message = OK.send_with_options(args=("csrf",), delay=600_000)
    with dashboard() as client:
        posts = [r for r in client.app.routes if isinstance(r, Route) and "POST" in (r.methods or ())]
        assert len(posts) == 10
        client.get("/")  # the cookie is set; the token is still missing or wrong
        for route in posts:
            path = route.path.replace("{name}", QUEUE).replace("{id}", message.message_id).replace("{id:int}", "1")
            assert client.post(path, data={}).status_code == 403, path
            assert client.post(path, data={CSRF_FIELD: "0" * 64}).status_code == 403, path
        # a token from another browser (another cookie) is refused too
        stolen = csrf_token(client)
        client.cookies.clear()
        assert client.post(f"/jobs/{message.message_id}/cancel", data={CSRF_FIELD: stolen}).status_code == 403
        # and state-changing paths do not answer GET
        assert client.get(f"/jobs/{message.message_id}/cancel").status_code in (404, 405)
    assert state_of(database_url, message.message_id) == "queued"


def test_read_only_mode_hides_every_action_and_refuses_them(broker, database_url, dashboard, start_worker):
    start_worker(queues=[QUEUE], threads=1)
    failed = FAIL.send("read-only")
    settled(database_url, failed.message_id)
    with dashboard(read_only=True) as client:
        pages = [client.get(p).text for p in ("/", f"/jobs/{failed.message_id}", "/jobs?state=rejected", "/webhooks",
                                              "/outbox")]
        assert all('method="post"' not in page for page in pages)
        assert not any(word in page for page in pages for word in (">Retry<", ">Cancel<", ">Pause<", ">Replay<"))
        assert "retry all that match" not in pages[2]
        assert "read-only" in pages[0]
        # even with a valid token (no page carries one here)
        token = client.app.state.csrf.token_for(client.cookies[CSRF_COOKIE])
        refused = client.post(f"/jobs/{failed.message_id}/retry", data={CSRF_FIELD: token})
        assert refused.status_code == 403 and "read-only" in refused.text
        assert client.post("/outbox/retry", data={CSRF_FIELD: token}).status_code == 403
        assert client.get("/jobs/bulk", params={"action": "retry"}).status_code == 403
    assert state_of(database_url, failed.message_id) == "rejected"


def test_with_a_password_every_page_needs_basic_auth(broker, database_url, dashboard):
    good = "Basic " + base64.b64encode(b"admin:s3cret").decode()
    bad = "Basic " + base64.b64encode(b"admin:guess").decode()
    with dashboard(password="s3cret") as client:
        for path in ("/", "/jobs", "/workers", "/periodic", "/outbox", "/webhooks", "/healthz", "/metrics",
                     "/static/dashboard.js"):
            refused = client.get(path)
            assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
            assert client.get(path, headers={"Authorization": bad}).status_code == 401
            assert client.get(path, headers={"Authorization": good}).status_code == 200, path
        client.headers["Authorization"] = good
        assert post(client, f"/queues/{QUEUE}/pause").status_code == 303
        assert post(client, f"/queues/{QUEUE}/resume").status_code == 303
    assert actions(database_url, "queues.resume")[-1][2] == "admin"  # who: the basic-auth user


def test_hidden_arguments_are_never_shown_nor_searched(broker, database_url, dashboard):
    message = OK.send_with_options(args=("secret-token-123",), delay=600_000)
    with dashboard(hide_args=True) as client:
        page = client.get(f"/jobs/{message.message_id}", params={"show": "args"}).text
        search = client.get("/jobs", params={"q": "no-such-text-anywhere", "actor": f"{QUEUE}.ok"}).text
    assert "secret-token-123" not in page and "STANDMEET_DASHBOARD_HIDE_ARGS" in page
    assert message.message_id in search  # the text filter is ignored, not applied


def test_a_queue_with_due_jobs_and_no_live_worker_says_no_worker_not_active(broker, database_url, dashboard):
    from broker.engine import sql_enqueue
    from broker.engine.codec import enqueue_params

    # Given due jobs on a queue no live worker process serves
    messages = [Message(queue_name="dash_unserved", actor_name="dash.none", args=(i,), kwargs={}, options={})
                for i in range(2)]
    query(database_url, sql_enqueue.ENQUEUE, enqueue_params(messages))
    with dashboard() as client:
        page = client.get("/").text
        text = client.get("/metrics").text
    row = re.search(r'<tr id="queue-dash_unserved">(.*?)</tr>', page, re.S)
    assert row, page
    # Then the overview says "no worker", in the colour of a problem, never a green "active"
    assert 'class="state noworker unserved"' in row.group(1) and ">no worker<" in row.group(1)
    assert ">active<" not in row.group(1)
    # and the metrics say it too
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("standmeet_queue_unserved", (("queue_name", "dash_unserved"),))] == 1
    # a queue a live worker serves is active (this process's broker serves the test queues)
    broker.prove_alive()
    query(database_url, "UPDATE standmeet.worker_processes SET queues = queues || '{dash_served}'::text[]"
                        " WHERE id = %s", (broker.worker_id,))
    query(database_url, sql_enqueue.ENQUEUE, enqueue_params(
        [Message(queue_name="dash_served", actor_name="dash.none", args=(0,), kwargs={}, options={})]))
    with dashboard() as client:
        page = client.get("/").text
        text = client.get("/metrics").text
    row = re.search(r'<tr id="queue-dash_served">(.*?)</tr>', page, re.S)
    assert row and ">active<" in row.group(1) and "no worker" not in row.group(1)
    assert 'standmeet_queue_unserved{queue_name="dash_served"} 0.0' in text
    query(database_url, "DELETE FROM dramatiq.queue WHERE queue_name IN ('dash_unserved', 'dash_served')")


def test_the_outbox_page_shows_unrouted_topics_and_failed_events_and_retries_them(broker, database_url, dashboard):
    from broker.engine import sql

    # Given an event of a topic no live process routes, and a failed event of one this process routes
    query(database_url, "DELETE FROM standmeet.outbox")
    query(database_url, sql.EMIT, {"topic": "dash.elsewhere", "payload": "{}", "routes": None})
    (failed_id,) = query(database_url, "INSERT INTO standmeet.outbox (topic, payload, error)"
                                       " VALUES ('test.ping', '{\"label\": \"dash-retried\"}',"
                                       " 'UnknownTopic: no route') RETURNING id")[0]
    with dashboard() as client:
        overview = client.get("/").text
        page = client.get("/outbox").text
        # Then the overview and the outbox page say the topic is routed by no live process
        assert 'id="unrouted-dash.elsewhere"' in overview and "No live process routes" in overview
        assert 'id="unrouted-dash.elsewhere"' in page
        assert re.search(rf'<tr id="event-{failed_id}">.*?state failed.*?UnknownTopic: no route.*?Retry', page, re.S)
        # When an operator retries the failed event
        answer = post(client, "/outbox/retry", {"id": str(failed_id)}, page="/outbox")
        assert answer.status_code == 303 and answer.headers["location"].startswith("/outbox?")
        # Then it is pending again, for a relay that routes it, and the action is recorded
        assert query(database_url, "SELECT error, relayed_at FROM standmeet.outbox WHERE id = %s",
                     (failed_id,)) == [(None, None)]
        assert post(client, "/outbox/retry", {"id": str(failed_id)}).headers["location"].endswith(
            "notice=nothing")
        assert post(client, "/outbox/retry", {"id": "x"}).status_code == 400
    (target, affected, _, source) = actions(database_url, "outbox.retry")[0]
    assert target == {"event_ids": [failed_id]} and affected == 1 and source.startswith("dashboard")
    query(database_url, "DELETE FROM standmeet.outbox")


@pytest.mark.slow  # waits out a real timer of a second or more
def test_healthz_answers_ok_and_every_page_503_without_the_database(broker, database_url, dashboard):
    with dashboard() as client:
        assert client.get("/healthz").json() == {"status": "ok", "database": "ok"}
    with dashboard(database_url="postgresql://postgres@127.0.0.1:1/nowhere", connect_timeout_s=0.5) as client:
        answer = client.get("/healthz")
        page = client.get("/jobs")
    assert answer.status_code == 503 and answer.json()["status"] == "unavailable"
    assert page.status_code == 503 and "the database is unavailable" in page.text


def test_metrics_are_the_database_derived_gauges_in_prometheus_text(broker, database_url, dashboard, start_worker):
    start_worker(queues=[QUEUE], threads=1)
    settled(database_url, FAIL.send("metrics").message_id)
    OK.send_with_options(args=("metrics-later",), delay=600_000)
    with dashboard() as client:
        text = client.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    assert samples[("standmeet_queue_depth", (("queue_name", QUEUE), ("state", "rejected_24h")))] >= 1
    assert samples[("standmeet_queue_depth", (("queue_name", QUEUE), ("state", "delayed")))] >= 1
    assert ("standmeet_oldest_queued_age_seconds", (("queue_name", QUEUE),)) in samples
    assert samples[("standmeet_queue_prefetched", (("queue_name", QUEUE),))] >= 0
    assert samples[("standmeet_workers_alive", ())] >= 1
    assert samples[("standmeet_outbox_lag_seconds", ())] >= 0
    assert samples[("standmeet_database_up", ())] == 1


def test_healthz_answers_503_on_a_database_no_migrate_has_touched(admin_url, dashboard):
    # Given a database that answers but holds no schema (a dashboard started before migrate)
    from broker.dashboard.pages import NO_SCHEMA
    from tests.support import db as testdb

    name = testdb.unique_name("smt_no_schema")
    testdb.query(admin_url, f'CREATE DATABASE "{name}"')
    try:
        with dashboard(database_url=testdb.with_dbname(admin_url, name)) as client:
            answer = client.get("/healthz")
        # Then the probe says so, in one line: no request is sent its way
        assert answer.status_code == 503
        assert answer.json() == {"status": "unavailable", "database": NO_SCHEMA}
    finally:
        testdb.drop_database(admin_url, name)
