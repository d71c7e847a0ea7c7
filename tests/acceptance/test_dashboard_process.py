"""``standmeet-jobs dashboard`` as a real process: where it refuses to listen, what it
serves, and an operator's retry of a failed job in a real headless Chromium while a
real worker process runs the jobs."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium.webdriver.remote.webdriver import WebDriver

from tests.support.db import scalar, wait_for
from tests.support.procs import ROOT, running, worker_cmd

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def dashboard_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "broker.cli", "dashboard", *args]


@pytest.fixture
def dashboard_process(subprocess_env: dict[str, str], tmp_path: Path
                      ) -> Callable[..., AbstractContextManager[str]]:
    """``with dashboard_process("--read-only", env={...}) as base_url:`` a served dashboard."""

    @contextmanager
    def start(*args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1") -> Iterator[str]:
        port = free_port()
        log = tmp_path / f"dashboard-{port}.log"
        with running(dashboard_cmd("--host", host, "--port", str(port), *args), {**subprocess_env, **(env or {})},
                     log=log) as proc:
            base = f"http://127.0.0.1:{port}"

            def up() -> bool:
                assert proc.poll() is None, f"the dashboard exited: {log.read_text()}"
                try:
                    return httpx.get(base + "/healthz", timeout=1).status_code in (200, 401)
                except httpx.TransportError:
                    return False

            wait_for(up, timeout_s=20, interval_s=0.1, what="the dashboard to answer")
            yield base

    return start


def test_a_host_beyond_loopback_without_a_password_refuses_to_start(subprocess_env):
    env = {k: v for k, v in subprocess_env.items() if k != "STANDMEET_DASHBOARD_PASSWORD"}
    result = subprocess.run(dashboard_cmd("--host", "0.0.0.0", "--port", str(free_port())), env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=30)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "STANDMEET_DASHBOARD_PASSWORD" in lines[0], result.stderr


def test_the_command_serves_every_page_and_refuses_a_post_without_a_token(dashboard_process, broker, database_url):
    import tests.support.dashboard_jobs as jobs

    message = jobs.fail_until_retried.send_with_options(args=("served",), delay=600_000)
    with dashboard_process() as base:
        for path in ("/", "/jobs?state=delayed&queue=index&actor=test.fail_until_retried", f"/jobs/{message.message_id}",
                     "/workers", "/periodic", "/webhooks", "/healthz", "/metrics"):
            answer = httpx.get(base + path, timeout=10)
            assert answer.status_code == 200, (path, answer.text)
        assert message.message_id in httpx.get(base + "/jobs?state=delayed&queue=index", timeout=10).text
        assert 'id="retry-job"' in httpx.get(f"{base}/jobs/{message.message_id}", timeout=10).text
        refused = httpx.post(f"{base}/jobs/{message.message_id}/cancel", data={}, timeout=10)
        assert refused.status_code == 403
    assert scalar(database_url, 'SELECT "state"::text FROM dramatiq.queue WHERE message_id = %s',
                  (message.message_id,)) == "queued"


def test_read_only_serves_the_pages_without_any_action(dashboard_process, broker):
    import tests.support.dashboard_jobs as jobs

    message = jobs.fail_until_retried.send_with_options(args=("read-only",), delay=600_000)
    with dashboard_process("--read-only") as base:
        page = httpx.get(f"{base}/jobs/{message.message_id}", timeout=10)
    assert page.status_code == 200 and message.message_id in page.text
    assert 'id="retry-job"' not in page.text and 'method="post"' not in page.text


def test_with_a_password_it_listens_beyond_loopback_behind_basic_auth(dashboard_process):
    with dashboard_process(host="0.0.0.0", env={"STANDMEET_DASHBOARD_PASSWORD": "s3cret"}) as base:
        assert httpx.get(base + "/", timeout=10).status_code == 401
        assert httpx.get(base + "/", auth=("admin", "wrong"), timeout=10).status_code == 401
        assert httpx.get(base + "/", auth=("admin", "s3cret"), timeout=10).status_code == 200


def test_the_served_dashboard_refuses_a_rebound_host_and_a_foreign_post_and_marks_its_cookie_secure_behind_tls(
        dashboard_process, broker, database_url):
    import tests.support.dashboard_jobs as jobs

    message = jobs.fail_until_retried.send_with_options(args=("rebound-secret",), delay=600_000)
    with dashboard_process(env={"STANDMEET_DASHBOARD_ALLOWED_HOSTS": "jobs.example.com"}) as base:
        rebound = httpx.get(f"{base}/jobs/{message.message_id}?show=args", headers={"Host": "attacker.example:8420"},
                            timeout=10)
        proxied = httpx.get(base + "/", headers={"Host": "jobs.example.com", "X-Forwarded-Proto": "https"},
                            timeout=10)
        plain = httpx.get(base + "/", timeout=10)
        token = re.search(r'name="csrf_token" value="([0-9a-f]+)"', plain.text)
        assert token, plain.text
        foreign = httpx.post(f"{base}/jobs/{message.message_id}/cancel", data={"csrf_token": token.group(1)},
                             cookies=plain.cookies, headers={"Origin": "http://attacker.example"}, timeout=10)
    assert rebound.status_code == 400 and "rebound-secret" not in rebound.text
    assert len(rebound.text.strip().splitlines()) == 1 and "STANDMEET_DASHBOARD_ALLOWED_HOSTS" in rebound.text
    # uvicorn trusts X-Forwarded-Proto from loopback: the request came over https
    assert proxied.status_code == 200 and "; secure" in proxied.headers["set-cookie"].lower()
    assert "; secure" not in plain.headers["set-cookie"].lower()
    assert foreign.status_code == 403 and "origin" in foreign.text
    assert scalar(database_url, 'SELECT "state"::text FROM dramatiq.queue WHERE message_id = %s',
                  (message.message_id,)) == "queued"


def test_an_allowed_host_that_is_not_a_host_name_refuses_to_start_in_one_line(subprocess_env):
    env = {**subprocess_env, "STANDMEET_DASHBOARD_ALLOWED_HOSTS": "https://jobs.example.com/"}
    result = subprocess.run(dashboard_cmd("--port", str(free_port())), env=env, cwd=ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "STANDMEET_DASHBOARD_ALLOWED_HOSTS" in lines[0], result.stderr


@pytest.fixture
def chromium(tmp_path: Path) -> Iterator[WebDriver]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        pytest.skip(f"no browser here: {CHROMIUM} and {CHROMEDRIVER} come from Debian's chromium and "
                    "chromium-driver packages (.ci/run installs them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER, log_output=str(tmp_path / "driver.log")),
                              options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


def refreshing_wait(driver: WebDriver, timeout_s: float = 30) -> Any:
    """A wait for pages that refresh their rows in place: an element found a moment ago may
    have been replaced since (Chromium says so as a stale reference, or as a node that "does
    not belong to the document"); the wait looks again instead of failing on it."""
    from selenium.common.exceptions import StaleElementReferenceException, WebDriverException
    from selenium.webdriver.support.ui import WebDriverWait

    class Wait(WebDriverWait):  # type: ignore[type-arg]
        def until(self, method: Any, message: str = "") -> Any:
            def looked_again(d: WebDriver) -> Any:
                try:
                    return method(d)
                except WebDriverException as exc:
                    if isinstance(exc, StaleElementReferenceException) or "does not belong to the document" in str(exc):
                        return False
                    raise
            return super().until(looked_again, message)

    return Wait(driver, timeout_s)


@pytest.mark.slow
def test_an_operator_filters_to_a_failed_job_retries_it_in_a_browser_and_sees_it_done(
        chromium, dashboard_process, broker, database_url, subprocess_env, tmp_path):
    from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.select import Select

    import tests.support.dashboard_jobs as jobs

    driver = chromium
    # the pages refresh their rows in place: an element found a moment ago may have been
    # replaced since, so waits look again instead of failing on it
    wait = refreshing_wait(driver)

    def click(locator: tuple[str, str]) -> None:
        """Click what ``locator`` finds, finding it again if a refresh replaced it first."""
        def clicked(d) -> bool:
            try:
                element = d.find_element(*locator)
                if not (element.is_displayed() and element.is_enabled()):
                    return False
                element.click()
                return True
            except (StaleElementReferenceException, NoSuchElementException):
                return False
        wait.until(clicked)
    with running(worker_cmd("--queues", "index", "--threads", "2", module="tests.support.dashboard_jobs"),
                 subprocess_env, log=tmp_path / "worker.log"), dashboard_process() as base:
        failed = jobs.fail_until_retried.send("browser-retry")
        wait_for(lambda: scalar(database_url, 'SELECT "state"::text FROM dramatiq.queue WHERE message_id = %s',
                                (failed.message_id,)) == "rejected", timeout_s=30, what="the job's first, failing run")

        driver.get(base + "/jobs")
        Select(driver.find_element(By.ID, "filter-state")).select_by_value("rejected")
        driver.find_element(By.ID, "filter-actor").send_keys("test.fail_until_retried")
        driver.find_element(By.ID, "filter-q").send_keys("browser-retry")
        driver.find_element(By.ID, "apply-filters").click()
        wait.until(seen.text_to_be_present_in_element((By.ID, "jobs-total"), "1"))
        assert driver.find_element(By.ID, "jobs-total").text == "1"
        click((By.CSS_SELECTOR, f'tr[data-job-id="{failed.message_id}"] a.job-link'))

        wait.until(seen.text_to_be_present_in_element((By.ID, "job-state"), "rejected"))
        assert "the first run fails" in driver.find_element(By.ID, "job-error").text
        click((By.ID, "retry-job"))

        # the page refreshes itself: no reload, the state turns to done
        wait.until(seen.text_to_be_present_in_element((By.ID, "job-state"), "done"))
        assert "Retry queued." in driver.find_element(By.CSS_SELECTOR, ".notice").text
        driver.save_screenshot(str(tmp_path / "dashboard-job-retried.png"))

        # the list refreshes itself too, in place: a new job shows up, what was typed stays
        driver.get(base + "/jobs?actor=test.fail_until_retried")
        driver.execute_script("window.notReloaded = true;")
        driver.find_element(By.ID, "filter-q").send_keys("half-typed")
        later = jobs.fail_until_retried.send_with_options(args=("arrives-later",), delay=600_000)
        wait.until(seen.presence_of_element_located((By.CSS_SELECTOR, f'tr[data-job-id="{later.message_id}"]')))
        assert driver.execute_script("return window.notReloaded === true;")
        assert driver.find_element(By.ID, "filter-q").get_attribute("value") == "half-typed"
        driver.save_screenshot(str(tmp_path / "dashboard-jobs.png"))

    assert (tmp_path / "dashboard-job-retried.png").stat().st_size > 10_000
    assert scalar(database_url, "SELECT count(*) FROM test_runs WHERE label = 'browser-retry'"
                                " AND finished_at IS NOT NULL") == 1
