"""An async web app's own transaction: ``await enqueue_async(aconn, …)`` and ``await
emit_async(aconn, …)`` write a job and an event with the request's rows, or not at all.

Each test goes through a real Starlette app (its TestClient runs the ASGI app on an event
loop of its own) whose endpoint opens a psycopg ``AsyncConnection`` transaction. A
commit makes the job and the event visible with the request's row, and wakes the queue's
consumers then; a rollback leaves none of them; a refused message leaves the transaction
usable, as the sync forms do.
"""

from __future__ import annotations

import psycopg
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from broker import emit_async, enqueue_async
from broker.errors import InvalidMessage
from tests.support import unique_jobs
from tests.support.db import scalar

ROWS = "SELECT count(*) FROM test_counters WHERE key = %s"
JOBS = "SELECT count(*) FROM dramatiq.queue WHERE message->'args' = jsonb_build_array(%s::text)"
EVENTS = "SELECT count(*) FROM standmeet.outbox WHERE topic = 'test.crash' AND payload->>'label' = %s"


def _written(url: str, label: str) -> tuple[int, int, int]:
    """The request's row, its job and its event, as counted after the request."""
    return scalar(url, ROWS, (label,)), scalar(url, JOBS, (label,)), scalar(url, EVENTS, (label,))


def make_app(database_url: str) -> Starlette:
    async def create_document(request: Request) -> JSONResponse:
        label = request.query_params["label"]
        async with await psycopg.AsyncConnection.connect(database_url) as aconn:
            async with aconn.transaction():
                await aconn.execute("INSERT INTO test_counters (key, value) VALUES (%s, 1)", (label,))
                if request.query_params.get("refused"):  # a refused message leaves the transaction usable
                    with pytest.raises(InvalidMessage):
                        await enqueue_async(aconn, "test.mark", float("nan"))
                message = await enqueue_async(aconn, "test.mark", label)
                event_id = await emit_async(aconn, "test.crash", {"label": label})
                if request.query_params.get("fail"):
                    raise RuntimeError("the request failed after enqueueing")
        return JSONResponse({"job": message.message_id, "event": event_id})

    async def unique_document(request: Request) -> JSONResponse:
        label = request.query_params["label"]
        async with await psycopg.AsyncConnection.connect(database_url) as aconn:
            async with aconn.transaction():
                message = await enqueue_async(aconn, unique_jobs.unique, label)
        return JSONResponse({"job": message.message_id})

    return Starlette(routes=[Route("/documents", create_document, methods=["POST"]),
                             Route("/unique", unique_document, methods=["POST"])])


@pytest.fixture(scope="module")
def client(broker, database_url):
    with TestClient(make_app(database_url), raise_server_exceptions=False) as test_client:
        yield test_client


def test_an_async_endpoint_writes_its_row_job_and_event_together_and_wakes_consumers_at_commit(
        client, database_url):
    with psycopg.connect(database_url, autocommit=True) as listener:
        listener.execute('LISTEN "dramatiq.index.enqueue"')
        # When the endpoint enqueues and emits inside its AsyncConnection transaction
        response = client.post("/documents", params={"label": "async-commit"})
        woken = [n.channel for n in listener.notifies(timeout=5, stop_after=1)]
    # Then the row, the job and the event are all there, and the queue was woken
    assert response.status_code == 200, response.text
    assert _written(database_url, "async-commit") == (1, 1, 1)
    assert scalar(database_url, "SELECT state::text FROM dramatiq.queue WHERE message_id = %s::uuid",
                  (response.json()["job"],)) == "queued"
    assert woken == ["dramatiq.index.enqueue"]


def test_a_failing_async_request_rolls_back_its_row_job_and_event(client, database_url):
    # When the endpoint raises after enqueueing and emitting
    response = client.post("/documents", params={"label": "async-rollback", "fail": "1"})
    # Then the request failed, and its rollback took the job and the event with it
    assert response.status_code == 500
    assert _written(database_url, "async-rollback") == (0, 0, 0)


def test_a_refused_message_leaves_the_async_transaction_usable(client, database_url):
    # When the endpoint's first enqueue is refused (NaN), then it goes on and commits
    response = client.post("/documents", params={"label": "async-refused", "refused": "1"})
    # Then everything else it wrote is there
    assert response.status_code == 200, response.text
    assert _written(database_url, "async-refused") == (1, 1, 1)


def test_an_async_send_of_a_live_unique_key_returns_the_live_message(client, database_url):
    # When two requests send the same unique call
    first = client.post("/unique", params={"label": "async-unique"}).json()["job"]
    second = client.post("/unique", params={"label": "async-unique"}).json()["job"]
    # Then the second got the first's message, and the skip was counted
    assert second == first
    assert scalar(database_url, JOBS, ("async-unique",)) == 1
    assert scalar(database_url, "SELECT skipped FROM standmeet.unique_skips WHERE actor_name = 'test.unique'") >= 1
