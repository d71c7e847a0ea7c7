"""The dashboard against hostile requests, through Starlette's test client and this
module's real database: foreign hosts (DNS rebinding), foreign origins, edge values in
every parameter, arguments nested too deep, unknown queues, hidden nested arguments, and
markup in what jobs, queues and actors say."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import dramatiq
import pytest
from dramatiq.message import Message
from starlette.testclient import TestClient

from broker.dashboard import DashboardConfig, create_app
from broker.dashboard.app import CUT_MARKER
from broker.dashboard.security import CSRF_COOKIE, CSRF_FIELD
from broker.ops.redact import HIDDEN
from tests.support.db import query, scalar

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

QUEUE = "dash_hostile"
BASE = "http://127.0.0.1:8420"
TOKEN = re.compile(rf'name="{CSRF_FIELD}" value="([0-9a-f]+)"')


def _noop(*args: object, **kwargs: object) -> None:
    """Never run: the jobs here wait, delayed, to be looked at."""


NOOP = dramatiq.actor(_noop, actor_name=f"{QUEUE}.noop", queue_name=QUEUE, max_retries=0)

#: The message a job's row is turned into by hand (the broker would never write these).
SET_ARGS = "UPDATE dramatiq.queue SET message = jsonb_set(message, '{args}', %s::jsonb) WHERE message_id = %s"
DEEP_ARGS = "SELECT repeat('[', 10000) || '\"deep-leaf\"' || repeat(']', 10000)"
SET_FAILED = ("UPDATE dramatiq.queue SET \"state\" = 'rejected', error = %(error)s, queue_name = %(queue)s,"
              " message = jsonb_set(jsonb_set(message, '{actor_name}', to_jsonb(%(actor)s::text)),"
              " '{queue_name}', to_jsonb(%(queue)s::text)) WHERE message_id = %(id)s")
PAUSED = "SELECT count(*) FROM standmeet.queue_pauses WHERE queue_name = %s"
ACTIONS = "SELECT count(*) FROM standmeet.operator_actions WHERE action = %s"


@pytest.fixture
def dashboard(database_url: str) -> Callable[..., Iterator[TestClient]]:
    """``with dashboard(base_url=…, **config) as client:`` a client of a fresh app."""

    @contextmanager
    def open_dashboard(base_url: str = BASE, **overrides: object) -> Iterator[TestClient]:
        config = replace(DashboardConfig(database_url=database_url, queues=(QUEUE,)), **overrides)
        with TestClient(create_app(config), base_url=base_url, raise_server_exceptions=False) as client:
            yield client

    return open_dashboard  # type: ignore[return-value]


def token_of(client: TestClient) -> str:
    page = client.get("/")
    match = TOKEN.search(page.text)
    assert match, page.text
    return match.group(1)


def one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def delayed_job(*args: object, **options: object) -> Message:
    return NOOP.send_with_options(args=args, delay=600_000, **options)


# -- 1. the hosts it answers to ---------------------------------------------------------

def test_a_request_naming_another_host_is_refused_before_it_reads_anything(broker, dashboard):
    job = delayed_job("rebound-secret")
    with dashboard() as client:
        answer = client.get(f"/jobs/{job.message_id}", params={"show": "args"},
                            headers={"Host": "attacker.example:8420"})
        own = client.get(f"/jobs/{job.message_id}", params={"show": "args"})
    assert answer.status_code == 400
    line = one_line(answer.text)
    assert "attacker.example:8420" in line and "STANDMEET_DASHBOARD_ALLOWED_HOSTS" in line
    assert "rebound-secret" not in answer.text
    assert own.status_code == 200 and "rebound-secret" in own.text


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:8420", "localhost", "LOCALHOST:8420", "localhost.",
                                  "[::1]", "[::1]:8420", "127.0.0.1:9000"])
def test_a_loopback_dashboard_answers_to_every_loopback_name_and_port(broker, dashboard, host):
    with dashboard() as client:
        assert client.get("/", headers={"Host": host}).status_code == 200


@pytest.mark.parametrize("host", ["attacker.example", "127.0.0.1.attacker.example", "localhost:80:80",
                                  "127.0.0.1:99999", "[::1", "", "10.0.0.5"])
def test_a_loopback_dashboard_refuses_every_other_host(broker, dashboard, host):
    with dashboard() as client:
        answer = client.get("/healthz", headers={"Host": host})
    assert answer.status_code == 400 and "STANDMEET_DASHBOARD_ALLOWED_HOSTS" in one_line(answer.text)


def test_a_reverse_proxys_name_is_answered_once_allowed(broker, dashboard):
    with dashboard(allowed_hosts=("jobs.example.com",)) as client:
        assert client.get("/", headers={"Host": "jobs.example.com"}).status_code == 200
        assert client.get("/", headers={"Host": "Jobs.Example.com:443"}).status_code == 200
        assert client.get("/", headers={"Host": "evil.example.com"}).status_code == 400


def test_a_dashboard_bound_to_one_address_answers_to_it_and_not_to_loopback_names(broker, dashboard):
    with dashboard(base_url="http://10.1.2.3:8420", bind_host="10.1.2.3", password="pw") as client:
        auth = ("admin", "pw")
        assert client.get("/healthz", auth=auth).status_code == 200
        assert client.get("/healthz", auth=auth, headers={"Host": "localhost:8420"}).status_code == 400


# -- 2. POSTs from another origin -------------------------------------------------------

def test_a_post_with_a_forged_host_and_origin_does_not_pause_a_queue(broker, database_url, dashboard):
    with dashboard() as client:
        token = token_of(client)
        answer = client.post(f"/queues/{QUEUE}/pause", data={CSRF_FIELD: token}, follow_redirects=False,
                             headers={"Host": "attacker.example", "Origin": "http://attacker.example"})
    assert answer.status_code in (400, 403), answer.text
    assert scalar(database_url, PAUSED, (QUEUE,)) == 0


@pytest.mark.parametrize("headers", [
    {"Origin": "http://attacker.example"},
    {"Origin": "http://127.0.0.1:8421"},    # another port: another origin
    {"Origin": "https://127.0.0.1:8420"},   # another scheme
    {"Origin": "null"},
    {"Sec-Fetch-Site": "cross-site"},
    {"Sec-Fetch-Site": "same-site"},
])
def test_a_post_from_another_origin_is_refused_even_with_a_valid_token(broker, database_url, dashboard, headers):
    with dashboard() as client:
        token = token_of(client)
        answer = client.post(f"/queues/{QUEUE}/pause", data={CSRF_FIELD: token}, headers=headers,
                             follow_redirects=False)
    assert answer.status_code == 403
    assert "refused a POST" in one_line(answer.text)
    assert scalar(database_url, PAUSED, (QUEUE,)) == 0


@pytest.mark.parametrize("headers", [{}, {"Origin": BASE}, {"Origin": "http://127.0.0.1:8420"},
                                     {"Sec-Fetch-Site": "same-origin"}])
def test_a_post_from_its_own_pages_or_without_origin_acts_on_its_token(broker, database_url, dashboard, headers):
    with dashboard() as client:
        token = token_of(client)
        paused = client.post(f"/queues/{QUEUE}/pause", data={CSRF_FIELD: token}, headers=headers,
                             follow_redirects=False)
        resumed = client.post(f"/queues/{QUEUE}/resume", data={CSRF_FIELD: token}, headers=headers,
                              follow_redirects=False)
    assert paused.status_code == 303 and "notice=paused" in paused.headers["location"]
    assert resumed.status_code == 303 and "notice=resumed" in resumed.headers["location"]


# -- 3. the cookie is Secure behind TLS ---------------------------------------------------

@pytest.mark.parametrize(("mode", "base_url", "secure"), [
    ("auto", "https://127.0.0.1:8420", True), ("auto", BASE, False),
    ("on", BASE, True), ("off", "https://127.0.0.1:8420", False),
])
def test_the_cookie_is_secure_as_the_setting_and_the_scheme_say(broker, dashboard, mode, base_url, secure):
    with dashboard(base_url=base_url, secure_cookie=mode) as client:
        cookie = client.get("/").headers["set-cookie"]
    assert cookie.startswith(f"{CSRF_COOKIE}=") and "samesite=strict" in cookie.lower()
    assert ("; secure" in cookie.lower()) is secure, cookie


# -- 4. edge values: 400 with the reason, never a 500 -------------------------------------

@pytest.mark.parametrize(("path", "says"), [
    ("/jobs?since=99999999999d", "since"),
    ("/jobs?since=" + "9" * 400 + "d", "since"),
    ("/jobs?page=99999999999999999999", "page"),
    ("/jobs?page=9223372036854775807", "page"),
    ("/jobs?page=0", "page"),
    ("/jobs?page=-3", "page"),
    ("/jobs?page=abc", "page"),
    ("/jobs?id=not-hex!", "job id"),
    ("/jobs?actor=a%00b", "actor"),
    ("/jobs?queue=" + "q" * 600, "queue"),
    ("/jobs/not-a-uuid", "job id"),
    ("/jobs/123e4567-e89b-12d3-a456-426614174000?show=everything", "show"),
    ("/webhooks?endpoint=99999999999999999999", "endpoint"),
    ("/webhooks?endpoint=%C2%B2", "endpoint"),
    ("/webhooks?endpoint=-1", "endpoint"),
    ("/webhooks/deliveries/99999999999999999999", "delivery id"),
    ("/outbox?state=everything", "state"),
    ("/outbox?topic=a%00b", "topic"),
])
def test_every_parameter_out_of_range_gets_400_with_the_reason(broker, dashboard, path, says):
    with dashboard() as client:
        answer = client.get(path)
    assert answer.status_code == 400, (path, answer.status_code, answer.text[-300:])
    if answer.headers["content-type"].startswith("text/plain"):
        assert says in one_line(answer.text)
    else:  # the jobs list says it above its form
        match = re.search(r'id="filter-error">([^<]*)<', answer.text)
        assert match and says in match.group(1), answer.text[-500:]


@pytest.mark.parametrize(("path", "data", "says"), [
    ("/webhooks/endpoints/99999999999999999999/disable", {}, "endpoint id"),
    ("/webhooks/deliveries/99999999999999999999/replay", {}, "delivery id"),
    ("/outbox/retry", {"id": "99999999999999999999"}, "id"),
    ("/jobs/bulk", {"action": "cancel", "since": "99999999999d"}, "since"),
])
def test_every_action_parameter_out_of_range_gets_400_with_the_reason(broker, dashboard, path, data, says):
    with dashboard() as client:
        answer = client.post(path, data={**data, CSRF_FIELD: token_of(client)}, follow_redirects=False)
    assert answer.status_code == 400 and says in one_line(answer.text), answer.text


def test_arguments_nested_ten_thousand_levels_deep_show_cut_on_the_job_page(broker, database_url, dashboard):
    job = delayed_job("shallow")
    deep = scalar(database_url, DEEP_ARGS)
    query(database_url, SET_ARGS, (deep, job.message_id))
    with dashboard() as client:
        page = client.get(f"/jobs/{job.message_id}")
        shown = client.get(f"/jobs/{job.message_id}", params={"show": "args"})
    assert page.status_code == 200 and shown.status_code == 200, shown.text[-500:]
    assert CUT_MARKER in shown.text and "deep-leaf" not in shown.text


@pytest.mark.parametrize("name", ["<script>", "x" * 300, "no_such_queue"])
def test_a_queue_the_runtime_does_not_know_is_neither_paused_nor_resumed(broker, database_url, dashboard, name):
    with dashboard() as client:
        token = token_of(client)
        paused = client.post(f"/queues/{name}/pause", data={CSRF_FIELD: token}, follow_redirects=False)
        resumed = client.post(f"/queues/{name}/resume", data={CSRF_FIELD: token}, follow_redirects=False)
    for answer in (paused, resumed):
        assert answer.status_code == 404 and "unknown queue" in one_line(answer.text), answer.text
        assert QUEUE in answer.text  # it says which queues it knows
    assert scalar(database_url, PAUSED, (name,)) == 0


# -- 5. hidden means hidden ---------------------------------------------------------------

def test_hidden_arguments_stay_hidden_in_the_messages_a_job_carries(broker, dashboard):
    nxt = NOOP.message("next-step-secret", token="next-kw-secret")
    callback = NOOP.message("callback-secret")
    job = delayed_job("own-secret", pipe_target=nxt.asdict(), group_completion_uuid="g-1",
                      group_completion_callbacks=[callback.asdict()],
                      custom={"nested": {"args": ["custom-secret"], "actor_name": "x"}})
    with dashboard(hide_args=True) as client:
        page = client.get(f"/jobs/{job.message_id}", params={"show": "args"}).text
    options = re.search(r'<pre id="job-options">(.*?)</pre>', page, re.S)
    assert options, page
    for secret in ("own-secret", "next-step-secret", "next-kw-secret", "callback-secret", "custom-secret"):
        assert secret not in page, secret
    assert HIDDEN in options.group(1) and nxt.message_id in options.group(1)  # what runs next still shows
    with dashboard() as client:  # and without hiding, all of it is there
        shown = client.get(f"/jobs/{job.message_id}").text
    assert "next-step-secret" in shown and "callback-secret" in shown


def test_a_search_in_hidden_arguments_is_neither_applied_nor_echoed(broker, dashboard):
    delayed_job("searched-secret")
    with dashboard(hide_args=True) as client:
        page = client.get("/jobs", params={"q": "searched-secret", "queue": QUEUE})
        confirm = client.get("/jobs/bulk", params={"q": "searched-secret", "queue": QUEUE, "action": "cancel"})
    assert page.status_code == 200 and confirm.status_code == 200
    assert "searched-secret" not in page.text and "searched-secret" not in confirm.text


# -- 6. text is text ----------------------------------------------------------------------

def test_what_a_job_its_queue_and_its_actor_say_is_shown_as_text(broker, database_url, dashboard):
    job = delayed_job("markup")
    error = "bad path [/etc] [link=http://x]y[/link] <script>alert(1)</script>"
    query(database_url, SET_FAILED, {"error": error, "queue": "<b>q</b>", "actor": "<i>actor</i>",
                                     "id": job.message_id})
    try:
        with dashboard() as client:
            listed = client.get("/jobs", params={"id": job.message_id}).text
            page = client.get(f"/jobs/{job.message_id}").text
        for text in (listed, page):
            assert "bad path [/etc] [link=http://x]y[/link] &lt;script&gt;alert(1)&lt;/script&gt;" in text
            assert "&lt;b&gt;q&lt;/b&gt;" in text and "&lt;i&gt;actor&lt;/i&gt;" in text
            assert "<script>alert" not in text and "<b>q</b>" not in text and "<i>actor</i>" not in text
    finally:
        query(database_url, "DELETE FROM dramatiq.queue WHERE message_id = %s", (job.message_id,))

