"""A page an application declares (``broker.app.page``) is served by the dashboard like its own:
in the navigation with its title, rendering over base.html, its bad input answered 400, its
notice shown after its action. (The application's own templates: the webhook pages' tests.)"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from starlette.testclient import TestClient

from broker import app
from broker.dashboard import DashboardConfig, create_app
from broker.errors import ConfigError


async def answer_page(request: Any) -> Any:
    from broker.dashboard.app import redirect, render, whole_number, with_conn

    if request.query_params.get("done"):
        return redirect("/app-answer", "app-answered")
    n = whole_number("n", request.query_params.get("n", "1"), low=1, high=9)
    (value,) = await with_conn(request, lambda conn: conn.execute("SELECT 40 + %s", (n,)).fetchone())
    return render(request, "not_found.html", {"what": f"the answer {value}"})


@pytest.fixture
def declared() -> Iterator[None]:
    app.page("/app-answer", answer_page, title="Answer")
    app.dashboard_notice("app-answered", "Answered by the application.")
    yield
    app.REGISTRY.pages.pop("GET /app-answer")
    app.REGISTRY.notices.pop("app-answered")


def test_a_declared_page_is_in_the_navigation_served_guarded_and_says_its_notice(broker, database_url, declared):
    with TestClient(create_app(DashboardConfig(database_url=database_url)), base_url="http://127.0.0.1:8420") as client:
        assert '<a href="/app-answer"' in client.get("/").text and ">Answer</a>" in client.get("/").text
        page = client.get("/app-answer?n=2")
        assert page.status_code == 200 and "the answer 42" in page.text  # the template it named, over base.html
        refused = client.get("/app-answer?n=99")
        assert refused.status_code == 400 and "n must be a whole number from 1 to 9" in refused.text
        done = client.get("/app-answer?done=1", follow_redirects=True)
        assert "Answered by the application." in done.text


def test_a_page_declared_twice_differently_is_refused(declared):
    with pytest.raises(ConfigError, match="declared twice"):
        app.page("/app-answer", answer_page, title="Another title")
