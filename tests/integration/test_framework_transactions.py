"""Your web framework's own transaction: a job and an event written with the request's
rows, or not at all.

``enqueue(conn, …)`` and ``emit(conn, …)`` take the psycopg 3 connection the framework's
transaction runs on: Django's ``connection.connection`` inside ``transaction.atomic()``,
SQLAlchemy's ``session.connection().connection.driver_connection``. A commit makes the job
and the event visible with the request's rows (consumers are woken at commit); a rollback
leaves none of them. Each test goes through the real framework against this module's
database.
"""

from __future__ import annotations

from typing import Any

import pytest
from psycopg.conninfo import conninfo_to_dict

from broker import emit, enqueue
from tests.support.db import scalar

django = pytest.importorskip("django", reason="Django is in the test extra")
sqlalchemy = pytest.importorskip("sqlalchemy", reason="SQLAlchemy is in the test extra")

ROWS = "SELECT count(*) FROM test_counters WHERE key = %s"
JOBS = "SELECT count(*) FROM dramatiq.queue WHERE message->'args' = jsonb_build_array(%s::text)"
EVENTS = "SELECT count(*) FROM standmeet.outbox WHERE topic = 'test.crash' AND payload->>'label' = %s"


def _written(url: str, label: str) -> tuple[int, int, int]:
    """The request's row, its job and its event, as counted after the request."""
    return scalar(url, ROWS, (label,)), scalar(url, JOBS, (label,)), scalar(url, EVENTS, (label,))


# -- Django --------------------------------------------------------------------------


def create_document(request: Any) -> Any:
    """A Django view: a row, a job and an event in one ``transaction.atomic()``."""
    from django.db import connection, transaction
    from django.http import JsonResponse

    label = request.GET["label"]
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO test_counters (key, value) VALUES (%s, 1)", [label])
        conn = connection.connection  # the psycopg 3 connection of Django's transaction
        message = enqueue(conn, "test.mark", label)
        emit(conn, "test.crash", {"label": label})
        if request.GET.get("fail"):
            raise RuntimeError("the request failed after enqueueing")
    return JsonResponse({"job": message.message_id})


urlpatterns: list[Any] = []


@pytest.fixture(scope="module")
def django_client(broker, database_url):
    from django.conf import settings
    from django.urls import path

    params = conninfo_to_dict(database_url)
    if not settings.configured:
        settings.configure(
            DEBUG=False, ALLOWED_HOSTS=["testserver"], ROOT_URLCONF=__name__, MIDDLEWARE=[],
            INSTALLED_APPS=[], SECRET_KEY="tests-only",
            DATABASES={"default": {
                "ENGINE": "django.db.backends.postgresql", "NAME": params["dbname"],
                "HOST": params.get("host", ""), "PORT": params.get("port", ""),
                "USER": params.get("user", ""), "PASSWORD": params.get("password", ""),
            }},
        )
        django.setup()
    urlpatterns[:] = [path("documents", create_document)]
    from django.db import connection
    from django.test import Client

    assert settings.DATABASES["default"]["NAME"] == params["dbname"], "Django is bound to another module's database"
    yield Client(raise_request_exception=False)
    connection.close()


def test_a_django_view_inside_atomic_writes_its_row_job_and_event_together(django_client, database_url):
    # When a view enqueues a job and emits an event inside transaction.atomic() and returns
    response = django_client.get("/documents", {"label": "django-commit"})
    # Then the row, the job and the event are all there
    assert response.status_code == 200, response.content
    assert _written(database_url, "django-commit") == (1, 1, 1)
    assert scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s::uuid",
                  (response.json()["job"],)) == "queued"


def test_a_django_view_that_fails_inside_atomic_leaves_no_row_no_job_and_no_event(django_client, database_url):
    # When the view raises after enqueueing and emitting, inside transaction.atomic()
    response = django_client.get("/documents", {"label": "django-rollback", "fail": "1"})
    # Then the request fails and its transaction took the job and the event with it
    assert response.status_code == 500
    assert _written(database_url, "django-rollback") == (0, 0, 0)


# -- SQLAlchemy ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def sqlalchemy_engine(broker, database_url):
    import psycopg
    from sqlalchemy import create_engine

    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(database_url))
    yield engine
    engine.dispose()


def _save_document(engine: Any, label: str, *, fail: bool) -> None:
    from sqlalchemy import text
    from sqlalchemy.orm import Session

    with Session(engine) as session, session.begin():
        session.execute(text("INSERT INTO test_counters (key, value) VALUES (:key, 1)"), {"key": label})
        conn = session.connection().connection.driver_connection  # the session's psycopg 3 connection
        enqueue(conn, "test.mark", label)
        emit(conn, "test.crash", {"label": label})
        if fail:
            raise RuntimeError("the unit of work failed after enqueueing")


def test_a_sqlalchemy_session_commits_its_row_job_and_event_together(sqlalchemy_engine, database_url):
    _save_document(sqlalchemy_engine, "sqlalchemy-commit", fail=False)
    assert _written(database_url, "sqlalchemy-commit") == (1, 1, 1)


def test_a_sqlalchemy_session_rolled_back_leaves_no_row_no_job_and_no_event(sqlalchemy_engine, database_url):
    with pytest.raises(RuntimeError, match="after enqueueing"):
        _save_document(sqlalchemy_engine, "sqlalchemy-rollback", fail=True)
    assert _written(database_url, "sqlalchemy-rollback") == (0, 0, 0)
