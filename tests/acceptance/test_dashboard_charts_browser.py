"""The history charts, a job's attempts and row selection in a real headless Chromium,
against a real ``standmeet-jobs dashboard`` process and a real worker process."""

from __future__ import annotations

from tests.acceptance.test_dashboard_process import chromium, dashboard_process, refreshing_wait  # noqa: F401  (fixtures)
from tests.support.db import scalar, wait_for
from tests.support.procs import running, worker_cmd

FINAL = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state IN ('done', 'rejected')"
DONE = "SELECT count(*) FROM dramatiq.queue WHERE message_id = ANY(%s::uuid[]) AND state = 'done'"


def test_after_a_drain_with_failures_the_history_charts_show_them_and_the_job_page_lists_its_attempts(
        chromium, dashboard_process, broker, database_url, subprocess_env, tmp_path):  # noqa: F811
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen

    import tests.support.dashboard_jobs as dashboard_jobs
    import tests.support.jobs as jobs

    driver = chromium
    wait = refreshing_wait(driver)
    with running(worker_cmd("--queues", "index", "--threads", "2", module="tests.support.dashboard_jobs"),
                 subprocess_env, log=tmp_path / "worker.log"), dashboard_process() as base:
        # Given a drain: five jobs done, three rejected, one done after a failed run
        done = [jobs.noop.send(f"charts-{i}") for i in range(5)]
        rejected = [dashboard_jobs.fail_until_retried.send(f"charts-rejected-{i}") for i in range(3)]
        flaky = jobs.raise_once.send("charts-flaky")
        ids = [m.message_id for m in [*done, *rejected, flaky]]
        wait_for(lambda: scalar(database_url, FINAL, (ids,)) == len(ids), timeout_s=60, what="the drain")

        # When an operator opens the queue's history
        driver.get(base + "/history?queue=index&window=1h")
        throughput = wait.until(seen.presence_of_element_located(
            (By.CSS_SELECTOR, "svg#chart-0-throughput polyline[data-series='done']")))
        failures = driver.find_element(By.CSS_SELECTOR, "svg#chart-0-failures polyline[data-series='failures']")
        # Then the throughput series counts the six jobs done, the failures series the four failed runs
        done_values = [float(v) for v in throughput.get_attribute("data-values").split(",")]
        failure_values = [float(v) for v in failures.get_attribute("data-values").split(",")]
        assert sum(done_values) == 6 and len(done_values) == 61
        assert sum(failure_values) == 4 and max(failure_values) > 0
        # drawn: the charts take room on the page, their titles and units are there to read
        chart = driver.find_element(By.ID, "chart-0-failures")
        assert chart.size["width"] > 300 and chart.size["height"] > 80
        assert chart.get_attribute("role") == "img"
        title = driver.find_element(By.ID, "chart-0-failures-title")
        assert title.get_attribute("textContent") == "Failures of index, last hour"
        labels = [t.get_attribute("textContent") for t in chart.find_elements(By.CSS_SELECTOR, "text.axis-label")]
        assert labels == ["runs per minute", "time (UTC), one point per minute"]
        legend = chart.find_element(By.CSS_SELECTOR, "g.legend-item[data-series='failures'] text")
        assert legend.get_attribute("textContent").startswith("failed + rejected + crashed (peak ")
        driver.save_screenshot(str(tmp_path / "dashboard-history.png"))

        # and the flaky job's page lists both its attempts, the failed one with its error
        driver.get(f"{base}/jobs/{flaky.message_id}")
        rows = wait.until(seen.presence_of_all_elements_located((By.CSS_SELECTOR, "#job-attempts tr.attempt")))
        assert [r.get_attribute("data-outcome") for r in rows] == ["failed", "done"]
        assert "RuntimeError" in rows[0].find_element(By.CSS_SELECTOR, "td.error").text
        assert rows[1].find_element(By.CSS_SELECTOR, "td.error").text == ""
        assert "(start to end)" in driver.find_element(By.ID, "job-last-run").text

        # When the operator selects every rejected job on the list and retries them
        driver.get(base + "/jobs?state=rejected&queue=index")
        wait.until(seen.text_to_be_present_in_element((By.ID, "jobs-total"), "3"))
        driver.find_element(By.ID, "select-all").click()
        boxes = driver.find_elements(By.CSS_SELECTOR, "#jobs-table input.select-row")
        assert len(boxes) == 3 and all(box.is_selected() for box in boxes)
        driver.find_element(By.ID, "retry-selected").click()
        # Then they run again, and succeed (their second run does)
        wait_for(lambda: scalar(database_url, DONE, ([m.message_id for m in rejected],)) == 3, timeout_s=30,
                 what="the selected jobs to run again")
        assert "queued again" in driver.find_element(By.CSS_SELECTOR, ".notice").text
    assert (tmp_path / "dashboard-history.png").stat().st_size > 10_000
